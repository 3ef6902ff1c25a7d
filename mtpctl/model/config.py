"""Decoder configuration: a small dataclass read from a Hugging Face ``config.json``.

The architecture is chosen by the config's documented ``model_type`` field, never by the model's name:
its :class:`~mtpctl.model.families.Family` (:mod:`mtpctl.model.families`) says how the family's config is
read (its defaults, activation key, q/k/v bias default, which layers slide) and which parts of the block
it uses; :meth:`DecoderConfig.from_dict` turns that and config.json into plain fields.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Tuple

from mtpctl.errors import CorruptModel, UnsupportedModel
from mtpctl.model.families import FAMILIES, Family, family_of  # noqa: F401 (FAMILIES: its old home)
from mtpctl.model.moe import MoeConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
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
    which layers have it), None for a dense model.
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
        cfg = family.with_defaults(cfg)
        act = cfg.get(family.activation_key, "silu")
        if act not in SUPPORTED_ACTIVATIONS:
            raise UnsupportedModel(f"{family.activation_key} {act!r} is not supported "
                                   f"(supported: {', '.join(SUPPORTED_ACTIVATIONS)})")
        for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
            if cfg.get(key):
                raise UnsupportedModel(f"config.json sets {key}={cfg[key]!r}, which the native runtime does not support")
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            layers = int(cfg["num_hidden_layers"])
            head_dim = int(cfg.get("head_dim") or hidden // heads)
            attention_bias = cfg.get("attention_bias")
            if attention_bias is None:
                attention_bias = family.attention_bias
            scalar = cfg.get("query_pre_attn_scalar")
            cap = cfg.get("final_logit_softcapping")
            rope, rope_local = _ropes_from_dict(cfg)
            return cls(
                model_type=model_type,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=head_dim,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope=rope,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(attention_bias),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                qk_norm=family.block.qk_norm,
                layer_windows=_layer_windows(cfg, layers, family),
                hidden_act=act,
                rope_local=rope_local,
                attention_scale=float(scalar) ** -0.5 if scalar is not None else None,
                norm_offset=family.block.norm_offset,
                sandwich_norms=family.block.sandwich_norms,
                scaled_embeddings=family.block.scaled_embeddings,
                final_logit_softcapping=float(cap) if cap else None,
                moe=MoeConfig.from_hf(cfg, model_type) if family.experts is not None else None,
            )
        except (KeyError, TypeError, ValueError) as err:
            raise CorruptModel(f"config.json is missing or has a bad value for {err}") from err

    @classmethod
    def from_folder(cls, folder: Path) -> "DecoderConfig":
        """Read ``folder/config.json``. Raises CorruptModel if it is missing or not JSON."""
        return cls.from_dict(read_json(Path(folder) / "config.json"))


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
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _layer_windows(cfg: dict, layers: int, family: Family) -> tuple:
    """Per-layer sliding window from ``layer_types`` (HF v5 configs), else the family's rule for the
    older keys (:attr:`Family.layer_types <mtpctl.model.families.Family.layer_types>`)."""
    window: Optional[int] = cfg.get("sliding_window")
    if not window or cfg.get("use_sliding_window") is False:
        return (None,) * layers
    types = cfg.get("layer_types")
    if types is None:
        types = family.layer_types(cfg, layers)
    if len(types) != layers:
        raise CorruptModel(f"config.json: layer_types has {len(types)} entries for {layers} layers")
    return tuple(int(window) if t == "sliding_attention" else None for t in types)
