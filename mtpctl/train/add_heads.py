"""``add-heads``: graft MTP heads onto a frozen target and train them by self-distillation.

Pipeline (Cai et al. 2024, "Medusa", Medusa-1: the base model stays frozen):

1. data: text records, or prompts answered by the target itself (:mod:`mtpctl.train.distill`);
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
   it (:func:`mtpctl.drafters.heads.tree.tree_from_accuracy`);
5. output: ``mtp_config.json`` + ``mtp_heads.safetensors`` + ``mtp_datastore.safetensors`` (the training
   sequences as a retrieval datastore) written to a temporary folder and renamed.

Under ``torchrun --nproc-per-node N`` (DDP, gloo on CPU) rank 0 prepares the features, every rank
trains on its share of each batch, gradients are averaged, and rank 0 writes the output.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Dict, Sequence

import torch

from mtpctl.version import __version__
from mtpctl.drafters.heads.eagle3 import check_aux_layers, default_aux_layers
from mtpctl.drafters.heads.folder import save_heads
from mtpctl.drafters.heads.tree import expected_accepted, tree_from_accuracy
from mtpctl.drafters.retrieval import DATASTORE_FILE, Datastore
from mtpctl.errors import BadInput
from mtpctl.files import output_folder
from mtpctl.model.decoder import Decoder
from mtpctl.model.tokenizer import TextCodec
from mtpctl.model.weights import weights_hash
from mtpctl.train import distributed
from mtpctl.train.distill import read_records
from mtpctl.train.eagle import Eagle3Trainer, EagleTrainer
from mtpctl.train.features import FEATURES_FORMAT, Features, build_sequences, compute_features, data_fingerprint, run_key
from mtpctl.train.settings import DTYPES, TrainSettings
from mtpctl.train.trainer import Trainer


def write_datastore(feats: Features, path: Path, vocab_size: int) -> Path:
    """Write the training sequences (prompts and the target's self-distilled responses) as a
    retrieval datastore (:mod:`mtpctl.drafters.retrieval`) to ``path``, recording the target's
    ``vocab_size``; returns ``path``."""
    ids, offsets = feats.ids.tolist(), feats.offsets.tolist()
    Datastore.from_sequences([ids[a:b] for a, b in zip(offsets[:-1], offsets[1:])]).save(path, vocab_size)
    return path


def write_output(out: Path, heads: torch.nn.Module, overwrite: bool, extra_files: Dict[str, Path]) -> None:
    """Write the head folder to ``out`` atomically: a temporary sibling folder, renamed when complete;
    an existing ``out`` is replaced only with ``overwrite`` (after the new one is complete).

    Raises:
        BadInput: ``out`` exists and ``overwrite`` is not set.
    """
    with output_folder(Path(out), overwrite) as tmp:  # ordinary file modes (safetensors writes owner-only files)
        save_heads(heads, tmp)
        for name, src in extra_files.items():
            shutil.copy2(src, tmp / name)


def add_heads(target_folder: Path, target_name: str, data: Sequence[Path], out: Path, settings: TrainSettings,
              home: Path, resume: bool = False, overwrite: bool = False, bundle: bool = False) -> dict:
    """Train Medusa heads for the target in ``target_folder`` and write them to ``out``.

    Args:
        target_folder: the target checkpoint (Hugging Face folder).
        target_name: how the user named it (recorded in the config).
        data: ``.txt``/``.jsonl`` data files (see :mod:`mtpctl.train.distill`).
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
        raise BadInput(f"{out} already exists: choose another folder or replace it", option="overwrite")
    started = time.perf_counter()
    codec = TextCodec(target_folder)
    target_hash = weights_hash(target_folder)
    records = read_records(data)
    target = Decoder.from_folder(target_folder, torch.float32)
    if settings.max_seq_len > target.cfg.max_position_embeddings:  # no sequence runs past the model's context
        settings = replace(settings, max_seq_len=target.cfg.max_position_embeddings)
    if settings.kind == "eagle3":  # the layers it reads, named in the config and the caches' keys
        layers = settings.aux_layers or list(default_aux_layers(target.cfg.num_hidden_layers))
        try:
            check_aux_layers(layers, target.cfg.num_hidden_layers)
        except ValueError as err:
            raise BadInput(str(err), option="aux_layers") from err
        settings = replace(settings, aux_layers=layers)
    shape = {k: getattr(settings, k) for k in ("self_distill", "response_tokens", "distill_dtype", "features_dtype",
                                                "max_seq_len", "soft_labels", "soft_top")}
    shape["features_format"] = FEATURES_FORMAT
    if settings.kind == "eagle3":
        shape["aux_layers"] = settings.aux_layers
    feat_dir = Path(home) / "work" / f"features-{run_key(target_hash, data_fingerprint(data), shape)}"
    work = Path(home) / "work" / f"heads-{run_key(feat_dir.name, asdict(settings))}"
    feat_path = feat_dir / "features.safetensors"
    timings = {}
    if distributed.rank() == 0 and not feat_path.exists():
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
        distributed.log(f"features: hidden states of {kept} sequences kept from self-distillation, one teacher-forced target "
            f"pass over {len(todo)}{why} ({sum(len(s.ids) for s in todo)} tokens, {settings.features_dtype}); "
            f"cached in {feat_dir}")
        features_model = None if not todo else target if settings.features_dtype == "float32" else \
            Decoder.from_folder(target_folder, DTYPES[settings.features_dtype], blocked=True)
        compute_features(features_model, sequences, settings).save(feat_path)
        del sequences, features_model  # the kept hidden states (~0.4 GB for the recipe) are on disk now
        timings["features_s"] = round(time.perf_counter() - t0, 1)
    elif distributed.rank() == 0:
        distributed.log(f"features: reusing {feat_path}")
    if distributed.world_size() > 1:
        torch.distributed.barrier()
    feats = Features.load(feat_path)
    work.mkdir(parents=True, exist_ok=True)
    trainer = {"eagle": EagleTrainer, "eagle3": Eagle3Trainer}.get(settings.kind, Trainer)(target, feats, settings, work)
    what = (f"an {settings.kind} head ({settings.num_heads} draft steps)" if settings.kind in ("eagle", "eagle3")
            else f"{settings.num_heads} {settings.kind} heads")
    distributed.log(f"training {what} on {len(trainer.train_pos)} positions "
        f"({len(trainer.eval_pos)} held out), {trainer.total_steps} optimizer step{'s' if trainer.total_steps != 1 else ''}")
    t0 = time.perf_counter()
    progress = trainer.train(resume)
    timings["train_s"] = round(time.perf_counter() - t0, 1)
    acc = trainer.evaluate()
    tree = tree_from_accuracy(acc, settings.tree_nodes)
    summary = {"settings": asdict(settings), "positions": len(trainer.train_pos), "held_out": len(trainer.eval_pos),
               "history": progress.history, "held_out_top1": [round(a[0], 4) for a in acc],
               "expected_tau": round(1 + expected_accepted(acc, tree), 3), "timings_s": timings}
    if distributed.rank() == 0:
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
    if distributed.world_size() > 1:
        torch.distributed.barrier()
    return summary
