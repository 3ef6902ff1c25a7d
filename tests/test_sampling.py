"""Sampling and acceptance as pure functions: exact expected tensors, and the distribution that
speculative rejection sampling produces."""

from collections import Counter

import pytest
import torch

from mtpctl.decode.acceptance import accept_greedy, accept_rejection_sampling, accept_sampled_exact
from mtpctl.decode.tree import DraftTree
from mtpctl.decode.sampling import SamplingParams, next_token, position_uniform, probs_from_logits, sample_at
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


@pytest.mark.parametrize("kwargs", [{"temperature": -1}, {"temperature": float("nan")}, {"temperature": float("inf")},
                                    {"top_p": 0}, {"top_p": 1.5}, {"top_k": -2}, {"seed": 2 ** 64}, {"seed": -2 ** 63 - 1}])
def test_bad_sampling_params_are_rejected(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_same_seed_same_draws():
    params = SamplingParams(temperature=1.0, seed=7)
    draws = [[next_token(LOGITS, params, position_uniform(params.stream_seed(), i)) for i in range(20)]
             for _ in range(2)]
    assert draws[0] == draws[1]
    assert len(set(draws[0])) > 1


def test_position_uniforms_depend_on_seed_and_position_only():
    assert position_uniform(7, 3) == position_uniform(7, 3)
    assert position_uniform(7, 3) != position_uniform(7, 4) and position_uniform(7, 3) != position_uniform(8, 3)
    draws = [position_uniform(11, i) for i in range(20000)]
    assert all(0.0 <= u < 1.0 for u in draws)
    deciles = Counter(int(u * 10) for u in draws)
    assert not chi_square_rejects(deciles, {k: 0.1 for k in range(10)})
    assert chi_square_rejects(Counter(int(u * u * 10) for u in draws), {k: 0.1 for k in range(10)})  # power
    neighbours = Counter((int(a * 3), int(b * 3)) for a, b in zip(draws, draws[1:]))
    assert not chi_square_rejects(neighbours, {(i, j): 1 / 9 for i in range(3) for j in range(3)})


def test_sample_at_is_the_inverse_cdf():
    probs = torch.tensor([0.1, 0.4, 0.2, 0.3])
    assert [sample_at(probs, u) for u in (0.0, 0.05, 0.3, 0.6, 0.95, 0.999999)] == [0, 0, 1, 2, 3, 3]
    assert [sample_at(2 * probs, u) for u in (0.05, 0.3, 0.6, 0.95)] == [0, 1, 2, 3]  # not normalised: same tokens
    holes = torch.tensor([0.0, 0.5, 0.0, 0.5, 0.0])
    assert [sample_at(holes, u) for u in (0.0, 0.25, 0.5, 0.75, 0.9999999)] == [1, 1, 3, 3, 3]


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


def test_sampled_exact_acceptance_commits_the_plain_samples():
    """Each committed token is the one plain sampling draws at its position with the same uniform:
    draft tokens that equal it are accepted, the first that does not ends the step with it."""
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1], [0.0, 0.0, 1.0, 0.0]])
    logits, params = torch.log(probs + 1e-30), SamplingParams(temperature=1.0)
    uniforms = [0.3, 0.8, 0.5, 0.1]
    plain = [sample_at(probs[d], uniforms[d]) for d in range(4)]  # 1, 3, 0, 2
    assert plain == [1, 3, 0, 2]
    result = accept_sampled_exact(DraftTree.chain([9, 1, 3, 0]), logits, params, uniforms.__getitem__)
    assert (result.path, result.tokens) == ([0, 1, 2, 3], [1, 3, 0, 2])  # all accepted, then the bonus
    result = accept_sampled_exact(DraftTree.chain([9, 1, 2, 0]), logits, params, uniforms.__getitem__)
    assert (result.path, result.tokens) == ([0, 1], [1, 3])
    tree = DraftTree.from_parents([9, 0, 2, 1, 3], [-1, 0, 0, 0, 3])  # three candidates, the third followed
    result = accept_sampled_exact(tree, logits[[0, 1, 1, 1, 1]], params, uniforms.__getitem__)
    assert (result.path, result.tokens) == ([0, 3, 4], [1, 3, 2])  # row 4 uniform, u 0.5: token 2


def test_sampled_exact_acceptance_follows_the_target_and_accepts_with_p():
    """Over many seeds the first committed token is distributed as p, and the draft token is accepted
    with probability p(draft), as rejection sampling of a one-hot draft accepts it."""
    p = torch.tensor([0.5, 0.05, 0.25, 0.2])
    logits, params = torch.log(p).repeat(3, 1), SamplingParams(temperature=1.0)
    first, accepted = Counter(), 0
    for seed in range(20000):
        result = accept_sampled_exact(DraftTree.chain([0, 2, 0]), logits, params, lambda d: position_uniform(seed, d))
        first[result.tokens[0]] += 1
        accepted += result.accepted[:1] == [2]
    assert not chi_square_rejects(first, dict(enumerate(p.tolist())))
    assert chi_square_rejects(first, {0: 0.48, 1: 0.05, 2: 0.27, 3: 0.2})  # power: a 2% shift is seen
    assert not chi_square_rejects(Counter(accepted=accepted, rejected=20000 - accepted),
                                  {"accepted": 0.25, "rejected": 0.75})


def test_a_tiny_temperature_samples_the_argmax_not_noise():
    logits = torch.tensor([0.5, 2.0, -1.0, 1.9])
    for temperature in (1e-45, 1e-300, 1e-30):
        probs = probs_from_logits(logits, SamplingParams(temperature=temperature))
        assert probs.tolist() == [0.0, 1.0, 0.0, 0.0], temperature
