"""Training Medusa and Hydra heads over cached features (Cai et al. 2024, "Medusa", Medusa-1: the
base model stays frozen).

Head k (1-based) at position t learns the target's prediction for token t+1+k, i.e. ``pred[t + k]``,
where the tokens between follow the target's own path (:func:`mtpctl.train.features.head_labels`);
loss = sum_k decay^(k-1) * CE (or KL to the target's distribution with ``soft_labels``); AdamW,
linear warm-up then cosine decay, gradient accumulation; positions are independent examples (the
heads see one hidden state), shuffled with a seeded generator. Per-head top-k accuracy on held-out
sequences gives the default draft tree (:func:`mtpctl.drafters.heads.tree.tree_from_accuracy`).

Under ``torchrun --nproc-per-node N`` (DDP, gloo on CPU) every rank trains on its share of each
batch, gradients are averaged, and rank 0 checkpoints (heads + AdamW state, for ``--resume``).
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, List, Optional

import torch
import torch.nn.functional as F

from mtpctl.drafters.heads.config import HeadsConfig
from mtpctl.drafters.heads.eagle import layer_config_for
from mtpctl.drafters.heads.eagle3 import eagle3_layer_config
from mtpctl.drafters.heads.medusa import MedusaHeads
from mtpctl.errors import BadInput
from mtpctl.model.decoder import Decoder
from mtpctl.train import distributed
from mtpctl.train.features import Features, example_positions, head_labels, pending_embeds
from mtpctl.train.settings import TrainSettings

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
        eagle = settings.kind in ("eagle", "eagle3")  # one layer that always reads the next token: no blocks per head
        layer = eagle3_layer_config(cfg, settings.aux_layers) if settings.kind == "eagle3" else \
            layer_config_for(cfg) if eagle else None
        self.hcfg = HeadsConfig(settings.kind, settings.num_heads, 0 if eagle else settings.head_layers,
                                settings.own_lm_head or settings.kind == "eagle3", cfg.hidden_size, cfg.vocab_size,
                                len(token_map) if token_map is not None else 0,
                                token_conditioned=(settings.condition_on_token or settings.kind == "hydra") and not eagle,
                                layer=layer)
        self.heads = self._new_heads(token_map)
        split = torch.randperm(len(feats.loss_from), generator=torch.Generator().manual_seed(settings.seed)).tolist()
        n_eval = max(1, int(round(settings.holdout * len(split)))) if len(split) > 1 else 0
        self.eval_seqs, self.train_seqs = sorted(split[:n_eval]), sorted(split[n_eval:] or split)
        self.eval_pos = example_positions(feats, self.eval_seqs)
        self.train_pos = example_positions(feats, self.train_seqs)
        if len(self.train_pos) == 0:
            raise BadInput("the training data leaves no position to train on (sequences too short)")
        self.model = self.heads
        if distributed.world_size() > 1:
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
            yield step, [(m[distributed.rank()::distributed.world_size()], self._label_counts(m)) for m in micro]
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
        per_head = sums / counts.clamp(min=1) * distributed.world_size()
        weights = s.head_decay ** torch.arange(s.num_heads, dtype=torch.float32)
        return (per_head * weights).sum(), per_head.detach()

    def train(self, resume: bool, on_eval: Optional[Callable[[dict], None]] = None) -> Progress:
        """Run (or continue) training; checkpoint every epoch and at the end. Returns the progress."""
        if resume:
            self._load_checkpoint()
        epoch_steps = self.epoch_steps
        bar = distributed.progress_bar(self.total_steps, "train")
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
        if distributed.rank() != 0:
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
            distributed.log("--resume: no checkpoint of this run yet; starting from the beginning")
            return
        tensors = load_file(str(path))
        self.heads.load_state_dict({k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")})
        for i, p in enumerate(self.params):
            state = {name.split(".", 2)[2]: v for name, v in tensors.items() if name.startswith(f"optim.{i}.")}
            if state:
                state["step"] = state["step"].reshape(())
                self.opt.state[p] = state
        self.progress = Progress(**json.loads((self.work / "checkpoint.json").read_text(encoding="utf-8")))
        distributed.log(f"--resume: continuing at step {self.progress.step} of {self.total_steps}")
