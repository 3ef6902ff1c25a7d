"""DeepSeek-V3 (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report"; transformers' ``DeepseekV3ForCausalLM``):
multi-head latent attention (MLA, from DeepSeek-V2): queries through ``q_a_proj`` -> ``q_a_layernorm`` ->
``q_b_proj`` (or one ``q_proj`` without ``q_lora_rank``); ``kv_a_proj_with_mqa`` gives a
``kv_lora_rank`` latent (normed by ``kv_a_layernorm``, then ``kv_b_proj`` into each head's
``qk_nope_head_dim`` key and ``v_head_dim`` value) and one ``qk_rope_head_dim`` rotary key shared by
every head; each query/key head is its non-rotary part then its rotary part, turned with the interleaved
layout (``rope_interleave``: pairs of adjacent values). YaRN rope scaling (``rope_scaling.type ==
"yarn"``) scales the tables by its attention factor and the softmax scale by ``mscale(factor,
mscale_all_dim) ** 2``. MoE as GLM-4.5's (sigmoid router, groups, shared experts,
``first_k_dense_replace`` dense layers); MTP layers at indices ``num_hidden_layers`` and above are not
read by the body (the MTP drafter reads them: :data:`~.mtp_layouts.DEEPSEEK`).

The KV cache holds per token and layer only the normed latent and the rotated rotary key
(:class:`~mtpctl.model.kv_cache.LatentCache`), attended in the latent space with ``kv_b_proj`` absorbed
(:func:`~mtpctl.model.decoder.latent_attention`, on torch's ops): see docs/architecture.md. No native
layer stack, not exportable."""

from mtpctl.model.families.base import MLA_LAYER, Block, Experts, Family
from mtpctl.model.families.mtp_layouts import DEEPSEEK

FAMILY = Family(model_type="deepseek_v3", architecture="DeepseekV3ForCausalLM", layer_tensors=MLA_LAYER,
                block=Block(mla=True), exportable=False, native_stack=False, experts=Experts(), mlp_bias_key="",
                mtp_layout=DEEPSEEK)
