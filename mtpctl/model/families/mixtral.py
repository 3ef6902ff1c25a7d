"""Mixtral (Jiang et al. 2024, "Mixtral of Experts"; transformers' ``MixtralForCausalLM``): Mistral's
attention (every layer slides when config.json sets ``sliding_window``); every layer's MLP a MoE block
of ``num_local_experts`` SwiGLU experts of ``intermediate_size``, softmax router, top
``num_experts_per_tok`` renormalised, the weights kept in float32 (:mod:`mtpctl.model.moe`). Released
checkpoints name the block ``block_sparse_moe`` and its experts' projections ``w1`` (gate), ``w3`` (up),
``w2`` (down)."""

from mtpctl.model.families.base import Experts, Family

FAMILY = Family(model_type="mixtral", architecture="MixtralForCausalLM", exportable=False, native_stack=False,
                experts=Experts(prefix="block_sparse_moe.", names=("w1", "w3", "w2")))
