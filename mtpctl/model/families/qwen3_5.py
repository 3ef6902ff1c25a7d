"""Qwen3.5's multimodal checkpoint read as its text body (config ``qwen3_5``; transformers'
``AutoModelForCausalLM`` loads it as ``Qwen3_5ForCausalLM`` too): config.json's ``text_config`` is the
:mod:`.qwen3_5_text` body's, its tensors ``model.language_model.*`` are read as ``model.*``, and the
vision tower (``model.visual.*``) is not read and the MTP layers (``mtp.*``) are left to the MTP drafter.
Images and video are not supported: the body decodes text only."""

import dataclasses

from mtpctl.model.families.qwen3_5_text import FAMILY as TEXT

FAMILY = dataclasses.replace(TEXT, model_type="qwen3_5", text_config=True,
                             renames=(("model.language_model.", "model."),), ignored=("mtp.", "model.visual."))
