"""ERNIE 4.5 MoE (ernie4_5_moe) on a tiny random checkpoint written by transformers' own classes: layers 0
and 3 dense, 1 and 2 MoE (``moe_layer_start_index``/``moe_layer_end_index``), two shared experts, a non-zero
``moe_statics`` selection bias, interleaved rotary, tied embeddings. Both expert layouts load; every prefill
logit and 16 greedy tokens equal transformers' in float32; prompt lookup, a scripted drafter and a batch
equal plain decoding in float32 and bfloat16; a checkpoint with its MTP tensors (``model.mtp_*``) loads the
body and stays strict about any other name; ``use_bias`` is refused in one line."""

import json

import pytest
import torch

from helpers import (FAMILY_PROMPTS, assert_equals_transformers, assert_speculation_equals_plain,
                     random_reference_model, write_moe_checkpoints, write_tiny_checkpoint)

from mtpctl.errors import CorruptModel, UnsupportedModel
from mtpctl.model.config import DecoderConfig
from mtpctl.model.decoder import Decoder
from mtpctl.model.moe import MoeWeights, route

transformers = pytest.importorskip("transformers")

CONFIG = dict(vocab_size=259, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=257,
              eos_token_id=258, moe_num_experts=8, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=2,
              moe_layer_start_index=1, moe_layer_end_index=2)
NEW = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(transformers' model, {"per_expert": folder, "stacked": folder}), each with the tiny tokenizer."""
    root = tmp_path_factory.mktemp("ernie")
    reference = random_reference_model("ernie4_5_moe", **CONFIG)
    return reference, write_moe_checkpoints(root, "ernie4_5_moe", reference, write_tiny_checkpoint(root / "tokenizer"))


def test_the_checkpoint_has_what_the_family_reads(checkpoint):
    from safetensors import safe_open

    reference, where = checkpoint
    with safe_open(str(where["per_expert"] / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"model.layers.1.mlp.experts.0.gate_proj.weight", "model.layers.1.mlp.moe_statics.e_score_correction_bias",
            "model.layers.1.mlp.shared_experts.gate_proj.weight"} <= names and "lm_head.weight" not in names
    cfg = DecoderConfig.from_folder(where["per_expert"])
    assert cfg.pair_rope and cfg.tie_word_embeddings and not cfg.attention_bias and cfg.mtp_layers == 0
    assert cfg.rope.theta == 500000.0 and cfg.moe.shared_intermediate_size == 64 and cfg.moe.norm_min == 1e-12
    model = Decoder.from_folder(where["stacked"])
    assert [layer.moe is not None for layer in model.layers] == [False, True, True, False]
    assert not model.layers[0].fused_rotary  # interleaved pairs: rope in torch's ops, not the fused kernel
    bias = reference.model.layers[1].mlp.gate.moe_statics.e_score_correction_bias
    assert bias.abs().min() > 0 and torch.equal(model.layers[1].router_bias, bias[0])
    layer = model.layers[1]
    weights = MoeWeights(router=layer.router, gate_up=layer.experts_gate_up, down=layer.experts_down,
                         score_bias=layer.router_bias)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    unbiased = MoeWeights(router=layer.router, gate_up=layer.experts_gate_up, down=layer.experts_down)
    assert not torch.equal(route(x, cfg.moe, weights).experts, route(x, cfg.moe, unbiased).experts)


@pytest.mark.parametrize("layout", ["per_expert", "stacked"])
def test_logits_and_greedy_tokens_equal_transformers_in_float32(checkpoint, layout):
    reference, where = checkpoint
    assert_equals_transformers(reference, Decoder.from_folder(where[layout]), where[layout], FAMILY_PROMPTS, NEW)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculation_and_batches_equal_plain_decoding(checkpoint, dtype):
    assert_speculation_equals_plain(checkpoint[1]["per_expert"], dtype, FAMILY_PROMPTS, NEW)


def _mtp_tensors(tensors: dict) -> dict:
    """One MTP layer as released ERNIE 4.5 checkpoints hold it: ``model.mtp_block.0.*`` (a decoder layer:
    the last one's tensors), ``model.mtp_emb_norm.0``, ``model.mtp_hidden_norm.0``, ``model.mtp_linear_proj.0``."""
    last = "model.layers.3."
    out = {"model.mtp_block.0." + n[len(last):]: t.clone() for n, t in tensors.items() if n.startswith(last)}
    out.update({"model.mtp_emb_norm.0.weight": torch.ones(64), "model.mtp_hidden_norm.0.weight": torch.ones(64),
                "model.mtp_linear_proj.0.weight": torch.randn(64, 128)})
    return out


def test_a_checkpoint_with_mtp_tensors_loads_the_body_and_stays_strict_otherwise(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    src = checkpoint[1]["per_expert"]
    tensors = load_file(str(src / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    body = Decoder.from_folder(src)

    def write(name, extra):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
        save_file({**tensors, **extra}, str(folder / "model.safetensors"))
        return folder

    folder = write("mtp", _mtp_tensors(tensors))
    assert DecoderConfig.from_folder(folder).mtp_layers == 1
    model = Decoder.from_folder(folder)
    assert len(model.layers) == 4
    for (name, ours), theirs in zip(model.state_dict().items(), body.state_dict().values()):
        assert torch.equal(ours, theirs), name
    with pytest.raises(CorruptModel) as caught:
        Decoder.from_folder(write("stray", {**_mtp_tensors(tensors), "model.layers.0.mtp_linear_proj.weight":
                                            torch.ones(64, 128)}))
    assert "unexpected" in str(caught.value) and "\n" not in str(caught.value)


def test_use_bias_is_refused_in_one_line(checkpoint):
    cfg = json.loads((checkpoint[1]["per_expert"] / "config.json").read_text())
    with pytest.raises(UnsupportedModel) as caught:
        DecoderConfig.from_dict({**cfg, "use_bias": True})
    assert "use_bias" in str(caught.value) and "\n" not in str(caught.value)
