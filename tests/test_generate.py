"""The decoding loop on tiny random models: lossless greedy speculation for every draft length,
stops inside accepted blocks, max-new-tokens, statistics, and the sampled distribution."""

from collections import Counter

import pytest
import torch

from helpers import (GREEDY, PROMPT, ScriptedDrafter, decode, exact_sequence_probs, greedy_reference, random_decoder,
                     run)
from mtpctl.backends.torch import TorchEngine
from mtpctl.decode.loop import generate
from mtpctl.decode.sampling import SamplingParams
from mtpctl.decode.stopping import StopChecker
from mtpctl.decode.tree import DraftTree
from mtpctl.drafters.ngram import NgramDrafter
from stats_util import chi_square_rejects


def test_plain_loop_equals_reference(tiny_model, tiny_reference):
    result = run(tiny_model)
    assert result.token_ids == tiny_reference
    assert result.stats.decode_steps == 39 and result.stats.tau == 1.0
    assert result.stats.acceptance_rate is None


@pytest.mark.parametrize("draft_len", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("corrupt_every", [0, 2, 3])
def test_greedy_speculation_is_lossless(tiny_model, tiny_reference, draft_len, corrupt_every):
    drafter = ScriptedDrafter(len(PROMPT), tiny_reference, tiny_model.cfg.vocab_size, corrupt_every, draft_len)
    result = run(tiny_model, drafter)
    assert result.token_ids == tiny_reference
    if corrupt_every == 0:  # a perfect drafter: every step commits draft_len + 1 tokens but the last
        assert result.stats.decode_steps == -(-39 // (draft_len + 1))
        assert result.stats.acceptance_rate == 1.0


@pytest.mark.parametrize("draft_len", [1, 4, 7])
def test_ngram_speculation_is_lossless(tiny_model, tiny_reference, draft_len):
    assert run(tiny_model, NgramDrafter(3, 1, draft_len)).token_ids == tiny_reference


def test_wrong_drafts_only_cost_steps(tiny_model, tiny_reference):
    class Wrong:
        budget = 4

        def propose(self, context, max_tokens, last=None):
            return DraftTree.chain([context[-1]] + [(context[-1] + 1) % tiny_model.cfg.vocab_size] * max_tokens)

    result = run(tiny_model, Wrong())
    assert result.token_ids == tiny_reference


@pytest.mark.parametrize("max_new", [1, 2, 3, 4, 7])
def test_max_new_tokens_is_never_exceeded(tiny_model, tiny_reference, max_new):
    drafter = ScriptedDrafter(len(PROMPT), tiny_reference, tiny_model.cfg.vocab_size, budget=5)
    result = run(tiny_model, drafter, max_new=max_new)  # includes draft-len - 1 = 4
    assert result.token_ids == tiny_reference[:max_new]
    assert result.finish_reason == "length"
    assert result.stats.new_tokens == max_new


def test_eos_inside_an_accepted_block_ends_there(tiny_model, tiny_reference):
    eos = tiny_reference[10]
    cut = tiny_reference.index(eos) + 1
    drafter = ScriptedDrafter(len(PROMPT), tiny_reference, tiny_model.cfg.vocab_size, budget=6)
    spec = run(tiny_model, drafter, eos={eos})
    plain = run(tiny_model, eos={eos})
    assert spec.token_ids == plain.token_ids == tiny_reference[:cut]
    assert spec.finish_reason == "eos"
    assert spec.stats.new_tokens == cut
    assert 1 + sum(spec.stats.accepted_per_step) == spec.stats.new_tokens


def test_stop_string_inside_an_accepted_block_ends_there(tiny_model, tiny_reference):
    text = decode(tiny_reference)
    stop = text[12:14]
    at = text.index(stop)
    drafter = ScriptedDrafter(len(PROMPT), tiny_reference, tiny_model.cfg.vocab_size, budget=6)
    spec = run(tiny_model, drafter, stops=[stop])
    plain = run(tiny_model, stops=[stop])
    assert spec.token_ids == plain.token_ids == tiny_reference[:at + 2]
    assert spec.text == plain.text == text[:at]
    assert spec.finish_reason == "stop"


def test_statistics_count_committed_tokens(tiny_model, tiny_reference):
    drafter = ScriptedDrafter(len(PROMPT), tiny_reference, tiny_model.cfg.vocab_size, corrupt_every=2, budget=4)
    s = run(tiny_model, drafter).stats
    assert s.new_tokens == 40
    assert 1 + sum(s.accepted_per_step) == s.new_tokens  # first token comes from prefill
    assert s.tau == pytest.approx(39 / s.decode_steps)
    assert 0 < s.acceptance_rate < 1
    assert s.accepted_tokens == sum(s.accepted_per_step) - s.decode_steps
    assert len(s.step_ms) == s.decode_steps


def test_context_full_ends_generation(tiny_model):
    engine = TorchEngine(tiny_model, len(PROMPT) + 5)
    result = generate(engine, PROMPT, StopChecker((), (), 100, decode), GREEDY, NgramDrafter(budget=4))
    assert result.finish_reason == "context"
    assert len(result.token_ids) == 6  # 5 in cache + the last sampled token


def test_same_seed_same_output(tiny_model):
    sampling = SamplingParams(temperature=1.0, seed=11)
    first, second = (run(tiny_model, NgramDrafter(budget=4), sampling=sampling).token_ids for _ in range(2))
    assert first == second
    assert run(tiny_model, NgramDrafter(budget=4), sampling=SamplingParams(temperature=1.0, seed=12)).token_ids != first


class RandomDrafter:
    """Samples drafts from a fixed distribution q and reports q (a stochastic drafter)."""

    def __init__(self, q: torch.Tensor, seed: int, budget: int = 3):
        self.q, self.g, self.budget = q, torch.Generator().manual_seed(seed), budget

    def propose(self, context, max_tokens, last=None):  # max_tokens may be 0: the loop asks every step
        tokens = torch.multinomial(self.q, max_tokens, replacement=True, generator=self.g).tolist() if max_tokens else []
        return DraftTree.chain([context[-1]] + tokens, self.q.repeat(max_tokens, 1))


@pytest.mark.parametrize("drafter_kind", ["ngram", "random"])
def test_speculative_sampling_matches_plain_distribution(drafter_kind):
    model = random_decoder(seed=5, vocab=5, max_pos=32)
    prompt, n = [1, 2, 1, 2, 1], 3
    params = SamplingParams(temperature=1.0, top_k=4)
    expected = exact_sequence_probs(model, prompt, n, params)
    counts = Counter()
    for seed in range(3000):
        drafter = NgramDrafter(2, 1, 3) if drafter_kind == "ngram" else RandomDrafter(
            torch.tensor([0.4, 0.3, 0.1, 0.1, 0.1]), seed + 100_000)  # independent of the sampler
        sampling = SamplingParams(temperature=1.0, top_k=4, seed=seed)
        counts[tuple(run(model, drafter, max_new=n, sampling=sampling, prompt=prompt).token_ids)] += 1
    assert not chi_square_rejects(counts, expected)
    # power: a different temperature's distribution is rejected by the same check
    assert chi_square_rejects(counts, exact_sequence_probs(model, prompt, n, SamplingParams(temperature=0.5)))


def test_int4_packed_model_verifies_bit_for_bit():
    """With every linear on the int4 kernel, a verify pass equals plain steps exactly, so greedy
    speculation reproduces plain greedy with no near-tie allowance at all."""
    from helpers import gguf_grid_decoder

    model = gguf_grid_decoder()
    assert len(model.packed_weights) == 2 * 4 + 1  # every layer linear and the lm_head
    block = TorchEngine(model, 32)
    block.prefill(PROMPT)
    logits = block.verify(DraftTree.chain([1, 2, 3, 4, 5])).logits
    step = TorchEngine(model, 32)
    step.prefill(PROMPT)
    for i, token in enumerate([1, 2, 3, 4, 5]):
        assert torch.equal(step.verify(DraftTree(token)).logits[0], logits[i])
        step.commit([0])
    reference = greedy_reference(model, PROMPT, 40)
    for draft_len in (2, 5):
        drafter = ScriptedDrafter(len(PROMPT), reference, model.cfg.vocab_size, corrupt_every=3, budget=draft_len)
        assert run(model, drafter).token_ids == reference
