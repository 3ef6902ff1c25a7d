"""The target's view of the training data, computed once and cached on disk: hidden states (after
the final norm) and the target's own predictions at every position of every sequence, and the labels
each head learns from them.

For self-distilled sequences, self-distillation keeps what its passes computed (when
``distill_dtype`` equals ``features_dtype`` and without soft labels); otherwise, and for text
records, one teacher-forced pass of the target gives them. The cache is keyed by the target's weight
hash, the data and the settings that shape the features, so epochs, re-runs and ``--resume`` never
re-run the target.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import torch

from mtpctl.decode.attention import attention_masks
from mtpctl.drafters.heads.medusa import MedusaHeads
from mtpctl.errors import BadInput
from mtpctl.files import sha256_file
from mtpctl.model.decoder import Decoder
from mtpctl.model.tokenizer import TextCodec
from mtpctl.train import distributed
from mtpctl.train.distill import Record, TrainSequence, batch_greedy
from mtpctl.train.settings import TrainSettings

FEATURES_FORMAT = 3  # 2: input ids cached too (EAGLE reads them); 3: kept from self-distillation
# (a new format recomputes the cache)


@dataclass
class Features:
    """The target's view of the training data, cached on disk.

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

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        tensors = {k: v.contiguous() for k, v in asdict(self).items() if v is not None}
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> "Features":
        from safetensors.torch import load_file

        return cls(**load_file(str(path)))


def build_sequences(records: Sequence[Record], codec: TextCodec, settings: TrainSettings,
                    distill_model: Optional[Callable[[], Decoder]]) -> List[TrainSequence]:
    """Records -> training sequences; prompts are answered by the target (self-distillation), which
    keeps its hidden states and predictions when :func:`keeps_features` says they can serve as features.

    Raises:
        BadInput: prompt records without ``self_distill``.
    """
    texts, prompts = [], []
    for r in records:
        if r.text is not None:
            ids = [int(i) for i in codec.tokenizer(r.text)["input_ids"]][: settings.max_seq_len]
            if len(ids) > 1:
                texts.append(TrainSequence(ids, 0))
        else:
            prompts.append(codec.encode_messages(r.messages)[: settings.max_seq_len - 1])
    if prompts and not settings.self_distill:
        raise BadInput(f"{len(prompts)} record(s) are prompts without responses: self-distill so the target "
                       "writes them, or give text records", option="self_distill")
    sequences = list(texts)
    if prompts:
        model = distill_model()
        plural = "s" if len(prompts) != 1 else ""
        distributed.log(f"self-distillation: the target answers {len(prompts)} prompt{plural} ({settings.distill_batch} at a "
            f"time, {settings.distill_dtype})")
        bar = distributed.progress_bar(len(prompts), "distill")
        found = batch_greedy(model, prompts, settings.response_tokens, codec.eos_ids, settings.distill_batch,
                             progress=bar.update if bar else None, keep_features=keeps_features(settings),
                             aux_layers=aux_layers_of(settings))
        if bar:
            bar.close()
        for p, d in zip(prompts, found):
            n = min(len(p) + len(d.response), settings.max_seq_len)
            sequences.append(TrainSequence((p + d.response)[:n], len(p), None if d.hidden is None else d.hidden[:n],
                                           None if d.pred is None else d.pred[:n],
                                           None if d.aux is None else d.aux[:n]))
    if not sequences:
        raise BadInput("the training data holds no sequence of two tokens or more")
    return sequences


def aux_layers_of(settings: TrainSettings) -> tuple:
    """The target layers whose residual streams the features keep (EAGLE-3's ``aux_layers``, resolved
    by :func:`mtpctl.train.add_heads.add_heads`), else none."""
    return tuple(settings.aux_layers or ()) if settings.kind == "eagle3" else ()


def keeps_features(settings: TrainSettings) -> bool:
    """Whether self-distillation's own pass gives the features: same dtype, and no soft labels (their
    top-m distributions come from the teacher-forced pass)."""
    return settings.distill_dtype == settings.features_dtype and not settings.soft_labels


@torch.inference_mode()
def compute_features(model: Optional[Decoder], sequences: Sequence[TrainSequence], settings: TrainSettings,
                     chunk_tokens: int = 4096) -> Features:
    """Features of every sequence: kept from self-distillation where a sequence has them, else one
    teacher-forced pass of ``model`` (which may be None when every sequence has them)."""
    hidden, pred, soft_ids, soft_probs, aux = [], [], [], [], []
    layers = aux_layers_of(settings)
    bar = distributed.progress_bar(len(sequences), "features")
    for seq in sequences:
        if seq.hidden is not None:
            hidden.append(seq.hidden.to(torch.bfloat16))
            pred.append(seq.pred)
            if layers:
                aux.append(seq.aux.to(torch.bfloat16))
            if bar:
                bar.update(1)
            continue
        ids = seq.ids
        cache = model.new_cache(len(ids))
        depth = torch.arange(len(ids))
        masks = attention_masks(model.cfg.layer_windows, 0, depth, None, len(ids))
        streams = dict.fromkeys(layers) if layers else None
        h = model(torch.tensor([ids]), depth[None], cache, masks, aux=streams)[0]
        if layers:
            aux.append(torch.cat([streams[i][0] for i in layers], dim=-1).to(torch.bfloat16))
        for start in range(0, len(ids), chunk_tokens):
            logits = model.logits(h[start:start + chunk_tokens])
            pred.append(logits.argmax(-1))
            if settings.soft_labels:
                top = logits.softmax(-1).topk(settings.soft_top, dim=-1)
                soft_ids.append(top.indices.to(torch.int32))
                soft_probs.append(top.values.to(torch.bfloat16))
        hidden.append(h.to(torch.bfloat16))
        if bar:
            bar.update(1)
    if bar:
        bar.close()
    lengths = torch.tensor([0] + [len(s.ids) for s in sequences])
    return Features(torch.cat(hidden), torch.cat(pred), lengths.cumsum(0), torch.tensor([s.loss_from for s in sequences]),
                    torch.tensor([i for s in sequences for i in s.ids], dtype=torch.long),
                    torch.cat(soft_ids) if soft_ids else None, torch.cat(soft_probs) if soft_probs else None,
                    torch.cat(aux) if aux else None)


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


def pending_embeds(heads: MedusaHeads, feats: Features, positions: torch.Tensor,
                   embed: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Embeddings of the tokens the heads read at each position ``[B]``: the tokens that follow it,
    which along every path the target accepts are its own predictions (at decode time the pending
    token is ``pred[t]``; :func:`head_labels` keeps a label only where the tokens before it are on the
    target's path). Token-conditioned Medusa heads: ``ids[t + 1]``, ``[B, hidden]``; Hydra heads
    ``ids[t + 1 + k]`` for k = 0..K-1, ``[B, K, hidden]`` (past a sequence's end the tokens are
    arbitrary: every later head's label there is ignored). None for plain Medusa heads."""
    if not heads.cfg.token_conditioned:
        return None
    last = len(feats.ids) - 1
    if not heads.sequential:
        return embed[feats.ids[(positions + 1).clamp(max=last)]].float()
    index = positions[:, None] + 1 + torch.arange(heads.cfg.num_heads)[None]
    return embed[feats.ids[index.clamp(max=last)]].float()


def run_key(*parts) -> str:
    """A short stable hash of JSON-able parts (names a cache or work folder)."""
    import hashlib

    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def data_fingerprint(paths: Sequence[Path]) -> List[str]:
    """sha256 of each data file (the features cache key)."""
    return [sha256_file(Path(p)) for p in paths]
