"""Llama (Touvron et al. 2023, "LLaMA"; Llama 2 and 3, with Llama 3's rope scaling): RMSNorm, SwiGLU
MLP, rotary embeddings, grouped-query attention. Models that keep its block and its config class
(``model_type: llama``), SmolLM2 among them, are this family."""

from mtpctl.model.families.base import Family

FAMILY = Family(model_type="llama", architecture="LlamaForCausalLM")
