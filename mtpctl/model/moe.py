"""Mixture-of-Experts MLP blocks, computed so that a token's output does not depend on the other rows
of its pass (docs/numerics.md, "Mixture-of-Experts blocks").

Eight families, chosen by ``model_type`` and their config.json keys (never by a model's name):

- ``qwen3_moe``, ``qwen2_moe``: softmax over all experts' router logits, top-k, optionally renormalised
  (``norm_topk_prob``), the k weights rounded to the model's dtype; Qwen2-MoE adds one shared expert
  whose output is scaled by ``sigmoid(shared_expert_gate(x))``.
- ``qwen3_5_moe_text`` (and ``qwen3_5_moe``, the multimodal checkpoint's text body): Qwen2-MoE's block,
  the top-k always renormalised (the config has no ``norm_topk_prob``), every layer MoE; ``qwen3_next``:
  Qwen2-MoE's block and keys, with its own defaults.
- ``mixtral``: the same softmax and top-k, always renormalised (equal to a softmax over the top-k
  logits), the weights kept in float32.
- ``deepseek_v3``, ``glm4_moe``: router logits in float32, sigmoid scores; experts are chosen on
  ``score + e_score_correction_bias`` within the ``topk_group`` best of ``n_group`` groups (a group's
  score is the sum of its two best biased scores), weighted by their unbiased scores, optionally
  renormalised, times ``routed_scaling_factor``; ``n_shared_experts`` shared experts, run as one MLP of
  ``n_shared_experts * moe_intermediate_size``, added to every token's output.
- ``ernie4_5_moe``: router logits in float32, softmax over all experts; experts chosen on
  ``probability + e_score_correction_bias`` (``moe_statics``), weighted by their unbiased probabilities
  divided by ``max(sum, moe_norm_min)``, rounded to the model's dtype; ``moe_num_shared_experts`` shared
  experts run as one MLP; MoE layers from ``moe_layer_start_index`` to ``moe_layer_end_index`` whose
  ``index + 1`` is a multiple of ``moe_layer_interval``.
- ``gpt_oss``: router logits with a bias, the top k logits chosen, then a softmax over those k; experts
  with biases and the clamped SwiGLU ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)``,
  ``g = clamp(gate, max=l)``, their weights as transformers 5 holds them (transposed, gate and up
  columns interleaved: ``gate_up [E, H, 2I]``, ``down [E, I, H]``; :func:`_clamped_mlp`).
- ``llama4_text`` (and ``llama4``, the multimodal checkpoint's text body): the top k router logits
  (in the model's dtype), each expert's weight the sigmoid of its logit, multiplying the expert's
  *input* (not its output); experts as transformers holds them, transposed with gate and up columns
  concatenated (``gate_up [E, H, 2I]``: the gate's I columns, then the up's; ``down [E, I, H]``); one
  shared expert of ``intermediate_size``, ungated, added to every token's output; the MoE layers
  ``moe_layers``, else every ``interleave_moe_layer_step``-th.

Expert weights live in one stacked layout: ``gate_up [E, 2I, H]`` (each expert's gate rows, then its up
rows) and ``down [E, H, I]``, which is transformers 5's own ``mlp.experts.gate_up_proj`` /
``mlp.experts.down_proj`` layout; :func:`moe_weights_from_checkpoint` also stacks the per-expert tensors
of released checkpoints (``experts.{i}.gate_proj.weight`` ..., Mixtral's ``w1``/``w3``/``w2``).

Batch invariance: every product runs on torch's matmul in blocks of exactly ``rows`` rows (the last
padded with zero rows, as :class:`~mtpctl.model.linears.FixedRowsLinear` does): the router over the
pass, the shared experts over the pass, each routed expert over the rows routed to it. Every
transcendental element-wise op (SiLU, sigmoid, exp) runs where each value takes torch's vectorised
path, never its scalar tail (:func:`elementwise`); sums over experts are fixed trees of element-wise
adds; selection is a stable sort (ties go to the lower expert id). A token's k expert outputs are
weighted and added in ascending expert id order, the order transformers' blocks add them in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from mtpctl.errors import CorruptModel, UnsupportedModel
from mtpctl.model.device import FIXED_ROWS

#: the model types :meth:`MoeConfig.from_hf` reads
MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe", "gpt_oss", "qwen3_5_moe_text",
                   "qwen3_5_moe", "qwen3_next", "llama4_text", "llama4", "ernie4_5_moe")
#: softmax over all experts then top-k; sigmoid scores; top-k logits then a softmax over them (gpt-oss);
#: top-k logits, each weighted by its sigmoid (Llama 4)
SCORINGS = ("softmax", "sigmoid", "topk_softmax", "topk_sigmoid")
#: config activation name -> function
ACTIVATIONS: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu}

#: element-wise ops run on rows padded to a multiple of this many values: twice the widest vector
#: torch's CPU kernels use (AVX-512: 16 float32 or 32 bfloat16 lanes, two vectors an iteration), so
#: no value ever falls in the scalar remainder loop, whose exp can differ from the vector one by 1 ulp
_LANES = 64
#: at most this many values per element-wise call: below torch's grain size (32768), so one thread
#: runs it from its start and the vector loop's iterations begin at multiples of _LANES
_SERIAL = 16384


# --------------------------------------------------------------------------------------------- config


def is_moe_layer(index: int, *, first_k_dense_replace: int = 0, decoder_sparse_step: int = 1,
                 mlp_only_layers: Sequence[int] = (), num_experts: int = 1,
                 last_moe_layer: Optional[int] = None) -> bool:
    """Whether decoder layer ``index`` (0-based) has a MoE block rather than a dense MLP.

    DeepSeek-V3 and GLM-4.5 keep the first ``first_k_dense_replace`` layers dense; Qwen2/Qwen3-MoE make
    a layer sparse when it is not in ``mlp_only_layers``, there are experts, and ``(index + 1)`` is a
    multiple of ``decoder_sparse_step`` (transformers' ``Qwen3MoeDecoderLayer``); ERNIE 4.5 also keeps
    the layers after ``last_moe_layer`` dense (its ``moe_layer_end_index``; None: no such bound).
    Mixtral: every layer (the defaults).
    """
    return (num_experts > 0 and index >= first_k_dense_replace and index not in mlp_only_layers
            and (index + 1) % decoder_sparse_step == 0 and (last_moe_layer is None or index <= last_moe_layer))


#: per family: the defaults of its transformers config class for the keys read here
_FAMILY_DEFAULTS: Dict[str, Dict[str, object]] = {
    "qwen3_moe": dict(hidden_size=2048, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                      norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=(), hidden_act="silu"),
    "qwen2_moe": dict(hidden_size=2048, num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
                      shared_expert_intermediate_size=5632, norm_topk_prob=False, decoder_sparse_step=1,
                      mlp_only_layers=(), hidden_act="silu"),
    "qwen3_next": dict(hidden_size=2048, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
                       shared_expert_intermediate_size=512, norm_topk_prob=True, decoder_sparse_step=1,
                       mlp_only_layers=(), hidden_act="silu"),
    "qwen3_5_moe_text": dict(hidden_size=2048, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                             shared_expert_intermediate_size=512, hidden_act="silu"),
    "mixtral": dict(hidden_size=4096, num_local_experts=8, num_experts_per_tok=2, intermediate_size=14336,
                    hidden_act="silu"),
    "deepseek_v3": dict(hidden_size=7168, n_routed_experts=256, num_experts_per_tok=8,
                        moe_intermediate_size=2048, n_shared_experts=1, n_group=8, topk_group=4,
                        norm_topk_prob=True, routed_scaling_factor=2.5, first_k_dense_replace=3,
                        hidden_act="silu"),
    "glm4_moe": dict(hidden_size=4096, n_routed_experts=128, num_experts_per_tok=8, moe_intermediate_size=1408,
                     n_shared_experts=1, n_group=1, topk_group=1, norm_topk_prob=True,
                     routed_scaling_factor=1.0, first_k_dense_replace=1, hidden_act="silu"),
    "ernie4_5_moe": dict(hidden_size=2560, moe_num_experts=64, moe_k=6, moe_intermediate_size=1536,
                         moe_num_shared_experts=2, moe_layer_start_index=1, moe_layer_end_index=-1,
                         moe_layer_interval=1, moe_norm_min=1e-12, hidden_act="silu"),
    "gpt_oss": dict(hidden_size=2880, num_local_experts=128, num_experts_per_tok=4, intermediate_size=2880,
                    swiglu_alpha=1.702, swiglu_limit=7.0, hidden_act="silu"),
    "llama4_text": dict(hidden_size=5120, num_local_experts=16, num_experts_per_tok=1, intermediate_size=8192,
                        interleave_moe_layer_step=1, hidden_act="silu"),
}
#: per family: the config keys naming the number of routed experts (transformers' attribute_map aliases)
_EXPERT_COUNT_KEYS = {"qwen3_moe": ("num_experts", "num_local_experts"),
                      "qwen2_moe": ("num_experts", "num_local_experts"),
                      "qwen3_5_moe_text": ("num_experts", "num_local_experts"),
                      "qwen3_next": ("num_experts", "num_local_experts"),
                      "mixtral": ("num_local_experts", "num_experts"),
                      "deepseek_v3": ("n_routed_experts", "num_local_experts"),
                      "glm4_moe": ("n_routed_experts", "num_local_experts"),
                      "gpt_oss": ("num_local_experts", "num_experts"),
                      "llama4_text": ("num_local_experts", "num_experts"),
                      "ernie4_5_moe": ("moe_num_experts", "num_experts")}
#: per family whose config class names it otherwise: the config keys naming the experts per token
_TOP_K_KEYS = {"ernie4_5_moe": ("moe_k", "num_experts_per_tok")}

#: model types whose MoE block is another's (the multimodal Qwen3.5-MoE checkpoint's text body)
_SAME_BLOCK = {"qwen3_5_moe": "qwen3_5_moe_text", "llama4": "llama4_text"}


@dataclass(frozen=True)
class MoeConfig:
    """One family's MoE block as plain fields (:meth:`from_hf` reads them from config.json).

    Attributes:
        scoring: ``"softmax"`` (softmax over every expert's logit, then top-k) or ``"sigmoid"``
            (sigmoid scores, grouped top-k on the scores plus the correction bias).
        num_experts: routed experts E.
        top_k: experts per token k.
        hidden_size: H.
        intermediate_size: each routed expert's intermediate size I.
        norm_topk_prob: the k weights divided by their sum (sigmoid scoring: plus 1e-20).
        norm_min: with ``norm_topk_prob`` and softmax scoring, the k weights are divided by
            ``max(sum, norm_min)`` (ERNIE 4.5's ``moe_norm_min``); 0: by the sum itself.
        n_group, topk_group: sigmoid scoring picks experts only in the ``topk_group`` groups (of
            ``n_group`` consecutive experts) whose two best biased scores sum highest.
        routed_scaling_factor: multiplies the k weights after any renormalisation.
        score_bias: a per-expert ``e_score_correction_bias`` added to the scores (sigmoid scoring) or the
            probabilities (softmax scoring, ERNIE 4.5's ``moe_statics``) for the choice only.
        shared_intermediate_size: intermediate size of the shared-expert MLP run on every token (0: none).
        shared_gate: the shared expert's output scaled by ``sigmoid(x @ shared_gate.T)`` (Qwen2-MoE).
        activation: the experts' activation (config ``hidden_act``).
        router_float32: router logits from float32 activations and weights (DeepSeek-V3, GLM-4.5);
            else in the model's dtype, cast to float32 for the softmax.
        weights_float32: each expert's output is multiplied by its float32 weight in float32, then rounded
            to the model's dtype (Mixtral, DeepSeek-V3, GLM-4.5); else the weights are rounded to the
            model's dtype first (Qwen). The same in a float32 model.
        first_k_dense_replace, decoder_sparse_step, mlp_only_layers, last_moe_layer: which layers are MoE
            (:func:`is_moe_layer`).
        swiglu_limit, swiglu_alpha: gpt-oss's experts (``swiglu_limit > 0``): biased router and experts,
            the clamped SwiGLU and transformers' transposed, interleaved expert layout (:func:`_clamped_mlp`).
        scale_input: each routed expert's input is multiplied by its weight, and its output is added as
            it is (Llama 4); else the output is weighted.
        transposed: the experts are held as transformers' ``gate_up [E, H, 2I]`` (gate columns, then up
            columns) and ``down [E, I, H]`` (Llama 4; gpt-oss's clamped experts are transposed too).
        moe_layers: the MoE layers by index (Llama 4's ``moe_layers``), which then replaces the other
            rules of :meth:`is_moe_layer`; None: those rules.
    """

    scoring: str
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    norm_topk_prob: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    score_bias: bool = False
    shared_intermediate_size: int = 0
    shared_gate: bool = False
    activation: str = "silu"
    router_float32: bool = False
    weights_float32: bool = False
    first_k_dense_replace: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: Tuple[int, ...] = ()
    last_moe_layer: Optional[int] = None
    norm_min: float = 0.0
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.702
    scale_input: bool = False
    transposed: bool = False
    moe_layers: Optional[Tuple[int, ...]] = None

    @property
    def clamped(self) -> bool:
        """gpt-oss's experts: biases, the clamped SwiGLU, the transposed interleaved layout."""
        return self.swiglu_limit > 0

    @property
    def experts_transposed(self) -> bool:
        """The experts are held transposed, ``gate_up [E, H, 2I]`` and ``down [E, I, H]`` (gpt-oss, Llama 4)."""
        return self.transposed or self.clamped

    def __post_init__(self):
        problems = []
        if self.scoring not in SCORINGS:
            problems.append(f"scoring {self.scoring!r} (known: {', '.join(SCORINGS)})")
        if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            problems.append(f"{self.top_k} experts per token of {self.num_experts}")
        if self.hidden_size < 1 or self.intermediate_size < 1 or self.shared_intermediate_size < 0:
            problems.append(f"sizes hidden {self.hidden_size}, intermediate {self.intermediate_size}, "
                            f"shared {self.shared_intermediate_size}")
        if self.n_group < 1 or self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            problems.append(f"{self.topk_group} of {self.n_group} groups over {self.num_experts} experts")
        elif self.scoring == "sigmoid" and self.n_group > 1 and self.num_experts // self.n_group < 2:
            problems.append(f"groups of {self.num_experts // self.n_group} expert (a group's score is its "
                            f"two best)")
        elif self.top_k > self.topk_group * (self.num_experts // self.n_group):
            problems.append(f"{self.top_k} experts per token from {self.topk_group} groups of "
                            f"{self.num_experts // self.n_group}")
        if self.scoring != "sigmoid" and self.n_group != 1:
            problems.append("grouped selection with softmax scoring")
        if self.score_bias and self.scoring == "topk_softmax":
            problems.append("a score bias with top-k softmax scoring")
        if self.norm_min < 0:
            problems.append(f"norm_min {self.norm_min}")
        if self.shared_gate and not self.shared_intermediate_size:
            problems.append("a shared-expert gate without a shared expert")
        if self.decoder_sparse_step < 1 or self.first_k_dense_replace < 0:
            problems.append(f"decoder_sparse_step {self.decoder_sparse_step}, "
                            f"first_k_dense_replace {self.first_k_dense_replace}")
        if problems:
            raise CorruptModel("MoE config: " + "; ".join(problems))
        if self.activation not in ACTIVATIONS:
            raise UnsupportedModel(f"MoE experts with activation {self.activation!r} are not supported "
                                   f"(supported: {', '.join(ACTIVATIONS)})")

    @classmethod
    def from_hf(cls, config: Mapping[str, object], model_type: str) -> "MoeConfig":
        """The MoE block of a config.json of ``model_type`` (one of :data:`MOE_MODEL_TYPES`); keys it
        omits take the defaults of the family's transformers config class.

        Raises:
            UnsupportedModel: another model type, or DeepSeek routing this block does not run
                (``scoring_func`` other than sigmoid, ``topk_method`` other than ``noaux_tc``, a
                ``moe_layer_freq`` other than 1, which transformers ignores).
            CorruptModel: values that contradict each other (k above the experts, groups that do not
                divide them, an expert count given twice differently).
        """
        model_type = _SAME_BLOCK.get(model_type, model_type)
        if model_type not in _FAMILY_DEFAULTS:
            raise UnsupportedModel(f"no MoE block for model_type {model_type!r} "
                                   f"(MoE model types: {', '.join(MOE_MODEL_TYPES)})")
        defaults = _FAMILY_DEFAULTS[model_type]

        def get(key):
            value = config.get(key)
            if value is None:
                value = defaults.get(key)
            if value is None:
                raise CorruptModel(f"MoE config of {model_type}: no {key!r}")
            return value

        def aliased(keys, what):
            values = {config[k] for k in keys if config.get(k) is not None}
            if len(values) > 1:
                raise CorruptModel(f"MoE config of {model_type}: the number of {what} given twice "
                                   f"({' and '.join(keys)} differ)")
            return int(values.pop()) if values else int(get(keys[0]))

        common = dict(num_experts=aliased(_EXPERT_COUNT_KEYS[model_type], "experts"),
                      top_k=aliased(_TOP_K_KEYS.get(model_type, ("num_experts_per_tok",)), "experts per token"),
                      hidden_size=int(get("hidden_size")), activation=str(get("hidden_act")))
        if model_type in ("qwen3_moe", "qwen2_moe", "qwen3_next"):
            shared = int(get("shared_expert_intermediate_size")) if model_type != "qwen3_moe" else 0
            return cls(scoring="softmax", intermediate_size=int(get("moe_intermediate_size")),
                       norm_topk_prob=bool(get("norm_topk_prob")), shared_intermediate_size=shared,
                       shared_gate=shared > 0, decoder_sparse_step=int(get("decoder_sparse_step")),
                       mlp_only_layers=tuple(int(i) for i in get("mlp_only_layers")), **common)
        if model_type == "llama4_text":
            return cls(scoring="topk_sigmoid", intermediate_size=int(get("intermediate_size")),
                       shared_intermediate_size=int(get("intermediate_size")), scale_input=True, transposed=True,
                       decoder_sparse_step=int(get("interleave_moe_layer_step")),
                       moe_layers=None if config.get("moe_layers") is None
                       else tuple(int(i) for i in config["moe_layers"]), **common)
        if model_type == "gpt_oss":
            return cls(scoring="topk_softmax", intermediate_size=int(get("intermediate_size")),
                       swiglu_limit=float(get("swiglu_limit")), swiglu_alpha=float(get("swiglu_alpha")), **common)
        if model_type == "qwen3_5_moe_text":  # transformers' router renormalises always; every layer MoE
            return cls(scoring="softmax", intermediate_size=int(get("moe_intermediate_size")), norm_topk_prob=True,
                       shared_intermediate_size=int(get("shared_expert_intermediate_size")), shared_gate=True, **common)
        if model_type == "mixtral":
            return cls(scoring="softmax", intermediate_size=int(get("intermediate_size")), norm_topk_prob=True,
                       weights_float32=True, **common)
        if model_type == "ernie4_5_moe":
            return cls._ernie(get, common)
        # deepseek_v3, glm4_moe
        if config.get("scoring_func", "sigmoid") != "sigmoid":
            raise UnsupportedModel(f"{model_type} with scoring_func {config['scoring_func']!r} "
                                   f"(supported: sigmoid)")
        if config.get("topk_method", "noaux_tc") != "noaux_tc":
            raise UnsupportedModel(f"{model_type} with topk_method {config['topk_method']!r} "
                                   f"(supported: noaux_tc)")
        if config.get("moe_layer_freq", 1) != 1:
            raise UnsupportedModel(f"{model_type} with moe_layer_freq {config['moe_layer_freq']} "
                                   f"(supported: 1)")
        moe_intermediate = int(get("moe_intermediate_size"))
        return cls(scoring="sigmoid", intermediate_size=moe_intermediate,
                   norm_topk_prob=bool(get("norm_topk_prob")), n_group=int(get("n_group")),
                   topk_group=int(get("topk_group")), routed_scaling_factor=float(get("routed_scaling_factor")),
                   score_bias=True, shared_intermediate_size=moe_intermediate * int(get("n_shared_experts")),
                   router_float32=True, weights_float32=True,
                   first_k_dense_replace=int(get("first_k_dense_replace")), **common)

    @classmethod
    def _ernie(cls, get, common: dict) -> "MoeConfig":
        """ERNIE 4.5's block (transformers' ``Ernie4_5_MoeSparseMoeBlock``): float32 router, softmax then the
        top k of probability + ``moe_statics`` bias, always renormalised (``moe_norm_min``), the weights
        rounded to the model's dtype; ``moe_num_shared_experts`` shared experts as one MLP. MoE layers:
        ``moe_layer_start_index`` to ``moe_layer_end_index`` (-1: the last layer), every
        ``moe_layer_interval``-th (``index + 1`` a multiple of it)."""
        intermediate, end = int(get("moe_intermediate_size")), int(get("moe_layer_end_index"))
        return cls(scoring="softmax", intermediate_size=intermediate, norm_topk_prob=True,
                   norm_min=float(get("moe_norm_min")), score_bias=True,
                   shared_intermediate_size=intermediate * int(get("moe_num_shared_experts")), router_float32=True,
                   first_k_dense_replace=int(get("moe_layer_start_index")),
                   decoder_sparse_step=int(get("moe_layer_interval")),
                   last_moe_layer=None if end == -1 else end, **common)

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer ``index`` has this MoE block (``moe_layers`` where given, else
        :func:`is_moe_layer`)."""
        if self.moe_layers is not None:
            return index in self.moe_layers
        return is_moe_layer(index, first_k_dense_replace=self.first_k_dense_replace,
                            decoder_sparse_step=self.decoder_sparse_step, mlp_only_layers=self.mlp_only_layers,
                            num_experts=self.num_experts, last_moe_layer=self.last_moe_layer)


# -------------------------------------------------------------------------------------------- weights


@dataclass(frozen=True)
class MoeWeights:
    """One MoE block's tensors.

    Attributes:
        router: ``[E, H]``; float32 where the config's ``router_float32``, else the model's dtype.
        gate_up: ``[E, 2I, H]``: expert e's gate rows ``gate_up[e, :I]``, its up rows ``gate_up[e, I:]``.
        down: ``[E, H, I]``.
        score_bias: ``[E]`` float32 ``e_score_correction_bias``, or None.
        shared_gate_up: ``[2Is, H]`` (gate rows, then up rows), or None.
        shared_down: ``[H, Is]``, or None.
        shared_gate: ``[1, H]`` (Qwen2-MoE's ``shared_expert_gate``), or None.
        router_bias: ``[E]`` added to the router's logits (gpt-oss), or None.
        gate_up_bias: ``[E, 2I]`` (interleaved as ``gate_up``'s columns), ``down_bias`` ``[E, H]``: the
            experts' biases (gpt-oss), or None; a clamped config's ``gate_up`` is ``[E, H, 2I]`` (gate and
            up columns interleaved) and ``down`` ``[E, I, H]``, transformers' gpt-oss layout.
    """

    router: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    score_bias: Optional[torch.Tensor] = None
    shared_gate_up: Optional[torch.Tensor] = None
    shared_down: Optional[torch.Tensor] = None
    shared_gate: Optional[torch.Tensor] = None
    router_bias: Optional[torch.Tensor] = None
    gate_up_bias: Optional[torch.Tensor] = None
    down_bias: Optional[torch.Tensor] = None

    @property
    def dtype(self) -> torch.dtype:
        return self.gate_up.dtype


def stack_experts(gates: Sequence[torch.Tensor], ups: Sequence[torch.Tensor],
                  downs: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-expert ``gate [I, H]``, ``up [I, H]`` and ``down [H, I]`` -> ``gate_up [E, 2I, H]``,
    ``down [E, H, I]``."""
    gate_up = torch.stack([torch.cat((g, u)) for g, u in zip(gates, ups)])
    return gate_up, torch.stack(list(downs))


def _score_bias_names(e: int) -> Tuple[Tuple[str, Tuple[int, ...]], ...]:
    """Where a block's selection bias may be, and its shape: DeepSeek-V3's and GLM-4.5's router
    ``gate.e_score_correction_bias [E]``; ERNIE 4.5's ``moe_statics`` ``[1, E]``, in the router in
    transformers' ``state_dict`` and beside it as released."""
    return (("gate.e_score_correction_bias", (e,)), ("gate.moe_statics.e_score_correction_bias", (1, e)),
            ("moe_statics.e_score_correction_bias", (1, e)))


#: per-expert tensor names: (gate, up, down); Mixtral's released checkpoints name them w1, w3, w2
_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def moe_weights_from_checkpoint(tensors: Mapping[str, torch.Tensor], cfg: MoeConfig, prefix: str = "",
                                dtype: Optional[torch.dtype] = None) -> MoeWeights:
    """A MoE block's tensors from a checkpoint's, the names under ``prefix`` (such as
    ``"model.layers.3.mlp."``, or Mixtral's ``"model.layers.3.block_sparse_moe."``):

    - router ``gate.weight`` and, with ``cfg.score_bias``, ``gate.e_score_correction_bias`` (ERNIE 4.5's
      ``[1, E]`` ``gate.moe_statics.e_score_correction_bias`` or ``moe_statics.e_score_correction_bias``);
    - experts stacked as transformers 5 holds them, ``experts.gate_up_proj [E, 2I, H]`` and
      ``experts.down_proj [E, H, I]``, or per expert ``experts.{i}.gate_proj.weight`` / ``up_proj`` /
      ``down_proj`` (Mixtral's: ``w1`` / ``w3`` / ``w2``);
    - shared experts ``shared_experts.{gate,up,down}_proj.weight`` (DeepSeek-V3, GLM-4.5) or
      ``shared_expert.*`` with ``shared_expert_gate.weight`` (Qwen2-MoE).

    Expert and shared weights are cast to ``dtype`` (default: the experts' own); the router to float32
    where the config's ``router_float32``, else to ``dtype``; the score bias to float32.

    Raises:
        CorruptModel: a tensor missing, of the wrong shape, or a name under ``prefix`` this block does not
            use (an expert past E, a bias the config does not have).
    """
    ours = {name[len(prefix):]: t for name, t in tensors.items() if name.startswith(prefix)}
    used = set()
    e, h, i, s = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.shared_intermediate_size

    def take(name, shape):
        if name not in ours:
            raise CorruptModel(f"MoE block {prefix!r}: no tensor {prefix}{name}")
        t = ours[name]
        if tuple(t.shape) != tuple(shape):
            raise CorruptModel(f"MoE block: {prefix}{name} has shape {tuple(t.shape)}, the config says "
                               f"{tuple(shape)}")
        used.add(name)
        return t

    if "experts.gate_up_proj" in ours or "experts.down_proj" in ours:
        gate_up, down = take("experts.gate_up_proj", (e, 2 * i, h)), take("experts.down_proj", (e, h, i))
    else:
        names = next((n for n in _EXPERT_NAMES if f"experts.0.{n[0]}.weight" in ours), _EXPERT_NAMES[0])
        gate_up, down = stack_experts([take(f"experts.{x}.{names[0]}.weight", (i, h)) for x in range(e)],
                                      [take(f"experts.{x}.{names[1]}.weight", (i, h)) for x in range(e)],
                                      [take(f"experts.{x}.{names[2]}.weight", (h, i)) for x in range(e)])
    dtype = dtype or gate_up.dtype
    router = take("gate.weight", (e, h)).to(torch.float32 if cfg.router_float32 else dtype)
    score_bias = None
    if cfg.score_bias:
        name, shape = next(((n, shape) for n, shape in _score_bias_names(e) if n in ours), _score_bias_names(e)[0])
        score_bias = take(name, shape).float().reshape(e)
    shared_gate_up = shared_down = shared_gate = None
    if s:
        stem = "shared_expert." if cfg.shared_gate else "shared_experts."
        shared_gate_up = torch.cat((take(f"{stem}gate_proj.weight", (s, h)),
                                    take(f"{stem}up_proj.weight", (s, h)))).to(dtype)
        shared_down = take(f"{stem}down_proj.weight", (h, s)).to(dtype)
        if cfg.shared_gate:
            shared_gate = take("shared_expert_gate.weight", (1, h)).to(dtype)
    unused = sorted(set(ours) - used)
    if unused:
        raise CorruptModel(f"MoE block: tensors this block does not use: "
                           f"{', '.join(prefix + n for n in unused[:4])}{' ...' if len(unused) > 4 else ''}")
    return MoeWeights(router=router.contiguous(), gate_up=gate_up.to(dtype).contiguous(),
                      down=down.to(dtype).contiguous(), score_bias=score_bias,
                      shared_gate_up=None if shared_gate_up is None else shared_gate_up.contiguous(),
                      shared_down=None if shared_down is None else shared_down.contiguous(),
                      shared_gate=None if shared_gate is None else shared_gate.contiguous())


# ------------------------------------------------------------------------------- row-invariant pieces


def _linear_rows(x: torch.Tensor, weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``x [n, K] @ weight [N, K].T`` in blocks of exactly ``rows`` rows, the last padded with zero rows
    (:class:`~mtpctl.model.linears.FixedRowsLinear`'s rule): a row's result comes from a product of one
    shape whatever the other rows."""
    n = x.shape[0]
    padded = -n % rows
    if padded:
        x = torch.cat((x, x.new_zeros(padded, x.shape[1])))
    blocks = [F.linear(block, weight) for block in x.split(rows)]
    y = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
    return y[:n]


def elementwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for a value-by-value op on ``x [n, d]``, each value computed by torch's vectorised loop:
    rows padded with zeros to a multiple of :data:`_LANES` values, at most :data:`_SERIAL` values a
    call (one thread, from the call's start). torch's CPU loops compute the remainder of a call that
    does not fill a vector with the scalar function, whose exp differs from the vector one in the last
    bit for some float32 inputs; so a row computed alone, or at a place of a pass where it met that
    remainder, would otherwise differ."""
    n, d = x.shape
    width = -(-d // _LANES) * _LANES
    if width != d:
        padded = x.new_zeros(n, width)
        padded[:, :d] = x
        x = padded
    per_call = max(1, _SERIAL // width)
    if n <= per_call:
        y = fn(x.contiguous())
    else:
        y = torch.cat([fn(part.contiguous()) for part in x.split(per_call)])
    return y[:, :d] if width != d else y


def _row_sum(x: torch.Tensor) -> torch.Tensor:
    """``x [n, d]`` summed along each row as a fixed tree of element-wise adds (columns padded with zeros
    to a power of two, halves added until one is left): the same order for a row in any pass. ``[n]``."""
    d = x.shape[1]
    width = 1 << (d - 1).bit_length()
    if width != d:
        x = torch.cat((x, x.new_zeros(x.shape[0], width - d)), dim=1)
    while x.shape[1] > 1:
        half = x.shape[1] // 2
        x = x[:, :half] + x[:, half:]
    return x[:, 0]


def _top(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices ``[..., k]`` of the k largest values along the last dim, largest first, ties to the lower
    index (a stable sort: a row's choice depends on its values alone)."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


def _mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act, rows: int) -> torch.Tensor:
    """``down(act(gate(x)) * up(x))`` for rows ``x [n, H]``, ``gate_up [2I, H]``, ``down [H, I]``, each
    product in blocks of ``rows`` rows."""
    i = down.shape[1]
    y = _linear_rows(x, gate_up, rows)
    return _linear_rows(elementwise(act, y[:, :i]) * y[:, i:], down, rows)


def _expert(weights: MoeWeights, expert: int, cfg: MoeConfig) -> Tuple[torch.Tensor, torch.Tensor]:
    """Expert ``expert``'s ``gate_up [2I, H]`` and ``down [H, I]`` (views of transposed stacks where the
    config holds them so)."""
    if cfg.experts_transposed:
        return weights.gate_up[expert].t(), weights.down[expert].t()
    return weights.gate_up[expert], weights.down[expert]


def _clamped_mlp(x: torch.Tensor, weights: MoeWeights, expert: int, cfg: MoeConfig, rows: int) -> torch.Tensor:
    """gpt-oss's expert ``expert`` for rows ``x [n, H]``: ``h = x @ gate_up[e] + gate_up_bias[e]`` (gate
    and up columns interleaved), ``g = clamp(h_gate, max=l)``, ``u = clamp(h_up, -l, l)``, then
    ``((u + 1) * g * sigmoid(alpha * g)) @ down[e] + down_bias[e]``; each product in blocks of ``rows``
    rows, the sigmoid on :func:`elementwise`'s vector path."""
    limit = cfg.swiglu_limit
    h = _linear_rows(x, weights.gate_up[expert].t(), rows)
    if weights.gate_up_bias is not None:
        h = h + weights.gate_up_bias[expert]
    gate, up = h[:, 0::2].clamp(max=limit), h[:, 1::2].clamp(min=-limit, max=limit)
    glu = gate * elementwise(torch.sigmoid, gate * cfg.swiglu_alpha)
    y = _linear_rows((up + 1) * glu, weights.down[expert].t(), rows)
    return y + weights.down_bias[expert] if weights.down_bias is not None else y


# -------------------------------------------------------------------------------------------- forward


@dataclass(frozen=True)
class Routing:
    """Each token's experts and weights.

    Attributes:
        experts: ``[M, k]`` int64, each row's experts in ascending id order.
        weights: ``[M, k]``, the weight of ``experts``' expert at the same place: float32 where the
            config's ``weights_float32``, else the activations' dtype.
        logits: ``[M, E]`` router logits (float32 where the config's ``router_float32``).
    """

    experts: torch.Tensor
    weights: torch.Tensor
    logits: torch.Tensor


def route(x: torch.Tensor, cfg: MoeConfig, weights: MoeWeights, rows: int = FIXED_ROWS["cpu"]) -> Routing:
    """The experts and weights of each row of ``x [M, H]`` (the MoE block's input), each row's the same
    alone or in any pass (the router's product in blocks of ``rows`` rows)."""
    m = x.shape[0]
    if cfg.router_float32:
        logits = _linear_rows(x.float(), weights.router.float(), rows)
    else:
        logits = _linear_rows(x, weights.router, rows)
    k = cfg.top_k
    if cfg.scoring == "softmax":
        z = logits.float()
        z = z - z.amax(dim=-1, keepdim=True)
        e = elementwise(torch.exp, z)
        probs = e / _row_sum(e)[:, None]
        chosen = _top(probs + weights.score_bias if weights.score_bias is not None else probs, k)
        w = probs.gather(1, chosen)
        if cfg.norm_topk_prob:
            total = _sequential_sum(w)
            w = w / (total.clamp(min=cfg.norm_min) if cfg.norm_min else total)[:, None]
    elif cfg.scoring == "topk_softmax":
        chosen, w = _topk_softmax(logits, weights.router_bias, k)
    elif cfg.scoring == "topk_sigmoid":  # Llama 4: the k largest logits, each expert's weight its sigmoid
        chosen = _top(logits, k)
        w = elementwise(torch.sigmoid, logits.float().gather(1, chosen))
    else:
        scores = elementwise(torch.sigmoid, logits)
        biased = scores + weights.score_bias if weights.score_bias is not None else scores
        if cfg.topk_group < cfg.n_group:
            grouped = biased.view(m, cfg.n_group, cfg.num_experts // cfg.n_group)
            two = grouped.gather(2, _top(grouped, 2))
            group_scores = two[..., 0] + two[..., 1]
            keep = torch.zeros(m, cfg.n_group, dtype=torch.bool, device=x.device)
            keep.scatter_(1, _top(group_scores, cfg.topk_group), True)
            keep = keep[:, :, None].expand_as(grouped).reshape(m, cfg.num_experts)
            biased = biased.masked_fill(~keep, float("-inf"))
        chosen = _top(biased, k)
        w = scores.gather(1, chosen)
        if cfg.norm_topk_prob:
            w = w / (_sequential_sum(w) + 1e-20)[:, None]
        w = w * cfg.routed_scaling_factor
    if not cfg.weights_float32:
        w = w.to(x.dtype)
    experts, order = torch.sort(chosen, dim=-1)
    return Routing(experts=experts, weights=w.gather(1, order), logits=logits)


def _topk_softmax(logits: torch.Tensor, bias: Optional[torch.Tensor], k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's routing: the k largest of ``logits + bias`` (a stable choice), then a softmax over
    those k in the logits' dtype (its denominator summed one at a time). (chosen ``[M, k]``, weights)."""
    if bias is not None:
        logits = logits + bias
    chosen = _top(logits, k)
    top = logits.gather(1, chosen)
    e = elementwise(torch.exp, top - top[:, :1])
    return chosen, e / _sequential_sum(e)[:, None]


def _sequential_sum(w: torch.Tensor) -> torch.Tensor:
    """``w [n, k]`` summed over k in column order, one element-wise add at a time."""
    total = w[:, 0]
    for j in range(1, w.shape[1]):
        total = total + w[:, j]
    return total


def moe_mlp(x: torch.Tensor, cfg: MoeConfig, weights: MoeWeights, rows: int = FIXED_ROWS["cpu"],
            routing: Optional[Routing] = None) -> torch.Tensor:
    """The MoE block's output for ``x [..., H]`` (the post-attention-normed hidden states), in ``x``'s
    dtype, which must be the weights' dtype.

    Each row's output is bit for bit the same whether it is computed alone or with any other rows:
    the router, the shared experts and each routed expert run on blocks of exactly ``rows`` rows (4 on
    a CPU, :data:`~mtpctl.model.device.FIXED_ROWS`), each expert over the rows routed to it; a row's k
    weighted outputs are added in ascending expert id order, then the shared experts' output.

    ``routing``: a :func:`route` of the same rows, where the caller has it already.
    """
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    if x.dtype != weights.dtype:
        raise ValueError(f"activations in {x.dtype}, MoE weights in {weights.dtype}")
    m = x.shape[0]
    if m == 0:
        return x.new_zeros(shape)
    if routing is None:
        routing = route(x, cfg, weights, rows)
    act = ACTIVATIONS[cfg.activation]
    k = cfg.top_k
    slots = x.new_empty(m, k, x.shape[1])
    flat = routing.experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, tokens ascending
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    start = 0
    for expert, count in zip(experts.tolist(), counts.tolist()):
        pairs = order[start:start + count]
        start += count
        tokens, slot = pairs // k, pairs % k
        w = routing.weights[tokens, slot]
        if cfg.clamped:
            y = _clamped_mlp(x[tokens], weights, expert, cfg, rows)
        elif cfg.scale_input:  # Llama 4: the weight scales the expert's input, its output is added as it is
            gate_up, down = _expert(weights, expert, cfg)
            slots[tokens, slot] = _mlp(x[tokens] * w[:, None].to(x.dtype), gate_up, down, act, rows)
            continue
        else:
            y = _mlp(x[tokens], *_expert(weights, expert, cfg), act, rows)
        slots[tokens, slot] = (y.to(w.dtype) * w[:, None]).to(x.dtype)
    out = torch.zeros_like(x)
    for j in range(k):  # ascending expert id: the order transformers' index_add_ adds them in
        out = out + slots[:, j]
    if weights.shared_gate_up is not None:
        shared = _mlp(x, weights.shared_gate_up, weights.shared_down, act, rows)
        if weights.shared_gate is not None:
            gate = elementwise(torch.sigmoid, _linear_rows(x, weights.shared_gate, rows))
            shared = gate * shared
        out = out + shared
    return out.reshape(shape)
