"""add-heads: labels, losses and gradients of every head, repeatable training, resume, DDP agreement,
self-distillation in batches, the output folder, and the CLI's errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import greedy_reference, random_decoder
from mtpctl.cli.main import main
from mtpctl.train.distill import Record, batch_greedy, read_records
from mtpctl.drafters.heads.config import HeadsConfig
from mtpctl.drafters.heads.folder import load_heads
from mtpctl.drafters.heads.medusa import MedusaHeads
from mtpctl.errors import BadInput
from mtpctl.train.add_heads import add_heads
from mtpctl.train.features import Features, head_labels
from mtpctl.train.settings import TrainSettings
from mtpctl.train.trainer import Trainer, head_losses, lr_at

REPO = Path(__file__).resolve().parents[1]


def test_labels_are_the_targets_predictions_k_places_ahead():
    # two sequences of lengths 5 and 3; pred holds the target's argmax at each position, and the
    # input ids follow it (a self-distilled response: ids[t + 1] == pred[t])
    feats = Features(torch.zeros(8, 4), torch.tensor([10, 11, 12, 13, 14, 20, 21, 22]), torch.tensor([0, 5, 8]),
                     torch.tensor([0, 0]), torch.tensor([9, 10, 11, 12, 13, 19, 20, 21]))
    labels = head_labels(feats, torch.tensor([0, 2, 5, 6]), 3, None)
    # head k at position t learns pred[t + k], within the same sequence (else -100)
    assert labels.tolist() == [[11, 12, 13], [13, 14, -100], [21, 22, -100], [22, -100, -100]]
    vocab_index = torch.full((30,), -100)
    vocab_index[torch.tensor([11, 13, 22])] = torch.tensor([0, 1, 2])
    assert head_labels(feats, torch.tensor([0]), 3, vocab_index).tolist() == [[0, -100, 1]]


def test_labels_are_kept_only_where_the_tokens_before_them_follow_the_targets_path():
    """Plain text's tokens are not the target's: head k's label pred[t + k] is what the target says after
    ids[t + 2 .. t + k], which matches what the heads draft only where those ids are the target's own
    predictions (ids[t + j + 1] == pred[t + j], j = 1..k-1; and j = 0 for heads that do not read the
    next token)."""
    pred = torch.tensor([10, 11, 12, 13, 14, 15, 16])
    ids = torch.tensor([1, 2, 11, 3, 13, 14, 15])  # on the path at t + 1 = 2, 4, 5, 6 (pred[1], pred[3..5])
    feats = Features(torch.zeros(7, 4), pred, torch.tensor([0, 7]), torch.tensor([0]), ids)
    got = head_labels(feats, torch.tensor([0, 1, 2, 3]), 3, None)
    assert got.tolist() == [[11, 12, -100],    # t=0: ids[2] == pred[1], ids[3] != pred[2]
                            [12, -100, -100],  # t=1: ids[3] != pred[2]
                            [13, 14, 15],      # t=2: ids[4], ids[5] follow pred[3], pred[4]
                            [14, 15, 16]]
    # heads that do not read the next token also need ids[t + 1] == pred[t]
    got = head_labels(feats, torch.tensor([0, 1, 3]), 3, None, reads_next=False)
    assert got.tolist() == [[-100, -100, -100], [12, -100, -100], [14, 15, 16]]


def test_labels_equal_a_token_by_token_reference_on_random_sequences():
    """head_labels against its definition, written as loops, on random back-to-back sequences (ids
    mostly on the target's path), both head kinds, with and without a draft vocabulary."""
    import random

    rng = random.Random(0)
    for _ in range(150):
        lens = [rng.randint(1, 10) for _ in range(rng.randint(1, 4))]
        total, vocab, k_heads = sum(lens), rng.choice([3, 50]), rng.randint(1, 5)
        pred = [rng.randrange(vocab) for _ in range(total)]
        ids = [rng.randrange(vocab)] + [pred[t - 1] if rng.random() < 0.75 else rng.randrange(vocab) for t in range(1, total)]
        offsets = torch.tensor([0] + lens).cumsum(0)
        feats = Features(torch.zeros(total, 2), torch.tensor(pred), offsets, torch.zeros(len(lens), dtype=torch.long),
                         torch.tensor(ids))
        vocab_index = None
        if rng.random() < 0.3:
            vocab_index = torch.full((vocab,), -100)
            vocab_index[torch.tensor(rng.sample(range(vocab), vocab // 2 + 1))] = torch.arange(vocab // 2 + 1)
        positions = sorted(rng.sample(range(total), rng.randint(1, total)))
        for reads_next in (True, False):
            want = []
            for t in positions:
                end = int(offsets[offsets > t][0])  # the end of t's sequence
                row = []
                for k in range(1, k_heads + 1):
                    ok = t + k < end and all(ids[t + j + 1] == pred[t + j] for j in range(1 if reads_next else 0, k))
                    label = pred[t + k] if ok else -100
                    row.append(int(vocab_index[label]) if ok and vocab_index is not None else label)
                want.append(row)
            got = head_labels(feats, torch.tensor(positions), k_heads, vocab_index, reads_next)
            assert got.tolist() == want, (lens, ids, pred, positions, reads_next)


def test_every_head_gets_a_loss_and_a_gradient():
    model = random_decoder(seed=1)
    cfg = HeadsConfig("medusa", 3, 1, False, model.cfg.hidden_size, model.cfg.vocab_size)
    heads = MedusaHeads(cfg)
    hidden = torch.randn(6, model.cfg.hidden_size)
    labels = torch.randint(0, model.cfg.vocab_size, (6, 3))
    per_head = head_losses(heads(hidden, model.logits, full_vocab=False), labels)
    assert per_head.shape == (3,) and bool((per_head > 0).all())
    (per_head * torch.tensor([1.0, 0.8, 0.64])).sum().backward()
    for k, blocks in enumerate(heads.blocks):
        grad = blocks[0].linear.weight.grad
        assert grad is not None and float(grad.abs().sum()) > 0, f"head {k + 1} got no gradient"


def test_hydra_heads_read_the_targets_tokens_and_every_head_learns():
    """Hydra head k reads ids[t + k] (teacher forcing on the tokens that follow, the target's own along
    its path) and head k-1's features, so a loss on the last head alone sends gradients to every head."""
    from mtpctl.train.features import pending_embeds

    model = random_decoder(seed=1)
    cfg = HeadsConfig("hydra", 3, 1, False, model.cfg.hidden_size, model.cfg.vocab_size, token_conditioned=True)
    heads = MedusaHeads(cfg)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.05)
    feats = Features(torch.randn(8, model.cfg.hidden_size), torch.tensor([10, 11, 12, 13, 14, 20, 21, 22]),
                     torch.tensor([0, 5, 8]), torch.tensor([0, 0]), torch.tensor([9, 10, 11, 12, 13, 19, 20, 21]))
    embeds = pending_embeds(heads, feats, torch.tensor([0, 6]), model.embed)
    assert embeds.shape == (2, 3, model.cfg.hidden_size)
    assert torch.equal(embeds[0], model.embed[torch.tensor([10, 11, 12])])
    assert torch.equal(embeds[1, 0], model.embed[21])  # later ones past the end: clamped, unused
    logits = heads(feats.hidden[torch.tensor([0, 6])], model.logits, full_vocab=False, token_embeds=embeds)
    labels = head_labels(feats, torch.tensor([0, 6]), 3, None)
    head_losses(logits, labels)[2].backward()
    for k in range(3):
        assert float(heads.token_proj[k].grad.abs().sum()) > 0, f"head {k + 1} got no gradient from head 3"


def test_soft_labels_equal_hard_labels_for_a_one_hot_target():
    logits = torch.randn(4, 2, 7)
    labels = torch.randint(0, 7, (4, 2))
    ids = torch.stack([labels, (labels + 1) % 7], dim=-1)
    probs = torch.stack([torch.ones(4, 2), torch.zeros(4, 2)], dim=-1)
    assert torch.allclose(head_losses(logits, labels, (ids, probs)), head_losses(logits, labels))


def test_learning_rate_warms_up_then_decays():
    s = TrainSettings(warmup=0.1)
    values = [lr_at(step, 100, s) for step in range(100)]
    assert values[0] == pytest.approx(0.1) and values[9] == pytest.approx(1.0)
    assert values[10] == pytest.approx(1.0) and values[-1] < 0.01
    assert all(a >= b for a, b in zip(values[10:], values[11:]))


def test_batched_self_distillation_equals_one_prompt_at_a_time():
    model = random_decoder(seed=2)
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9]]
    got = batch_greedy(model, prompts, 12, eos_ids={258}, batch_size=3)
    for prompt, d in zip(prompts, got):
        assert d.response == greedy_reference(model, prompt, 12)[:len(d.response)]
        assert len(d.response) == 12 or d.response[-1] == 258
        assert d.hidden is None and d.pred is None


def test_kept_features_equal_a_teacher_forced_pass():
    """Self-distillation's own hidden states and argmax tokens serve as features: every position of
    prompt + response, as one teacher-forced pass over the finished sequence gives them."""
    from mtpctl.train.distill import TrainSequence
    from mtpctl.train.features import compute_features

    model = random_decoder(seed=2)
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9], [4]]
    eos = {int(batch_greedy(model, [[9, 9]], 5, set())[0].response[2])}  # one row stops early
    got = batch_greedy(model, prompts, 6, eos_ids=eos, batch_size=4, keep_features=True, aux_layers=(0, 2))
    assert len(got[2].response) == 3  # ended at its EOS, 3 rows kept on going
    eagle3 = TrainSettings(kind="eagle3", aux_layers=[0, 2])  # EAGLE-3 features: the layers' streams too
    for prompt, d in zip(prompts, got):
        ids = prompt + d.response
        assert d.hidden.shape == (len(ids), model.cfg.hidden_size) and d.pred.shape == (len(ids),)
        assert d.aux.shape == (len(ids), 2 * model.cfg.hidden_size)
        assert d.pred[len(prompt) - 1:-1].tolist() == d.response
        ref = compute_features(model, [TrainSequence(ids, len(prompt))], eagle3)
        torch.testing.assert_close(d.hidden.float(), ref.hidden.float(), atol=0.02, rtol=0.02)  # bf16 storage
        torch.testing.assert_close(d.aux.float(), ref.aux.float(), atol=0.05, rtol=0.02)
        assert torch.equal(ref.aux[:, :model.cfg.hidden_size], model.embed[torch.tensor(ids)].to(torch.bfloat16))
        assert d.pred.tolist() == ref.pred.tolist()
    assert compute_features(model, [TrainSequence([5, 6, 7], 1)], TrainSettings()).aux is None


def write_data(folder: Path) -> Path:
    path = folder / "data.jsonl"
    with path.open("w") as f:
        for i in range(24):
            f.write(json.dumps({"prompt": f"count: {i} {i + 1} {i + 2}"}) + "\n")
        f.write(json.dumps({"text": "abcabcabcabcabcabcabcabcabc " * 4}) + "\n")
    return path


SMALL = dict(num_heads=2, self_distill=True, response_tokens=16, epochs=2, batch_tokens=64, tree_nodes=4, lr=3e-3)


def read_heads(folder):
    return {k: v.clone() for k, v in load_heads(folder).state_dict().items()}


def test_training_is_repeatable_and_learns(tiny_folder, tmp_path):
    data = write_data(tmp_path)
    runs = []
    for i in range(2):
        summary = add_heads(tiny_folder, "tiny", [data], tmp_path / f"out{i}", TrainSettings(**SMALL),
                            tmp_path / f"home{i}")
        runs.append(read_heads(tmp_path / f"out{i}"))
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
    history = summary["history"]
    assert len(history) == 2 and history[-1]["loss"] < history[0]["loss"] + 1e-6
    cfg = HeadsConfig.load(tmp_path / "out0")
    assert cfg.num_heads == 2 and len(cfg.topk_accuracy) == 2 and len(cfg.tree) == 4
    assert cfg.training["settings"]["seed"] == 0 and cfg.target == "tiny" and len(cfg.target_hash) == 64
    other = add_heads(tiny_folder, "tiny", [data], tmp_path / "seed1", TrainSettings(**{**SMALL, "seed": 1}),
                      tmp_path / "home0")
    assert other["timings_s"].get("features_s") is None  # features came from the cache
    assert not all(torch.equal(runs[0][k], v) for k, v in read_heads(tmp_path / "seed1").items())


def test_resume_continues_where_an_interrupted_run_stopped(tiny_folder, tmp_path):
    data = write_data(tmp_path)
    add_heads(tiny_folder, "tiny", [data], tmp_path / "straight", TrainSettings(**SMALL), tmp_path / "home")

    class Interrupt(Exception):
        pass

    evals = []

    def stop_after_first_epoch(entry):  # the first epoch's eval runs before its checkpoint, the second's after it
        evals.append(entry)
        if len(evals) == 2:
            raise Interrupt()

    original = Trainer.train
    try:  # interrupt after the first epoch's checkpoint, at the second epoch's eval
        Trainer.train = lambda self, resume, on_eval=None: original(self, resume, stop_after_first_epoch)
        with pytest.raises(Interrupt):
            add_heads(tiny_folder, "tiny", [data], tmp_path / "resumed", TrainSettings(**SMALL), tmp_path / "home2")
    finally:
        Trainer.train = original
    assert not (tmp_path / "resumed").exists()  # nothing half-written
    assert not list(tmp_path.glob(".resumed*"))
    [checkpoint] = (tmp_path / "home2").rglob("checkpoint.safetensors")
    kept = checkpoint.read_bytes()  # a checkpoint of other tensors (an earlier mtpctl's names): one clear line
    save_file({("model.renamed" if k.startswith("model.") else k) + str(i): v
               for i, (k, v) in enumerate(load_file(str(checkpoint)).items())}, str(checkpoint))
    with pytest.raises(BadInput, match="another set of trained tensors"):
        add_heads(tiny_folder, "tiny", [data], tmp_path / "resumed", TrainSettings(**SMALL), tmp_path / "home2",
                  resume=True)
    checkpoint.write_bytes(kept)
    add_heads(tiny_folder, "tiny", [data], tmp_path / "resumed", TrainSettings(**SMALL), tmp_path / "home2",
              resume=True)
    straight, resumed = read_heads(tmp_path / "straight"), read_heads(tmp_path / "resumed")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


@pytest.mark.slow
def test_two_ddp_processes_agree_with_one(tiny_folder, tmp_path, monkeypatch):
    """torchrun --nproc-per-node 2 (gloo, CPU): each rank takes half of every batch and DDP averages the
    gradients, so the result equals a single process on the whole batch (up to float summation order)."""
    data = write_data(tmp_path)
    args = ["add-heads", "-m", str(tiny_folder), "--data", str(data), "--self-distill", "--num-heads", "2",
            "--response-tokens", "16", "--epochs", "2", "--batch-tokens", "64", "--tree-nodes", "4", "--lr", "3e-3"]
    env = {**os.environ, "MTPCTL_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    ddp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "mtpctl.cli.main", *args, "--out", str(tmp_path / "ddp")],
                         env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert ddp.returncode == 0, ddp.stderr[-2000:]
    monkeypatch.setenv("MTPCTL_HOME", str(tmp_path / "home"))
    assert main([*args, "--out", str(tmp_path / "single")]) == 0
    one, two = read_heads(tmp_path / "single"), read_heads(tmp_path / "ddp")
    for name in one:
        assert torch.allclose(one[name], two[name], atol=1e-4), name


def test_data_errors_are_clear(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n\n")
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "ok"}\n{not json\n')
    for path, words in [(empty, "holds no text"), (latin, "not UTF-8"), (broken, "broken.jsonl:2"),
                        (tmp_path / "missing.txt", "cannot read")]:
        with pytest.raises(BadInput, match=words):
            read_records([path])


def run_cli(args, capsys):
    code = main(args)
    return code, capsys.readouterr().err


def test_cli_bad_input_exits_2_with_one_line(tiny_folder, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MTPCTL_HOME", str(tmp_path / "home"))
    data = write_data(tmp_path)
    base = ["add-heads", "-m", str(tiny_folder), "--data", str(data), "--self-distill"]
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    (tmp_path / "exists").mkdir()
    for args, words in [
        (base + ["--num-heads", "0", "--out", str(tmp_path / "a")], "num-heads must be at least 1"),
        (["add-heads", "-m", str(tiny_folder), "--data", str(empty), "--out", str(tmp_path / "b")], "holds no text"),
        (base + ["--out", str(tmp_path / "exists")], "already exists"),
        (["add-heads", "-m", str(tiny_folder), "--data", str(data), "--out", str(tmp_path / "c")], "--self-distill"),
    ]:
        code, err = run_cli(args, capsys)
        assert code == 2, err
        lines = [line for line in err.splitlines() if line.startswith("mtpctl: error:")]
        assert len(lines) == 1 and words in lines[0] and "Traceback" not in err


def test_no_flags_turn_a_recipes_on_settings_off(tiny_folder, tmp_path, capsys, monkeypatch):
    """A recipe's on/off settings are overridden by the --no- forms (recipe heads that are
    token-conditioned cannot go to vLLM's layout; --no-condition-on-token makes ones that can)."""
    monkeypatch.setenv("MTPCTL_HOME", str(tmp_path / "home"))
    data = write_data(tmp_path)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"version: 1\nmodel: {tiny_folder}\ndata: [{data.name}]\nsettings:\n"
                      "  condition_on_token: true\n  self_distill: true\n  num_heads: 2\n  response_tokens: 8\n"
                      "  epochs: 0.2\n")
    for extra, conditioned in (([], True), (["--no-condition-on-token"], False)):
        out = tmp_path / f"heads-{conditioned}"
        assert main(["add-heads", "--recipe", str(recipe), "--out", str(out), *extra]) == 0
        assert HeadsConfig.load(out).token_conditioned is conditioned
    code, err = run_cli(["add-heads", "--recipe", str(recipe), "--no-self-distill", "--out", str(tmp_path / "x")], capsys)
    assert code == 2 and "--self-distill" in err


def test_generate_with_heads_end_to_end(tiny_folder, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MTPCTL_HOME", str(tmp_path / "home"))
    data = write_data(tmp_path)
    heads = tmp_path / "heads"
    code = main(["add-heads", "-m", str(tiny_folder), "--data", str(data), "--self-distill", "--num-heads", "2",
                 "--response-tokens", "12", "--epochs", "1", "--tree-nodes", "3", "--out", str(heads)])
    assert code == 0
    capsys.readouterr()
    plain_args = ["generate", "-m", str(tiny_folder), "--max-new-tokens", "24", "--json", "count: 3 4"]
    assert main(plain_args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(plain_args + ["--speculate", "heads", "--heads", str(heads)]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == plain["token_ids"] and spec["stats"]["draft_tokens"] > 0
    deep = tmp_path / "deep.yaml"
    deep.write_text("[[0], [0, 0], [0, 0, 0]]\n")
    (tmp_path / "other").mkdir()
    HeadsConfig.load(heads)  # sanity: a real head folder
    cfg = json.loads((heads / "mtp_config.json").read_text())
    cfg["target_hash"] = "0" * 64
    other = tmp_path / "other"
    (other / "mtp_config.json").write_text(json.dumps(cfg))
    (other / "mtp_heads.safetensors").write_bytes((heads / "mtp_heads.safetensors").read_bytes())
    for kind in ("hydra", "eagle", "eagle3"):  # heads that draft level by level: torch backend only
        folder = tmp_path / kind
        assert main(["add-heads", "-m", str(tiny_folder), "--data", str(data), "--self-distill", "--num-heads", "2",
                     "--response-tokens", "12", "--epochs", "1", "--kind", kind, "--out", str(folder)]) == 0
        cfg = HeadsConfig.load(folder)
        assert cfg.kind == kind and (cfg.token_conditioned if kind == "hydra" else cfg.layer is not None)
        assert len(cfg.topk_accuracy) == 2 and cfg.training["held_out_top1"]
        capsys.readouterr()
        for speculate in ("heads", "heads+ngram"):
            assert main(plain_args + ["--speculate", speculate, "--heads", str(folder), "--tree-nodes", "4"]) == 0
            assert json.loads(capsys.readouterr().out)["token_ids"] == plain["token_ids"]
        assert main(["export", str(tiny_folder), "--heads", str(folder), "--onnx", str(tmp_path / "x")]) == 2
        assert f"{kind} heads" in capsys.readouterr().err
    wide = tmp_path / "wide.yaml"
    wide.write_text("[[300]]\n")  # the tiny vocabulary has 259 tokens
    for extra, words in [(["--tree", str(deep)], "3 deep"), (["--heads", str(other)], "another model"),
                         (["--tree", str(wide)], "rank 300")]:
        args = plain_args + ["--speculate", "heads"] + (["--heads", str(heads)] if "--heads" not in extra else []) + extra
        assert main(args) == 2
        assert words in capsys.readouterr().err


def test_an_unreachable_hub_dataset_is_one_clear_error(tiny_folder, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MTPCTL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as on a machine without the hub
    code, err = run_cli(["add-heads", "-m", str(tiny_folder), "--data", "hf://datasets/someone/chats",
                         "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and "cannot download dataset 'someone/chats'" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_a_tree_deeper_than_verification_supports_is_bad_input(tiny_folder):
    from mtpctl.backends.torch import TorchSession
    from mtpctl.decode.attention import MAX_DRAFT_DEPTH as most
    from mtpctl.drafters.build import LoadedHeads, heads_drafter
    from mtpctl.drafters.heads.tree import StaticTree

    session = TorchSession(tiny_folder)
    cfg = HeadsConfig("medusa", 40, 0, False, session.model.cfg.hidden_size, session.model.cfg.vocab_size)
    heads = LoadedHeads(cfg, MedusaHeads(cfg))
    deep = StaticTree.from_paths([[0] * d for d in range(1, 41)], 40)
    with pytest.raises(BadInput, match=f"up to {most}"):
        heads_drafter(session, heads, deep)
    assert heads_drafter(session, heads, StaticTree.from_paths([[0] * d for d in range(1, most + 1)], 40)).tree.depth == most


def test_settings_name_the_bad_dtype():
    for name in ("distill_dtype", "features_dtype"):
        with pytest.raises(BadInput, match=name.replace("_", " ")):
            TrainSettings(**{name: "float16"}).check()


def test_max_seq_len_below_two_tokens_is_bad_input():
    """A training sequence needs two tokens: max_seq_len 1 cut every prompt to nothing and the batched
    greedy prefill failed with an IndexError instead of a one-line error."""
    with pytest.raises(BadInput, match="max-seq-len must be at least 2, got 1"):
        TrainSettings(max_seq_len=1).check()
    with pytest.raises(BadInput, match="max-seq-len must be at least 2, got 0"):
        TrainSettings(max_seq_len=0).check()
    TrainSettings(max_seq_len=2).check()


def test_kept_features_are_cut_with_their_sequences(tiny_folder):
    """Text and prompt records mixed, max_seq_len cutting prompt + response: the kept hidden states and
    argmax tokens are cut alike, stay in sequence order and equal a teacher-forced pass over the same ids."""
    from mtpctl.train.distill import TrainSequence
    from mtpctl.train.features import build_sequences, compute_features
    from mtpctl.model.decoder import Decoder
    from mtpctl.model.tokenizer import TextCodec

    codec = TextCodec(tiny_folder)
    model = Decoder.from_folder(tiny_folder, torch.float32)
    records = [Record(text="abc " * 20), Record(messages=[{"role": "user", "content": "hi"}]),
               Record(text="de"), Record(messages=[{"role": "user", "content": "x" * 20}, {"role": "assistant", "content": "y"},
                                                   {"role": "user", "content": "z"}])]
    settings = TrainSettings(self_distill=True, response_tokens=12, distill_batch=2, distill_dtype="float32",
                             features_dtype="float32", max_seq_len=30)
    seqs = build_sequences(records, codec, settings, lambda: model)
    assert [s.hidden is None for s in seqs] == [True, True, False, False]  # texts first, then the prompts
    prompt_lens = [len(codec.encode_messages(r.messages)) for r in records if r.messages]
    assert [s.loss_from for s in seqs[2:]] == [min(n, 29) for n in prompt_lens]
    assert len(seqs[3].ids) == 30 and seqs[3].loss_from == 29  # the prompt cut to 29 tokens, its response to 1
    for s in seqs:
        assert s.hidden is None or (s.hidden.shape[0] == len(s.ids) == s.pred.shape[0])
    got = compute_features(model, seqs, settings)
    ref = compute_features(model, [TrainSequence(s.ids, s.loss_from) for s in seqs], settings)
    assert torch.equal(got.offsets, ref.offsets) and torch.equal(got.ids, ref.ids)
    assert got.pred.tolist() == ref.pred.tolist()
    torch.testing.assert_close(got.hidden.float(), ref.hidden.float(), atol=0.05, rtol=0.01)
    # labels line up: on every response position but the last, pred[t] is the token at t + 1
    for s in seqs[2:]:
        assert s.pred[s.loss_from - 1:-1].tolist() == s.ids[s.loss_from:]


@pytest.mark.parametrize("tau, warned", [(1.02, True), (1.15, True), (1.6, False)])
def test_heads_that_predict_little_get_a_warning(tiny_folder, tmp_path, capsys, monkeypatch, tau, warned):
    """A run whose heads learned nothing stored its tree silently; generate with it is slower
    than plain decoding. The summary's expected tau now decides a warning on stderr (stdout stays JSON)."""
    import mtpctl.cli.add_heads as cli_module

    summary = {"held_out_top1": [0.01, 0.0], "expected_tau": tau, "held_out": 40}
    monkeypatch.setattr(cli_module, "add_heads", lambda *a, **k: summary)
    monkeypatch.setenv("MTPCTL_HOME", str(tmp_path / "home"))
    data = write_data(tmp_path)
    code = main(["add-heads", "-m", str(tiny_folder), "--data", str(data), "--self-distill", "--json",
                 "--out", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert code == 0 and json.loads(out) == summary
    assert ("these heads predict little" in err) is warned


def test_self_distillation_stops_at_the_models_context():
    """A prompt plus --response-tokens past max_position_embeddings (128 here) was an internal
    error (IndexError in the rotary table); a response now ends where the context does."""
    model = random_decoder(seed=2)
    ctx = model.cfg.max_position_embeddings
    prompts = [[5, 6, 7], list(range(1, 101))]
    got = batch_greedy(model, prompts, 200, eos_ids=set(), batch_size=2)
    assert [len(d.response) for d in got] == [ctx - 100, ctx - 100]  # the batch stops with its longest prompt
    for prompt, d in zip(prompts, got):
        assert d.response == greedy_reference(model, prompt, len(d.response))


def test_add_heads_fits_sequences_to_the_models_context(tiny_folder, tmp_path):
    """max_seq_len (512) and response_tokens (128) by default, on a model of 128 positions: a
    long text record or a long self-distilled response was an internal error; sequences are cut to the
    context instead."""
    data = write_data(tmp_path)
    with data.open("a") as f:
        f.write(json.dumps({"text": "0123456789 " * 40}) + "\n")  # 440 bytes: 440 tokens past the context
    summary = add_heads(tiny_folder, "tiny", [data], tmp_path / "out", TrainSettings(**{**SMALL, "response_tokens": 128}),
                        tmp_path / "home")
    assert summary["settings"]["max_seq_len"] == 128 and summary["positions"] > 0


def test_no_held_out_data_is_said_plainly(tiny_folder, tmp_path, capsys, monkeypatch):
    """With nothing held out, the figures are 0 because nothing was measured, not because the
    heads are bad; the warning says so instead of "predict little"."""
    import mtpctl.cli.add_heads as cli_module

    monkeypatch.setattr(cli_module, "add_heads", lambda *a, **k: {"held_out_top1": [0.0], "expected_tau": 1.0,
                                                                   "held_out": 0})
    monkeypatch.setenv("MTPCTL_HOME", str(tmp_path / "home"))
    code = main(["add-heads", "-m", str(tiny_folder), "--data", str(write_data(tmp_path)), "--self-distill",
                 "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 0 and "no sequence was held out" in err and "predict little" not in err
    assert "(no held-out figures)" in err and "held-out top-1 per head" not in err


def test_add_heads_measures_tau_on_held_out_prompts(tiny_folder, tmp_path):
    """The head folder records the tau its heads reach decoding held-out prompts (greedy, every step drafting),
    equal to what the library measures decoding those prompts with the folder itself, and the outputs equal
    plain decoding; a run resumed with another measure_prompts reuses the checkpoint (no training)."""
    import mtpctl

    data = write_data(tmp_path)
    settings = TrainSettings(**{**SMALL, "holdout": 0.3, "measure_prompts": 3})
    summary = add_heads(tiny_folder, "tiny", [data], tmp_path / "out", settings, tmp_path / "home")
    measured = HeadsConfig.load(tmp_path / "out").training["measured"]
    assert measured == summary["measured"]
    assert measured["prompts"] == 3 and measured["policy"] == "always" and measured["dtype"] == "bfloat16"
    assert measured["tree_nodes"] == settings.tree_nodes
    assert measured["same_as_plain"] == {"heads": "3/3", "heads+ngram": "3/3"}
    # the same prompts decoded one at a time by the library with the written folder
    prompts = _held_out_prompt_ids(tmp_path / "home", settings)
    for method in ("heads", "heads+ngram"):
        llm = mtpctl.load(str(tiny_folder), speculate=method, heads=str(tmp_path / "out"), dtype="bfloat16",
                          speculate_policy="always", tree_nodes=settings.tree_nodes)
        steps = committed = 0
        for ids in prompts:
            stats = llm.pipeline.generate(ids, settings.response_tokens).stats
            steps, committed = steps + stats.decode_steps, committed + sum(stats.accepted_per_step)
        assert measured["tau"][method] == round(committed / steps, 3)
        assert measured["tau"][method] >= 1.0
    again = add_heads(tiny_folder, "tiny", [data], tmp_path / "out", TrainSettings(**{**vars(settings),
                      "measure_prompts": 0}), tmp_path / "home", resume=True, overwrite=True)
    assert "measured" not in again and "measured" not in HeadsConfig.load(tmp_path / "out").training
    assert again["history"] == summary["history"]  # the checkpoint's: nothing trained again


def _held_out_prompt_ids(home, settings):
    """The held-out prompts of a finished run, read back through the trainer's own split."""
    from mtpctl.train.measure import held_out_prompts
    from mtpctl.train.shards import ShardedFeatures, Manifest

    feats = [p for p in (Path(home) / "work").glob("features-*") if Manifest.load(p) is not None]
    assert len(feats) == 1
    store = ShardedFeatures(feats[0], Manifest.load(feats[0]))
    n = store.num_sequences
    split = torch.randperm(n, generator=torch.Generator().manual_seed(settings.seed)).tolist()
    n_eval = max(1, int(round(settings.holdout * n)))
    return held_out_prompts(store, sorted(split[:n_eval]), settings.measure_prompts)


def test_a_failed_measurement_keeps_the_trained_heads(tiny_folder, tmp_path, monkeypatch):
    """The measurement comes last: an error in it is recorded in the config, the folder is still written."""
    import mtpctl.train.add_heads as module

    def fail(*args, **kwargs):
        raise BadInput("no such drafter here")

    monkeypatch.setattr(module, "measure_tau", fail)
    summary = add_heads(tiny_folder, "tiny", [write_data(tmp_path)], tmp_path / "out",
                        TrainSettings(**{**SMALL, "holdout": 0.3}), tmp_path / "home")
    assert summary["measured"] == {"error": "no such drafter here"}
    assert HeadsConfig.load(tmp_path / "out").training["measured"] == {"error": "no such drafter here"}
    assert (tmp_path / "out" / "mtp_heads.safetensors").is_file()


def test_a_dynamic_tree_needs_eagle_heads(tiny_folder, tmp_path, capsys, monkeypatch):
    """--dynamic-tree drafts EAGLE-2's tree with EAGLE kinds only: with Medusa heads, or without the
    heads drafter, it is one error line and exit 2."""
    monkeypatch.setenv("MTPCTL_HOME", str(tmp_path / "home"))
    add_heads(tiny_folder, "tiny", [write_data(tmp_path)], tmp_path / "medusa", TrainSettings(**SMALL),
              tmp_path / "home")
    base = ["generate", "-m", str(tiny_folder), "--max-new-tokens", "4", "--dynamic-tree"]
    for extra, words in ((["--speculate", "heads", "--heads", str(tmp_path / "medusa")], "not by medusa heads"),
                         (["--speculate", "ngram"], "goes with the heads drafter")):
        assert main([*base, *extra, "hello"]) == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("mtpctl: error:")]
        assert len(lines) == 1 and words in lines[0] and "--dynamic-tree" in lines[0]
