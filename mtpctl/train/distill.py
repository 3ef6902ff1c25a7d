"""Training text for MTP heads: reading data files and self-distillation (the target writes the
responses to prompts itself, so the heads learn what the target will say).

Data files:
- ``.txt``: plain text; documents are separated by blank lines.
- ``.jsonl``: one record per line, ``{"text": ...}`` (plain text), ``{"prompt": ...}`` or
  ``{"messages": [...]}`` (a prompt, answered by the target itself with ``self_distill``).
- ``hf://datasets/OWNER/NAME``: a Hugging Face dataset repo's ``.jsonl`` and ``.txt`` files, downloaded
  with huggingface_hub where the hub is reachable.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Set

import torch

from mtpctl.decode.attention import padded_batch_masks
from mtpctl.errors import BadInput, HubUnreachable
from mtpctl.model.decoder import Decoder
from mtpctl.model.tokenizer import check_messages, check_text


@dataclass
class Record:
    """One training example: plain text, or a conversation whose response the target writes."""

    text: Optional[str] = None
    messages: Optional[List[dict]] = None  # [{"role": ..., "content": ...}], the prompt side only


@dataclass
class TrainSequence:
    """Token ids ``[T]`` of one training sequence and where its loss starts (0 for plain text; the first
    response position for a self-distilled prompt); with ``hidden`` ``[T, hidden]`` and ``pred`` ``[T]``
    when self-distillation kept what the target computed (no second pass needed)."""

    ids: List[int]
    loss_from: int
    hidden: Optional[torch.Tensor] = None
    pred: Optional[torch.Tensor] = None
    aux: Optional[torch.Tensor] = None  # [T, k hidden]: the residual streams of the aux layers asked for


HF_DATASET = "hf://datasets/"


def resolve_data(entries: Sequence[str], cache: Path) -> List[Path]:
    """Data arguments -> local files: paths as given; ``hf://datasets/OWNER/NAME`` downloaded (its
    ``*.jsonl`` and ``*.txt`` files) into ``cache``.

    Raises:
        HubUnreachable: a dataset that could not be downloaded (offline, unknown repo, HTTP error).
        BadInput: a downloaded dataset without .jsonl or .txt files.
    """
    files: List[Path] = []
    for entry in entries:
        if not str(entry).startswith(HF_DATASET):
            files.append(Path(entry))
            continue
        repo = str(entry)[len(HF_DATASET):]
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError

        try:
            folder = Path(snapshot_download(repo, repo_type="dataset", allow_patterns=["*.jsonl", "*.txt"],
                                            cache_dir=str(cache)))
        except (HfHubHTTPError, OSError, ValueError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise HubUnreachable(f"cannot download dataset {repo!r} from the Hugging Face hub ({first}); "
                                 "give local .txt or .jsonl files instead", option="data") from err
        found = sorted(p for p in folder.rglob("*") if p.suffix in (".jsonl", ".txt"))
        if not found:
            raise BadInput(f"dataset {repo!r} has no .jsonl or .txt files mtpctl can read")
        files.extend(found)
    return files


def read_records(paths: Sequence[Path]) -> List[Record]:
    """Read ``.txt`` and ``.jsonl`` data files.

    Raises:
        BadInput: a file is missing, not UTF-8, malformed, or holds no text; or no file is given.
    """
    if not paths:
        raise BadInput("no training data: give text or JSONL files, or a recipe that names them", option="data")
    records: List[Record] = []
    for path in map(Path, paths):
        try:
            content = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise BadInput(f"data file {path} is not UTF-8 text ({err.reason} at byte {err.start})") from err
        except OSError as err:
            raise BadInput(f"cannot read data file {path}: {err.strerror or err}") from err
        found = _parse_jsonl(path, content) if path.suffix == ".jsonl" else [
            Record(text=doc.strip()) for doc in content.split("\n\n") if doc.strip()]
        if not found:
            raise BadInput(f"data file {path} holds no text")
        records.extend(found)
    return records


def _parse_jsonl(path: Path, content: str) -> List[Record]:
    out: List[Record] = []
    for number, line in enumerate(content.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise BadInput(f"{path}:{number}: not a JSON object ({err.msg})") from err
        if not isinstance(row, dict):
            raise BadInput(f"{path}:{number}: expected an object with 'text', 'prompt' or 'messages'")
        try:
            out.append(_record(row))
        except BadInput as err:
            raise BadInput(f"{path}:{number}: {err}") from err
    return out


def _record(row: dict) -> Record:
    """One JSONL object as a record, its text checked as a tokenizer takes it (valid Unicode).

    Raises:
        BadInput: no non-empty 'text', 'prompt' or 'messages' field, or text that is not valid Unicode.
    """
    if isinstance(row.get("text"), str) and row["text"].strip():
        check_text(row["text"], "'text'")
        return Record(text=row["text"])
    if isinstance(row.get("prompt"), str) and row["prompt"].strip():
        check_text(row["prompt"], "'prompt'")
        return Record(messages=[{"role": "user", "content": row["prompt"]}])
    if isinstance(row.get("messages"), list) and row["messages"]:
        check_messages(row["messages"])
        return Record(messages=row["messages"])
    raise BadInput("expected a non-empty 'text', 'prompt' or 'messages' field")


@dataclass
class Distilled:
    """The target's greedy response to one prompt and, when asked for, what it computed on the way.

    hidden ``[P + R, hidden]`` (the model's dtype) and pred ``[P + R]`` (int64): the final hidden state
    and the argmax of the logits at every position of prompt + response (P prompt tokens, R response
    tokens); ``pred[P - 1 + j]`` is response token j, the last one predicts past the response. None
    unless ``keep_features``; ``aux`` ``[P + R, k hidden]`` the residual streams of the aux layers
    asked for, side by side (None without them).
    """

    response: List[int]
    hidden: Optional[torch.Tensor] = None
    pred: Optional[torch.Tensor] = None
    aux: Optional[torch.Tensor] = None


def batch_greedy(model: Decoder, prompts: Sequence[List[int]], max_new_tokens: int, eos_ids: Set[int],
                 batch_size: int = 32, progress: Optional[Callable[[int, int], None]] = None,
                 keep_features: bool = False, aux_layers: Sequence[int] = ()) -> List[Distilled]:
    """Greedy responses of the target to many prompts, ``batch_size`` at a time (left-padded).

    A bfloat16 decode step over 32 rows costs about what one row does on this CPU (the weights are
    read once), so batching is what makes self-distillation fit a recipe's time budget.

    Args:
        model: the target.
        prompts: prompt token ids, one list per prompt.
        max_new_tokens: response length cap (tokens); a batch's responses also end where the
            context does (``max_position_embeddings``, counting its longest prompt).
        eos_ids: a response ends at (and includes) its first EOS.
        progress: called after each batch with the number of prompts it finished and their
            positions (prompt + response tokens).
        keep_features: also keep the hidden states and argmax tokens of every position (what a
            teacher-forced pass over prompt + response would give, computed in the same batch), so
            training needs no second pass of the target over the sequences; they come back on the
            CPU whatever the model's device.
        aux_layers: with ``keep_features``, also keep these layers' residual streams
            (:meth:`Decoder.forward`'s ``aux``).

    Returns:
        one :class:`Distilled` per prompt, in order.

    Raises:
        ValueError: a prompt that fills the model's context.
    """
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths share a batch
    results = {}
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        found = _greedy_batch(model, [prompts[i] for i in chunk], max_new_tokens, eos_ids, keep_features,
                              tuple(aux_layers))
        results.update(zip(chunk, found))
        if progress:
            progress(len(chunk), sum(len(prompts[i]) + len(d.response) for i, d in zip(chunk, found)))
    return [results[i] for i in range(len(prompts))]


@torch.inference_mode()
def _greedy_batch(model: Decoder, prompts: List[List[int]], max_new: int, eos_ids: Set[int],
                  keep: bool, aux_layers: tuple = ()) -> List[Distilled]:
    device = model.device
    b, longest = len(prompts), max(len(p) for p in prompts)
    max_new = min(max_new, model.cfg.max_position_embeddings - longest)  # the last response token's position fits
    if max_new < 1:
        raise ValueError(f"a prompt of {longest} tokens leaves no room in a context of "
                         f"{model.cfg.max_position_embeddings} positions")
    pad = [longest - len(p) for p in prompts]
    ids = torch.tensor([[0] * pad[r] + prompts[r] for r in range(b)], dtype=torch.long, device=device)
    valid = torch.zeros(b, longest + max_new, dtype=torch.bool)  # slots holding real tokens
    for r in range(b):
        valid[r, pad[r]:] = True
    slot_pos = (torch.arange(longest + max_new)[None] - torch.tensor(pad)[:, None]).clamp(min=0)  # [b, cap]
    cache = model.new_cache(longest + max_new, batch=b)
    responses: List[List[int]] = [[] for _ in range(b)]
    kept: List[list] = [[] for _ in range(b)]  # per row: (hidden [n, d], pred [n], aux [n, k d]) in position order
    done = [False] * b
    start, n, step = 0, longest, 0
    while True:
        finished = all(done)  # with keep, one more pass feeds the last response tokens
        queries = torch.arange(start, start + n)
        masks = padded_batch_masks(model.cfg.layer_windows, valid, slot_pos, queries)
        masks = {w: m.to(device) for w, m in masks.items()}
        streams = dict.fromkeys(aux_layers) if keep and aux_layers else None
        hidden = model(ids, slot_pos[:, queries].to(device), cache, masks, aux=streams)
        cache.advance(n)
        nxt = model.logits(hidden[:, -1]).argmax(-1)  # [b]
        if keep:
            aux = torch.cat([streams[i] for i in aux_layers], dim=-1) if streams else None
            _keep_step(model, kept, hidden, nxt, pad, responses, step, aux)
        if finished:
            return _distilled(responses, kept)
        for r, token in enumerate(nxt.tolist()):  # one copy to the host a step
            if not done[r]:
                responses[r].append(token)
                done[r] = token in eos_ids or len(responses[r]) >= max_new
        if all(done) and not keep:
            return _distilled(responses, kept)
        start, n, step = start + n, 1, step + 1
        ids = nxt[:, None]


def _keep_step(model: Decoder, kept: List[list], hidden: torch.Tensor, nxt: torch.Tensor, pad: List[int],
               responses: List[List[int]], step: int, aux: Optional[torch.Tensor] = None) -> None:
    """Keep what a pass computed (``aux [b, N, k d]`` too, where given): at step 0 (prefill) every
    prompt position of every row; at step s the position of response token s - 1, for the rows that
    have one."""
    for r in range(len(kept)):
        if step == 0:
            h = hidden[r, pad[r]:]
            kept[r].append((h, model.logits(h).argmax(-1), None if aux is None else aux[r, pad[r]:]))
        elif len(responses[r]) >= step:
            kept[r].append((hidden[r, -1:], nxt[r:r + 1], None if aux is None else aux[r, -1:]))


def _distilled(responses: List[List[int]], kept: List[list]) -> List[Distilled]:
    out = []
    for resp, pieces in zip(responses, kept):
        if not pieces:
            out.append(Distilled(resp))
            continue
        hidden, pred, aux = zip(*pieces)
        out.append(Distilled(resp, torch.cat(hidden).cpu(), torch.cat(pred).cpu(),
                             None if aux[0] is None else torch.cat(aux).cpu()))
    return out
