"""GLM-4.5 / 4.6 / 4.7 (Zhipu AI & Tsinghua 2025, "GLM-4.5: Agentic, Reasoning, and Coding (ARC)
Foundation Models"; transformers' ``Glm4MoeForCausalLM``): Llama's block with q/k/v biases
(``attention_bias``), an optional per-head QK-norm (``use_qk_norm``), and a rotary embedding on the first
``int(head_dim * partial_rotary_factor)`` values of each query/key head only (rotate-half over those; the
rest pass; ``partial_rotary_factor`` defaults to 0.5). The first ``first_k_dense_replace`` layers keep a
dense MLP of ``intermediate_size``; the others a MoE block (:mod:`mtpctl.model.moe`): sigmoid router with
``e_score_correction_bias``, grouped top-k (``n_group``/``topk_group``), ``routed_scaling_factor``,
``norm_topk_prob``, ``n_routed_experts`` experts and ``n_shared_experts`` shared ones of
``moe_intermediate_size``. Released checkpoints carry ``num_nextn_predict_layers`` MTP layers at layer
indices ``num_hidden_layers`` and above, which the body does not read (the MTP drafter does:
:data:`~.mtp_layouts.DEEPSEEK`).

The rotary embedding of a partial-rotary config is applied with torch's ops before the cache write (the
native fused rotate-and-write kernel turns whole heads); attention itself runs on the native kernel
where it takes the shape. No native layer stack, not exportable."""

from mtpctl.model.families.base import LLAMA_LAYER, OPTIONAL_QK_NORMS, Block, Experts, Family
from mtpctl.model.families.mtp_layouts import DEEPSEEK

FAMILY = Family(model_type="glm4_moe", architecture="Glm4MoeForCausalLM", layer_tensors=LLAMA_LAYER + OPTIONAL_QK_NORMS,
                block=Block(partial_rotary=True), defaults=(("partial_rotary_factor", 0.5),), exportable=False,
                native_stack=False, experts=Experts(), mlp_bias_key="", qk_norm_key="use_qk_norm",
                mtp_layout=DEEPSEEK)
