"""MXFP4 expert weights, dequantized at load (gpt-oss as published).

Such a checkpoint's config.json carries ``quantization_config: {"quant_method": "mxfp4", ...}`` and
stores a stack of expert matrices ``W`` (as the model holds it, ``[E, C, R]``) as two uint8 tensors
(the OCP Microscaling format's FP4 E2M1 values in blocks of 32 with an E8M0 scale each):

- ``W_blocks [E, R, G, 16]``: each byte two FP4 codes, the low nibble the even value, the high nibble
  the odd one; code ``c`` is ``FP4_VALUES[c]`` (sign bit 3, then 2 exponent and 1 mantissa bits);
- ``W_scales [E, R, G]``: each block's power of two, ``2 ** (s - 127)``.

A row of ``R`` has ``G * 32`` values; the model's matrix is the transpose, ``W[e] = values[e].T``
(``[G * 32, R]``), as transformers' gpt-oss reads them. :class:`~mtpctl.model.weights.CheckpointReader`
reads such a pair as one float32 tensor ``W``, an expert at a time (:func:`dequantize`).
"""

from __future__ import annotations

from typing import Dict, Mapping, Tuple

import torch

from mtpctl.errors import CorruptModel, UnsupportedModel

BLOCKS, SCALES = "_blocks", "_scales"
#: the value of each FP4 E2M1 code
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: the E8M0 scale's exponent bias
SCALE_BIAS = 127


def is_mxfp4(config: Mapping) -> bool:
    """Whether config.json's ``quantization_config`` names MXFP4 (``quant_method "mxfp4"``)."""
    qc = config.get("quantization_config")
    return isinstance(qc, dict) and qc.get("quant_method") == "mxfp4"


def value_shape(blocks: Tuple[int, ...]) -> Tuple[int, ...]:
    """The shape of the model's stack of a ``W_blocks [E, R, G, 16]``: ``[E, G * 32, R]``."""
    e, r, g, _ = blocks
    return e, g * 32, r


def pair_blocks(shapes: Mapping[str, Tuple[int, ...]], dtypes: Mapping[str, torch.dtype], enabled: bool,
                source: str) -> Dict[str, Tuple[str, str]]:
    """Each MXFP4 stack of a checkpoint (name -> shape, name -> dtype) -> (its blocks' name, its scales'
    name), keyed by the name the model reads it under (the blocks' name without ``_blocks``).

    Raises:
        UnsupportedModel: MXFP4 blocks in a checkpoint whose config.json names no MXFP4 quantization.
        CorruptModel: blocks without their scales, not uint8, not ``[E, R, G, 16]``, scales not ``[E, R, G]``.
    """
    out = {}
    for blocks in sorted(n for n in shapes if n.endswith(BLOCKS)):
        name = blocks[:-len(BLOCKS)]
        scales = name + SCALES
        if not enabled:
            raise UnsupportedModel(f"{source}: tensor {blocks!r} is MXFP4-coded, but config.json's quantization_config "
                                   "does not name quant_method 'mxfp4'")
        if scales not in shapes:
            raise CorruptModel(f"{source}: MXFP4 tensor {blocks!r} has no scales {scales!r}")
        b, s = tuple(shapes[blocks]), tuple(shapes[scales])
        if dtypes[blocks] != torch.uint8 or dtypes[scales] != torch.uint8 or len(b) != 4 or b[-1] != 16 \
                or s != b[:-1]:
            raise CorruptModel(f"{source}: MXFP4 tensor {blocks!r} {b} {dtypes[blocks]} with scales {s} "
                               f"{dtypes[scales]}: expected uint8 [E, R, G, 16] and uint8 [E, R, G]")
        out[name] = (blocks, scales)
    return out


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 values ``[R, G * 32]`` of one matrix's MXFP4 ``blocks [R, G, 16]`` (uint8) and ``scales
    [R, G]`` (uint8): each code's value times its block's ``2 ** (scale - 127)``."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    r, g, _ = blocks.shape
    codes = blocks.to(torch.int64)
    values = torch.stack((lut[codes & 0x0F], lut[codes >> 4]), dim=-1).view(r, g, 32)
    return torch.ldexp(values, (scales.to(torch.int32) - SCALE_BIAS)[..., None]).view(r, g * 32)
