"""Qwen3-MoE (Qwen Team 2025, "Qwen3 Technical Report"; transformers' ``Qwen3MoeForCausalLM``): Qwen3's
attention (per-head QK-norm before the rotary embedding); in the layers that are not in
``mlp_only_layers`` and whose ``(index + 1)`` is a multiple of ``decoder_sparse_step``, a MoE block
instead of the dense MLP: ``num_experts`` (config alias ``num_local_experts``) SwiGLU experts of
``moe_intermediate_size``, softmax router over all of them, top ``num_experts_per_tok``, renormalised
with ``norm_topk_prob`` (:mod:`mtpctl.model.moe`). Dense layers keep ``intermediate_size``."""

from mtpctl.model.families.base import LLAMA_LAYER, QK_NORMS, Block, Experts, Family
from mtpctl.model.families.qwen2 import layer_types

FAMILY = Family(model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM", layer_tensors=LLAMA_LAYER + QK_NORMS,
                block=Block(qk_norm=True), layer_types=layer_types, exportable=False, native_stack=False,
                experts=Experts())
