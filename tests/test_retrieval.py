"""Retrieval drafting (REST): suffix lookup in a datastore, exact draft trees, strict loading, and
lossless greedy decoding with the retrieval tree merged into heads+ngram."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from mtpctl.cli.main import main
from mtpctl.errors import BadInput
from mtpctl.drafters.retrieval import DATASTORE_FILE, Datastore, RetrievalDrafter

SEQS = [[1, 2, 3, 4, 6], [1, 2, 3, 5], [7, 2, 3, 4, 6], [8, 2, 3, 4, 9]]


def test_match_finds_every_occurrence_of_a_suffix():
    store = Datastore.from_sequences(SEQS, key_len=6)
    lo, hi = store.match([2, 3])
    assert hi - lo == 4
    assert sorted(store.keys[lo:hi, 2].tolist()) == [4, 4, 4, 5]
    lo, hi = store.match([3, 4, 6])
    assert hi - lo == 2
    lo, hi = store.match([4, 5])  # never occurs
    assert lo == hi


def test_tree_holds_the_most_frequent_continuations_of_the_longest_match():
    drafter = RetrievalDrafter(Datastore.from_sequences(SEQS, key_len=6), max_match=3, depth=3)
    # "0 2 3" does not occur, "2 3" does (4 times): continuations 4 6 | 5 | 4 6 | 4 9
    draft = drafter.propose([0, 2, 3], 4)  # most frequent first: 4 (x3), 4 6 (x2), 5 (x1), 4 9 (x1)
    assert draft.tokens == [3, 4, 6, 5, 9] and draft.parents == [-1, 0, 1, 0, 1]  # rooted at the pending 3
    for k in range(1, 4):  # a smaller draft is the first k nodes of the larger one (the policy's cuts)
        cut = drafter.propose([0, 2, 3], k)
        assert cut.tokens == draft.tokens[:k + 1] and cut.parents == draft.parents[:k + 1]
    # a longer match narrows the continuations: "7 2 3" occurs once
    assert drafter.propose([7, 2, 3], 4).tokens[1:] == [4, 6]


def test_no_match_crosses_a_sequence_end_and_separators_are_never_proposed():
    drafter = RetrievalDrafter(Datastore.from_sequences([[1, 2], [3, 4]], key_len=4), max_match=2, depth=2)
    draft = drafter.propose([2, 3], 4)  # "2 3" spans two sequences: only "3" matches
    assert draft.tokens == [3, 4] and draft.parents == [-1, 0]
    assert drafter.propose([5], 4).tokens == [5]  # nothing matches: the root alone
    assert drafter.propose([2], 4).tokens == [2]  # "2" ends its sequence: no continuation


def test_min_share_leaves_rare_continuations_out():
    store = Datastore.from_sequences(SEQS, key_len=6)
    assert 5 not in RetrievalDrafter(store, max_match=2, depth=2, min_share=0.5).propose([2, 3], 8).tokens
    assert 5 in RetrievalDrafter(store, max_match=2, depth=2).propose([2, 3], 8).tokens


def test_bad_settings_are_refused():
    store = Datastore.from_sequences(SEQS, key_len=6)
    with pytest.raises(ValueError):
        RetrievalDrafter(store, max_match=4, depth=4)  # 8 > key length 6
    with pytest.raises(ValueError):
        RetrievalDrafter(store, max_match=1, min_match=2)
    with pytest.raises(ValueError):
        Datastore.from_sequences([[]])


def test_datastore_round_trip_and_strict_loading(tmp_path):
    path = tmp_path / DATASTORE_FILE
    store = Datastore.from_sequences(SEQS)
    store.save(path)
    loaded = Datastore.load(path, vocab_size=10)
    assert np.array_equal(loaded.keys, store.keys)
    with pytest.raises(BadInput, match="another model"):
        Datastore.load(path, vocab_size=8)  # token 9 is outside an 8-token vocabulary
    save_file({"tokens": torch.tensor([1, 2, -1]), "extra": torch.zeros(1)}, str(path))
    with pytest.raises(BadInput, match="exactly one tensor"):
        Datastore.load(path, 10)
    save_file({"tokens": torch.zeros(2, 2, dtype=torch.int32)}, str(path))
    with pytest.raises(BadInput, match="1-D"):
        Datastore.load(path, 10)
    path.write_bytes(b"not safetensors")
    with pytest.raises(BadInput, match="cannot read"):
        Datastore.load(path, 10)


def test_retrieval_merged_with_heads_and_ngram_is_lossless(capsys, tiny_folder, tmp_path):
    """A datastore of the tiny model's own greedy output makes the retrieval tree accept tokens; greedy
    decoding with it (alone and merged) still writes plain greedy's tokens."""
    prompts = ["Tell me a story about a cat", "What is 2 + 2?", "List three colours"]
    base = ["generate", "-m", str(tiny_folder), "--max-new-tokens", "24", "--json"]
    plain = []
    for p in prompts:
        assert main(base + [p]) == 0
        plain.append(json.loads(capsys.readouterr().out))
    from mtpctl.model.tokenizer import TextCodec

    codec = TextCodec(tiny_folder)
    seqs = [codec.encode_messages([{"role": "user", "content": p}]) + r["token_ids"] for p, r in zip(prompts, plain)]
    store_path = tmp_path / DATASTORE_FILE
    Datastore.from_sequences(seqs).save(store_path)
    for spec in ("retrieval", "ngram+retrieval"):
        for p, ref in zip(prompts, plain):
            assert main(base + ["--speculate", spec, "--datastore", str(store_path), p]) == 0
            out = json.loads(capsys.readouterr().out)
            assert out["token_ids"] == ref["token_ids"]
            assert out["stats"]["tau"] > 1.5  # the datastore holds this very output: most drafts accepted


@pytest.mark.parametrize("args, fragment", [
    (["--speculate", "retrieval"], "needs a datastore file, or a head folder that carries one (--datastore)"),
    (["--speculate", "heads+bogus"], "unknown drafter"),
    (["--speculate", "ngram+ngram"], "unknown drafter"),
    (["--speculate", "draft+ngram"], "needs a draft model"),  # draft merges since issue 21; it needs --draft
    (["--speculate", "ngram", "--datastore", "x.safetensors"], "goes with the retrieval drafter (--datastore)"),
    (["--speculate", "ngram", "--retrieval-nodes", "5"], "goes with the retrieval drafter (--retrieval-nodes)"),
    (["--speculate", "retrieval", "--datastore", "missing.safetensors"], "no retrieval datastore"),
])
def test_bad_retrieval_arguments(capsys, tiny_folder, args, fragment):
    assert main(["generate", "-m", str(tiny_folder), *args, "Hi"]) == 2
    err = capsys.readouterr().err
    assert fragment in err and len(err.strip().splitlines()) == 1
