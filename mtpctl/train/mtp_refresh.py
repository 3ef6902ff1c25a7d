"""``add-heads --kind mtp``: measure a checkpoint's own MTP layers on the user's data, refresh them by
self-distillation on the current body, and write them back into a new checkpoint folder.

1. features: the body's hidden states and greedy predictions over the data (self-distilled responses
   with ``self_distill``), as for every head kind (:func:`mtpctl.train.add_heads.prepare_features`);
2. measure: per-depth acceptance of the layers as read (:meth:`mtpctl.train.mtp.MtpTrainer.acceptance`),
   on the held-out sequences (all sequences with ``measure_only``);
3. refresh: the layers train together on the other sequences (the body frozen), ``num_heads`` depths
   deep, chained as ``--speculate mtp`` drafts with them (:class:`mtpctl.train.mtp.MtpChain`: layer i
   drafts depth i+1, the last one the depths past them);
4. measure again on the same held-out sequences;
5. write back (:func:`mtpctl.model.rewrite.rewrite_checkpoint`): a new folder where only the layers'
   tensors hold new values (same names, dtypes, shards), with ``mtp_refresh.json`` (the figures).

With ``graft`` (a checkpoint whose MTP tensors were dropped), the layer measured and trained is a new one
(:func:`mtpctl.train.mtp_graft.fresh_layer`) and the write-back adds its tensors in a new shard, the
config declaring one layer (:func:`mtpctl.model.rewrite.add_tensors`).

Depths: a checkpoint declaring k layers (one where grafted) is measured and trained ``num_heads`` >= k
deep (depths 1..k its layers', the rest its last layer's, recursively); :func:`layer_count` is the
default depth.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional, Sequence

import torch

from mtpctl.drafters.mtp import MtpLayers, MtpSettings, check_mtp_layers, read_mtp_layers
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
    """Measure the MTP layers of the checkpoint in ``target_folder`` on ``data`` and, unless
    ``measure_only``, refresh them and write the checkpoint with the new layers to ``out``.

    Args:
        settings: of kind ``mtp``; ``num_heads`` is the depth measured and trained, at least the
            checkpoint's k layers (depths 1..k from its layers in turn, deeper ones by running the last
            recursively), ``head_decay`` the recursive depths' weight (depth s > k: ``head_decay^(s-k)``).
        mtp: how the layer runs (the drafter's settings; the defaults are ``--speculate mtp``'s).
        graft: the checkpoint's MTP tensors are missing: build a new layer (:mod:`mtpctl.train.mtp_graft`),
            measure it, train it and write the checkpoint with it added to ``out``.
        The others as :func:`mtpctl.train.add_heads.add_heads`'s.

    Returns:
        ``{"target", "depth", "layers", "measured_on", "before": acceptance, ...}``, with ``after``, ``positions``,
        ``history``, ``out`` when refreshed (acceptance: :meth:`~mtpctl.train.mtp.MtpTrainer.acceptance`).

    Raises:
        BadInput: bad settings, no ``out``, ``out`` exists without ``overwrite`` or is the target, a
            checkpoint without MTP layers (one that holds them, with ``graft``; ``graft`` with
            ``measure_only``), fewer depths than the checkpoint's layers, several processes.
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
    count = layer_count(target_folder, graft)
    if settings.num_heads < count:
        raise BadInput(f"{target_folder} has {count} MTP layers, each drafting a depth of its own: measure and train "
                       f"at least {count} depths (--num-heads {count}), not {settings.num_heads}", option="num_heads")
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
    layers = [MtpLayers(target, target_folder, mtp, tensors=fresh)] if graft else \
        read_mtp_layers(target, target_folder, mtp)
    what = "MTP layer" if len(layers) == 1 else f"{len(layers)} MTP layers"
    run.work.mkdir(parents=True, exist_ok=True)
    trainer = MtpTrainer(target, run.store, run.settings, run.work, layers, device=where)
    summary = {"target": str(target_folder), "depth": run.settings.num_heads, "layers": len(layers),
               "settings": asdict(run.settings)}
    if measure_only:
        summary.update(measured_on="all", before=trainer.acceptance(range(run.store.num_sequences)))
        distributed.log(f"{what} on all {run.store.num_sequences} sequences: {acceptance_line(summary['before'])}")
        return summary
    seqs = trainer.eval_seqs or trainer.train_seqs  # a single sequence is trained and measured on
    summary.update(measured_on="held-out" if trainer.eval_seqs else "training", before=trainer.acceptance(seqs))
    distributed.log(f"{what} as read, on {len(seqs)} {summary['measured_on']} sequences: "
                    f"{acceptance_line(summary['before'])}")
    distributed.log(f"refreshing the {what} on {trainer.train_count} positions ({run.settings.num_heads} "
                    f"depth(s)), {trainer.total_steps} optimizer steps, on {where}")
    progress = trainer.train(resume)
    summary.update(after=trainer.acceptance(seqs), positions=trainer.train_count, history=progress.history,
                   out=str(out))
    distributed.log(f"{what} refreshed: {acceptance_line(summary['after'])}")
    values = trainer.heads.values()
    summary["timings_s"] = {**run.timings, "total_s": round(time.perf_counter() - started, 1)}
    if graft:
        prefix = layers[0].prefix
        summary["grafted"] = {"shard": ADDED_SHARD, "tensors": len(fresh)}
        added = {prefix + name: values.get(prefix + name, init).to(init.dtype) for name, init in fresh.items()}
        add_tensors(target_folder, Path(out), added, grafted_config(cfg, target_folder), overwrite,
                    notes={NOTES_FILE: summary})
        distributed.log(f"wrote {out}: {len(added)} MTP tensors added in {ADDED_SHARD}, every other file as in "
                        f"{target_folder} but config.json (one MTP layer)")
        return summary
    rewrite_checkpoint(target_folder, Path(out), values, overwrite, notes={NOTES_FILE: summary})
    distributed.log(f"wrote {out}: {len(values)} MTP tensors replaced, every other file as in {target_folder}")
    return summary


def layer_count(folder: Path, graft: bool = False) -> int:
    """The MTP layers a refresh of the checkpoint in ``folder`` trains, which is its default depth: the
    count its config declares (at least 1), one with ``graft``."""
    return 1 if graft else max(DecoderConfig.from_folder(Path(folder)).mtp_layers, 1)


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
