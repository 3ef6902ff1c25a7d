"""Gemma 3's text model (Gemma Team 2025, "Gemma 3 Technical Report"): 5 local sliding-window layers
per global one, local rope base 10k and global 1M, QK-norm, sandwich norms (pre/post attention and
pre/post feedforward), RMSNorm as ``1 + w`` scaled in float32, GELU-tanh, embeddings scaled by
sqrt(hidden_size), tied embeddings. config.json keys its config class fills in are the defaults."""

from typing import List

from mtpctl.model.families.base import BIASES, FULL, PROJECTIONS, QK_NORMS, SLIDING, Block, Family, Tensor

#: ``layer_types``' rule when config.json has none: every 6th layer is global (``sliding_window_pattern``)
PATTERN = 6
#: Gemma's norms: after attention (``post_attention_layernorm``, before the residual add), before and
#: after the MLP
NORMS_BEFORE = (Tensor("input_layernorm.weight", ("h",), "input_norm", norm=True),
                Tensor("post_attention_layernorm.weight", ("h",), "attn_out_norm", norm=True))
NORMS_AFTER = (Tensor("pre_feedforward_layernorm.weight", ("h",), "post_attention_norm", norm=True),
               Tensor("post_feedforward_layernorm.weight", ("h",), "mlp_out_norm", norm=True))


def layer_types(cfg: dict, layers: int) -> List[str]:
    """Older configs' ``sliding_window_pattern``: every pattern-th layer global, the others slide."""
    pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or PATTERN)
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers)]


FAMILY = Family(
    model_type="gemma3_text", architecture="Gemma3ForCausalLM",
    layer_tensors=NORMS_BEFORE + PROJECTIONS + BIASES + QK_NORMS + NORMS_AFTER,
    block=Block(qk_norm=True, norm_offset=1.0, sandwich_norms=True, scaled_embeddings=True),
    activation_key="hidden_activation", layer_types=layer_types, native_stack=False,
    defaults=(("hidden_activation", "gelu_pytorch_tanh"), ("head_dim", 256), ("rope_theta", 1_000_000.0),
              ("rope_local_base_freq", 10_000.0), ("sliding_window", 4096), ("query_pre_attn_scalar", 256),
              ("tie_word_embeddings", True)))
