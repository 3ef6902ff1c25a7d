"""Block-scaled FP8 checkpoints, as DeepSeek-V3 and the GLM-4.5 FP8 releases ship them, dequantized at load.

Such a checkpoint's config.json carries ``quantization_config: {"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [128, 128]}``; each quantized weight ``W`` (a matrix,
or a stack of them such as ``mlp.experts.gate_up_proj [E, R, C]``) is stored as ``float8_e4m3fn`` beside
``W_scale_inv`` (``...weight`` -> ``...weight_scale_inv``), float32 of shape ``[..., ceil(R / b0), ceil(C / b1)]``
for the block ``(b0, b1)``. Its value is ``fp8.float() * scale_inv`` in float32, each scale covering one
``b0 x b1`` block (the last row and column of blocks partial where R or C is not a multiple of the block).
The weights left unquantized (embeddings, lm_head, norms, routers, what ``modules_to_not_convert`` names)
are stored in a float dtype without a scale and load as any other.

Everything else quantized is refused in one line naming the config key or the tensor: another
``quant_method``, ``fmt`` or ``activation_scheme``, per-tensor scales (no ``weight_block_size``), a float8
tensor without its scale, a scale whose shape is not its weight's block grid, integer-coded weights.
"""

from __future__ import annotations

import math
from typing import Dict, Mapping, Optional, Tuple

import torch

from mtpctl.errors import CorruptModel, UnsupportedModel
from mtpctl.model.mxfp4 import is_mxfp4

FP8 = torch.float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"
FLOAT8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                            "float8_e8m0fnu") if hasattr(torch, n))


def block_of(config: Mapping) -> Optional[Tuple[int, int]]:
    """The weight block ``(rows, cols)`` of a config.json's block-scaled FP8 ``quantization_config``;
    None without a ``quantization_config``.

    Raises:
        UnsupportedModel: a quantization other than block-scaled, dynamic-activation e4m3 FP8.
        CorruptModel: a ``quantization_config`` or ``weight_block_size`` of the wrong type.
    """
    qc = config.get("quantization_config")
    if qc is None or is_mxfp4(config):  # MXFP4 experts: mtpctl.model.mxfp4
        return None
    if not isinstance(qc, dict):
        raise CorruptModel("config.json: quantization_config is not a JSON object")
    for key, default, allowed in (("quant_method", None, ("fp8",)), ("fmt", "e4m3", ("e4m3",)),
                                  ("activation_scheme", "dynamic", ("dynamic",)),
                                  ("scale_fmt", "float", ("float", "ue8m0")), ("expert_dtype", "fp8", ("fp8",))):
        value = qc.get(key, default)
        if value not in allowed:
            raise UnsupportedModel(f"config.json: quantization_config {key} {value!r} is not supported (mtpctl "
                                   "loads block-scaled FP8 only: quant_method 'fp8', fmt 'e4m3', activation_scheme "
                                   "'dynamic', weight_block_size)")
    block = qc.get("weight_block_size")
    if block is None:
        raise UnsupportedModel("config.json: quantization_config has no weight_block_size: per-tensor FP8 scales "
                               "are not supported (block-scaled FP8 only)")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise CorruptModel(f"config.json: quantization_config weight_block_size {block!r} is not two positive integers")
    return int(block[0]), int(block[1])


def scale_grid(shape: Tuple[int, ...], block: Tuple[int, int]) -> Tuple[int, ...]:
    """The shape of the scale of a weight of ``shape`` (``[..., R, C]``) in blocks ``block``."""
    return tuple(shape[:-2]) + (math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1]))


def pair_scales(shapes: Mapping[str, Tuple[int, ...]], dtypes: Mapping[str, torch.dtype],
                block: Optional[Tuple[int, int]], source: str) -> Dict[str, str]:
    """Each block-scaled FP8 weight of a checkpoint (name -> shape, name -> dtype) -> its scale's name,
    every tensor checked: a scale beside a float8_e4m3fn weight of at least two dims, float32, of its
    block grid's shape; no other float8 tensor, no weight of an integer dtype.

    Raises:
        CorruptModel: a scale without its weight, of the wrong shape, beside a weight that is not
            float8_e4m3fn; a float8_e4m3fn weight without its scale.
        UnsupportedModel: scales without a ``quantization_config``; a scale not float32; a tensor of
            another float8, or a weight of an integer dtype (another quantization).
    """
    pairs = {}
    for scale in sorted(n for n in shapes if n.endswith(SCALE_SUFFIX)):
        weight = scale[:-len(SCALE_SUFFIX)]
        pairs[weight] = scale
        _check_pair(weight, scale, shapes, dtypes, block, source)
    for name in shapes:
        if name not in pairs and not name.endswith(SCALE_SUFFIX):
            _check_plain(name, dtypes[name], source)
    return pairs


def _check_pair(weight: str, scale: str, shapes, dtypes, block, source: str) -> None:
    if block is None:
        raise UnsupportedModel(f"{source}: tensor {scale!r} is a block scale, but config.json has no "
                               "quantization_config (quant_method 'fp8', weight_block_size)")
    if weight not in shapes:
        raise CorruptModel(f"{source}: scale {scale!r} has no weight {weight!r}")
    if dtypes[weight] != FP8:
        raise CorruptModel(f"{source}: tensor {weight!r} has a scale {scale!r} but dtype "
                           f"{str(dtypes[weight]).removeprefix('torch.')}, not float8_e4m3fn")
    if dtypes[scale] != torch.float32:
        raise UnsupportedModel(f"{source}: scale {scale!r} has dtype {str(dtypes[scale]).removeprefix('torch.')}; "
                               "mtpctl reads float32 block scales only")
    if len(shapes[weight]) < 2:
        raise CorruptModel(f"{source}: FP8 tensor {weight!r} has shape {tuple(shapes[weight])}; block scales "
                           "apply to matrices")
    grid = scale_grid(tuple(shapes[weight]), block)
    if tuple(shapes[scale]) != grid:
        raise CorruptModel(f"{source}: scale {scale!r} has shape {tuple(shapes[scale])}, expected {grid} "
                           f"({list(block)} blocks of {weight!r} {tuple(shapes[weight])})")


def _check_plain(name: str, dtype: torch.dtype, source: str) -> None:
    """Refuse a tensor without a scale that is a float8 one, or a ``.weight`` of an integer dtype (integer
    index tensors, such as a draft vocabulary's ``token_map``, are data, not weights)."""
    if dtype == FP8:
        raise CorruptModel(f"{source}: tensor {name!r} is float8_e4m3fn without its scale {name + SCALE_SUFFIX!r}")
    if dtype in FLOAT8 or (name.endswith("weight") and not dtype.is_floating_point):
        raise UnsupportedModel(f"{source}: tensor {name!r} has dtype {str(dtype).removeprefix('torch.')}: quantized "
                               "weights other than block-scaled float8_e4m3fn are not supported")


def dequantize(codes: torch.Tensor, scale: torch.Tensor, block: Tuple[int, int]) -> torch.Tensor:
    """float32 values of FP8 ``codes [R, C]`` whose block scales are ``scale [ceil(R/b0), ceil(C/b1)]``:
    ``codes.float() * scale`` of each one's block (edge blocks partial)."""
    rows, cols = codes.shape
    expanded = scale.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return codes.float() * expanded


def dequantize_stack(codes: torch.Tensor, scale: torch.Tensor, block: Tuple[int, int]) -> torch.Tensor:
    """float32 values of FP8 ``codes [..., R, C]`` (a matrix or a stack of them) with block scales
    ``scale [..., ceil(R/b0), ceil(C/b1)]``, matrix by matrix (:func:`dequantize`)."""
    rows, cols = codes.shape[-2:]
    mats, scales = codes.reshape(-1, rows, cols), scale.reshape(-1, *scale.shape[-2:])
    return torch.stack([dequantize(m, s, block) for m, s in zip(mats, scales)]).view(codes.shape)
