"""gpt-oss (``gpt_oss``) on tiny random checkpoints written by transformers' own ``GptOssForCausalLM``
(float32): every prefill logit and greedy decoding equal transformers' on prompts longer than the
sliding window, so windows, sinks, biases and the clamped SwiGLU experts all count; prompt lookup,
a scripted drafter and batches equal plain decoding; its MoE block gives a row alike alone and in any
pass; the native attention kernel is not used for it (it takes no sinks)."""

import dataclasses

import pytest
import torch

from helpers import (FAMILY_PROMPTS, MOE_COMMON, assert_distilled_features_match, assert_equals_transformers,
                     assert_speculation_equals_plain, random_reference_model, write_moe_checkpoints,
                     write_tiny_checkpoint)

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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculation_and_batches_equal_plain_decoding(checkpoint, dtype):
    assert_speculation_equals_plain(checkpoint[1], dtype, PROMPTS, NEW)


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


# ------------------------------------------------------------------------------------------ MXFP4

FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _quantize(matrix: torch.Tensor):
    """Our own MXFP4 coding of ``matrix [R, K]`` (K a multiple of 32): each block of 32 scaled by the
    power of two that brings its largest magnitude to at most 6, each value the nearest FP4 one; codes
    packed two a byte, the even value in the low nibble. (blocks [R, K/32, 16], scales [R, K/32])."""
    r, k = matrix.shape
    groups = matrix.reshape(r, k // 32, 32)
    amax = groups.abs().amax(dim=-1).clamp(min=2.0 ** -100)
    exp = torch.ceil(torch.log2(amax / 6.0)).to(torch.int32)
    scaled = groups / torch.pow(2.0, exp.float())[..., None]
    table = torch.tensor(FP4[:8])
    codes = (scaled.abs()[..., None] - table).abs().argmin(dim=-1) + 8 * (scaled < 0)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed, (exp + 127).to(torch.uint8)


def _reference_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The values of ``blocks [R, G, 16]``, ``scales [R, G]``, byte by byte: ``[R, G * 32]`` float32."""
    r, g, _ = blocks.shape
    out = torch.empty(r, g * 32)
    for i in range(r):
        for j in range(g):
            factor = 2.0 ** (int(scales[i, j]) - 127)
            for byte in range(16):
                code = int(blocks[i, j, byte])
                out[i, j * 32 + 2 * byte] = FP4[code & 15] * factor
                out[i, j * 32 + 2 * byte + 1] = FP4[code >> 4] * factor
    return out


@pytest.fixture(scope="module")
def mxfp4_checkpoints(tmp_path_factory):
    """(MXFP4 folder, float32 folder holding our reference's dequantized values, the dequantized stacks):
    gpt-oss with experts of 32 (MXFP4 blocks of 32 along each matrix's rows)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("mxfp4")
    reference = random_reference_model("gpt_oss", **{**CONFIG, "intermediate_size": 32, "num_hidden_layers": 2})
    folder = write_moe_checkpoints(root, "gpt_oss", reference, write_tiny_checkpoint(root / "tokenizer"))["per_expert"]
    tensors = load_file(str(folder / "model.safetensors"))
    quantized, dense, stacks = {}, {}, {}
    for name, t in tensors.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            quantized[name] = dense[name] = t
            continue
        coded = [_quantize(m.t().contiguous()) for m in t]
        quantized[name + "_blocks"] = torch.stack([b for b, _ in coded])
        quantized[name + "_scales"] = torch.stack([s for _, s in coded])
        dense[name] = stacks[name] = torch.stack([_reference_dequantize(b, s).t() for b, s in coded]).contiguous()
    out = {}
    for kind, values in (("mxfp4", quantized), ("dense", dense)):
        out[kind] = root / kind
        shutil.copytree(folder, out[kind])
        save_file(values, str(out[kind] / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out["mxfp4"] / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                     "model.layers.*.mlp.router",
                                                                                     "model.embed_tokens", "lm_head"]}
    (out["mxfp4"] / "config.json").write_text(json.dumps(cfg))
    return out["mxfp4"], out["dense"], stacks


def test_mxfp4_experts_are_dequantized_at_load_as_our_reference_does(mxfp4_checkpoints):
    import mtpctl

    coded, dense, stacks = mxfp4_checkpoints
    model = Decoder.from_folder(coded)
    for i, layer in enumerate(model.layers):
        assert torch.equal(layer.experts_gate_up, stacks[f"model.layers.{i}.mlp.experts.gate_up_proj"])
        assert torch.equal(layer.experts_down, stacks[f"model.layers.{i}.mlp.experts.down_proj"])
    assert stacks["model.layers.0.mlp.experts.down_proj"].abs().max() > 0
    for prompt in PROMPTS[1:]:
        got = [mtpctl.load(str(f), speculate="none", dtype="float32", threads=1).pipeline.generate(list(prompt), 12)
               .token_ids for f in (coded, dense)]
        assert got[0] == got[1]


def test_our_mxfp4_reference_agrees_with_transformers_dequantizer(mxfp4_checkpoints):
    mx = pytest.importorskip("transformers.integrations.mxfp4")
    from safetensors.torch import load_file

    coded, _, stacks = mxfp4_checkpoints
    tensors = load_file(str(coded / "model.safetensors"))
    name = "model.layers.1.mlp.experts.gate_up_proj"
    theirs = mx.convert_moe_packed_tensors(tensors[name + "_blocks"], tensors[name + "_scales"], dtype=torch.float32)
    assert torch.equal(theirs, stacks[name])


def test_mxfp4_blocks_without_the_config_are_refused_in_one_line(mxfp4_checkpoints, tmp_path, capsys):
    import json
    import shutil

    from helpers import cli

    folder = tmp_path / "m"
    shutil.copytree(mxfp4_checkpoints[0], folder)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["quantization_config"]
    (folder / "config.json").write_text(json.dumps(cfg))
    code, out, err = cli(capsys, "generate", "-m", folder, "--max-new-tokens", 4, "--no-chat", "abc")
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1, err
    assert "model.layers.0.mlp.experts.down_proj_blocks" in lines[0] and "mxfp4" in lines[0]


def test_the_cli_generates_on_the_torch_attention(checkpoint, capsys):
    import json

    from helpers import cli

    code, out, err = cli(capsys, "generate", "-m", checkpoint[1], "--json", "--max-new-tokens", 8, "--no-chat",
                         "abcabcabc", "--speculate", "ngram")
    assert code == 0, err
    result = json.loads(out)
    assert len(result["token_ids"]) == 8 and result["attention"] == "torch"


def test_onnx_export_is_refused_in_one_line_and_the_cost_identity_counts_experts(checkpoint):
    from mtpctl.decode.cost_table import model_identity
    from mtpctl.errors import UnsupportedModel
    from mtpctl.export.onnx import FusedStep

    model = Decoder.from_folder(checkpoint[1])
    with pytest.raises(UnsupportedModel) as caught:
        FusedStep(model)
    assert "'gpt_oss' cannot be exported" in str(caught.value) and "\n" not in str(caught.value)
    identity = model_identity(model.cfg)
    assert (identity["experts"], identity["experts_per_token"], identity["moe_layers"]) == (4, 2, 3)


def test_batched_self_distillation_features_equal_the_decoding_engine(checkpoint):
    """add-heads' teacher-forced batches (padded rows, the masked attention with sinks) give the argmax
    tokens and hidden states of the decoding engine's verify pass (the plan attention with sinks)."""
    assert_distilled_features_match(Decoder.from_folder(checkpoint[1]))
