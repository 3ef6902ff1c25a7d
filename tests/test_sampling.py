"""Sampling and acceptance as pure functions: exact expected tensors, and the distribution that
speculative rejection sampling produces."""

from collections import Counter

import pytest
import torch

from mtpctl.decode.acceptance import accept_greedy, accept_rejection_sampling
from mtpctl.decode.tree import DraftTree
from mtpctl.decode.sampling import SamplingParams, next_token, probs_from_logits
from stats_util import chi_square_rejects

LOGITS = torch.log(torch.tensor([0.1, 0.4, 0.2, 0.3]))


def test_greedy_probs_are_one_hot_of_argmax():
    assert probs_from_logits(LOGITS, SamplingParams()).tolist() == [0.0, 1.0, 0.0, 0.0]


def test_temperature_one_keeps_the_distribution():
    torch.testing.assert_close(probs_from_logits(LOGITS, SamplingParams(temperature=1.0)),
                               torch.tensor([0.1, 0.4, 0.2, 0.3]))


def test_top_k_keeps_the_k_most_likely():
    probs = probs_from_logits(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(probs, torch.tensor([0.0, 4 / 7, 0.0, 3 / 7]))


def test_top_p_keeps_the_smallest_set_reaching_p():
    # sorted: 0.4, 0.3, 0.2, 0.1; 0.4 + 0.3 = 0.7 >= 0.65 -> keep two tokens
    probs = probs_from_logits(LOGITS, SamplingParams(temperature=1.0, top_p=0.65))
    torch.testing.assert_close(probs, torch.tensor([0.0, 4 / 7, 0.0, 3 / 7]))
    probs = probs_from_logits(LOGITS, SamplingParams(temperature=1.0, top_p=0.71))
    torch.testing.assert_close(probs, torch.tensor([0.0, 4 / 9, 2 / 9, 3 / 9]))


@pytest.mark.parametrize("kwargs", [{"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -2}])
def test_bad_sampling_params_are_rejected(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_same_seed_same_draws():
    params = SamplingParams(temperature=1.0, seed=7)
    draws = [[next_token(LOGITS, params, g) for _ in range(20)] for g in (params.generator(), params.generator())]
    assert draws[0] == draws[1]
    assert len(set(draws[0])) > 1


def test_accept_greedy_exact():
    logits = torch.full((4, 10), -1.0)
    for row, best in enumerate([3, 5, 7, 9]):
        logits[row, best] = 1.0
    assert accept_greedy(DraftTree.chain([0, 3, 5, 7]), logits).tokens == [3, 5, 7, 9]  # all accepted + bonus
    result = accept_greedy(DraftTree.chain([0, 3, 6, 7]), logits)
    assert (result.accepted, result.next_token, result.path) == ([3], 5, [0, 1])  # first mismatch: argmax
    assert accept_greedy(DraftTree(0), logits[:1]).tokens == [3]


def test_rejection_sampling_certain_accept_and_reject():
    g = torch.Generator().manual_seed(0)
    logits = torch.log(torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]) + 1e-30)
    # p(draft) = 1 -> always accepted, bonus from row 1
    assert accept_rejection_sampling(DraftTree.chain([0, 1]), logits, SamplingParams(temperature=1.0), g).tokens == [1, 2]
    # p(draft) = 0 -> always rejected, recovered from the residual (token 1)
    assert accept_rejection_sampling(DraftTree.chain([0, 0]), logits, SamplingParams(temperature=1.0), g).tokens == [1]


@pytest.mark.parametrize("with_q", [False, True])
def test_rejection_sampling_output_follows_target_distribution(with_q):
    """The first committed token must be distributed as p whatever the draft proposes."""
    p = torch.tensor([0.5, 0.05, 0.25, 0.2])
    q = torch.tensor([0.1, 0.6, 0.2, 0.1])
    logits = torch.log(p).repeat(2, 1)
    params = SamplingParams(temperature=1.0)
    g = torch.Generator().manual_seed(1234)
    counts = Counter()
    for _ in range(20000):
        draft = int(torch.multinomial(q, 1, generator=g)) if with_q else 1
        tree = DraftTree.chain([0, draft], q[None] if with_q else None)
        counts[accept_rejection_sampling(tree, logits, params, g).tokens[0]] += 1
    expected = dict(enumerate(p.tolist()))
    assert not chi_square_rejects(counts, expected)
    # the check has power: the draft's own distribution is rejected
    assert chi_square_rejects(counts, dict(enumerate(q.tolist())))
