"""Text <-> token ids through the checkpoint's own tokenizer and chat template (HF transformers)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, List, Set, Tuple

from mtpctl.errors import BadInput, CorruptModel


class TextCodec:
    """The tokenizer of a Hugging Face checkpoint folder.

    Raises:
        CorruptModel: the folder has no usable tokenizer files.
    """

    def __init__(self, folder: Path):
        folder = Path(folder)
        if not any((folder / n).exists() for n in ("tokenizer.json", "tokenizer.model", "vocab.json")):
            raise CorruptModel(f"no tokenizer in {folder} (expected tokenizer.json or tokenizer.model)")
        try:
            self.tokenizer = _auto_tokenizer(folder)
        except (OSError, ValueError, TypeError, json.JSONDecodeError) as err:
            raise CorruptModel(f"cannot load the tokenizer in {folder}: {err}") from err
        self.eos_ids: Set[int] = _eos_ids(folder, self.tokenizer)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode_prompt(self, text: str, chat: bool = True, parse_special: bool = False) -> List[int]:
        """Prompt ids ``[T]``: through the chat template (one user turn, generation prompt added) when
        the model has one and ``chat`` is set, else the raw text with the tokenizer's own special
        tokens (BOS where the tokenizer adds one).

        The user's text is tokenized as text: a control token's string in it (``<|im_end|>``) is not
        turned into that token, so it cannot close its turn or open another; ``parse_special`` turns
        such strings into their tokens (for prompts built with control tokens on purpose).

        Raises:
            BadInput: the prompt is not a string, is not valid Unicode (:func:`check_text`), or is
                empty or only whitespace.
        """
        check_text(text, "the prompt")
        if not text.strip():
            raise BadInput("the prompt is empty")
        if chat and self.has_chat_template:
            return self.encode_messages([{"role": "user", "content": text}], parse_special)
        return [int(i) for i in self.tokenizer(text, split_special_tokens=not parse_special)["input_ids"]]

    def encode_messages(self, messages: List[dict], parse_special: bool = False) -> List[int]:
        """A conversation (``[{"role": ..., "content": ...}, ...]``) -> prompt ids through the chat
        template, generation prompt added; without a template, the contents joined by newlines.
        The template's control tokens are tokens; the messages' contents are text, unless
        ``parse_special`` (see :meth:`encode_prompt`). Ids equal the tokenizer's own for any
        conversation without control-token strings in its contents.

        Raises:
            BadInput: no message, a message that is not ``{"role": str, "content": str}``, a role or
                content that is not valid Unicode (:func:`check_text`), every message empty, or a
                template that does not reproduce a message's content (so the user's text cannot be
                told from the template's).
        """
        check_messages(messages)
        if not messages or not any(str(m.get("content", "")).strip() for m in messages):
            raise BadInput("the conversation is empty")
        if not self.has_chat_template:
            return self.encode_prompt("\n".join(m["content"] for m in messages), chat=False, parse_special=parse_special)
        if parse_special:
            out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return [int(i) for i in (out["input_ids"] if hasattr(out, "keys") else out)]
        rendered, spans = _content_spans(
            lambda chat: self.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False), messages)
        return self._encode_rendered(rendered, spans)

    def _encode_rendered(self, rendered: str, spans: List[Tuple[int, int]]) -> List[int]:
        """Ids of a rendered chat: the tokenizer's own splitting at added tokens, except inside
        ``spans`` (the messages' contents), where nothing is a control token."""
        added = self.tokenizer.get_added_vocab()
        pattern = re.compile("|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)))
        ids: List[int] = []
        start = 0

        def text(end: int) -> None:
            if end > start:
                ids.extend(self.tokenizer(rendered[start:end], add_special_tokens=False,
                                          split_special_tokens=True)["input_ids"])

        for match in pattern.finditer(rendered):
            if any(a < match.end() and match.start() < b for a, b in spans):
                continue  # inside a message: text
            text(match.start())
            ids.append(int(added[match.group()]))
            start = match.end()
        text(len(rendered))
        return [int(i) for i in ids]

    def decode(self, ids: List[int]) -> str:
        """Token ids -> text, special tokens skipped."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def check_text(text: str, where: str) -> None:
    """Refuse what a tokenizer cannot take as text: anything but a ``str``, or a string that is not
    valid Unicode (a lone surrogate such as ``"\\ud800"``, which a JSON escape or a Python literal can
    hold but no UTF-8 text can). ``where`` names the text in the message ("the prompt").

    Raises:
        BadInput: naming ``where``, the code point and its 1-based character position.
    """
    if not isinstance(text, str):
        raise BadInput(f"{where} must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise BadInput(f"{where} is not valid Unicode (a lone surrogate U+{ord(text[err.start]):04X} at character "
                       f"{err.start + 1})") from err


def check_messages(messages: List[dict]) -> None:
    """Refuse a conversation the chat template cannot take: each message must be a dict whose
    ``role`` and ``content`` are strings of valid Unicode (:func:`check_text`).

    Raises:
        BadInput: naming the message (1-based) and the field at fault.
    """
    if not isinstance(messages, (list, tuple)):
        raise BadInput(f"a conversation must be a list of messages, got {type(messages).__name__}")
    for number, message in enumerate(messages, 1):
        if not isinstance(message, dict):
            raise BadInput(f"message {number} must be a {{\"role\": string, \"content\": string}} object, "
                           f"got {type(message).__name__}")
        for field in ("role", "content"):
            check_text(message.get(field), f"message {number}'s {field}")


def _content_spans(render: Callable[[List[dict]], str], messages: List[dict]) -> Tuple[str, List[Tuple[int, int]]]:
    """The rendered chat and where each message's content stands in it: the template is rendered
    once with a marker in place of each content, and the contents put where the markers landed
    (stripped, for templates that strip them); that must give the template's own rendering.

    Raises:
        BadInput: a template that changes a message's text otherwise.
    """
    rendered = render(messages)
    markers = [f"\ue000{i}\ue001" for i in range(len(messages))]
    skeleton = render([{**m, "content": marker} for m, marker in zip(messages, markers)])
    for strip in (False, True):
        out, spans, start = [], [], 0
        for marker, m in zip(markers, messages):
            at = skeleton.find(marker, start)
            if at < 0:
                break
            content = str(m.get("content", ""))
            content = content.strip() if strip else content
            out.append(skeleton[start:at])
            begin = sum(len(piece) for piece in out)
            out.append(content)
            spans.append((begin, begin + len(content)))
            start = at + len(marker)
        out.append(skeleton[start:])
        if len(spans) == len(messages) and "".join(out) == rendered:
            return rendered, spans
    raise BadInput("the chat template changes a message's text, so it cannot be kept apart from the template's "
                   "control tokens: send the raw prompt, or parse control tokens in it", option="parse_special")


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


def _auto_tokenizer(folder: Path):
    """transformers' tokenizer of ``folder``. AutoTokenizer builds config.json's model config first, and
    transformers 5's config classes refuse values their fields do not type (Llama 4's released
    ``"attn_temperature_tuning": 4``, a null) although the tokenizer reads only the config's
    ``tokenizer_class``: such a config is passed as a plain one holding that alone (the model's own
    reading of config.json is :class:`~mtpctl.model.config.DecoderConfig`'s). No code the checkpoint
    ships is run (``trust_remote_code=False``): a config that names its own class (``auto_map``, as
    released MiMo's does) is read as a plain one too, and transformers never asks on the terminal."""
    from transformers import AutoTokenizer, PretrainedConfig

    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # an older huggingface_hub: config fields are not validated
        StrictDataclassError = ()
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except StrictDataclassError:
        pass
    except ValueError as err:  # a config class only the checkpoint's own code defines (MiMo's auto_map)
        if "trust_remote_code" not in str(err):
            raise
    named = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("tokenizer_class")
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False,
                                         config=PretrainedConfig(tokenizer_class=named))
