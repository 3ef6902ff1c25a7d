"""Llama 4 (``llama4_text``) on a tiny random checkpoint written by transformers' own ``Llama4ForCausalLM``
(float32): 4 layers mixing rotary and NoPE layers with dense and MoE feed-forwards, QK L2-norm, attention
temperature tuning that moves within the prompts, Llama 3 rope scaling and chunks of 8 positions that
every prompt crosses. Prefill logits and greedy tokens equal transformers'; prompt lookup, a scripted
drafter and batches equal plain decoding on both attention paths; a verify pass whose rows cross a
chunk boundary scores each row bit for bit as plain decoding does."""

import pytest
import torch

from helpers import (FAMILY_PROMPTS, MOE_COMMON, assert_equals_transformers, assert_speculation_equals_plain,
                     plain_decode_logits, random_reference_model, write_moe_checkpoints, write_tiny_checkpoint)

from mtpctl.backends.torch import TorchEngine
from mtpctl.decode.tree import DraftTree
from mtpctl.model.config import Chunk, DecoderConfig
from mtpctl.model.decoder import Decoder
from mtpctl.model.native import kernel_runs

transformers = pytest.importorskip("transformers")

#: layer 0 rotary + dense, 1 NoPE + MoE, 2 rotary + MoE, 3 NoPE + dense; one expert a token, as released
CONFIG = {**MOE_COMMON, "num_hidden_layers": 4, "num_local_experts": 4, "num_experts_per_tok": 1,
          "intermediate_size": 32, "intermediate_size_mlp": 96, "moe_layers": [1, 2], "no_rope_layers": [1, 0, 1, 0],
          "use_qk_norm": True, "attn_temperature_tuning": True, "floor_scale": 4, "attn_scale": 0.5,
          "attention_chunk_size": 8,
          "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}
#: FAMILY_PROMPTS and a longer, repetitive one (prompt lookup drafts from it): each crosses a chunk boundary
#: or reaches it while decoding
PROMPTS = FAMILY_PROMPTS + ([7, 8, 9, 10, 11] * 4,)
NEW = 16
NATIVE = kernel_runs(4, 2, 16)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(transformers' model, its save_pretrained folder with the tiny tokenizer)."""
    root = tmp_path_factory.mktemp("llama4")
    reference = random_reference_model("llama4_text", **CONFIG)
    folders = write_moe_checkpoints(root, "llama4_text", reference, write_tiny_checkpoint(root / "tokenizer"))
    return reference, folders["per_expert"]


def test_config_and_tensor_map(checkpoint):
    _, folder = checkpoint
    cfg = DecoderConfig.from_folder(folder)
    assert cfg.layer_windows == (Chunk(8), None, Chunk(8), None) and cfg.nope_layers == (1, 3)
    assert cfg.pair_rope and cfg.qk_l2_norm and not cfg.qk_norm and cfg.attn_temperature == (4.0, 0.5)
    assert cfg.rope.rope_type == "llama3" and cfg.intermediate_size == 96
    assert [cfg.moe.is_moe_layer(i) for i in range(4)] == [False, True, True, False]
    assert cfg.moe.scoring == "topk_sigmoid" and cfg.moe.scale_input and cfg.moe.shared_intermediate_size == 32
    assert not cfg.family.exportable and not cfg.family.native_stack
    model = Decoder.from_folder(folder)
    assert model.layers[1].experts_gate_up.shape == (4, 64, 64) and model.layers[0].gate_up.shape == (192, 64)


def test_defaults_of_a_bare_config():
    cfg = DecoderConfig.from_dict({"model_type": "llama4_text"})
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size, cfg.moe.num_experts, cfg.moe.top_k) == \
        (5120, 48, 16384, 16, 1)
    assert cfg.nope_layers[:2] == (3, 7) and cfg.layer_windows[:4] == (Chunk(8192),) * 3 + (None,)
    assert cfg.rope.theta == 500000.0 and cfg.attn_temperature == (8192.0, 0.1)


def test_logits_and_greedy_tokens_equal_transformers_in_float32(checkpoint):
    reference, folder = checkpoint
    assert len(PROMPTS[-1]) > 2 * CONFIG["attention_chunk_size"]
    assert_equals_transformers(reference, Decoder.from_folder(folder), folder, PROMPTS, NEW)


@pytest.mark.parametrize("part", ["chunks", "temperature"])
def test_chunks_and_temperature_move_the_logits(checkpoint, part):
    """The parity above would catch a block without them: each changes the logits past 1e-3."""
    reference, folder = checkpoint
    model = Decoder.from_folder(folder)
    for layer in model.layers:
        if part == "temperature":
            layer.temperature = None
    if part == "chunks":
        import dataclasses

        model.cfg = dataclasses.replace(model.cfg, layer_windows=(None,) * 4)
    prompt = PROMPTS[-1]
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
    ours = TorchEngine(model, len(prompt) + 1).verify(DraftTree.chain(prompt)).logits
    assert (ours - expected).abs().max() > 1e-3


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=pytest.mark.skipif(
    not NATIVE, reason="the native attention kernel does not build here"))], ids=["torch", "native"])
def test_verify_rows_across_a_chunk_boundary_equal_plain_decoding(checkpoint, native):
    """A chain of 6 draft tokens from position 13 crosses the chunk boundary at 16: each row's logits are
    bit for bit those of plain decoding (one token a pass), bfloat16 weights."""
    model = Decoder.from_folder(checkpoint[1], dtype=torch.bfloat16)
    prompt, chain = PROMPTS[-1][:13], [3, 99, 41, 7, 250, 18]
    engine = TorchEngine(model, 40, native=native)
    engine.prefill(prompt)
    rows = engine.verify(DraftTree.chain(chain)).logits
    for i in range(len(chain)):
        assert torch.equal(rows[i], plain_decode_logits(model, prompt, chain[:i + 1], 40, native=native))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculation_and_batches_equal_plain_decoding(checkpoint, dtype):
    assert_speculation_equals_plain(checkpoint[1], dtype, PROMPTS, NEW)


def test_the_multimodal_checkpoint_reads_as_its_text_body(checkpoint, tmp_path):
    """``llama4`` (transformers' ``Llama4ForConditionalGeneration`` with a tiny vision tower, the text body
    under ``language_model.``): the same weights and logits as the text checkpoint; the vision tower and
    projector are not read."""
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    from helpers import copy_tokenizer_files

    reference, folder = checkpoint
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=28,
                  patch_size=14, vision_output_dim=64, projector_input_dim=64, projector_output_dim=64)
    wrapper = Llama4ForConditionalGeneration(Llama4Config(text_config=reference.config.to_dict(),
                                                          vision_config=vision, tie_word_embeddings=False))
    wrapper.language_model.load_state_dict(reference.state_dict())
    wrapper.save_pretrained(str(tmp_path))
    copy_tokenizer_files(folder, tmp_path)
    cfg = DecoderConfig.from_folder(tmp_path)
    assert cfg.model_type == "llama4" and cfg.layer_windows == (Chunk(8), None, Chunk(8), None)
    prompt = PROMPTS[-1]
    text, multimodal = (TorchEngine(Decoder.from_folder(f), len(prompt) + 1).verify(DraftTree.chain(prompt)).logits
                        for f in (folder, tmp_path))
    assert torch.equal(text, multimodal)


def _with_config(folder, tmp_path, **changes):
    """``folder``'s checkpoint (weights linked, tokenizer copied) under ``tmp_path`` with config.json keys
    changed (None: written as null)."""
    import json

    from helpers import copy_tokenizer_files

    cfg = {**json.loads((folder / "config.json").read_text()), **changes}
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").symlink_to(folder / "model.safetensors")
    return copy_tokenizer_files(folder, tmp_path)


def test_released_config_values_load_and_decode_as_their_meaning(checkpoint, tmp_path, capsys):
    """Llama 4's released configs write ``"attn_temperature_tuning": 4`` (true), and a null may stand for a
    flag's default: transformers 5's config class refuses both, which the tokenizer's loading met as an
    internal error. The CLI decodes such a checkpoint as the plain one, temperature and QK-norm on."""
    import json

    from helpers import cli

    folder = checkpoint[1]
    released = _with_config(folder, tmp_path / "released", attn_temperature_tuning=4, use_qk_norm=None)
    cfg = DecoderConfig.from_folder(released)
    assert cfg.attn_temperature == (4.0, 0.5) and cfg.qk_l2_norm
    outs = []
    for f in (folder, released):
        code, out, err = cli(capsys, "generate", "-m", f, "--no-chat", "--json", "--max-new-tokens", 6, "abcabc")
        assert code == 0, err
        outs.append(json.loads(out)["token_ids"])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("key, value", [("attention_chunk_size", -8), ("attention_chunk_size", 0),
                                        ("no_rope_layer_interval", 0), ("floor_scale", 0)])
def test_sizes_of_zero_or_below_are_refused_in_one_line(checkpoint, tmp_path, capsys, key, value):
    """A negative chunk (an internal error at prefill), an interval of 0 (a division by zero in
    transformers' config class, met first) and a floor_scale of 0 (infinite temperatures) exit 2 with one
    line naming the key."""
    from helpers import assert_one_line_exit_2, cli

    changes = {key: value, "no_rope_layers": None} if key == "no_rope_layer_interval" else {key: value}
    folder = _with_config(checkpoint[1], tmp_path / "bad", **changes)
    assert_one_line_exit_2(*cli(capsys, "generate", "-m", folder, "--no-chat", "hi"), key)


def test_a_layer_type_of_another_family_is_refused_not_read_as_full_attention(checkpoint, tmp_path, capsys):
    """``sliding_attention`` in a Llama 4 config (no mask for it in transformers' Llama 4) was read as full
    attention silently: it is refused in one line."""
    from helpers import assert_one_line_exit_2, cli

    types = ["chunked_attention", "sliding_attention", "chunked_attention", "full_attention"]
    folder = _with_config(checkpoint[1], tmp_path / "sliding", layer_types=types)
    assert_one_line_exit_2(*cli(capsys, "generate", "-m", folder, "--no-chat", "hi"), "'sliding_attention'")


def test_onnx_export_is_refused_from_the_config_before_the_weights_are_read(checkpoint, tmp_path, capsys):
    """No ONNX graph for Llama 4: the refusal comes first, one line, not after hashing the weights and
    loading them in float32 (minutes, or out of memory, for a released checkpoint); nothing is written."""
    from helpers import assert_one_line_exit_2, cli

    out = tmp_path / "onnx"
    assert_one_line_exit_2(*cli(capsys, "export", checkpoint[1], "--onnx", out), "cannot be exported")
    assert not out.exists() and list(tmp_path.iterdir()) == []
