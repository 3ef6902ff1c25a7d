"""``mtpctl generate --batch-file``: the JSONL records a batch reads, and the records it writes.

A record is one JSON object a line: ``{"prompt": "..."}`` or ``{"messages": [{"role": ..., "content":
...}, ...]}``, with optional ``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``, ``seed``,
``stop`` (a string or a list of them) overriding the command's options, and ``id`` (any JSON value,
copied to the result). Each input line gets one output line, in input order: the result (as
``generate --json`` prints it, with ``line`` and ``id``) or ``{"line": N, "error": "..."}``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import Any, List, Optional, Union

from mtpctl.decode.sampling import SamplingParams
from mtpctl.errors import MtpctlError
from mtpctl.model.tokenizer import check_text

FIELDS = {"prompt", "messages", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop", "id"}


@dataclass
class BatchRecord:
    """One usable input line: its number (1-based), the prompt or conversation and its settings."""

    line: int
    prompt: Union[str, List[dict]]
    max_new_tokens: int
    sampling: SamplingParams
    stop: tuple
    id: Any = None


@dataclass
class BadRecord:
    """An input line that cannot run: its number, what is wrong, and its ``id`` where it has one."""

    line: int
    error: str
    id: Any = None

    def to_json(self) -> dict:
        out = {"line": self.line, "error": self.error}
        if self.id is not None:
            out["id"] = self.id
        return out


def record_error(line: int, err: BaseException, ident: Any = None) -> BadRecord:
    """The error line of a record that failed: an :class:`MtpctlError`'s own message (the input's
    fault), or, for any other exception, an internal error of this record alone, named with its type."""
    if isinstance(err, MtpctlError):
        return BadRecord(line, str(err), ident)
    return BadRecord(line, f"internal error on this record: {type(err).__name__}: {err}", ident)


def read_records(data: bytes, max_new_tokens: int, sampling: SamplingParams,
                 stop: tuple) -> List[Union[BatchRecord, BadRecord]]:
    """The records of a batch file's bytes, one per line (a blank line, a line that is not UTF-8,
    not a JSON object, without a prompt or with a bad field is a :class:`BadRecord`); the command's
    ``max_new_tokens``, ``sampling`` and ``stop`` where a record gives none. Whatever goes wrong
    reading one line becomes that line's :class:`BadRecord` (:func:`record_error`), never the others'."""
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # the newline that ends the last line
    return [_read_line(number, raw, max_new_tokens, sampling, stop) for number, raw in enumerate(lines, 1)]


def _read_line(number: int, raw: bytes, max_new_tokens: int, sampling: SamplingParams,
               stop: tuple) -> Union[BatchRecord, BadRecord]:
    """:func:`_record`, with any error it raises turned into the line's :class:`BadRecord`."""
    try:
        return _record(number, raw, max_new_tokens, sampling, stop)
    except Exception as err:  # a fault on one line is reported in that line's error field alone
        return record_error(number, err)


def _record(number: int, raw: bytes, max_new_tokens: int, sampling: SamplingParams,
            stop: tuple) -> Union[BatchRecord, BadRecord]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return BadRecord(number, f"not UTF-8 text (byte 0x{raw[err.start]:02x} at column {err.start + 1})")
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        return BadRecord(number, f"not JSON ({err.msg} at column {err.colno})")
    except RecursionError:
        return BadRecord(number, "JSON nested too deeply to read")
    if not isinstance(record, dict):
        return BadRecord(number, "a record must be a JSON object with 'prompt' or 'messages'")
    ident = record.get("id")
    problem = _problem(record)
    if problem:
        return BadRecord(number, problem, ident)
    try:
        sampling = replace(sampling, **{k: record[k] for k in ("temperature", "top_k", "top_p", "seed") if k in record})
    except (ValueError, TypeError) as err:
        return BadRecord(number, str(err), ident)
    stops = record.get("stop", stop)
    stops = (stops,) if isinstance(stops, str) else tuple(stops)
    try:
        for text in stops:
            check_text(text, "a stop string")
    except MtpctlError as err:
        return BadRecord(number, str(err), ident)
    prompt = record["prompt"] if "prompt" in record else list(record["messages"])
    return BatchRecord(number, prompt, int(record.get("max_new_tokens", max_new_tokens)), sampling, stops, ident)


def _problem(record: dict) -> Optional[str]:
    """What is wrong with a record's fields, or None."""
    unknown = sorted(set(record) - FIELDS)
    if unknown:
        return f"unknown field {unknown[0]!r} (fields: {', '.join(sorted(FIELDS))})"
    if ("prompt" in record) == ("messages" in record):
        return "a record needs 'prompt' (a string) or 'messages' (a list of {role, content}), one of them"
    if "prompt" in record and not isinstance(record["prompt"], str):
        return "'prompt' must be a string"
    messages = record.get("messages")
    if messages is not None and not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("content"), str) and isinstance(m.get("role"), str)
            for m in messages)):
        return "'messages' must be a non-empty list of {\"role\": string, \"content\": string} objects"
    number = record.get("max_new_tokens")
    if number is not None and (not isinstance(number, int) or isinstance(number, bool) or number < 1):
        return "'max_new_tokens' must be an integer >= 1"
    for key, kind in (("temperature", (int, float)), ("top_p", (int, float)), ("top_k", int), ("seed", int)):
        if key in record and record[key] is not None and (not isinstance(record[key], kind)
                                                          or isinstance(record[key], bool)):
            return f"'{key}' must be a number" if kind != int else f"'{key}' must be an integer"
        if key in record and isinstance(record[key], float) and not math.isfinite(record[key]):
            return f"'{key}' must be a finite number"
    seed = record.get("seed")
    if seed is not None and not -2 ** 63 <= seed < 2 ** 64:
        return "'seed' must be an integer from -2**63 to 2**64 - 1"
    stops = record.get("stop")
    if stops is not None and not (isinstance(stops, str) or (isinstance(stops, list)
                                                             and all(isinstance(s, str) for s in stops))):
        return "'stop' must be a string or a list of strings"
    return None


def result_json(record: BatchRecord, result_fields: dict) -> str:
    """One output line for a finished record: ``line``, ``id`` (when given), then the fields of
    ``generate --json``."""
    head = {"line": record.line}
    if record.id is not None:
        head["id"] = record.id
    return json.dumps({**head, **result_fields})
