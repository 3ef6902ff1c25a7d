"""Draft-model speculation on tiny random models: lossless greedy (self-draft, a perturbed draft, a
draft with permuted ids through an id map, padded logits), the target's distribution under rejection
sampling, auto draft length, the draft's KV-cache rollback, and a context longer than the draft's."""

from collections import Counter

import pytest
import torch

from helpers import PROMPT, exact_sequence_probs, greedy_reference, random_decoder, random_state_dict, run
from mtpctl.model.config import DecoderConfig
from mtpctl.drafters.draft_model import AUTO_START, DraftModelDrafter
from mtpctl.model.decoder import Decoder
from mtpctl.decode.sampling import SamplingParams
from stats_util import chi_square_rejects


def perturbed(model: Decoder, seed: int, noise: float) -> Decoder:
    """A copy of ``model`` with Gaussian noise on every weight: a draft that agrees often, not always."""
    g = torch.Generator().manual_seed(seed)
    copy = Decoder(model.cfg, model.dtype)
    copy.load_state_dict(model.state_dict())
    for p in copy.parameters():
        p.data.add_(noise * torch.randn(p.shape, generator=g))
    return copy


def relabeled(cfg_overrides: dict, seed: int, perm: torch.Tensor, width: int) -> Decoder:
    """The model ``random_decoder(seed, **cfg_overrides)`` with its vocabulary rows moved: draft id d
    is target id ``perm[d]`` (rows past ``len(perm)`` are padding, random)."""
    from helpers import tiny_config_dict

    target_cfg = DecoderConfig.from_dict(tiny_config_dict(**cfg_overrides))
    tensors = random_state_dict(target_cfg, seed)
    cfg = DecoderConfig.from_dict(tiny_config_dict(**{**cfg_overrides, "vocab": width}))
    embed = 5.0 * torch.randn(width, cfg.hidden_size, generator=torch.Generator().manual_seed(1))  # loud padding
    embed[:len(perm)] = tensors["model.embed_tokens.weight"][perm]
    tensors["model.embed_tokens.weight"] = embed
    model = Decoder(cfg)
    model.load_hf_tensors(tensors)
    return model


def test_self_draft_accepts_everything(tiny_model, tiny_reference):
    drafter = DraftModelDrafter(tiny_model, tiny_model.cfg.vocab_size, draft_len=4)
    result = run(tiny_model, drafter)
    assert result.token_ids == tiny_reference
    assert result.stats.acceptance_rate == 1.0
    assert result.stats.decode_steps == -(-39 // 5)


@pytest.mark.parametrize("draft_len", [1, 3, 6, None])
def test_greedy_with_a_different_draft_is_lossless(tiny_model, tiny_reference, draft_len):
    draft = perturbed(tiny_model, seed=1, noise=0.05)
    drafter = DraftModelDrafter(draft, tiny_model.cfg.vocab_size, draft_len=draft_len)
    result = run(tiny_model, drafter)
    assert result.token_ids == tiny_reference
    assert 0 < result.stats.acceptance_rate < 1  # both accepted and rejected draft tokens occurred


def test_rollback_reuses_the_common_prefix(tiny_model):
    """After a rejection the draft cache keeps the accepted prefix: one draft pass per call feeds the
    new tokens, and the draft's logits equal those of a fresh prefill."""
    drafter = DraftModelDrafter(tiny_model, tiny_model.cfg.vocab_size, draft_len=3)
    first = drafter.propose(PROMPT, 3).tokens[1:]
    assert drafter.forward_passes == 3  # prefill + 2 draft tokens fed (the last one is not)
    context = PROMPT + first[:1] + [(first[1] + 1) % 259]  # first accepted, second rejected
    second = drafter.propose(context, 3).tokens[1:]
    assert drafter.engine.length == len(context) + 2  # context + 2 fed draft tokens
    fresh = DraftModelDrafter(tiny_model, tiny_model.cfg.vocab_size, draft_len=3)
    assert fresh.propose(context, 3).tokens[1:] == second


def test_auto_draft_length_grows_and_shrinks(tiny_model, tiny_reference):
    good = DraftModelDrafter(tiny_model, tiny_model.cfg.vocab_size, draft_len=None, max_draft_len=7)
    steps = run(tiny_model, good).stats.drafted_per_step
    assert steps[:3] == [AUTO_START, AUTO_START + 2, 7]  # +2 after each fully accepted block, capped
    bad = DraftModelDrafter(random_decoder(seed=11), tiny_model.cfg.vocab_size, draft_len=None)
    result = run(tiny_model, bad)
    assert result.token_ids == tiny_reference
    assert result.stats.drafted_per_step[0] == AUTO_START
    assert result.stats.drafted_per_step[-6:-1] == [1] * 5  # -1 after each rejection, floor 1 (the last step has no room)


def test_id_map_and_padding_rows(tiny_model, tiny_reference):
    """A draft whose ids are a permutation of the target's and whose logits have 40 padding rows
    (with large embeddings, so they would win an argmax): through the id map it is the target itself,
    so every draft token is accepted, and no padding id is ever proposed."""
    vocab = tiny_model.cfg.vocab_size
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))
    draft = relabeled({}, 3, perm, vocab + 40)
    id_map = perm.tolist() + [-1] * 40
    drafter = DraftModelDrafter(draft, vocab, draft_len=4, id_map=id_map)
    result = run(tiny_model, drafter)
    assert result.token_ids == tiny_reference
    assert result.stats.acceptance_rate == 1.0


def test_width_mismatch_without_a_map_is_refused(tiny_model):
    with pytest.raises(ValueError, match="id map"):
        DraftModelDrafter(random_decoder(seed=1, vocab=300), tiny_model.cfg.vocab_size)
    with pytest.raises(ValueError, match="entries"):
        DraftModelDrafter(tiny_model, tiny_model.cfg.vocab_size, id_map=list(range(10)))


def test_context_longer_than_the_draft_stops_drafting(tiny_model, tiny_reference):
    """A draft with a 16-position context: drafting stops when the context reaches it, plain steps
    follow, and the output is still plain greedy."""
    draft = random_decoder(seed=3, max_pos=16)  # the target's weights, a shorter context
    drafter = DraftModelDrafter(draft, tiny_model.cfg.vocab_size, draft_len=3)
    result = run(tiny_model, drafter)
    assert result.token_ids == tiny_reference
    drafted = result.stats.drafted_per_step
    assert drafted[0] == 3 and drafted[-10:] == [0] * 10
    assert drafter.engine.capacity <= 16
    long_prompt = list(range(20))  # longer than the draft's context from the start
    assert run(tiny_model, DraftModelDrafter(draft, tiny_model.cfg.vocab_size, draft_len=3), max_new=5,
               prompt=long_prompt).token_ids == greedy_reference(tiny_model, long_prompt, 5)


@pytest.fixture
def one_thread():
    """One torch thread: these tiny models are overhead-bound, and on a shared machine a descheduled
    second intra-op thread stalls every small op."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_rejection_sampling_with_a_draft_model_keeps_the_target_distribution(one_thread):
    """The first 3 tokens sampled with a draft model (other weights, 2 padding logits rows masked by
    the id map, the target's sampling settings, q reported; chains of 2 draft tokens) follow the exact
    distribution of plain sampling (chi-square), and not that of another temperature (power). One
    drafter serves every run, so its cache is rolled back to the shared prompt each time."""
    model = random_decoder(seed=5, vocab=5, max_pos=32)
    draft = relabeled({"vocab": 5, "max_pos": 32}, 9, torch.arange(5), 7)
    prompt, n = [1, 2, 1, 2, 1], 3
    params = SamplingParams(temperature=1.0, top_k=4)
    expected = exact_sequence_probs(model, prompt, n, params)
    drafter = DraftModelDrafter(draft, 5, params, draft_len=3, id_map=[0, 1, 2, 3, 4, -1, -1], seed=123)
    counts, drafted = Counter(), 0
    for seed in range(1000):
        sampling = SamplingParams(temperature=1.0, top_k=4, seed=seed)
        result = run(model, drafter, max_new=n + 1, sampling=sampling, prompt=prompt)
        counts[tuple(result.token_ids[:n])] += 1
        drafted += result.stats.draft_tokens
    assert drafted >= 1000 * 2  # the first step drafts 2 tokens every run
    assert not chi_square_rejects(counts, expected)
    assert chi_square_rejects(counts, exact_sequence_probs(model, prompt, n, SamplingParams(temperature=0.5)))


def test_sampled_draft_reports_q_in_the_target_width():
    draft = relabeled({"vocab": 5, "max_pos": 32}, 9, torch.arange(5), 7)
    sampling = SamplingParams(temperature=1.0, seed=0)
    drafter = DraftModelDrafter(draft, 5, sampling, draft_len=3, id_map=[0, 1, 2, 3, 4, -1, -1], seed=0)
    proposal = drafter.propose([1, 2, 1], 3)
    assert proposal.is_chain and proposal.tokens[0] == 1 and proposal.q.shape == (4, 5)  # row 0: the root
    q = proposal.q[1:]
    assert torch.allclose(q.sum(-1), torch.ones(3))
    assert all(q[i, t] > 0 for i, t in enumerate(proposal.tokens[1:]))
