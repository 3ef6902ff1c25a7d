"""add-heads at scale, on the CPU: features in shards streamed as the in-memory path would give them,
what a training step reads, resuming an interrupted extraction, batched teacher-forced passes, the
device and the process group's backend, bfloat16 autocast, progress lines, two ranks sharing shards."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import random_decoder
from mtpctl.cli.main import main
from mtpctl.errors import BadInput
from mtpctl.train import distributed
from mtpctl.train.add_heads import add_heads
from mtpctl.train.distill import TrainSequence
from mtpctl.train.eagle import Eagle3Trainer
from mtpctl.train.features import Features, compute_features
from mtpctl.train.settings import TrainSettings
from mtpctl.train.shards import Manifest, MemoryFeatures, ShardEntry, ShardedFeatures, shard_name, write_shard
from mtpctl.train.target import TargetHead
from mtpctl.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]


def write_data(folder: Path, prompts: int = 24) -> Path:
    path = folder / "data.jsonl"
    with path.open("w") as f:
        for i in range(prompts):
            f.write(json.dumps({"prompt": f"count: {i} {i + 1} {i + 2}"}) + "\n")
        f.write(json.dumps({"text": "abcabcabcabcabcabcabcabcabc " * 4}) + "\n")
    return path


SMALL = dict(num_heads=2, self_distill=True, response_tokens=16, epochs=2, batch_tokens=64, tree_nodes=4, lr=3e-3,
             shard_positions=200)


def feature_store(home: Path) -> ShardedFeatures:
    """The one feature folder an add-heads run wrote under ``home``."""
    (folder,) = (home / "work").glob("features-*")
    return ShardedFeatures(folder, Manifest.load(folder))


def heads_state(trainer) -> dict:
    return {k: v.clone() for k, v in trainer.heads.state_dict().items()}


@pytest.mark.parametrize("kind, extra", [("medusa", dict(condition_on_token=True, soft_labels=True)),
                                         ("eagle3", dict(aux_layers=[0, 1, 2], draft_vocab=40))])
def test_streamed_shards_give_the_in_memory_batches_and_heads(tiny_folder, tmp_path, kind, extra):
    """Features written as several shards and streamed back train exactly as the same features held
    in memory (one Features, as the single features file held them, cut at the same sequences): the same
    positions in every micro-batch, the same rows read, bit-identical heads."""
    data = write_data(tmp_path)
    settings = TrainSettings(**{**SMALL, "kind": kind, **extra})
    add_heads(tiny_folder, "tiny", [data], tmp_path / "out", settings, tmp_path / "home")
    store = feature_store(tmp_path / "home")
    assert store.num_shards >= 3 and all(e.positions <= 200 for e in store.entries)
    feats = store.all_features()
    memory = MemoryFeatures(feats, [len(e.lengths) for e in store.entries])
    resolved = TrainSettings(**json.loads((tmp_path / "out" / "mtp_config.json").read_text())["training"]["settings"])
    target = TargetHead.from_folder(tiny_folder, torch.float32)
    cls = Eagle3Trainer if kind == "eagle3" else Trainer
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    streamed, held = (cls(target, s, resolved, tmp_path / name) for s, name in ((store, "a"), (memory, "b")))
    for (step_a, micro_a), (step_b, micro_b) in zip(streamed._batches(), held._batches()):
        assert step_a == step_b and len(micro_a) == len(micro_b)
        for (m_a, c_a), (m_b, c_b) in zip(micro_a, micro_b):
            assert torch.equal(c_a, c_b)
            if kind == "medusa":
                assert torch.equal(m_a.shards, m_b.shards) and torch.equal(m_a.local, m_b.local)
                for x, y in zip(streamed._inputs(m_a), held._inputs(m_b)):
                    assert (x is None and y is None) or all(torch.equal(p, q) for p, q in zip(
                        x if isinstance(x, tuple) else (x,), y if isinstance(y, tuple) else (y,)))
            else:
                assert m_a == m_b
                assert all(torch.equal(streamed._batch(m_a)[k], held._batch(m_b)[k]) for k in held._batch(m_b))
    streamed.train(resume=False)
    held.train(resume=False)
    a, b = heads_state(streamed), heads_state(held)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert streamed.evaluate() == held.evaluate()


def write_store(feats: Features, folder: Path, counts) -> ShardedFeatures:
    """``feats`` written as shards of ``counts`` sequences each."""
    folder.mkdir(parents=True)
    lengths = (feats.offsets[1:] - feats.offsets[:-1]).tolist()
    manifest = Manifest(feats.hidden.shape[1], 0, 0, 0)
    first = 0
    for i, n in enumerate(counts):
        a, b = int(feats.offsets[first]), int(feats.offsets[first + n])
        part = Features(feats.hidden[a:b], feats.pred[a:b], feats.offsets[first:first + n + 1] - a,
                        feats.loss_from[first:first + n], feats.ids[a:b])
        entry = ShardEntry(i, shard_name(i), first, lengths[first:first + n], feats.loss_from[first:first + n].tolist())
        write_shard(part, folder, entry)
        manifest.shards.append(entry)
        first += n
    manifest.save(folder)
    return ShardedFeatures(folder, manifest)


def synthetic_features(sequences: int = 160, length: int = 40, hidden: int = 64, vocab: int = 259) -> Features:
    g = torch.Generator().manual_seed(0)
    total = sequences * length
    pred = torch.randint(0, vocab, (total,), generator=g)
    ids = torch.cat([torch.tensor([1]), pred[:-1]])  # on the target's path
    return Features(torch.randn(total, hidden, generator=g).to(torch.bfloat16), pred,
                    torch.arange(0, total + 1, length), torch.zeros(sequences, dtype=torch.long), ids)


def step_reads(trainer, store) -> list:
    """Bytes read from the shard files by each training step (its batches and its losses)."""
    reads, steps = [], trainer._batches()
    while True:
        before = store.bytes_read
        step = next(steps, None)
        if step is None:
            return reads
        for m, counts in step[1]:
            trainer._loss(m, counts)
        reads.append(store.bytes_read - before)


def test_what_a_step_reads_does_not_grow_with_the_number_of_shards(tmp_path):
    """A step reads its own rows and the ids and predictions of the shards it touches (at most two open
    at once), so cutting the same features into four times as many shards reads no more a step."""
    feats = synthetic_features()
    model = random_decoder(seed=1)
    settings = TrainSettings(num_heads=2, batch_tokens=64, epochs=1, holdout=0.05)
    total = sum(t.numel() * t.element_size() for t in (feats.hidden, feats.pred, feats.ids))
    batch_rows = 64 * 64 * 2  # a micro-batch's hidden states, bfloat16
    most = {}
    for shards in (2, 8):
        store = write_store(feats, tmp_path / f"s{shards}", [160 // shards] * shards)
        reads = step_reads(Trainer(model, store, settings, tmp_path), store)
        assert store.most_open <= 2
        shard_ids_pred = len(feats.pred) // shards * 16  # one shard's ids and predictions, int64
        assert max(reads) <= batch_rows + 2 * shard_ids_pred  # a batch's rows, at most two shards' ids and predictions
        most[shards] = max(reads)
    assert most[8] <= most[2] < total / 8


def test_resume_keeps_finished_shards_and_redoes_the_one_cut_short(tiny_folder, tmp_path, monkeypatch):
    """An extraction killed after two shards, with a third half-written: resuming extracts only the
    shards not complete (the half-written one again) and gives the features of a run never stopped; a
    run that does not resume starts the shards over."""
    import mtpctl.train.extract as extract

    data = write_data(tmp_path)
    settings = TrainSettings(**SMALL)
    add_heads(tiny_folder, "tiny", [data], tmp_path / "straight", settings, tmp_path / "home1")
    straight = feature_store(tmp_path / "home1")
    assert straight.num_shards >= 4

    class Killed(Exception):
        pass

    written, original_write = [], extract.write_shard

    def dies_on_the_third(feats, folder, entry):
        if len(written) == 2:
            (Path(folder) / (entry.file + ".tmp")).write_bytes(b"half a shard")
            raise Killed()
        written.append(entry.index)
        return original_write(feats, folder, entry)

    monkeypatch.setattr(extract, "write_shard", dies_on_the_third)
    with pytest.raises(Killed):
        add_heads(tiny_folder, "tiny", [data], tmp_path / "resumed", settings, tmp_path / "home2")
    monkeypatch.setattr(extract, "write_shard", original_write)
    done, original_extract = [], extract.extract_shard

    def recorded(plan, *args, **kwargs):
        done.append(plan.index)
        return original_extract(plan, *args, **kwargs)

    monkeypatch.setattr(extract, "extract_shard", recorded)
    add_heads(tiny_folder, "tiny", [data], tmp_path / "resumed", settings, tmp_path / "home2", resume=True)
    assert written == [0, 1] and done == list(range(2, straight.num_shards))
    folder = next((tmp_path / "home2" / "work").glob("features-*"))
    assert not list(folder.glob("*.tmp"))
    a, b = straight.all_features(), feature_store(tmp_path / "home2").all_features()
    for name in ("hidden", "pred", "ids", "offsets", "loss_from"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    (folder / "manifest.json").unlink()  # as if cut short again: without resuming, every shard is redone
    done.clear()
    add_heads(tiny_folder, "tiny", [data], tmp_path / "again", settings, tmp_path / "home2")
    assert done == list(range(straight.num_shards))


def test_batched_teacher_forced_features_equal_one_pass_per_sequence():
    """Sequences of different lengths in one left-padded pass (several passes where tokens run out) give
    each sequence the hidden states, aux streams, predictions and soft labels of a pass of its own."""
    model = random_decoder(seed=2)
    g = torch.Generator().manual_seed(3)
    seqs = [TrainSequence(torch.randint(0, 256, (n,), generator=g).tolist(), 1) for n in (5, 17, 9, 30, 2, 17)]
    settings = TrainSettings(kind="eagle3", aux_layers=[0, 1, 2], distill_batch=4)
    soft = TrainSettings(soft_labels=True, soft_top=4, distill_batch=3)
    for s in (settings, soft):
        together = compute_features(model, seqs, s)
        for i, seq in enumerate(seqs):
            alone = compute_features(model, [seq], TrainSettings(**{**s.__dict__, "distill_batch": 1}))
            a, b = int(together.offsets[i]), int(together.offsets[i + 1])
            assert together.pred[a:b].tolist() == alone.pred.tolist()
            torch.testing.assert_close(together.hidden[a:b].float(), alone.hidden.float(), atol=0.02, rtol=0.02)
            if s.kind == "eagle3":
                torch.testing.assert_close(together.aux[a:b].float(), alone.aux.float(), atol=0.05, rtol=0.02)
            else:
                assert together.soft_ids[a:b].tolist() == alone.soft_ids.tolist()


def test_cuda_without_a_gpu_is_one_line_and_exit_2(tiny_folder, tmp_path, capsys, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    monkeypatch.setenv("MTPCTL_HOME", str(tmp_path / "home"))
    code = main(["add-heads", "-m", str(tiny_folder), "--data", str(write_data(tmp_path)), "--self-distill",
                 "--device", "cuda", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("mtpctl: error:")]
    assert code == 2 and len(lines) == 1 and "--device" in lines[0] and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_the_backend_and_device_follow_the_device(monkeypatch):
    """NCCL for CUDA ranks, gloo for CPU ranks; under torchrun a CUDA rank takes cuda:LOCAL_RANK and an
    explicit index is refused; outside torchrun nothing joins a process group."""
    assert distributed.backend_for(torch.device("cuda", 3)) == "nccl"
    assert distributed.backend_for(torch.device("cpu")) == "gloo"
    assert distributed.init_distributed("cpu") == torch.device("cpu")
    assert not torch.distributed.is_initialized()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert distributed.rank_device("cuda") == torch.device("cuda", 0)  # one process: an index to set and pin
    assert distributed.rank_device("cuda:3") == torch.device("cuda", 3)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert distributed.rank_device("cuda") == torch.device("cuda", 2)
    assert distributed.rank_device("auto") == torch.device("cuda", 2)
    assert distributed.rank_device("cpu") == torch.device("cpu")
    with pytest.raises(BadInput, match="LOCAL_RANK") as err:
        distributed.rank_device("cuda:1")
    assert err.value.option == "device"


def test_a_bfloat16_target_trains_float32_heads_under_autocast(tmp_path):
    feats = synthetic_features(sequences=8, length=20)
    model = random_decoder(seed=1)
    target = TargetHead(model.cfg, model.embed.detach().to(torch.bfloat16), model.embed.detach().to(torch.bfloat16))
    trainer = Trainer(target, feats, TrainSettings(num_heads=2, batch_tokens=32, epochs=1, condition_on_token=True),
                      tmp_path)
    assert trainer.bf16 and all(p.dtype == torch.float32 for p in trainer.heads.parameters())
    before = heads_state(trainer)
    progress = trainer.train(resume=False)
    assert progress.step == trainer.total_steps and math.isfinite(progress.history[-1]["loss"])
    assert any(not torch.equal(before[k], v) for k, v in heads_state(trainer).items())


def test_target_head_is_the_decoders_embedding_and_lm_head(tiny_folder):
    from mtpctl.model.decoder import Decoder

    model = Decoder.from_folder(tiny_folder, torch.float32)
    target = TargetHead.from_folder(tiny_folder, torch.float32)
    h = torch.randn(3, model.cfg.hidden_size)
    assert torch.equal(target.embed, model.embed) and torch.equal(target.logits(h), model.logits(h))


def test_progress_lines_give_the_pace_and_the_time_left(capsys):
    meter = distributed.Meter("features", 10, "sequences", every=1e9)
    meter.update(4, positions=400)
    meter.close()
    line = capsys.readouterr().err.strip()
    assert line.startswith("mtpctl: features: 4/10 sequences") and "positions/s" in line and "ETA" in line


@pytest.mark.slow
def test_two_ranks_extract_their_shares_and_agree_with_one(tiny_folder, tmp_path, monkeypatch):
    """torchrun --nproc-per-node 2 (gloo, CPU) with several shards: both ranks extract shards, and the
    heads equal a single process's over the same features (up to float summation order)."""
    data = write_data(tmp_path)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"version: 1\nmodel: {tiny_folder}\ndata: [{data.name}]\nsettings:\n  self_distill: true\n"
                      "  num_heads: 2\n  response_tokens: 16\n  epochs: 1\n  batch_tokens: 64\n"
                      "  shard_positions: 200\n")
    env = {**os.environ, "MTPCTL_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    ddp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "mtpctl.cli.main", "add-heads", "--recipe", str(recipe),
                          "--out", str(tmp_path / "ddp")],
                         env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert ddp.returncode == 0, ddp.stderr[-2000:]
    assert {e.rank for e in feature_store(tmp_path / "home").entries} == {0, 1}
    monkeypatch.setenv("MTPCTL_HOME", str(tmp_path / "home"))
    assert main(["add-heads", "--recipe", str(recipe), "--out", str(tmp_path / "single")]) == 0
    from mtpctl.drafters.heads.folder import load_heads

    one, two = load_heads(tmp_path / "single").state_dict(), load_heads(tmp_path / "ddp").state_dict()
    for name in one:
        assert torch.allclose(one[name], two[name], atol=1e-4), name


def test_eagle_evaluation_groups_need_not_be_shared_by_the_ranks(tmp_path, monkeypatch):
    """Every rank evaluates the held-out sequences on its own: one held-out sequence under two ranks
    is one group (training groups still need a sequence per rank)."""
    from mtpctl.train.eagle import EagleTrainer

    model = random_decoder(seed=1)
    trainer = EagleTrainer(model, synthetic_features(sequences=4, length=10),
                           TrainSettings(kind="eagle", num_heads=2, batch_tokens=8, epochs=1), tmp_path)
    monkeypatch.setattr("mtpctl.train.distributed.world_size", lambda: 2)
    assert trainer._group([3], shared=False) == [[3]]
    with pytest.raises(BadInput, match="2 processes"):
        trainer._group([3])
