"""Integration tests on the real SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to float32).

Lossless here means identical tokens. fp32 matmuls are not batch-invariant (a row computed alone and
inside an N-row verify pass differ by ~1e-6 relative), so speculation may flip an argmax where the top
two logits are within that noise. At a divergence the tests report the top-2 logit gap of plain
decoding at that position: a gap under NEAR_TIE is such a flip (reported, not a failure); any other
divergence is a bug and fails.
"""

import pytest
import torch

from helpers import SMOLLM2_PROMPTS as PROMPTS, ScriptedDrafter, assert_lossless
from mtpctl.model.linears import blocked_layout_available
from mtpctl.model.row_invariance import path_of, row_invariant
from mtpctl.drafters.ngram import NgramDrafter
from mtpctl.backends.torch import TorchEngine
from mtpctl.decode.sampling import SamplingParams
from mtpctl.decode.tree import DraftTree

pytestmark = pytest.mark.real
GREEDY = SamplingParams()


def test_logits_match_transformers(smollm2, smollm2_folder):
    from transformers import AutoModelForCausalLM

    ids = smollm2.encode(PROMPTS[1])
    reference = AutoModelForCausalLM.from_pretrained(str(smollm2_folder), dtype=torch.float32)
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    ours = TorchEngine(smollm2.model, len(ids)).verify(DraftTree.chain(ids)).logits
    # float32 kernels that sum in another order (oneDNN's blocked layout vs MKL): ~1e-4 on logits of
    # magnitude ~20, i.e. ~5e-6 relative
    assert (ours - expected).abs().max().item() <= 3e-4


def test_64_token_greedy_matches_transformers_generate(smollm2, smollm2_folder):
    from transformers import AutoModelForCausalLM

    ids = smollm2.encode("Tell me a long story about a lighthouse keeper and a storm.")
    reference = AutoModelForCausalLM.from_pretrained(str(smollm2_folder), dtype=torch.float32)
    expected = reference.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False,
                                  eos_token_id=sorted(smollm2.codec.eos_ids))[0, len(ids):].tolist()
    ours = smollm2.generate(ids, 64, GREEDY).token_ids
    assert len(ours) == 64
    assert ours == expected


@pytest.fixture(scope="module")
def plain_results(smollm2):
    return {p: smollm2.generate(smollm2.encode(p), 64, GREEDY) for p in PROMPTS}


@pytest.fixture(scope="module")
def plain_outputs(plain_results):
    return {p: r.token_ids for p, r in plain_results.items()}


def test_incremental_text_equals_a_full_decode(smollm2, plain_results):
    for result in plain_results.values():
        assert result.text == smollm2.codec.decode(result.token_ids)


@pytest.mark.parametrize("draft_len", [1, 3, 6])
@pytest.mark.parametrize("prompt", PROMPTS, ids=["repeat", "code", "list", "summary"])
def test_ngram_greedy_is_lossless(smollm2, plain_outputs, prompt, draft_len):
    ids = smollm2.encode(prompt)
    spec = smollm2.generate(ids, 64, GREEDY, NgramDrafter(3, 1, draft_len))
    assert_lossless(smollm2, ids, plain_outputs[prompt], spec.token_ids)
    assert spec.stats.new_tokens == len(spec.token_ids) <= 64


def test_ngram_accepts_drafts_on_a_repeating_prompt(smollm2):
    ids = smollm2.encode(PROMPTS[0])
    stats = smollm2.generate(ids, 64, GREEDY, NgramDrafter(3, 1, 6)).stats
    assert stats.tau > 1.5 and stats.acceptance_rate > 0.3


def test_stop_string_inside_an_accepted_block(smollm2, plain_outputs):
    ids = smollm2.encode(PROMPTS[2])
    plain = plain_outputs[PROMPTS[2]]
    text = smollm2.codec.decode(plain)
    stop = text[len(text) // 2: len(text) // 2 + 4]
    expected = smollm2.generate(ids, 64, GREEDY, stop_strings=[stop])
    drafter = ScriptedDrafter(len(ids), plain, smollm2.model.cfg.vocab_size)  # accepts whole blocks
    spec = smollm2.generate(ids, 64, GREEDY, drafter, stop_strings=[stop])
    assert spec.finish_reason == expected.finish_reason == "stop"
    assert spec.token_ids == expected.token_ids and spec.text == expected.text
    assert stop not in spec.text and len(spec.token_ids) < len(plain)
    assert max(spec.stats.accepted_per_step) == 7  # whole blocks were accepted before the stop


@pytest.mark.parametrize("max_new", [1, 2, 5])  # 5 = draft-len - 1
def test_max_new_tokens_with_speculation(smollm2, plain_outputs, max_new):
    ids = smollm2.encode(PROMPTS[0])
    drafter = ScriptedDrafter(len(ids), plain_outputs[PROMPTS[0]], smollm2.model.cfg.vocab_size)
    result = smollm2.generate(ids, max_new, GREEDY, drafter)
    assert result.token_ids == plain_outputs[PROMPTS[0]][:max_new]
    assert result.finish_reason == "length"


@pytest.fixture(scope="module")
def smollm2_int4(smollm2_folder):
    from mtpctl.backends.torch import TorchSession

    return TorchSession(smollm2_folder, dtype="bfloat16", weights="int4")


@pytest.mark.parametrize("prompt", PROMPTS[:3], ids=["repeat", "code", "list"])
def test_int4_ngram_greedy_is_bit_exact(smollm2_int4, prompt):
    """bfloat16 + int4 weights: every kernel on the path is batch-invariant, so speculation must
    reproduce plain greedy exactly (no near-tie allowance)."""
    assert len(smollm2_int4.model.packed_weights) == 30 * 4 + 1
    ids = smollm2_int4.encode(prompt)
    plain = smollm2_int4.generate(ids, 64, GREEDY).token_ids
    for draft_len in (3, 6):
        spec = smollm2_int4.generate(ids, 64, GREEDY, NgramDrafter(3, 1, draft_len))
        assert spec.token_ids == plain


@pytest.mark.parametrize("keep_bytes", [3000, 50_000_000])
def test_truncated_real_gguf_fails_cleanly(tmp_path, monkeypatch, capsys, keep_bytes):
    from mtpctl.cli.main import main
    from mtpctl.model.sources import alias_gguf_path

    monkeypatch.setenv("MTPCTL_HOME", str(tmp_path / "home"))
    truncated = tmp_path / "cut.gguf"
    with open(alias_gguf_path("smollm2-135m"), "rb") as src:
        truncated.write_bytes(src.read(keep_bytes))
    assert main(["generate", "--model", str(truncated), "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a readable GGUF file" in err
    assert list((tmp_path / "home" / "models").glob("*")) == []  # no half-written import
    assert truncated.stat().st_size == keep_bytes


@pytest.fixture(scope="module")
def smollm2_bf16(smollm2_folder):
    from mtpctl.backends.torch import TorchSession

    return TorchSession(smollm2_folder, dtype="bfloat16")


def test_bfloat16_verify_rows_equal_plain_decoding_bit_for_bit(smollm2_bf16):
    """Dense bfloat16: every row of a 4-token verify pass equals one-token decoding of the same
    prefix, at every length of a real generation. Before one-row products were computed as two
    (model._linear), the chain's first row differed from plain decoding at 1 of these lengths (the
    MLP's down projection, 1 ulp), enough to flip a near-tie."""
    assert_verify_rows_equal_plain_decoding(smollm2_bf16)


def test_float32_verify_rows_equal_plain_decoding_bit_for_bit(smollm2):
    """float32 with the linear weights on the path a Session takes on this CPU (oneDNN's blocked layout
    where it passed its row-invariance check here, else torch's matmul in fixed blocks of rows):
    batch-invariant, unlike torch's default float32 kernel, so float32 verification is bit-exact as well."""
    path = path_of(smollm2.model.layers[0].gate_up)
    assert path == ("onednn-float32" if blocked_layout_available() and row_invariant("onednn-float32")
                    else "fixed-rows-float32")
    assert_verify_rows_equal_plain_decoding(smollm2)


def assert_verify_rows_equal_plain_decoding(session):
    ids = session.encode("Explain how a hash map works in three sentences.")
    tokens = session.generate(ids, 28, GREEDY).token_ids
    steps, chains = TorchEngine(session.model, 128), TorchEngine(session.model, 128)
    steps.prefill(ids)
    chains.prefill(ids)
    alone = []
    for t in tokens:
        alone.append(steps.verify(DraftTree.chain([t])).hidden_states[0].clone())
        steps.commit([0])
    for k in range(len(tokens) - 4):
        block = chains.verify(DraftTree.chain(tokens[k:k + 4])).hidden_states
        for i in range(4):
            assert torch.equal(block[i], alone[k + i]), f"length {len(ids) + k}, row {i}"
        chains.commit([0])


@pytest.mark.parametrize("prompt", PROMPTS, ids=["repeat", "code", "list", "summary"])
def test_bfloat16_ngram_greedy_is_bit_exact(smollm2_bf16, prompt):
    """Dense bfloat16 is batch-invariant too (one-row products padded to two), so n-gram speculation
    reproduces plain greedy exactly, no near-tie allowance."""
    ids = smollm2_bf16.encode(prompt)
    plain = smollm2_bf16.generate(ids, 64, GREEDY).token_ids
    spec = smollm2_bf16.generate(ids, 64, GREEDY, NgramDrafter(3, 1, 4))
    assert spec.token_ids == plain
