"""EAGLE-3 drafting on the real SmolLM2-135M-Instruct: the target's passes return layers 2, 15 and 27
through the native kernels' decode and verify path, and greedy output with an EAGLE-3 drafter equals
plain greedy decoding (bit for bit in bfloat16; in float32 up to a near-tie, see test_real_smollm2).
Trained heads and acceptance are checked in vLLM's company (tests/test_vllm_engine.py)."""

import pytest
import torch

from helpers import GREEDY, SMOLLM2_PROMPTS as PROMPTS, TREES, assert_lossless, perturbed

from mtpctl.backends.torch import TorchSession
from mtpctl.drafters.heads.config import HeadsConfig
from mtpctl.drafters.heads.eagle3 import Eagle3Drafter, Eagle3Head, eagle3_layer_config
from mtpctl.drafters.heads.tree import StaticTree

pytestmark = pytest.mark.real


def drafter(session, shape="mixed", seed=0):
    model = session.model
    cfg = HeadsConfig("eagle3", 4, 0, True, model.cfg.hidden_size, model.cfg.vocab_size, 4096,
                      layer=eagle3_layer_config(model.cfg))
    torch.manual_seed(seed)
    head = Eagle3Head(cfg, torch.float32, model.dense_lm_head().float(), torch.arange(4096) * 12)
    head = perturbed(head, seed, scale=0.02).to(model.dtype)
    return Eagle3Drafter(head, StaticTree.from_paths(TREES[shape], 4), lambda ids: model.embed[ids].to(model.dtype))


@pytest.fixture(scope="module")
def smollm2_bf16_eagle3(smollm2_folder):
    return TorchSession(smollm2_folder, dtype="bfloat16")


@pytest.mark.parametrize("prompt", PROMPTS[:3], ids=["repeat", "code", "list"])
def test_bfloat16_eagle3_greedy_is_bit_exact(smollm2_bf16_eagle3, prompt):
    session = smollm2_bf16_eagle3
    ids = session.encode(prompt)
    d = drafter(session)
    assert d.aux_layers == (2, 15, 27)  # the layers each pass returns to it
    plain = session.generate(ids, 48, GREEDY).token_ids
    spec = session.generate(ids, 48, GREEDY, d)
    assert spec.token_ids == plain and sum(spec.stats.drafted_per_step) > 0


def test_float32_eagle3_greedy_is_lossless(smollm2):
    ids = smollm2.encode(PROMPTS[3])
    d = drafter(smollm2, "deep-second", seed=1)
    plain = smollm2.generate(ids, 48, GREEDY).token_ids
    spec = smollm2.generate(ids, 48, GREEDY, d)
    assert_lossless(smollm2, ids, plain, spec.token_ids)
    assert sum(spec.stats.drafted_per_step) > 0
