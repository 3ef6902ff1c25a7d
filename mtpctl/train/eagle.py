"""``add-heads --kind eagle``: train an EAGLE draft layer by self-distillation over the cached features.

Sequences train whole (the layer attends over earlier rows). Row p reads the target's feature f_p
and the next token x_{p+1}; at each unrolled draft step s = 1..K (training-time test, see
:meth:`mtpctl.drafters.heads.eagle.EagleHead.forward`) it learns the target's prediction for token p + 2,
``pred[p + 1]``: cross-entropy over the draft vocabulary, plus EAGLE's smooth-L1 regression of the
predicted feature to the target's f_{p+1} (Li et al. 2024), step s weighted ``head_decay^(s-1)``.
Step s has rows p >= s - 1 (a draft s tokens after the target's row p - s + 1) whose tokens read at
steps 2..s follow the target's own path (``ids[q + 1] == pred[q]`` for q = p - s + 2 .. p: at decode time
they are the earlier steps' drafts, and the label only counts if those were accepted), as for Medusa
heads (:func:`mtpctl.train.features.head_labels`); always true on self-distilled responses. As
for Medusa heads, self-distilled sequences learn from the row before their response on (``loss_from - 1``).

Per-step top-k accuracy on held-out sequences is conditional on the earlier drafts being right
(teacher forcing), so the product along a tree path is the chance the target accepts it.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F

from mtpctl.drafters.heads.eagle import EagleHead
from mtpctl.drafters.heads.eagle3 import Eagle3Head
from mtpctl.errors import BadInput
from mtpctl.train import distributed
from mtpctl.train.trainer import EVAL_RANKS, Trainer

FEATURE_LOSS_WEIGHT = 1.0  # EAGLE's feature regression, next to each step's cross-entropy


class EagleTrainer(Trainer):
    """:class:`~mtpctl.train.trainer.Trainer` for an EAGLE head: micro-batches are groups of
    whole sequences of at most ``batch_tokens`` tokens (at least one sequence per process), packed
    shard by shard; each epoch takes the shards in a seeded order and each shard's groups in a
    seeded order."""

    unit = "draft step"
    feature_loss_weight = FEATURE_LOSS_WEIGHT
    #: the features the first draft step reads
    feature_name = "hidden"

    def _new_heads(self, token_map: Optional[torch.Tensor]) -> torch.nn.Module:
        return EagleHead(self.hcfg, torch.float32, self.target.dense_lm_head(), token_map)

    def _epoch_steps(self) -> int:
        self.groups = self._group(self.train_seqs)
        return math.ceil(len(self.groups) / self.s.grad_accum)

    def _group(self, seqs: Sequence[int], shared: bool = True) -> List[List[int]]:
        """Sequences sorted by shard, then length, packed into groups of <= ``batch_tokens`` tokens
        (padding counted), a group possibly ending in the next shard; ``shared`` (training) groups hold at
        least one sequence per process."""
        lengths, shard_of = self.store.lengths.tolist(), self.store.shard_of.tolist()
        least = distributed.world_size() if shared else 1
        groups: List[List[int]] = []
        for s in sorted(seqs, key=lambda i: (shard_of[i], lengths[i], i)):
            if groups and (len(groups[-1]) < least or (len(groups[-1]) + 1) * lengths[s] <= self.s.batch_tokens):
                groups[-1].append(s)
            else:
                groups.append([s])
        if len(groups) > 1 and len(groups[-1]) < least:  # a short last group joins the one before
            groups[-2].extend(groups.pop())
        if groups and len(groups[0]) < least:
            raise BadInput(f"{len(seqs)} sequence(s) cannot be shared by {least} processes: use fewer processes or "
                           "more data")
        return groups

    def _epoch_order(self, epoch: int) -> List[int]:
        """Indices of the groups in the order one epoch takes them: shards in a seeded order (a group
        belongs to its first sequence's shard), each shard's groups in a seeded order."""
        home = torch.tensor([int(self.store.shard_of[g[0]]) for g in self.groups])
        order = []
        shards = torch.randperm(self.store.num_shards, generator=torch.Generator().manual_seed(self._seed(epoch)))
        for shard in shards.tolist():
            mine = (home == shard).nonzero().squeeze(1)
            g = torch.Generator().manual_seed(self._seed(epoch, shard))
            order += mine[torch.randperm(len(mine), generator=g)].tolist()
        return order

    def _batches(self):
        ga = self.s.grad_accum
        step, order, epoch_of_order = self.progress.step, None, None
        while step < self.total_steps:
            epoch, offset = divmod(step, self.epoch_steps)
            if epoch != epoch_of_order:
                order, epoch_of_order = self._epoch_order(epoch), epoch
            chosen = [self.groups[i] for i in order[offset * ga:(offset + 1) * ga]]
            yield step, [(g[distributed.rank()::distributed.world_size()], self._label_counts(g)) for g in chosen]
            step += 1

    def _step_positions(self, micro) -> int:
        return sum(int(self.store.lengths[g].sum()) for g, _ in micro) * distributed.world_size()

    def _rows(self, s: int, name: str, a: int, b: int) -> torch.Tensor:
        """Rows ``[a, b)`` of sequence ``s`` of per-row features ``name``."""
        shard, start = int(self.store.shard_of[s]), int(self.store.starts[s])
        return self.store.span(shard, name, start + a, start + b)

    def _batch(self, seqs: Sequence[int], features: bool = True) -> dict:
        """Padded rows of ``seqs`` (on the CPU): features, next-token ids, labels (draft-vocab indices,
        -100 where none), the target's next features (where the loss regresses them), and masks
        ``[B, T]`` (T = longest length - 1); without ``features`` the feature rows stay zeros (nothing
        read but ids and predictions)."""
        store = self.store
        t = max(int(store.lengths[s]) for s in seqs) - 1
        b, h = len(seqs), store.hidden_size
        out = {"feats": torch.zeros(b, t, store.width(self.feature_name)), "next_feats": torch.zeros(b, t, h),
               "tokens": torch.zeros(b, t, dtype=torch.long), "labels": torch.full((b, t), -100),
               "valid": torch.zeros(b, t, dtype=torch.bool), "first": torch.zeros(b, dtype=torch.long),
               "on_path": torch.zeros(b, t, dtype=torch.bool)}
        for i, s in enumerate(seqs):
            shard, start, n = int(store.shard_of[s]), int(store.starts[s]), int(store.lengths[s])
            index = store.index(shard)
            ids, pred = index.ids[start:start + n], index.pred[start:start + n]
            if features:
                out["feats"][i, :n - 1] = self._rows(s, self.feature_name, 0, n - 1).float()
            if features and self.feature_loss_weight:
                out["next_feats"][i, :n - 1] = self._rows(s, "hidden", 1, n).float()
            out["tokens"][i, :n - 1] = ids[1:]
            out["labels"][i, :n - 1] = self.vocab_index[pred[1:]] if self.vocab_index is not None else pred[1:]
            out["valid"][i, :n - 1] = True
            out["on_path"][i, :n - 1] = ids[1:] == pred[:-1]  # row p reads the target's own prediction
            out["first"][i] = max(int(store.loss_from[s]) - 1, 0)
        return out

    def _loss_rows(self, batch: dict, labelled: bool = True) -> torch.Tensor:
        """``[K, B, T]`` rows that carry a loss at each draft step (``labelled``: only rows whose
        label is in the draft vocabulary): step s (0-based) at row p needs rows p - s + 1 .. p on the
        target's path (the tokens they read are drafts of the earlier steps at decode time)."""
        t = batch["labels"].shape[1]
        rows = torch.arange(t)
        steps = torch.arange(self.s.num_heads)[:, None, None]
        ok = batch["labels"] >= 0 if labelled else batch["valid"]
        path = torch.ones(self.s.num_heads, *ok.shape, dtype=torch.bool)
        for s in range(1, self.s.num_heads):
            shifted = torch.zeros_like(batch["on_path"])
            shifted[:, s - 1:] = batch["on_path"][:, :t - s + 1]  # row p: on_path[p - s + 1]
            path[s] = path[s - 1] & shifted
        return (rows[None, None] >= batch["first"][None, :, None]) & (rows[None, None] >= steps) & ok[None] & path

    def _label_counts(self, seqs: Sequence[int]) -> torch.Tensor:
        return self._loss_rows(self._batch(seqs, features=False)).sum((1, 2)).float()

    def _on_device(self, batch: dict) -> dict:
        return {k: v.to(self.device) for k, v in batch.items()}

    def _loss(self, seqs: Sequence[int], counts: torch.Tensor) -> tuple:
        batch = self._batch(seqs)
        rows = self._loss_rows(batch).to(self.device)
        batch = self._on_device(batch)
        sums = []
        with self.autocast():
            outs = self._outputs(self.model, batch)
            for s, g in enumerate(outs):
                keep = rows[s]
                loss = F.cross_entropy(self._logits(s, g[keep]), batch["labels"][keep], reduction="sum")
                if self.feature_loss_weight:
                    reg = F.smooth_l1_loss(g[keep].float(), batch["next_feats"][keep], reduction="none").mean(-1).sum()
                    loss = loss + self.feature_loss_weight * reg
                sums.append(loss.float())
        per_step = torch.stack(sums) / counts.to(self.device).clamp(min=1) * distributed.world_size()
        return (per_step * self._depth_weights()).sum(), per_step.detach()

    def _depth_weights(self) -> torch.Tensor:
        """``[K]`` the loss weight of each draft step: ``head_decay^(s-1)`` for step s."""
        return self.s.head_decay ** torch.arange(self.s.num_heads, dtype=torch.float32, device=self.device)

    def _outputs(self, module: torch.nn.Module, batch: dict) -> List[torch.Tensor]:
        """``module``'s (the head, or its DDP wrapper) outputs ``[g_1, ..., g_K]`` over ``batch`` (on the device)."""
        return module(batch["feats"], self._token_embeds(batch["tokens"]), batch["valid"], self.s.num_heads)

    def _logits(self, step: int, g: torch.Tensor) -> torch.Tensor:
        """Logits of draft step ``step``'s (0-based) outputs ``g``."""
        return self.heads.logits(g, self.lm_head)

    def _token_embeds(self, tokens: torch.Tensor) -> torch.Tensor:
        """The embeddings ``[B, T, H]`` (float32) of the tokens ``[B, T]`` the rows read."""
        return self.target.embed[tokens].float()

    @torch.no_grad()
    def _unrolled(self, seqs: Sequence[int]):
        """For each group of sequences ``seqs`` (evaluated whole on every rank): ``(batch, rows, outs)``,
        the padded batch on the device, its rows with a label at each draft step ``[K, B, T]``
        (labels outside a draft vocabulary count) and the head's outputs ``[g_1, ..., g_K]``
        (computed under :meth:`autocast`)."""
        for group in self._group(seqs, shared=False):
            batch = self._batch(group)
            rows = self._loss_rows(batch, labelled=False).to(self.device)
            batch = self._on_device(batch)
            with self.autocast():
                yield batch, rows, self._outputs(self.heads, batch)

    @torch.no_grad()
    def evaluate(self, ranks: int = EVAL_RANKS) -> List[List[float]]:
        """``acc[s][r]``: on held-out sequences, the share of rows where draft step s+1's rank-r
        candidate is the target's token, the earlier steps' tokens being right (teacher forcing)."""
        k = self.s.num_heads
        hits, counts = torch.zeros(k, ranks), torch.zeros(k)
        for batch, rows, outs in self._unrolled(self.eval_seqs):  # every rank evaluates all, on its own
            with self.autocast():
                for s, g in enumerate(outs):
                    keep = rows[s]
                    top = self._logits(s, g[keep]).topk(ranks, dim=-1).indices
                    labels = batch["labels"][keep][:, None]
                    hits[s] += ((top == labels) & (labels >= 0)).sum(0).float().cpu()
                    counts[s] += keep.sum().cpu()
        return (hits / counts.clamp(min=1)[:, None]).tolist()


class Eagle3Trainer(EagleTrainer):
    """:class:`EagleTrainer` for an EAGLE-3 head (:mod:`mtpctl.drafters.heads.eagle3`): the first
    draft step reads the target's aux layers (the features' ``aux``), the loss is the token
    cross-entropy alone (EAGLE-3 drops the feature regression), and the head's own lm_head trains too.

    Raises:
        BadInput: features without the aux layers' streams.
    """

    feature_loss_weight = 0.0
    feature_name = "aux"

    def _new_heads(self, token_map: Optional[torch.Tensor]) -> torch.nn.Module:
        if not self.store.aux_width:
            raise BadInput("eagle3 heads train on the target's aux layers, and these features lack them")
        return Eagle3Head(self.hcfg, torch.float32, self.target.dense_lm_head(), token_map)
