"""A draft model merged with other drafters on tiny models: specs in merge order; the hybrid tree
grafts the heads' candidates under the draft chain's nodes; heads+draft, draft+ngram and
heads+draft+ngram are plain greedy alone and batched; a draft model inside a merge drafts greedily
and the merged tree keeps the target's distribution when sampling; missing settings are one error."""

import json
from collections import Counter

import pytest

from helpers import (PROMPT, assert_one_line_exit_2, cli, exact_sequence_probs, generate_plain_and, greedy_reference,
                     random_decoder, random_heads, run, tiny_hydra_folder)
from mtpctl.backends.torch import TorchEngine, TorchSession, verify_packed
from mtpctl.decode.drafter import TargetStep
from mtpctl.decode.loop import Request, run as run_requests
from mtpctl.decode.sampling import SamplingParams
from mtpctl.decode.stopping import StopChecker
from mtpctl.drafters.build import DraftOptions, build, draft_member, parse
from mtpctl.drafters.draft_model import DraftModelDrafter
from mtpctl.drafters.heads.medusa import MedusaDrafter
from mtpctl.drafters.heads.tree import StaticTree
from mtpctl.drafters.hybrid import HybridDrafter
from mtpctl.drafters.lookahead import LookaheadDrafter, LookaheadSettings
from mtpctl.drafters.merged import MergedDrafter
from mtpctl.drafters.ngram import NgramDrafter
from mtpctl.drafters.self_draft import layer_subset
from mtpctl.errors import BadInput
from stats_util import chi_square_rejects


def test_specs_name_their_parts_in_merge_order():
    assert parse("ngram+draft+heads") == ("heads", "draft", "ngram")
    assert parse("lookahead+ngram") == ("ngram", "lookahead")
    assert parse("retrieval+lookahead+draft") == ("draft", "retrieval", "lookahead")
    for bad in ("draft+draft", "none+draft", "drafts"):
        with pytest.raises(BadInput, match="unknown drafter"):
            parse(bad)


@pytest.fixture(scope="module")
def model():
    return random_decoder(seed=3, num_hidden_layers=4)


def heads_drafter(model):
    return MedusaDrafter(StaticTree.from_paths([[0], [1], [0, 0], [0, 1]], 3), random_heads(model, num_heads=3), model)


def self_draft(model, layers=(0, 1, 3), draft_len=3):
    return DraftModelDrafter(layer_subset(model, layers), model.cfg.vocab_size, draft_len=draft_len)


def test_the_hybrid_grafts_the_heads_candidates_under_the_chain(model):
    """Under the chain's node at depth d (d below the heads' tree's depth: the heads it runs) hang head
    d+1's top-2 candidates; the heads' own tree hangs under the root."""
    heads = heads_drafter(model)
    hybrid = HybridDrafter(heads, self_draft(model), graft=2)
    engine = TorchEngine(model, 64)
    out = engine.prefill(PROMPT)
    pending = int(out[0].argmax())
    last = TargetStep(out, 0)
    tree = hybrid.propose(PROMPT + [pending], hybrid.budget, last)
    top = heads.logits(last, pending).topk(2, dim=-1).indices.tolist()  # [tree depth 2, 2]
    chain = self_draft(model).propose(PROMPT + [pending], 3).tokens[1:]
    node = 0
    for depth, token in enumerate(chain, 1):
        node = tree.child(node, token)
        assert node is not None
        if depth < len(top):
            assert all(tree.child(node, t) is not None for t in top[depth])
    assert tree.child(0, top[0][0]) is not None and tree.child(0, top[0][1]) is not None
    assert len(top) == 2 and tree.drafted <= hybrid.budget == 4 + 3 + 2 * 1


@pytest.mark.parametrize("kind", ["heads+draft", "draft+ngram", "heads+draft+ngram", "draft+lookahead"])
def test_merged_draft_models_are_plain_greedy_alone_and_batched(model, kind):
    members = {"heads+draft": lambda: [HybridDrafter(heads_drafter(model), self_draft(model))],
               "draft+ngram": lambda: [self_draft(model), NgramDrafter(3, 1, 3)],
               "heads+draft+ngram": lambda: [HybridDrafter(heads_drafter(model), self_draft(model, draft_len=None)),
                                             NgramDrafter(3, 1, 3)],
               "draft+lookahead": lambda: [self_draft(model), LookaheadDrafter(LookaheadSettings(3, 3, 2))]}[kind]()
    drafter = members[0] if len(members) == 1 else MergedDrafter(members)
    assert run(model, drafter).token_ids == greedy_reference(model, PROMPT, 40)
    prompts = [PROMPT, [5, 17, 42, 99], [9, 8, 7, 9, 8, 7, 9, 8], [77]]
    news = [30, 17, 25, 12]
    requests = [Request(p, StopChecker([], [], n, lambda ids: ""), SamplingParams(), drafter.fork())
                for p, n in zip(prompts, news)]
    outcomes = run_requests(requests, lambda r: TorchEngine(model, len(r.prompt_ids) + r.stop.max_new_tokens
                                                            + drafter.budget + 1), verify_packed, max_batch=3)
    assert [o.token_ids for o in outcomes] == [greedy_reference(model, p, n) for p, n in zip(prompts, news)]
    assert sum(o.stats.accepted_tokens for o in outcomes) > 0


def test_a_merged_draft_model_keeps_the_target_distribution():
    """draft+ngram sampled: the draft model drafts greedily inside the merge (deterministic
    candidates); the first 3 tokens follow the exact distribution of plain sampling."""
    model = random_decoder(seed=5, vocab=5, max_pos=32)
    prompt, n = [1, 2, 1, 2, 1], 3
    params = SamplingParams(temperature=1.0, top_k=4)
    drafter = MergedDrafter([DraftModelDrafter(layer_subset(model, (1,)), 5, draft_len=2), NgramDrafter(2, 1, 2)])
    counts, drafted = Counter(), 0
    for seed in range(1000):
        result = run(model, drafter, max_new=n + 1, sampling=SamplingParams(1.0, 4, 1.0, seed), prompt=prompt)
        counts[tuple(result.token_ids[:n])] += 1
        drafted += result.stats.draft_tokens
    assert drafted >= 2000
    assert not chi_square_rejects(counts, exact_sequence_probs(model, prompt, n, params))
    assert chi_square_rejects(counts, exact_sequence_probs(model, prompt, n, SamplingParams(temperature=0.5)))


@pytest.fixture(scope="module")
def tiny_session(tiny_folder):
    return TorchSession(tiny_folder)


def test_a_draft_model_inside_a_merge_drafts_greedily(tiny_session):
    sampled = SamplingParams(temperature=0.8, seed=1)
    alone = build(tiny_session, "draft", DraftOptions(draft_model="self:0"), sampled)
    merged = build(tiny_session, "draft+ngram", DraftOptions(draft_model="self:0"), sampled)
    assert not alone.sampling.greedy and isinstance(merged, MergedDrafter)
    assert draft_member(merged).sampling.greedy and draft_member(merged).describe()["layers"] == [0]
    with pytest.raises(ValueError, match="drafts greedily"):
        HybridDrafter(heads_drafter(tiny_session.model), alone)


def test_cli_draft_and_ngram_merge_losslessly(capsys, tiny_folder, tmp_path, monkeypatch):
    monkeypatch.setenv("MTPCTL_HOME", str(tmp_path / "home"))
    plain, spec, err = generate_plain_and(capsys, tiny_folder, "--speculate", "ngram+draft", "--draft", "self:1")
    assert spec["token_ids"] == plain["token_ids"] and spec["speculate"] == "draft+ngram"
    assert spec["draft"]["layers"] == [1] and "drafting in ids (self-draft" in err


@pytest.mark.parametrize("args, fragment", [
    (["--speculate", "heads+draft", "--draft", "self"], "needs a head folder (made by mtpctl add-heads) (--heads)"),
    (["--speculate", "heads+draft", "--heads", "nowhere"], "or self: the target's own layers) (--draft)"),
    (["--speculate", "draft+ngram", "--draft", "self:0", "--draft-len", "auto"], "not an automatic one (--draft-len)"),
])
def test_cli_merged_draft_settings_missing_are_one_line(capsys, tiny_folder, args, fragment):
    assert_one_line_exit_2(*cli(capsys, "generate", "-m", tiny_folder, *args, "hi"), fragment)


def test_bench_runs_heads_with_draft_and_lookahead(capsys, tiny_folder, tmp_path, monkeypatch):
    """heads+draft (Hydra heads: the heads' tree and the chain merge without grafts) and
    heads+lookahead from a head folder, in mtpctl bench: plain's tokens, drafts verified, and the
    self-draft adds no memory to heads+draft beyond the heads."""
    monkeypatch.setenv("MTPCTL_HOME", str(tmp_path / "home"))
    tiny_hydra_folder(tiny_folder, tmp_path / "heads")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"category": "copy", "prompt": "abc abc abc abc"}) + "\n")
    code, _, err = cli(capsys, "bench", "-m", tiny_folder, "--prompts", prompts, "--max-new-tokens", 12, "--repeats", 1,
                       "--methods", "plain,heads,draft+heads,lookahead+heads", "--heads", tmp_path / "heads",
                       "--draft", "self:1", "--json", tmp_path / "b.json")
    assert code == 0, err
    methods = {m["method"]: m for m in json.loads((tmp_path / "b.json").read_text())["methods"]}
    assert list(methods) == ["plain", "heads", "heads+draft", "heads+lookahead"]
    for name in ("heads+draft", "heads+lookahead"):
        assert methods[name]["new_tokens"] == methods["plain"]["new_tokens"] and methods[name]["acceptance_rate"] is not None
    extra = methods["heads+draft"]["peak_memory_bytes"] - methods["heads"]["peak_memory_bytes"]
    assert 0 <= extra < 16 * 1024  # a few more KV slots for the larger draft; no weights (the model's are ~360 KB)
