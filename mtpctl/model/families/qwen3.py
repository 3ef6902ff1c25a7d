"""Qwen3 (Qwen Team 2025, "Qwen3 Technical Report"): the Llama block with per-head RMSNorm on queries
and keys before the rotary embedding (QK-norm)."""

from mtpctl.model.families.base import LLAMA_LAYER, QK_NORMS, Block, Family

FAMILY = Family(model_type="qwen3", architecture="Qwen3ForCausalLM", layer_tensors=LLAMA_LAYER + QK_NORMS,
                block=Block(qk_norm=True), native_stack=False)
