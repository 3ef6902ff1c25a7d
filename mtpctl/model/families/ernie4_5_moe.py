"""ERNIE 4.5 MoE (Baidu 2025, "ERNIE 4.5 Technical Report"; transformers' ``Ernie4_5_MoeForCausalLM``, the
21B-A3B and 300B-A47B text models): Llama's pre-norm block without biases, its rotary embedding turning
adjacent pairs ``(2i, 2i + 1)`` of each head (``Block.pair_rope``, in float32; theta 500000 by default). The
layers from ``moe_layer_start_index`` to ``moe_layer_end_index`` (-1: the last) whose ``index + 1`` is a
multiple of ``moe_layer_interval`` hold a MoE block instead of the dense MLP (:mod:`mtpctl.model.moe`):
``moe_num_experts`` SwiGLU experts of ``moe_intermediate_size``, a float32 router, softmax over every
expert, the top ``moe_k`` chosen on probability plus ``moe_statics.e_score_correction_bias`` (``[1, E]``)
but weighted by the probabilities alone, renormalised by ``max(sum, moe_norm_min)``; and
``moe_num_shared_experts`` shared experts run as one MLP (``mlp.shared_experts.*``). The embeddings are
tied by default. Experts load per expert (what ``save_pretrained`` writes and the releases hold, the bias
as ``mlp.moe_statics.*``) or stacked (transformers 5's ``state_dict``, the bias as
``mlp.gate.moe_statics.*``).

Released checkpoints carry ``num_nextn_predict_layers`` MTP layers as ``model.mtp_block.{k}.*``,
``model.mtp_emb_norm.{k}``, ``model.mtp_hidden_norm.{k}`` and ``model.mtp_linear_proj.{k}``, which the body
does not read (the MTP drafter does: :data:`~.mtp_layouts.ERNIE`, its final norm the body's ``model.norm``).
``use_bias`` (biases on every projection and the lm_head) is refused. No native layer stack, not
exportable."""

from mtpctl.model.families.base import LLAMA_NORMS, PROJECTIONS, Block, Experts, Family
from mtpctl.model.families.mtp_layouts import ERNIE

FAMILY = Family(
    model_type="ernie4_5_moe", architecture="Ernie4_5_MoeForCausalLM", layer_tensors=LLAMA_NORMS + PROJECTIONS,
    block=Block(pair_rope=True), attention_bias_key="", mlp_bias_key="", exportable=False,
    native_stack=False, mtp_layout=ERNIE,
    experts=Experts(score_bias="moe_statics.e_score_correction_bias",
                    fused_score_bias="gate.moe_statics.e_score_correction_bias", score_bias_shape=("1", "e")),
    defaults=(("vocab_size", 103424), ("hidden_size", 2560), ("intermediate_size", 12288), ("num_hidden_layers", 28),
              ("num_attention_heads", 20), ("num_key_value_heads", 4), ("max_position_embeddings", 131072),
              ("rms_norm_eps", 1e-5), ("rope_theta", 500000.0), ("tie_word_embeddings", True)))
