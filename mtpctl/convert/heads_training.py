"""``add-heads``: graft Medusa heads onto a frozen target and train them by self-distillation.

Pipeline (Cai et al. 2024, "Medusa", Medusa-1: the base model stays frozen):

1. data: text records, or prompts answered by the target itself (:mod:`mtpctl.convert.distill`);
2. features: the hidden states ``[T, hidden]`` (after the final norm) and the target's own prediction
   at each position (argmax, and with ``soft_labels`` its top-m distribution) of every sequence. For
   self-distilled sequences self-distillation keeps them as it generates (when ``distill_dtype`` equals
   ``features_dtype`` and without soft labels); otherwise, and for text records, one teacher-forced
   pass of the target gives them. They are cached on disk, keyed by the target's
   weight hash, the data and the settings that shape them, so epochs, re-runs and ``--resume`` never
   re-run the target;
3. training: head k (1-based) at position t learns the target's prediction for token t+1+k, i.e.
   ``pred[t + k]``, where the tokens between follow the target's own path (``ids[t + j + 1] ==
   pred[t + j]`` for 0 < j < k; from j = 0 for heads that do not read the next token), as they do along
   any path the target accepts at decode time (a self-distilled response always; plain text only
   where it happens to); loss = sum_k decay^(k-1) * CE (or KL to the target's distribution with
   ``soft_labels``); AdamW, linear warm-up then cosine decay, gradient accumulation; positions are
   independent examples (the heads see one hidden state), shuffled with a seeded generator;
4. evaluation: per-head top-k accuracy on held-out sequences; the default draft tree is grown from
   it (:func:`mtpctl.runtime.heads.tree_from_accuracy`);
5. output: ``mtp_config.json`` + ``mtp_heads.safetensors`` + ``mtp_datastore.safetensors`` (the training
   sequences as a retrieval datastore) written to a temporary folder and renamed.

Under ``torchrun --nproc-per-node N`` (DDP, gloo on CPU) rank 0 prepares the features, every rank
trains on its share of each batch, gradients are averaged, and rank 0 writes the output.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

from mtpctl import __version__
from mtpctl.convert.distill import Record, TrainSequence, batch_greedy, read_records
from mtpctl.errors import BadInput, MtpctlError
from mtpctl.runtime.heads import (
    KINDS,
    HeadsConfig,
    MedusaHeads,
    StaticTree,
    tree_from_accuracy,
)
from mtpctl.runtime.eagle import layer_config_for
from mtpctl.runtime.engine import MAX_DRAFT_DEPTH
from mtpctl.model.decoder import Decoder
from mtpctl.runtime.retrieval import DATASTORE_FILE, Datastore
from mtpctl.model.tokenizer import TextCodec
from mtpctl.model.weights import weights_hash

FEATURES_FORMAT = 3  # 2: input ids cached too (EAGLE reads them); 3: kept from self-distillation
# (a new format recomputes the cache)
EVAL_RANKS = 10  # top-k accuracy measured per head (the deepest rank a grown tree can use)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class TrainSettings:
    """Every setting of an ``add-heads`` run (recorded in ``mtp_config.json``)."""

    kind: str = "medusa"
    num_heads: int = 4
    head_layers: int = 1
    own_lm_head: bool = False
    draft_vocab: int = 0  # score only the N most frequent target predictions (0 = the full vocabulary)
    condition_on_token: bool = False  # heads also read the pending token's embedding (HeadsConfig.token_conditioned)
    self_distill: bool = False  # prompts get responses written by the target
    response_tokens: int = 128  # longest self-distilled response
    distill_batch: int = 32  # prompts decoded together
    distill_dtype: str = "bfloat16"
    features_dtype: str = "float32"  # the target's teacher-forced pass that gives hidden states and labels
    max_seq_len: int = 512  # longer sequences are cut
    soft_labels: bool = False  # KL to the target's top-m distribution instead of CE to its argmax
    soft_top: int = 16  # m
    epochs: float = 2.0
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup: float = 0.05  # fraction of the optimizer steps
    batch_tokens: int = 256  # positions per optimizer micro-batch
    grad_accum: int = 1
    head_decay: float = 0.8  # loss weight of head k is head_decay ** (k - 1)
    holdout: float = 0.05  # fraction of sequences held out for accuracy
    tree_nodes: int = 4  # nodes of the default draft tree (the size generate uses by default, session.DEFAULT_TREE_NODES)
    seed: int = 0

    def check(self) -> None:
        """Raise BadInput on a setting that cannot work."""
        if self.kind not in KINDS:
            raise BadInput(f"head kind {self.kind!r} is not available (choose from {', '.join(KINDS)})")
        for name in ("num_heads", "batch_tokens", "grad_accum", "response_tokens", "distill_batch",
                     "tree_nodes", "soft_top"):
            if getattr(self, name) < 1:
                raise BadInput(f"{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.max_seq_len < 2:
            raise BadInput(f"max-seq-len must be at least 2, got {self.max_seq_len} (a training sequence needs "
                           "two tokens)")
        if self.head_layers < 0 or self.draft_vocab < 0:
            raise BadInput("head-layers and draft-vocab must be >= 0")
        if not self.epochs > 0 or not self.lr > 0:
            raise BadInput(f"epochs and lr must be > 0, got {self.epochs} and {self.lr}")
        if not 0 < self.holdout < 1 or not 0 <= self.warmup < 1 or not 0 < self.head_decay <= 1:
            raise BadInput("holdout must be in (0, 1), warmup in [0, 1), head-decay in (0, 1]")
        if self.kind == "eagle" and self.own_lm_head:
            raise BadInput("eagle heads project through the target's lm_head: drop --own-lm-head")
        if self.kind == "eagle" and self.condition_on_token:
            raise BadInput("an eagle head always reads the next token: drop --condition-on-token")
        if self.kind == "eagle" and self.soft_labels:
            raise BadInput("eagle heads train on the target's argmax only: drop --soft-labels")
        if self.num_heads > MAX_DRAFT_DEPTH:
            raise BadInput(f"num-heads must be at most {MAX_DRAFT_DEPTH} (the deepest draft tree verification "
                           f"supports), got {self.num_heads}")
        for name in ("distill_dtype", "features_dtype"):
            if getattr(self, name) not in DTYPES:
                raise BadInput(f"{name.replace('_', ' ')} {getattr(self, name)!r}: choose from {', '.join(DTYPES)}")


@dataclass
class Features:
    """The target's view of the training data, cached on disk.

    hidden ``[P, hidden]`` (bfloat16) and pred ``[P]`` (int64) for all P positions of all sequences
    back to back; ``offsets [S + 1]`` where each sequence starts; ``loss_from [S]`` its first position
    with a loss; ``ids [P]`` the input token ids; with soft labels ``soft_ids``/``soft_probs`` ``[P, m]``.
    """

    hidden: torch.Tensor
    pred: torch.Tensor
    offsets: torch.Tensor
    loss_from: torch.Tensor
    ids: torch.Tensor
    soft_ids: Optional[torch.Tensor] = None
    soft_probs: Optional[torch.Tensor] = None

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


@dataclass
class Progress:
    """Where training stands (saved with each checkpoint)."""

    step: int = 0  # optimizer steps done
    history: List[dict] = field(default_factory=list)  # per evaluation: step, loss, per-head top-1


def log(message: str) -> None:
    """Progress goes to stderr, from rank 0 only."""
    if _rank() == 0:
        print(f"mtpctl: {message}", file=sys.stderr, flush=True)


def is_main_process() -> bool:
    """True outside torchrun, and on rank 0 under it."""
    return _rank() == 0


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _world() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


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
        raise BadInput(f"{len(prompts)} record(s) are prompts without responses: add --self-distill so the "
                       "target writes them, or give text records")
    sequences = list(texts)
    if prompts:
        model = distill_model()
        plural = "s" if len(prompts) != 1 else ""
        log(f"self-distillation: the target answers {len(prompts)} prompt{plural} ({settings.distill_batch} at a "
            f"time, {settings.distill_dtype})")
        bar = _bar(len(prompts), "distill")
        found = batch_greedy(model, prompts, settings.response_tokens, codec.eos_ids, settings.distill_batch,
                             progress=bar.update if bar else None, keep_features=keeps_features(settings))
        if bar:
            bar.close()
        for p, d in zip(prompts, found):
            n = min(len(p) + len(d.response), settings.max_seq_len)
            sequences.append(TrainSequence((p + d.response)[:n], len(p), None if d.hidden is None else d.hidden[:n],
                                           None if d.pred is None else d.pred[:n]))
    if not sequences:
        raise BadInput("the training data holds no sequence of two tokens or more")
    return sequences


def keeps_features(settings: TrainSettings) -> bool:
    """Whether self-distillation's own pass gives the features: same dtype, and no soft labels (their
    top-m distributions come from the teacher-forced pass)."""
    return settings.distill_dtype == settings.features_dtype and not settings.soft_labels


@torch.inference_mode()
def compute_features(model: Optional[Decoder], sequences: Sequence[TrainSequence], settings: TrainSettings,
                     chunk_tokens: int = 4096) -> Features:
    """Features of every sequence: kept from self-distillation where a sequence has them, else one
    teacher-forced pass of ``model`` (which may be None when every sequence has them)."""
    from mtpctl.runtime.engine import attention_masks

    hidden, pred, soft_ids, soft_probs = [], [], [], []
    bar = _bar(len(sequences), "features")
    for seq in sequences:
        if seq.hidden is not None:
            hidden.append(seq.hidden.to(torch.bfloat16))
            pred.append(seq.pred)
            if bar:
                bar.update(1)
            continue
        ids = seq.ids
        cache = model.new_cache(len(ids))
        depth = torch.arange(len(ids))
        masks = attention_masks(model.cfg.layer_windows, 0, depth, None, len(ids))
        h = model(torch.tensor([ids]), depth[None], cache, masks)[0]
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
                    torch.cat(soft_ids) if soft_ids else None, torch.cat(soft_probs) if soft_probs else None)


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


def head_losses(logits: torch.Tensor, labels: torch.Tensor, soft: Optional[tuple] = None) -> torch.Tensor:
    """Per-head mean loss ``[K]`` of draft logits ``[B, K, V]`` against labels ``[B, K]`` (-100 ignored):
    cross-entropy, or with ``soft = (ids [B, K, m], probs [B, K, m])`` the cross-entropy to the target's
    renormalised top-m distribution (KL up to the target's entropy, a constant)."""
    sums, counts = head_loss_sums(logits, labels, soft)
    return sums / counts.clamp(min=1)


def head_loss_sums(logits: torch.Tensor, labels: torch.Tensor, soft: Optional[tuple] = None) -> tuple:
    """Per-head summed loss ``[K]`` and number of labelled positions ``[K]`` (see :func:`head_losses`)."""
    valid = labels >= 0  # [B, K]
    if soft is None:
        flat = F.cross_entropy(logits.flatten(0, 1), labels.flatten().clamp(min=0), reduction="none")
        per_pos = flat.view(labels.shape)
    else:
        ids, probs = soft
        keep = ids >= 0
        probs = torch.where(keep, probs.float(), 0.0)
        probs = probs / probs.sum(-1, keepdim=True).clamp(min=1e-9)
        logp = logits.log_softmax(-1).gather(-1, ids.clamp(min=0))
        per_pos = -(probs * logp).sum(-1)
    per_pos = torch.where(valid, per_pos, 0.0)
    return per_pos.sum(0), valid.sum(0).float()


@torch.no_grad()
def topk_accuracy(heads: MedusaHeads, lm_head, feats: Features, positions: torch.Tensor,
                  vocab_index: Optional[torch.Tensor], ranks: int = EVAL_RANKS, batch: int = 512,
                  embed: Optional[torch.Tensor] = None) -> List[List[float]]:
    """``acc[k][r]``: the share of held-out positions where head k+1's rank-r candidate is the
    target's token (labels outside a draft vocabulary count as misses)."""
    k_heads = heads.cfg.num_heads
    hits = torch.zeros(k_heads, ranks)
    counts = torch.zeros(k_heads)
    for start in range(0, len(positions), batch):
        pos = positions[start:start + batch]
        labels = head_labels(feats, pos, k_heads, None, heads.cfg.token_conditioned)
        logits = heads.draft_vocab_logits(feats.hidden[pos].float(), lm_head, pending_embeds(heads, feats, pos, embed))
        top = logits.topk(ranks, dim=-1).indices  # [B, K, ranks] in draft-vocab indices
        if heads.token_map is not None:
            top = heads.token_map[top]
        valid = labels >= 0
        hits += ((top == labels[..., None]) & valid[..., None]).sum(0).float()
        counts += valid.sum(0).float()
    return (hits / counts.clamp(min=1)[:, None]).tolist()


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


def _bar(total: int, desc: str):
    if _rank() != 0:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=f"mtpctl: {desc}", unit="it", leave=False, dynamic_ncols=True)


def lr_at(step: int, total: int, settings: TrainSettings) -> float:
    """Linear warm-up over ``warmup * total`` steps, then cosine decay to 0 (multiplier of lr)."""
    warm = int(settings.warmup * total)
    if step < warm:
        return (step + 1) / warm
    progress = (step - warm) / max(total - warm, 1)
    return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


class Trainer:
    """One add-heads run over cached features (see the module docstring).

    Args:
        target: the frozen target (float32).
        feats: the cached features.
        settings: the run's settings.
        work: folder for checkpoints (``--resume`` continues from ``work/checkpoint.*``).
    """

    #: what one accuracy figure is about, in progress lines
    unit = "head"

    def __init__(self, target: Decoder, feats: Features, settings: TrainSettings, work: Path):
        self.target, self.feats, self.s, self.work = target, feats, settings, work
        cfg = target.cfg
        torch.manual_seed(settings.seed)
        token_map = self._draft_vocab() if settings.draft_vocab else None
        self.vocab_index = None
        if token_map is not None:
            self.vocab_index = torch.full((cfg.vocab_size,), -100, dtype=torch.long)
            self.vocab_index[token_map] = torch.arange(len(token_map))
        eagle = settings.kind == "eagle"  # one layer that always reads the next token: no blocks per head
        self.hcfg = HeadsConfig(settings.kind, settings.num_heads, 0 if eagle else settings.head_layers,
                                settings.own_lm_head, cfg.hidden_size, cfg.vocab_size,
                                len(token_map) if token_map is not None else 0,
                                token_conditioned=(settings.condition_on_token or settings.kind == "hydra") and not eagle,
                                layer=layer_config_for(cfg) if eagle else None)
        self.heads = self._new_heads(token_map)
        split = torch.randperm(len(feats.loss_from), generator=torch.Generator().manual_seed(settings.seed)).tolist()
        n_eval = max(1, int(round(settings.holdout * len(split)))) if len(split) > 1 else 0
        self.eval_seqs, self.train_seqs = sorted(split[:n_eval]), sorted(split[n_eval:] or split)
        self.eval_pos = example_positions(feats, self.eval_seqs)
        self.train_pos = example_positions(feats, self.train_seqs)
        if len(self.train_pos) == 0:
            raise BadInput("the training data leaves no position to train on (sequences too short)")
        self.model = self.heads
        if _world() > 1:
            self.model = torch.nn.parallel.DistributedDataParallel(self.heads)
        self.params = [p for p in self.heads.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=settings.lr, weight_decay=settings.weight_decay)
        self.epoch_steps = self._epoch_steps()
        self.total_steps = max(1, int(round(self.epoch_steps * settings.epochs)))
        self.progress = Progress()

    def _new_heads(self, token_map: Optional[torch.Tensor]) -> torch.nn.Module:
        return MedusaHeads(self.hcfg, torch.float32, self.target.dense_lm_head().float(), token_map)

    def _epoch_steps(self) -> int:
        """Optimizer steps per epoch."""
        return math.ceil(len(self.train_pos) / (self.s.batch_tokens * self.s.grad_accum))

    def _draft_vocab(self) -> torch.Tensor:
        """The ``draft_vocab`` most frequent target predictions in the data (ids ascending)."""
        counts = torch.bincount(self.feats.pred, minlength=self.target.cfg.vocab_size)
        n = min(self.s.draft_vocab, self.target.cfg.vocab_size)
        return counts.topk(n).indices.sort().values

    @property
    def lm_head(self):
        return self.target.logits

    def _batches(self):
        """Micro-batches of positions for each optimizer step from ``progress.step`` on; every rank
        takes its slice of each micro-batch."""
        s = self.s
        per_step = s.batch_tokens * s.grad_accum
        n = len(self.train_pos)
        epoch_steps = math.ceil(n / per_step)
        step = self.progress.step
        while step < self.total_steps:
            epoch, offset = divmod(step, epoch_steps)
            order = torch.randperm(n, generator=torch.Generator().manual_seed(s.seed * 1000 + epoch + 1))
            chunk = self.train_pos[order[offset * per_step:(offset + 1) * per_step]]
            micro = [chunk[i:i + s.batch_tokens] for i in range(0, len(chunk), s.batch_tokens)]
            yield step, [(m[_rank()::_world()], self._label_counts(m)) for m in micro]
            step += 1

    def _label_counts(self, pos: torch.Tensor) -> torch.Tensor:
        """Labelled positions per head ``[K]`` in a whole micro-batch (all ranks together)."""
        return (head_labels(self.feats, pos, self.s.num_heads, self.vocab_index, self.hcfg.token_conditioned)
                >= 0).sum(0).float()

    def _loss(self, pos: torch.Tensor, counts: torch.Tensor) -> tuple:
        """(weighted loss, per-head losses ``[K]``) of this rank's positions ``pos``; each head's loss
        is its sum over ``pos`` divided by ``counts`` (the whole micro-batch's labelled positions) times
        the world size, so DDP's gradient average equals one process on the whole micro-batch."""
        s = self.s
        labels = head_labels(self.feats, pos, s.num_heads, self.vocab_index, self.hcfg.token_conditioned)
        logits = self.model(self.feats.hidden[pos].float(), self.lm_head, full_vocab=False,
                            token_embeds=pending_embeds(self.heads, self.feats, pos, self.target.embed))
        soft = None
        if s.soft_labels:
            target = pos[:, None] + torch.arange(1, s.num_heads + 1)[None]
            target = target.clamp(max=len(self.feats.pred) - 1)
            ids = self.feats.soft_ids[target].long()
            if self.vocab_index is not None:
                ids = self.vocab_index[ids]
            soft = (ids, self.feats.soft_probs[target])
        sums, _ = head_loss_sums(logits, labels, soft)
        per_head = sums / counts.clamp(min=1) * _world()
        weights = s.head_decay ** torch.arange(s.num_heads, dtype=torch.float32)
        return (per_head * weights).sum(), per_head.detach()

    def train(self, resume: bool, on_eval: Optional[Callable[[dict], None]] = None) -> Progress:
        """Run (or continue) training; checkpoint every epoch and at the end. Returns the progress."""
        if resume:
            self._load_checkpoint()
        epoch_steps = self.epoch_steps
        bar = _bar(self.total_steps, "train")
        if bar:
            bar.update(self.progress.step)
        running = None
        for step, micro in self._batches():
            for group in self.opt.param_groups:
                group["lr"] = self.s.lr * lr_at(step, self.total_steps, self.s)
            self.opt.zero_grad(set_to_none=True)
            for m, counts in micro:
                loss, per_head = self._loss(m, counts)
                (loss / len(micro)).backward()
            self.opt.step()
            self.progress.step = step + 1
            value = loss.item()
            running = value if running is None else 0.9 * running + 0.1 * value
            if bar:
                bar.update(1)
                bar.set_postfix(loss=f"{running:.3f}")
            end_of_epoch = self.progress.step % epoch_steps == 0 or self.progress.step == self.total_steps
            if end_of_epoch:
                acc = self.evaluate(ranks=1)
                entry = {"step": self.progress.step, "loss": round(running, 4),
                         "top1": [round(a[0], 4) for a in acc]}
                self.progress.history.append(entry)
                if bar:
                    bar.write(f"mtpctl: step {entry['step']}/{self.total_steps} loss {entry['loss']} "
                              f"held-out top-1 per {self.unit} {entry['top1']}", file=sys.stderr)
                if on_eval:
                    on_eval(entry)
                self._save_checkpoint()
        if bar:
            bar.close()
        return self.progress

    def evaluate(self, ranks: int = EVAL_RANKS) -> List[List[float]]:
        """Per-head top-k accuracy on the held-out positions (see :func:`topk_accuracy`)."""
        return topk_accuracy(self.heads, self.lm_head, self.feats, self.eval_pos, self.vocab_index, ranks,
                             embed=self.target.embed)

    def _save_checkpoint(self) -> None:
        if _rank() != 0:
            return
        from safetensors.torch import save_file

        tensors = {f"model.{k}": v.contiguous() for k, v in self.heads.state_dict().items()}
        for i, p in enumerate(self.params):
            for name, value in self.opt.state.get(p, {}).items():
                tensors[f"optim.{i}.{name}"] = value.reshape(-1).contiguous() if value.dim() == 0 else value.contiguous()
        save_file(tensors, str(self.work / "checkpoint.tmp"))
        (self.work / "checkpoint.json.tmp").write_text(json.dumps(asdict(self.progress)), encoding="utf-8")
        os.replace(self.work / "checkpoint.tmp", self.work / "checkpoint.safetensors")
        os.replace(self.work / "checkpoint.json.tmp", self.work / "checkpoint.json")

    def _load_checkpoint(self) -> None:
        from safetensors.torch import load_file

        path = self.work / "checkpoint.safetensors"
        if not path.exists():
            log("--resume: no checkpoint of this run yet; starting from the beginning")
            return
        tensors = load_file(str(path))
        self.heads.load_state_dict({k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")})
        for i, p in enumerate(self.params):
            state = {name.split(".", 2)[2]: v for name, v in tensors.items() if name.startswith(f"optim.{i}.")}
            if state:
                state["step"] = state["step"].reshape(())
                self.opt.state[p] = state
        self.progress = Progress(**json.loads((self.work / "checkpoint.json").read_text(encoding="utf-8")))
        log(f"--resume: continuing at step {self.progress.step} of {self.total_steps}")


def run_key(*parts) -> str:
    """A short stable hash of JSON-able parts (names a cache or work folder)."""
    import hashlib

    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def data_fingerprint(paths: Sequence[Path]) -> List[str]:
    """sha256 of each data file (the features cache key)."""
    import hashlib

    return [hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in paths]


def write_datastore(feats: Features, path: Path, vocab_size: int) -> Path:
    """Write the training sequences (prompts and the target's self-distilled responses) as a
    retrieval datastore (:mod:`mtpctl.runtime.retrieval`) to ``path``, recording the target's
    ``vocab_size``; returns ``path``."""
    ids, offsets = feats.ids.tolist(), feats.offsets.tolist()
    Datastore.from_sequences([ids[a:b] for a, b in zip(offsets[:-1], offsets[1:])]).save(path, vocab_size)
    return path


def write_output(out: Path, heads: MedusaHeads, overwrite: bool, extra_files: Dict[str, Path]) -> None:
    """Write the head folder to ``out`` atomically: a temporary sibling folder, renamed when complete;
    an existing ``out`` is replaced only with ``overwrite`` (after the new one is complete).

    Raises:
        BadInput: ``out`` exists and ``overwrite`` is not set.
    """
    from mtpctl.convert.onnx_export import finish_output, prepare_output

    tmp = prepare_output(Path(out), overwrite)
    try:
        heads.save(tmp)
        for name, src in extra_files.items():
            shutil.copy2(src, tmp / name)
        finish_output(tmp, Path(out))  # ordinary file modes (safetensors writes owner-only files)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def add_heads(target_folder: Path, target_name: str, data: Sequence[Path], out: Path, settings: TrainSettings,
              home: Path, resume: bool = False, overwrite: bool = False, bundle: bool = False) -> dict:
    """Train Medusa heads for the target in ``target_folder`` and write them to ``out``.

    Args:
        target_folder: the target checkpoint (Hugging Face folder).
        target_name: how the user named it (recorded in the config).
        data: ``.txt``/``.jsonl`` data files (see :mod:`mtpctl.convert.distill`).
        out: the head folder to write.
        settings: training settings.
        home: mtpctl's cache folder (features and checkpoints live under ``home/work``).
        resume: continue from this run's last checkpoint.
        overwrite: replace an existing ``out``.
        bundle: copy the target's weights into ``out`` (otherwise they are referenced by hash).

    Returns:
        the training summary written into the config (figures and timings).

    Raises:
        BadInput: bad settings or data, or ``out`` exists without ``overwrite``.
        CorruptModel, UnsupportedModel: the target cannot be loaded.
    """
    settings.check()
    out = Path(out)
    if out.exists() and not overwrite:
        raise BadInput(f"{out} already exists: choose another --out or add --overwrite")
    started = time.perf_counter()
    codec = TextCodec(target_folder)
    target_hash = weights_hash(target_folder)
    records = read_records(data)
    target = Decoder.from_folder(target_folder, torch.float32)
    if settings.max_seq_len > target.cfg.max_position_embeddings:  # no sequence runs past the model's context
        settings = replace(settings, max_seq_len=target.cfg.max_position_embeddings)
    shape = {k: getattr(settings, k) for k in ("self_distill", "response_tokens", "distill_dtype", "features_dtype",
                                                "max_seq_len", "soft_labels", "soft_top")}
    shape["features_format"] = FEATURES_FORMAT
    feat_dir = Path(home) / "work" / f"features-{run_key(target_hash, data_fingerprint(data), shape)}"
    work = Path(home) / "work" / f"heads-{run_key(feat_dir.name, asdict(settings))}"
    feat_path = feat_dir / "features.safetensors"
    timings = {}
    if _rank() == 0 and not feat_path.exists():
        feat_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        sequences = build_sequences(records, codec, settings,
                                    lambda: Decoder.from_folder(target_folder, DTYPES[settings.distill_dtype], blocked=True))
        timings["data_s"] = round(time.perf_counter() - t0, 1)
        t0 = time.perf_counter()
        todo = [s for s in sequences if s.hidden is None]
        kept = len(sequences) - len(todo)
        why = "" if kept or not settings.self_distill else \
            f" (self-distilled in {settings.distill_dtype}; features are taken in {settings.features_dtype})"
        log(f"features: hidden states of {kept} sequences kept from self-distillation, one teacher-forced target "
            f"pass over {len(todo)}{why} ({sum(len(s.ids) for s in todo)} tokens, {settings.features_dtype}); "
            f"cached in {feat_dir}")
        features_model = None if not todo else target if settings.features_dtype == "float32" else \
            Decoder.from_folder(target_folder, DTYPES[settings.features_dtype], blocked=True)
        compute_features(features_model, sequences, settings).save(feat_path)
        del sequences, features_model  # the kept hidden states (~0.4 GB for the recipe) are on disk now
        timings["features_s"] = round(time.perf_counter() - t0, 1)
    elif _rank() == 0:
        log(f"features: reusing {feat_path}")
    if _world() > 1:
        torch.distributed.barrier()
    feats = Features.load(feat_path)
    work.mkdir(parents=True, exist_ok=True)
    if settings.kind == "eagle":
        from mtpctl.convert.eagle_training import EagleTrainer

        trainer = EagleTrainer(target, feats, settings, work)
    else:
        trainer = Trainer(target, feats, settings, work)
    what = (f"an eagle head ({settings.num_heads} draft steps)" if settings.kind == "eagle"
            else f"{settings.num_heads} {settings.kind} heads")
    log(f"training {what} on {len(trainer.train_pos)} positions "
        f"({len(trainer.eval_pos)} held out), {trainer.total_steps} optimizer step{'s' if trainer.total_steps != 1 else ''}")
    t0 = time.perf_counter()
    progress = trainer.train(resume)
    timings["train_s"] = round(time.perf_counter() - t0, 1)
    acc = trainer.evaluate()
    tree = tree_from_accuracy(acc, settings.tree_nodes)
    summary = {"settings": asdict(settings), "positions": len(trainer.train_pos), "held_out": len(trainer.eval_pos),
               "history": progress.history, "held_out_top1": [round(a[0], 4) for a in acc],
               "expected_tau": round(1 + expected_accepted(acc, tree), 3), "timings_s": timings}
    if _rank() == 0:
        trainer.hcfg.target, trainer.hcfg.target_hash = target_name, target_hash
        trainer.hcfg.tree = [list(p) for p in tree.paths]
        trainer.hcfg.topk_accuracy = [[round(x, 5) for x in row] for row in acc]
        trainer.hcfg.mtpctl_version = __version__
        summary["timings_s"]["total_s"] = round(time.perf_counter() - started, 1)
        trainer.hcfg.training = summary
        extra = {DATASTORE_FILE: write_datastore(feats, work / DATASTORE_FILE, target.cfg.vocab_size)}
        summary["datastore_tokens"] = int(len(feats.ids))
        if bundle:
            extra.update({p.name: p for p in sorted(Path(target_folder).iterdir())
                          if p.is_file() and not p.name.startswith(".")})
        write_output(out, trainer.heads, overwrite, extra)
    if _world() > 1:
        torch.distributed.barrier()
    return summary


def expected_accepted(acc: Sequence[Sequence[float]], tree: StaticTree) -> float:
    """Expected accepted draft tokens per step of ``tree`` under independent per-head accuracies."""
    total = 0.0
    for path in tree.paths:
        prob = 1.0
        for depth, rank in enumerate(path):
            prob *= acc[depth][rank]
        total += prob
    return total


DISTRIBUTED_TIMEOUT = datetime.timedelta(hours=6)


def init_distributed() -> bool:
    """Join the process group when launched by ``torchrun`` (gloo on CPU); True when distributed."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or torch.distributed.is_initialized():
        return torch.distributed.is_initialized()
    try:
        # the other ranks wait at a barrier while rank 0 self-distills (minutes to hours)
        torch.distributed.init_process_group("gloo", timeout=DISTRIBUTED_TIMEOUT)
    except (RuntimeError, ValueError) as err:
        raise MtpctlError(f"cannot join the torchrun process group: {err}") from err
    return True
