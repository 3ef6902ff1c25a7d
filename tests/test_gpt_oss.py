"""gpt-oss (``gpt_oss``) on tiny random checkpoints written by transformers' own ``GptOssForCausalLM``
(float32): every prefill logit and greedy decoding equal transformers' on prompts longer than the
sliding window, so windows, sinks, biases and the clamped SwiGLU experts all count; prompt lookup,
a scripted drafter and batches equal plain decoding; its MoE block gives a row alike alone and in any
pass; the native attention kernel is not used for it (it takes no sinks)."""

import dataclasses

import pytest
import torch

from helpers import (FAMILY_PROMPTS, MOE_COMMON, assert_equals_transformers, assert_speculation_equals_plain,
                     random_reference_model, write_moe_checkpoints, write_tiny_checkpoint)

from mtpctl.backends.torch import TorchEngine
from mtpctl.decode.tree import DraftTree
from mtpctl.model.config import DecoderConfig
from mtpctl.model.decoder import Decoder
from mtpctl.model.moe import MoeConfig, MoeWeights, moe_mlp

transformers = pytest.importorskip("transformers")

#: 3 layers (slide, full, slide), a window of 4 tokens: every prompt is longer than it
CONFIG = {**MOE_COMMON, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 24,
          "sliding_window": 4, "swiglu_limit": 1.0}
#: FAMILY_PROMPTS and a longer, repetitive one (prompt lookup drafts from it)
PROMPTS = FAMILY_PROMPTS + ([7, 8, 9, 10, 11] * 4,)
NEW = 24


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(transformers' model, its save_pretrained folder with the tiny tokenizer): sinks and router biases
    drawn N(0, 1) so they move the softmaxes and the routing; a SwiGLU limit of 1 so the clamps bite."""
    root = tmp_path_factory.mktemp("gpt_oss")
    reference = random_reference_model("gpt_oss", **CONFIG)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if name.endswith(("sinks", "router.bias")):
                p.normal_(0, 1)
    folders = write_moe_checkpoints(root, "gpt_oss", reference, write_tiny_checkpoint(root / "tokenizer"))
    return reference, folders["per_expert"]


def test_config_and_tensor_map(checkpoint):
    _, folder = checkpoint
    cfg = DecoderConfig.from_folder(folder)
    assert cfg.layer_windows == (4, None, 4) and cfg.attention_sinks and cfg.attention_bias
    assert cfg.rope.rope_type == "yarn" and not cfg.rope.truncate and cfg.rope.theta == 150000.0
    assert cfg.moe.scoring == "topk_softmax" and cfg.moe.swiglu_limit == 1.0 and cfg.moe.swiglu_alpha == 1.702
    assert cfg.family.kernels == ("torch",) and not cfg.family.exportable
    model = Decoder.from_folder(folder)
    assert model.layers[0].experts_gate_up.shape == (4, 64, 48) and model.layers[0].sinks.shape == (4,)


def test_defaults_of_a_bare_config():
    cfg = DecoderConfig.from_dict({"model_type": "gpt_oss"})
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim, cfg.moe.num_experts, cfg.moe.top_k) == \
        (2880, 36, 64, 128, 4)
    assert cfg.layer_windows[:2] == (128, None) and cfg.rope.factor == 32.0 and cfg.moe.swiglu_limit == 7.0


def test_logits_and_greedy_tokens_equal_transformers_in_float32(checkpoint):
    reference, folder = checkpoint
    assert_equals_transformers(reference, Decoder.from_folder(folder), folder, PROMPTS, NEW)


def test_prefill_without_plans_equals_transformers(checkpoint):
    """The masked prefill path (no AttentionPlan: sinks by hand, torch's SDPA takes none)."""
    reference, folder = checkpoint
    model = Decoder.from_folder(folder)
    prompt = PROMPTS[-1]
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
    engine = TorchEngine(model, len(prompt) + 1, native=False)
    assert (engine.prefill(list(prompt))[0] - expected[-1]).abs().max() < 1e-4


@pytest.mark.parametrize("part", ["sinks", "windows"])
def test_sinks_and_windows_move_the_logits(checkpoint, part):
    """The parity above would catch a block without them: each changes the logits past 1e-4."""
    reference, folder = checkpoint
    model = Decoder.from_folder(folder)
    if part == "sinks":
        for layer in model.layers:
            layer.sinks.data.fill_(float("-inf"))
    else:
        cfg = dataclasses.replace(model.cfg, layer_windows=(None,) * 3)
        for layer in model.layers:
            layer.cfg = cfg
        model.cfg = cfg
    prompt = PROMPTS[-1]
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
    ours = TorchEngine(model, len(prompt) + 1).verify(DraftTree.chain(prompt)).logits
    assert (ours - expected).abs().max() > 1e-3


def test_speculation_and_batches_equal_plain_decoding(checkpoint):
    assert_speculation_equals_plain(checkpoint[1], "float32", PROMPTS, NEW)


def test_the_moe_block_gives_a_row_alike_alone_and_in_any_pass():
    torch.manual_seed(1)
    cfg = MoeConfig.from_hf({"hidden_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2,
                             "intermediate_size": 20, "swiglu_limit": 1.5}, "gpt_oss")
    w = MoeWeights(router=torch.randn(4, 32), gate_up=torch.randn(4, 32, 40) * 0.3, down=torch.randn(4, 20, 32) * 0.3,
                   router_bias=torch.randn(4), gate_up_bias=torch.randn(4, 40), down_bias=torch.randn(4, 32))
    x = torch.randn(11, 32)
    together = moe_mlp(x, cfg, w)
    for i in range(len(x)):
        assert torch.equal(moe_mlp(x[i:i + 1], cfg, w)[0], together[i])
    assert torch.equal(moe_mlp(x[3:9], cfg, w), together[3:9])


def test_the_native_attention_kernel_is_not_used(checkpoint):
    model = Decoder.from_folder(checkpoint[1])
    assert not TorchEngine(model, 8).native
    with pytest.raises(ValueError, match="gpt_oss's attention"):
        TorchEngine(model, 8, native=True)
