"""Retrieval datastores and their options: a head folder without a drafter that reads it, datastores
made for another model (by their ids or their recorded vocabulary), empty datastores, and the
datastore add-heads writes decoding losslessly."""

import pytest
import torch
from safetensors.torch import save_file

from mtpctl.cli.main import main
from mtpctl.errors import BadInput
from mtpctl.drafters.heads.config import HeadsConfig
from mtpctl.drafters.retrieval import DATASTORE_FILE, Datastore


def heads_folder(folder, vocab: int):
    """A head folder (config only) made for a model of ``vocab`` tokens, carrying a datastore whose
    ids (1..4) fit any vocabulary."""
    folder.mkdir(parents=True)
    HeadsConfig(kind="medusa", num_heads=2, head_layers=1, own_lm_head=False, hidden_size=64, vocab_size=vocab,
                target="other", target_hash="0" * 64, tree=[[0]], topk_accuracy=[[0.5]] * 2).save(folder)
    Datastore.from_sequences([[1, 2, 3, 4]]).save(folder / DATASTORE_FILE)
    return folder


@pytest.mark.parametrize("speculate", ["none", "ngram"])
def test_heads_without_a_drafter_that_uses_them_is_refused(capsys, tiny_folder, tmp_path, speculate):
    """A head folder no drafter of the spec reads is refused, not ignored."""
    heads = heads_folder(tmp_path / "heads", 259)
    assert main(["generate", "-m", str(tiny_folder), "--speculate", speculate, "--heads", str(heads), "Hi"]) == 2
    err = capsys.readouterr().err
    assert "a head folder goes with the heads or retrieval drafters (--heads)" in err and len(err.strip().splitlines()) == 1


def test_the_datastore_of_heads_for_another_vocabulary_is_refused(capsys, tiny_folder, tmp_path):
    """Ids 1..4 fit the tiny vocabulary (259), but the heads (and their datastore) were made for a
    model of 1000 tokens: another model (e.g. SmolLM2's datastore on Gemma 3, whose vocabulary holds
    every SmolLM2 id)."""
    args = ["generate", "-m", str(tiny_folder), "--max-new-tokens", "2", "--speculate", "retrieval", "--heads"]
    assert main(args + [str(heads_folder(tmp_path / "other", 1000)), "Hi"]) == 2
    err = capsys.readouterr().err
    assert "vocabulary 1000" in err and len(err.strip().splitlines()) == 1
    assert main(args + [str(heads_folder(tmp_path / "same", 259)), "Hi"]) == 0


def test_a_recorded_vocabulary_size_must_match(tmp_path):
    path = tmp_path / DATASTORE_FILE
    Datastore.from_sequences([[1, 2, 3]]).save(path, vocab_size=1000)
    with pytest.raises(BadInput, match="vocabulary 1000.*another model"):
        Datastore.load(path, vocab_size=259)
    assert len(Datastore.load(path, vocab_size=1000)) == 3
    Datastore.from_sequences([[1, 2, 3]]).save(path)  # no record (older files): ids checked only
    assert len(Datastore.load(path, vocab_size=259)) == 3


def test_a_datastore_without_tokens_is_refused(tmp_path):
    path = tmp_path / DATASTORE_FILE
    save_file({"tokens": torch.tensor([-1, -1], dtype=torch.int32)}, str(path))
    with pytest.raises(BadInput, match="holds no tokens"):
        Datastore.load(path, vocab_size=259)


def test_add_heads_datastore_records_the_vocabulary_and_drafts_losslessly(capsys, tiny_folder, tmp_path, monkeypatch):
    """The datastore add-heads writes (bfloat16 self-distillation, the default) carries the target's
    vocabulary size, and heads+ngram+retrieval over it writes plain greedy's tokens in bfloat16."""
    import json

    monkeypatch.setenv("MTPCTL_HOME", str(tmp_path / "home"))
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"count: {i} {i + 1} {i + 2}"}) + "\n" for i in range(16)))
    heads = tmp_path / "heads"
    assert main(["add-heads", "-m", str(tiny_folder), "--data", str(data), "--self-distill", "--num-heads", "2",
                 "--response-tokens", "12", "--epochs", "1", "--tree-nodes", "3", "--out", str(heads)]) == 0
    from safetensors import safe_open

    with safe_open(str(heads / DATASTORE_FILE), framework="pt") as handle:
        assert handle.metadata() == {"vocab_size": "259"}
    capsys.readouterr()
    base = ["generate", "-m", str(tiny_folder), "--dtype", "bfloat16", "--max-new-tokens", "24", "--json", "count: 3 4"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(base + ["--speculate", "heads+ngram+retrieval", "--heads", str(heads), "--retrieval-nodes", "6"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == plain["token_ids"] and spec["stats"]["draft_tokens"] > 0
