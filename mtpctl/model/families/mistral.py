"""Mistral (Jiang et al. 2023, "Mistral 7B"): the Llama block; a ``sliding_window`` in config.json
makes every layer attend within it."""

from mtpctl.model.families.base import Family

FAMILY = Family(model_type="mistral", architecture="MistralForCausalLM")
