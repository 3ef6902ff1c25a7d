"""Pairing and draft-model speculation on the real SmolLM2-135M-Instruct and Gemma 3 270M.

The two are ``incompatible`` (other tokenization, other BOS rule), so they pair only through the
cross-tokenizer text mode; greedy output there must equal plain greedy of the target (up to a flip at
a near-tie of fp32 verification, see test_real_smollm2.py). SmolLM2 drafting for itself through the
text path checks that the text round trip loses nothing: almost every draft token is accepted.
"""

import pytest
import torch

from mtpctl.drafters.pairing import INCOMPATIBLE, compare, draft_model_drafter, load_vocabulary
from mtpctl.drafters.draft_model import DraftModelDrafter, TextBridge
from mtpctl.decode.sampling import SamplingParams
from helpers import assert_lossless

pytestmark = pytest.mark.real
GREEDY = SamplingParams()
PROMPTS = ["List the planets of the solar system in order, one per line.",
           "Write a Python function that returns the n-th Fibonacci number."]
N = 32


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread: on the small shared test machine a descheduled second thread stalls every
    small op of a decode step."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def vocabs(smollm2_folder, gemma3_folder):
    return load_vocabulary(smollm2_folder), load_vocabulary(gemma3_folder)


@pytest.fixture(scope="module")
def gemma3(gemma3_folder, one_thread):
    from mtpctl.backends.torch import TorchSession

    return TorchSession(gemma3_folder)


def test_smollm2_and_gemma3_are_incompatible_both_ways(vocabs):
    smol, gemma = vocabs
    p = compare(smol, gemma)
    assert p.verdict == INCOMPATIBLE and p.id_map is None
    assert p.evidence["first_difference"] == {"id": 0, "target": "<|endoftext|>", "draft": "<pad>"}
    assert (p.evidence["target"]["logits_width"], p.evidence["draft"]["logits_width"]) == (49152, 262144)
    assert p.evidence["target"]["adds_before"] == [] and p.evidence["draft"]["adds_before"] == ["<bos>"]
    assert "different BPE merges" in p.reasons
    back = compare(gemma, smol)
    assert back.verdict == INCOMPATIBLE and back.evidence["first_difference"]["target"] == "<pad>"


def test_smollm2_drafting_for_itself_through_text(smollm2, vocabs, one_thread):
    """The target as its own draft through decode -> re-encode: greedy equals plain greedy and
    nearly every draft token is accepted (the text round trip keeps the ids)."""
    tok = smollm2.codec.tokenizer
    for prompt in PROMPTS:
        ids = smollm2.encode(prompt)
        plain = smollm2.generate(ids, N, GREEDY).token_ids
        bridge = TextBridge.from_tokenizers(tok, tok, sorted(smollm2.codec.eos_ids))
        drafter = DraftModelDrafter(smollm2.model, smollm2.model.cfg.vocab_size, draft_len=4, text=bridge)
        spec = smollm2.generate(ids, N, GREEDY, drafter)
        assert_lossless(smollm2, ids, plain, spec.token_ids)
        assert spec.stats.acceptance_rate >= 0.9, spec.stats.acceptance_rate


@pytest.mark.parametrize("direction", ["smollm2<-gemma3", "gemma3<-smollm2"])
def test_cross_tokenizer_greedy_is_plain_greedy(direction, smollm2, gemma3, vocabs, one_thread):
    smol_v, gemma_v = vocabs
    if direction == "smollm2<-gemma3":
        target, draft, pairing = smollm2, gemma3, compare(smol_v, gemma_v)
    else:
        target, draft, pairing = gemma3, smollm2, compare(gemma_v, smol_v)
    ids = target.encode(PROMPTS[0], chat=target.codec.has_chat_template)
    plain = target.generate(ids, N, GREEDY)
    drafter = draft_model_drafter(pairing, draft.model, target.model.cfg.vocab_size, GREEDY, 4)
    assert drafter.text is not None
    spec = target.generate(ids, N, GREEDY, drafter)
    assert_lossless(target, ids, plain.token_ids, spec.token_ids)
    assert spec.stats.draft_tokens > 0 and spec.stats.accepted_tokens > 0
    print(f"{direction}: acceptance {spec.stats.acceptance_rate:.2f}, tau {spec.stats.tau:.2f}")
