"""CPU weight layouts: 4-bit packing of weights that already are group-quantized (GGUF Q4_1 / Q8_0
imports), dense bfloat16 weights in the native kernels' tiles (:class:`TiledLinear`), and oneDNN's
blocked layout for dense float32/bfloat16 weights (:class:`BlockedLinear`); and torch's own matmul in
fixed-shape row blocks on any device (:class:`FixedRowsLinear`, the pure-torch path).

A GGUF checkpoint dequantized to float32 still holds, in every group of 32 input weights, values of
the form ``d * q + m`` (Q4_1: q in 0..15) or ``d * q`` (Q8_0: q in -127..127). Such a matrix is
packed keeping the file's own integer codes: Q4_1 groups as weights ``scale * q + zero`` with
scale = d, zero = m; Q8_0 groups as ``d * q`` (for torch's kernel split as q + 128 = 16 * hi + lo
into two 4-bit matrices whose products add up). A decode step then reads ~0.6-0.75 (Q4_1) or
~1.1-1.3 (Q8_0) bytes per weight instead of 2 (bfloat16) or 4 (float32): on a memory-bound CPU that
is the speed-up. The codes run on the native kernels (``csrc/int4_matmul.c``: float32 scales, each
group's weights rounded to bfloat16) where they build and activations are bfloat16, else on torch's
int4 CPU matmul (``torch._weight_int4pack_mm_for_cpu``, scales rounded to the activation dtype).

Both kernels compute every row of a block exactly as they compute that row alone (checked by the
tests), which is what lets speculative verification reproduce plain decoding bit for bit.
Matrices that are not on such a grid are not packed (no silent re-quantization). Detection relies on
ggml's quantizers putting each group's min and max on the ends of the grid (Q4_1: q = 0 and 15;
Q8_0: |q| = 127), which they do by construction.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from functools import lru_cache
from typing import Iterator, List, Optional, Tuple

import torch
from torch import nn

from mtpctl.model.native import (bf16_tiles, bf16_untile, blob_codes, int4_matmul, int4_matmul_best, int4_pack,
                                 int8_pack, load_kernel)

GROUP = 32
REL_TOL = 1e-5  # reconstruction error allowed, relative to the group's largest |weight|


def _groups(weight: torch.Tensor) -> torch.Tensor:
    n, k = weight.shape
    return weight.float().reshape(n, k // GROUP, GROUP)


#: (q [N, K], scale [N, K/32], zero [N, K/32] or None): weights ``scale * q (+ zero)`` in each group of
#: 32; q in 0..15 with a zero (Q4_1), or in -127..127 without one (Q8_0)
Codes = Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]


def _torch_pack(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """Codes with weights ``scale * q + zero`` -> (packed weight, scales_and_zeros ``[K/32, N, 2]`` in
    ``dtype``) for torch's kernel, which computes ``(q - 8) * scale + zero'``."""
    packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
    scales_zeros = torch.stack((scale.t(), (zero + 8 * scale).t()), dim=-1).float().contiguous()
    return packed, scales_zeros.to(dtype)


def _exact(groups: torch.Tensor, recon: torch.Tensor) -> bool:
    bound = groups.abs().amax(-1, keepdim=True) * REL_TOL + 1e-30
    return bool(((recon - groups).abs() <= bound).all())


def pack_q4(weight: torch.Tensor) -> Optional[List[Codes]]:
    """The 4-bit codes of ``weight [N, K]`` if every group of 32 is ``d * q + m`` with q in 0..15; else None."""
    g = _groups(weight)
    low, high = g.amin(-1), g.amax(-1)
    scale = (high - low) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((g - low[..., None]) / safe[..., None]).clamp(0, 15)
    if not _exact(g, q * scale[..., None] + low[..., None]):
        return None
    return [(q.reshape(weight.shape), scale, low)]


def pack_q8(weight: torch.Tensor) -> Optional[List[Codes]]:
    """The 8-bit codes of ``weight [N, K]`` (zero None) if every group of 32 is ``d * q``, q in
    -127..127; else None."""
    g = _groups(weight)
    d = g.abs().amax(-1) / 127
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round(g / safe[..., None]).clamp(-127, 127)
    if not _exact(g, q * d[..., None]):
        return None
    return [(q.reshape(weight.shape), d, None)]


def split_q8(q: torch.Tensor, d: torch.Tensor) -> List[Codes]:
    """8-bit codes as two sets of 4-bit codes whose weights add up to theirs (q + 128 = 16 * hi + lo),
    for torch's int4 kernel."""
    u = q + 128
    hi, lo = torch.div(u, 16, rounding_mode="floor"), torch.remainder(u, 16)
    return [(hi, 16 * d, -128 * d), (lo, d, torch.zeros_like(d))]


class PackedLinear(nn.Module):
    """``y = x @ W.T`` for a weight packed by :func:`pack_q4` / :func:`pack_q8`.

    Input ``[..., K]`` and output ``[..., N]`` in ``dtype``. With bfloat16 activations and the native
    kernels (:mod:`mtpctl.model.native`), the weights run on ``csrc/int4_matmul.c`` (float32 scales,
    each group's weights rounded to bfloat16 once; 8-bit codes as they are); otherwise on torch's int4
    kernel with scales in ``dtype`` (bfloat16 is its fast path, float32 its slow exact one), 8-bit
    codes split into two 4-bit parts whose outputs add. Both compute a row alike alone or in a block.

    Args:
        parts: the codes of :func:`pack_q4` or :func:`pack_q8` (one part each).
        native: None = the native kernel where it runs (bfloat16 and a kernel library that builds),
            False = torch's kernel.
    """

    def __init__(self, parts: List[Codes], out_features: int, dtype: torch.dtype = torch.bfloat16,
                 native: Optional[bool] = None):
        super().__init__()
        self.native = native is not False and dtype == torch.bfloat16 and out_features % 4 == 0 \
            and load_kernel() is not None
        if self.native:
            self.parts = [(int4_pack(q, scale, zero) if zero is not None else int8_pack(q, scale),)
                          for q, scale, zero in parts]
        else:
            four_bit = [half for q, scale, zero in parts
                        for half in ([(q, scale, zero)] if zero is not None else split_q8(q, scale))]
            self.parts = [_torch_pack(q, scale, zero, dtype) for q, scale, zero in four_bit]
        self.out_features, self.dtype = out_features, dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = None
        if self.native:  # one blob per weight (4-bit or 8-bit codes), written in x's dtype by the kernel
            out = int4_matmul(flat, self.parts[0][0], self.out_features, out_dtype=x.dtype)
        else:  # Q8_0 as two 4-bit parts whose outputs add
            for packed, scales_zeros in self.parts:
                y = torch._weight_int4pack_mm_for_cpu(flat, packed, GROUP, scales_zeros)
                out = y if out is None else out + y
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def forward_best(self, x: torch.Tensor) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """(:meth:`forward` of rows ``x [M, K]``, each row's argmax ``[M]`` as :func:`int4_matmul_best`
        takes it: -1 where the row holds NaN or inf), or None where torch's kernel runs these weights."""
        if not self.native or x.dim() != 2 or x.dtype != torch.bfloat16:
            return None
        return int4_matmul_best(x, self.parts[0][0], self.out_features, out_dtype=x.dtype)


    def select_rows(self, index: torch.Tensor) -> Optional["PackedLinear"]:
        """A :class:`PackedLinear` of the output rows ``index`` ``[M]`` of this weight, with the same codes
        (so row for row the same outputs), or None where the codes are not kept in the native layout
        (torch's kernel) or M is not a multiple of 4."""
        if not self.native or len(index) % 4:
            return None
        tiles, where = torch.unique(index // 4, return_inverse=True)  # decode only the tiles of 4 rows it needs
        q, scale, zero = blob_codes(self.parts[0][0][tiles])
        rows = where * 4 + index % 4
        return PackedLinear([(q[rows], scale[rows], zero[rows] if zero is not None else None)], len(index),
                            torch.bfloat16, native=True)


def pack_exact(weight: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
               native: Optional[bool] = None) -> Optional[PackedLinear]:
    """A :class:`PackedLinear` with the integer codes of ``weight [N, K]`` (activations in ``dtype``;
    ``native`` as there), or None when it is not on a Q4_1 or Q8_0 grid (or K is not a multiple of 32)."""
    if weight.dim() != 2 or weight.shape[1] % GROUP or weight.shape[0] % 16:
        return None
    parts = pack_q4(weight) or pack_q8(weight)
    return PackedLinear(parts, weight.shape[0], dtype, native) if parts else None


class TiledLinear(nn.Module):
    """``y = x @ W.T`` for a dense bfloat16 weight ``[N, K]`` on the native matmul (csrc/int4_matmul.c):
    the weight's own values in tiles of 4 outputs and 32 inputs (:func:`bf16_tiles`), bfloat16 dot
    products summed in float32 in a fixed order, the output rounded to bfloat16. A row is computed the
    same alone or among any number of rows, so a decode step needs no second row (unlike
    :class:`BlockedLinear`), and the native layer stack reads the tiles directly
    (:func:`mtpctl.model.native.layer_stack`). Build it where :func:`mtpctl.model.native.load_kernel`
    gives the kernels.

    Input ``[..., K]`` bfloat16; output ``[..., N]`` bfloat16 (or the float32 sums, ``out_dtype``).

    Raises:
        ValueError: a weight that is not 2-D bfloat16 with N a multiple of 4 and K of 32.
    """

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.blob = bf16_tiles(weight.detach())
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        y = int4_matmul(flat, self.blob, self.out_features, out_dtype=out_dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def forward_best(self, x: torch.Tensor) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """(:meth:`forward` of rows ``x [M, K]``, each row's argmax ``[M]`` as :func:`int4_matmul_best`
        takes it: -1 where the row holds NaN or inf), or None for rows that are not 2-D."""
        if x.dim() != 2:
            return None
        return int4_matmul_best(x, self.blob, self.out_features, out_dtype=torch.bfloat16)

    def dense(self) -> torch.Tensor:
        """The weight ``[N, K]`` as an ordinary (strided) tensor."""
        return bf16_untile(self.blob)

    @property
    def nbytes(self) -> int:
        return self.blob.numel()


#: True inside :func:`any_rows`: a :class:`FixedRowsLinear` computes all its rows in one product
_ANY_ROWS: ContextVar[bool] = ContextVar("mtpctl_any_rows", default=False)


@contextlib.contextmanager
def any_rows() -> Iterator[None]:
    """Within this block every :class:`FixedRowsLinear` computes its rows in one product of whatever
    shape the pass has, reading its weight once, instead of in fixed blocks: for a prefill on the device
    path (:meth:`mtpctl.backends.torch.TorchEngine.prefill`), which feeds plain and speculative decoding
    alike, so its rows need not match a decode or verify pass's bit for bit; T/64 reads of every weight
    become one."""
    token = _ANY_ROWS.set(True)
    try:
        yield
    finally:
        _ANY_ROWS.reset(token)


class FixedRowsLinear(nn.Module):
    """``y = x @ W.T`` for a dense weight ``[N, K]`` on torch's own matmul (any device), computed in
    blocks of exactly ``rows`` rows (the last one padded with zero rows): every row of every pass then
    comes out of a product of one shape, so its result does not depend on how many rows, or which,
    the pass carries (torch's kernels pick their blocking and reduction order by shape). The pure-torch
    path holds its linear weights this way (:mod:`mtpctl.model.device`); the weight is the checkpoint's
    tensor itself, not a copy.

    Input ``[..., K]`` in the weight's dtype; output ``[..., N]``.
    """

    def __init__(self, weight: torch.Tensor, rows: int):
        super().__init__()
        if rows < 1:
            raise ValueError(f"rows must be >= 1, not {rows}")
        self.weight, self.rows = weight.detach(), rows
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _ANY_ROWS.get():  # a prefill (any_rows): one product, the weight read once
            return torch.nn.functional.linear(x, self.weight)
        y = self._in_blocks(lambda block: torch.nn.functional.linear(block, self.weight), x.reshape(-1, self.in_features))
        return y.reshape(*x.shape[:-1], self.out_features)

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + x @ W.T`` (``residual [..., N]`` the shape of the output), the sum made in each
        block's product (``torch.addmm``: one launch where :meth:`forward` and an add are two, and the
        sum rounded once). Blocks as :meth:`forward`'s, the residual's padded alike, so that a row is summed
        the same way in a pass of any row count (a multiple of the block or not)."""
        flat, res = x.reshape(-1, self.in_features), residual.reshape(-1, self.out_features)
        if _ANY_ROWS.get():
            return torch.addmm(res, flat, self.weight.t()).reshape(residual.shape)
        y = self._in_blocks(lambda block, added: torch.addmm(added, block, self.weight.t()), flat, res)
        return y.reshape(residual.shape)

    def _in_blocks(self, product, *rows: torch.Tensor) -> torch.Tensor:
        """``product`` of blocks of exactly ``self.rows`` rows of the 2-D ``rows`` tensors (each padded
        alike with zero rows appended in one op: the values of a cat with zeros), the blocks' results
        stacked and cut back to the rows given."""
        m = rows[0].shape[0]
        padded = -m % self.rows
        if padded:
            rows = tuple(torch.nn.functional.pad(t, (0, 0, 0, padded)) for t in rows)
        blocks = [product(*block) for block in zip(*(t.split(self.rows) for t in rows))]
        return (blocks[0] if len(blocks) == 1 else torch.cat(blocks))[:m]

    def dense(self) -> torch.Tensor:
        """The weight ``[N, K]``."""
        return self.weight

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


def tiles_take(dtype: torch.dtype, shape: Tuple[int, ...]) -> bool:
    """True when a weight of ``dtype`` and ``shape`` can be held as a :class:`TiledLinear`: 2-D bfloat16
    with N a multiple of 4 and K of 32, on a CPU where the native kernels build."""
    return dtype == torch.bfloat16 and len(shape) == 2 and shape[0] % 4 == 0 and shape[1] % GROUP == 0 \
        and load_kernel() is not None


def blocked_layout_available(dtype: torch.dtype = torch.float32) -> bool:
    """True when this torch build has oneDNN's prepacked linear ops (:class:`BlockedLinear`) for weights
    of ``dtype``: bfloat16 ones also need a CPU that oneDNN's bfloat16 reorder runs on (AVX512-BW/VL/DQ
    or AVX-NE-CONVERT; an AVX2-only CPU has neither), found by reordering a small weight once."""
    ops = torch.ops.mkldnn
    if not (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise")):
        return False
    return dtype != torch.bfloat16 or _bf16_reorder_runs()


@lru_cache(maxsize=None)
def _bf16_reorder_runs() -> bool:
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 32, dtype=torch.bfloat16), None)
    except RuntimeError:  # "bf16 path needs the cpu support ...": this CPU has no such kernel
        return False
    return True


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
    :func:`mtpctl.model.decoder._linear` does, and speculative verification reproduces plain decoding
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


def blocked_copy(weight: Optional[torch.Tensor], blocked: bool) -> Optional[BlockedLinear]:
    """A :class:`BlockedLinear` holding ``weight [N, K]`` (float32 or bfloat16) for decoding, or None
    when ``blocked`` is False, there is no weight, or torch lacks oneDNN's ops. For the MTP heads'
    draft-vocabulary projection: torch's default kernel takes ~3.6 ms for two float32 rows of an
    [8192, 576] projection here, the blocked layout ~0.4 ms (bfloat16: 0.26 against 0.12 ms)."""
    if not blocked or weight is None or weight.dtype not in (torch.float32, torch.bfloat16) \
            or weight.device.type != "cpu" or not blocked_layout_available(weight.dtype):
        return None
    return BlockedLinear(weight)


def projection_copy(rows: Optional[torch.Tensor], token_map: Optional[torch.Tensor], blocked: bool,
                    target_lm_head: Optional[nn.Module] = None) -> Optional[nn.Module]:
    """For decoding, the kernel of a draft-vocabulary projection: ``rows [V_d, K]``, the rows
    ``token_map [V_d]`` of the target's lm_head, in the target's own layout where it has one:
    - a :class:`PackedLinear` on the native kernels (int4 weights): those rows of its own codes, the
      weights the target itself computes with, about 1.1 bytes a weight for Q8_0 against 2 in
      bfloat16, which is most of what the heads read a step;
    - a :class:`TiledLinear` (dense bfloat16): a tiled copy of ``rows``. A pass of 1-8 rows over an
      [8192, 576] projection, weights from memory, takes 0.6-0.9 ms there against 0.9-1.1 ms in
      oneDNN's blocked layout.
    Else the blocked copy of ``rows`` (:func:`blocked_copy`); None when ``blocked`` is False or there are
    no rows."""
    if blocked and rows is not None and token_map is not None and isinstance(target_lm_head, PackedLinear):
        packed = target_lm_head.select_rows(token_map)
        if packed is not None:
            return packed
    if blocked and rows is not None and isinstance(target_lm_head, TiledLinear) \
            and tiles_take(rows.dtype, tuple(rows.shape)):
        return TiledLinear(rows)
    return blocked_copy(rows, blocked)
