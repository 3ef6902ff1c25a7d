"""Decoder configuration: a small dataclass read from a Hugging Face ``config.json``.

The architecture is chosen by the config's documented ``model_type`` field, never by the model's name:
its :class:`~mtpctl.model.families.Family` (:mod:`mtpctl.model.families`) says how the family's config is
read (its defaults, activation key, q/k/v bias default, which layers slide) and which parts of the block
it uses; :meth:`DecoderConfig.from_dict` turns that and config.json into plain fields.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Tuple

from mtpctl.errors import CorruptModel, UnsupportedModel
from mtpctl.model.families import FAMILIES, Family, family_of  # noqa: F401 (FAMILIES: its old home)
from mtpctl.model.gated_deltanet import GatedDeltaNetConfig
from mtpctl.model.fp8 import block_of
from mtpctl.model.mxfp4 import is_mxfp4
from mtpctl.model.moe import MoeConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
#: config activation name -> the activation the model applies (GELU-tanh: Hendrycks & Gimpel 2016)
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding settings (Su et al. 2021, RoFormer); ``scaling`` as in HF configs."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN (Peng et al. 2023; rope_type "yarn"): the ramp's bounds and the attention factor's terms
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: Optional[float] = None
    truncate: bool = True


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(rope: RopeConfig) -> float:
    """The factor on a rope's cos and sin tables: YaRN's attention factor (given, or
    ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` where both are set, else
    ``mscale(factor)``); 1 for the other rope types."""
    if rope.rope_type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return float(yarn_get_mscale(rope.factor, rope.mscale) / yarn_get_mscale(rope.factor, rope.mscale_all_dim))
    return yarn_get_mscale(rope.factor)


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): queries through a low-rank ``q_lora_rank`` (None:
    one ``q_proj``), keys and values from a shared ``kv_lora_rank`` latent plus one ``qk_rope_head_dim``
    rotary key shared by all heads; a query/key head is ``qk_nope_head_dim + qk_rope_head_dim`` values
    (the rotary part last), a value head ``v_head_dim``. ``rope_interleave``: the rotary part's pairs are
    adjacent values (DeepSeek's layout), else its two halves (rotate-half)."""

    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_head_dim(self) -> int:
        """An expanded head's length, the longer of a query/key head and a value head
        (:attr:`DecoderConfig.head_dim`); the KV cache holds ``kv_lora_rank + qk_rope_head_dim`` values a
        token instead (:class:`~mtpctl.model.kv_cache.LatentCache`)."""
        return max(self.qk_head_dim, self.v_head_dim)


@dataclass(frozen=True)
class Chunk:
    """A chunked-attention layer's :attr:`DecoderConfig.layer_windows` entry (Llama 4's
    ``attention_chunk_size``): positions are cut into chunks of ``size``, and a token attends to the
    positions of its own chunk up to itself (not a sliding window: the first token of a chunk sees
    itself alone)."""

    size: int


def first_visible(window, pos):
    """The first position a token at ``pos`` (an int or a long tensor) attends to in a layer of
    attention window ``window``: 0 for None (full attention), ``pos - window + 1`` for a sliding window
    of ``window`` tokens (may be negative), the start of its chunk for a :class:`Chunk`."""
    if window is None:
        return pos * 0
    if isinstance(window, Chunk):
        return pos // window.size * window.size
    return pos - window + 1


@dataclass(frozen=True)
class DecoderConfig:
    """Shapes and options of a Llama-family or Gemma 3 decoder.

    Attributes are those of the Hugging Face config of the same name; ``layer_windows[i]`` is the
    sliding attention window (in tokens) of layer i, or None for full attention. ``rope_local`` is the
    rotary embedding of the sliding-window layers when it differs from ``rope`` (Gemma 3's
    ``rope_local_base_freq``), else None. ``attention_scale`` multiplies q.k (``head_dim ** -0.5``, or
    Gemma's ``query_pre_attn_scalar ** -0.5``); ``hidden_act`` is one of :data:`SUPPORTED_ACTIVATIONS`;
    ``qk_norm``, ``norm_offset``, ``sandwich_norms`` and ``scaled_embeddings`` are the family's
    :class:`~mtpctl.model.families.Block` flags;
    ``final_logit_softcapping`` caps logits as ``cap * tanh(logits / cap)`` (None: no cap).
    ``moe``: a Mixture-of-Experts family's block (:class:`~mtpctl.model.moe.MoeConfig`, which also says
    which layers have it), None for a dense model. ``rotary_dim``: the rotary embedding turns only the
    first ``rotary_dim`` values of each head (GLM-4.5's ``partial_rotary_factor``), None: all.
    ``mla``: multi-head latent attention (DeepSeek-V3, :class:`MlaConfig`): then ``head_dim`` is an
    expanded head's length (:attr:`MlaConfig.cache_head_dim`), ``num_key_value_heads`` the heads, and
    ``rotary_dim`` the rotary part; its KV cache holds the compressed rows instead
    (:class:`~mtpctl.model.kv_cache.LatentCache`). ``mtp_layers``: native MTP layers the checkpoint declares (under the
    family's :attr:`~mtpctl.model.families.mtp_layouts.MtpLayout.count_keys`; without a layout
    ``num_nextn_predict_layers``, at layer indices ``num_hidden_layers`` and above), which the body does not read.
    ``deltanet``: a hybrid body's Gated DeltaNet layers (Qwen3.5, :class:`GatedDeltaNetConfig`, whose
    ``layer_types`` say which layers they are), None where every layer attends. ``output_gate``: the
    attention layers' output times ``sigmoid(gate)`` (the family's :class:`~mtpctl.model.families.Block` flag).
    ``fp8_block``: the weight block of a block-scaled FP8 checkpoint (``quantization_config``,
    :mod:`mtpctl.model.fp8`), whose weights are dequantized at load; None for any other. ``mxfp4``: its
    ``quantization_config`` names MXFP4, whose ``*_blocks``/``*_scales`` expert stacks are dequantized at
    load (:mod:`mtpctl.model.mxfp4`). ``attention_sinks``: a learned logit per query head joins each
    attention softmax's denominator (gpt-oss, the family's :class:`~mtpctl.model.families.Block` flag).
    ``layer_windows[i]`` may also be a :class:`Chunk` (chunked attention, Llama 4). ``pair_rope``: the
    rotary embedding turns adjacent pairs of values (2i, 2i+1) as complex numbers in float32, its
    tables kept in float32 (Llama 4), not the two halves of a head. ``nope_layers``: the layers (by
    index) without a rotary embedding (Llama 4's ``no_rope_layers`` zeros). ``qk_l2_norm``: queries and
    keys of the rotary layers RMS-normed without a weight after the rotary embedding (Llama 4's
    ``use_qk_norm``). ``attn_temperature``: ``(floor_scale, attn_scale)``: the NoPE layers' queries
    times ``1 + attn_scale * log1p(floor((p + 1) / floor_scale))`` at position p (Llama 4's
    ``attn_temperature_tuning``), None: not scaled. ``o_bias``: ``o_proj`` has a bias with
    ``attention_bias`` (the family's :class:`~mtpctl.model.families.Block` flag; gpt-oss and Qwen3.5
    have it through their other flags).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool
    layer_windows: tuple = field(default=())
    hidden_act: str = "silu"
    rope_local: Optional[RopeConfig] = None
    attention_scale: Optional[float] = None
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    scaled_embeddings: bool = False
    final_logit_softcapping: Optional[float] = None
    moe: Optional[MoeConfig] = None
    rotary_dim: Optional[int] = None
    mla: Optional[MlaConfig] = None
    mtp_layers: int = 0
    deltanet: Optional[GatedDeltaNetConfig] = None
    output_gate: bool = False
    attention_sinks: bool = False
    fp8_block: Optional[Tuple[int, int]] = None
    mxfp4: bool = False
    pair_rope: bool = False
    nope_layers: Tuple[int, ...] = ()
    qk_l2_norm: bool = False
    attn_temperature: Optional[Tuple[float, float]] = None
    o_bias: bool = False

    @property
    def q_lora(self) -> bool:
        """MLA queries through the low-rank ``q_a_proj``/``q_b_proj`` (a :class:`~mtpctl.model.families.Tensor`
        flag)."""
        return self.mla is not None and self.mla.q_lora_rank is not None

    @property
    def q_lora_bias(self) -> bool:
        """MLA's ``q_a_proj`` has a bias (``attention_bias``)."""
        return self.q_lora and self.attention_bias

    @property
    def q_full(self) -> bool:
        """MLA queries through one ``q_proj``."""
        return self.mla is not None and self.mla.q_lora_rank is None

    @property
    def rope_dim(self) -> int:
        """How many values of a query/key head the rotary embedding turns: ``rotary_dim`` (GLM's
        ``partial_rotary_factor``: the first ones; MLA: the rotary part), else all ``head_dim``."""
        return self.rotary_dim if self.rotary_dim is not None else self.head_dim

    @property
    def family(self) -> Family:
        """The description of this config's family (:mod:`mtpctl.model.families`)."""
        return family_of(self.model_type)

    @property
    def scale(self) -> float:
        """The factor on attention scores q.k."""
        return self.attention_scale if self.attention_scale is not None else self.head_dim ** -0.5

    @classmethod
    def from_dict(cls, cfg: dict) -> "DecoderConfig":
        """Build from a parsed ``config.json``.

        Raises:
            UnsupportedModel: unknown ``model_type``, activation or rope type.
            CorruptModel: a required key is missing or has the wrong type.
        """
        model_type = cfg.get("model_type")
        family = family_of(model_type)
        cfg = family.with_defaults(family.text_part(cfg))
        act = cfg.get(family.activation_key, "silu")
        if act not in SUPPORTED_ACTIVATIONS:
            raise UnsupportedModel(f"{family.activation_key} {act!r} is not supported "
                                   f"(supported: {', '.join(SUPPORTED_ACTIVATIONS)})")
        for key in ("attn_logit_softcapping", "use_bidirectional_attention", "use_bias"):  # use_bias: ERNIE's
            if cfg.get(key):
                raise UnsupportedModel(f"config.json sets {key}={cfg[key]!r}, which the native runtime does not support")
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            layers = int(cfg["num_hidden_layers"])
            head_dim = int(cfg.get("head_dim") or hidden // heads)
            attention_bias = cfg.get(family.attention_bias_key) if family.attention_bias_key else None
            if attention_bias is None:
                attention_bias = family.attention_bias
            scalar = cfg.get("query_pre_attn_scalar")
            cap = cfg.get("final_logit_softcapping")
            rope, rope_local = _ropes_from_dict(cfg)
            nope = _nope_layers(cfg, layers) if family.block.nope_layers else ()
            kv_heads = int(cfg.get("num_key_value_heads") or heads)
            if "yarn" in (rope.rope_type, getattr(rope_local, "rope_type", None)) and \
                    not (family.block.mla or family.block.yarn):
                raise UnsupportedModel(f"rope type 'yarn' is supported for deepseek_v3 and gpt_oss only, not {model_type}")
            qk_norm = family.block.qk_norm or bool(family.qk_norm_key and cfg.get(family.qk_norm_key))
            rotary_dim, mla, scale = None, None, float(scalar) ** -0.5 if scalar is not None else None
            if family.block.partial_rotary:
                factor = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor",
                                                                 cfg.get("partial_rotary_factor", 1.0))
                rotary_dim = int(head_dim * float(factor))
                if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
                    raise CorruptModel(f"config.json: partial_rotary_factor {factor} of head_dim {head_dim}")
                rotary_dim = None if rotary_dim == head_dim else rotary_dim
            if family.block.mla:
                mla = _mla_from_dict(cfg)
                if mla.q_lora_rank is None and attention_bias:
                    raise UnsupportedModel("multi-head latent attention without q_lora_rank and with attention_bias "
                                           "is not supported")
                head_dim, kv_heads, rotary_dim = mla.cache_head_dim, heads, mla.qk_rope_head_dim
                scale = mla.qk_head_dim ** -0.5
                if rope.rope_type != "default" and rope.mscale_all_dim:  # transformers' yarn_apply_mscale
                    m = yarn_get_mscale(rope.factor, rope.mscale_all_dim)
                    scale = scale * m * m
            return cls(
                model_type=model_type,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg[family.intermediate_key]),
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=kv_heads,
                head_dim=head_dim,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope=rope,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(attention_bias),
                mlp_bias=bool(family.mlp_bias_key and cfg.get(family.mlp_bias_key, False)),
                qk_norm=qk_norm,
                layer_windows=_layer_windows(cfg, layers, family),
                hidden_act=act,
                rope_local=rope_local,
                attention_scale=scale,
                norm_offset=family.block.norm_offset,
                sandwich_norms=family.block.sandwich_norms,
                scaled_embeddings=family.block.scaled_embeddings,
                final_logit_softcapping=float(cap) if cap else None,
                moe=MoeConfig.from_hf(cfg, model_type) if family.experts is not None else None,
                rotary_dim=rotary_dim,
                mla=mla,
                mtp_layers=_mtp_layers(cfg, family),
                deltanet=GatedDeltaNetConfig.from_hf(cfg) if family.block.linear_attention else None,
                output_gate=family.block.output_gate,
                attention_sinks=family.block.attention_sinks,
                fp8_block=block_of(cfg),
                mxfp4=is_mxfp4(cfg),
                pair_rope=family.block.pair_rope,
                nope_layers=nope,
                qk_l2_norm=family.block.qk_l2_norm and _flag(cfg, "use_qk_norm"),
                attn_temperature=_attn_temperature(cfg) if family.block.nope_layers else None,
                o_bias=family.block.o_bias,
            )
        except (KeyError, TypeError, ValueError) as err:
            raise CorruptModel(f"config.json is missing or has a bad value for {err}") from err

    @classmethod
    def from_folder(cls, folder: Path) -> "DecoderConfig":
        """Read ``folder/config.json``. Raises CorruptModel if it is missing or not JSON."""
        return cls.from_dict(read_json(Path(folder) / "config.json"))


#: the config keys counting MTP layers at ``model.layers.{num_hidden_layers + k}`` of a family without a layout
MTP_COUNT_KEYS = ("num_nextn_predict_layers", "num_mtp_layers")


def _mtp_layers(cfg: dict, family: Family) -> int:
    """The native MTP layers ``cfg`` declares: the first of the family layout's count keys present."""
    keys = family.mtp_layout.count_keys if family.mtp_layout is not None else MTP_COUNT_KEYS
    return int(next((cfg[k] for k in keys if cfg.get(k) is not None), 0))


def read_json(path: Path) -> dict:
    """Parse a JSON object from ``path``; CorruptModel if it is missing or malformed."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError as err:
        raise CorruptModel(f"{path} is missing") from err
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorruptModel(f"{path} is not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise CorruptModel(f"{path} does not hold a JSON object")
    return data


#: rope_parameters keys of configs that give each layer type its own rotary embedding (HF v5)
GLOBAL_ROPE, LOCAL_ROPE = "full_attention", "sliding_attention"


def _ropes_from_dict(cfg: dict) -> Tuple[RopeConfig, Optional[RopeConfig]]:
    """(rope of global layers, rope of sliding-window layers or None when they share it).

    Reads HF v5 ``rope_parameters`` either flat (``{"rope_type", "rope_theta", ...}``) or by layer
    type (``{"full_attention": {...}, "sliding_attention": {...}}``), and the older keys
    ``rope_theta``, ``rope_scaling`` (global layers only) and ``rope_local_base_freq``.
    """
    params = cfg.get("rope_parameters") or {}
    if isinstance(params.get(GLOBAL_ROPE), dict) or isinstance(params.get(LOCAL_ROPE), dict):
        rope = _rope_from_dict(cfg, params.get(GLOBAL_ROPE) or {}, cfg.get("rope_theta"))
        local = params.get(LOCAL_ROPE) or {}
    else:
        rope = _rope_from_dict(cfg, params, cfg.get("rope_theta"))
        local = None
    if cfg.get("rope_local_base_freq") is not None or local is not None:
        local_rope = _rope_from_dict({}, local or {}, cfg.get("rope_local_base_freq"))
        return rope, (None if local_rope == rope else local_rope)
    return rope, None


def _mla_from_dict(cfg: dict) -> MlaConfig:
    q_lora = cfg.get("q_lora_rank")
    return MlaConfig(q_lora_rank=int(q_lora) if q_lora else None, kv_lora_rank=int(cfg["kv_lora_rank"]),
                     qk_nope_head_dim=int(cfg["qk_nope_head_dim"]), qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
                     v_head_dim=int(cfg["v_head_dim"]), rope_interleave=bool(cfg.get("rope_interleave", True)))


def _rope_from_dict(cfg: dict, params: dict, theta_default) -> RopeConfig:
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", theta_default if theta_default is not None else 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModel(
            f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings")
                                             or (cfg.get("max_position_embeddings") if rope_type == "yarn" else None)
                                             or 8192),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        attention_factor=None if params.get("attention_factor") is None else float(params["attention_factor"]),
        truncate=bool(params.get("truncate", True)),
    )


def _nope_layers(cfg: dict, layers: int) -> Tuple[int, ...]:
    """The layers without a rotary embedding: the zeros of ``no_rope_layers`` (one entry a layer, 1:
    rotary), else every ``no_rope_layer_interval``-th layer (default 4), as Llama 4's config class
    fills them in."""
    flags = cfg.get("no_rope_layers")
    if not flags:
        interval = int(_positive(cfg, "no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if len(flags) < layers:
        raise CorruptModel(f"config.json: no_rope_layers has {len(flags)} entries for {layers} layers")
    return tuple(i for i in range(layers) if not flags[i])


def _flag(cfg: dict, key: str, default: bool = True) -> bool:
    """A boolean key of config.json, ``default`` where it is missing or null (Llama 4's released
    configs write ``"attn_temperature_tuning": 4`` for true)."""
    value = cfg.get(key)
    return default if value is None else bool(value)


def _positive(cfg: dict, key: str, default):
    """A number of config.json that must be above 0, ``default`` where it is missing or null.

    Raises:
        CorruptModel: it is 0 or below (a chunk of no positions, a NoPE layer every 0 layers, ...).
    """
    value = cfg.get(key)
    if value is None:
        return default
    if float(value) <= 0:
        raise CorruptModel(f"config.json: {key} is {value}; it must be above 0")
    return value


def _attn_temperature(cfg: dict) -> Optional[Tuple[float, float]]:
    """Llama 4's ``(floor_scale, attn_scale)`` where ``attn_temperature_tuning`` (default on) scales the
    NoPE layers' queries, else None."""
    if not _flag(cfg, "attn_temperature_tuning"):
        return None
    scale = cfg.get("attn_scale")
    return float(_positive(cfg, "floor_scale", 8192)), float(0.1 if scale is None else scale)


def _chunked_windows(cfg: dict, layers: int) -> tuple:
    """Per-layer :class:`Chunk` of a chunked-attention family (Llama 4): the layers ``layer_types``
    names ``chunked_attention`` (without it, the rotary layers) attend within chunks of
    ``attention_chunk_size``, its ``full_attention`` ones fully (another type is refused); None (no chunk
    size): every layer attends fully."""
    if cfg.get("attention_chunk_size") is None:
        return (None,) * layers
    size = _positive(cfg, "attention_chunk_size", None)
    types = cfg.get("layer_types")
    if types is None:
        nope = set(_nope_layers(cfg, layers))
        types = ["full_attention" if i in nope else "chunked_attention" for i in range(layers)]
    if len(types) != layers:
        raise CorruptModel(f"config.json: layer_types has {len(types)} entries for {layers} layers")
    unknown = sorted(map(str, set(types) - {"chunked_attention", "full_attention"}))
    if unknown:  # transformers' Llama 4 has no mask for them either
        raise UnsupportedModel(f"config.json: layer_types {unknown[0]!r} is not a layer of this family "
                               "(chunked_attention or full_attention)")
    return tuple(Chunk(int(size)) if t == "chunked_attention" else None for t in types)


def _check_layer_types(types, family: Family) -> None:
    """Raise UnsupportedModel, in one line, for a ``layer_types`` entry this family does not compute (a
    layer kind read as another would give other tokens than the model's)."""
    known = {GLOBAL_ROPE, LOCAL_ROPE} | ({"linear_attention"} if family.block.linear_attention else set())
    unknown = sorted(map(str, set(types or ()) - known))
    if unknown:
        raise UnsupportedModel(f"config.json: layer_types {unknown[0]!r} is not a layer of {family.model_type} "
                               f"(known: {', '.join(sorted(known))})")


def _layer_windows(cfg: dict, layers: int, family: Family) -> tuple:
    """Per-layer sliding window from ``layer_types`` (HF v5 configs), else the family's rule for the
    older keys (:attr:`Family.layer_types <mtpctl.model.families.Family.layer_types>`); a
    chunked-attention family's chunks (:func:`_chunked_windows`)."""
    if family.block.chunked_attention:
        return _chunked_windows(cfg, layers)
    _check_layer_types(cfg.get("layer_types"), family)
    window: Optional[int] = cfg.get("sliding_window")
    if not window or cfg.get("use_sliding_window") is False:
        return (None,) * layers
    types = cfg.get("layer_types")
    if types is None:
        types = family.layer_types(cfg, layers)
    if len(types) != layers:
        raise CorruptModel(f"config.json: layer_types has {len(types)} entries for {layers} layers")
    return tuple(int(window) if t == "sliding_attention" else None for t in types)
