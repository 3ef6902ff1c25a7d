"""Lookahead decoding on tiny random models: a pass's extra rows (the Jacobi window) leave the draft
tree's rows bit for bit and compute what plain decoding of their own sentence computes; the window
follows the reference's update (warm-up, then one Jacobi iterate a step, columns harvested into the
pool); the pool keeps G continuations per first token, least recently seen dropped; greedy output is
plain greedy's alone, merged and batched; sampled output follows the target's distribution; settings
no pass can carry are refused."""

import json
from collections import Counter

import pytest
import torch

from helpers import (PROMPT, assert_one_line_exit_2, cli, exact_sequence_probs, generate_plain_and, greedy_reference,
                     plain_decode_logits, random_decoder, random_heads, run)
from mtpctl.backends.torch import TorchEngine, verify_packed
from mtpctl.decode.drafter import TargetStep
from mtpctl.decode.loop import Request, run as run_requests
from mtpctl.decode.sampling import SamplingParams
from mtpctl.decode.stopping import StopChecker
from mtpctl.decode.tree import DraftTree, ExtraRows
from mtpctl.drafters.heads.medusa import MedusaDrafter
from mtpctl.drafters.heads.tree import StaticTree
from mtpctl.drafters.lookahead import LookaheadDrafter, LookaheadSettings, NgramPool
from mtpctl.drafters.merged import MergedDrafter
from mtpctl.drafters.ngram import NgramDrafter
from mtpctl.errors import BadInput
from mtpctl.model.native import load_kernel
from stats_util import chi_square_rejects

ATTENTION = [pytest.param(True, marks=pytest.mark.skipif(load_kernel() is None, reason="no C compiler here")), False]
SETTINGS = [(4, 3, 3), (5, 4, 5), (3, 2, 2), (1, 2, 1), (2, 6, 3), (6, 5, 4)]


@pytest.mark.parametrize("native", ATTENTION)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extra_rows_leave_the_tree_alone_and_compute_their_own_sentence(native, dtype):
    """Extra rows change no bit of the tree's rows, and each extra row's logits are those plain
    decoding gives after the committed tokens, the root, the rows it sees and itself."""
    model = random_decoder(seed=3, dtype=dtype, blocked=True)
    tree = DraftTree.from_parents([7, 8, 9, 10], [-1, 0, 0, 1])
    extra = ExtraRows((20, 21, 22, 23, 24), (1, 2, 1, 2, 3), ((), (0,), (), (0,), (0, 3)))  # rows 3, 4 skip rows
    with_extra = DraftTree.from_parents(tree.tokens, tree.parents)
    with_extra.extra = extra
    outs = []
    for t in (tree, with_extra):
        engine = TorchEngine(model, 40, native=native)
        engine.prefill(PROMPT)
        outs.append(engine.verify(t))
    assert len(outs[1]) == 9 and torch.equal(outs[0].logits, outs[1].logits[:4])
    for r, seen in enumerate(extra.sees):
        sentence = [tree.tokens[0]] + [extra.tokens[j] for j in seen] + [extra.tokens[r]]
        assert [extra.offsets[j] for j in seen] + [extra.offsets[r]] == list(range(1, len(sentence)))
        plain = plain_decode_logits(model, PROMPT, sentence, 40, native=native)
        assert torch.equal(outs[1][4 + r], plain)


def test_extra_rows_refuse_rows_they_cannot_see():
    with pytest.raises(ValueError, match="sees only rows before it"):
        ExtraRows((1, 2), (1, 2), ((), (1,)))
    with pytest.raises(ValueError, match="offsets start at 1"):
        ExtraRows((1,), (0,), ((),))


class OneHotRows:
    """A pass output whose row i predicts token 100 + i."""

    def __init__(self, rows: int):
        self.rows = rows

    def __len__(self):
        return self.rows

    def __getitem__(self, i):
        return torch.nn.functional.one_hot(torch.tensor(100 + i), 300).float()


def test_the_window_follows_the_jacobi_update():
    """W=3, N=4: the window starts as W+N-3 base tokens, gains a level (one column narrower each
    step) for N-2 steps, then each step reads the newest level's argmax as the next iterate,
    harvests every column as an n-gram and drops the oldest level."""
    drafter = LookaheadDrafter(LookaheadSettings(3, 4, 2))
    context = list(range(10, 30))
    tree = drafter.propose(context, drafter.budget, TargetStep(OneHotRows(1), 0))
    base = drafter.levels[0]
    assert len(base) == 4 and set(base) <= set(context) and tree.extra.offsets == (1, 2, 3, 4)
    assert tree.extra.sees == ((), (0,), (0, 1), (0, 1, 2))

    def step(tree, pending):
        context.append(pending)
        out = OneHotRows(tree.rows)
        return drafter.propose(context, drafter.budget, TargetStep(out, 0, [0], tree))

    n = len(tree)  # the tree's nodes come before the window's rows
    tree = step(tree, 50)  # warm-up: level 1 = the base's iterates, every level one column narrower
    assert drafter.levels == [base[1:], [100 + n + r for r in range(4)]]
    assert tree.extra.offsets == (1, 2, 3, 1, 2, 3, 4)
    assert tree.extra.sees == ((), (0,), (0, 1), (), (0,), (0, 1), (0, 1, 2))
    level1, n = drafter.levels[1], len(tree)
    tree = step(tree, 51)
    level2 = [100 + n + 3 + c for c in range(1, 4)]  # level 1's iterates, column 0 dropped
    assert drafter.levels == [base[2:], level1[1:], level2]  # widths W-1, W, W: warm
    assert tree.extra.offsets == (1, 2, 1, 2, 3, 2, 3, 4)
    assert tree.extra.sees == ((), (0,), (), (0,), (0, 1), (2,), (0, 3), (0, 1, 4))
    sent, n = drafter.levels, len(tree)
    tree = step(tree, 52)
    new = [100 + n + 5 + c for c in range(3)]
    bottoms = [51] + sent[0]  # the pending token of that pass, then the base
    for c in range(3):
        gram = (sent[1][c], sent[2][c], new[c])
        assert gram in drafter.pool.continuations(bottoms[c])
    assert drafter.levels == [sent[1][1:], sent[2], new]


def test_the_pool_keeps_the_most_recent_continuations():
    pool = NgramPool(2)
    for gram in ([1, 2, 3], [1, 4, 5], [1, 2, 3], [1, 6, 7], [9, 9, 9]):
        pool.add(gram)
    assert pool.continuations(1) == [(6, 7), (2, 3)]  # (4, 5) seen least recently: dropped
    assert pool.continuations(9) == [(9, 9)] and pool.continuations(8) == []


def test_settings_count_the_rows_and_the_depth_of_a_pass():
    s = LookaheadSettings(5, 4, 5)
    assert [s.window_rows(step) for step in (1, 2, 3, 9)] == [6, 11, 14, 14]  # 14 = W*(N-1)-1 once warm
    assert s.rows == 14 + 5 * 3 and s.depth == 6


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(map(str, s)))
def test_greedy_lookahead_is_plain_greedy(tiny_model, tiny_reference, settings):
    drafter = LookaheadDrafter(LookaheadSettings(*settings))
    result = run(tiny_model, drafter)
    assert result.token_ids == tiny_reference
    assert result.stats.draft_tokens > 0


def test_the_window_alone_drafts_a_token_by_token_model_exactly(monkeypatch):
    """On a model whose next token depends on the current token alone (f; every block's output
    projections zeroed), each column the window harvests is f's chain from its bottom token (column
    0 keys the pending token, as the reference does, so only its chain after the key is f's). With the
    pool fed by the window alone (no prompt or output n-grams), whole candidates are accepted."""
    model = random_decoder(seed=0, tie_word_embeddings=False)
    for layer in model.layers:
        layer.o_proj.data.zero_()
        layer.down.data.zero_()
    with torch.inference_mode():
        f = model.logits(model.final_norm(model.embed, model.norm, model.cfg.rms_norm_eps)).argmax(-1).tolist()
    prompt = list(range(40, 70))
    drafter = LookaheadDrafter(LookaheadSettings(4, 4, 3))
    monkeypatch.setattr(drafter, "_pool_context", lambda context: setattr(drafter, "seen", context))
    result = run(model, drafter, max_new=60, prompt=prompt)
    assert result.token_ids == greedy_reference(model, prompt, 60)
    grams = [(first,) + rest for first, kept in drafter.pool._by_first.items() for rest in kept]
    assert len(grams) > 20 and all(g[2] == f[g[1]] and g[3] == f[g[2]] for g in grams)
    assert sum(g[1] == f[g[0]] for g in grams) > len(grams) // 2
    assert result.stats.tau > 1.5


@pytest.mark.parametrize("native", ATTENTION)
def test_lookahead_merged_and_batched_is_plain_greedy_for_every_row(native):
    model = random_decoder(seed=3)
    prompts = [PROMPT, [5, 17, 42, 99], [9, 8, 7, 9, 8, 7, 9, 8], [1, 2, 3, 1, 2, 3], [77]]
    news = [30, 17, 25, 20, 12]
    references = [greedy_reference(model, p, n) for p, n in zip(prompts, news)]
    heads = MedusaDrafter(StaticTree.from_paths([[0], [1], [0, 0]], 2), random_heads(model, num_heads=2), model)
    for drafter in (LookaheadDrafter(LookaheadSettings(4, 3, 3)),
                    MergedDrafter([NgramDrafter(3, 1, 3), LookaheadDrafter(LookaheadSettings(3, 4, 2))]),
                    MergedDrafter([heads, LookaheadDrafter(LookaheadSettings(4, 3, 3))])):
        for max_batch in (1, 3):
            requests = [Request(p, StopChecker([], [], n, lambda ids: ""), SamplingParams(), drafter.fork())
                        for p, n in zip(prompts, news)]
            outcomes = run_requests(requests, lambda r: TorchEngine(model, len(r.prompt_ids) + r.stop.max_new_tokens
                                                                    + drafter.budget + 1, native=native),
                                    verify_packed, max_batch)
            assert [o.token_ids for o in outcomes] == references


def test_a_merged_window_waits_when_the_room_is_short(tiny_model):
    """A merged tree keeps the window only where it fits the step's room; nodes fill the rest."""
    drafter = MergedDrafter([NgramDrafter(3, 1, 3), LookaheadDrafter(LookaheadSettings(4, 3, 3))])
    context = PROMPT + [5, 17]
    last = TargetStep(OneHotRows(1), 0)
    roomy = drafter.propose(context, drafter.budget, last)
    assert roomy.extra is not None and roomy.rows - 1 <= drafter.budget
    short = drafter.propose(context, 3, last)
    assert short.extra is None and short.drafted <= 3


def test_sampled_lookahead_keeps_the_target_distribution():
    """The first 3 sampled tokens with lookahead drafting (candidates from the prompt's n-grams and the
    window) follow the exact distribution of plain sampling (chi-square), not another temperature's."""
    model = random_decoder(seed=5, vocab=5, max_pos=32)
    prompt, n = [1, 2, 1, 2, 1], 3
    params = SamplingParams(temperature=1.0, top_k=4)
    settings = LookaheadSettings(3, 3, 2)
    requests = [Request(prompt, StopChecker([], [], n + 4, lambda ids: ""), SamplingParams(1.0, 4, 1.0, seed),
                        LookaheadDrafter(settings, seed=seed)) for seed in range(4000)]
    outcomes = run_requests(requests, lambda r: TorchEngine(model, len(prompt) + n + 4 + settings.rows + 1),
                            verify_packed, max_batch=64)
    assert sum(o.stats.draft_tokens for o in outcomes) >= 4000  # candidates were verified
    counts = Counter(tuple(o.token_ids[:n]) for o in outcomes)
    assert not chi_square_rejects(counts, exact_sequence_probs(model, prompt, n, params))
    assert chi_square_rejects(counts, exact_sequence_probs(model, prompt, n, SamplingParams(temperature=0.5)))


@pytest.mark.parametrize("settings, fragment", [
    ((0, 3, 3), "W >= 1"), ((4, 1, 3), "N >= 2"), ((4, 3, 0), "G >= 1"),
    ((16, 4, 2), "verification supports 16"), ((16, 2, 120), "does not fit the model's context of 128"),
])
def test_settings_no_pass_can_carry_are_refused(settings, fragment):
    with pytest.raises(BadInput, match=fragment) as err:
        LookaheadSettings(*settings).check(128)
    assert err.value.option == "lookahead"


def test_lookahead_settings_parse():
    assert LookaheadSettings.parse("5,4,5") == LookaheadSettings(5, 4, 5)
    for text in ("5,4", "a,b,c", "5,4,5,1"):
        with pytest.raises(BadInput, match="W,N,G"):
            LookaheadSettings.parse(text)


def test_cli_lookahead_is_plain_greedy(capsys, tiny_folder):
    plain, spec, _ = generate_plain_and(capsys, tiny_folder, "--speculate", "lookahead", "--lookahead", "3,3,2")
    assert spec["token_ids"] == plain["token_ids"] and spec["speculate"] == "lookahead"
    assert spec["draft_len"] == LookaheadSettings(3, 3, 2).rows


@pytest.mark.parametrize("args, fragment", [
    (["--speculate", "lookahead", "--lookahead", "4,3"], "expected W,N,G"),
    (["--speculate", "lookahead", "--lookahead", "0,3,3"], "W >= 1"),
    (["--speculate", "lookahead", "--lookahead", "20,5,3"], "verification supports 16 (--lookahead)"),
    (["--speculate", "lookahead", "--lookahead", "16,2,120"], "does not fit the model's context of 128 tokens with a "
                                                              "prompt (--lookahead)"),
    (["--speculate", "ngram", "--lookahead", "4,3,3"], "goes with the lookahead drafter (--lookahead)"),
])
def test_cli_bad_lookahead_values_are_one_line_exit_2(capsys, tiny_folder, args, fragment):
    assert_one_line_exit_2(*cli(capsys, "generate", "-m", tiny_folder, *args, "hi"), fragment)


def test_bench_runs_lookahead_beside_plain(capsys, tiny_folder, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"category": "copy", "prompt": "abc abc abc abc"}) + "\n")
    code = cli(capsys, "bench", "-m", tiny_folder, "--prompts", prompts, "--max-new-tokens", 12, "--repeats", 1,
               "--methods", "plain,ngram+lookahead,lookahead", "--lookahead", "3,3,2", "--json", tmp_path / "b.json")[0]
    assert code == 0
    report = json.loads((tmp_path / "b.json").read_text())
    methods = {m["method"]: m for m in report["methods"]}
    assert list(methods) == ["plain", "ngram+lookahead", "lookahead"] and report["settings"]["lookahead"] == "3,3,2"
    assert methods["lookahead"]["new_tokens"] == methods["plain"]["new_tokens"]
