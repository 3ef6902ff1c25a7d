"""Text <-> token ids through the checkpoint's own tokenizer and chat template (HF transformers)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Set

from mtpctl.errors import BadInput, CorruptModel


class TextCodec:
    """The tokenizer of a Hugging Face checkpoint folder.

    Raises:
        CorruptModel: the folder has no usable tokenizer files.
    """

    def __init__(self, folder: Path):
        from transformers import AutoTokenizer

        folder = Path(folder)
        if not any((folder / n).exists() for n in ("tokenizer.json", "tokenizer.model", "vocab.json")):
            raise CorruptModel(f"no tokenizer in {folder} (expected tokenizer.json or tokenizer.model)")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except (OSError, ValueError, TypeError, json.JSONDecodeError) as err:
            raise CorruptModel(f"cannot load the tokenizer in {folder}: {err}") from err
        self.eos_ids: Set[int] = _eos_ids(folder, self.tokenizer)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode_prompt(self, text: str, chat: bool = True) -> List[int]:
        """Prompt ids ``[T]``: through the chat template (one user turn, generation prompt added) when
        the model has one and ``chat`` is set, else the raw text with the tokenizer's own special
        tokens (BOS where the tokenizer adds one).

        Raises:
            BadInput: the prompt is empty or only whitespace.
        """
        if not text.strip():
            raise BadInput("the prompt is empty")
        if chat and self.has_chat_template:
            return self.encode_messages([{"role": "user", "content": text}])
        return [int(i) for i in self.tokenizer(text)["input_ids"]]

    def encode_messages(self, messages: List[dict]) -> List[int]:
        """A conversation (``[{"role": ..., "content": ...}, ...]``) -> prompt ids through the chat
        template, generation prompt added; without a template, the contents joined by newlines.

        Raises:
            BadInput: no message, or every message empty.
        """
        if not messages or not any(str(m.get("content", "")).strip() for m in messages):
            raise BadInput("the conversation is empty")
        if not self.has_chat_template:
            return self.encode_prompt("\n".join(m["content"] for m in messages), chat=False)
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return [int(i) for i in (out["input_ids"] if hasattr(out, "keys") else out)]

    def decode(self, ids: List[int]) -> str:
        """Token ids -> text, special tokens skipped."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def _eos_ids(folder: Path, tokenizer) -> Set[int]:
    """EOS ids from generation_config.json and config.json (int or list) and the tokenizer."""
    ids: Set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if path.exists():
            value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
            ids.update(value if isinstance(value, list) else [value] if value is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
