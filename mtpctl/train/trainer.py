"""Training Medusa and Hydra heads over cached features (Cai et al. 2024, "Medusa", Medusa-1: the
base model stays frozen).

Head k (1-based) at position t learns the target's prediction for token t+1+k, i.e. ``pred[t + k]``,
where the tokens between follow the target's own path (:func:`mtpctl.train.features.head_labels`);
loss = sum_k decay^(k-1) * CE (or KL to the target's distribution with ``soft_labels``); AdamW,
linear warm-up then cosine decay, gradient accumulation; positions are independent examples (the
heads see one hidden state). Per-head top-k accuracy on held-out
sequences gives the default draft tree (:func:`mtpctl.drafters.heads.tree.tree_from_accuracy`).

Positions stream from the feature shards (:mod:`mtpctl.train.shards`): shards in a seeded order,
positions in a seeded order within each. Heads keep float32 weights and train under bfloat16
autocast where the target is bfloat16. Under ``torchrun --nproc-per-node N`` (DDP: NCCL on CUDA,
gloo on the CPU) every rank trains on its share of each batch, gradients are averaged, and rank 0
checkpoints (heads + AdamW state, for ``--resume``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, List, Optional

import torch
import torch.nn.functional as F

from mtpctl.drafters.heads.config import HeadsConfig
from mtpctl.drafters.heads.eagle import layer_config_for
from mtpctl.drafters.heads.eagle3 import eagle3_layer_config
from mtpctl.drafters.heads.medusa import MedusaHeads
from mtpctl.errors import BadInput
from mtpctl.train import distributed
from mtpctl.train.features import head_labels, pending_tokens
from mtpctl.train.settings import TrainSettings
from mtpctl.train.shards import as_store

EVAL_RANKS = 10  # top-k accuracy measured per head (the deepest rank a grown tree can use)


@dataclass
class Progress:
    """Where training stands (saved with each checkpoint)."""

    step: int = 0  # optimizer steps done
    history: List[dict] = field(default_factory=list)  # per evaluation: step, loss, per-head top-1


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


def topk_hits(logits: torch.Tensor, labels: torch.Tensor, token_map: Optional[torch.Tensor],
              ranks: int) -> tuple:
    """(hits ``[K, ranks]``, labelled positions ``[K]``) of draft logits ``[B, K, V_d]`` against target
    ids ``[B, K]`` (-100 ignored): hits[k][r] counts positions where head k+1's rank-r candidate is the
    label (labels outside a draft vocabulary count as misses)."""
    top = logits.topk(ranks, dim=-1).indices  # [B, K, ranks] in draft-vocab indices
    if token_map is not None:
        top = token_map[top]
    valid = labels >= 0
    hits = ((top == labels[..., None]) & valid[..., None]).sum(0).float()
    return hits.cpu(), valid.sum(0).float().cpu()


@dataclass
class Positions:
    """Training positions: ``local[i]`` inside shard ``shards[i]`` of a feature store."""

    shards: torch.Tensor
    local: torch.Tensor

    def __len__(self) -> int:
        return len(self.local)

    def __getitem__(self, index) -> "Positions":
        return Positions(self.shards[index], self.local[index])

    @classmethod
    def cat(cls, parts: List["Positions"]) -> "Positions":
        if not parts:
            return cls(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
        return cls(torch.cat([p.shards for p in parts]), torch.cat([p.local for p in parts]))

    def by_shard(self):
        """(shard, indices of the positions in it) for each shard they touch."""
        for shard in torch.unique(self.shards).tolist():
            yield shard, (self.shards == shard).nonzero().squeeze(1)


class Cursor:
    """Takes positions off a stream of ``(shard, local positions)`` segments, ``n`` at a time."""

    def __init__(self, segments: Iterator):
        self.segments, self.buffer = segments, []

    def take(self, n: int) -> Positions:
        """The next ``n`` positions (fewer where the stream ends)."""
        parts, have = [], 0
        while have < n:
            if not self.buffer:
                shard, local = next(self.segments, (None, None))
                if shard is None:
                    break
                self.buffer = [Positions(torch.full_like(local, shard), local)]
            head = self.buffer.pop()
            parts.append(head[:n - have])
            if len(head) > n - have:
                self.buffer = [head[n - have:]]
            have += len(parts[-1])
        return Positions.cat(parts)


def lr_at(step: int, total: int, settings: TrainSettings) -> float:
    """Linear warm-up over ``warmup * total`` steps, then cosine decay to 0 (multiplier of lr)."""
    warm = int(settings.warmup * total)
    if step < warm:
        return (step + 1) / warm
    progress = (step - warm) / max(total - warm, 1)
    return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


class Trainer:
    """One add-heads run over the target's features (see the module docstring).

    Training positions stream shard by shard: each epoch takes the shards in a seeded random order
    and each shard's positions in a seeded random order, so a step reads the rows of at most a couple
    of shards whatever their number; every rank reads only its own slice of each micro-batch.

    Args:
        target: the frozen target's embedding and lm_head (a :class:`~mtpctl.train.target.TargetHead`,
            or a :class:`~mtpctl.model.decoder.Decoder`); heads train under bfloat16 autocast when
            they are bfloat16, in float32 otherwise (their weights are float32 either way).
        feats: the features (a :class:`~mtpctl.train.shards.FeatureStore`, or a :class:`Features` in memory).
        settings: the run's settings.
        work: folder for checkpoints (``--resume`` continues from ``work/checkpoint.*``).
        device: where the heads train (default: the target's device).
    """

    #: what one accuracy figure is about, in progress lines
    unit = "head"

    def __init__(self, target, feats, settings: TrainSettings, work: Path, device=None):
        self.target, self.feats, self.s, self.work = target, feats, settings, work
        self.device = torch.device(device) if device is not None else target.embed.device
        self.bf16 = target.embed.dtype == torch.bfloat16
        cfg = target.cfg
        torch.manual_seed(settings.seed)
        token_map = self._draft_vocab() if settings.draft_vocab else None
        self.vocab_index = None
        if token_map is not None:
            self.vocab_index = torch.full((cfg.vocab_size,), -100, dtype=torch.long)
            self.vocab_index[token_map] = torch.arange(len(token_map))
        self.hcfg = self._heads_config(token_map)
        self.heads = self._new_heads(token_map).to(self.device)
        n_seqs = self.store.num_sequences
        split = torch.randperm(n_seqs, generator=torch.Generator().manual_seed(settings.seed)).tolist()
        n_eval = max(1, int(round(settings.holdout * len(split)))) if len(split) > 1 else 0
        self.eval_seqs, self.train_seqs = sorted(split[:n_eval]), sorted(split[n_eval:] or split)
        self.train_mask, self.eval_mask = self._mask(self.train_seqs), self._mask(self.eval_seqs)
        self.train_count, self.eval_count = self._count(self.train_mask), self._count(self.eval_mask)
        if self.train_count == 0:
            raise BadInput("the training data leaves no position to train on (sequences too short)")
        self.model = self.heads
        if distributed.world_size() > 1:
            ids = [self.device.index or 0] if self.device.type == "cuda" else None
            self.model = torch.nn.parallel.DistributedDataParallel(self.heads, device_ids=ids)
        self.params = [p for p in self.heads.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=settings.lr, weight_decay=settings.weight_decay)
        self.epoch_steps = self._epoch_steps()
        self.total_steps = settings.steps or max(1, int(round(self.epoch_steps * settings.epochs)))
        self.progress = Progress()

    @property
    def feats(self):
        """The features as given (see :attr:`store` for what training reads)."""
        return self._feats

    @feats.setter
    def feats(self, value) -> None:
        self._feats, self.store = value, as_store(value)

    def _mask(self, seqs: List[int]) -> torch.Tensor:
        mask = torch.zeros(self.store.num_sequences, dtype=torch.bool)
        mask[torch.tensor(seqs, dtype=torch.long)] = True
        return mask

    def _examples_per_sequence(self) -> torch.Tensor:
        """``[S]`` training positions of each sequence: from ``loss_from - 1`` to its last but one."""
        return (self.store.lengths - 1 - (self.store.loss_from - 1).clamp(min=0)).clamp(min=0)

    def _count(self, mask: torch.Tensor) -> int:
        """Training positions of the sequences in ``mask`` (Medusa and Hydra: one example each)."""
        return int(self._examples_per_sequence()[mask].sum())

    def _shard_positions(self, shard: int, mask: torch.Tensor) -> torch.Tensor:
        """Local positions, in order, that train (see :func:`~mtpctl.train.features.example_positions`)
        of shard ``shard``'s sequences in ``mask``."""
        store = self.store
        a, b = int(store.firsts[shard]), int(store.firsts[shard + 1])
        out = [torch.arange(int(store.starts[s]) + max(int(store.loss_from[s]) - 1, 0),
                            int(store.starts[s]) + int(store.lengths[s]) - 1)
               for s in range(a, b) if mask[s]]
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)

    def _heads_config(self, token_map: Optional[torch.Tensor]) -> Optional[HeadsConfig]:
        """The config of the heads this run trains (what their folder records)."""
        s, cfg = self.s, self.target.cfg
        eagle = s.kind in ("eagle", "eagle3")  # one layer that always reads the next token: no blocks per head
        layer = eagle3_layer_config(cfg, s.aux_layers) if s.kind == "eagle3" else \
            layer_config_for(cfg) if eagle else None
        return HeadsConfig(s.kind, s.num_heads, 0 if eagle else s.head_layers, s.own_lm_head or s.kind == "eagle3",
                           cfg.hidden_size, cfg.vocab_size, len(token_map) if token_map is not None else 0,
                           token_conditioned=(s.condition_on_token or s.kind == "hydra") and not eagle, layer=layer)

    def _new_heads(self, token_map: Optional[torch.Tensor]) -> torch.nn.Module:
        return MedusaHeads(self.hcfg, torch.float32, self.target.dense_lm_head(), token_map)

    def _epoch_steps(self) -> int:
        """Optimizer steps per epoch."""
        return math.ceil(self.train_count / (self.s.batch_tokens * self.s.grad_accum))

    def _draft_vocab(self) -> torch.Tensor:
        """The ``draft_vocab`` most frequent target predictions in the data (ids ascending)."""
        counts = torch.zeros(self.target.cfg.vocab_size, dtype=torch.long)
        for shard in range(self.store.num_shards):
            counts += torch.bincount(self.store.index(shard).pred, minlength=self.target.cfg.vocab_size)
        n = min(self.s.draft_vocab, self.target.cfg.vocab_size)
        return counts.topk(n).indices.sort().values

    @property
    def lm_head(self):
        return self.target.logits

    def autocast(self) -> contextlib.ExitStack:
        """Where the heads compute: bfloat16 autocast on the training device where the target is bfloat16
        (off otherwise), and off the CPU the device as the default of tensors made inside (the heads'
        positions and masks)."""
        stack = contextlib.ExitStack()
        if self.device.type != "cpu":
            stack.enter_context(self.device)
        stack.enter_context(torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16))
        return stack

    def _seed(self, epoch: int, shard: Optional[int] = None) -> int:
        """The seed of an epoch's shard order, or of one shard's order in it."""
        base = self.s.seed * 1000 + epoch + 1
        return base if shard is None else base * 1_000_003 + shard + 1

    def _epoch_stream(self, epoch: int) -> Iterator:
        """``(shard, local positions)`` of one epoch: the shards in a seeded order, each one's training
        positions in a seeded order."""
        order = torch.randperm(self.store.num_shards, generator=torch.Generator().manual_seed(self._seed(epoch)))
        for shard in order.tolist():
            local = self._shard_positions(shard, self.train_mask)
            if len(local):
                g = torch.Generator().manual_seed(self._seed(epoch, shard))
                yield shard, local[torch.randperm(len(local), generator=g)]

    def _batches(self):
        """Micro-batches of positions for each optimizer step from ``progress.step`` on; every rank
        takes its slice of each micro-batch (empty where the micro-batch has fewer positions than there
        are ranks: :meth:`_no_inputs`)."""
        s = self.s
        per_step = s.batch_tokens * s.grad_accum
        step = self.progress.step
        while step < self.total_steps:
            epoch, offset = divmod(step, self.epoch_steps)
            cursor = Cursor(self._epoch_stream(epoch))
            cursor.take(offset * per_step)  # a resumed run: the steps of this epoch already done
            end = min((epoch + 1) * self.epoch_steps, self.total_steps)
            while step < end:
                chunk = cursor.take(per_step)
                micro = [chunk[i:i + s.batch_tokens] for i in range(0, len(chunk), s.batch_tokens)]
                yield step, [(m[distributed.rank()::distributed.world_size()], self._label_counts(m)) for m in micro]
                step += 1

    def _labels(self, pos: Positions, vocab_index: Optional[torch.Tensor]) -> torch.Tensor:
        """Labels ``[B, K]`` of positions (:func:`~mtpctl.train.features.head_labels`)."""
        out = torch.full((len(pos), self.s.num_heads), -100, dtype=torch.long)
        for shard, idx in pos.by_shard():
            out[idx] = head_labels(self.store.index(shard), pos.local[idx], self.s.num_heads, vocab_index,
                                   self.hcfg.token_conditioned)
        return out

    def _label_counts(self, pos: Positions) -> torch.Tensor:
        """Labelled positions per head ``[K]`` in a whole micro-batch (all ranks together)."""
        return (self._labels(pos, self.vocab_index) >= 0).sum(0).float()

    def _inputs(self, pos: Positions) -> tuple:
        """(hidden states ``[B, H]``, pending-token embeddings or None, soft labels or None) of positions,
        on the training device; the rows read from each shard they touch (see :meth:`_no_inputs` for
        no position)."""
        if len(pos) == 0:
            return self._no_inputs()
        hidden, tokens, soft_ids, soft_probs = [], [], [], []
        k, order = self.s.num_heads, []
        for shard, idx in pos.by_shard():
            local, index = pos.local[idx], self.store.index(shard)
            order.append(idx)
            hidden.append(self.store.rows(shard, "hidden", local))
            tokens.append(pending_tokens(self.heads, index, local))
            if self.s.soft_labels:
                target = (local[:, None] + torch.arange(1, k + 1)[None]).clamp(max=len(index.pred) - 1).flatten()
                soft_ids.append(self.store.rows(shard, "soft_ids", target).view(len(local), k, -1).long())
                soft_probs.append(self.store.rows(shard, "soft_probs", target).view(len(local), k, -1))
        where = torch.argsort(torch.cat(order))  # back to the positions' order
        embeds = None
        if tokens[0] is not None:
            embeds = self.target.embed[torch.cat(tokens)[where].to(self.target.embed.device)].to(self.device).float()
        soft = None
        if soft_ids:
            ids = torch.cat(soft_ids)[where]
            if self.vocab_index is not None:
                ids = self.vocab_index[ids]
            soft = (ids.to(self.device), torch.cat(soft_probs)[where].to(self.device))
        return torch.cat(hidden)[where].to(self.device).float(), embeds, soft

    def _no_inputs(self) -> tuple:
        """The inputs of no position: hidden states ``[0, H]``, pending-token embeddings of the shape the
        heads read (``[0, H]``, Hydra ``[0, K, H]``) or None, no soft labels. A rank whose slice of a
        micro-batch is empty (fewer positions than ranks) runs the heads on these: its loss is a zero
        whose backward still gives every parameter a gradient, so it joins each of DDP's all-reduces
        as the other ranks do instead of leaving them waiting."""
        hidden = torch.zeros(0, self.target.cfg.hidden_size, device=self.device)
        tokens = pending_tokens(self.heads, self.store.index(0), torch.zeros(0, dtype=torch.long))
        if tokens is None:
            return hidden, None, None
        return hidden, self.target.embed[tokens.to(self.target.embed.device)].to(self.device).float(), None

    def _loss(self, pos: Positions, counts: torch.Tensor) -> tuple:
        """(weighted loss, per-head losses ``[K]``) of this rank's positions ``pos``; each head's loss
        is its sum over ``pos`` divided by ``counts`` (the whole micro-batch's labelled positions) times
        the world size, so DDP's gradient average equals one process on the whole micro-batch."""
        s = self.s
        labels = self._labels(pos, self.vocab_index).to(self.device)
        hidden, embeds, soft = self._inputs(pos)
        with self.autocast():
            logits = self.model(hidden, self.lm_head, full_vocab=False, token_embeds=embeds)
            sums, _ = head_loss_sums(logits, labels, soft)
        per_head = sums.float() / counts.to(self.device).clamp(min=1) * distributed.world_size()
        weights = s.head_decay ** torch.arange(s.num_heads, dtype=torch.float32, device=self.device)
        return (per_head * weights).sum(), per_head.detach()

    def train(self, resume: bool, on_eval: Optional[Callable[[dict], None]] = None) -> Progress:
        """Run (or continue) training; checkpoint every epoch and at the end. Returns the progress."""
        if resume:
            self._load_checkpoint()
        meter = distributed.Meter("train", self.total_steps, "steps", done=self.progress.step)
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
            meter.note(loss=f"{running:.3f}")
            meter.update(1, positions=self._step_positions(micro))
            if self.progress.step % self.epoch_steps == 0 or self.progress.step == self.total_steps:
                self._end_of_epoch(running, meter, on_eval)
        meter.close()
        return self.progress

    def _step_positions(self, micro) -> int:
        """Positions a step trained on, all ranks together (about: this rank's times their number)."""
        return sum(len(m) for m, _ in micro) * distributed.world_size()

    def _end_of_epoch(self, running: float, meter, on_eval) -> None:
        """Held-out top-1, a progress line, the checkpoint."""
        acc = self.evaluate(ranks=1)
        entry = {"step": self.progress.step, "loss": round(running, 4), "top1": [round(a[0], 4) for a in acc]}
        self.progress.history.append(entry)
        meter.write(f"step {entry['step']}/{self.total_steps} loss {entry['loss']} held-out top-1 per {self.unit} "
                    f"{entry['top1']}")
        if on_eval:
            on_eval(entry)
        self._save_checkpoint()

    @torch.no_grad()
    def evaluate(self, ranks: int = EVAL_RANKS, batch: int = 512) -> List[List[float]]:
        """``acc[k][r]``: the share of held-out positions where head k+1's rank-r candidate is the
        target's token (labels outside a draft vocabulary count as misses)."""
        k = self.hcfg.num_heads
        hits, counts = torch.zeros(k, ranks), torch.zeros(k)
        for shard in range(self.store.num_shards):
            local = self._shard_positions(shard, self.eval_mask)
            for a in range(0, len(local), batch):
                pos = Positions(torch.full((len(local[a:a + batch]),), shard), local[a:a + batch])
                labels = self._labels(pos, None).to(self.device)
                hidden, embeds, _ = self._inputs(pos)
                with self.autocast():
                    logits = self.heads.draft_vocab_logits(hidden, self.lm_head, embeds)
                h, c = topk_hits(logits.float(), labels, self.heads.token_map, ranks)
                hits, counts = hits + h, counts + c
        return (hits / counts.clamp(min=1)[:, None]).tolist()

    def _save_checkpoint(self) -> None:
        if distributed.rank() != 0:
            return
        from safetensors.torch import save_file

        tensors = {f"model.{k}": v.detach().cpu().contiguous() for k, v in self.heads.state_dict().items()}
        for i, p in enumerate(self.params):
            for name, value in self.opt.state.get(p, {}).items():
                value = value.detach().cpu()
                tensors[f"optim.{i}.{name}"] = (value.reshape(-1) if value.dim() == 0 else value).contiguous()
        save_file(tensors, str(self.work / "checkpoint.tmp"))
        (self.work / "checkpoint.json.tmp").write_text(json.dumps(asdict(self.progress)), encoding="utf-8")
        os.replace(self.work / "checkpoint.tmp", self.work / "checkpoint.safetensors")
        os.replace(self.work / "checkpoint.json.tmp", self.work / "checkpoint.json")

    def _load_checkpoint(self) -> None:
        from safetensors.torch import load_file

        path = self.work / "checkpoint.safetensors"
        if not path.exists():
            distributed.log("--resume: no checkpoint of this run yet; starting from the beginning")
            return
        tensors = load_file(str(path))
        saved = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
        expected = self.heads.state_dict()
        if set(saved) != set(expected) or any(tuple(v.shape) != tuple(expected[k].shape) for k, v in saved.items()):
            raise BadInput(f"{path} holds another set of trained tensors than this run trains (written by an "
                           f"earlier mtpctl?): start afresh without resuming, or delete {self.work}", option="resume")
        self.heads.load_state_dict(saved)
        for i, p in enumerate(self.params):
            state = {name.split(".", 2)[2]: v for name, v in tensors.items() if name.startswith(f"optim.{i}.")}
            if state:
                state = {name: v if name == "step" else v.to(p.device) for name, v in state.items()}
                state["step"] = state["step"].reshape(())
                self.opt.state[p] = state
        self.progress = Progress(**json.loads((self.work / "checkpoint.json").read_text(encoding="utf-8")))
        distributed.log(f"--resume: continuing at step {self.progress.step} of {self.total_steps}")
