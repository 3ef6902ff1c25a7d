"""A batch's rows are independent in what they draw and in how they fail: a seeded sampled request
commits the same tokens whatever the drafter, the draft sizes and the batch around it, and a bug met
in one row's own drafting ends that row alone (an InternalFault), the others decoding as alone."""

from typing import List

import pytest

from helpers import random_decoder, random_heads
from mtpctl.backends.torch import TorchEngine, verify_packed
from mtpctl.decode.loop import Request, generate, run
from mtpctl.decode.policy import AlwaysDraft
from mtpctl.decode.sampling import SamplingParams
from mtpctl.decode.stopping import StopChecker
from mtpctl.decode.tree import DraftTree
from mtpctl.drafters.heads.medusa import MedusaDrafter
from mtpctl.drafters.heads.tree import StaticTree
from mtpctl.drafters.merged import MergedDrafter
from mtpctl.drafters.ngram import NgramDrafter
from mtpctl.errors import InternalFault

PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 5, 17], [9, 8, 7, 9, 8, 7, 9, 8], [1, 2, 3, 1, 2, 3, 1, 2, 3], [100, 101],
           [200, 13, 13, 200, 13]]
NEW = 24


@pytest.fixture(scope="module")
def model():
    return random_decoder(seed=3)


def _stop(n: int = NEW) -> StopChecker:
    return StopChecker([], [], n, lambda ids: "")


def _run(model, prompts, samplings, drafter, max_batch, policy=None) -> list:
    budget = drafter.budget if drafter is not None else 0
    requests = [Request(p, _stop(), s, drafter.fork() if drafter is not None else None)
                for p, s in zip(prompts, samplings)]
    return run(requests, lambda r: TorchEngine(model, len(r.prompt_ids) + NEW + budget + 1), verify_packed,
               max_batch, policy)


def _drafters(model) -> dict:
    heads = MedusaDrafter(StaticTree.from_paths([[0], [1], [0, 0], [0, 1]], 2), random_heads(model, num_heads=2),
                          model)
    return {"none": None, "ngram": NgramDrafter(3, 1, 4), "ngram-1": NgramDrafter(2, 1, 1), "heads": heads,
            "heads+ngram": MergedDrafter([heads, NgramDrafter(3, 1, 3)])}


class _Policy(AlwaysDraft):
    """Every row drafts a size that changes step by step (0, 1, 2, ...), as an auto policy's might."""

    def __init__(self):
        self.calls = 0

    def draft_sizes(self, rooms: List[int], indices: List[int]) -> List[int]:
        self.calls += 1
        return [(self.calls + i) % (room + 1) for i, room in enumerate(rooms)]


def test_a_seeded_sampled_request_commits_the_same_tokens_with_any_drafter_alone_or_batched(model):
    samplings = [SamplingParams(temperature=1.0, top_k=50, seed=seed) for seed in range(len(PROMPTS))]
    reference = [o.token_ids for o in _run(model, PROMPTS, samplings, None, 1)]
    assert len({tuple(r) for r in reference}) == len(PROMPTS)
    for name, drafter in _drafters(model).items():
        for max_batch, policy in ((1, None), (5, None), (3, _Policy())):
            outcomes = _run(model, PROMPTS, samplings, drafter, max_batch, policy)
            assert [o.token_ids for o in outcomes] == reference, (name, max_batch, policy)
            if drafter is not None and policy is None and max_batch == 5:
                assert sum(o.stats.accepted_tokens for o in outcomes) > 0  # the drafts were verified, not skipped


def test_a_seed_changes_the_tokens_and_the_same_seed_repeats_them(model):
    one = SamplingParams(temperature=1.0, seed=1)
    first = _run(model, PROMPTS[:1], [one], NgramDrafter(3, 1, 4), 1)[0].token_ids
    assert _run(model, PROMPTS[:1], [one], None, 1)[0].token_ids == first
    assert _run(model, PROMPTS[:1], [SamplingParams(temperature=1.0, seed=2)], None, 1)[0].token_ids != first


class _FailsOn:
    """Prompt lookup that raises a bug's exception (or proposes a tree not rooted at the pending token)
    for one prompt, from its third call on."""

    def __init__(self, bad_first_token: int, how: str, calls: int = 0):
        self.inner, self.bad, self.how, self.calls = NgramDrafter(3, 1, 4), bad_first_token, how, calls
        self.budget = self.inner.budget

    def fork(self):
        return _FailsOn(self.bad, self.how)

    def propose(self, context, max_tokens, last=None):
        self.calls += 1
        if context[0] == self.bad and self.calls >= 3:
            if self.how == "raise":
                raise IndexError("a drafter's bug")
            return DraftTree(context[-1] + 1)
        return self.inner.propose(context, max_tokens, last)


@pytest.mark.parametrize("how", ["raise", "wrong root"])
def test_a_bug_in_one_rows_drafting_ends_that_row_alone(model, how):
    greedy = [SamplingParams()] * len(PROMPTS)
    alone = [o.token_ids for o in _run(model, PROMPTS, greedy, None, 1)]
    outcomes = _run(model, PROMPTS, greedy, _FailsOn(PROMPTS[2][0], how), 5)
    assert isinstance(outcomes[2], InternalFault) and outcomes[2].exit_code == 3
    assert "internal error in this request (drafting)" in str(outcomes[2])
    assert ("IndexError" in str(outcomes[2])) == (how == "raise")
    assert [o.token_ids for i, o in enumerate(outcomes) if i != 2] == alone[:2] + alone[3:]


def test_a_single_generation_reports_its_drafters_bug_as_an_internal_fault(model):
    engine = TorchEngine(model, len(PROMPTS[0]) + NEW + 8)
    with pytest.raises(InternalFault) as caught:
        generate(engine, PROMPTS[0], _stop(), SamplingParams(), _FailsOn(PROMPTS[0][0], "raise"))
    assert isinstance(caught.value.__cause__, IndexError)
