"""Suffix decoding (``--speculate suffix``): the suffix index's counts and eviction, the longest match,
the draft tree's shape and order, the global index shared by forks and bounded, its cache file, and
on the real SmolLM2 greedy output equal to plain decoding's, alone, merged and in a batch."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from helpers import assert_one_line_exit_2, cli  # noqa: E402

from mtpctl.drafters.suffix import (SuffixCache, SuffixDrafter, SuffixSettings, best_first, longest_match,  # noqa: E402
                                    read_cache, save_cache, vocab_fingerprint)
from mtpctl.drafters.suffix_index import GrowingIndex, SuffixIndex  # noqa: E402
from mtpctl.errors import BadInput  # noqa: E402


def brute_counts(seqs, depth):
    """Every pattern of up to ``depth`` tokens -> how many positions of ``seqs`` start it."""
    out = {}
    for s in seqs:
        for i in range(len(s)):
            for n in range(1, min(depth, len(s) - i) + 1):
                key = tuple(s[i:i + n])
                out[key] = out.get(key, 0) + 1
    return out


def random_seqs(rng, count, vocab, longest):
    return [[rng.randrange(vocab) for _ in range(rng.randint(0, longest))] for _ in range(count)]


# ---- the index


def test_index_counts_every_pattern_exactly_and_eviction_returns_them():
    rng = random.Random(0)
    for trial in range(150):
        depth = rng.randint(2, 8)
        index, held = SuffixIndex(depth), []
        for _ in range(12):
            if held and rng.random() < 0.4:
                index.evict_oldest()
                held.pop(0)
            else:
                held.append([rng.randrange(rng.randint(1, 3)) for _ in range(rng.randint(0, 14))])
                index.add(held[-1])
            assert index.paths() == brute_counts(held, depth), trial
            fresh = SuffixIndex(depth)
            for s in held:
                fresh.add(s)
            assert index.nodes == fresh.nodes, trial  # node for node the trie of what is held
            assert index.tokens == sum(map(len, held))
        while held:
            index.evict_oldest()
            held.pop(0)
        assert (index.nodes, index.tokens, index.sequences, index.paths()) == (1, 0, 0, {})


def test_repeated_text_adds_no_nodes_and_memory_is_reported():
    text = [7, 3, 9, 3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5] * 5
    index = SuffixIndex(64)
    index.add(text)
    nodes, size = index.nodes, index.nbytes()
    index.add(text)
    assert index.nodes == nodes and index.nbytes() >= size > 0
    assert index.paths()[tuple(text[:3])] == 2 * brute_counts([text], 64)[tuple(text[:3])]


def test_index_refuses_bad_token_ids_and_an_empty_evict():
    index = SuffixIndex(4)
    with pytest.raises(ValueError):
        index.add([1, -2])
    with pytest.raises(ValueError):
        index.add([1 << 31])
    with pytest.raises(ValueError):
        index.evict_oldest()


def test_growing_index_counts_match_brute_force_at_every_length():
    rng = random.Random(1)
    for trial in range(150):
        depth = rng.randint(2, 7)
        grow, seq = GrowingIndex(depth), []
        for _ in range(8):
            more = [rng.randrange(rng.randint(1, 3)) for _ in range(rng.randint(1, 4))]
            grow.extend(more)
            seq += more
            n = len(seq)
            for size in range(1, min(depth, n)):
                pattern = seq[n - size:]
                starts = [w for w in range(n - size) if seq[w:w + size] == pattern]  # with a next token
                place = grow.find(pattern)
                assert (place is None) == (not starts), trial
                if place is None:
                    continue
                assert grow.mass(place) == len(starts)
                nexts = {}
                for w in starts:
                    nexts[seq[w + size]] = nexts.get(seq[w + size], 0) + 1
                assert {t: c for t, c, _ in grow.continuations(place)} == nexts, trial


def test_longest_match_is_the_longest_suffix_with_a_continuation():
    rng = random.Random(2)
    for trial in range(100):
        seqs = random_seqs(rng, 4, 3, 12)
        index = SuffixIndex(6)
        for s in seqs:
            index.add(s)
        context = [rng.randrange(3) for _ in range(rng.randint(1, 9))]
        expected = 0
        for size in range(1, min(5, len(context)) + 1):
            pattern = context[len(context) - size:]
            if any(s[i:i + size] == pattern and i + size < len(s) and size < 6 for s in seqs for i in range(len(s))):
                expected = size
        length, place = longest_match(index, context, 5)
        assert length == expected, (trial, seqs, context)
        assert (place is None) == (expected == 0)


# ---- the draft


def hand_made_cache(**settings) -> SuffixCache:
    """Responses 1 2 3 4 5 (twice), 1 2 3 4 6, 1 2 3 7: after 1 2 3, token 4 followed 3 of 4 times and
    7 once; after 1 2 3 4, token 5 twice and 6 once."""
    cache = SuffixCache(SuffixSettings(prompt_tail=0, **settings))
    for seq in ([1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 7], [1, 2, 3, 4, 5]):
        cache.add(seq)
    return cache


def test_the_tree_is_grown_best_first_by_path_probability():
    cache = hand_made_cache()
    # match 1 2 3 (3 tokens, factor 1: 3 nodes): 4 (0.75), then 4 5 (0.5), then 7 (0.25, found before 4 6)
    tree = SuffixDrafter(cache.settings, cache).propose([9, 1, 2, 3], 8)
    assert (tree.tokens, tree.parents, tree.q) == ([3, 4, 5, 7], [-1, 0, 1, 0], None)
    nodes = best_first(cache.index, cache.index.find([1, 2, 3]), 8, 0.1)
    assert nodes == [(-1, 4, 0.75), (0, 5, 0.5), (-1, 7, 0.25), (0, 6, 0.25)]
    wide = SuffixDrafter(SuffixSettings(prompt_tail=0, factor=2.0), cache).propose([9, 1, 2, 3], 8)
    assert (wide.tokens, wide.parents) == ([3, 4, 5, 7, 6], [-1, 0, 1, 0, 1])
    sure = SuffixDrafter(SuffixSettings(prompt_tail=0, min_prob=0.3), cache).propose([9, 1, 2, 3], 8)
    assert (sure.tokens, sure.parents) == ([3, 4, 5], [-1, 0, 1])
    short = SuffixDrafter(SuffixSettings(prompt_tail=0, factor=2.0), cache).propose([9, 1, 2, 3], 2)
    assert short.tokens == [3, 4, 5]  # the first 2 nodes of the larger draft
    assert SuffixDrafter(cache.settings, cache).propose([9, 1, 2, 3], 0).tokens == [3]
    assert SuffixDrafter(cache.settings, cache).propose([8, 9], 8).tokens == [9]  # no match: no draft


def test_a_smaller_draft_is_the_first_nodes_of_a_larger_one():
    rng = random.Random(3)
    cache = SuffixCache(SuffixSettings(prompt_tail=0, factor=4.0, nodes=16))
    for s in random_seqs(rng, 30, 4, 20):
        cache.add(s)
    for _ in range(40):
        context = [rng.randrange(4) for _ in range(rng.randint(2, 12))]
        full = SuffixDrafter(cache.settings, cache).propose(context, 16)
        for k in range(len(full)):
            cut = SuffixDrafter(cache.settings, cache).propose(context, k)
            assert (cut.tokens, cut.parents) == (full.tokens[:k + 1], full.parents[:k + 1])


def test_the_request_s_own_index_drafts_what_repeats_in_its_context():
    drafter = SuffixDrafter(SuffixSettings(prompt_tail=0))
    # 5 6 7 occurred before, followed by 8 5 6 7: a chain of 3 (factor 1 x match 3), each token certain
    tree = drafter.propose([5, 6, 7, 8, 5, 6, 7], 8)
    assert (tree.tokens, tree.parents) == ([7, 8, 5, 6], [-1, 0, 1, 2])
    tree = drafter.propose([5, 6, 7, 8, 5, 6, 7, 8], 8)  # extends what it saw: the same local index
    assert tree.tokens == [8, 5, 6, 7, 8]  # match 5 6 7 8: 4 tokens


def test_local_and_global_drafts_the_one_expecting_more_tokens_wins():
    cache = hand_made_cache(factor=4.0)
    drafter = SuffixDrafter(cache.settings, cache)
    # the local index saw 1 2 3 once, followed by 0: certain, 1 token expected per node at match length 3
    local = drafter.propose([1, 2, 3, 0, 1, 2, 3], 8)
    assert local.tokens[:2] == [3, 0]
    # another request, where only the global index matches
    fresh = drafter.fork().propose([9, 1, 2, 3], 8)
    assert fresh.tokens[:3] == [3, 4, 5]


def test_forks_share_the_global_index_and_finished_responses_teach_it():
    drafter = SuffixDrafter(SuffixSettings(prompt_tail=2))
    first, second = drafter.fork(), drafter.fork()
    assert first.cache is drafter.cache is second.cache
    prompt, output = [10, 11, 12, 13], [20, 21, 22, 23, 24, 25]
    assert first.propose(prompt, 8).tokens == [13]
    first.finished(prompt, output)
    assert drafter.cache.sequences() == [[12, 13, 20, 21, 22, 23, 24, 25]]
    # the same prompt again: the global index knows what followed its last two tokens
    tree = second.propose(prompt + [20], 8)
    assert tree.tokens == [20, 21, 22, 23]  # match 12 13 20 (3 tokens, factor 1): 3 nodes


def test_a_long_response_served_again_is_drafted_a_whole_budget_at_every_step():
    """Past the index's depth the match is held short enough for the draft to fit below it: a response
    of 150 tokens served again drafts its next 8 tokens at every position, not 1 once the context's
    match would reach the depth."""
    drafter = SuffixDrafter(SuffixSettings(max_depth=32, nodes=8))
    prompt, output = list(range(1000, 1020)), list(range(2000, 2150))
    drafter.fork().finished(prompt, output)
    again = drafter.fork()
    for k in range(8, 140):
        assert again.propose(prompt + output[:k], 8).tokens[1:] == output[k:k + 8], k


def test_a_drafter_reused_without_forks_starts_over_on_another_request():
    drafter = SuffixDrafter(SuffixSettings(prompt_tail=0))
    assert drafter.propose([1, 2, 3, 1, 2], 8).tokens == [2, 3, 1]
    assert drafter.propose([4, 2, 5], 8).tokens == [5]  # 1 2 3 is not in this request: nothing to draft


def test_the_global_index_stays_within_its_node_bound_evicting_oldest_first():
    rng = random.Random(4)
    cache = SuffixCache(SuffixSettings(max_nodes=60, prompt_tail=0))
    added = []
    for _ in range(20):
        added.append([rng.randrange(50) for _ in range(10)])
        cache.add(added[-1])
        assert cache.index.nodes <= 60
    kept = cache.sequences()
    assert kept == added[len(added) - len(kept):] and 0 < len(kept) < 20
    stats = cache.stats()
    assert stats["nodes"] <= stats["max_nodes"] == 60 and stats["evicted"] == 20 - len(kept) and stats["bytes"] > 0
    cache.add(list(range(100)))  # alone above the bound: nothing is kept
    assert cache.index.nodes == 1 and cache.sequences() == []


def test_settings_out_of_range_name_their_setting(tmp_path):
    for bad, option in ((dict(max_depth=1), "suffix_depth"), (dict(min_prob=1.5), "suffix_min_prob"),
                        (dict(factor=0), "suffix_factor"), (dict(nodes=0), "suffix_nodes"),
                        (dict(max_nodes=0), "suffix_max_nodes"),
                        (dict(cache=str(tmp_path / "no" / "such" / "x.cache")), "suffix_cache")):
        with pytest.raises(BadInput) as err:
            SuffixSettings(**bad).check()
        assert err.value.option == option


# ---- the cache file


def test_cache_file_round_trip(tmp_path):
    path = tmp_path / "suffix.cache"
    cache = SuffixCache(SuffixSettings(prompt_tail=0), "fp", vocab_size=100)
    for s in ([1, 2, 3], [4, 5], [1, 2, 3, 4]):
        cache.add(s)
    cache.save(path)
    again = SuffixCache(SuffixSettings(prompt_tail=0, max_depth=8), "fp", vocab_size=100)
    again.load(path)
    assert again.sequences() == [[1, 2, 3], [4, 5], [1, 2, 3, 4]]
    assert again.index.paths() == brute_counts(again.sequences(), 8)
    empty = SuffixCache(SuffixSettings(), "fp", 100)
    empty.save(tmp_path / "empty.cache")
    assert read_cache(tmp_path / "empty.cache", "fp", 100) == []


@pytest.mark.parametrize("damage", ["another tokenizer", "truncated", "not safetensors", "ids past the vocabulary"])
def test_a_bad_cache_file_is_one_error_and_is_left_as_it_was(tmp_path, damage):
    path = tmp_path / "suffix.cache"
    cache = SuffixCache(SuffixSettings(), "fp", vocab_size=100)
    cache.add([1, 2, 3, 99])
    cache.save(path)
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:-6])
    elif damage == "not safetensors":
        path.write_bytes(b"hello, not a cache")
    before = path.read_bytes()
    fingerprint, vocab = ("other", 100) if damage == "another tokenizer" else ("fp", 100)
    if damage == "ids past the vocabulary":
        vocab = 50
    with pytest.raises(BadInput) as err:
        SuffixCache(SuffixSettings(), fingerprint, vocab).load(path)
    assert err.value.option == "suffix_cache" and str(path) in str(err.value)
    if damage == "another tokenizer":
        assert "another tokenizer" in str(err.value)
    assert path.read_bytes() == before


def test_the_vocabulary_fingerprint_tells_tokenizers_apart():
    assert vocab_fingerprint({"a": 0, "b": 1}) == vocab_fingerprint({"b": 1, "a": 0})
    assert vocab_fingerprint({"a": 0, "b": 1}) != vocab_fingerprint({"a": 1, "b": 0})


def test_save_cache_writes_only_a_suffix_drafter_with_a_file(tmp_path):
    from mtpctl.drafters.merged import MergedDrafter
    from mtpctl.drafters.ngram import NgramDrafter

    path = tmp_path / "c.cache"
    suffix = SuffixDrafter(SuffixSettings(cache=str(path)), SuffixCache(SuffixSettings(cache=str(path)), "fp", 10))
    suffix.finished([1, 2], [3, 4])
    assert save_cache(NgramDrafter()) is None
    assert save_cache(MergedDrafter([suffix, NgramDrafter()])) == path
    assert read_cache(path, "fp", 10) == [[1, 2, 3, 4]]


def test_suffix_drafter_loads_an_existing_cache_and_names_the_settings_changed(tmp_path):
    from mtpctl.drafters.suffix import suffix_drafter

    path = tmp_path / "c.cache"
    vocab = {"a": 0, "b": 1, "c": 2}
    first = suffix_drafter(SuffixSettings(cache=str(path)), vocab, 3)  # no file yet: empty
    assert first.cache.sequences() == []
    first.finished([0], [1, 2, 1])
    save_cache(first)
    again = suffix_drafter(SuffixSettings(cache=str(path), nodes=4), vocab, 3)
    assert again.cache.sequences() == [[0, 1, 2, 1]] and again.budget == 4
    with pytest.raises(BadInput):
        suffix_drafter(SuffixSettings(cache=str(path)), {"a": 0, "b": 2, "c": 1}, 3)
    assert SuffixSettings(cache="x", nodes=4).options_set() == ["suffix_nodes", "suffix_cache"]
    assert SuffixSettings().options_set() == []


# ---- the CLI and the policy


def test_the_auto_policy_prices_suffix_like_prompt_lookup():
    from mtpctl.decode.policy import CostModelPolicy, DraftCost, make_policy

    policy = make_policy("auto", "bfloat16", "suffix")
    assert isinstance(policy, CostModelPolicy) and policy.draft == DraftCost()  # no drafting cost measured: none


def test_suffix_settings_without_suffix_and_a_bad_cache_are_one_error_each(capsys, tiny_folder, tmp_path):
    code, out, err = cli(capsys, "generate", "-m", tiny_folder, "--speculate", "ngram", "--suffix-nodes", 4, "hi")
    assert_one_line_exit_2(code, out, err, "goes with the suffix drafter (--suffix-nodes)")
    bad = tmp_path / "bad.cache"
    bad.write_bytes(b"not a cache")
    code, out, err = cli(capsys, "generate", "-m", tiny_folder, "--speculate", "suffix", "--suffix-cache", bad, "hi")
    assert_one_line_exit_2(code, out, err, "(--suffix-cache)")
    assert bad.read_bytes() == b"not a cache"
    other = tmp_path / "other.cache"
    SuffixCache(SuffixSettings(), "another tokenizer's fingerprint", 259).save(other)
    before = other.read_bytes()
    code, out, err = cli(capsys, "generate", "-m", tiny_folder, "--speculate", "suffix", "--suffix-cache", other, "hi")
    assert_one_line_exit_2(code, out, err, "another tokenizer")
    assert other.read_bytes() == before


def test_generate_writes_the_cache_and_reports_the_global_index(capsys, tiny_folder, tmp_path):
    path = tmp_path / "suffix.cache"
    args = ["generate", "-m", tiny_folder, "--speculate", "suffix+ngram", "--suffix-cache", path, "--json",
            "--max-new-tokens", 12, "--no-chat", "abcabcabc"]
    code, out, err = cli(capsys, *args)
    assert code == 0, err
    result = json.loads(out)
    assert result["speculate"] == "suffix+ngram" and path.is_file()
    index = result["suffix_index"]
    assert set(index) == {"sequences", "tokens", "nodes", "bytes", "max_nodes", "evicted"}
    assert index["nodes"] <= index["max_nodes"] == SuffixSettings().max_nodes
    code, out, err = cli(capsys, *args)  # the file is read back
    assert code == 0, err


def test_bench_rounds_reports_each_round(capsys, tiny_folder, tmp_path):
    code, out, err = cli(capsys, "bench", "-m", tiny_folder, "--methods", "plain,suffix", "--limit", 1, "--categories",
                         "code", "--max-new-tokens", 8, "--rounds", 2, "--json", tmp_path / "b.json")
    assert code == 0, err
    assert "Round 1 of 2: cold" in out and "Round 2 of 2: warm" in out
    report = json.loads((tmp_path / "b.json").read_text())
    assert [(r["round"], r["warm"]) for r in report["rounds"]] == [(1, False), (2, True)]
    assert set(report["rounds"][-1]["suffix_index"]) == {"suffix"}
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "abcabc"}\n{"prompt": "xyzxyz"}\n')
    code, out, err = cli(capsys, "bench", "-m", tiny_folder, "--prompts", prompts, "--methods", "plain,suffix",
                         "--max-new-tokens", 8, "--rounds", 2, "--batch-sizes", "1,2", "--json", tmp_path / "c.json")
    assert code == 0, err
    report = json.loads((tmp_path / "c.json").read_text())
    assert [(r["round"], r["warm"], len(r["rows"])) for r in report["rounds"]] == [(1, False, 4), (2, True, 4)]
    assert "Round 2 of 2: warm" in out and "- suffix: suffix index:" in out
    code, out, err = cli(capsys, "bench", "-m", tiny_folder, "--methods", "plain,suffix", "--repeats", 2, "--limit", 1)
    assert_one_line_exit_2(code, out, err, "use --rounds")


# ---- the real SmolLM2-135M-Instruct

REPEATING = "Copy this list exactly, twice: apples (red), bananas (yellow), limes (green), plums (purple)."


@pytest.mark.real
@pytest.mark.parametrize("spec", ["suffix", "suffix+ngram"])
def test_greedy_suffix_is_plain_greedy_on_smollm2(capsys, smollm2_folder, spec):
    args = ["generate", "-m", smollm2_folder, "--json", "--max-new-tokens", 48, "--threads", 1, REPEATING]
    code, plain, err = cli(capsys, *args)
    assert code == 0, err
    code, spec_out, err = cli(capsys, *args, "--speculate", spec)
    assert code == 0, err
    plain, result = json.loads(plain), json.loads(spec_out)
    assert result["token_ids"] == plain["token_ids"]
    assert result["stats"]["tau"] > 1.0  # the list repeats: the local index drafts it


@pytest.mark.real
def test_a_response_served_before_is_drafted_from_the_global_index(smollm2):
    """The library path: one drafter serving a prompt twice; the second time its global index holds the
    first response, so more is accepted, and greedy output stays plain greedy's."""
    from mtpctl.decode.sampling import SamplingParams

    prompt = smollm2.encode("Name the four seasons and one thing about each.")
    plain = smollm2.generate(prompt, 40, SamplingParams())
    drafter = SuffixDrafter(SuffixSettings())
    first = smollm2.generate(prompt, 40, SamplingParams(), drafter.fork())
    drafter.finished(prompt, first.token_ids)  # what the decoding loop does when a request ends
    second = smollm2.generate(prompt, 40, SamplingParams(), drafter.fork())
    assert first.token_ids == second.token_ids == plain.token_ids
    assert second.stats.tau > first.stats.tau and second.stats.tau > 2.0


@pytest.mark.real
def test_a_batch_of_repeated_prompts_learns_from_earlier_records_on_smollm2(capsys, smollm2_folder, tmp_path):
    prompts = ["Name the four seasons.", "List three primary colors.", "Name the four seasons.",
               "List three primary colors."]
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    base = ["generate", "-m", smollm2_folder, "--batch-file", batch, "--max-new-tokens", 32, "--threads", 1]
    runs = {}
    for name, extra in (("plain", ()), ("suffix", ("--speculate", "suffix", "--max-batch", 1)),
                        ("batched", ("--speculate", "suffix", "--max-batch", 3))):
        code, out, err = cli(capsys, *base, *extra)
        assert code == 0, err
        runs[name] = [json.loads(line) for line in out.splitlines()]
    for name in ("suffix", "batched"):
        assert [r["token_ids"] for r in runs[name]] == [r["token_ids"] for r in runs["plain"]], name
    taus = [r["stats"]["tau"] for r in runs["suffix"]]
    assert taus[2] > taus[0] and taus[3] > taus[1], taus  # one at a time: the repeats find the earlier responses
    assert "suffix index: 4 responses" in err


def test_suffix_merges_with_heads_and_stays_plain_greedy(capsys, tiny_folder, tmp_path):
    from helpers import generate_plain_and, make_heads

    heads = make_heads(tmp_path / "heads", tiny_folder)
    plain, merged, err = generate_plain_and(capsys, tiny_folder, "--speculate", "suffix+heads", "--heads", heads)
    assert merged["speculate"] == "heads+suffix" and merged["token_ids"] == plain["token_ids"]
    assert merged["draft_len"] > SuffixSettings().nodes  # the suffix budget and the heads tree
