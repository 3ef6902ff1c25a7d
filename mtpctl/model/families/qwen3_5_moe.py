"""Qwen3.5-MoE's multimodal checkpoint read as its text body (config ``qwen3_5_moe``; transformers'
``AutoModelForCausalLM`` loads it as ``Qwen3_5MoeForCausalLM``): config.json's ``text_config`` is the
:mod:`.qwen3_5_moe_text` body's, its tensors ``model.language_model.*`` are read as ``model.*``, and the
vision tower (``model.visual.*``) is not read and the MTP layers (``mtp.*``) are left to the MTP drafter.
Text only."""

import dataclasses

from mtpctl.model.families.qwen3_5_moe_text import FAMILY as TEXT

FAMILY = dataclasses.replace(TEXT, model_type="qwen3_5_moe", text_config=True,
                             renames=(("model.language_model.", "model."),), ignored=("mtp.", "model.visual."))
