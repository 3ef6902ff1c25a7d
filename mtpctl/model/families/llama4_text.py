"""Llama 4's text model (Meta 2025, "The Llama 4 herd"; transformers' ``Llama4ForCausalLM``, config
``llama4_text``): Llama's pre-norm block with three kinds of attention layer and a MoE feed-forward.

- Rotary layers turn adjacent pairs of values as complex numbers (``apply_rotary_emb``; Llama 3 rope
  scaling where config.json asks), RMS-norm queries and keys per head without a weight after it
  (``use_qk_norm``), and attend within chunks of ``attention_chunk_size`` positions (``layer_types``'
  ``chunked_attention``; a token sees its own chunk up to itself: :class:`~mtpctl.model.config.Chunk`).
- NoPE layers (the zeros of ``no_rope_layers``, else every ``no_rope_layer_interval``-th layer) have no
  rotary embedding, attend to everything, and with ``attn_temperature_tuning`` scale their queries by
  ``1 + attn_scale * log1p(floor((p + 1) / floor_scale))``.
- The layers ``moe_layers`` names (else every ``interleave_moe_layer_step``-th) hold a MoE block
  (:mod:`mtpctl.model.moe`): the top ``num_experts_per_tok`` router logits, each expert's input times the
  sigmoid of its logit, ``num_local_experts`` SwiGLU experts of ``intermediate_size`` stacked as
  transformers holds them (``feed_forward.experts.gate_up_proj [E, H, 2I]``, gate columns then up
  columns; ``down_proj [E, I, H]``), plus a shared expert (``feed_forward.shared_expert.*``) on every
  token; the other layers a dense SwiGLU MLP of ``intermediate_size_mlp`` (``feed_forward.*``).

The multimodal checkpoint (``llama4``) reads as this body (:mod:`.llama4`). Attention runs on torch's ops
or the native attention kernel (the rotary embedding, norms and temperature in torch before it); no
native layer stack, not exportable to ONNX."""

from typing import Tuple

from mtpctl.model.families.base import LLAMA_NORMS, PROJECTIONS, Block, Experts, Family, Tensor

#: attention's projections and their biases (o_proj's too) where config.json sets ``attention_bias``, then
#: the dense layers' MLP under ``feed_forward.``
LAYER = LLAMA_NORMS + PROJECTIONS[:4] + (
    Tensor("self_attn.q_proj.bias", ("q",), "qkv_bias", when="attention_bias"),
    Tensor("self_attn.k_proj.bias", ("kv",), "qkv_bias", when="attention_bias"),
    Tensor("self_attn.v_proj.bias", ("kv",), "qkv_bias", when="attention_bias"),
    Tensor("self_attn.o_proj.bias", ("h",), "o_bias", when="attention_bias"),
    Tensor("feed_forward.gate_proj.weight", ("i", "h"), "gate_up"),
    Tensor("feed_forward.up_proj.weight", ("i", "h"), "gate_up"),
    Tensor("feed_forward.down_proj.weight", ("h", "i"), "down"))


class Llama4Experts(Experts):
    """Llama 4's router, stacked experts and shared expert: one layout, transformers' (transposed, gate
    and up concatenated)."""

    def per_expert(self, names, layer: int) -> bool:
        return False

    def tensors(self, cfg, per_expert: bool) -> Tuple[Tensor, ...]:
        p = self.fused_prefix
        return (Tensor(p + "router.weight", ("e", "h"), "router"),
                Tensor(p + "experts.gate_up_proj", ("e", "h", "2mi"), "experts_gate_up"),
                Tensor(p + "experts.down_proj", ("e", "mi", "h"), "experts_down"),
                Tensor(p + "shared_expert.gate_proj.weight", ("si", "h"), "shared_gate_up"),
                Tensor(p + "shared_expert.up_proj.weight", ("si", "h"), "shared_gate_up"),
                Tensor(p + "shared_expert.down_proj.weight", ("h", "si"), "shared_down"))


FAMILY = Family(
    model_type="llama4_text", architecture="Llama4ForCausalLM", layer_tensors=LAYER,
    block=Block(pair_rope=True, nope_layers=True, qk_l2_norm=True, chunked_attention=True, o_bias=True),
    exportable=False, native_stack=False, experts=Llama4Experts(prefix="feed_forward.", fused_prefix="feed_forward."),
    mlp_bias_key="", intermediate_key="intermediate_size_mlp",
    defaults=(("vocab_size", 202048), ("hidden_size", 5120), ("intermediate_size", 8192),
              ("intermediate_size_mlp", 16384), ("num_hidden_layers", 48), ("num_attention_heads", 40),
              ("num_key_value_heads", 8), ("head_dim", 128), ("max_position_embeddings", 131072),
              ("rms_norm_eps", 1e-5), ("rope_theta", 500000.0), ("attention_chunk_size", 8192),
              ("num_local_experts", 16), ("num_experts_per_tok", 1)))
