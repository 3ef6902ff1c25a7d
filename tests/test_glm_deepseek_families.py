"""GLM-4.5 (glm4_moe) and DeepSeek-V3 (deepseek_v3) on tiny random checkpoints written by transformers'
own classes (non-zero ``e_score_correction_bias``, grouped sigmoid routing, shared experts, one dense
layer; GLM with q/k/v biases, QK-norm and partial rotary; DeepSeek with multi-head latent attention and
YaRN rope scaling): every prefill logit and 32 greedy tokens equal transformers' in float32; speculation
(prompt lookup, a scripted drafter) and batches equal plain decoding in float32 and bfloat16; MTP layers
in the published layout (``model.layers.{num_hidden_layers}.*``) are left to their reader, the rest of
loading stays strict; YaRN's frequencies and scales equal transformers'."""

import json

import pytest
import torch

from helpers import (FAMILY_PROMPTS, assert_equals_transformers, assert_speculation_equals_plain,
                     copy_tokenizer_files, random_reference_model, write_tiny_checkpoint)

from mtpctl.errors import CorruptModel
from mtpctl.model.config import DecoderConfig, rope_attention_factor
from mtpctl.model.decoder import Decoder, rope_inv_freq

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=259, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
              max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=257,
              eos_token_id=258, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
              intermediate_size=96, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
              num_nextn_predict_layers=0)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32, beta_fast=32,
            beta_slow=1, mscale=1.0, mscale_all_dim=0.8)
EXTRA = {"glm4_moe": dict(num_key_value_heads=2, head_dim=16, attention_bias=True, use_qk_norm=True,
                          partial_rotary_factor=0.5, routed_scaling_factor=1.5),
         "deepseek_v3": dict(num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16,
                             qk_rope_head_dim=16, v_head_dim=16, routed_scaling_factor=2.5,
                             rope_scaling=dict(YARN, type="yarn"))}
MODEL_TYPES = tuple(EXTRA)
PROMPTS = FAMILY_PROMPTS
NEW = 32


def reference_model(model_type: str):
    return random_reference_model(model_type, **COMMON, **EXTRA[model_type])


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """model_type -> (transformers' model, checkpoint folder with the tiny tokenizer)."""
    root = tmp_path_factory.mktemp("glm_deepseek")
    tokenizer = write_tiny_checkpoint(root / "tokenizer")
    out = {}
    for model_type in MODEL_TYPES:
        reference = reference_model(model_type)
        folder = root / model_type
        reference.save_pretrained(str(folder))
        copy_tokenizer_files(tokenizer, folder)
        out[model_type] = (reference, folder)
    return out


def test_the_checkpoints_have_what_the_families_read(folders):
    glm = DecoderConfig.from_folder(folders["glm4_moe"][1])
    assert glm.rotary_dim == 8 and glm.qk_norm and glm.attention_bias and glm.mla is None
    assert glm.moe.score_bias and glm.moe.shared_intermediate_size == 32 and glm.moe.n_group == 2
    ds = DecoderConfig.from_folder(folders["deepseek_v3"][1])
    assert ds.mla.q_lora_rank == 24 and ds.mla.rope_interleave and ds.rope.rope_type == "yarn"
    assert ds.head_dim == 32 and ds.num_key_value_heads == 4 and ds.rope_dim == 16
    for model_type, (reference, folder) in folders.items():
        bias = reference.model.layers[1].mlp.gate.e_score_correction_bias
        assert bias.abs().min() > 0
        model = Decoder.from_folder(folder)
        assert [layer.moe is not None for layer in model.layers] == [False, True, True]
        assert torch.equal(model.layers[1].router_bias, bias)
        assert not model.layers[0].fused_rotary  # partial rotary / MLA: rope in torch's ops, not the fused kernel


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_logits_and_greedy_tokens_equal_transformers_in_float32(folders, model_type):
    reference, folder = folders[model_type]
    model = Decoder.from_folder(folder)
    assert_equals_transformers(reference, model, folder, PROMPTS, NEW)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_speculation_and_batches_equal_plain_decoding(folders, model_type, dtype):
    assert_speculation_equals_plain(folders[model_type][1], dtype, PROMPTS, NEW)


def _mtp_layer(tensors: dict, layers: int) -> dict:
    """One MTP layer in the published GLM-4.5 / DeepSeek-V3 layout at index ``layers``: a full decoder
    layer (the last one's tensors) plus ``eh_proj``, ``enorm``, ``hnorm`` and ``shared_head``."""
    last, mtp = f"model.layers.{layers - 1}.", f"model.layers.{layers}."
    out = {mtp + name[len(last):]: t.clone() for name, t in tensors.items() if name.startswith(last)}
    h = tensors["model.norm.weight"].shape[0]
    out.update({mtp + "eh_proj.weight": torch.randn(h, 2 * h), mtp + "enorm.weight": torch.ones(h),
                mtp + "hnorm.weight": torch.ones(h), mtp + "shared_head.norm.weight": torch.ones(h),
                mtp + "shared_head.head.weight": tensors["lm_head.weight"].clone()})
    return out


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_a_checkpoint_with_an_mtp_layer_loads_the_body_and_stays_strict_otherwise(folders, model_type, tmp_path):
    from safetensors.torch import load_file, save_file

    src = folders[model_type][1]
    tensors = load_file(str(src / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    body = Decoder.from_folder(src)

    def write(name, config, extra):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        save_file({**tensors, **extra}, str(folder / "model.safetensors"))
        return folder

    mtp = _mtp_layer(tensors, layers)
    model = Decoder.from_folder(write("mtp", {**cfg, "num_nextn_predict_layers": 1}, mtp))
    assert len(model.layers) == layers
    for (name, ours), theirs in zip(model.state_dict().items(), body.state_dict().values()):
        assert torch.equal(ours, theirs), name
    for name, config, extra in (("undeclared", {**cfg, "num_nextn_predict_layers": 0}, mtp),
                                ("past", {**cfg, "num_nextn_predict_layers": 1},
                                 {**mtp, f"model.layers.{layers + 1}.enorm.weight": torch.ones(64)}),
                                ("stray", {**cfg, "num_nextn_predict_layers": 1},
                                 {**mtp, "model.layers.0.eh_proj.weight": torch.ones(64, 128)})):
        with pytest.raises(CorruptModel) as caught:
            Decoder.from_folder(write(name, config, extra))
        assert "unexpected" in str(caught.value) and "\n" not in str(caught.value)


def test_yarn_frequencies_and_scales_equal_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, yarn_apply_mscale

    for yarn in (YARN, dict(YARN, mscale=0.0, mscale_all_dim=0.0), dict(YARN, factor=40.0, mscale=1.0,
                                                                        mscale_all_dim=1.0, beta_fast=16)):
        config = transformers.AutoConfig.for_model("deepseek_v3", **COMMON, **EXTRA["deepseek_v3"])
        config.rope_parameters = dict(yarn)
        expected_inv, expected_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
        cfg = DecoderConfig.from_dict({**config.to_dict(), "rope_parameters": dict(yarn), "rope_scaling": None})
        assert torch.equal(rope_inv_freq(cfg.rope, cfg.rope_dim), expected_inv)
        assert rope_attention_factor(cfg.rope) == pytest.approx(expected_factor, rel=1e-12)
        assert cfg.scale == pytest.approx(yarn_apply_mscale(dict(yarn), 32 ** -0.5), rel=1e-12)


def test_the_native_stack_and_export_leave_them_alone(folders):
    from mtpctl.export.onnx import EXPORTABLE

    for model_type, (_, folder) in folders.items():
        cfg = DecoderConfig.from_folder(folder)
        assert model_type not in EXPORTABLE and not cfg.family.native_stack
        model = Decoder.from_folder(folder, dtype=torch.bfloat16, blocked=True)
        assert model.native_stack() is None
