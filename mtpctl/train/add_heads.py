"""``add-heads``: graft MTP heads onto a frozen target and train them by self-distillation.

Pipeline (Cai et al. 2024, "Medusa", Medusa-1: the base model stays frozen):

1. data: text records, or prompts answered by the target itself (:mod:`mtpctl.train.distill`), and
   prompts the target writes itself (Magpie, :mod:`mtpctl.train.magpie`) added to them;
2. features: the hidden states ``[T, hidden]`` (after the final norm) and the target's own prediction
   at each position (argmax, and with ``soft_labels`` its top-m distribution) of every sequence. For
   self-distilled sequences self-distillation keeps them as it generates (when ``distill_dtype`` equals
   ``features_dtype`` and without soft labels); otherwise, and for text records, teacher-forced passes
   of the target over several sequences at once give them. They are written to disk in bfloat16 shards
   as they are computed (:mod:`mtpctl.train.extract`, :mod:`mtpctl.train.shards`), keyed by the target's
   weight hash, the data and the settings that shape them, so epochs, re-runs and ``--resume`` never
   re-run the target (a resumed run keeps the shards finished before it stopped);
3. training: head k (1-based) at position t learns the target's prediction for token t+1+k, i.e.
   ``pred[t + k]``, where the tokens between follow the target's own path (``ids[t + j + 1] ==
   pred[t + j]`` for 0 < j < k; from j = 0 for heads that do not read the next token), as they do along
   any path the target accepts at decode time (a self-distilled response always; plain text only
   where it happens to); loss = sum_k decay^(k-1) * CE (or KL to the target's distribution with
   ``soft_labels``); AdamW, linear warm-up then cosine decay, gradient accumulation; positions are
   independent examples (the heads see one hidden state), streamed from the shards in a seeded order;
   the heads read only the target's embedding and lm_head (:mod:`mtpctl.train.target`);
4. evaluation: per-head top-k accuracy on held-out sequences; the default draft tree is grown from
   it (:func:`mtpctl.drafters.heads.tree.tree_from_accuracy`);
5. output: ``mtp_config.json`` + ``mtp_heads.safetensors`` + ``mtp_datastore.safetensors`` (the training
   sequences as a retrieval datastore) written to a temporary folder and renamed;
6. measurement (before the rename): the folder decodes up to ``measure_prompts`` held-out prompts
   plainly, with heads and with heads+ngram (:mod:`mtpctl.train.measure`); their tau and whether each
   output equals plain decoding go into ``mtp_config.json`` (``training.measured``).

Everything runs on one device (``device``: ``auto``, ``cpu``, ``cuda``, ``cuda:N``): on CUDA the target
is bfloat16 by default and heads train under bfloat16 autocast. Under ``torchrun --nproc-per-node N``
(DDP: NCCL on CUDA, gloo on the CPU; a CUDA rank on ``cuda:LOCAL_RANK``) every rank extracts its share
of the feature shards, trains on its share of each batch, gradients are averaged, and rank 0 writes
the output.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch

from mtpctl.version import __version__
from mtpctl.drafters.heads.eagle3 import check_aux_layers, default_aux_layers
from mtpctl.drafters.heads.folder import save_heads
from mtpctl.drafters.heads.tree import expected_accepted, tree_from_accuracy
from mtpctl.drafters.retrieval import DATASTORE_FILE, Datastore
from mtpctl.errors import BadInput, MtpctlError
from mtpctl.files import output_folder
from mtpctl.model.config import DecoderConfig
from mtpctl.model.tokenizer import TextCodec
from mtpctl.model.weights import weights_hash
from mtpctl.train import distributed
from mtpctl.train.distill import Record, read_records
from mtpctl.train.eagle import Eagle3Trainer, EagleTrainer
from mtpctl.train.extract import TargetModels, extract
from mtpctl.train.features import FEATURES_FORMAT, build_items, data_fingerprint, run_key
from mtpctl.train.measure import MeasureSettings, held_out_prompts, measure_tau, measured_line
from mtpctl.train.magpie import CACHE_FILE, DRAW_LOG_FILE, PROMPTS_FILE, DrawLog, MagpiePrompts, magpie_prompts
from mtpctl.train.settings import DTYPES, TrainSettings, resolve_settings
from mtpctl.train.shards import FeatureStore, Manifest, ShardedFeatures
from mtpctl.train.target import TargetHead
from mtpctl.train.trainer import Trainer


#: the trainer of each head kind
TRAINERS = {"medusa": Trainer, "hydra": Trainer, "eagle": EagleTrainer, "eagle3": Eagle3Trainer}


def trainer_class(kind: str):
    """The trainer class of heads of ``kind``.

    Raises:
        BadInput: a kind no trainer trains (the message names the known kinds).
    """
    if kind not in TRAINERS:
        raise BadInput(f"no trainer for head kind {kind!r} (known kinds: {', '.join(TRAINERS)})", option="kind")
    return TRAINERS[kind]


def write_datastore(store: FeatureStore, path: Path, vocab_size: int) -> int:
    """Write the training sequences (prompts and the target's self-distilled responses) as a
    retrieval datastore (:mod:`mtpctl.drafters.retrieval`) to ``path``, recording the target's
    ``vocab_size``; returns the number of tokens."""
    sequences = []
    for shard in range(store.num_shards):
        index = store.index(shard)
        ids, offsets = index.ids.tolist(), index.offsets.tolist()
        sequences += [ids[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
    Datastore.from_sequences(sequences).save(path, vocab_size)
    return sum(len(s) for s in sequences)


def write_output(out: Path, heads: torch.nn.Module, overwrite: bool, extra_files: Dict[str, Path],
                 finish: Optional[Callable[[Path], None]] = None) -> None:
    """Write the head folder to ``out`` atomically: a temporary sibling folder, renamed when complete
    (``finish`` receives it complete, before the rename: the tau measurement, which decodes with it);
    an existing ``out`` is replaced only with ``overwrite`` (after the new one is complete).

    Raises:
        BadInput: ``out`` exists and ``overwrite`` is not set.
    """
    with output_folder(Path(out), overwrite) as tmp:  # ordinary file modes (safetensors writes owner-only files)
        save_heads(heads, tmp)
        for name, src in extra_files.items():
            shutil.copy2(src, tmp / name)
        if finish is not None:
            finish(tmp)


def measure_in_folder(folder: Path, heads: torch.nn.Module, target_folder: Path, prompts: List[List[int]],
                      settings: TrainSettings, where: torch.device) -> None:
    """Decode ``prompts`` with the complete head folder ``folder`` (:func:`mtpctl.train.measure.measure_tau`)
    and record the figures in its config (``training.measured``) and the training summary."""
    t0 = time.perf_counter()
    try:
        measured = measure_tau(MeasureSettings(str(target_folder), str(folder), settings.distill_dtype, str(where),
                                               settings.response_tokens, settings.tree_nodes), prompts)
        distributed.log(measured_line(measured))
    except MtpctlError as err:  # the trained heads are kept: the measurement is recorded as failed
        distributed.log(f"warning: could not measure tau with the heads ({err}); the folder is written without it")
        measured = {"error": str(err)}
    heads.cfg.training["measured"] = measured
    heads.cfg.training["timings_s"]["measure_s"] = round(time.perf_counter() - t0, 1)
    heads.cfg.save(folder)


def add_heads(target_folder: Path, target_name: str, data: Sequence[Path], out: Path, settings: TrainSettings,
              home: Path, resume: bool = False, overwrite: bool = False, bundle: bool = False,
              device: str = "auto") -> dict:
    """Train MTP heads for the target in ``target_folder`` and write them to ``out``.

    Args:
        target_folder: the target checkpoint (Hugging Face folder).
        target_name: how the user named it (recorded in the config).
        data: ``.txt``/``.jsonl`` data files (see :mod:`mtpctl.train.distill`); may be empty when
            ``settings.magpie`` draws prompts (then the target writes every prompt).
        out: the head folder to write.
        settings: training settings.
        home: mtpctl's cache folder (features and checkpoints live under ``home/work``).
        resume: continue from this run's last checkpoint, keeping the feature shards an interrupted
            run finished.
        overwrite: replace an existing ``out``.
        bundle: copy the target's weights into ``out`` (otherwise they are referenced by hash).
        device: where the target runs and the heads train: ``auto`` (a CUDA GPU when torch sees one),
            ``cpu``, ``cuda`` or ``cuda:N``; under torchrun a CUDA rank takes ``cuda:LOCAL_RANK``.

    Returns:
        the training summary written into the config (figures and timings; with Magpie prompts,
        ``magpie``: the screening's counts and the pre-query template).

    Raises:
        BadInput: bad settings, data or device, or ``out`` exists without ``overwrite``.
        CorruptModel, UnsupportedModel: the target cannot be loaded.
    """
    settings.check()
    out = Path(out)
    if out.exists() and not overwrite:
        raise BadInput(f"{out} already exists: choose another folder or replace it", option="overwrite")
    started = time.perf_counter()
    where = distributed.init_distributed(device)
    run = prepare_features(target_folder, data, settings, home, where, resume)
    settings, cfg, store, work, timings, magpie = run.settings, run.cfg, run.store, run.work, run.timings, run.magpie
    target_hash = run.target_hash
    target = TargetHead.from_folder(target_folder, DTYPES[settings.target_dtype], where)
    work.mkdir(parents=True, exist_ok=True)
    trainer = trainer_class(settings.kind)(target, store, settings, work, device=where)
    _announce_training(trainer, settings, where)
    t0 = time.perf_counter()
    progress = trainer.train(resume)
    timings["train_s"] = round(time.perf_counter() - t0, 1)
    acc = trainer.evaluate()
    tree = tree_from_accuracy(acc, settings.tree_nodes)
    summary = {"settings": asdict(settings), "positions": trainer.train_count, "held_out": trainer.eval_count,
               "history": progress.history, "held_out_top1": [round(a[0], 4) for a in acc],
               "expected_tau": round(1 + expected_accepted(acc, tree), 3), "timings_s": timings,
               "device": str(where)}
    if magpie is not None:
        summary["magpie"] = magpie.record()  # its settings are in summary["settings"]
    if distributed.rank() == 0:
        trainer.hcfg.target, trainer.hcfg.target_hash = target_name, target_hash
        trainer.hcfg.tree = [list(p) for p in tree.paths]
        trainer.hcfg.topk_accuracy = [[round(x, 5) for x in row] for row in acc]
        trainer.hcfg.mtpctl_version = __version__
        summary["timings_s"]["total_s"] = round(time.perf_counter() - started, 1)
        trainer.hcfg.training = summary
        extra = {DATASTORE_FILE: work / DATASTORE_FILE}
        summary["datastore_tokens"] = write_datastore(store, extra[DATASTORE_FILE], cfg.vocab_size)
        if magpie is not None:
            extra[PROMPTS_FILE] = work / PROMPTS_FILE
            magpie.write_jsonl(extra[PROMPTS_FILE])
        if bundle:
            extra.update({p.name: p for p in sorted(Path(target_folder).iterdir())
                          if p.is_file() and not p.name.startswith(".")})
        prompts = held_out_prompts(store, trainer.eval_seqs, settings.measure_prompts)
        finish = None
        if prompts:
            distributed.log(f"measuring tau on {len(prompts)} held-out prompts")
            finish = partial(measure_in_folder, heads=trainer.heads, target_folder=Path(target_folder),
                             prompts=prompts, settings=settings, where=where)
        write_output(out, trainer.heads.cpu(), overwrite, extra, finish)
    distributed.barrier(where)
    return summary


@dataclass
class FeatureRun:
    """What :func:`prepare_features` gives a training run: its settings made concrete, the target's
    config and weight hash, the features, the run's work folder, timings and the Magpie prompts drawn."""

    settings: TrainSettings
    cfg: DecoderConfig
    target_hash: str
    store: ShardedFeatures
    work: Path
    timings: Dict[str, float]
    magpie: Optional[MagpiePrompts]


def _one_sequence_a_pass(settings: TrainSettings, cfg: DecoderConfig) -> TrainSettings:
    """``settings`` with ``distill_batch`` 1 for a body with Gated DeltaNet layers (Qwen3.5, Qwen3-Next),
    whose passes take one sequence each (a recurrent state per sequence, no padding): its
    self-distillation and teacher-forced passes then run a sequence at a time."""
    if cfg.deltanet is None or settings.distill_batch == 1:
        return settings
    distributed.log(f"features: {cfg.model_type} has Gated DeltaNet layers: one sequence a pass "
                    f"(distill_batch 1, not {settings.distill_batch})")
    return replace(settings, distill_batch=1)


def prepare_features(target_folder: Path, data: Sequence[Path], settings: TrainSettings, home: Path,
                     where: torch.device, resume: bool = False) -> FeatureRun:
    """The features of the target over ``data`` (and Magpie prompts), extracted once into
    ``home/work/features-KEY`` (reused when there; ``resume`` keeps the shards an interrupted run
    finished), with the run's work folder ``home/work/heads-KEY``."""
    codec = TextCodec(target_folder)
    target_hash = weights_hash(target_folder)
    records = read_records(data) if data or not settings.magpie_count else []
    cfg = DecoderConfig.from_folder(Path(target_folder))
    settings = _one_sequence_a_pass(resolve_settings(_with_aux_layers(settings, cfg.num_hidden_layers),
                                                     cfg.hidden_size, cfg.max_position_embeddings, where), cfg)
    feat_dir = Path(home) / "work" / f"features-{run_key(target_hash, data_fingerprint(data), feature_shape(settings))}"
    work = Path(home) / "work" / f"heads-{run_key(feat_dir.name, training_shape(settings))}"
    timings = {}
    magpie = None
    if settings.magpie_count:
        t0 = time.perf_counter()
        magpie = cached_magpie_prompts(feat_dir, target_folder, settings, where, resume)
        records += [Record(messages=[{"role": "user", "content": p}]) for p in magpie.prompts]
        timings["magpie_s"] = round(time.perf_counter() - t0, 1)
    manifest = Manifest.load(feat_dir)
    if manifest is None:
        t0 = time.perf_counter()
        items = build_items(records, codec, settings)
        manifest = extract(feat_dir, items, settings, TargetModels(target_folder, settings, where), codec.eos_ids,
                           resume, cfg.hidden_size)
        timings["features_s"] = round(time.perf_counter() - t0, 1)
    else:
        distributed.log(f"features: reusing {feat_dir} ({len(manifest.shards)} shards)")
    return FeatureRun(settings, cfg, target_hash, ShardedFeatures(feat_dir, manifest), work, timings, magpie)


def cached_magpie_prompts(feat_dir: Path, target_folder: Path, settings: TrainSettings,
                          where: torch.device, resume: bool = False) -> MagpiePrompts:
    """The Magpie prompts of this run: read from ``feat_dir`` (whose key covers the target and the
    Magpie settings) where an earlier run left them, else drawn by rank 0 from the target (in
    ``distill_dtype``, on ``where``) and kept there; the other ranks wait and read them. Each request is
    logged as it finishes (:class:`~mtpctl.train.magpie.DrawLog`); ``resume`` keeps the requests an
    interrupted run drew, otherwise they are drawn again."""
    from mtpctl.backends.torch import TorchSession

    path = Path(feat_dir) / CACHE_FILE
    found = MagpiePrompts.load(path)
    if found is None and distributed.rank() == 0:
        Path(feat_dir).mkdir(parents=True, exist_ok=True)
        log = DrawLog(Path(feat_dir) / DRAW_LOG_FILE)
        done = log.read() if resume else {}
        if not resume:
            log.remove()
        elif done:
            distributed.log(f"magpie: --resume: keeping the {len(done)} requests drawn before")
        session = TorchSession(Path(target_folder), settings.distill_dtype, device=str(where))
        meter = distributed.Meter("magpie", settings.magpie.count, "requests", done=len(done))
        found = magpie_prompts(session, settings.magpie, on_done=lambda _: meter.update(), done=done,
                               on_draw=log.append)
        meter.close()
        del session
        found.save(path, settings.magpie)
        log.remove()
    elif found is not None:
        distributed.log(f"magpie: reusing the prompts in {path}")
    distributed.barrier(where)
    found = found or MagpiePrompts.load(path)
    distributed.log(f"magpie: {found.stats.line()}")
    return found


def _with_aux_layers(settings: TrainSettings, num_layers: int) -> TrainSettings:
    """EAGLE-3's ``aux_layers`` made concrete (the engines' default where not given) and checked.

    Raises:
        BadInput: a layer the target does not have.
    """
    if settings.kind != "eagle3":
        return settings
    layers = settings.aux_layers or list(default_aux_layers(num_layers))
    try:
        check_aux_layers(layers, num_layers)
    except ValueError as err:
        raise BadInput(str(err), option="aux_layers") from err
    return replace(settings, aux_layers=layers)


def feature_shape(settings: TrainSettings) -> dict:
    """The settings that shape the features (their cache key), with the features' format."""
    shape = {k: getattr(settings, k) for k in ("self_distill", "response_tokens", "distill_dtype", "features_dtype",
                                                "max_seq_len", "soft_labels", "soft_top", "shard_positions")}
    shape["features_format"] = FEATURES_FORMAT
    if settings.magpie_count:
        shape["magpie"] = asdict(settings.magpie)
    if settings.kind == "eagle3":
        shape["aux_layers"] = settings.aux_layers
    return shape


def training_shape(settings: TrainSettings) -> dict:
    """The settings that shape the trained heads (the key of a run's checkpoints): all but the final
    measurement's, so a run resumed to measure again reuses the checkpoint."""
    shape = asdict(settings)
    del shape["measure_prompts"]
    return shape


def _announce_training(trainer: Trainer, settings: TrainSettings, where: torch.device) -> None:
    what = (f"an {settings.kind} head ({settings.num_heads} draft steps)" if settings.kind in ("eagle", "eagle3")
            else f"{settings.num_heads} {settings.kind} heads")
    how = "bfloat16 autocast" if trainer.bf16 else "float32"
    distributed.log(f"training {what} on {trainer.train_count} positions ({trainer.eval_count} held out), "
                    f"{trainer.total_steps} optimizer step{'s' if trainer.total_steps != 1 else ''}, on {where} "
                    f"({how}, {distributed.world_size()} rank(s))")
