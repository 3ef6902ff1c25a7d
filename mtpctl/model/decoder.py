"""A Llama-family decoder (llama, SmolLM2, mistral, qwen2, qwen3), Gemma 3 (gemma3_text), the MoE families
and Qwen3.5's hybrid body (qwen3_5_text: Gated DeltaNet layers, :func:`deltanet_pass`) that scores N
candidate tokens against a position-indexed KV cache in one forward pass.

Written for mtpctl from the published architectures (Touvron et al. 2023, "LLaMA"; RMSNorm, SwiGLU MLP,
rotary embeddings, grouped-query attention; Gemma Team 2025, "Gemma 3 Technical Report": interleaved
local sliding-window and global layers with their own rope bases, QK-norm, sandwich norms, GELU-tanh
MLP, scaled embeddings) and the Hugging Face checkpoint layout. What a family changes in the block is
read from :class:`mtpctl.model.config.DecoderConfig` flags, and its checkpoint's tensors from its
family's description (``cfg.family``, :mod:`mtpctl.model.families`), never from a model's name. Q/K/V
and gate/up projections are fused at load time so a step runs one matmul where the checkpoint has three
or two. Positions and the attention mask are explicit, so a chain or a tree of draft tokens is
verified in one call.
"""

from __future__ import annotations

import math
from functools import partial, reduce
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from mtpctl.errors import CorruptModel, UnsupportedModel
from mtpctl.model.config import DecoderConfig, RopeConfig, rope_attention_factor
from mtpctl.model.kv_cache import KVCache, LatentCache, PassSlots
from mtpctl.model.native import (SlotPlan, StackWeights, attend, kernel_takes, layer_stack, stack_part,
                                 norm_takes, rms_norm, rotate_write)
from mtpctl.model.linears import BlockedLinear, FixedRowsLinear, PackedLinear, TiledLinear, pack_exact
from mtpctl.model.device import FIXED_ROWS, widening_products
from mtpctl.model.gated_deltanet import GatedDeltaNetWeights, deltanet_prefill, deltanet_tree, grouped_rows
from mtpctl.model.linear_cache import LinearCache
from mtpctl.model.moe import MoeWeights, elementwise, moe_mlp
from mtpctl.model.row_invariance import dense_linear, int4_path
from mtpctl.model.weights import CheckpointReader, MemoryTensors, read_headers, renamed, shard_files

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: weights that may be held packed or on a checked dense path (MLA's ``kv_b`` stays dense: latent attention
#: multiplies by its parts per head); ``in_proj``/``out_proj``: a Gated DeltaNet layer's projections
LINEARS = ("qkv", "o_proj", "gate_up", "down", "lm_head", "q_b", "in_proj", "out_proj")
EMBED = "model.embed_tokens.weight"
#: config activation name -> function (``gelu_pytorch_tanh``: GELU with the tanh approximation)
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh")}


def expected_tensors(cfg: DecoderConfig, names=None) -> Dict[str, tuple]:
    """Tensor name -> shape of a Hugging Face checkpoint of this config (its family's tensor map,
    :meth:`mtpctl.model.families.Family.shapes`); a MoE model's experts in the layout the checkpoint's
    ``names`` (a set) hold them in, per expert or stacked (None: stacked)."""
    return cfg.family.shapes(cfg, names)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies ``[head_dim / 2]`` (float32), with linear, Llama 3 or YaRN scaling applied
    (``head_dim``: the values the rotary embedding turns). YaRN's attention factor on the tables:
    :func:`mtpctl.model.config.rope_attention_factor`."""
    if rope.rope_type == "yarn":
        return yarn_inv_freq(rope, head_dim)
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        inv = inv / rope.factor
    elif rope.rope_type == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv


def yarn_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """YaRN's inverse frequencies (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large
    Language Models"): each frequency between its extrapolated (``1 / theta^(2i/dim)``) and interpolated
    (divided by ``factor``) value along a linear ramp over the dims whose wavelengths lie between
    ``beta_fast`` and ``beta_slow`` rotations in ``original_max_position_embeddings`` (bounds rounded out
    with ``truncate``), as transformers' ``_compute_yarn_parameters`` computes them."""
    base, factor = rope.theta, rope.factor

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # the share of the extrapolated frequency
    return interpolation * (1 - keep) + extrapolation * keep


#: rotary table rows a model builds at first, and the block of positions rows are computed in (so that a row
#: holds the same bits in a table of any length: each block is the same computation)
ROPE_START = 4096
#: a Decoder's rotary table buffers: global cos, sin; the sliding-window layers' own cos, sin (Gemma 3)
ROPE_TABLES = ("rope_cos", "rope_sin", "rope_local_cos", "rope_local_sin")


def rope_rows(rope: RopeConfig, dim: int, start: int, end: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[end - start, dim]`` (float32) of positions ``[start, end)``: the angles
    ``position * inv_freq`` (:func:`rope_inv_freq`, float32) repeated over both halves, times YaRN's
    attention factor (:func:`mtpctl.model.config.rope_attention_factor`; 1 otherwise), computed a block
    of :data:`ROPE_START` positions at a time from ``start`` (a multiple of it)."""
    inv, factor = rope_inv_freq(rope, dim), rope_attention_factor(rope)
    cos, sin = [], []
    for first in range(start, end, ROPE_START):
        freqs = torch.outer(torch.arange(first, min(first + ROPE_START, end), dtype=torch.float32), inv)
        angles = torch.cat((freqs, freqs), dim=-1)  # [block, dim]
        c, s = angles.cos(), angles.sin()
        if factor != 1.0:
            c, s = c * factor, s * factor
        cos.append(c)
        sin.append(s)
    return torch.cat(cos), torch.cat(sin)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) computed in float32, returned in ``x``'s dtype.

    Written out rather than ``F.rms_norm``: the fused CPU kernel reduces a lone row in a different
    order than a row inside a block, which would make a verify pass disagree with plain decoding.
    """
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rms_norm_float32_scale(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm scaled in float32 before the cast back to ``x``'s dtype (Gemma's convention); ``weight``
    is float32 and already holds Gemma's ``1 + w``. Same reduction as :func:`_rms_norm`."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * weight).to(x.dtype)


def _fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in one op (``F.rms_norm``: one kernel on CUDA, float32 inside, the weight applied before
    the cast back to ``x``'s dtype) for the device path (:meth:`Decoder.hold_fixed_rows`): one launch
    instead of six to eight. CUDA's kernel reduces each row on its own, in an order set by the row's
    length alone, so a row's result does not depend on how many rows share the call (what
    ``mean(-1)``'s reduction does not promise: its layout follows the row count); on the CPU
    :func:`_rms_norm` stays, whose written-out reduction is the one that holds there."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _fused_rms_norm_float32_scale(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`_fused_rms_norm` for Gemma's float32 ``1 + w`` weights (:func:`_rms_norm_float32_scale`)."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(x.dtype)


#: the norm each family convention uses on the device path (:meth:`Decoder.hold_fixed_rows`)
FUSED_NORMS = {_rms_norm: _fused_rms_norm, _rms_norm_float32_scale: _fused_rms_norm_float32_scale}


def _linear(x: torch.Tensor, weight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for a float weight, a :class:`PackedLinear`, :class:`TiledLinear` or
    :class:`BlockedLinear`.

    A dense bfloat16 product of one row is computed as two (the row twice): this CPU's
    one-row bfloat16 kernel rounds differently from its many-row kernel on some inputs (a 1-ulp
    change in the MLP's down projection of a real SmolLM2 step), while products of 2 to 33 rows agree
    row for row. Plain decoding then computes each token exactly as a verify pass does, for about
    the cost of one row (tests/test_engine.py).
    """
    if isinstance(weight, (PackedLinear, TiledLinear, BlockedLinear, FixedRowsLinear)):
        y = weight.forward(x)  # no hooks on these: skip nn.Module's call machinery (~4 us, 121 calls a step)
        return y if bias is None else y + bias
    if weight.dtype == torch.bfloat16 and x.numel() == x.shape[-1]:
        pair = x.reshape(1, -1).expand(2, -1)  # the row twice, without a copy
        return F.linear(pair, weight, bias)[:1].reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


#: fp32 matmuls on this CPU compute a row the same way for any row count M >= 4 (not for M < 4), so
#: attention products that mix tokens are padded to at least this many rows
MIN_ROWS = 4


@dataclass(frozen=True)
class AttentionGroup:
    """The tokens of a pass that share a head length (see :class:`AttentionPlan`).

    Attributes:
        head: head length (slots read in place).
        rows: ``[n_g]`` long, which tokens of the pass; None when the group is the whole pass.
        bias: ``[1, 1, n_g, 1, head + TAIL]`` float32 added to the attention scores: 0 where the
            token may attend, -inf where not (padding, slots outside a sliding window).
    """

    head: int
    rows: Optional[torch.Tensor]
    bias: torch.Tensor


@dataclass(frozen=True)
class AttentionPlan:
    """How the N tokens of a decode or verify pass read the KV cache, for one attention window
    (built by :func:`mtpctl.decode.attention.attention_plan`; the same for every layer of the window).

    Token i at position p reads two parts, laid out the same way whether it is decoded alone or
    inside a verify pass (a tree node's path in the tail is where plain decoding has it):

    - the head: cache slots ``[0, head)`` in their own order; ``head`` is a function of p alone
      (:func:`mtpctl.decode.attention.head_length`); for a draft tree it ends inside the committed slots
      (a chain's own slots already sit at their positions, so its head may reach into them);
    - the tail: ``tail_slots[i]``, the committed slots from the head's end on, then the token's
      ancestors and itself root first, padded to a fixed length (padding masked).

    Attributes:
        tail_slots: ``[N, TAIL]`` long, cache slots of each token's tail (padding: slot 0); its first
            column is the token's head length, where the tail starts.
        groups: the tokens grouped by head length, with their score biases.
        fixes: ``(rows [F], cols [F], slots [F])`` long, the entries of ``tail_slots`` that a window of
            ``TAIL`` consecutive slots from the tail's start does not hold (a tree node's ancestors,
            which sit elsewhere in the pass): tails are read as that window (one contiguous copy per
            token), then these are put in place; padding entries read whatever the window holds
            (masked, probability 0). None when every token's path sits in its window (plain decoding,
            chains).
        tail_start: for a pass of one token, ``tail_slots[0, 0]`` as a Python int (where its tail
            starts, known on the host), so that a layer need not read it back from the device; None
            for more tokens.
    """

    tail_slots: torch.Tensor
    groups: Tuple[AttentionGroup, ...]
    fixes: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
    tail_start: Optional[int] = None


def _pad_rows(x: torch.Tensor) -> torch.Tensor:
    """``[..., M, K]`` -> at least ``MIN_ROWS`` rows (zero rows appended)."""
    missing = MIN_ROWS - x.shape[-2]
    return x if missing <= 0 else F.pad(x, (0, 0, 0, missing))


def _head_product(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x [b, kv_heads, m, k] @ y [b, kv_heads, k, s]`` -> ``[b, kv_heads, m, s]``, a row's result the same
    whatever ``m``: on the CPU in one product of at least ``MIN_ROWS`` rows (from 4 rows on its kernels
    compute every row alike); elsewhere (a GPU) one product per block of exactly ``FIXED_ROWS["cuda"]``
    rows, each of the same shape whatever the pass (cuBLAS picks its kernel and reduction order by
    shape, the batch count included), reading ``y`` in place."""
    m = x.shape[-2]
    if x.device.type == "cpu":
        return torch.matmul(_pad_rows(x), y)[:, :, :m]
    block = FIXED_ROWS["cuda"]
    padded = F.pad(x, (0, 0, 0, -m % block)) if m % block else x
    parts = [_product(rows, y) for rows in padded.split(block, dim=2)]
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))[:, :, :m]


def _product(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x @ y`` over their batch dims, in float32: ``torch.matmul`` of float32 operands; bfloat16 ones
    (queries, probabilities and a bfloat16 cache's keys and values, off the CPU) multiply into float32
    (``torch.bmm(..., out_dtype=torch.float32)``: each product exact, the sums in float32), so that
    nothing the cache holds is widened into a copy first."""
    if x.dtype == torch.float32:
        return torch.matmul(x, y)
    batch = torch.broadcast_shapes(x.shape[:-2], y.shape[:-2])
    x3 = x.expand(*batch, *x.shape[-2:]).reshape(-1, *x.shape[-2:])
    y3 = y.expand(*batch, *y.shape[-2:]).reshape(-1, *y.shape[-2:])
    return torch.bmm(x3, y3, out_dtype=torch.float32).reshape(*batch, x.shape[-2], y.shape[-1])


def _gather_tails(x: torch.Tensor, plan: AttentionPlan, tail: int) -> torch.Tensor:
    """Each token's tail of ``x`` ``[batch, kv_heads, slots, head_dim]`` (a layer's keys or values),
    ``[batch, kv_heads, N, TAIL, head_dim]``: the window of ``TAIL`` slots from its tail's start,
    with the plan's ``fixes`` applied, so that the valid entries are the slots of ``tail_slots``."""
    b, kv, slots, d = x.shape
    s = x.stride()
    windows = x.as_strided((b, kv, slots - tail + 1, tail, d), (s[0], s[1], s[2], s[2], s[3]))
    out = windows.index_select(2, plan.tail_slots[:, 0])
    if plan.fixes is not None:
        rows, cols, src = plan.fixes
        out[:, :, rows, cols] = x[:, :, src]
    return out


def _attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
               plan: AttentionPlan, sinks: Optional[torch.Tensor] = None,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Grouped-query attention in float32, computed so that a token's result does not depend on the
    other tokens of its pass (batch-invariant): a verify pass gives bit for bit what plain decoding of
    each token's path gives, wherever the linear layers are batch-invariant too (bfloat16, int4, and
    float32 in oneDNN's blocked layout).

    q ``[batch, heads, N, head_dim]``; keys ``[batch, kv_heads, slots, head_dim]``, values ``[batch, kv_heads,
    slots, value_dim]`` (``value_dim``: ``head_dim`` but for latent attention's); ``scale`` multiplies q.k
    (usually ``head_dim ** -0.5``). Returns ``[batch, heads, N, value_dim]``, written into ``out``
    ``[batch, N, heads, value_dim]`` (any float dtype: the float32 result is cast as it is written) when
    given, else into a new tensor of ``q``'s dtype; either way a transposed view of it.

    Each token attends over its head and tail (:class:`AttentionPlan`) as one softmax:
    - head: ``q @ K[:head]`` and ``P @ V[:head]`` for all tokens with that head length in one matmul
      (:func:`_head_product`: at least ``MIN_ROWS`` rows on the CPU, blocks of 64 on a GPU, where every
      row is computed alike);
    - tail: the token's ``TAIL`` keys and values gathered into its own batch entry, one batched
      matmul of identical shapes for all tokens.
    The head reads a token's committed slots in place; the tail puts its path where plain decoding
    has it, so the softmax and the weighted sums run over the same values in the same order and with
    the same lengths. ``F.scaled_dot_product_attention``'s CPU kernel lacks the property. A lone token
    (plain decoding) reads its tail in place: the cache holds ``TAIL`` spare slots past its capacity
    for that (:meth:`Decoder.new_cache`).

    ``sinks`` ``[heads]`` (gpt-oss): each head's logit joins its softmax as one more column, dropped
    after (:func:`_softmax_with_sinks`).
    """
    b, heads, n, d = q.shape
    kv_heads, vd = keys.shape[1], values.shape[-1]
    group = heads // kv_heads
    tail = plan.tail_slots.shape[1]
    # [b, kv_heads, N, group, d] in the cache's dtype: float32, or a bfloat16 cache's (off the CPU), whose
    # products give float32 (_product)
    qg = q.reshape(b, kv_heads, group, n, d).to(keys.dtype).transpose(2, 3)
    if out is None:
        out = q.new_empty((b, n, heads, vd))
    dest = out.view(b, n, kv_heads, group, vd).transpose(1, 2)  # [b, kv_heads, N, group, vd], out's memory
    if n == 1:  # one token: its tail slots are consecutive, read in place (the same values a gather gives)
        start = plan.tail_start if plan.tail_start is not None else int(plan.tail_slots[0, 0])
        tail_k, tail_v = keys[:, :, None, start:start + tail], values[:, :, None, start:start + tail]
    else:
        tail_k = _gather_tails(keys, plan, tail)  # [b, kv_heads, N, TAIL, d]
        tail_v = _gather_tails(values, plan, tail)
    tail_scores = _product(qg, tail_k.transpose(-1, -2))  # [b, kv_heads, N, group, TAIL] float32
    staged = None if len(plan.groups) == 1 else tail_scores.new_empty(dest.shape)  # groups' results, cast once
    for g in plan.groups:
        pick = (lambda t: t) if g.rows is None else (lambda t: t[:, :, g.rows])
        n_g = n if g.rows is None else len(g.rows)
        m = n_g * group
        scores = pick(tail_scores)
        if g.head:
            head_scores = _head_product(pick(qg).reshape(b, kv_heads, m, d), keys[:, :, :g.head].transpose(-1, -2))
            scores = torch.cat((head_scores.reshape(b, kv_heads, n_g, group, g.head), scores), dim=-1)
        probs = _probs(g.bias, scores, scale, sinks, kv_heads, group, blocked=g.head > 0)  # [b, kv, rows, S]
        probs = probs.to(values.dtype)  # a bfloat16 cache's values take bfloat16 weights, as flash attention's
        o = _product(probs[:, :, :m, g.head:].reshape(scores.shape[:-1] + (tail,)), pick(tail_v))
        if g.head:  # the head's weighted sum plus the tail's, with one group written where the result goes
            head = _head_product(probs[..., :g.head], values[:, :, :g.head])[:, :, :m].reshape(o.shape)
            o = torch.add(head, o, out=dest) if staged is None else head + o
        if staged is not None:
            staged[:, :, g.rows] = o
        elif not g.head:
            dest.copy_(o)
    if staged is not None:
        dest.copy_(staged)
    return out.transpose(1, 2)


def _probs(bias: torch.Tensor, scores: torch.Tensor, scale: float, sinks: Optional[torch.Tensor], kv_heads: int,
           group: int, blocked: bool) -> torch.Tensor:
    """``softmax(bias + scale * scores)`` over the last dim of ``scores [b, kv_heads, n, group, S]`` (bias
    ``[1, 1, n, 1, S]``), as ``[b, kv_heads, rows, S]`` whose first ``n * group`` rows are the result.

    Off the CPU, ``blocked`` (the head's product follows, in blocks of ``FIXED_ROWS["cuda"]`` rows) and
    without sinks: ``rows`` is ``n * group`` rounded up to the block, the scaled scores written into the
    first rows of an uninitialized tensor of that many, so that the head's product reads the softmax's
    output as it is instead of a padded copy (one launch less a layer). The other rows hold whatever the
    memory held and come out as whatever the softmax makes of it: each row is its own softmax and its
    own row of every product after, and nobody reads them. Elsewhere ``rows`` is ``n * group``."""
    b, kv, n, group, s = scores.shape
    m = n * group
    block = FIXED_ROWS["cuda"]
    if not blocked or sinks is not None or scores.device.type == "cpu" or m % block == 0:
        return _softmax_with_sinks(torch.add(bias, scores, alpha=scale), sinks, kv_heads, group).reshape(b, kv, m, s)
    padded = scores.new_empty((b, kv, m + -m % block, s))
    torch.add(bias, scores, alpha=scale, out=padded[:, :, :m].view(b, kv, n, group, s))
    return torch.softmax(padded, dim=-1)


def _softmax_with_sinks(logits: torch.Tensor, sinks: Optional[torch.Tensor], kv_heads: int,
                        group: int) -> torch.Tensor:
    """Softmax over the last dim of ``logits [b, kv_heads, N, group, S]``; with ``sinks [kv_heads *
    group]`` each head's sink logit joins as one more column (in the denominator only), then dropped."""
    if sinks is None:
        return torch.softmax(logits, dim=-1)
    sink = sinks.float().view(1, kv_heads, 1, group, 1).expand(*logits.shape[:-1], 1)
    return torch.softmax(torch.cat((logits, sink), dim=-1), dim=-1)[..., :-1]


def _masked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                      scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """Attention with sinks in float32 for prefill and teacher-forced passes (torch's fused SDPA takes
    no sinks): q ``[b, heads, N, d]``, keys/values ``[b, kv_heads, S, d]``, ``mask`` bool ``[b|1, 1,
    N, S]`` (True: attend). ``[b, heads, N, d]``."""
    b, heads, n, d = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    qg = q.float().reshape(b, kv_heads, group, n, d).transpose(2, 3)  # [b, kv, N, group, d]
    scores = torch.matmul(qg, keys.float()[:, :, None].transpose(-1, -2))  # [b, kv, N, group, S]
    bias = torch.zeros(mask.shape, dtype=torch.float32, device=q.device).masked_fill(~mask, float("-inf"))
    probs = _softmax_with_sinks(scores * scale + bias[:, :, :, None], sinks, kv_heads, group)
    out = torch.matmul(probs, values.float()[:, :, None])  # [b, kv, N, group, d]
    return out.transpose(2, 3).reshape(b, heads, n, d)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply rotary embedding to ``x`` ``[batch, N, heads, head_dim]``; cos/sin ``[batch, N, 1, head_dim]``."""
    half = x.shape[-1] // 2
    if x.device.type != "cpu":  # each half's second product and sum in one launch (rounded once): 3 launches
        turned = x * cos
        out = torch.empty_like(turned)
        torch.addcmul(turned[..., :half], x[..., half:], sin[..., :half], value=-1, out=out[..., :half])
        torch.addcmul(turned[..., half:], x[..., :half], sin[..., half:], out=out[..., half:])
        return out
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin  # the CPU's bits, as transformers' ops round them


def _rotate_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`_rotate` of the first ``cos.shape[-1]`` values of each head of ``x``, the rest passed
    (GLM-4.5's ``partial_rotary_factor``)."""
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return _rotate(x, cos, sin)
    return torch.cat((_rotate(x[..., :rd], cos, sin), x[..., rd:]), dim=-1)


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x [..., d]`` whose rotated pairs are adjacent values (2i, 2i+1), each pair
    multiplied as a complex number by ``cos_i + j sin_i`` in float32 and written back in place (Llama 4's
    ``apply_rotary_emb``), in ``x``'s dtype; cos/sin ``[..., d]`` as :func:`_rotate` takes them."""
    half = cos.shape[-1] // 2
    c, s = cos[..., :half].float(), sin[..., :half].float()
    h = x.float()
    x1, x2 = h[..., 0::2], h[..., 1::2]
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2).to(x.dtype)


def temperature_scales(positions: torch.Tensor, floor_scale: float, attn_scale: float) -> torch.Tensor:
    """Llama 4's attention temperature of tokens at ``positions`` (long, any shape), float32 of the same
    shape: ``1 + attn_scale * log1p(floor((p + 1) / floor_scale))``, the log on :func:`elementwise`'s
    vector path (a token's factor the same in any pass)."""
    steps = torch.floor((positions.reshape(-1, 1).float() + 1.0) / floor_scale)
    return (elementwise(torch.log1p, steps) * attn_scale + 1.0).reshape(positions.shape)


def _rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x [..., d]`` whose rotated pairs are adjacent values (2i, 2i+1), written
    out de-interleaved (the even values' results, then the odd ones'): DeepSeek's layout, transformers'
    ``apply_rotary_pos_emb_interleave``; cos/sin ``[..., d]`` as :func:`_rotate` takes them."""
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class DecoderLayer(nn.Module):
    """One pre-norm transformer block: attention (GQA) then a gated MLP (SwiGLU or GELU-tanh), each
    with a residual; with ``cfg.sandwich_norms`` (Gemma) each branch's output is normed before its add.

    Norm parameters: ``input_norm`` (before attention), ``post_attention_norm`` (before the MLP: HF
    Llama's ``post_attention_layernorm``, Gemma's ``pre_feedforward_layernorm``), and with sandwich
    norms ``attn_out_norm`` / ``mlp_out_norm`` (Gemma's ``post_attention_layernorm`` /
    ``post_feedforward_layernorm``). With ``cfg.norm_offset`` they are float32 and hold ``offset + w``.
    With ``lazy`` the parameters are placeholders on the ``meta`` device (no memory) until loaded.
    """

    def __init__(self, cfg: DecoderConfig, index: int, dtype: torch.dtype, device="cpu", lazy: bool = False):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.cfg, self.index = cfg, index
        self.q_size, self.kv_size = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
        where = "meta" if lazy else device

        def param(*shape, dtype=dtype):
            return nn.Parameter(torch.empty(shape, dtype=dtype, device=where), requires_grad=False)

        norm_dtype = torch.float32 if cfg.norm_offset else dtype
        self.norm = _rms_norm_float32_scale if cfg.norm_offset else _rms_norm
        # decode and verify passes on the native kernels (a SlotPlan) norm with the native RMSNorm too
        self.native_norms = norm_takes(h) and (not (cfg.qk_norm or cfg.qk_l2_norm) or norm_takes(hd))
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.input_norm = param(h, dtype=norm_dtype)
        self.post_attention_norm = param(h, dtype=norm_dtype)
        self.attn_out_norm = param(h, dtype=norm_dtype) if cfg.sandwich_norms else None
        self.mlp_out_norm = param(h, dtype=norm_dtype) if cfg.sandwich_norms else None
        # with an output gate (Qwen3.5) q_proj gives each head's query, then its gate
        self.output_gate = cfg.output_gate
        self.qkv = param((2 if cfg.output_gate else 1) * self.q_size + 2 * self.kv_size, h)
        self.qkv_bias = param(self.qkv.shape[0]) if cfg.attention_bias else None
        self.o_proj = param(h, self.q_size)
        self.o_bias = param(h) if cfg.attention_bias and (cfg.output_gate or cfg.attention_sinks or cfg.o_bias) else None
        # gpt-oss: a learned logit per query head in each softmax's denominator
        self.sinks = param(cfg.num_attention_heads) if cfg.attention_sinks else None
        # a MoE layer (cfg.moe says which): router and stacked experts instead of the dense MLP, run by
        # moe_mlp in blocks of ``moe_rows`` rows (the placement's fixed row count, hold_fixed_rows)
        self.moe = cfg.moe if cfg.family.is_moe_layer(cfg, index) else None
        self.moe_rows = FIXED_ROWS.get(torch.device(device).type, FIXED_ROWS["cuda"])
        if self.moe is None:
            self.gate_up = param(2 * cfg.intermediate_size, h)
            self.gate_up_bias = param(2 * cfg.intermediate_size) if cfg.mlp_bias else None
            self.down = param(h, cfg.intermediate_size)
            self.down_bias = param(h) if cfg.mlp_bias else None
        else:
            e, i = self.moe.num_experts, self.moe.intermediate_size
            self.router = param(e, h)
            self.experts_gate_up = param(e, 2 * i, h)
            self.experts_down = param(e, h, i)
            self.gate_up = self.gate_up_bias = self.down = self.down_bias = None
            if self.moe.experts_transposed:  # gpt-oss, Llama 4: transformers' transposed layout (mtpctl.model.moe)
                self.experts_gate_up, self.experts_down = param(e, h, 2 * i), param(e, i, h)
            if self.moe.clamped:  # gpt-oss: biases
                self.router_logit_bias, self.experts_gate_up_bias = param(e), param(e, 2 * i)
                self.experts_down_bias = param(e, h)
        self.q_norm = param(hd, dtype=norm_dtype) if cfg.qk_norm else None
        self.k_norm = param(hd, dtype=norm_dtype) if cfg.qk_norm else None
        if self.moe is not None:  # sigmoid routing's score bias (float32) and shared experts
            self.router_bias = param(e, dtype=torch.float32) if self.moe.score_bias else None
            s = self.moe.shared_intermediate_size
            self.shared_gate_up = param(2 * s, h) if s else None
            self.shared_down = param(h, s) if s else None
            self.shared_expert_gate = param(1, h) if self.moe.shared_gate else None  # Qwen's sigmoid gate
            if self.moe.router_float32:  # kept in float32, as transformers keeps the gate
                self.router = param(e, h, dtype=torch.float32)
        # Llama 4: NoPE layers (no rotary embedding; queries scaled by position with attn_temperature),
        # the rotary layers' queries and keys RMS-normed without a weight after the rotary embedding
        self.rotary = index not in cfg.nope_layers
        self.temperature = None if self.rotary else cfg.attn_temperature
        self.qk_l2_weight = torch.ones(hd, dtype=dtype, device=device) if cfg.qk_l2_norm and self.rotary else None
        # the native kernel that rotates and writes the cache in one go turns whole heads (rotate-half)
        self.fused_rotary = cfg.rope_dim == hd and cfg.mla is None and not cfg.pair_rope and self.rotary \
            and self.qk_l2_weight is None
        self.mla = cfg.mla
        if cfg.mla is not None:  # multi-head latent attention: its own projections (see latent_attention)
            m, heads = cfg.mla, cfg.num_attention_heads
            first = m.q_lora_rank if m.q_lora_rank else heads * m.qk_head_dim
            self.q_size, self.kv_size = heads * m.v_head_dim, 0  # attention's output per token
            self.qkv = param(first + m.kv_lora_rank + m.qk_rope_head_dim, h)
            self.qkv_bias = param(first + m.kv_lora_rank + m.qk_rope_head_dim) if cfg.attention_bias else None
            self.q_a_norm = param(m.q_lora_rank) if m.q_lora_rank else None
            self.q_b = param(heads * m.qk_head_dim, m.q_lora_rank) if m.q_lora_rank else None
            self.kv_a_norm = param(m.kv_lora_rank)
            self.kv_b = param(heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
            self.o_proj = param(h, heads * m.v_head_dim)
            self.o_bias = param(h) if cfg.attention_bias else None
        # a Gated DeltaNet layer (cfg.deltanet says which): its own tensors instead of attention's
        self.deltanet = cfg.deltanet if cfg.family.is_linear_layer(cfg, index) else None
        if self.deltanet is not None:
            d = self.deltanet
            self.qkv = self.qkv_bias = self.o_proj = self.o_bias = self.q_norm = self.k_norm = None
            self.in_proj = param(d.proj_dim, h)
            self.conv = param(d.conv_dim, 1, d.conv_kernel, dtype=torch.float32)
            self.a_log = param(d.num_v_heads, dtype=torch.float32)
            self.dt_bias = param(d.num_v_heads, dtype=torch.float32)
            self.gated_norm_weight = param(d.v_head_dim)
            self.out_proj = param(h, d.value_dim)

    def forward(self, x, cos, sin, cache, mask: Optional[torch.Tensor], plan=None,
                positions: Optional[torch.Tensor] = None):
        """x ``[batch, N, hidden]`` -> ``[batch, N, hidden]``; writes this layer's N new KV slots.
        ``positions [batch, N]``: the tokens' positions, which a layer whose queries are scaled by
        position (``cfg.attn_temperature``, NoPE layers) needs.

        Prefill and teacher-forced passes: ``cache`` a :class:`KVCache` and ``mask`` (the fused SDPA
        kernel attends over the used slots only, which is faster for long N). Decode and verify passes:
        ``cache`` a :class:`PassSlots` (batch 1, the rows of one or more sequences, each with its own
        cache) and ``plan``, so that attention is batch-invariant: a :class:`SlotPlan` (the native
        kernel, the native RMSNorm for this layer's norms and, without q/k norms, the rotary embedding
        fused with the cache write, :mod:`mtpctl.model.native`), or one :class:`AttentionPlan` per
        sequence (torch's ops, :func:`_attention`).
        """
        cfg = self.cfg
        b, n, _ = x.shape
        heads = cfg.num_attention_heads
        native = isinstance(plan, SlotPlan)
        norm = rms_norm if self.native_norms and native else self.norm
        if self.deltanet is not None:
            mixed = deltanet_pass(self, norm(x, self.input_norm, cfg.rms_norm_eps), cache)
            return mixer_out_and_mlp(self, x, mixed, norm)
        qkv = _linear(norm(x, self.input_norm, cfg.rms_norm_eps), self.qkv, self.qkv_bias)
        if self.mla is not None:  # over the compressed cache (LatentCache)
            return self._attention_out_and_mlp(x, latent_attention(self, qkv, cos, sin, cache, mask, plan), b, n, norm)
        if native and self.q_norm is None and self.fused_rotary:  # rotate, write the caches and attend in C
            i = self.cache_index
            q = rotate_write(qkv[0], cos[0, :, 0], sin[0, :, 0], cache.kv, i, cache.dest, heads,
                             cfg.num_key_value_heads, kv_bf16=cache.kv_bf16)
            attn = attend(q, cache.kv, i, cfg.num_key_value_heads, cfg.scale, plan, kv_bf16=cache.kv_bf16)
            return self._attention_out_and_mlp(x, attn.transpose(0, 1)[None].to(x.dtype), b, n, norm)
        gate = None
        real = getattr(cache, "rows", n)
        if real < n:  # a padded pass (Decoder.pass_rows): attention for its tokens only (views)
            qkv, cos, sin = qkv[:, :real], cos[:, :real], sin[:, :real]
            positions = None if positions is None else positions[:, :real]
        if self.output_gate:
            qkv, gate = split_output_gate(qkv, heads, cfg.head_dim)
        q, k, v = qkv_heads(self, qkv, cos, sin, norm, positions)
        attn = self._attend(q, k, v, cache, mask, plan, x.dtype, n)
        return self._attention_out_and_mlp(x, attn, b, real, norm, gate)

    def _attend(self, q, k, v, cache, mask, plan, dtype, rows: int):
        """Attention of queries ``q [batch, heads, N, head_dim]`` over the cache after writing keys and
        values ``k``/``v`` ``[batch, kv_heads, N, head_dim]`` (see :meth:`forward`), ``[batch, heads, N,
        head_dim]`` in ``dtype``; on torch's batch-invariant path (one :class:`AttentionPlan` a sequence)
        ``[batch, heads, rows, head_dim]``, the pass's ``rows`` (a padded pass's, :meth:`Decoder.pass_rows`),
        each sequence's written in place and the padding rows left as the memory held them (nobody reads
        them: every op after attention treats each row on its own)."""
        cfg = self.cfg
        n = q.shape[2]
        native = isinstance(plan, SlotPlan)
        if native:
            cache.write(self.cache_index, k, v)
            attn = attend(q[0].transpose(0, 1).float().contiguous(), cache.kv, self.cache_index,
                          cfg.num_key_value_heads, cfg.scale, plan, kv_bf16=cache.kv_bf16)
            attn = attn.transpose(0, 1)[None].to(q.dtype)
        elif plan is not None:  # one plan per sequence of the pass, each over its own cache
            cache.write(self.cache_index, k, v)
            i = self.cache_index
            out = q.new_empty((q.shape[0], rows, q.shape[1], v.shape[-1]), dtype=dtype)
            for seq, start, count, seq_plan in zip(cache.caches, cache.starts, cache.counts, plan):
                _attention(q[:, :, start:start + count], seq.k[i], seq.v[i], cfg.scale, seq_plan, self.sinks,
                           out[:, start:start + count])
            attn = out.transpose(1, 2)
        elif mask is None:  # a free prefill's full-attention layer (Decoder.free_prefill): causal over its own rows
            cache.write(self.cache_index, k, v)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=cfg.attention_scale)
        else:
            keys, values = cache.write(self.cache_index, k, v)
            used = cache.length + n
            if self.sinks is not None:
                return _masked_attention(q, keys[:, :, :used], values[:, :, :used], mask[..., :used], cfg.scale,
                                         self.sinks).to(dtype)
            attn = F.scaled_dot_product_attention(q.float(), keys[:, :, :used].float(), values[:, :, :used].float(),
                                                  attn_mask=mask[..., :used], enable_gqa=True,
                                                  scale=cfg.attention_scale).to(dtype)
        return attn

    def _attention_out_and_mlp(self, x, attn, b: int, n: int, norm, gate: Optional[torch.Tensor] = None):
        """The rest of the block after attention ``attn [batch, heads, rows, head_dim]`` of the pass's
        ``n`` tokens (:func:`attention_out_and_mlp`), times ``sigmoid(gate)`` first where the layer has an
        output gate; ``rows`` is ``n`` or, attention written into a padded pass's rows already, the pass's."""
        if gate is not None:
            attn = attn[:, :, :n].transpose(1, 2).reshape(b, n, self.q_size)
            attn = attn * elementwise(torch.sigmoid, gate.reshape(-1, self.q_size)).reshape(attn.shape)
        else:
            attn = attn.transpose(1, 2).reshape(b, attn.shape[2], self.q_size)
        if attn.shape[1] < x.shape[1]:  # a padded pass: the padding rows' attention is zeros, one shape on
            attn = F.pad(attn, (0, 0, 0, x.shape[1] - attn.shape[1]))
        return attention_out_and_mlp(self, x, attn, norm)

    @property
    def cache_index(self) -> int:
        """Which layer of the KV cache holds this layer's keys and values: its index, or in a hybrid body
        (Gated DeltaNet layers hold no KV) its place among the attention layers (from :attr:`index`,
        which a self-draft's view of the first layers sets anew)."""
        d = self.cfg.deltanet
        return self.index if d is None else sum(not d.is_linear_layer(i) for i in range(self.index))

    def deltanet_weights(self) -> GatedDeltaNetWeights:
        """A Gated DeltaNet layer's tensors as :mod:`mtpctl.model.gated_deltanet` takes them (views)."""
        d = self.deltanet
        return GatedDeltaNetWeights(in_proj=self.in_proj, conv=self.conv.view(d.conv_dim, d.conv_kernel),
                                    a_log=self.a_log, dt_bias=self.dt_bias, norm=self.gated_norm_weight,
                                    out_proj=self.out_proj)


def split_output_gate(qkv: torch.Tensor, heads: int, head_dim: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """A gated attention's fused projection ``[batch, N, 2 q + 2 kv]`` (each query head followed by its
    gate) -> (the projection without the gates ``[batch, N, q + 2 kv]``, the gates ``[batch, N, q]``)."""
    q_size = heads * head_dim
    both = qkv[..., :2 * q_size].unflatten(-1, (heads, 2 * head_dim))
    queries = both[..., :head_dim].flatten(-2)
    return torch.cat((queries, qkv[..., 2 * q_size:]), dim=-1), both[..., head_dim:].flatten(-2)


def deltanet_pass(layer: DecoderLayer, h: torch.Tensor, cache) -> torch.Tensor:
    """A Gated DeltaNet layer over the input-normed rows ``h [batch, N, hidden]`` of a pass: each
    sequence from its committed state (``cache.linear``), its states staged for the commit
    (:class:`~mtpctl.model.linear_cache.LinearCache`): a verify pass's every node
    (:func:`~mtpctl.model.gated_deltanet.deltanet_tree`, so the committed state is bit for bit plain
    decoding's), a prefill pass's last token (the chunked form). ``[batch, N, hidden]``.

    Raises:
        UnsupportedModel: a pass of several sequences through a batched cache (teacher-forced batches), or
            a verify pass with rows beyond its tree's nodes (lookahead decoding's window).
    """
    if isinstance(cache, PassSlots):
        spans = list(zip(cache.caches, cache.starts, cache.counts, cache.parents or [None] * len(cache.caches)))
    elif h.shape[0] != 1:
        raise UnsupportedModel(f"Gated DeltaNet layers run one sequence a pass, not a batch of {h.shape[0]} "
                               "(a teacher-forced batch of several sequences: pass them one at a time)")
    else:
        spans = [(cache, 0, h.shape[1], None)]
    outs = [_deltanet_sequence(layer, h[0, start:start + n], tree, seq) for seq, start, n, tree in spans]
    return (outs[0] if len(outs) == 1 else torch.cat(outs))[None]


def _deltanet_sequence(layer: DecoderLayer, rows: torch.Tensor, parents, cache: KVCache) -> torch.Tensor:
    """One sequence's rows of a pass through a Gated DeltaNet layer (:func:`deltanet_pass`)."""
    cfg, weights, linear = layer.deltanet, layer.deltanet_weights(), cache.linear
    state = linear.state(layer.index)
    if parents is None:
        got = deltanet_prefill(rows, weights, cfg, state, rows=layer.moe_rows)
        linear.stage(layer.index, {rows.shape[0] - 1: got.state})
        return got.out
    if len(parents) != rows.shape[0]:
        raise UnsupportedModel("a verify pass with rows beyond its draft tree's nodes (lookahead decoding) does not "
                               "run on Gated DeltaNet layers")
    got = deltanet_tree(rows, parents, weights, cfg, state, rows=layer.moe_rows)
    linear.stage(layer.index, dict(enumerate(got.states)))
    return got.out


# The block's math around attention, shared by DecoderLayer.forward and the ONNX graph's layer step
# (mtpctl.export.onnx._layer_step): each computes attention its own way (batch-invariant over the
# runtime's cache; one masked softmax over a functional cache) between these two. Written with
# non-negative dims, so a traced graph needs no Mod op.

def qkv_heads(layer: DecoderLayer, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm,
              positions: Optional[torch.Tensor] = None):
    """Queries ``[batch, heads, N, head_dim]``, keys and values ``[batch, kv_heads, N, head_dim]``
    from the fused q/k/v projection ``qkv [batch, N, q + 2 kv]``: with the family's QK-norm
    (``norm``: the RMSNorm function to apply), queries and keys rotated in one go (pairs of adjacent
    values with ``cfg.pair_rope``; not at all in a NoPE layer), then RMS-normed without a weight where
    the layer has ``qk_l2_weight``; a NoPE layer's queries scaled by position (``positions [batch, N]``,
    :func:`temperature_scales`) where it has ``temperature``."""
    cfg = layer.cfg
    hd, heads, kv_heads = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    qk = qkv[..., :layer.q_size + layer.kv_size].unflatten(2, (heads + kv_heads, hd))
    if layer.q_norm is not None:
        qk = torch.cat((norm(qk[:, :, :heads], layer.q_norm, cfg.rms_norm_eps),
                        norm(qk[:, :, heads:], layer.k_norm, cfg.rms_norm_eps)), dim=2)
    if layer.rotary:
        qk = _rotate_pairs(qk, cos, sin) if cfg.pair_rope else _rotate_partial(qk, cos, sin)
    if layer.qk_l2_weight is not None:
        qk = norm(qk, layer.qk_l2_weight, cfg.rms_norm_eps)
    if layer.temperature is not None:
        if positions is None:
            raise ValueError("a layer whose queries are scaled by position needs the tokens' positions")
        scale = temperature_scales(positions, *layer.temperature)[..., None, None]
        qk = torch.cat(((qk[:, :, :heads].float() * scale).to(qk.dtype), qk[:, :, heads:]), dim=2)
    qk = qk.transpose(1, 2)
    q, k = qk[:, :heads], qk[:, heads:]
    v = qkv[..., layer.q_size + layer.kv_size:].unflatten(2, (kv_heads, hd)).transpose(1, 2)
    return q, k, v


def mla_parts(layer: DecoderLayer, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Multi-head latent attention's pieces from the fused ``q_a_proj``/``kv_a_proj_with_mqa`` product
    ``qkv [batch, N, ...]`` (or ``q_proj``'s without ``q_lora_rank``): each query head's non-rotary part
    ``[batch, N, heads, qk_nope_head_dim]`` and rotary part ``[batch, N, heads, qk_rope_head_dim]``, and
    each token's cache row ``[batch, 1, N, kv_lora_rank + qk_rope_head_dim]``: the latent after
    ``kv_a_layernorm``, then the rotary key every head shares. The rotary parts turn with cos/sin
    ``[batch, N, 1, qk_rope_head_dim]``. The latents' RMSNorms are torch's (:func:`_rms_norm`), row by
    row alike in any pass."""
    cfg, m = layer.cfg, layer.mla
    heads, eps = cfg.num_attention_heads, cfg.rms_norm_eps
    first = m.q_lora_rank if m.q_lora_rank else heads * m.qk_head_dim
    q = qkv[..., :first]
    if m.q_lora_rank:
        q = _linear(_rms_norm(q, layer.q_a_norm, eps), layer.q_b)
    q = q.unflatten(2, (heads, m.qk_head_dim))
    latent = _rms_norm(qkv[..., first:first + m.kv_lora_rank], layer.kv_a_norm, eps)
    rotate = _rotate_interleaved if m.rope_interleave else _rotate
    q_rot = rotate(q[..., m.qk_nope_head_dim:], cos, sin)
    k_rot = rotate(qkv[..., first + m.kv_lora_rank:][:, :, None], cos, sin)[:, :, 0]
    return q[..., :m.qk_nope_head_dim], q_rot, torch.cat((latent, k_rot), dim=-1)[:, None]


def latent_weights(layer: DecoderLayer) -> Tuple[torch.Tensor, torch.Tensor]:
    """``kv_b_proj``'s two parts per head, views of its weight: ``W_UK [heads, qk_nope_head_dim,
    kv_lora_rank]`` (latent -> non-rotary key) and ``W_UV [heads, v_head_dim, kv_lora_rank]`` (latent ->
    value)."""
    m = layer.mla
    w = layer.kv_b.view(layer.cfg.num_attention_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
    return w[:, :m.qk_nope_head_dim], w[:, m.qk_nope_head_dim:]


def head_products(x: torch.Tensor, w: torch.Tensor, rows: Optional[int]) -> torch.Tensor:
    """Each head's product ``x [heads, M, K] @ w [heads, K, N]`` -> ``[heads, M, N]``. With ``rows`` in
    blocks of exactly that many rows (the last padded with zero rows), as :class:`FixedRowsLinear`
    computes: every row then comes out of a product of one shape, the same alone or among others; None:
    one product (prefill and teacher-forced passes)."""
    if rows is None:
        return torch.matmul(x, w)
    m = x.shape[1]
    padded = F.pad(x, (0, 0, 0, -m % rows)) if m % rows else x
    blocks = [torch.matmul(block, w) for block in padded.split(rows, dim=1)]
    return (blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1))[:, :m]


def latent_attention(layer: DecoderLayer, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, mask,
                     plan) -> torch.Tensor:
    """Multi-head latent attention over the compressed cache (:class:`~mtpctl.model.kv_cache.LatentCache`),
    in the absorbed form: each head's non-rotary query is taken into the latent space (``q_nope @ W_UK``),
    joined by its rotary part, and attends as one of ``heads`` query heads over one KV head, the cache
    rows (keys: latent and rotary key; values: the latent); each head's latent result leaves through
    ``W_UV``. The same scores as the expanded keys give (``q_nope . (W_UK c) = (q_nope W_UK) . c``),
    rounded otherwise. Both products run in fixed row blocks in decode and verify passes
    (:func:`head_products`), attention on torch's batch-invariant ops (:func:`_attention`), so a row's
    result does not depend on its pass. ``qkv``, cos/sin as :func:`mla_parts` takes them; ``cache``,
    ``mask``, ``plan`` as :meth:`DecoderLayer.forward`. ``[batch, heads, N, v_head_dim]`` in ``qkv``'s
    dtype.

    Raises:
        UnsupportedModel: a native-kernel plan (:class:`SlotPlan`): the kernel does not attend over a latent.
    """
    cfg, m = layer.cfg, layer.mla
    b, n, heads = qkv.shape[0], qkv.shape[1], cfg.num_attention_heads
    rows = None if plan is None else layer.moe_rows
    q_nope, q_rot, row = mla_parts(layer, qkv, cos, sin)
    w_uk, w_uv = latent_weights(layer)
    q_lat = head_products(q_nope.permute(2, 0, 1, 3).reshape(heads, b * n, -1), w_uk, rows)
    q = torch.cat((q_lat.reshape(heads, b, n, -1).transpose(0, 1), q_rot.transpose(1, 2)), dim=-1)
    i = layer.cache_index
    if isinstance(plan, SlotPlan):
        raise UnsupportedModel("multi-head latent attention runs on torch's attention, not the native kernel")
    if plan is not None:  # one plan per sequence of the pass, each over its own cache
        cache.write(i, row, row[..., :m.kv_lora_rank])
        parts = [_attention(q[:, :, start:start + count], seq.k[i], seq.v[i], cfg.scale, seq_plan)
                 for seq, start, count, seq_plan in zip(cache.caches, cache.starts, cache.counts, plan)]
        attn = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    else:
        keys, values = cache.write(i, row, row[..., :m.kv_lora_rank])
        used = cache.length + n
        attn = F.scaled_dot_product_attention(q.float(), keys[:, :, :used].float(), values[:, :, :used].float(),
                                              attn_mask=mask[..., :used], enable_gqa=True, scale=cfg.scale)
    attn = attn.to(qkv.dtype).transpose(0, 1).reshape(heads, b * n, m.kv_lora_rank)  # [heads, M, kv_lora_rank]
    out = head_products(attn, w_uv.transpose(1, 2), rows)
    return out.reshape(heads, b, n, m.v_head_dim).transpose(0, 1)


def attention_out_and_mlp(layer: DecoderLayer, x: torch.Tensor, attn: torch.Tensor, norm) -> torch.Tensor:
    """The rest of the block after attention ``attn [batch, N, heads * head_dim]``: output projection
    (normed first with sandwich norms) and residual, then the gated MLP and its residual."""
    return mlp_and_residual(layer, _add_projection(layer, x, attn, layer.o_proj, getattr(layer, "o_bias", None),
                                                   layer.attn_out_norm, norm), norm)


def mixer_out_and_mlp(layer: DecoderLayer, x: torch.Tensor, out: torch.Tensor, norm) -> torch.Tensor:
    """The block after its token mixer's projected output ``out [batch, N, hidden]`` (a Gated DeltaNet
    layer's): sandwich norm where the family has it and the residual, then the gated MLP and its residual."""
    if layer.attn_out_norm is not None:
        out = norm(out, layer.attn_out_norm, layer.cfg.rms_norm_eps)
    return mlp_and_residual(layer, x + out, norm)


def mlp_and_residual(layer: DecoderLayer, x: torch.Tensor, norm) -> torch.Tensor:
    """``x`` plus the layer's gated MLP (or MoE) of ``norm(x)``, normed first with sandwich norms."""
    eps = layer.cfg.rms_norm_eps
    moe = getattr(layer, "moe", None)
    if moe is None:
        gate, up = _linear(norm(x, layer.post_attention_norm, eps), layer.gate_up, layer.gate_up_bias).chunk(2, dim=2)
        return _add_projection(layer, x, layer.act(gate) * up, layer.down, layer.down_bias, layer.mlp_out_norm, norm)
    weights = MoeWeights(router=layer.router, gate_up=layer.experts_gate_up, down=layer.experts_down,
                         score_bias=getattr(layer, "router_bias", None),
                         shared_gate_up=getattr(layer, "shared_gate_up", None),
                         shared_down=getattr(layer, "shared_down", None),
                         router_bias=getattr(layer, "router_logit_bias", None),
                         gate_up_bias=getattr(layer, "experts_gate_up_bias", None),
                         down_bias=getattr(layer, "experts_down_bias", None),
                         shared_gate=getattr(layer, "shared_expert_gate", None))
    out = moe_mlp(norm(x, layer.post_attention_norm, eps), moe, weights, layer.moe_rows)  # each row's experts alike
    if layer.mlp_out_norm is not None:
        out = norm(out, layer.mlp_out_norm, eps)
    return x + out


def _add_projection(layer: DecoderLayer, x: torch.Tensor, inp: torch.Tensor, weight, bias: Optional[torch.Tensor],
                    out_norm: Optional[torch.Tensor], norm) -> torch.Tensor:
    """The residual ``x`` plus ``inp``'s projection by ``weight`` (and ``bias``), normed by ``out_norm``
    first where the family has a sandwich norm. Off the CPU a :class:`FixedRowsLinear` with neither bias
    nor norm adds ``x`` in its product (:meth:`FixedRowsLinear.add_to`: one launch instead of two); the
    CPU keeps the product and the add apart, whose bits the tests against transformers hold."""
    if isinstance(weight, FixedRowsLinear) and bias is None and out_norm is None and x.device.type != "cpu":
        return weight.add_to(inp, x)
    out = _linear(inp, weight, bias)
    if out_norm is not None:
        out = norm(out, out_norm, layer.cfg.rms_norm_eps)
    return x + out


def _native_blob(linear) -> Optional[torch.Tensor]:
    """The weight blob the native matmul reads of a linear layer (int4/int8 codes or bfloat16 tiles), or
    None where it runs elsewhere."""
    if isinstance(linear, TiledLinear):
        return linear.blob
    if isinstance(linear, PackedLinear) and linear.native:
        return linear.parts[0][0]
    return None


@dataclass(frozen=True, eq=False)
class _Slot:
    """A parameter that checkpoint tensors fill: ``owner.attr``, the tensors ``names`` stacked by rows
    (q, k, v -> qkv); ``norm``: a norm weight (held as ``norm_offset + w`` in float32 where the config
    has an offset)."""

    owner: nn.Module
    attr: str
    names: Tuple[str, ...]
    norm: bool = False


def _slots(model: "Decoder", present=None) -> List[_Slot]:
    """Every parameter of ``model`` that checkpoint tensors fill, as its family's tensor map names them
    (:meth:`mtpctl.model.families.Family.slots`; a tied lm_head is none: it follows the embedding); a MoE
    layer's experts in the layout of the checkpoint's names ``present`` (a set; None: stacked)."""
    cfg = model.cfg
    family = cfg.family
    slots = [_Slot(model, attr, names, norm) for attr, names, norm in family.slots(cfg)
             if attr != "lm_head" or not cfg.tie_word_embeddings]
    for i, layer in enumerate(model.layers):
        slots += [_Slot(layer, attr, names, norm) for attr, names, norm in family.slots(cfg, i, present)]
    return slots


def _rows(shape: tuple) -> int:
    """Rows a tensor of ``shape`` fills in its stacked parameter: its first dim, or for a tensor of more
    than two dims its rows of the last dim (an expert stack ``[E, R, C]``: E * R)."""
    return math.prod(shape[:-1]) if len(shape) > 2 else shape[0]


def _rows_of(dest: torch.Tensor, row: int, shape: tuple) -> torch.Tensor:
    """The part of stacked parameter ``dest`` that a tensor of ``shape`` fills from row ``row`` (rows
    counted as :func:`_rows` does), viewed in that shape."""
    if dest.dim() <= 2 and len(shape) == dest.dim():
        return dest.narrow(0, row, shape[0])
    return dest.view(-1, dest.shape[-1]).narrow(0, row, _rows(shape)).view(shape)


def checkpoint_tensors(model: "Decoder", shapes: Dict[str, tuple],
                       stored: Optional[Dict[str, torch.Tensor]] = None) -> Dict[str, torch.Tensor]:
    """The inverse of loading: each checkpoint tensor named in ``shapes`` (name -> shape, the family's
    names, as the checkpoint the model was loaded from has them) as views of the rows of ``model``'s
    (fused) parameter it filled, in the model's dtype; names no parameter holds are left out. Only for
    a model whose parameters are dense (loaded without ``packed`` or ``blocked``).

    A config whose norms hold an offset (``offset + w``, Gemma's, Qwen3.5's) needs ``stored``, the
    checkpoint's own values of its norm tensors by name: each norm is given back by
    :func:`stored_norm` (as stored where it did not change).

    Raises:
        ValueError: a parameter held by a kernel, or a config whose norms hold an offset without ``stored``.
    """
    offset = model.cfg.norm_offset
    if offset and stored is None:
        raise ValueError("norm weights held with an offset are written back only beside their stored values")
    present = set(shapes) if model.cfg.moe is not None else None
    out: Dict[str, torch.Tensor] = {}
    for slot in _slots(model, present):
        if not any(name in shapes for name in slot.names):
            continue
        param = getattr(slot.owner, slot.attr)
        if not isinstance(param, torch.Tensor):
            raise ValueError(f"{slot.attr} is held by a kernel, not as a tensor")
        row = 0
        for name in slot.names:
            out[name] = _rows_of(param.detach(), row, shapes[name])
            if slot.norm and offset:
                out[name] = stored_norm(out[name], stored.get(name), offset)
            row += _rows(shapes[name])
    return out


def stored_norm(held: torch.Tensor, stored: Optional[torch.Tensor], offset: float) -> torch.Tensor:
    """A norm weight held as ``offset + w`` (float32) given back as its checkpoint's ``w``: ``stored`` itself
    (bit for bit) while ``held`` is still what loading made of it, else ``held - offset``."""
    if stored is not None and torch.equal(stored.to(held.device, torch.float32) + offset, held):
        return stored
    return held - offset


class _Filler:
    """Fills a :class:`Decoder`'s parameters from a tensor source (:class:`CheckpointReader`,
    :class:`MemoryTensors`) one source tensor at a time, in the source's order.

    A tensor goes straight into its rows of its (fused) parameter, which a placeholder (``meta``)
    becomes on the model's device when its first tensor arrives. A linear weight that a kernel may
    hold (``packed``, ``blocked``) is gathered into its own fused tensor, in the file's dtype, and handed
    to the kernel once complete (a dense parameter where the kernel does not take it). On the CPU, an
    embedding or a dense untied lm_head placeholder whose file dtype is the model's is memory-mapped.
    """

    def __init__(self, model: "Decoder", source, packed: bool, blocked: bool, native_int4: Optional[bool]):
        self.model, self.source = model, source
        self.packed, self.blocked, self.native_int4 = packed, blocked, native_int4
        # where the codes run: a path checked row-invariant on this CPU (None: none holds, held dense)
        self.int4 = int4_path(model.dtype, native_int4) if packed else None
        self.where: Dict[str, Tuple[_Slot, int]] = {}
        self.open: Dict[_Slot, Tuple[torch.Tensor, set, bool]] = {}  # destination, names to come, for a kernel

    def run(self) -> None:
        """Fill every slot (raises CorruptModel when the source lacks a tensor)."""
        present = set(self.source.names) if self.model.cfg.moe is not None else None
        for slot in _slots(self.model, present):
            row = 0
            for name in slot.names:
                if name not in self.source:
                    raise CorruptModel(f"{self.source.source}: missing tensor {name!r}")
                self.where[name] = (slot, row)
                row += _rows(self.source.shape(name))
        for name in self.source.names:
            if name in self.where:
                self._put(name)
        self.model._stack = None

    def _put(self, name: str) -> None:
        slot, row = self.where[name]
        if slot not in self.open:
            dest, held = self._begin(slot)
            if dest is None:  # filled whole
                self._done(slot)
                return
            self.open[slot] = (dest, set(slot.names), held)
        dest, left, held = self.open[slot]
        self.source.read_into(name, _rows_of(dest, row, self.source.shape(name)))
        left.discard(name)
        if not left:
            del self.open[slot]
            self._arrange(slot, dest)
            if held and not self._hold(slot.owner, slot.attr, dest):
                self._materialize(slot).copy_(dest)
            self._done(slot)

    def _begin(self, slot: _Slot) -> Tuple[Optional[torch.Tensor], bool]:
        """(where the slot's tensors go, whether that is a fused tensor for a kernel); (None, False)
        when the slot was filled here whole."""
        placeholder = slot.owner._parameters[slot.attr]
        offset = self.model.cfg.norm_offset
        if slot.norm and offset:  # Gemma's (1 + w), added once in float32
            self._materialize(slot).copy_(self.source.read(slot.names[0]).float() + offset)
            return None, False
        if self._may_hold(slot.attr, tuple(placeholder.shape)):
            dtype = reduce(torch.promote_types, (self.source.dtype(n) for n in slot.names))
            return torch.empty(placeholder.shape, dtype=dtype), True
        if self._mappable(slot, placeholder):
            mapped = self.source.mapped(slot.names[0])
            if mapped is not None:
                setattr(slot.owner, slot.attr, nn.Parameter(mapped, requires_grad=False))
                return None, False
        return self._materialize(slot), False

    def _may_hold(self, attr: str, shape: tuple) -> bool:
        """Whether :meth:`_hold` may take this linear weight (packing depends on its values)."""
        return attr in LINEARS and (self.int4 is not None or self.blocked)

    def _mappable(self, slot: _Slot, placeholder: torch.Tensor) -> bool:
        return (slot.attr in ("embed", "lm_head") and placeholder.is_meta and self.model._home.type == "cpu"
                and self.source.dtype(slot.names[0]) == placeholder.dtype)

    def _materialize(self, slot: _Slot) -> torch.Tensor:
        """The slot's parameter's tensor, a placeholder first replaced by an uninitialized parameter on
        the model's device."""
        param = slot.owner._parameters[slot.attr]
        if param.is_meta:
            param = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=self.model._home),
                                 requires_grad=False)
            setattr(slot.owner, slot.attr, param)
        return param.data

    def _arrange(self, slot: _Slot, rows: torch.Tensor) -> None:
        """Once a slot's tensors are all read into ``rows`` (before a kernel holds them): Qwen3-Next's
        grouped Gated DeltaNet input projection put in q, k, v, z, b, a order, in place."""
        if slot.attr == "in_proj" and self.model.cfg.family.grouped_in_proj:
            rows.copy_(rows[grouped_rows(slot.owner.deltanet).to(rows.device)])

    def _done(self, slot: _Slot) -> None:
        """After the embedding, a tied lm_head: held by a kernel (a packed one from the file's values), else
        the embedding itself."""
        model = self.model
        if slot.owner is not model or slot.attr != "embed" or not model.cfg.tie_word_embeddings:
            return
        value = self.source.read(EMBED) if self.packed else model.embed.detach()
        if not self._hold(model, "lm_head", value):
            model.lm_head = model.embed

    def _hold(self, owner: nn.Module, attr: str, value: torch.Tensor) -> bool:
        """Hold a linear weight for a decoding kernel instead of as a Parameter: packed (int4) where its
        values are on a 4-/8-bit grid, else (``blocked``) dense on the fastest path that computes a row
        alike in any pass on this CPU (:func:`mtpctl.model.row_invariance.dense_path`: the native tiles,
        oneDNN's blocked layout, or torch's matmul in fixed blocks of rows)."""
        if attr not in LINEARS:
            return False
        dtype = self.model.dtype
        native = None if self.int4 == "native-int4" else False
        module = pack_exact(value, dtype, native) if self.int4 is not None else None
        if module is not None:
            self.model.packed_weights.append(f"{getattr(owner, 'index', 'model')}.{attr}")
        elif self.blocked:
            module = dense_linear(value, dtype)
        else:
            return False
        owner._parameters.pop(attr, None)  # a Parameter slot cannot hold a module
        setattr(owner, attr, module)
        return True


class Decoder(nn.Module):
    """The target model: embeddings, ``num_hidden_layers`` blocks, final norm and lm_head.

    Weights are frozen (``requires_grad=False``); build with :meth:`from_folder`. Sliding-window
    layers rotate with ``cfg.rope_local`` when the config gives them their own rope (Gemma 3).
    """

    def __init__(self, cfg: DecoderConfig, dtype: torch.dtype = torch.float32, device="cpu", lazy: bool = False):
        """``lazy``: the weights are placeholders on the ``meta`` device (no memory) until
        :meth:`load_hf_tensors` or :meth:`from_folder` puts each on ``device``."""
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        self._home = torch.device(device)  # where loading puts the weights
        where = "meta" if lazy else device
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=where),
                                  requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, device, lazy) for i in range(cfg.num_hidden_layers))
        norm_dtype = torch.float32 if cfg.norm_offset else dtype
        self.norm = nn.Parameter(torch.empty(cfg.hidden_size, dtype=norm_dtype, device=where), requires_grad=False)
        self.final_norm = _rms_norm_float32_scale if cfg.norm_offset else _rms_norm
        # Gemma: embeddings times sqrt(hidden_size), the factor rounded to the weights' dtype first
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size ** 0.5, dtype=torch.float32).to(device, dtype)
                             if cfg.scaled_embeddings else None, persistent=False)
        self.packed_weights: list = []  # names of the weights held packed (see load_hf_tensors)
        self.lm_head = self.embed if cfg.tie_word_embeddings else nn.Parameter(
            torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=where), requires_grad=False)
        # rotary tables [positions, rope_dim] (rope_local_*: None where sliding-window layers share the
        # global rope): the first ROPE_START positions now, more as caches and passes ask (reserve_rope)
        for name in ROPE_TABLES:
            self.register_buffer(name, None, persistent=False)
        self.reserve_rope(1)
        # per layer: rotate with the local rope (a sliding-window layer of a config that has one)
        self.local_rope = tuple(w is not None and cfg.rope_local is not None for w in cfg.layer_windows)
        #: decode and verify passes run every layer in one native call where it covers the blocks
        #: (:meth:`native_stack`); False runs them layer by layer (comparisons, profiles)
        self.layer_stack = True
        self._stack: Optional[Tuple[int, Optional[StackWeights]]] = None  # (id of the model it describes, stack)
        #: rows a decode or verify pass is padded to a multiple of on the device path (None: not padded)
        self.pass_block: Optional[int] = None

    @property
    def rope_positions(self) -> int:
        """Positions the rotary tables hold now (rows of ``rope_cos``); :meth:`reserve_rope` grows them."""
        return self.rope_cos.shape[0]

    def reserve_rope(self, end: int) -> None:
        """Build the rotary tables for positions ``[0, end)`` at least (``end``: a host int, so nothing
        waits on the device): when they hold fewer, they grow to the next power of two at or above
        ``end``, at least :data:`ROPE_START`, at most ``max_position_embeddings`` (an ``end`` past it
        builds them whole). The rows already built stay; the new ones hold the bits a table built at once
        would hold (:func:`rope_rows`), in float32 for ``pair_rope`` (Llama 4), else the model's dtype.
        A copy of the model that shares its buffer dict (:func:`mtpctl.drafters.self_draft.layer_subset`)
        sees the grown tables too."""
        cfg, have = self.cfg, 0 if self.rope_cos is None else self.rope_cos.shape[0]
        limit = cfg.max_position_embeddings
        if end <= have or have >= limit:
            return
        size = min(limit, max(ROPE_START, 1 << (end - 1).bit_length()))
        table = torch.float32 if cfg.pair_rope else self.dtype  # Llama 4 rotates in float32
        device = self.rope_cos.device if have else self._home
        for prefix, rope in (("rope", cfg.rope), ("rope_local", cfg.rope_local)):
            if rope is None:  # sliding-window layers share the global rope
                continue
            with torch.inference_mode(False):  # plain tensors, which training passes may also read
                rows = [t.to(device, table) for t in rope_rows(rope, cfg.rope_dim, have, size)]
                if have:
                    rows = [torch.cat((getattr(self, prefix + part), new)) for part, new in zip(("_cos", "_sin"), rows)]
            setattr(self, prefix + "_cos", rows[0])
            setattr(self, prefix + "_sin", rows[1])

    def rope(self, positions: torch.Tensor, local: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[*positions.shape, rope_dim]`` at ``positions`` (long, on the model's device) of
        the global rotary tables, or with ``local`` of the sliding-window layers' own (the global ones
        where the config has none).

        Positions past the tables' rows grow them when ``positions`` is on the CPU (torch's bounds check
        finds them; nothing is checked otherwise). On a GPU the rows must be there already: a KV cache
        reserves its slots' positions when it is made (:meth:`new_cache`), and other callers
        :meth:`reserve_rope` from the host.

        Raises:
            ValueError: a position at or past ``max_position_embeddings``.
        """
        cos, sin = (self.rope_local_cos, self.rope_local_sin) if local and self.rope_local_cos is not None \
            else (self.rope_cos, self.rope_sin)
        try:
            return cos[positions], sin[positions]
        except IndexError:  # a position past the rows built so far (or past the model's context)
            last, limit = int(positions.max()), self.cfg.max_position_embeddings
            if last >= limit:
                raise ValueError(f"position {last} is past the model's context of {limit} positions "
                                 "(max_position_embeddings)") from None
            if last < self.rope_positions:
                raise  # not a position the tables lack (a negative one past their length)
            self.reserve_rope(last + 1)
            return self.rope(positions, local)

    @classmethod
    def from_folder(cls, folder: Path, dtype: torch.dtype = torch.float32, packed: bool = False,
                    blocked: bool = False, native_int4: Optional[bool] = None, device="cpu") -> "Decoder":
        """Load ``config.json`` and ``*.safetensors`` from a Hugging Face checkpoint folder, strictly.

        Args:
            packed: keep the linear weights that are 4-bit/8-bit group-quantized (GGUF Q4_1 / Q8_0
                imports) packed for the int4 CPU kernel (:mod:`mtpctl.model.linears`); bfloat16 only.
            blocked: hold the other linear weights for decoding kernels (the same values, faster decode
                and verify passes): bfloat16 ones in the native kernels' tiles (:class:`TiledLinear`)
                where those build, else (and float32 ones) in oneDNN's blocked layout
                (:class:`BlockedLinear`) where torch has oneDNN. Such a model has no ``state_dict``
                entries for them and cannot be traced to ONNX.
            native_int4: packed weights run on the native int4 kernel where it runs (None), or on
                torch's (False; see :class:`PackedLinear`).
            device: where the weights go (``"cpu"``, ``"cuda:0"``, a :class:`torch.device`).

        Names and shapes are checked from the files' headers before any weight is read; the tensors
        are then read one at a time (:class:`CheckpointReader`) straight into their parameters on
        ``device``, so loading holds the weights (in ``dtype``) plus about one tensor. On the CPU, an
        embedding (or a dense untied lm_head) whose file dtype is ``dtype`` is memory-mapped from its
        file instead of copied (only the rows used become resident); such a file must not be rewritten
        in place while the model lives (replacing it, as mtpctl's own writers do, is safe).

        Raises:
            CorruptModel: missing/unexpected/mis-shaped/NaN tensors, unreadable files.
            UnsupportedModel: an architecture outside the Llama family, or ``packed`` without bfloat16.
        """
        cfg = DecoderConfig.from_folder(Path(folder))
        if packed and dtype != torch.bfloat16:
            raise UnsupportedModel("int4 weights run with bfloat16 activations, not float32", option="dtype")
        optional = ("lm_head.weight",) if cfg.tie_word_embeddings else ()
        files = shard_files(Path(folder))
        renames = cfg.family.renames
        # the experts' layout, from the names as the tensor map reads them
        names = {renamed(n, renames) for n in read_headers(files)} if cfg.moe is not None else None
        # native MTP layers are not the body's (mtpctl.drafters.mtp reads them): not read, not checked
        layout, body = cfg.family.mtp_layout, cfg.num_hidden_layers
        mtp = layout.tensor_prefixes(body, cfg.mtp_layers) if layout is not None else \
            tuple(f"model.layers.{i}." for i in range(body, body + cfg.mtp_layers))
        mtp += cfg.family.ignored  # tensors the family's body never reads (Qwen3.5's mtp.*, its vision tower)
        reader = CheckpointReader(files, expected_tensors(cfg, names), optional, ignored=mtp,
                                  renames=renames, fp8_block=cfg.fp8_block, mxfp4=cfg.mxfp4)  # headers only
        model = cls(cfg, dtype, device, lazy=True)
        _Filler(model, reader, packed, blocked, native_int4).run()
        return model

    def load_hf_tensors(self, t: Dict[str, torch.Tensor], packed: bool = False, blocked: bool = False,
                        native_int4: Optional[bool] = None) -> None:
        """Copy checkpoint tensors (already checked by name and shape) into the fused parameters.

        With ``packed``, each linear weight on a Q4_1/Q8_0 grid (detected on the checkpoint's float32
        values, see :func:`pack_exact`) is held as a :class:`PackedLinear` instead; their names are
        listed in ``packed_weights``. With ``blocked`` the other linear weights are held as
        :class:`TiledLinear` (bfloat16, where the native kernels build) or :class:`BlockedLinear`
        (oneDNN's blocked layout, where torch has oneDNN), the same values either way.

        Raises:
            CorruptModel: a tensor the model needs is not in ``t``.
        """
        _Filler(self, MemoryTensors(t), packed, blocked, native_int4).run()

    @property
    def stack(self) -> Optional[StackWeights]:
        """What decode and verify passes hand the native layer stack (:meth:`native_stack`), or None
        where they run layer by layer. Built on first use for this very object: a copy of the model
        (``copy.copy`` of a layer subset, ``copy.deepcopy``) builds its own from its own layers."""
        if not self.layer_stack:
            return None
        if self._stack is None or self._stack[0] != id(self):
            self._stack = (id(self), self.native_stack())
        return self._stack[1]

    def native_stack(self) -> Optional[StackWeights]:
        """What the native layer stack (:func:`mtpctl.model.native.layer_stack`) reads of this model's
        layers, or None where it does not cover them: it covers bfloat16 blocks of the families that
        allow it (:attr:`mtpctl.model.families.Family.native_stack`) whose four
        linear weights all run on the native kernels (int4 codes or bfloat16 tiles), without biases,
        q/k norms, sandwich norms, scaled embeddings, sliding windows or a second rope, with SiLU and
        shapes the native attention and norms take."""
        cfg, layers = self.cfg, list(self.layers)
        linears = ("qkv", "o_proj", "gate_up", "down")
        covered = cfg.family.native_stack and self.dtype == torch.bfloat16 and cfg.hidden_act == "silu" \
            and not cfg.norm_offset \
            and self.embed_scale is None and all(w is None for w in cfg.layer_windows) \
            and norm_takes(cfg.hidden_size) and kernel_takes(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) \
            and all(_native_blob(getattr(layer, name)) is not None for layer in layers for name in linears) \
            and all(layer.qkv_bias is None and layer.gate_up_bias is None and layer.q_norm is None
                    and layer.attn_out_norm is None and layer.native_norms for layer in layers)
        if not covered or not layers:
            return None
        rows, keep = [], []
        for layer in layers:
            blobs = [_native_blob(getattr(layer, name)) for name in linears]
            norms = [layer.input_norm.detach(), layer.post_attention_norm.detach()]
            keep += norms + blobs
            rows.append([t.data_ptr() for t in norms + blobs] + [blob.shape[2] for blob in blobs])
        shape = [len(layers), cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                 cfg.num_key_value_heads, cfg.head_dim]
        return StackWeights(torch.tensor(rows, dtype=torch.long), torch.tensor(shape, dtype=torch.long), tuple(keep),
                            cfg.rms_norm_eps, cfg.scale)

    def new_cache(self, capacity: int, batch: int = 1, spare: int = 0, compact: bool = False) -> KVCache:
        """An empty KV cache for ``capacity`` tokens and ``spare`` never-written slots (a
        :class:`LatentCache` for multi-head latent attention). Attention runs in
        float32 in every dtype, so on the CPU the cache is float32 (torch's ops read it without
        converting), or with ``compact`` in a bfloat16 model's dtype: its keys and values are bfloat16
        values, so nothing is rounded, and the native kernels, which widen what they read, read half the
        bytes (a pass's attention reads every committed slot of its sequences). Off the CPU a bfloat16
        model's cache is bfloat16 wherever attention's products can take bfloat16 operands and give
        float32 there (:func:`_product`, :func:`~mtpctl.model.device.widening_products`: CUDA), else float32.

        The rotary tables grow to hold the positions of its slots, one past them included (an MTP
        layer's row at slot s sits at position s + 1), here on the host rather than at each pass."""
        c = self.cfg
        self.reserve_rope(capacity + spare + 1)
        compact = compact or widening_products(self.device)
        dtype = torch.bfloat16 if compact and self.dtype == torch.bfloat16 else torch.float32
        linear = [layer.index for layer in self.layers if layer.deltanet is not None]
        if c.mla is not None:  # the compressed rows of multi-head latent attention (latent attention)
            return LatentCache(c.num_hidden_layers, batch, c.mla.kv_lora_rank, c.mla.qk_rope_head_dim, capacity,
                               dtype, self.device, spare=spare)
        cache = KVCache(c.num_hidden_layers - len(linear), batch, c.num_key_value_heads, c.head_dim, capacity, dtype,
                        self.device, spare=spare)  # slots for the attention layers only
        if c.deltanet is not None:  # a hybrid body: each Gated DeltaNet layer's state beside the cache
            cache.linear = LinearCache(c.deltanet, linear, self.device)
        return cache

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: Union[KVCache, PassSlots],
                masks: Optional[Dict[Optional[int], torch.Tensor]], plans: Optional[dict] = None,
                aux: Optional[Dict[int, Optional[torch.Tensor]]] = None) -> torch.Tensor:
        """Run N new tokens per row against the KV cache(s); their KV go to the slots after each
        sequence's committed ones, uncommitted (the caller commits accepted slots).

        Args:
            input_ids: ``[batch, N]`` token ids.
            position_ids: ``[batch, N]`` positions (a token's depth in a draft tree adds to its
                sequence's committed length).
            cache: teacher-forced passes and prefill without the native kernels: the :class:`KVCache`
                of ``batch`` sequences of the same length; decode, verify and native prefill passes:
                :class:`PassSlots`, batch 1, the rows of one or more sequences packed, each sequence
                with its own cache.
            masks: attention window (None = full) -> bool mask ``[batch|1, 1, N, capacity]``
                (True = may attend), from :func:`mtpctl.decode.attention.attention_masks`: prefill
                without the native kernels and teacher-forced passes (the fused SDPA kernel, where
                only speed matters).
            plans: instead of masks, for decode, verify and native prefill passes: attention window -> a
                :class:`SlotPlan` of every row (the native attention kernel and native RMSNorm,
                :mod:`mtpctl.model.native`) or a tuple of one :class:`AttentionPlan` per sequence
                (torch's ops), so that each token is computed exactly as it would be alone.
            aux: layer id -> filled here with the residual stream ``[batch, N, hidden]`` after that
                many decoder layers (0: the embeddings), for drafters that read intermediate layers
                (EAGLE-3); the ids are the keys given, the ids vLLM's ``eagle_aux_hidden_state_layer_ids``
                name.

        Returns:
            hidden_states after the final norm, ``[batch, N, hidden]``.
        """
        plan = None if plans is None or len(plans) != 1 else next(iter(plans.values()))
        if isinstance(plan, SlotPlan) and isinstance(cache, PassSlots) and self.stack is not None:
            return self._stacked(input_ids, position_ids, cache, plan, aux)
        x = F.embedding(input_ids, self.embed)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        if aux is not None and 0 in aux:
            aux[0] = x
        rot = tuple(t.unsqueeze(2) for t in self.rope(position_ids))  # 2 x [batch, N, 1, rope_dim]
        local = rot if self.rope_local_cos is None else tuple(t.unsqueeze(2) for t in self.rope(position_ids, True))
        for index, (layer, window, is_local) in enumerate(zip(self.layers, self.cfg.layer_windows, self.local_rope), 1):
            cos, sin = local if is_local else rot
            if plans is not None:
                x = layer(x, cos, sin, cache, None, plans[window], positions=position_ids)
            else:
                x = layer(x, cos, sin, cache, masks[window], positions=position_ids)
            if aux is not None and index in aux:
                aux[index] = x
        native = plans is not None and any(isinstance(p, SlotPlan) for p in plans.values()) \
            and norm_takes(self.cfg.hidden_size)
        return (rms_norm if native else self.final_norm)(x, self.norm, self.cfg.rms_norm_eps)

    def _stacked(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: PassSlots,
                 plan: SlotPlan, aux: Optional[Dict[int, Optional[torch.Tensor]]] = None) -> torch.Tensor:
        """:meth:`forward` of a decode or verify pass through the native layer stack (``self.stack``): in
        one call, or with ``aux`` in parts that end at its layers (each part computes what the whole
        stack does, so the tokens are the same either way)."""
        x = F.embedding(input_ids[0], self.embed)
        cos, sin = self.rope(position_ids[0])
        norm, layers = self.norm.detach(), self.cfg.num_hidden_layers
        if not aux:
            return layer_stack(x, self.stack, norm, cos, sin, cache.kv, cache.dest, cache.kv_bf16, plan)[None]
        if 0 in aux:
            aux[0] = x.clone()[None]
        start, out = 0, None
        for end in sorted({i for i in aux if 0 < i < layers} | {layers}):
            stack, kv = stack_part(self.stack, cache.kv, cache.kv_bf16, start, end)
            out = layer_stack(x, stack, norm, cos, sin, kv, cache.dest, cache.kv_bf16, plan)
            if end in aux:
                aux[end] = x.clone()[None]  # x holds the residual stream after layer ``end`` now
            start = end
        return out[None]

    @property
    def device(self) -> torch.device:
        """Where the weights are."""
        return self.embed.device

    def hold_fixed_rows(self, rows: int, device_path: bool = False) -> None:
        """Hold every dense linear weight (fused projections and the lm_head) as a
        :class:`FixedRowsLinear` of ``rows`` rows a block: the pure-torch path's batch-invariant linears
        (:mod:`mtpctl.model.device`), and MoE layers' experts in blocks of as many rows. The tensors are
        the same; packed, tiled or blocked weights stay as they are.

        ``device_path`` (the pure-torch path on a GPU, :class:`~mtpctl.backends.torch.TorchSession` sets
        it off the CPU): the norms run fused (:data:`FUSED_NORMS`), and a dense body's decode and
        verify passes carry a multiple of ``rows`` rows (:meth:`pass_rows`), so that every linear and
        norm of a layer sees one shape and pads nothing."""
        self.pass_block = rows if device_path and self.cfg.deltanet is None and self.cfg.mla is None \
            and not any(layer.moe is not None for layer in self.layers) else None
        if device_path:
            self.final_norm = FUSED_NORMS.get(self.final_norm, self.final_norm)  # held twice: still fused
        for layer in self.layers:
            layer.moe_rows = rows
            if device_path:
                layer.norm = FUSED_NORMS.get(layer.norm, layer.norm)
        for owner in (self, *self.layers):
            for name in LINEARS:
                weight = owner._parameters.get(name)
                if weight is not None:
                    owner._parameters.pop(name)
                    setattr(owner, name, FixedRowsLinear(weight, rows))
        self._stack = None

    @property
    def free_prefill(self) -> bool:
        """Whether a prefill may run free of the fixed shapes (the device path of a dense body without
        attention sinks): its linears in one product each (:func:`~mtpctl.model.linears.any_rows`) and its
        full-attention layers as torch's causal SDPA in the model's dtype, without a mask (flash attention
        on a GPU), instead of float32 scores over a bool mask of the whole cache. A prefill feeds plain and
        speculative decoding alike, so nothing it computes has to match another pass's rows."""
        return self.pass_block is not None and not self.cfg.attention_sinks

    def pass_rows(self, rows: int) -> int:
        """How many rows a decode or verify pass of ``rows`` tokens carries: ``rows`` rounded up to the
        device path's block (:meth:`hold_fixed_rows`; the extra rows are padding whose results nobody
        reads), or ``rows`` itself elsewhere."""
        block = self.pass_block
        return rows if block is None else -(-rows // block) * block

    @property
    def weight_bytes(self) -> int:
        """Memory held by the weights (dense parameters, blocked bfloat16 weights, packed int4 codes with
        their scales), bytes."""
        dense = {p.data_ptr(): p.numel() * p.element_size() for p in self.parameters()}
        # fixed-rows linears hold the checkpoint's tensors (a tied lm_head the embedding's): counted once
        dense.update((m.weight.data_ptr(), m.nbytes) for m in self.modules() if isinstance(m, FixedRowsLinear))
        packed = sum(t.numel() * t.element_size() for m in self.modules() if isinstance(m, PackedLinear)
                     for part in m.parts for t in part)
        blocked = sum(m.nbytes for m in self.modules() if isinstance(m, (BlockedLinear, TiledLinear)))
        return sum(dense.values()) + packed + blocked

    @property
    def logits_by_row(self) -> bool:
        """True when scoring rows one at a time beats scoring them together (an int4 lm_head)."""
        return isinstance(self.lm_head, PackedLinear)

    def logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """lm_head: ``[..., hidden]`` -> float32 logits ``[..., vocab]`` (soft-capped as
        ``cap * tanh(logits / cap)`` when the config sets ``final_logit_softcapping``)."""
        logits = _linear(hidden_states, self.lm_head).float()
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def logits_best(self, hidden_states: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """:meth:`logits` of rows ``[M, hidden]`` and, where the lm_head's kernel takes it while it writes
        them (native tiles or codes, no soft cap), each row's argmax ``[M]`` (the first index of its
        largest logit; -1 where the row holds NaN or inf), else None. The logits are the same either way."""
        forward_best = getattr(self.lm_head, "forward_best", None)
        if forward_best is not None and self.cfg.final_logit_softcapping is None and hidden_states.dim() == 2:
            got = forward_best(hidden_states)
            if got is not None:
                return got[0].float(), got[1]
        return self.logits(hidden_states), None

    def dense_lm_head(self) -> torch.Tensor:
        """The lm_head weight ``[vocab, hidden]`` as a dense tensor (a packed one is unpacked through
        its own kernel, so the values are those the model computes with)."""
        if isinstance(self.lm_head, (BlockedLinear, TiledLinear, FixedRowsLinear)):  # tied: the embedding holds them
            return self.embed.detach() if self.cfg.tie_word_embeddings else self.lm_head.dense()
        if not isinstance(self.lm_head, PackedLinear):
            return self.lm_head.detach()
        with torch.inference_mode():
            eye = torch.eye(self.cfg.hidden_size, dtype=self.dtype)
            return self.lm_head(eye).T.contiguous()
