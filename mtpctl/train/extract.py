"""Feature extraction, shard by shard, shared by the ranks: the training sequences to come
(:class:`~mtpctl.train.features.Item`) are cut into shards of at most ``shard_positions`` positions
(their longest possible length counted), rank r extracts shards r, r + N, ... (self-distillation in
batches, then teacher-forced passes in batches where needed) and writes each one as it is done
(:func:`~mtpctl.train.shards.write_shard`). A shard file under its final name is complete: a resumed
run keeps those and redoes the rest. Rank 0 writes the manifest once every rank is done.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

import torch

from mtpctl.errors import MtpctlError
from mtpctl.model.decoder import Decoder
from mtpctl.train import distributed
from mtpctl.train.features import Item, aux_layers_of, answer, compute_features, keeps_features
from mtpctl.train.settings import DTYPES, TrainSettings
from mtpctl.train.shards import Manifest, ShardEntry, read_entry, shard_name, write_shard


@dataclass
class ShardPlan:
    """Shard ``index``: items ``[first, first + count)``, ``bound`` positions at most."""

    index: int
    first: int
    count: int
    bound: int

    @property
    def file(self) -> str:
        return shard_name(self.index)


def plan_shards(items: Sequence[Item], settings: TrainSettings) -> List[ShardPlan]:
    """Consecutive items in shards of at most ``shard_positions`` positions (an item longer than that
    alone), counting each item's longest possible sequence (:meth:`Item.bound`)."""
    plans: List[ShardPlan] = []
    for i, item in enumerate(items):
        n = item.bound(settings)
        last = plans[-1] if plans else None
        if last is not None and last.bound + n <= settings.shard_positions:
            last.count, last.bound = last.count + 1, last.bound + n
        else:
            plans.append(ShardPlan(len(plans), i, 1, n))
    return plans


class TargetModels:
    """The target as self-distillation and the teacher-forced passes need it, loaded on first use on
    ``device`` (the native CPU kernels' layouts on the CPU, torch's ops elsewhere); one model serves both
    where their dtypes agree."""

    def __init__(self, folder: Path, settings: TrainSettings, device: torch.device):
        self.folder, self.settings, self.device = Path(folder), settings, device
        self._models = {}

    def get(self, dtype: str) -> Decoder:
        if dtype not in self._models:
            self._models[dtype] = Decoder.from_folder(self.folder, DTYPES[dtype], blocked=self.device.type == "cpu",
                                                      device=self.device)
        return self._models[dtype]

    def distill(self) -> Decoder:
        return self.get(self.settings.distill_dtype)

    def features(self) -> Decoder:
        return self.get(self.settings.features_dtype)

    def release(self) -> None:
        """Drop the models (their memory goes back before training)."""
        self._models.clear()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


@dataclass
class Meters:
    """Progress of a rank's extraction: prompts self-distilled, sequences through teacher-forced passes."""

    distill: distributed.Meter
    forced: distributed.Meter

    @classmethod
    def of(cls, todo: Sequence[ShardPlan], items: Sequence[Item], settings: TrainSettings) -> "Meters":
        mine = [items[i] for p in todo for i in range(p.first, p.first + p.count)]
        prompts = sum(item.prompt for item in mine)
        forced = len(mine) - (prompts if keeps_features(settings) else 0)
        return cls(distributed.Meter("self-distillation", prompts, "prompts"),
                   distributed.Meter("features", forced, "sequences"))

    def close(self) -> None:
        self.distill.close()
        self.forced.close()


def extract_shard(plan: ShardPlan, items: Sequence[Item], models: TargetModels, settings: TrainSettings,
                  eos_ids, meters: Optional[Meters] = None):
    """The :class:`~mtpctl.train.features.Features` of one shard's items and its entry."""
    mine = items[plan.first:plan.first + plan.count]
    sequences = answer(mine, settings, eos_ids, models.distill, meters.distill.update if meters else None)
    needed = any(s.hidden is None for s in sequences)
    feats = compute_features(models.features() if needed else None, sequences, settings,
                             progress=meters.forced.update if meters else None)
    lengths = (feats.offsets[1:] - feats.offsets[:-1]).tolist()
    return feats, ShardEntry(plan.index, plan.file, plan.first, lengths, feats.loss_from.tolist(), distributed.rank())


def complete_shards(folder: Path, plans: Sequence[ShardPlan]) -> dict:
    """Index -> entry of the planned shards whose files are complete and match the plan."""
    found = {}
    for plan in plans:
        entry = read_entry(Path(folder) / plan.file)
        if entry is not None and entry.first == plan.first and len(entry.lengths) == plan.count:
            found[plan.index] = entry
    return found


def clear_shards(folder: Path, plans: Sequence[ShardPlan]) -> None:
    """Remove the files (complete or not) of ``plans``."""
    for plan in plans:
        for path in (Path(folder) / plan.file, Path(folder) / (plan.file + ".tmp")):
            path.unlink(missing_ok=True)


def extract(folder: Path, items: Sequence[Item], settings: TrainSettings, models: TargetModels, eos_ids,
            resume: bool, hidden_size: int) -> Manifest:
    """Extract this rank's shards of ``items`` into ``folder`` (every rank calls it; see the module
    docstring), wait for the others, and return the manifest (written by rank 0).

    Args:
        resume: keep this rank's complete shards from an interrupted run (otherwise they are redone).
        hidden_size: the target's hidden size (the manifest's widths).
    """
    folder.mkdir(parents=True, exist_ok=True)
    plans = plan_shards(items, settings)
    mine = plans[distributed.rank()::distributed.world_size()]
    done = complete_shards(folder, mine) if resume else {}
    if not resume:
        clear_shards(folder, mine)
    todo = [p for p in mine if p.index not in done]
    _announce(plans, items, todo, done, settings, folder)
    meters = Meters.of(todo, items, settings)
    for plan in todo:
        feats, entry = extract_shard(plan, items, models, settings, eos_ids, meters)
        write_shard(feats, folder, entry)
        del feats
    meters.close()
    models.release()
    distributed.barrier(models.device)
    if distributed.rank() == 0:
        write_manifest(folder, plans, settings, hidden_size)
    distributed.barrier(models.device)
    return Manifest.load(folder)


def write_manifest(folder: Path, plans: Sequence[ShardPlan], settings: TrainSettings, hidden_size: int) -> None:
    """``folder/manifest.json`` listing every planned shard's entry.

    Raises:
        MtpctlError: a planned shard is not complete.
    """
    found = complete_shards(folder, plans)
    missing = [p.file for p in plans if p.index not in found]
    if missing:
        raise MtpctlError(f"feature shards missing in {folder} after every rank finished: "
                          f"{', '.join(missing[:3])}; run again, resuming, to extract them", option="resume")
    Manifest(hidden_size, len(aux_layers_of(settings)) * hidden_size, settings.soft_top if settings.soft_labels else 0,
             settings.shard_positions, [found[p.index] for p in plans]).save(folder)


def _announce(plans, items, todo, done, settings: TrainSettings, folder: Path) -> None:
    """One line on what this run extracts (rank 0's share, and the whole)."""
    prompts = sum(item.prompt for item in items)
    how = (f"self-distillation of {prompts} prompts ({settings.distill_batch} at a time, {settings.distill_dtype}"
           + (", its hidden states kept)" if keeps_features(settings) else ")")) if prompts else "no prompts"
    share = f"; this rank: {len(todo)} shards to do" + (f", {len(done)} kept from an interrupted run" if done else "")
    distributed.log(f"features: {len(items)} sequences in {len(plans)} shards of <= {settings.shard_positions} "
                    f"positions over {distributed.world_size()} rank(s), {how}, teacher-forced passes in "
                    f"{settings.features_dtype} where needed{share}; in {folder}")
