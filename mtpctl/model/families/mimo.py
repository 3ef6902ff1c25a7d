"""Xiaomi MiMo (Xiaomi LLM-Core 2025, "MiMo: Unlocking the Reasoning Potential of Language Model"; the
``MiMoForCausalLM`` of its checkpoints' own ``modeling_mimo.py``, config ``mimo``): the :mod:`.qwen2`
body (its config class is Qwen2's plus ``num_nextn_predict_layers``), and that many MTP layers at
``model.mtp_layers.{k}.*``, which the body does not read (the MTP drafter does:
:data:`~.mtp_layouts.MIMO`)."""

import dataclasses

from mtpctl.model.families.mtp_layouts import MIMO
from mtpctl.model.families.qwen2 import FAMILY as QWEN2

FAMILY = dataclasses.replace(QWEN2, model_type="mimo", architecture="MiMoForCausalLM", ignored=("model.mtp_layers.",),
                             mtp_layout=MIMO)
