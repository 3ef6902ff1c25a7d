"""EAGLE-3 draft head (kind ``eagle3``): the architecture vLLM, SGLang and TensorRT-LLM run.

EAGLE-3 (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test") reads several of the target's layers instead of its last one: the residual
streams after a low, a middle and a high layer (``layer.aux_layers``; the engines' default for n
layers is ``(2, n // 2, n - 3)``) are concatenated and fused by ``fc [H, k H]``. One decoder layer
then reads, at row p, the token embedding of x_{p+1} and the fused feature:

- ``e = input_layernorm(embed(x_{p+1}))`` (mtpctl's ``embed_norm``), ``u_n = hidden_norm(u)``;
- attention over ``[e ; u_n]`` (its q/k/v projections take ``2H``), the residual being ``u``
  (``u_n`` with ``norm_before_residual``);
- ``post_attention_layernorm`` and the SiLU-gated MLP with their residuals give ``g``, the layer's
  output before its final ``norm``;
- draft logits ``lm_head(norm(g))`` over the draft vocabulary (its own ``lm_head [V_d, H]``; draft
  id i is target id ``token_map[i]``, which the serving layouts write as ``d2t[i] = token_map[i] - i``).

Drafting deeper feeds ``g`` back in place of the fused feature (``fc`` reads only the target's
layers), as vLLM's proposer does with the layer's pre-norm output. Training unrolls those draft
steps (the training-time test of :class:`~mtpctl.drafters.heads.eagle.DraftLayer`), with the token
cross-entropy alone: EAGLE-3 drops EAGLE's feature regression.

:class:`Eagle3Drafter` is :class:`~mtpctl.drafters.heads.eagle.EagleDrafter` with the fused
features of the committed rows, read from the target pass's ``aux_hidden_states`` (the torch
engine returns them for its ``aux_layers``).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import torch
from torch import nn

from mtpctl.decode.drafter import TargetStep
from mtpctl.drafters.heads.config import HeadsConfig
from mtpctl.drafters.heads.eagle import DraftLayer, EagleDrafter, normal_weight, layer_config_for
from mtpctl.model.decoder import _rms_norm
from mtpctl.model.linears import blocked_copy


def default_aux_layers(num_layers: int) -> Tuple[int, ...]:
    """The target layers an EAGLE-3 head reads by default: vLLM's and EAGLE's ``(2, n // 2, n - 3)``
    for n >= 6 layers (so a layout without the ids still names the right ones), else the embeddings,
    the middle and the last layer."""
    return (2, num_layers // 2, num_layers - 3) if num_layers >= 6 else (0, num_layers // 2, num_layers)


def eagle3_layer_config(target_cfg, aux_layers: Optional[Sequence[int]] = None):
    """The EAGLE-3 layer's shapes for a target (:class:`~mtpctl.model.config.DecoderConfig`): one of
    its decoder layers, reading ``aux_layers`` (default :func:`default_aux_layers`).

    Raises:
        ValueError: a layer id outside ``0..num_hidden_layers``.
    """
    layers = list(aux_layers) if aux_layers is not None else list(default_aux_layers(target_cfg.num_hidden_layers))
    check_aux_layers(layers, target_cfg.num_hidden_layers)
    lc = layer_config_for(target_cfg)
    lc.aux_layers = layers
    return lc


def check_aux_layers(layers: Sequence[int], num_layers: int) -> None:
    """ValueError unless every id of ``layers`` names a residual stream of a ``num_layers``-layer target."""
    bad = [i for i in layers if not isinstance(i, int) or not 0 <= i <= num_layers]
    if bad or not layers:
        raise ValueError(f"EAGLE-3 reads target layers {list(layers)}; a model of {num_layers} layers has ids "
                         f"0..{num_layers}")


class Eagle3Head(DraftLayer):
    """The EAGLE-3 layer, its fusion of the target's layers and its own vocabulary projection.

    Parameters (``H`` hidden, ``k`` aux layers, ``A``/``G`` attention/KV heads of ``D`` dims, ``I``
    MLP width, ``V_d`` the draft vocabulary, the full one without ``draft_vocab_size``):
    ``fc [H, k H]``, ``embed_norm [H]``, ``hidden_norm [H]``, ``qkv [(A + 2G) D, 2H]``,
    ``o_proj [H, A D]``, ``post_attention_norm [H]``, ``gate_up [2I, H]``, ``down [H, I]``,
    ``norm [H]``, ``lm_head [V_d, H]`` and, with a draft vocabulary, ``token_map [V_d]``.

    Weights start as N(0, 0.02) draws from torch's global generator, norms at one, ``lm_head`` as
    the target's lm_head rows of the draft vocabulary.

    Args:
        cfg: a :class:`~mtpctl.drafters.heads.config.HeadsConfig` of kind ``eagle3``.
        dtype: parameter dtype.
        target_lm_head: ``[vocab, hidden]`` the target's lm_head (``lm_head``'s first value).
        token_map: ``[V_d]`` target ids of the draft vocabulary (with ``draft_vocab_size``).
        blocked: a decoding head: bfloat16 products on the native tiles (:meth:`DraftLayer.linear`), else
            ``lm_head`` in oneDNN's blocked layout.

    Raises:
        ValueError: no ``target_lm_head``, or a draft vocabulary without ``token_map``.
    """

    def __init__(self, cfg: HeadsConfig, dtype: torch.dtype = torch.float32, target_lm_head: Optional[torch.Tensor] = None,
                 token_map: Optional[torch.Tensor] = None, blocked: bool = False, target_kernel: Optional[nn.Module] = None):
        super().__init__()
        self.cfg = cfg
        h, k = cfg.hidden_size, len(cfg.layer.aux_layers)
        if target_lm_head is None:
            raise ValueError("an EAGLE-3 head's lm_head starts from the target's: pass target_lm_head")
        self.fc = normal_weight(dtype, h, k * h)
        self.embed_norm = nn.Parameter(torch.ones(h, dtype=dtype))
        self.hidden_norm = nn.Parameter(torch.ones(h, dtype=dtype))
        self._init_layer(cfg, dtype, 2 * h)
        self.norm = nn.Parameter(torch.ones(h, dtype=dtype))
        if cfg.draft_vocab_size:
            if token_map is None or token_map.shape != (cfg.draft_vocab_size,):
                raise ValueError(f"a draft vocabulary of {cfg.draft_vocab_size} needs token_map [{cfg.draft_vocab_size}]")
            self.register_buffer("token_map", token_map.to(torch.long).clone())
            rows = target_lm_head[self.token_map]
        else:
            self.token_map = None
            rows = target_lm_head
        self.lm_head = nn.Parameter(rows.detach().to(dtype).clone())
        self.blocked = blocked  # decoding: the products on tiles (DraftLayer.linear), else lm_head in oneDNN's layout
        self.lm_head_kernel = None  # made at the first draft (after loading) where lm_head takes no tiles

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's aux layers' residual streams side by side ``[..., k H]`` -> the fused feature ``[..., H]``."""
        return self.linear(aux, "fc")

    def attention_inputs(self, feats: torch.Tensor, token_embeds: torch.Tensor, positions: torch.Tensor) -> tuple:
        """Rows ``(u_p, e(x_{p+1}))`` -> ``(residual, q, k, v)`` (see the module docstring); ``feats``
        are fused features (:meth:`fuse`) or an earlier step's outputs."""
        eps = self.cfg.layer.rms_norm_eps
        normed = _rms_norm(feats, self.hidden_norm, eps)
        residual = normed if self.cfg.layer.norm_before_residual else feats
        inp = torch.cat((_rms_norm(token_embeds, self.embed_norm, eps), normed), dim=-1)
        return (residual,) + self.rotary_qkv(inp, positions)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The layer's output before its final norm ``g [..., T, H]``: what the next draft step reads."""
        return self.residual_mlp(x, attn)

    def logits(self, g: torch.Tensor, lm_head: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
        """Outputs ``[..., H]`` -> float32 logits over the draft vocabulary ``[..., V_d]`` (``lm_head``,
        the target's, is not used: the head has its own)."""
        normed = _rms_norm(g, self.norm, self.cfg.layer.rms_norm_eps)
        if self.blocked and "lm_head" not in self.tiles():
            if self.lm_head_kernel is None:
                self.lm_head_kernel = blocked_copy(self.lm_head.detach(), True) or False  # False: oneDNN lacks it
            if self.lm_head_kernel:
                return self.lm_head_kernel(normed).float()
        return self.linear(normed, "lm_head", torch.float32).float()

    def forward(self, aux: torch.Tensor, token_embeds: torch.Tensor, valid: torch.Tensor, steps: int):
        """Training-time test over the target's aux layers ``aux [B, T, k H]`` (see
        :meth:`DraftLayer.forward`); returns each step's outputs ``g`` ``[B, T, H]``."""
        return super().forward(self.fuse(aux), token_embeds, valid, steps)


def aux_features(aux_hidden_states: Optional[dict], layers: Sequence[int], rows: Optional[Sequence[int]] = None) -> torch.Tensor:
    """The aux layers' residual streams of a target pass side by side, ``[m, k H]`` (``rows`` of the
    pass, or all).

    Raises:
        ValueError: the pass carries no aux layers, or not these.
    """
    if aux_hidden_states is None or any(aux_hidden_states.get(i) is None for i in layers):
        raise ValueError(f"EAGLE-3 drafting needs the target's layers {list(layers)} from each pass: the torch "
                         "backend with the engine's aux_layers set (drafters.build does)")
    parts = [aux_hidden_states[i] for i in layers]
    if rows is not None:
        parts = [p[list(rows)] for p in parts]
    return torch.cat(parts, dim=-1)


class Eagle3Drafter(EagleDrafter):
    """Drafts a tree with an :class:`Eagle3Head` (see :class:`EagleDrafter`): the committed rows read
    the fused features of the target's aux layers, deeper rows their parent's output.

    Args:
        head: the EAGLE-3 head (in the target's dtype).
        tree: the static tree of ranks.
        embed: token ids ``[M]`` -> the target's embeddings ``[M, H]`` in the head's dtype.
        dynamic: draft EAGLE-2's dynamic tree of the static tree's size instead of the static tree.
    """

    def __init__(self, head: Eagle3Head, tree, embed: Callable[[torch.Tensor], torch.Tensor], dynamic: bool = False):
        super().__init__(head, tree, embed, dynamic=dynamic)
        self.aux_layers = tuple(head.cfg.layer.aux_layers)  # the target's passes must return these layers

    def fork(self) -> "Eagle3Drafter":
        """The same head and tree with an empty KV cache of its own."""
        return Eagle3Drafter(self.head, self.tree, self.embed, self.dynamic)

    def committed_inputs(self, last: TargetStep) -> torch.Tensor:
        """The committed rows' aux layers side by side ``[m, k H]`` (fused by :meth:`features`)."""
        return aux_features(last.out.aux_hidden_states, self.head.cfg.layer.aux_layers, last.rows)

    def features(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head.fuse(inputs.to(self.keys.dtype))
