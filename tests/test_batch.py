"""Many requests at once: every row of a batch decodes exactly as its request alone (greedy), with
rows joining and leaving mid-run, ragged acceptance, stops inside accepted blocks, a request whose
logits turn NaN, bad requests among good ones, per-request KV caches, and the sampled distribution
of batched speculative sampling."""

from collections import Counter
from typing import Dict, List, Sequence

import pytest
import torch

from helpers import exact_sequence_probs, random_decoder, random_heads
from mtpctl.backends.torch import TorchEngine, TorchSession, verify_packed
from mtpctl.decode.loop import Request, generate, run
from mtpctl.decode.policy import AlwaysDraft
from mtpctl.decode.sampling import SamplingParams
from mtpctl.decode.session import GenerationRequest
from mtpctl.decode.stopping import StopChecker
from mtpctl.decode.tree import DraftTree
from mtpctl.decode.drafter import propose_all
from mtpctl.drafters.draft_model import DraftModelDrafter
from mtpctl.drafters.heads.medusa import MedusaDrafter
from mtpctl.drafters.heads.tree import StaticTree
from mtpctl.drafters.merged import MergedDrafter
from mtpctl.drafters.ngram import NgramDrafter
from mtpctl.drafters.self_draft import layer_subset
from mtpctl.errors import BadInput, NonFinite
from mtpctl.model.native import load_kernel
from stats_util import chi_square_rejects

PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 5, 17], [5, 17, 42, 99], [9, 8, 7, 9, 8, 7, 9, 8], [1, 2, 3, 1, 2, 3, 1, 2, 3],
           [100, 101], [5] * 12, [44, 45, 46], [200, 13, 13, 200, 13], [77], [31, 32, 33, 34, 35, 36, 37]]
NEW_TOKENS = [40, 17, 25, 33, 9, 30, 21, 1, 12, 26]  # rows leave at different steps
ATTENTION = [pytest.param(True, marks=pytest.mark.skipif(load_kernel() is None, reason="no C compiler here")),
             False]


class OracleTree:
    """Proposes trees around a known continuation: each step a random number of correct tokens
    (0 to all of ``max_tokens``) with a wrong sibling branch beside them, so in one step some rows
    accept nothing and others everything. Each fork draws from its own seeded generator."""

    def __init__(self, continuations: Dict[tuple, List[int]], vocab: int, budget: int = 6, seed: int = 0):
        self.continuations, self.vocab, self.budget = continuations, vocab, budget
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)

    def fork(self) -> "OracleTree":
        self.seed += 1
        return OracleTree(self.continuations, self.vocab, self.budget, self.seed * 7919)

    def propose(self, context: Sequence[int], max_tokens: int, last=None) -> DraftTree:
        prompt = next(p for p in self.continuations if tuple(context[:len(p)]) == p and len(context) > len(p))
        ahead = self.continuations[prompt][len(context) - len(prompt):]
        right = int(torch.randint(0, max_tokens + 1, (), generator=self.generator))
        tree = DraftTree.chain([context[-1]] + ahead[:right])
        for parent in (len(tree) - 1, 0):  # a wrong child after the right chain, a wrong sibling at the root
            if len(tree) <= max_tokens and parent < len(tree) - 1 + (parent == 0) and len(ahead) > parent:
                tree.add(parent, (ahead[tree.depths[parent]] + 1) % self.vocab)
        return tree


def alone(model, native, prompt, max_new, drafter=None) -> List[int]:
    engine = TorchEngine(model, len(prompt) + max_new + 8, native=native)
    return generate(engine, prompt, StopChecker([], [], max_new, lambda ids: ""), SamplingParams(), drafter).token_ids


def batched(model, native, prompts, news, drafter, max_batch, sampling=SamplingParams(), policy=None):
    requests = [Request(p, StopChecker([], [], n, lambda ids: ""), sampling, drafter.fork() if drafter else None)
                for p, n in zip(prompts, news)]
    budget = drafter.budget if drafter else 0
    return run(requests, lambda r: TorchEngine(model, len(r.prompt_ids) + r.stop.max_new_tokens + budget + 1,
                                               native=native), verify_packed, max_batch, policy)


@pytest.fixture(scope="module")
def model():
    return random_decoder(seed=3)


@pytest.fixture(scope="module")
def references(model):
    return {native: [alone(model, native, p, n) for p, n in zip(PROMPTS, NEW_TOKENS)] for native in (True, False)
            if native is False or load_kernel() is not None}


@pytest.mark.parametrize("native", ATTENTION)
@pytest.mark.parametrize("max_batch", [1, 2, 5, 8])
@pytest.mark.parametrize("kind", ["none", "ngram", "oracle", "heads+ngram", "draft", "ngram+draft"])
def test_every_row_equals_its_request_decoded_alone(model, references, native, max_batch, kind):
    refs = references[native]
    if kind == "heads+ngram":  # random heads: their trees are proposed for every row in one heads call
        drafter = MergedDrafter([MedusaDrafter(StaticTree.from_paths([[0], [1], [0, 0], [0, 1]], 2),
                                               random_heads(model, num_heads=2), model), NgramDrafter(3, 1, 3)])
    elif kind in ("draft", "ngram+draft"):  # a draft model (the target's first layer): one fork per row, packed
        draft = DraftModelDrafter(layer_subset(model, [0]), model.cfg.vocab_size, draft_len=3)
        drafter = draft if kind == "draft" else MergedDrafter([NgramDrafter(3, 1, 2), draft])
    else:
        drafter = {"none": None, "ngram": NgramDrafter(3, 1, 4),
                   "oracle": OracleTree({tuple(p): r for p, r in zip(PROMPTS, refs)}, model.cfg.vocab_size)}[kind]
    outcomes = batched(model, native, PROMPTS, NEW_TOKENS, drafter, max_batch)
    assert [o.token_ids for o in outcomes] == refs
    if kind == "oracle":  # ragged acceptance happened: steps that accepted nothing and steps that accepted 4+
        accepted = [n for o in outcomes for n in o.stats.accepted_per_step]
        assert min(accepted) == 1 and max(accepted) >= 5


def test_a_draft_models_forks_draft_together_in_one_pass_per_step(model):
    """Forks of one draft model propose together (propose_forks): each row's chain is the one it
    drafts alone, and every draft step of every row runs in one packed pass of the draft model."""
    draft = layer_subset(model, [0])
    contexts = [p + [p[-1]] for p in PROMPTS[:4]]
    solo = [DraftModelDrafter(draft, model.cfg.vocab_size, draft_len=3).propose(c, 3) for c in contexts]
    forks = [DraftModelDrafter(draft, model.cfg.vocab_size, draft_len=3) for _ in contexts]
    passes = []
    original = draft.forward
    draft.forward = lambda *args, **kwargs: passes.append(args[0].shape) or original(*args, **kwargs)
    try:
        together = propose_all(forks, [(c, 3, None) for c in contexts])
    finally:
        del draft.forward
    assert [t.tokens for t in together] == [t.tokens for t in solo]
    assert len(passes) == 4 + 2  # a prefill per new row, then one pass per later draft step for all rows
    assert all(shape == (1, 4) for shape in passes[4:])  # each of those carries the four rows


def test_a_draft_fork_whose_logits_turn_nan_fails_alone_and_the_others_draw_as_alone():
    """Forks of one draft model proposing together: the row whose draft logits hold NaN gets that error,
    the others' chains, generators and caches are those of drafting alone (sampled drafts too)."""
    target = random_decoder(seed=3)
    draft = random_decoder(seed=4, blocked=True, tie_word_embeddings=False)  # blocked: batch-invariant, as sessions load
    contexts = [p + [p[-1]] for p in PROMPTS[:4]]
    token = min(set(contexts[0]) - {t for c in contexts[1:] for t in c})  # seen by the first row only
    draft.embed.data[token] = float("nan")
    sampling = SamplingParams(temperature=1.0, seed=0)

    def fork(seed):
        return DraftModelDrafter(draft, target.cfg.vocab_size, sampling, draft_len=3, seed=seed)

    together_forks = [fork(s) for s in range(4)]
    together = propose_all(together_forks, [(c, 3, None) for c in contexts])
    assert isinstance(together[0], NonFinite) and "draft model" in str(together[0])
    for seed, context, tree, twin in zip(range(1, 4), contexts[1:], together[1:], together_forks[1:]):
        solo = fork(seed)
        alone_tree = solo.propose(context, 3)
        assert tree.tokens == alone_tree.tokens and torch.equal(tree.q, alone_tree.q)
        assert twin.forward_passes == solo.forward_passes and twin.cached == solo.cached
        assert torch.equal(twin.generator.get_state(), solo.generator.get_state())
    with pytest.raises(NonFinite):
        fork(0).propose(contexts[0], 3)  # alone, the same row raises


def test_the_same_draft_drafter_twice_proposes_one_call_after_the_other(model):
    """Not forks: one drafter (one cache) asked for two rows drafts them one after the other, each as
    alone, instead of packing two rows into one cache."""
    draft = DraftModelDrafter(layer_subset(model, [0]), model.cfg.vocab_size, draft_len=3)
    contexts = [p + [p[-1]] for p in PROMPTS[:2]]
    solo = [DraftModelDrafter(layer_subset(model, [0]), model.cfg.vocab_size, draft_len=3).propose(c, 3)
            for c in contexts]
    assert [t.tokens for t in propose_all([draft, draft], [(c, 3, None) for c in contexts])] == [t.tokens for t in solo]


@pytest.mark.parametrize("native", ATTENTION)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_batched_pass_gives_each_row_its_bits_alone(native, dtype):
    """The property the lossless batch rests on: one packed pass over several sequences' trees gives
    each sequence's rows exactly the hidden states a pass of its tree alone gives (weights in
    oneDNN's blocked layout, as sessions load them)."""
    model = random_decoder(seed=3, dtype=dtype, blocked=True)
    trees = [DraftTree.from_parents([7, 8, 9, 10], [-1, 0, 0, 1]), DraftTree.chain([3, 4]), DraftTree(5)]
    engines, solo = [], []
    for i, (prompt, tree) in enumerate(zip(PROMPTS[:3], trees)):
        for bucket in (engines, solo):
            e = TorchEngine(model, 40, native=native)
            e.prefill(prompt)
            bucket.append(e)
    together = verify_packed(engines, trees)
    for e, tree, out in zip(solo, trees, together):
        alone_out = e.verify(tree)
        assert torch.equal(out.hidden_states, alone_out.hidden_states)
        assert torch.equal(out.logits, alone_out.logits)


@pytest.mark.slow
def test_sampled_batches_follow_the_targets_distribution():
    """Batched speculative sampling: each row's first tokens follow the target's distribution
    (checked against exact sequence probabilities with 20,000 requests, enough to see a 2% bias)."""
    model = random_decoder(seed=5, vocab=5, max_pos=32)
    prompt, n = [1, 2, 1, 2, 1], 3
    params = SamplingParams(temperature=1.0, top_k=4, seed=0)
    expected = exact_sequence_probs(model, prompt, n, params)
    samples = 20000
    requests = [Request(prompt, StopChecker([], [], n, lambda ids: ""), SamplingParams(1.0, 4, 1.0, seed),
                        NgramDrafter(2, 1, 3)) for seed in range(samples)]
    outcomes = run(requests, lambda r: TorchEngine(model, len(prompt) + n + 4), verify_packed, max_batch=64)
    counts = Counter(tuple(o.token_ids) for o in outcomes)
    assert not chi_square_rejects(counts, expected)
    # power: 2% of the probability moved from the likeliest sequence to the least likely is rejected
    top, bottom = max(expected, key=expected.get), min(expected, key=expected.get)
    biased = dict(expected)
    biased[top] -= 0.02
    biased[bottom] += 0.02
    assert chi_square_rejects(counts, biased)


def test_a_row_whose_logits_turn_nan_fails_alone():
    """A NaN never becomes a token: the request fails with the pass and row named; the others in
    the batch are unaffected (each row's numbers are its own)."""
    model = random_decoder(seed=3, tie_word_embeddings=False)  # a NaN embedding row stays out of the lm_head
    refs = [alone(model, False, p, n) for p, n in zip(PROMPTS, NEW_TOKENS)]
    elsewhere = {t for p, r in zip(PROMPTS[1:], refs[1:]) for t in p + r}
    token = min(set(PROMPTS[0]) - elsewhere)  # a token of the first prompt that no other row ever sees
    model.embed.data[token] = float("nan")
    outcomes = batched(model, False, PROMPTS, NEW_TOKENS, NgramDrafter(3, 1, 4), 4)
    assert isinstance(outcomes[0], NonFinite) and "prefill" in str(outcomes[0])
    assert [o.token_ids for o in outcomes[1:]] == refs[1:]


def test_a_row_whose_logits_turn_nan_mid_run_names_the_step():
    model = random_decoder(seed=3, tie_word_embeddings=False)
    output = alone(model, False, PROMPTS[1], 20)
    token = next(t for t in output if t not in PROMPTS[1])
    model.embed.data[token] = float("nan")  # fine until that token is fed back
    outcome = batched(model, False, PROMPTS[1:2], [20], None, 1)[0]
    assert isinstance(outcome, NonFinite) and "step" in str(outcome) and "row 0" in str(outcome)


def test_a_row_of_logits_is_refused_for_any_nan_or_infinity_and_only_for_those():
    """The finite check reads one sum first: NaN, +inf and -inf anywhere in a row are refused, and a row
    of huge finite values whose sum overflows is not."""
    from mtpctl.decode.loop import _all_finite

    row = torch.randn(49152)
    assert _all_finite(row)
    for value in (float("nan"), float("inf"), float("-inf")):
        for where in (0, 31337, 49151):
            broken = row.clone()
            broken[where] = value
            assert not _all_finite(broken)
    assert _all_finite(torch.full((49152,), 3e38))  # the sum overflows to inf; every value is finite


@pytest.fixture(scope="module")
def tiny_session(tiny_folder):
    return TorchSession(tiny_folder)


def test_session_batch_keeps_input_order_and_refuses_bad_requests_alone(tiny_session):
    ids = [tiny_session.encode(text) for text in ("hello there", "count: 1 2 3 1 2 3", "x")]
    too_long = list(range(3, 200))  # the tiny model's context holds 128
    requests = [GenerationRequest(ids[0], 12), GenerationRequest(too_long, 4), GenerationRequest(ids[1], 20),
                GenerationRequest([], 4), GenerationRequest(ids[2], 5, stop_strings=("a",))]
    outcomes = tiny_session.generate_batch(requests, NgramDrafter(3, 1, 3), max_batch=2)
    assert isinstance(outcomes[1], BadInput) and "context" in str(outcomes[1])
    assert isinstance(outcomes[3], BadInput) and "no tokens" in str(outcomes[3])
    for outcome, request in zip(outcomes, requests):
        if isinstance(outcome, BadInput):
            continue
        single = tiny_session.generate(request.prompt_ids, request.max_new_tokens, stop_strings=request.stop_strings)
        assert (outcome.token_ids, outcome.text, outcome.finish_reason) == \
            (single.token_ids, single.text, single.finish_reason)


def test_each_request_gets_a_kv_cache_for_what_it_needs(tiny_session):
    """Per request: prompt + max new tokens + the drafter's budget + 1 slots, not the model's context."""
    ids = tiny_session.encode("hello")
    small, large = tiny_session.generate_batch([GenerationRequest(ids, 4), GenerationRequest(ids, 40)],
                                               NgramDrafter(3, 1, 3), max_batch=2)
    cfg = tiny_session.model.cfg
    per_slot = cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4 * 2  # float32 keys and values
    spare = small.stats.kv_cache_bytes // per_slot - (len(ids) + 4 + 3 + 1)  # never-written slots past the end
    assert 0 <= spare <= 64
    assert large.stats.kv_cache_bytes == per_slot * (len(ids) + 40 + 3 + 1 + spare)


def test_stops_inside_accepted_blocks_end_each_row_where_it_ends_alone(model, references):
    refs = references[False]
    oracle = OracleTree({tuple(p): r for p, r in zip(PROMPTS, refs)}, model.cfg.vocab_size, budget=8)
    news = [3, 5, 2, 7, 1, 4, 6, 1, 2, 3]  # most rows stop inside a block of accepted drafts
    outcomes = batched(model, False, PROMPTS, news, oracle, 10, policy=AlwaysDraft())
    assert [o.token_ids for o in outcomes] == [r[:n] for r, n in zip(refs, news)]
    assert all(o.finish_reason == "length" for o in outcomes)


def test_the_loop_tells_the_policy_what_each_cut_of_a_tree_would_have_kept(model, references):
    """The oracle's trees put the right tokens first (nodes 1..r) and wrong children after, so the tree
    cut to its first k nodes keeps min(k, accepted) tokens: what the loop reports for every size the
    row was allowed (the auto policy's estimate of smaller drafts)."""
    seen = []

    class Recording(AlwaysDraft):
        def observe(self, row, drafted, accepted, by_size=None):
            seen.append((drafted, accepted, by_size))

    oracle = OracleTree({tuple(p): r for p, r in zip(PROMPTS, references[False])}, model.cfg.vocab_size, budget=6)
    outcomes = batched(model, False, PROMPTS, NEW_TOKENS, oracle, 4, policy=Recording())
    assert [o.token_ids for o in outcomes] == references[False]
    assert any(0 < accepted < drafted for drafted, accepted, _ in seen)  # ragged: cuts would have mattered
    for drafted, accepted, by_size in seen:
        assert drafted <= len(by_size) <= 6
        assert by_size == [min(k, accepted) for k in range(1, len(by_size) + 1)]


def test_a_drafter_that_is_not_hashable_still_batches(model, references):
    """Rows are grouped by drafter family; a user's drafter need not be hashable (a dataclass)."""
    from dataclasses import dataclass

    @dataclass
    class Repeat:  # proposes the pending token again: mostly wrong, never harmful
        budget: int = 1

        def fork(self):
            return self

        def propose(self, context, max_tokens, last=None):
            tree = DraftTree(context[-1])
            if max_tokens > 0:
                tree.add(0, context[-1])
            return tree

    outcomes = batched(model, False, PROMPTS, NEW_TOKENS, Repeat(), 4)
    assert [o.token_ids for o in outcomes] == references[False]
