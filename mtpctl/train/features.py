"""The target's view of the training data: hidden states (after the final norm) and the target's own
predictions at every position of every sequence, and the labels each head learns from them.

For self-distilled sequences, self-distillation keeps what its passes computed (when
``distill_dtype`` equals ``features_dtype`` and without soft labels); otherwise, and for text
records, teacher-forced passes of the target over several sequences at once give them. They are
written to disk in shards (:mod:`mtpctl.train.shards`, :mod:`mtpctl.train.extract`), keyed by the
target's weight hash, the data and the settings that shape the features, so epochs, re-runs and
``--resume`` never re-run the target.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import torch

from mtpctl.decode.attention import padded_batch_masks
from mtpctl.drafters.heads.medusa import MedusaHeads
from mtpctl.errors import BadInput
from mtpctl.files import sha256_file
from mtpctl.model.decoder import Decoder
from mtpctl.model.tokenizer import TextCodec
from mtpctl.train.distill import Record, TrainSequence, batch_greedy
from mtpctl.train.settings import TrainSettings

FEATURES_FORMAT = 4  # 2: input ids cached too (EAGLE reads them); 3: kept from self-distillation;
# 4: shards and a manifest (a new format recomputes the cache)


@dataclass
class Features:
    """The target's view of training sequences (all of them, or one shard's).

    hidden ``[P, hidden]`` (bfloat16) and pred ``[P]`` (int64) for all P positions of all sequences
    back to back; ``offsets [S + 1]`` where each sequence starts; ``loss_from [S]`` its first position
    with a loss; ``ids [P]`` the input token ids; with soft labels ``soft_ids``/``soft_probs`` ``[P, m]``;
    for EAGLE-3 ``aux [P, k hidden]`` (bfloat16), the residual streams of the k layers it reads
    (``aux_layers``), side by side.
    """

    hidden: torch.Tensor
    pred: torch.Tensor
    offsets: torch.Tensor
    loss_from: torch.Tensor
    ids: torch.Tensor
    soft_ids: Optional[torch.Tensor] = None
    soft_probs: Optional[torch.Tensor] = None
    aux: Optional[torch.Tensor] = None


@dataclass
class Item:
    """One training sequence to come: a text record's token ids (cut to ``max_seq_len``), or a
    prompt's (cut to ``max_seq_len - 1``) that the target answers."""

    ids: List[int]
    prompt: bool

    def bound(self, settings: TrainSettings) -> int:
        """The most positions its sequence can have."""
        return min(len(self.ids) + settings.response_tokens, settings.max_seq_len) if self.prompt else len(self.ids)


def build_items(records: Sequence[Record], codec: TextCodec, settings: TrainSettings) -> List[Item]:
    """Records -> the training sequences to come, in their order: text records (of two tokens or
    more) first, then prompts.

    Raises:
        BadInput: prompt records without ``self_distill``; no sequence at all.
    """
    texts, prompts = [], []
    for r in records:
        if r.text is not None:
            ids = [int(i) for i in codec.tokenizer(r.text)["input_ids"]][: settings.max_seq_len]
            if len(ids) > 1:
                texts.append(Item(ids, False))
        else:
            prompts.append(Item(codec.encode_messages(r.messages)[: settings.max_seq_len - 1], True))
    if prompts and not settings.self_distill:
        raise BadInput(f"{len(prompts)} record(s) are prompts without responses: self-distill so the target "
                       "writes them, or give text records", option="self_distill")
    if not texts and not prompts:
        raise BadInput("the training data holds no sequence of two tokens or more")
    return texts + prompts


def answer(items: Sequence[Item], settings: TrainSettings, eos_ids, distill_model: Callable[[], Decoder],
           progress: Optional[Callable[[int, int], None]] = None) -> List[TrainSequence]:
    """The training sequences of ``items``, in order: texts as they are, prompts with the target's
    greedy response (self-distillation, batches of ``distill_batch``), which keeps its hidden states
    and predictions when :func:`keeps_features` says they can serve as features. ``progress(prompts,
    positions)`` is called after each batch of prompts."""
    prompts = [i for i, item in enumerate(items) if item.prompt]
    out = [TrainSequence(item.ids, 0) for item in items]
    if not prompts:
        return out
    asked = [items[i].ids for i in prompts]
    found = batch_greedy(distill_model(), asked, settings.response_tokens, eos_ids, settings.distill_batch,
                         progress=progress, keep_features=keeps_features(settings), aux_layers=aux_layers_of(settings))
    for i, p, d in zip(prompts, asked, found):
        n = min(len(p) + len(d.response), settings.max_seq_len)
        out[i] = TrainSequence((p + d.response)[:n], len(p), None if d.hidden is None else d.hidden[:n],
                               None if d.pred is None else d.pred[:n], None if d.aux is None else d.aux[:n])
    return out


def build_sequences(records: Sequence[Record], codec: TextCodec, settings: TrainSettings,
                    distill_model: Optional[Callable[[], Decoder]]) -> List[TrainSequence]:
    """Records -> training sequences (:func:`build_items`, then :func:`answer`), all in memory.

    Raises:
        BadInput: prompt records without ``self_distill``; no sequence at all.
    """
    return answer(build_items(records, codec, settings), settings, codec.eos_ids, distill_model)


def aux_layers_of(settings: TrainSettings) -> tuple:
    """The target layers whose residual streams the features keep (EAGLE-3's ``aux_layers``, resolved
    by :func:`mtpctl.train.add_heads.add_heads`), else none."""
    return tuple(settings.aux_layers or ()) if settings.kind == "eagle3" else ()


def keeps_features(settings: TrainSettings) -> bool:
    """Whether self-distillation's own pass gives the features: same dtype, and no soft labels (their
    top-m distributions come from the teacher-forced pass)."""
    return settings.distill_dtype == settings.features_dtype and not settings.soft_labels


#: padded tokens of one batched teacher-forced pass at most (a longer sequence runs alone)
FEATURE_BATCH_TOKENS = 8192


@torch.inference_mode()
def compute_features(model: Optional[Decoder], sequences: Sequence[TrainSequence], settings: TrainSettings,
                     chunk_tokens: int = 1024, progress: Optional[Callable[[int, int], None]] = None) -> Features:
    """Features of every sequence: kept from self-distillation where a sequence has them, else from
    teacher-forced passes of ``model`` (which may be None when every sequence has them) over several
    sequences at once (left-padded, up to ``distill_batch`` sequences and :data:`FEATURE_BATCH_TOKENS`
    padded tokens a pass, similar lengths together). ``progress(sequences, positions)`` is called after
    each teacher-forced pass."""
    out = _empty_features(model, sequences, settings)
    layers = aux_layers_of(settings)
    for i, seq in enumerate(sequences):
        if seq.hidden is None:
            continue
        a, b = int(out.offsets[i]), int(out.offsets[i + 1])
        out.hidden[a:b] = seq.hidden
        out.pred[a:b] = seq.pred
        if layers:
            out.aux[a:b] = seq.aux
    todo = [i for i, s in enumerate(sequences) if s.hidden is None]
    for batch in length_batches([len(sequences[i].ids) for i in todo], settings.distill_batch, FEATURE_BATCH_TOKENS):
        rows = [todo[j] for j in batch]
        _teacher_forced(model, [sequences[i].ids for i in rows], [int(out.offsets[i]) for i in rows], out, settings,
                        chunk_tokens)
        if progress:
            progress(len(rows), sum(len(sequences[i].ids) for i in rows))
    return out


def _empty_features(model: Optional[Decoder], sequences: Sequence[TrainSequence], settings: TrainSettings) -> Features:
    """Features of the sequences' shape, to be filled (one allocation each, no concatenation)."""
    lengths = torch.tensor([0] + [len(s.ids) for s in sequences])
    offsets = lengths.cumsum(0)
    total = int(offsets[-1])
    kept = next((s for s in sequences if s.hidden is not None), None)
    width = model.cfg.hidden_size if model is not None else kept.hidden.shape[-1]
    layers = aux_layers_of(settings)
    soft = settings.soft_top if settings.soft_labels else 0
    return Features(torch.empty(total, width, dtype=torch.bfloat16), torch.empty(total, dtype=torch.long), offsets,
                    torch.tensor([s.loss_from for s in sequences]),
                    torch.tensor([i for s in sequences for i in s.ids], dtype=torch.long),
                    torch.empty(total, soft, dtype=torch.int32) if soft else None,
                    torch.empty(total, soft, dtype=torch.bfloat16) if soft else None,
                    torch.empty(total, len(layers) * width, dtype=torch.bfloat16) if layers else None)


def length_batches(lengths: Sequence[int], most: int, tokens: int) -> List[List[int]]:
    """Indices of ``lengths`` in batches of similar lengths (shortest first): at most ``most`` a batch
    and ``tokens`` padded tokens (a longer one alone)."""
    batches: List[List[int]] = []
    for i in sorted(range(len(lengths)), key=lambda j: (lengths[j], j)):
        if batches and len(batches[-1]) < most and (len(batches[-1]) + 1) * lengths[i] <= tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def _teacher_forced(model: Decoder, rows: List[List[int]], starts: List[int], out: Features, settings: TrainSettings,
                    chunk_tokens: int) -> None:
    """One left-padded teacher-forced pass over ``rows`` (token ids); row r's hidden states,
    predictions (and aux streams, soft labels) go to ``out`` from position ``starts[r]``."""
    device = model.device
    b, cap = len(rows), max(len(r) for r in rows)
    pad = torch.tensor([cap - len(r) for r in rows])
    ids = torch.tensor([[0] * int(pad[i]) + r for i, r in enumerate(rows)], dtype=torch.long)
    valid = torch.arange(cap)[None] >= pad[:, None]
    slot_pos = (torch.arange(cap)[None] - pad[:, None]).clamp(min=0)
    masks = {w: m.to(device) for w, m in padded_batch_masks(model.cfg.layer_windows, valid, slot_pos,
                                                                torch.arange(cap)).items()}
    layers = aux_layers_of(settings)
    streams = dict.fromkeys(layers) if layers else None
    hidden = model(ids.to(device), slot_pos.to(device), model.new_cache(cap, batch=b), masks, aux=streams)
    for r, start in enumerate(starts):
        p, n = int(pad[r]), len(rows[r])
        h = hidden[r, p:]
        out.hidden[start:start + n] = h.to(torch.bfloat16).cpu()
        if layers:
            out.aux[start:start + n] = torch.cat([streams[i][r, p:] for i in layers], dim=-1).to(torch.bfloat16).cpu()
        for a in range(0, n, chunk_tokens):
            logits = model.logits(h[a:a + chunk_tokens])
            out.pred[start + a:start + a + len(logits)] = logits.argmax(-1).cpu()
            if settings.soft_labels:
                top = logits.softmax(-1).topk(settings.soft_top, dim=-1)
                out.soft_ids[start + a:start + a + len(logits)] = top.indices.to(torch.int32).cpu()
                out.soft_probs[start + a:start + a + len(logits)] = top.values.to(torch.bfloat16).cpu()


def example_positions(feats: Features, seq_ids: Sequence[int]) -> torch.Tensor:
    """Flat indices of the positions that train (a position t of a sequence from ``loss_from - 1``
    on, with at least one label: t + 1 < its length)."""
    out = []
    for s in seq_ids:
        start, end = int(feats.offsets[s]), int(feats.offsets[s + 1])
        first = start + max(int(feats.loss_from[s]) - 1, 0)
        out.append(torch.arange(first, end - 1))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


def head_labels(feats: Features, positions: torch.Tensor, num_heads: int, vocab_index: Optional[torch.Tensor],
                reads_next: bool = True) -> torch.Tensor:
    """Labels ``[B, K]`` for positions ``[B]``: head k's label is ``pred[t + k]`` inside the same
    sequence where the tokens between follow the target's path (``ids[t + j + 1] == pred[t + j]`` for
    j = 1..k-1, and for j = 0 too unless the heads read the next token, ``reads_next``), else -100
    (ignored); with a draft vocabulary, the label's index in it (-100 outside)."""
    seq = torch.searchsorted(feats.offsets, positions, right=True) - 1
    end = feats.offsets[seq + 1]
    ks = torch.arange(1, num_heads + 1)
    target = positions[:, None] + ks[None]
    last = len(feats.pred) - 1
    steps = positions[:, None] + torch.arange(num_heads)[None]  # t + j, j = 0..K-1
    on_path = feats.ids[(steps + 1).clamp(max=last)] == feats.pred[steps.clamp(max=last)]  # [B, K]
    if reads_next:
        on_path[:, 0] = True
    on_path = on_path.long().cumprod(dim=1).bool()  # head k needs every step j < k on the path
    inside = target < end[:, None]
    labels = torch.where(inside & on_path, feats.pred[target.clamp(max=last)], torch.tensor(-100))
    if vocab_index is not None:
        labels = torch.where(labels >= 0, vocab_index[labels.clamp(min=0)], labels)
    return labels


def pending_tokens(heads: MedusaHeads, feats: Features, positions: torch.Tensor) -> Optional[torch.Tensor]:
    """Ids of the tokens the heads read at each position ``[B]``: the tokens that follow it, which
    along every path the target accepts are its own predictions (at decode time the pending token is
    ``pred[t]``; :func:`head_labels` keeps a label only where the tokens before it are on the target's
    path). Token-conditioned Medusa heads: ``ids[t + 1]``, ``[B]``; Hydra heads ``ids[t + 1 + k]`` for
    k = 0..K-1, ``[B, K]`` (past a sequence's end the tokens are arbitrary: every later head's label
    there is ignored). None for plain Medusa heads."""
    if not heads.cfg.token_conditioned:
        return None
    last = len(feats.ids) - 1
    if not heads.sequential:
        return feats.ids[(positions + 1).clamp(max=last)]
    index = positions[:, None] + 1 + torch.arange(heads.cfg.num_heads)[None]
    return feats.ids[index.clamp(max=last)]


def pending_embeds(heads: MedusaHeads, feats: Features, positions: torch.Tensor,
                   embed: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Embeddings ``[B, hidden]`` or ``[B, K, hidden]`` (float32) of :func:`pending_tokens`; None for
    plain Medusa heads."""
    tokens = pending_tokens(heads, feats, positions)
    return None if tokens is None else embed[tokens.to(embed.device)].float()


def run_key(*parts) -> str:
    """A short stable hash of JSON-able parts (names a cache or work folder)."""
    import hashlib

    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def data_fingerprint(paths: Sequence[Path]) -> List[str]:
    """sha256 of each data file (the features cache key)."""
    return [sha256_file(Path(p)) for p in paths]
