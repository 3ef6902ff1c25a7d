"""Hybrid bodies (Qwen3.5's Gated DeltaNet layers) as draft models, on tiny random checkpoints built by
transformers' classes: greedy decoding with a hybrid draft for a hybrid target and for a dense target
equals plain greedy (with rejected and accepted drafts, fixed and auto draft lengths, the text mode and
a self-draft), batch rows equal their requests alone, sampled drafts keep the target's distribution,
and a rollback anywhere in the last chain restores the draft's states bit for bit, their memory bounded
and reported."""

from collections import Counter

import pytest
import torch

from helpers import (PROMPT, cli, exact_sequence_probs, random_decoder,
                     randomize_hybrid_weights, run, write_tiny_checkpoint)
from mtpctl.backends.torch import TorchEngine, verify_packed
from mtpctl.decode.drafter import propose_all
from mtpctl.decode.loop import Request, generate, run as run_batch
from mtpctl.decode.sampling import SamplingParams
from mtpctl.decode.stopping import StopChecker
from mtpctl.decode.tree import DraftTree
from mtpctl.drafters.draft_model import DraftModelDrafter, TextBridge
from mtpctl.drafters.self_draft import layer_subset
from mtpctl.errors import UnsupportedModel
from mtpctl.model.config import DecoderConfig
from mtpctl.model.decoder import Decoder
from stats_util import chi_square_rejects

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen3_5")

from test_qwen3_5 import TINY  # noqa: E402 (after the skips: it imports transformers' Qwen3.5)

VOCAB = TINY["vocab_size"]
LINEAR_LAYERS = 2  # TINY: Gated DeltaNet, full attention, Gated DeltaNet
NEW = 32


def hybrid(seed: int = 0, scale: float = 1.5, noise: float = 0.0, replace=None, **overrides) -> Decoder:
    """transformers' tiny random Qwen3.5 text model (``randomize_hybrid_weights``) as an mtpctl decoder
    with its linear weights blocked, as a session loads it; ``noise``: seeded N(0, noise) added to every
    tensor (a draft that agrees with the un-noised model often, not always); ``replace``: checkpoint
    tensors to use instead of its own."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    reference = randomize_hybrid_weights(Qwen3_5ForCausalLM(Qwen3_5TextConfig(**{**TINY, **overrides})).eval(), scale)
    tensors = reference.state_dict()
    if noise:
        g = torch.Generator().manual_seed(seed + 100)
        tensors = {k: v + noise * torch.randn(v.shape, generator=g) for k, v in tensors.items()}
    tensors.update(replace or {})
    model = Decoder(DecoderConfig.from_dict({**reference.config.to_dict(), "architectures": ["Qwen3_5ForCausalLM"]}))
    model.load_hf_tensors(tensors, blocked=True)
    return model


@pytest.fixture(scope="module")
def target():
    return hybrid(0)


@pytest.fixture(scope="module")
def draft():
    return hybrid(0, noise=0.005)


@pytest.fixture(scope="module")
def plain(target):
    return run(target, max_new=NEW).token_ids


def state_bytes(model: Decoder) -> int:
    return LINEAR_LAYERS * model.cfg.deltanet.state_bytes


@pytest.mark.parametrize("draft_len", [3, None])
def test_a_hybrid_draft_for_a_hybrid_target_is_plain_greedy(target, draft, plain, draft_len):
    drafter = DraftModelDrafter(draft, VOCAB, draft_len=draft_len)
    result = run(target, drafter, max_new=NEW)
    assert result.token_ids == plain
    assert 0 < result.stats.acceptance_rate < 1  # drafts accepted and drafts rejected
    kept = result.stats.drafter_state_bytes_max  # one chain's commits' states, at most budget - 1 of them
    assert 0 < kept <= (drafter.budget - 1) * state_bytes(draft) and kept % state_bytes(draft) == 0
    if draft_len == 3:
        assert kept == 2 * state_bytes(draft)
    assert result.stats.to_dict()["drafter_state_bytes_max"] == kept


def test_a_hybrid_draft_for_a_dense_target_is_plain_greedy():
    """A dense target whose layers add nothing (its output projections zeroed: a bigram model of its
    untied embeddings) and a hybrid draft with its embeddings, lm_head and final norm whose own layers
    move the logits a little: they agree often, not always."""
    dense = random_decoder(seed=3, tie_word_embeddings=False)
    with torch.no_grad():
        for layer in dense.layers:
            layer.o_proj.zero_()
            layer.down.zero_()
    shared = {"model.embed_tokens.weight": dense.embed, "lm_head.weight": dense.lm_head,
              "model.norm.weight": dense.norm - 1}  # Qwen3.5's final norm holds w of 1 + w
    hybrid_draft = hybrid(1, scale=0.3, replace=shared)
    expected = run(dense, max_new=NEW).token_ids
    assert len(set(expected)) > 10
    result = run(dense, DraftModelDrafter(hybrid_draft, VOCAB, draft_len=3), max_new=NEW)
    assert result.token_ids == expected and 0 < result.stats.acceptance_rate < 1


@pytest.mark.parametrize("accepted", [0, 2, 4])
def test_a_rollback_in_the_chain_restores_the_drafts_state_bit_for_bit(draft, accepted):
    """After a chain of 4 of which ``accepted`` are taken (then another token), the draft rolls back to
    the commit after the last accepted token and feeds only the new token: its Gated DeltaNet states and
    next chain equal those of a fresh drafter fed the same context (its prefill, then the tokens after
    it in one pass), bit for bit."""
    context = list(PROMPT)
    drafter = DraftModelDrafter(draft, VOCAB, draft_len=4)
    first = drafter.propose(context, 4).tokens[1:]
    assert drafter.draft_state_bytes == 3 * state_bytes(draft)  # the catch-up's and two draft steps' commits
    new = context + first[:accepted] + [(first[accepted] + 1) % VOCAB if accepted < 4 else 7]
    fed = []
    original = draft.forward
    draft.forward = lambda *args, **kwargs: fed.append(args[0].shape[1]) or original(*args, **kwargs)
    try:
        second = drafter.propose(new, 4).tokens[1:]
    finally:
        del draft.forward
    assert fed[0] == (2 if accepted == 4 else 1)  # no prefill: the new token (and the last draft, not fed before)
    fresh = DraftModelDrafter(draft, VOCAB, draft_len=4)
    fresh.propose(context, 1)  # the same prefill, no draft step
    assert fresh.propose(new, 4).tokens[1:] == second
    mine, theirs = drafter.engine.cache.linear, fresh.engine.cache.linear
    assert drafter.engine.length == fresh.engine.length
    assert all(mine.committed[i].equal(theirs.committed[i]) for i in mine.layers)


def test_the_linear_cache_rolls_back_only_to_kept_commits(draft):
    engine = TorchEngine(draft, 64)
    engine.keep_history(2)
    engine.prefill(list(PROMPT))
    states = {}
    for token in (11, 22, 33):
        states[engine.length] = engine.cache.linear.committed
        engine.verify(DraftTree(token))
        engine.commit([0])
    n = len(PROMPT)  # commits kept: after n + 1 and n + 2 tokens (two), not after n
    assert engine.history_bytes == 2 * state_bytes(draft)
    assert [engine.reachable(n + i) for i in range(5)] == [0, n + 1, n + 2, n + 3, n + 3]
    with pytest.raises(UnsupportedModel) as caught:
        engine.rollback(n)
    assert "cannot roll a Gated DeltaNet state back" in str(caught.value) and "\n" not in str(caught.value)
    engine.rollback(n + 1)
    assert engine.cache.linear.committed is states[n + 1] and engine.history_bytes == 0
    engine.rollback(0)  # the empty sequence: zeros
    assert all(not s.recurrent.any() for s in engine.cache.linear.committed.values())


def test_the_text_mode_and_a_self_draft_are_plain_greedy(target, draft, plain, tmp_path):
    """Text mode re-encodes the output each call, so the draft may need to roll back before its last
    chain: it rolls back to the longest prefix it kept a state for (else prefills). Self-drafts keep the
    target's first two layers (Gated DeltaNet and attention) or its first alone."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(write_tiny_checkpoint(tmp_path / "tokenizer")))
    bridge = TextBridge.from_tokenizers(tokenizer, tokenizer, [TINY["eos_token_id"]])
    result = run(target, DraftModelDrafter(draft, VOCAB, draft_len=3, text=bridge), max_new=NEW)
    assert result.token_ids == plain and result.stats.draft_tokens > 0
    sub = layer_subset(target, (0, 1))
    assert sub.cfg.deltanet.layer_types == ("linear_attention", "full_attention") and sub.layers[1].cache_index == 0
    for layers in ((0, 1), (0,)):  # (0,): no attention layer, a KV cache of no layers
        result = run(target, DraftModelDrafter(layer_subset(target, layers), VOCAB, draft_len=None), max_new=NEW)
        assert result.token_ids == plain and result.stats.draft_tokens > 0


def test_batch_rows_with_hybrid_draft_forks_equal_their_requests_alone(target, draft):
    prompts = [list(PROMPT), [5, 17, 42, 99], [9, 8, 7, 9, 8, 7], [100, 101]]
    news = [NEW, 12, 20, 7]
    drafter = DraftModelDrafter(draft, VOCAB, draft_len=3)
    alone = [run(target, drafter.fork(), max_new=n, prompt=p).token_ids for p, n in zip(prompts, news)]
    requests = [Request(p, StopChecker([], [], n, lambda ids: ""), SamplingParams(), drafter.fork())
                for p, n in zip(prompts, news)]
    outcomes = run_batch(requests, lambda r: TorchEngine(target, len(r.prompt_ids) + r.stop.max_new_tokens + 4),
                         verify_packed, 4)
    assert [o.token_ids for o in outcomes] == alone
    assert sum(o.stats.draft_tokens for o in outcomes) > sum(o.stats.accepted_tokens for o in outcomes) > 0
    sampling = SamplingParams(temperature=1.0, seed=0)  # sampled forks drafting together draw as alone
    contexts = [p + [p[-1]] for p in prompts]
    forks = [DraftModelDrafter(draft, VOCAB, sampling, draft_len=3, seed=s) for s in range(4)]
    together = propose_all(forks, [(c, 3, None) for c in contexts])
    for seed, context, tree, fork in zip(range(4), contexts, together, forks):
        solo = DraftModelDrafter(draft, VOCAB, sampling, draft_len=3, seed=seed)
        solo_tree = solo.propose(context, 3)
        assert tree.tokens == solo_tree.tokens and torch.equal(tree.q, solo_tree.q)
        assert torch.equal(fork.generator.get_state(), solo.generator.get_state())


def test_a_sampled_hybrid_draft_keeps_the_target_distribution():
    """The first 3 tokens sampled with a hybrid draft (its own samples and q, chains of 2 draft tokens,
    one drafter rolled back to the shared prompt every run) follow the exact distribution of plain
    sampling (chi-square), and not that of another temperature (power)."""
    model = random_decoder(seed=5, vocab=5, max_pos=32)
    sampled_draft = hybrid(2, vocab_size=5, bos_token_id=3, eos_token_id=4)
    prompt, n = [1, 2, 1, 2, 1], 3
    params = SamplingParams(temperature=1.0, top_k=4)
    drafter = DraftModelDrafter(sampled_draft, 5, params, draft_len=3, seed=123)
    counts, drafted, runs = Counter(), 0, 400  # enough to tell temperature 0.5 apart (the power check)
    for seed in range(runs):
        engine = TorchEngine(model, len(prompt) + n + 5)
        result = generate(engine, prompt, StopChecker([], [], n + 1, lambda ids: ""),
                          SamplingParams(1.0, 4, 1.0, seed), drafter)
        counts[tuple(result.token_ids[:n])] += 1
        drafted += result.stats.draft_tokens
    assert drafted >= runs * 2  # the first step drafts 2 tokens every run
    assert not chi_square_rejects(counts, exact_sequence_probs(model, prompt, n, params))
    assert chi_square_rejects(counts, exact_sequence_probs(model, prompt, n, SamplingParams(temperature=0.5)))


def test_the_cli_drafts_with_a_hybrid_draft_and_self_draft(tmp_path, capsys):
    """``--speculate draft`` with a hybrid checkpoint as the draft (here the target itself) and as a
    self-draft: plain greedy output, the kept states in ``--json``'s stats."""
    import json

    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from helpers import copy_tokenizer_files

    torch.manual_seed(0)
    reference = randomize_hybrid_weights(Qwen3_5ForCausalLM(Qwen3_5TextConfig(**TINY)).eval(), 1.5)
    folder = tmp_path / "qwen3_5"
    reference.save_pretrained(str(folder))
    copy_tokenizer_files(write_tiny_checkpoint(tmp_path / "tokenizer"), folder)
    args = ["generate", "-m", folder, "--json", "--no-chat", "--max-new-tokens", 12, "--threads", 1, "abcabc"]
    code, out, err = cli(capsys, *args)
    assert code == 0, err
    expected = json.loads(out)["token_ids"]
    for spec in (str(folder), "self:0-1"):
        code, out, err = cli(capsys, *args, "--speculate", "draft", "--draft", spec, "--draft-len", 3,
                             "--speculate-policy", "always")
        assert code == 0, err
        got = json.loads(out)
        assert got["token_ids"] == expected and got["stats"]["draft_tokens"] > 0
        assert got["stats"]["drafter_state_bytes_max"] > 0
