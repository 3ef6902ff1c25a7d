"""Gated DeltaNet linear-attention layers (Qwen3.5, Qwen3-Next), computed so that speculation can roll
their recurrent state back exactly (docs/numerics.md, "Gated DeltaNet layers: state that verification
rolls back"). The Decoder calls it for the ``qwen3_5_text``, ``qwen3_5_moe_text`` and ``qwen3_next``
families (:func:`mtpctl.model.decoder.deltanet_pass`), each sequence's states held in a
:class:`~mtpctl.model.linear_cache.LinearCache` beside its KV cache.

A Gated DeltaNet layer keeps no KV cache: each sequence carries a fixed-size :class:`LinearState`, the
last ``K - 1`` inputs of a short causal depthwise convolution over q, k and v (``conv [conv_dim, K-1]``)
and one matrix per value head (``recurrent [Hv, dk, dv]``), both float32. For a token with hidden state
``x``:

1. one projection gives q, k, v (``conv_dim = 2 * Hk * dk + Hv * dv`` channels), the output gate z
   (``Hv * dv``), and b and a (``Hv`` each);
2. q, k, v go through the depthwise convolution (kernel K, no bias) over the previous ``K - 1`` inputs
   and this one, then SiLU;
3. q and k are L2-normalised per head (eps 1e-6, in float32) and q is divided by ``sqrt(dk)``; a key
   head serves ``Hv / Hk`` consecutive value heads;
4. ``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a + dt_bias)`` (float32);
5. the gated delta rule, per value head: ``S = exp(g) * S``; ``delta = beta * (v - S^T k)``;
   ``S = S + k delta^T``; output ``o = S^T q``;
6. a gated RMSNorm per head: ``w * rmsnorm(o) * silu(z)`` (the norm's weight is used as it is, not
   ``1 + w``), then the output projection.

Batch invariance: the projections compute every row alike in any pass (:func:`project_rows`): as the
linear the decoder holds them in, on the path checked for the other dense linears (native bfloat16
tiles, oneDNN's blocked layout or fixed row blocks: :func:`~mtpctl.model.row_invariance.dense_path`),
or, for a plain weight, on torch's matmul in blocks of exactly ``rows`` rows
(:class:`~mtpctl.model.linears.FixedRowsLinear`); everything after them runs one token at a time on
tensors of one shape per layer (:func:`_token`): a token's output and the state after it are the same
bits whether it is decoded alone, inside a chain of draft tokens, or as a node of a draft tree
whose path is that chain. :func:`deltanet_step` (plain decoding and chain verification),
:func:`deltanet_tree` (tree verification) and :func:`deltanet_prefill` with ``method="recurrent"`` all
run that one function. ``method="chunked"`` (the default for prompts) computes the same recurrence in
chunks for speed and agrees with it to float32 rounding, not bit for bit; decoding continues from its
state either way.

Weights: transformers' own names under a layer's ``linear_attn.`` prefix
(:func:`deltanet_weights_from_checkpoint`): Qwen3.5's ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b``
/ ``in_proj_a``, or Qwen3-Next's fused per-key-head ``in_proj_qkvz`` / ``in_proj_ba``, put in one
order here; ``conv1d.weight``, ``dt_bias``, ``A_log``, ``norm.weight``, ``out_proj.weight``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from mtpctl.errors import CorruptModel, UnsupportedModel
from mtpctl.model.device import FIXED_ROWS
from mtpctl.model.linears import FixedRowsLinear

#: model types whose config.json names these keys (Qwen3.5's text config and its MoE variant, Qwen3-Next)
DELTANET_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
#: ``layer_types`` entry of a Gated DeltaNet layer
LINEAR_ATTENTION = "linear_attention"
#: transformers' configs' defaults for the keys read here (both families share them)
_DEFAULTS = dict(linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                 linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, hidden_act="silu")
#: the L2 norm's epsilon on q and k (FLA's, as transformers uses)
_L2_EPS = 1e-6
#: chunk length of the chunked prefill (transformers' torch fallback uses the same)
CHUNK = 64


# --------------------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class GatedDeltaNetConfig:
    """One Gated DeltaNet layer's shape (:meth:`from_hf` reads it from config.json).

    Attributes:
        hidden_size: H.
        num_k_heads, num_v_heads: Hk query/key heads, Hv value heads (a multiple of Hk).
        k_head_dim, v_head_dim: dk, dv.
        conv_kernel: K, the causal convolution's length (its state keeps ``K - 1`` inputs).
        rms_norm_eps: the gated RMSNorm's epsilon.
        layer_types: each decoder layer's type (``"linear_attention"`` or ``"full_attention"``), or
            empty where the config names none.
    """

    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int = 4
    rms_norm_eps: float = 1e-6
    layer_types: Tuple[str, ...] = ()

    def __post_init__(self):
        sizes = (self.hidden_size, self.num_k_heads, self.num_v_heads, self.k_head_dim, self.v_head_dim)
        problems = []
        if min(sizes) < 1:
            problems.append(f"sizes hidden {self.hidden_size}, heads {self.num_k_heads}/{self.num_v_heads}, "
                            f"head dims {self.k_head_dim}/{self.v_head_dim}")
        elif self.num_v_heads % self.num_k_heads:
            problems.append(f"{self.num_v_heads} value heads over {self.num_k_heads} key heads")
        if self.conv_kernel < 1:
            problems.append(f"conv kernel {self.conv_kernel}")
        unknown = sorted(set(self.layer_types) - {LINEAR_ATTENTION, "full_attention"})
        if unknown:
            problems.append(f"layer types {', '.join(map(repr, unknown))}")
        if problems:
            raise CorruptModel("Gated DeltaNet config: " + "; ".join(problems))

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v."""
        return 2 * self.key_dim + self.value_dim

    @property
    def proj_dim(self) -> int:
        """Outputs of the input projection: q, k, v, z, b, a."""
        return self.conv_dim + self.value_dim + 2 * self.num_v_heads

    @property
    def state_bytes(self) -> int:
        """Bytes of one sequence's :class:`LinearState` (float32)."""
        return 4 * (self.conv_dim * (self.conv_kernel - 1) + self.num_v_heads * self.k_head_dim * self.v_head_dim)

    def is_linear_layer(self, index: int) -> bool:
        """Whether decoder layer ``index`` is a Gated DeltaNet layer (per ``layer_types``)."""
        return bool(self.layer_types) and self.layer_types[index] == LINEAR_ATTENTION

    @classmethod
    def from_hf(cls, config: Mapping[str, object]) -> "GatedDeltaNetConfig":
        """The Gated DeltaNet layers of a config.json: Qwen3.5's (its ``text_config`` where the file is
        the multimodal one) or Qwen3-Next's. Keys it omits take transformers' defaults; ``layer_types``
        absent is derived as transformers does, every ``full_attention_interval``-th layer (default 4)
        full attention.

        Raises:
            UnsupportedModel: another model type, or an activation other than SiLU.
            CorruptModel: sizes that contradict each other.
        """
        text = config.get("text_config")
        if isinstance(text, Mapping):
            config = {**text, "model_type": text.get("model_type", config.get("model_type"))}
        model_type = config.get("model_type")
        if model_type not in DELTANET_MODEL_TYPES:
            raise UnsupportedModel(f"no Gated DeltaNet layers for model_type {model_type!r} "
                                   f"(model types: {', '.join(DELTANET_MODEL_TYPES)})")

        def get(key):
            value = config.get(key)
            return _DEFAULTS[key] if value is None else value

        if get("hidden_act") != "silu":
            raise UnsupportedModel(f"Gated DeltaNet with activation {get('hidden_act')!r} (supported: silu)")
        if config.get("hidden_size") is None:
            raise CorruptModel(f"Gated DeltaNet config of {model_type}: no 'hidden_size'")
        layer_types = config.get("layer_types")
        if layer_types is None and config.get("num_hidden_layers") is not None:
            interval = int(config.get("full_attention_interval") or 4)
            layer_types = [LINEAR_ATTENTION if (i + 1) % interval else "full_attention"
                           for i in range(int(config["num_hidden_layers"]))]
        return cls(hidden_size=int(config["hidden_size"]), num_k_heads=int(get("linear_num_key_heads")),
                   num_v_heads=int(get("linear_num_value_heads")), k_head_dim=int(get("linear_key_head_dim")),
                   v_head_dim=int(get("linear_value_head_dim")), conv_kernel=int(get("linear_conv_kernel_dim")),
                   rms_norm_eps=float(get("rms_norm_eps")), layer_types=tuple(layer_types or ()))


# -------------------------------------------------------------------------------------------- weights


@dataclass(frozen=True)
class GatedDeltaNetWeights:
    """One layer's tensors.

    Attributes:
        in_proj: ``[proj_dim, H]`` in the model's dtype, rows in the order q (head by head), k, v, z, b, a;
            or that weight held by the decoder as a linear module that computes every row alike in any
            pass (:class:`~mtpctl.model.linears.TiledLinear`, ``BlockedLinear``, ``FixedRowsLinear`` or
            ``PackedLinear``: ``module(x [T, H]) -> [T, proj_dim]``, see :func:`project_rows`).
        conv: ``[conv_dim, K]`` float32 (the checkpoint's values widened exactly), oldest tap first.
        a_log: ``[Hv]`` float32 ``A_log``.
        dt_bias: ``[Hv]`` float32.
        norm: ``[dv]`` the gated RMSNorm's weight, in the model's dtype.
        out_proj: ``[H, Hv * dv]`` in the model's dtype, or held as ``in_proj`` may be.
    """

    in_proj: Union[torch.Tensor, nn.Module]
    conv: torch.Tensor
    a_log: torch.Tensor
    dt_bias: torch.Tensor
    norm: torch.Tensor
    out_proj: Union[torch.Tensor, nn.Module]

    @property
    def dtype(self) -> torch.dtype:
        """The model's dtype (the activations'): the gated norm's weight's, as the projections'."""
        return self.norm.dtype


def grouped_rows(cfg: GatedDeltaNetConfig) -> torch.Tensor:
    """Qwen3-Next's input projection, ``in_proj_qkvz`` then ``in_proj_ba`` stacked by rows (per key head:
    its q, k, then the v and z of its ``Hv/Hk`` value heads; then per key head the b, then the a of its
    value heads), put in this module's order q, k, v, z, b, a: ``ours = grouped[grouped_rows(cfg)]``.
    ``[proj_dim]`` int64."""
    hk, dk, dv, r = cfg.num_k_heads, cfg.k_head_dim, cfg.v_head_dim, cfg.num_v_heads // cfg.num_k_heads
    qkvz = torch.arange(hk * (2 * dk + 2 * r * dv)).view(hk, -1).split([dk, dk, r * dv, r * dv], dim=1)
    ba = (hk * (2 * dk + 2 * r * dv) + torch.arange(2 * cfg.num_v_heads)).view(hk, -1).split([r, r], dim=1)
    return torch.cat([part.reshape(-1) for part in qkvz + ba])


def deltanet_weights_from_checkpoint(tensors: Mapping[str, torch.Tensor], cfg: GatedDeltaNetConfig,
                                     prefix: str = "", dtype: Optional[torch.dtype] = None) -> GatedDeltaNetWeights:
    """A Gated DeltaNet layer's tensors from a checkpoint's, the names under ``prefix`` (such as
    ``"model.layers.0.linear_attn."``):

    - Qwen3.5: ``in_proj_qkv.weight [conv_dim, H]``, ``in_proj_z.weight [Hv*dv, H]``,
      ``in_proj_b.weight [Hv, H]``, ``in_proj_a.weight [Hv, H]``;
    - Qwen3-Next: ``in_proj_qkvz.weight`` (per key head: its q, k, then the v and z of its ``Hv/Hk``
      value heads) and ``in_proj_ba.weight`` (per key head: the b, then the a of its value heads);
    - both: ``conv1d.weight [conv_dim, 1, K]``, ``dt_bias [Hv]``, ``A_log [Hv]``, ``norm.weight [dv]``,
      ``out_proj.weight [H, Hv*dv]``.

    Matrices and the norm are cast to ``dtype`` (default: ``out_proj``'s own); the rest to float32.

    Raises:
        CorruptModel: a tensor missing, of the wrong shape, or a name under ``prefix`` the layer does not use.
    """
    ours = {name[len(prefix):]: t for name, t in tensors.items() if name.startswith(prefix)}
    used = set()
    h, hv, dv, k = cfg.hidden_size, cfg.num_v_heads, cfg.v_head_dim, cfg.conv_kernel

    def take(name, shape):
        if name not in ours:
            raise CorruptModel(f"Gated DeltaNet layer {prefix!r}: no tensor {prefix}{name}")
        t = ours[name]
        if tuple(t.shape) != tuple(shape):
            raise CorruptModel(f"Gated DeltaNet layer: {prefix}{name} has shape {tuple(t.shape)}, the config "
                               f"says {tuple(shape)}")
        used.add(name)
        return t

    out_proj = take("out_proj.weight", (h, cfg.value_dim))
    dtype = dtype or out_proj.dtype
    if "in_proj_qkvz.weight" in ours or "in_proj_ba.weight" in ours:  # Qwen3-Next: grouped per key head
        grouped = torch.cat((take("in_proj_qkvz.weight", (2 * cfg.key_dim + 2 * cfg.value_dim, h)),
                             take("in_proj_ba.weight", (2 * hv, h))))
        parts = [grouped[grouped_rows(cfg)]]
    else:
        parts = [take("in_proj_qkv.weight", (cfg.conv_dim, h)), take("in_proj_z.weight", (cfg.value_dim, h)),
                 take("in_proj_b.weight", (hv, h)), take("in_proj_a.weight", (hv, h))]
    in_proj = torch.cat([p.to(dtype) for p in parts]).contiguous()
    conv = take("conv1d.weight", (cfg.conv_dim, 1, k)).reshape(cfg.conv_dim, k).float().contiguous()
    a_log = take("A_log", (hv,)).float().contiguous()
    dt_bias = take("dt_bias", (hv,)).float().contiguous()
    norm = take("norm.weight", (dv,)).to(dtype).contiguous()
    unused = sorted(set(ours) - used)
    if unused:
        raise CorruptModel(f"Gated DeltaNet layer: tensors this layer does not use: "
                           f"{', '.join(prefix + n for n in unused[:4])}{' ...' if len(unused) > 4 else ''}")
    return GatedDeltaNetWeights(in_proj=in_proj, conv=conv, a_log=a_log, dt_bias=dt_bias, norm=norm,
                                out_proj=out_proj.to(dtype).contiguous())


# ---------------------------------------------------------------------------------------------- state


@dataclass
class LinearState:
    """One sequence's state in one Gated DeltaNet layer, float32.

    Attributes:
        conv: ``[conv_dim, K-1]``, the convolution's inputs (projected q, k, v) of the last ``K - 1``
            tokens, oldest first (zeros before the first token).
        recurrent: ``[Hv, dk, dv]``, each value head's matrix S.

    The step functions never write into a state they are given: they return new ones, so a verifier
    keeps the committed state until it knows which token's state to commit.
    """

    conv: torch.Tensor
    recurrent: torch.Tensor

    @classmethod
    def zeros(cls, cfg: GatedDeltaNetConfig, device: Optional[torch.device] = None) -> "LinearState":
        """The state before a sequence's first token."""
        return cls(conv=torch.zeros(cfg.conv_dim, cfg.conv_kernel - 1, device=device),
                   recurrent=torch.zeros(cfg.num_v_heads, cfg.k_head_dim, cfg.v_head_dim, device=device))

    def clone(self) -> "LinearState":
        return LinearState(conv=self.conv.clone(), recurrent=self.recurrent.clone())

    def equal(self, other: "LinearState") -> bool:
        """Bit for bit the same state."""
        return torch.equal(self.conv, other.conv) and torch.equal(self.recurrent, other.recurrent)

    @property
    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.recurrent.numel() * self.recurrent.element_size()


def tree_state_bytes(cfg: GatedDeltaNetConfig, nodes: int) -> int:
    """Bytes of the per-node states :func:`deltanet_tree` keeps for a tree of ``nodes`` nodes in one layer
    (float32 conv and recurrent state per node)."""
    return nodes * cfg.state_bytes


# --------------------------------------------------------------------------------------- computation


def project_rows(linear: Union[torch.Tensor, nn.Module], x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x [T, K] @ W.T`` -> ``[T, N]`` for a projection of :class:`GatedDeltaNetWeights`, every row
    computed alike whatever ``T``: a held linear module runs as it is (its path was checked row-invariant
    when the decoder chose it); a plain weight ``[N, K]`` on torch's matmul in blocks of exactly ``rows``
    rows (:class:`FixedRowsLinear`, a wrapper of the tensor, no copy)."""
    if isinstance(linear, torch.Tensor):
        return FixedRowsLinear(linear, rows).forward(x)
    return linear.forward(x)


def _token(proj: torch.Tensor, state: LinearState, weights: GatedDeltaNetWeights,
           cfg: GatedDeltaNetConfig) -> Tuple[torch.Tensor, LinearState]:
    """One token: its projection row ``proj [proj_dim]`` and the state before it -> its gated, normed
    attention output ``[Hv * dv]`` (the out projection's input, model dtype) and the state after it.

    Every op runs on tensors of one shape per layer whatever the caller, so its bits depend only on
    ``proj`` and ``state``: this function is the whole of batch invariance after the projections."""
    dtype = proj.dtype
    hk, hv, dk, dv = cfg.num_k_heads, cfg.num_v_heads, cfg.k_head_dim, cfg.v_head_dim
    c, vd = cfg.conv_dim, cfg.value_dim
    mixed = proj[:c]
    window = torch.cat((state.conv, mixed.float()[:, None]), dim=1)  # [conv_dim, K], oldest first
    qkv = F.silu((window * weights.conv).sum(dim=1).to(dtype)).float()
    q = qkv[:cfg.key_dim].reshape(hk, dk)
    k = qkv[cfg.key_dim:2 * cfg.key_dim].reshape(hk, dk)
    v = qkv[2 * cfg.key_dim:].reshape(hv, dv)
    q = q * torch.rsqrt((q * q).sum(dim=-1, keepdim=True) + _L2_EPS)
    k = k * torch.rsqrt((k * k).sum(dim=-1, keepdim=True) + _L2_EPS)
    q = q / (dk ** 0.5)
    if hv != hk:
        q, k = q.repeat_interleave(hv // hk, dim=0), k.repeat_interleave(hv // hk, dim=0)
    z = proj[c:c + vd]
    b = proj[c + vd:c + vd + hv]
    a = proj[c + vd + hv:]
    beta = torch.sigmoid(b).float()
    g = -weights.a_log.exp() * F.softplus(a.float() + weights.dt_bias)
    s = state.recurrent * g.exp()[:, None, None]  # decayed, a new tensor: the given state stays as it is
    kv = torch.bmm(k[:, None, :], s)[:, 0]  # S^T k, [Hv, dv]: one matrix-vector product per head
    delta = (v - kv) * beta[:, None]
    s.addcmul_(k[:, :, None], delta[:, None, :])  # S += k delta^T in place, each entry rounded as s + k*delta
    o = torch.bmm(q[:, None, :], s)[:, 0].to(dtype)  # S^T q, [Hv, dv]
    out = _gated_norm(o, z.reshape(hv, dv), weights, cfg).reshape(vd)
    return out, LinearState(conv=window[:, 1:].contiguous(), recurrent=s)


def _gated_norm(o: torch.Tensor, z: torch.Tensor, weights: GatedDeltaNetWeights,
                cfg: GatedDeltaNetConfig) -> torch.Tensor:
    """``w * rmsnorm(o) * silu(z)`` over the last dim of ``o [..., dv]`` (model dtype), computed as
    transformers' RMSNormGated does: the norm in float32, rounded to the model's dtype before the weight,
    the gate's SiLU in float32, the product rounded once."""
    dtype = o.dtype
    h = o.float()
    h = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + cfg.rms_norm_eps)
    h = weights.norm * h.to(dtype)
    return (h * F.silu(z.float())).to(dtype)


class StepResult(NamedTuple):
    """What :func:`deltanet_step` returns.

    Attributes:
        out: ``[T, H]`` the layer's output rows (model dtype).
        state: the state after the last token.
        positions: with ``keep_every_position``, the state after each token (``positions[i]`` after
            token i; ``positions[-1]`` is ``state``); else None.
    """

    out: torch.Tensor
    state: LinearState
    positions: Optional[List[LinearState]]


class TreeResult(NamedTuple):
    """What :func:`deltanet_tree` returns: ``out [N, H]``, one row per node, and ``states``, the state
    after each node (node i's is the state after the path root..i)."""

    out: torch.Tensor
    states: List[LinearState]


def _check_rows(x: torch.Tensor, weights: GatedDeltaNetWeights, cfg: GatedDeltaNetConfig) -> None:
    if x.dim() != 2 or x.shape[1] != cfg.hidden_size:
        raise ValueError(f"Gated DeltaNet rows must be [T, {cfg.hidden_size}], got {tuple(x.shape)}")
    if x.dtype != weights.dtype:
        raise ValueError(f"activations in {x.dtype}, Gated DeltaNet weights in {weights.dtype}")


def deltanet_step(x_rows: torch.Tensor, weights: GatedDeltaNetWeights, cfg: GatedDeltaNetConfig,
                  state: LinearState, keep_every_position: bool = False,
                  rows: int = FIXED_ROWS["cpu"]) -> StepResult:
    """T new tokens ``x_rows [T, H]`` (the input-normed hidden states) of one sequence, after ``state``:
    plain decoding (T = 1) and the verification of a chain of draft tokens (the pending token, then
    the drafts).

    The recurrent form, one token at a time (:func:`_token`), with the projections computing each row
    alike whatever T (:func:`project_rows`; ``rows``: the block of a plain weight): token i's output
    row and the state after it are bit for bit those of decoding the tokens one call at a time, so a
    verifier that accepts the first j tokens commits ``positions[j-1]`` and continues exactly as plain
    decoding would. ``state`` itself is not changed.
    """
    _check_rows(x_rows, weights, cfg)
    proj = project_rows(weights.in_proj, x_rows, rows)
    outs, positions = [], []
    for t in range(x_rows.shape[0]):
        o, state = _token(proj[t], state, weights, cfg)
        outs.append(o)
        if keep_every_position:
            positions.append(state)
    core = torch.stack(outs) if outs else x_rows.new_zeros(0, cfg.value_dim)
    out = project_rows(weights.out_proj, core, rows)
    return StepResult(out=out, state=state, positions=positions if keep_every_position else None)


def deltanet_tree(x_rows: torch.Tensor, parents: Sequence[int], weights: GatedDeltaNetWeights,
                  cfg: GatedDeltaNetConfig, state: LinearState, rows: int = FIXED_ROWS["cpu"]) -> TreeResult:
    """A draft tree's nodes ``x_rows [N, H]`` after ``state``: ``parents[i]`` is node i's parent
    (node 0 is the root, the pending token, with parent -1; every other node's parent comes before it).

    Each node's state is computed from its parent's (the root's from ``state``) by the same
    :func:`_token` as :func:`deltanet_step`, so node i's output row and state are bit for bit those of
    the path root..i processed as a chain. Keeps one state per node (:func:`tree_state_bytes`).
    """
    _check_rows(x_rows, weights, cfg)
    parents = [int(p) for p in parents]
    n = x_rows.shape[0]
    if len(parents) != n or (n and parents[0] >= 0) or any(not 0 <= p < i for i, p in enumerate(parents) if i):
        raise ValueError(f"draft tree parents must start with the root (-1) and name earlier nodes, "
                         f"got {parents} for {n} nodes")
    proj = project_rows(weights.in_proj, x_rows, rows)
    outs, states = [], []
    for i in range(n):
        o, after = _token(proj[i], states[parents[i]] if i else state, weights, cfg)
        outs.append(o)
        states.append(after)
    core = torch.stack(outs) if outs else x_rows.new_zeros(0, cfg.value_dim)
    return TreeResult(out=project_rows(weights.out_proj, core, rows), states=states)


def deltanet_prefill(x_rows: torch.Tensor, weights: GatedDeltaNetWeights, cfg: GatedDeltaNetConfig,
                     state: Optional[LinearState] = None, method: str = "chunked", chunk: int = CHUNK,
                     rows: int = FIXED_ROWS["cpu"]) -> StepResult:
    """A prompt ``x_rows [T, H]`` (after ``state``, default zeros): its output rows and the state that
    decoding continues from.

    ``method="recurrent"`` is :func:`deltanet_step`: the state is bit for bit that of decoding the
    prompt token by token. ``method="chunked"`` computes the recurrence ``chunk`` tokens at a time with
    batched matmuls (the UT-transform form of the delta rule): the conv state is the same bits (it
    holds projection rows, computed alike), the recurrent state and outputs agree to float32 rounding
    (about 1e-6 relative), not bit for bit. Speculation stays lossless either way: plain decoding and
    verification both continue from the one prefilled state with the same step code.
    """
    _check_rows(x_rows, weights, cfg)
    state = state if state is not None else LinearState.zeros(cfg, x_rows.device)
    if method == "recurrent":
        return deltanet_step(x_rows, weights, cfg, state, rows=rows)
    if method != "chunked":
        raise ValueError(f"prefill method {method!r} (known: chunked, recurrent)")
    dtype, t = x_rows.dtype, x_rows.shape[0]
    if t == 0:
        return StepResult(out=x_rows.new_zeros(0, cfg.hidden_size), state=state, positions=None)
    hk, hv, dk, dv, kk = cfg.num_k_heads, cfg.num_v_heads, cfg.k_head_dim, cfg.v_head_dim, cfg.conv_kernel
    c, vd = cfg.conv_dim, cfg.value_dim
    proj = project_rows(weights.in_proj, x_rows, rows)
    seq = torch.cat((state.conv, proj[:, :c].float().T), dim=1)  # [conv_dim, K-1+T]
    windows = seq.unfold(1, kk, 1)  # [conv_dim, T, K]
    qkv = F.silu((windows * weights.conv[:, None, :]).sum(dim=-1).to(dtype)).float().T  # [T, conv_dim]
    q = qkv[:, :cfg.key_dim].reshape(t, hk, dk)
    k = qkv[:, cfg.key_dim:2 * cfg.key_dim].reshape(t, hk, dk)
    v = qkv[:, 2 * cfg.key_dim:].reshape(t, hv, dv)
    q = q * torch.rsqrt((q * q).sum(dim=-1, keepdim=True) + _L2_EPS) / (dk ** 0.5)
    k = k * torch.rsqrt((k * k).sum(dim=-1, keepdim=True) + _L2_EPS)
    if hv != hk:
        q, k = q.repeat_interleave(hv // hk, dim=1), k.repeat_interleave(hv // hk, dim=1)
    z = proj[:, c:c + vd].reshape(t, hv, dv)
    beta = torch.sigmoid(proj[:, c + vd:c + vd + hv]).float()
    g = -weights.a_log.exp() * F.softplus(proj[:, c + vd + hv:].float() + weights.dt_bias)
    o, recurrent = _chunked_delta_rule(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), beta.T, g.T,
                                       state.recurrent, chunk)
    core = _gated_norm(o.transpose(0, 1).to(dtype), z, weights, cfg).reshape(t, vd)
    out = project_rows(weights.out_proj, core, rows)
    return StepResult(out=out, state=LinearState(conv=seq[:, t:].contiguous(), recurrent=recurrent), positions=None)


def _chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
                        s: torch.Tensor, chunk: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over ``T`` tokens per head, ``chunk`` at a time: q, k ``[Hv, T, dk]`` (normed,
    q scaled), v ``[Hv, T, dv]``, beta and g ``[Hv, T]``, initial state ``s [Hv, dk, dv]``; all float32.
    Returns the outputs ``[Hv, T, dv]`` and the final state.

    Within a chunk, with G the running sum of g from the chunk's start and S0 the state before it, the
    token corrections ``u_t = beta_t (v_t - (exp(g_t) S_{t-1})^T k_t)`` solve the unit lower-triangular
    system ``u_t + sum_{s<t} beta_t exp(G_t - G_s) (k_t.k_s) u_s = beta_t (v_t - exp(G_t) S0^T k_t)``;
    then ``o_t = exp(G_t) S0^T q_t + sum_{s<=t} exp(G_t - G_s) (q_t.k_s) u_s`` and the state after the
    chunk is ``exp(G_C) S0 + sum_s exp(G_C - G_s) k_s u_s^T``. Padding tokens (k = v = beta = g = 0)
    leave the state as it is."""
    hv, t, _ = q.shape
    pad = -t % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    eye = torch.eye(chunk, device=q.device)
    outs = []
    for start in range(0, t + pad, chunk):
        part = slice(start, start + chunk)
        qc, kc, vc, bc = q[:, part], k[:, part], v[:, part], beta[:, part]
        cum = g[:, part].cumsum(dim=-1)  # G, [Hv, C]
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~lower, float("-inf")).exp()  # exp(G_t - G_s), s <= t
        system = eye + (bc[:, :, None] * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)
        rhs = bc[:, :, None] * (vc - cum.exp()[:, :, None] * (kc @ s))
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        outs.append(cum.exp()[:, :, None] * (qc @ s) + ((qc @ kc.transpose(-1, -2)) * decay) @ u)
        last = cum[:, -1:]
        s = last.exp()[:, :, None] * s + (kc * (last - cum).exp()[:, :, None]).transpose(-1, -2) @ u
    return torch.cat(outs, dim=1)[:, :t], s
