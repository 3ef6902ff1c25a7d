"""Batched decoding on the real SmolLM2-135M-Instruct: every request of a batch, in every numeric
mode, on both kernel paths (native, and the pure-torch path CUDA runs) and with every drafter, gets
exactly the tokens it gets decoded alone without speculation, with rows joining and leaving mid-run (the kernels compute each row alike in any pass: no near-tie
allowance here)."""

import pytest

from helpers import random_heads
from mtpctl.backends.torch import TorchSession
from mtpctl.decode.policy import AlwaysDraft, make_policy
from mtpctl.decode.sampling import SamplingParams
from mtpctl.decode.session import GenerationRequest
from mtpctl.drafters.heads.medusa import MedusaDrafter
from mtpctl.drafters.heads.tree import StaticTree
from mtpctl.drafters.merged import MergedDrafter
from mtpctl.drafters.ngram import NgramDrafter

pytestmark = pytest.mark.real
PROMPTS = ["Repeat this sentence exactly, twice: The quick brown fox jumps over the lazy dog.",
           "Write a Python function that returns the n-th Fibonacci number.",
           "List three planets, one per line.",
           "Summarize in one sentence: speculative decoding verifies several drafted tokens in one pass.",
           "What is 17 + 25?",
           "Translate to French: the cache is warm."]
NEW = [40, 24, 16, 32, 8, 20]  # rows leave at different steps; with max_batch 4 the last two join mid-run


@pytest.fixture(scope="module", params=[("float32", "dense", "native"), ("bfloat16", "dense", "native"),
                                        ("bfloat16", "int4", "native"), ("float32", "dense", "torch"),
                                        ("bfloat16", "dense", "torch")],
                ids=["float32", "bfloat16", "int4", "float32-torch-kernels", "bfloat16-torch-kernels"])
def session(request, smollm2_folder):
    dtype, weights, kernels = request.param
    return TorchSession(smollm2_folder, dtype, weights, device="cpu", kernels=kernels)


@pytest.fixture(scope="module")
def alone(session):
    ids = [session.encode(p) for p in PROMPTS]
    return ids, [session.generate(i, n).token_ids for i, n in zip(ids, NEW)]


def drafters(session):
    heads = random_heads(session.model, num_heads=2, seed=1).to(session.model.dtype)
    medusa = MedusaDrafter(StaticTree.from_paths([[0], [1], [0, 0]], 2), heads, session.model)
    return {"ngram": NgramDrafter(3, 1, 4), "heads": medusa, "heads+ngram": MergedDrafter([medusa, NgramDrafter(3, 2, 3)])}


@pytest.mark.parametrize("kind", ["none", "ngram", "heads+ngram"])
@pytest.mark.parametrize("max_batch", [2, 4])
def test_every_request_of_a_batch_equals_plain_decoding_alone(session, alone, kind, max_batch):
    ids, plain = alone
    drafter = None if kind == "none" else drafters(session)[kind]
    outcomes = session.generate_batch([GenerationRequest(i, n) for i, n in zip(ids, NEW)], drafter, max_batch,
                                      AlwaysDraft())
    assert [o.token_ids for o in outcomes] == plain


def test_the_auto_policy_changes_draft_sizes_not_tokens(session, alone):
    ids, plain = alone
    outcomes = session.generate_batch([GenerationRequest(i, n) for i, n in zip(ids, NEW)], NgramDrafter(3, 1, 4), 6,
                                      make_policy("auto", session.policy_mode))
    assert [o.token_ids for o in outcomes] == plain


def test_gemma3_batches_equal_plain_decoding_alone(gemma3_folder):
    """Sliding-window layers, q/k norms and a 262k-row lm_head, batched: each request as alone."""
    session = TorchSession(gemma3_folder, "bfloat16")
    ids = [session.encode(p, chat=False) for p in PROMPTS[:3]]
    plain = [session.generate(i, 12).token_ids for i in ids]
    outcomes = session.generate_batch([GenerationRequest(i, 12) for i in ids], NgramDrafter(3, 1, 3), 2, AlwaysDraft())
    assert [o.token_ids for o in outcomes] == plain


@pytest.mark.slow
def test_seeded_sampled_requests_commit_the_same_tokens_with_any_deterministic_drafter(session):
    """Each sampled request draws its token at each position from its own (seed, position) uniform, so
    the tokens are the same without a drafter, with prompt lookup and with heads, alone (every step
    drafting) and batched five at a time (the auto policy's changing draft sizes)."""
    ids = [session.encode(p) for p in PROMPTS[:5]]
    requests = [GenerationRequest(i, 20, SamplingParams(temperature=0.8, top_p=0.95, seed=seed))
                for seed, i in enumerate(ids)]
    plain = [o.token_ids for o in session.generate_batch(requests, None, 1)]
    for kind, drafter in drafters(session).items():
        for max_batch, policy in ((1, AlwaysDraft()), (5, make_policy("auto", session.policy_mode))):
            outcomes = session.generate_batch(requests, drafter, max_batch, policy)
            assert [o.token_ids for o in outcomes] == plain, (kind, max_batch)
