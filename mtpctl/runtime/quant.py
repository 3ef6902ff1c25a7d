"""CPU weight layouts: 4-bit packing of weights that already are group-quantized (GGUF Q4_1 / Q8_0
imports), and oneDNN's blocked layout for dense float32/bfloat16 weights (:class:`BlockedLinear`).

A GGUF checkpoint dequantized to float32 still holds, in every group of 32 input weights, values of
the form ``d * q + m`` (Q4_1: q in 0..15) or ``d * q`` (Q8_0: q in -127..127). Such a matrix is
packed for torch's int4 CPU matmul (``torch._weight_int4pack_mm_for_cpu``) keeping the file's own
integer codes: Q4_1 groups map to (q - 8) * scale + zero with scale = d, zero = m + 8d; Q8_0 groups
are split as q + 128 = 16 * hi + lo into two int4 matrices whose products add up. A decode step then
reads ~0.6 (Q4_1) or ~1.3 (Q8_0) bytes per weight instead of 2 (bfloat16) or 4 (float32): on a
memory-bound CPU that is the speed-up. Scales and zeros are stored in the activation dtype (bfloat16:
the kernel's fast path), so the weights equal the file's up to that rounding of each group's scale.

The kernel computes every row of a block exactly as it computes that row alone (checked by the
tests), which is what lets speculative verification reproduce plain decoding bit for bit.
Matrices that are not on such a grid are not packed (no silent re-quantization). Detection relies on
ggml's quantizers putting each group's min and max on the ends of the grid (Q4_1: q = 0 and 15;
Q8_0: |q| = 127), which they do by construction.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import nn

GROUP = 32
REL_TOL = 1e-5  # reconstruction error allowed, relative to the group's largest |weight|


def _groups(weight: torch.Tensor) -> torch.Tensor:
    n, k = weight.shape
    return weight.float().reshape(n, k // GROUP, GROUP)


def _pack(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """q ``[N, K]`` in 0..15, scale/zero ``[N, K/32]`` -> (packed weight, float32 scales_and_zeros
    ``[K/32, N, 2]``)."""
    packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
    scales_zeros = torch.stack((scale.t(), zero.t()), dim=-1).float().contiguous()
    return packed, scales_zeros


def _exact(groups: torch.Tensor, recon: torch.Tensor) -> bool:
    bound = groups.abs().amax(-1, keepdim=True) * REL_TOL + 1e-30
    return bool(((recon - groups).abs() <= bound).all())


def pack_q4(weight: torch.Tensor) -> Optional[List[Tuple[torch.Tensor, torch.Tensor]]]:
    """Pack ``weight [N, K]`` if every group of 32 is ``d * q + m`` with q in 0..15; else None."""
    g = _groups(weight)
    low, high = g.amin(-1), g.amax(-1)
    scale = (high - low) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((g - low[..., None]) / safe[..., None]).clamp(0, 15)
    if not _exact(g, q * scale[..., None] + low[..., None]):
        return None
    return [_pack(q.reshape(weight.shape), scale, low + 8 * scale)]


def pack_q8(weight: torch.Tensor) -> Optional[List[Tuple[torch.Tensor, torch.Tensor]]]:
    """Pack ``weight [N, K]`` as two int4 matrices if every group of 32 is ``d * q``, q in -127..127."""
    g = _groups(weight)
    d = g.abs().amax(-1) / 127
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round(g / safe[..., None]).clamp(-127, 127)
    if not _exact(g, q * d[..., None]):
        return None
    u = (q + 128).reshape(weight.shape)
    hi, lo = torch.div(u, 16, rounding_mode="floor"), torch.remainder(u, 16)
    return [_pack(hi, 16 * d, torch.zeros_like(d)), _pack(lo, d, 8 * d)]


class PackedLinear(nn.Module):
    """``y = x @ W.T`` for a weight packed by :func:`pack_q4` / :func:`pack_q8`.

    Input ``[..., K]`` and output ``[..., N]`` in ``dtype`` (the scales' dtype; bfloat16 is the
    kernel's fast path, float32 its slow exact one).
    """

    def __init__(self, parts: List[Tuple[torch.Tensor, torch.Tensor]], out_features: int,
                 dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.parts = [(packed, scales_zeros.to(dtype)) for packed, scales_zeros in parts]
        self.out_features = out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = None
        for packed, scales_zeros in self.parts:
            y = torch._weight_int4pack_mm_for_cpu(flat, packed, GROUP, scales_zeros)
            out = y if out is None else out + y
        return out.reshape(*x.shape[:-1], self.out_features)


def pack_exact(weight: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> Optional[PackedLinear]:
    """A :class:`PackedLinear` with the integer codes of ``weight [N, K]`` (scales in ``dtype``), or
    None when it is not on a Q4_1 or Q8_0 grid (or K is not a multiple of 32)."""
    if weight.dim() != 2 or weight.shape[1] % GROUP or weight.shape[0] % 16:
        return None
    parts = pack_q4(weight) or pack_q8(weight)
    return PackedLinear(parts, weight.shape[0], dtype) if parts else None


def blocked_layout_available() -> bool:
    """True when this torch build has oneDNN's prepacked linear ops (:class:`BlockedLinear`)."""
    ops = torch.ops.mkldnn
    return torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight") \
        and hasattr(ops, "_linear_pointwise")


class BlockedLinear(nn.Module):
    """``y = x @ W.T`` for a dense float32 or bfloat16 weight ``[N, K]`` held in oneDNN's blocked
    ("prepacked") layout, the layout torch's CPU compiler uses for frozen weights.

    The values are the weight's own (no rounding: :meth:`dense` gives them back exactly). What
    changes is the kernel: reordered once at load instead of on every call, a decode step's linear
    layers run about 1.2x faster and a verify pass of 8-16 tokens about 1.3x faster on this project's
    CPU in bfloat16 (BENCHMARKS.md). oneDNN's one-row kernel rounds differently from its many-row
    kernel on some inputs (in bfloat16, 172 of 7,624 rows of a real SmolLM2 generation), while blocks
    of 2 to 33 rows agree row for row, in float32 as in bfloat16 (unlike torch's default float32
    kernel); so one row is computed as two (the row twice), as the dense path in
    :func:`mtpctl.runtime.model._linear` does, and speculative verification reproduces plain decoding
    bit for bit (tests/test_quant.py, tests/test_engine.py).

    Input ``[..., K]`` and output ``[..., N]``, in the weight's dtype.

    Raises:
        ValueError: a weight that is not 2-D float32 or bfloat16.
    """

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        if weight.dtype not in (torch.float32, torch.bfloat16) or weight.dim() != 2:
            raise ValueError(f"BlockedLinear holds 2-D float32/bfloat16 weights, got {weight.dtype} "
                             f"{tuple(weight.shape)}")
        self.blocked = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        rows = len(flat)
        # one row: the row twice, copied (a stride-0 view of it costs oneDNN ~20 us more per call)
        flat = flat.expand(2, -1).contiguous() if rows == 1 else flat.contiguous()
        y = torch.ops.mkldnn._linear_pointwise(flat, self.blocked, None, "none", [], "")
        return y[:rows].reshape(*x.shape[:-1], self.out_features)

    def dense(self) -> torch.Tensor:
        """The weight ``[N, K]`` as an ordinary (strided) tensor."""
        return self.blocked.to_dense()

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features * self.dtype.itemsize
