"""Lookahead decoding, the self-draft and their merges on the real SmolLM2-135M-Instruct in bfloat16
(batch-invariant: lossless means identical tokens, no near-tie allowance): greedy output is plain
greedy's alone and in a batch, and lookahead accepts drafts on chat prompts."""

import pytest

from helpers import random_heads
from mtpctl.backends.torch import TorchSession
from mtpctl.decode.sampling import SamplingParams
from mtpctl.decode.session import GenerationRequest
from mtpctl.drafters.draft_model import DraftModelDrafter
from mtpctl.drafters.heads.medusa import MedusaDrafter
from mtpctl.drafters.heads.tree import StaticTree
from mtpctl.drafters.hybrid import HybridDrafter
from mtpctl.drafters.lookahead import LookaheadDrafter, LookaheadSettings
from mtpctl.drafters.merged import MergedDrafter
from mtpctl.drafters.ngram import NgramDrafter
from mtpctl.drafters.self_draft import layer_subset

pytestmark = pytest.mark.real
GREEDY = SamplingParams()
NEW = 48
PROMPTS = [
    "Repeat this sentence exactly, twice: The quick brown fox jumps over the lazy dog.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Hi! I just adopted a cat. What should I buy first?",
    "Summarize in two sentences: Speculative decoding lets a cheap drafter propose several tokens "
    "that the large model verifies in a single forward pass, keeping only those it agrees with.",
]


@pytest.fixture(scope="module")
def session(smollm2_folder):
    return TorchSession(smollm2_folder, dtype="bfloat16")


@pytest.fixture(scope="module")
def prompts(session):
    return [session.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def plain(session, prompts):
    return [session.generate(ids, NEW, GREEDY).token_ids for ids in prompts]


def self_draft(session, layers=range(0, 24), draft_len=3):
    model = session.model
    return DraftModelDrafter(layer_subset(model, tuple(layers)), model.cfg.vocab_size, draft_len=draft_len)


def drafters(session):
    model = session.model
    heads = MedusaDrafter(StaticTree.from_paths([[0], [1], [0, 0]], 3),
                          random_heads(model, num_heads=3).to(model.dtype), model)
    return {"lookahead": LookaheadDrafter(),
            "lookahead 5,4,5": LookaheadDrafter(LookaheadSettings(5, 4, 5)),
            "ngram+lookahead": MergedDrafter([NgramDrafter(3, 2, 3), LookaheadDrafter()]),
            "self-draft": self_draft(session),
            "self-draft auto": self_draft(session, [0, 1, 2] + list(range(7, 30)), None),
            "heads+draft+ngram": MergedDrafter([HybridDrafter(heads, self_draft(session)), NgramDrafter(3, 2, 3)])}


@pytest.mark.parametrize("name", ["lookahead", "lookahead 5,4,5", "ngram+lookahead", "self-draft", "self-draft auto",
                                  "heads+draft+ngram"])
def test_greedy_is_plain_greedy_alone_and_batched(session, prompts, plain, name):
    drafter = drafters(session)[name]
    alone = [session.generate(ids, NEW, GREEDY, drafter) for ids in prompts]
    assert [r.token_ids for r in alone] == plain
    assert sum(r.stats.accepted_tokens for r in alone) > 0
    batched = session.generate_batch([GenerationRequest(ids, NEW) for ids in prompts], drafter, max_batch=3)
    assert [o.token_ids for o in batched] == plain


def test_lookahead_accepts_on_a_chat_prompt_where_prompt_lookup_finds_little(session, prompts, plain):
    chat = prompts[2]
    lookahead = session.generate(chat, NEW, GREEDY, LookaheadDrafter()).stats
    assert lookahead.tau > 1.1 and lookahead.accepted_tokens >= 4
