"""Llama 4's multimodal checkpoint read as its text body (config ``llama4``; transformers'
``Llama4ForConditionalGeneration``): config.json's ``text_config`` is the :mod:`.llama4_text` body's, its
tensors ``language_model.model.*`` and ``language_model.lm_head.*`` are read as ``model.*`` and
``lm_head.*``, and the vision tower (``vision_model.*``) and its projector (``multi_modal_projector.*``)
are not read. Images are not supported: the body decodes text only."""

import dataclasses

from mtpctl.model.families.llama4_text import FAMILY as TEXT

FAMILY = dataclasses.replace(TEXT, model_type="llama4", text_config=True,
                             renames=(("language_model.model.", "model."), ("language_model.lm_head.", "lm_head.")),
                             ignored=("vision_model.", "multi_modal_projector."))
