"""``add-heads --kind mtp``: measure a checkpoint's own MTP layer on the user's data, refresh it by
self-distillation on the current body, and write it back into a new checkpoint folder.

1. features: the body's hidden states and greedy predictions over the data (self-distilled responses
   with ``self_distill``), as for every head kind (:func:`mtpctl.train.add_heads.prepare_features`);
2. measure: per-depth acceptance of the layer as read (:meth:`mtpctl.train.mtp.MtpTrainer.acceptance`),
   on the held-out sequences (all sequences with ``measure_only``);
3. refresh: the layer trains on the other sequences (the body frozen), ``num_heads`` depths deep;
4. measure again on the same held-out sequences;
5. write back (:func:`mtpctl.model.rewrite.rewrite_checkpoint`): a new folder where only the layer's
   tensors hold new values (same names, dtypes, shards), with ``mtp_refresh.json`` (the figures).

With ``graft`` (a checkpoint whose MTP tensors were dropped), the layer measured and trained is a new one
(:func:`mtpctl.train.mtp_graft.fresh_layer`) and the write-back adds its tensors in a new shard, the
config declaring one layer (:func:`mtpctl.model.rewrite.add_tensors`).

Only the first MTP layer is measured and refreshed. On a checkpoint with several, the later layers draft
depths 2.. (:class:`~mtpctl.drafters.mtp.MtpDrafter`), which the recursive depths here would not measure:
the depth is then 1 (``num_heads`` > 1 is refused), and the others are written back unchanged, with a
warning (they read the refreshed first layer's output).
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional, Sequence

import torch

from mtpctl.drafters.mtp import MtpLayers, MtpSettings, check_mtp_layers
from mtpctl.errors import BadInput, CorruptModel, UnsupportedModel
from mtpctl.model.config import DecoderConfig, read_json
from mtpctl.model.rewrite import ADDED_SHARD, add_tensors, rewrite_checkpoint
from mtpctl.train import distributed
from mtpctl.train.add_heads import prepare_features
from mtpctl.train.mtp import MtpTrainer
from mtpctl.train.mtp_graft import count_key, fresh_layer, grafted_config, present_tensors
from mtpctl.train.settings import TrainSettings
from mtpctl.train.target import TargetHead

#: the figures written beside the refreshed checkpoint's files
NOTES_FILE = "mtp_refresh.json"


def refresh_mtp(target_folder: Path, data: Sequence[Path], out: Optional[Path], settings: TrainSettings, home: Path,
                measure_only: bool = False, overwrite: bool = False, resume: bool = False, device: str = "auto",
                mtp: MtpSettings = MtpSettings(), graft: bool = False) -> dict:
    """Measure the MTP layer of the checkpoint in ``target_folder`` on ``data`` and, unless
    ``measure_only``, refresh it and write the checkpoint with the new layer to ``out``.

    Args:
        settings: of kind ``mtp``; ``num_heads`` is the depth measured and trained (depths past the
            first by running the layer recursively), ``head_decay`` the recursive objective's weight.
        mtp: how the layer runs (the drafter's settings; the defaults are ``--speculate mtp``'s).
        graft: the checkpoint's MTP tensors are missing: build a new layer (:mod:`mtpctl.train.mtp_graft`),
            measure it, train it and write the checkpoint with it added to ``out``.
        The others as :func:`mtpctl.train.add_heads.add_heads`'s.

    Returns:
        ``{"target", "depth", "measured_on", "before": acceptance, ...}``, with ``after``, ``positions``,
        ``history``, ``out`` when refreshed (acceptance: :meth:`~mtpctl.train.mtp.MtpTrainer.acceptance`).

    Raises:
        BadInput: bad settings, no ``out``, ``out`` exists without ``overwrite`` or is the target, a
            checkpoint without MTP layers (one that holds them, with ``graft``; ``graft`` with
            ``measure_only``), a depth over 1 on a checkpoint with several, several processes.
        UnsupportedModel: a family whose MTP layers are not read; a refresh of a block-scaled FP8 checkpoint.
        CorruptModel: an MTP layer without the published layout; a declared one whose tensors are all
            missing (without ``graft``).
    """
    settings.check()
    if settings.kind != "mtp":
        raise BadInput(f"refreshing MTP layers takes settings of kind mtp, not {settings.kind}", option="kind")
    target_folder = Path(target_folder)
    cfg = DecoderConfig.from_folder(target_folder)
    _check_graft(cfg, target_folder, graft, measure_only)
    if cfg.mtp_layers > 1 and settings.num_heads > 1 and not graft:
        raise BadInput(f"{target_folder} has {cfg.mtp_layers} MTP layers: its layer k+1 drafts depth k+1, and only "
                       "the first is measured and refreshed here: use depth 1 (--num-heads 1)", option="num_heads")
    if cfg.fp8_block is not None and not measure_only:
        raise UnsupportedModel(f"{target_folder} holds block-scaled FP8 weights: a refreshed MTP layer is not "
                               "written back into them (measure it only)", option="measure_only")
    _check_out(target_folder, out, measure_only, overwrite)
    mtp.check()
    where = distributed.init_distributed(device)
    if distributed.world_size() > 1:
        raise BadInput("refreshing MTP layers runs in one process (not under torchrun)")
    started = time.perf_counter()
    fresh = fresh_layer(target_folder, cfg) if graft else None  # before the features: it may be refused
    run = prepare_features(target_folder, data, settings, home, where, resume)
    target = TargetHead.from_folder(target_folder, torch.float32, where)
    layers = MtpLayers(target, target_folder, mtp, tensors=fresh)
    if layers.count > 1:
        distributed.log(f"warning: only the first of the checkpoint's {layers.count} MTP layers is measured and "
                        "refreshed; the others, which draft depths 2 and on reading its output, are written "
                        "unchanged")
    run.work.mkdir(parents=True, exist_ok=True)
    trainer = MtpTrainer(target, run.store, run.settings, run.work, layers, device=where)
    summary = {"target": str(target_folder), "depth": run.settings.num_heads, "settings": asdict(run.settings)}
    if measure_only:
        summary.update(measured_on="all", before=trainer.acceptance(range(run.store.num_sequences)))
        distributed.log(f"MTP layer on all {run.store.num_sequences} sequences: {acceptance_line(summary['before'])}")
        return summary
    seqs = trainer.eval_seqs or trainer.train_seqs  # a single sequence is trained and measured on
    summary.update(measured_on="held-out" if trainer.eval_seqs else "training", before=trainer.acceptance(seqs))
    distributed.log(f"MTP layer as read, on {len(seqs)} {summary['measured_on']} sequences: "
                    f"{acceptance_line(summary['before'])}")
    distributed.log(f"refreshing the MTP layer on {trainer.train_count} positions ({run.settings.num_heads} "
                    f"depth(s)), {trainer.total_steps} optimizer steps, on {where}")
    progress = trainer.train(resume)
    summary.update(after=trainer.acceptance(seqs), positions=trainer.train_count, history=progress.history,
                   out=str(out))
    distributed.log(f"MTP layer refreshed: {acceptance_line(summary['after'])}")
    values = {layers.prefix + name: value for name, value in trainer.heads.tensors().items()}
    summary["timings_s"] = {**run.timings, "total_s": round(time.perf_counter() - started, 1)}
    if graft:
        summary["grafted"] = {"shard": ADDED_SHARD, "tensors": len(fresh)}
        added = {layers.prefix + name: values.get(layers.prefix + name, init).to(init.dtype)
                 for name, init in fresh.items()}
        add_tensors(target_folder, Path(out), added, grafted_config(cfg, target_folder), overwrite,
                    notes={NOTES_FILE: summary})
        distributed.log(f"wrote {out}: {len(added)} MTP tensors added in {ADDED_SHARD}, every other file as in "
                        f"{target_folder} but config.json (one MTP layer)")
        return summary
    rewrite_checkpoint(target_folder, Path(out), values, overwrite, notes={NOTES_FILE: summary})
    distributed.log(f"wrote {out}: {len(values)} MTP tensors replaced, every other file as in {target_folder}")
    return summary


def _check_graft(cfg: DecoderConfig, folder: Path, graft: bool, measure_only: bool) -> None:
    """Refuse, before any work, a checkpoint without the MTP layer to refresh (without ``graft``) or one
    that has it (with ``graft``)."""
    if cfg.family.mtp_layout is None:
        check_mtp_layers(cfg, folder, option="kind")  # a family whose MTP layers are not read
    if not graft:
        check_mtp_layers(cfg, folder, option="graft",
                         instead="graft a new one, trained on the current body, or train heads of another kind")
        if not present_tensors(folder, cfg):
            key = count_key(cfg, cfg.family.text_part(read_json(folder / "config.json")))
            raise CorruptModel(f"{folder} declares {cfg.mtp_layers} MTP layer(s) ({key}) but holds none of their "
                               "tensors (a fine-tuning tool may have dropped them): graft a new one, trained on "
                               "the current body", option="graft")
        return
    if cfg.fp8_block is not None:
        raise UnsupportedModel(f"{folder} holds block-scaled FP8 weights: a grafted MTP layer is not written "
                               "into them", option="graft")
    if measure_only:
        raise BadInput("a grafted MTP layer is new: there is nothing to measure before it trains (its "
                       "acceptance is measured before and after training)", option="measure_only")
    if present_tensors(folder, cfg):
        raise BadInput(f"{folder} already holds its MTP layer: refresh it without grafting", option="graft")


def _check_out(target_folder: Path, out: Optional[Path], measure_only: bool, overwrite: bool) -> None:
    """Refuse, before any work, an output the refresh cannot write."""
    if measure_only:
        return
    if out is None:
        raise BadInput("no output folder: name the folder the checkpoint with the refreshed MTP layer is written "
                       "to, or only measure the layer", option="out")
    if Path(out).resolve() == target_folder.resolve():
        raise BadInput(f"{out} is the checkpoint itself: write the refreshed one to another folder", option="out")
    if Path(out).exists() and not overwrite:
        raise BadInput(f"{out} already exists: choose another folder or replace it", option="overwrite")


def acceptance_line(measured: dict) -> str:
    """One line of an acceptance measurement."""
    return (f"acceptance by depth {measured['acceptance']}, top-1 by depth {measured['top1']} "
            f"({measured['chains']} chains)")
