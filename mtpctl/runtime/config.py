"""Decoder configuration: a small dataclass read from a Hugging Face ``config.json``.

The architecture is chosen by the config's documented ``model_type`` field, never by the model's name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from mtpctl.errors import CorruptModel, UnsupportedModel

#: model_type -> (q/k/v projections have a bias, per-head RMSNorm on q and k)
LLAMA_FAMILY = {
    "llama": (None, False),
    "mistral": (False, False),
    "qwen2": (True, False),
    "qwen3": (None, True),
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


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
    """Shapes and options of a Llama-family decoder.

    Attributes are those of the Hugging Face config of the same name; ``layer_windows[i]`` is the
    sliding attention window (in tokens) of layer i, or None for full attention.
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

    @classmethod
    def from_dict(cls, cfg: dict) -> "DecoderConfig":
        """Build from a parsed ``config.json``.

        Raises:
            UnsupportedModel: unknown ``model_type``, activation or rope type.
            CorruptModel: a required key is missing or has the wrong type.
        """
        model_type = cfg.get("model_type")
        if model_type not in LLAMA_FAMILY:
            raise UnsupportedModel(
                f"model_type {model_type!r} is not supported by the native runtime "
                f"(supported: {', '.join(sorted(LLAMA_FAMILY))})"
            )
        bias_default, qk_norm = LLAMA_FAMILY[model_type]
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModel(f"hidden_act {act!r} is not supported (only 'silu')")
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            layers = int(cfg["num_hidden_layers"])
            head_dim = int(cfg.get("head_dim") or hidden // heads)
            attention_bias = cfg.get("attention_bias")
            if attention_bias is None:
                attention_bias = bool(bias_default)
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
                rope=_rope_from_dict(cfg),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(attention_bias),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                qk_norm=qk_norm,
                layer_windows=_layer_windows(cfg, layers),
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


def _rope_from_dict(cfg: dict) -> RopeConfig:
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
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


def _layer_windows(cfg: dict, layers: int) -> tuple:
    """Per-layer sliding window from ``layer_types`` (HF v5 configs) or the older keys."""
    window: Optional[int] = cfg.get("sliding_window")
    if not window or cfg.get("use_sliding_window") is False:
        return (None,) * layers
    types = cfg.get("layer_types")
    if types is None:  # qwen2: layers from max_window_layers on slide; mistral: all layers slide
        start = int(cfg.get("max_window_layers", 0)) if cfg.get("model_type") == "qwen2" else 0
        types = ["sliding_attention" if i >= start else "full_attention" for i in range(layers)]
    if len(types) != layers:
        raise CorruptModel(f"config.json: layer_types has {len(types)} entries for {layers} layers")
    return tuple(int(window) if t == "sliding_attention" else None for t in types)
