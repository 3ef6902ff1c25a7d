"""The supported model families, one module each (:mod:`.llama`, :mod:`.mistral`, :mod:`.qwen2`,
:mod:`.qwen3`, :mod:`.gemma3_text`, :mod:`.qwen3_moe`, :mod:`.mixtral`,
:mod:`.glm4_moe`, :mod:`.deepseek_v3`, :mod:`.gpt_oss`, :mod:`.llama4_text`, :mod:`.llama4`,
:mod:`.qwen3_5_text`, :mod:`.qwen3_5`, :mod:`.qwen3_5_moe_text`, :mod:`.qwen3_5_moe`, :mod:`.qwen3_next`,
:mod:`.ernie4_5_moe`, :mod:`.mimo`),
each a :class:`Family` description; :data:`FAMILIES` maps config.json's ``model_type`` to it. Adding a
family: docs/architecture.md, "Adding a model family".
"""

from __future__ import annotations

from typing import Dict

from mtpctl.errors import UnsupportedModel
from mtpctl.model.families import (deepseek_v3, ernie4_5_moe, gemma3_text, glm4_moe, gpt_oss, llama, llama4,
                                   llama4_text, mimo, mistral, mixtral, qwen2, qwen3, qwen3_5, qwen3_5_moe,
                                   qwen3_5_moe_text, qwen3_5_text, qwen3_moe, qwen3_next)
from mtpctl.model.families.base import Block, Experts, Family, Tensor

__all__ = ["Block", "Experts", "FAMILIES", "Family", "Tensor", "family_of"]

#: model_type -> the family's description
FAMILIES: Dict[str, Family] = {m.FAMILY.model_type: m.FAMILY for m in (llama, mistral, qwen2, qwen3, gemma3_text,
                                                                      qwen3_moe, mixtral, glm4_moe, deepseek_v3,
                                                                      gpt_oss, qwen3_5_text, qwen3_5, qwen3_5_moe_text,
                                                                      qwen3_5_moe, qwen3_next, llama4_text, llama4,
                                                                      ernie4_5_moe, mimo)}


def family_of(model_type) -> Family:
    """The family of config.json's ``model_type``.

    Raises:
        UnsupportedModel: a model_type no family describes, in one line naming the supported ones.
    """
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise UnsupportedModel(f"model_type {model_type!r} is not supported by the native runtime "
                               f"(supported: {', '.join(sorted(FAMILIES))})")
    return family
