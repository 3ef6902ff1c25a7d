"""Block-scaled FP8 checkpoints (DeepSeek-V3's and the GLM-4.5 FP8 releases' layout) load dequantized.

Tiny random models built with transformers' own classes have their projection weights quantized here to
float8_e4m3fn in 128 x 128 blocks (sizes of 160 and 64: partial edge blocks), written as ``weight`` +
``weight_scale_inv`` with the published ``quantization_config``, in the layout ``save_pretrained`` writes
("saved": DeepSeek-V3's experts one tensor each, a dense llama) and stacked (GLM-4.5's fused experts).
Loading them gives exactly the values of the same checkpoint dequantized here in float32, greedy tokens
equal transformers' on that dequantized checkpoint, and speculation equals plain decoding; reading is
streamed in block rows; an FP8 MTP layer and a quantized lm_head read as their dequantized values;
everything else quantized is refused in one line, exit 2 (and an FP8 MTP layer is not written back).
"""

import json
import math
import shutil

import pytest
import torch

from helpers import (FAMILY_PROMPTS, assert_equals_transformers, assert_one_line_exit_2,
                     assert_speculation_equals_plain, cli, copy_tokenizer_files, random_reference_model,
                     write_tiny_checkpoint)

from mtpctl.model import weights
from mtpctl.model.decoder import Decoder
from mtpctl.model.weights import CheckpointReader

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

BLOCK = 128
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}
COMMON = dict(vocab_size=259, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128,
              rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=257, eos_token_id=258)
MOE = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=160,
           n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, num_nextn_predict_layers=0)
#: (model_type, layout) -> config keys; intermediate_size 160: two block rows, the second partial
CASES = {("deepseek_v3", "saved"): dict(MOE, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32,
                                        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16),
         ("glm4_moe", "stacked"): dict(MOE, num_key_value_heads=2, head_dim=16, attention_bias=True,
                                       partial_rotary_factor=0.5),
         ("llama", "saved"): dict(num_key_value_heads=2, head_dim=16, intermediate_size=160)}
PROMPTS = FAMILY_PROMPTS[:2]
NEW = 16


def quantize(w: torch.Tensor):
    """(float8_e4m3fn codes, float32 scale_inv) of ``w [..., R, C]`` in 128 x 128 blocks, each block's
    largest magnitude mapped to 448 (the format's largest value)."""
    rows, cols = w.shape[-2:]
    grid = (math.ceil(rows / BLOCK), math.ceil(cols / BLOCK))
    padded = torch.zeros(*w.shape[:-2], grid[0] * BLOCK, grid[1] * BLOCK)
    padded[..., :rows, :cols] = w
    blocks = padded.unflatten(-1, (grid[1], BLOCK)).unflatten(-3, (grid[0], BLOCK))  # [..., gr, B, gc, B]
    scale = (blocks.abs().amax(dim=(-3, -1)) / 448.0).clamp(min=1e-12)
    codes = (blocks / scale[..., :, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return codes.flatten(-2).flatten(-3, -2)[..., :rows, :cols].contiguous(), scale.float()


def dequantized(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 values of ``codes`` with block scales ``scale``, block by block."""
    out = codes.float()
    for i in range(scale.shape[-2]):
        for j in range(scale.shape[-1]):
            out[..., i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] *= scale[..., i, j, None, None]
    return out


def quantized_names(tensors: dict) -> list:
    """The projections DeepSeek-V3's FP8 release quantizes: every ``*_proj`` matrix (attention, dense
    and expert MLPs, stacked experts); not embeddings, lm_head, norms or routers."""
    return [n for n, t in tensors.items() if t.dim() >= 2 and "_proj" in n and "embed" not in n
            and not n.endswith("_scale_inv")]


def write_pair(reference, layout: str, tokenizer, fp8_folder, float_folder) -> None:
    """``reference``'s checkpoint in ``layout`` written twice: FP8 with scales and quantization_config
    (``fp8_folder``), and those values dequantized in float32 without it (``float_folder``)."""
    config = reference.config.to_dict()
    if layout == "saved":
        reference.save_pretrained(str(float_folder))
        tensors = load_file(str(float_folder / "model.safetensors"))
    else:
        tensors = {k: v.contiguous() for k, v in reference.state_dict().items()}
    fp8, plain = dict(tensors), dict(tensors)
    for name in quantized_names(tensors):
        fp8[name], scale = quantize(tensors[name])
        fp8[name + "_scale_inv"] = scale
        plain[name] = dequantized(fp8[name], scale)
    for folder, state, cfg in ((fp8_folder, fp8, {**config, "quantization_config": QUANT}),
                               (float_folder, plain, config)):
        folder.mkdir(exist_ok=True)
        copy_tokenizer_files(tokenizer, folder)
        (folder / "config.json").write_text(json.dumps(cfg))
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(model_type, layout) -> (transformers' model of the dequantized checkpoint, FP8 folder, float folder)."""
    root = tmp_path_factory.mktemp("fp8")
    tokenizer = write_tiny_checkpoint(root / "tokenizer")
    out = {}
    for (model_type, layout), extra in CASES.items():
        name = f"{model_type}-{layout}"
        fp8_folder, float_folder = root / f"{name}-fp8", root / f"{name}-float"
        write_pair(random_reference_model(model_type, **COMMON, **extra), layout, tokenizer, fp8_folder, float_folder)
        dequant = transformers.AutoModelForCausalLM.from_pretrained(str(float_folder), dtype=torch.float32).eval()
        out[model_type, layout] = dequant, fp8_folder, float_folder
    return out


@pytest.mark.parametrize("case", list(CASES), ids=lambda c: "-".join(c))
def test_fp8_loads_as_its_dequantized_values_and_decodes_as_transformers(checkpoints, case):
    reference, fp8_folder, float_folder = checkpoints[case]
    stored = load_file(str(fp8_folder / "model.safetensors"))
    names = quantized_names(stored)
    assert any(stored[n + "_scale_inv"].shape[-2] == 2 for n in names)  # 160 rows: a partial second block row
    assert all(stored[n].dtype == torch.float8_e4m3fn for n in names)
    ours, plain = Decoder.from_folder(fp8_folder), Decoder.from_folder(float_folder)
    assert ours.state_dict().keys() == plain.state_dict().keys()
    for (name, a), b in zip(ours.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name
    original = random_reference_model(case[0], **COMMON, **CASES[case]).state_dict()
    assert not all(torch.equal(original[k], v) for k, v in reference.state_dict().items() if k in original)
    assert_equals_transformers(reference, ours, fp8_folder, PROMPTS, NEW)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculation_equals_plain_on_an_fp8_checkpoint(checkpoints, dtype):
    assert_speculation_equals_plain(checkpoints["glm4_moe", "stacked"][1], dtype, PROMPTS, NEW)


def test_reading_is_streamed_in_block_rows_with_partial_edges(tmp_path, monkeypatch):
    """A matrix and an expert stack read a block row at a time (CHUNK_BYTES tiny) equal their
    dequantized values; the scales are consumed, not listed, and may sit in another shard."""
    torch.manual_seed(0)
    tensors = {"a": torch.randn(300, 200), "b": torch.randn(3, 130, 70)}
    stored, expected = {}, {}
    for name, value in tensors.items():
        stored[name], stored[name + "_scale_inv"] = quantize(value)
        expected[name] = dequantized(stored[name], stored[name + "_scale_inv"])
    shards = [tmp_path / "model-1.safetensors", tmp_path / "model-2.safetensors"]
    save_file({k: v for k, v in stored.items() if k != "a_scale_inv"}, str(shards[0]))
    save_file({"a_scale_inv": stored["a_scale_inv"]}, str(shards[1]))
    monkeypatch.setattr(weights, "CHUNK_BYTES", 1)
    reader = CheckpointReader(shards, {n: tuple(t.shape) for n, t in tensors.items()}, fp8_block=(BLOCK, BLOCK))
    assert reader.names == ["a", "b"] and reader.dtype("a") == torch.float32 and reader.mapped("a") is None
    for name in tensors:
        assert torch.equal(reader.read(name), expected[name])
        out = torch.empty(tensors[name].shape, dtype=torch.bfloat16)
        reader.read_into(name, out)
        assert torch.equal(out, expected[name].to(torch.bfloat16))


def _edited(src, dest, config=None, tensors=None):
    """A copy of checkpoint folder ``src`` whose config.json is ``config(old)`` and tensors ``tensors(old)``."""
    shutil.copytree(src, dest)
    if config is not None:
        (dest / "config.json").write_text(json.dumps(config(json.loads((src / "config.json").read_text()))))
    if tensors is not None:
        save_file(tensors(load_file(str(src / "model.safetensors"))), str(dest / "model.safetensors"))
    return dest


Q = "model.layers.0.self_attn.q_proj.weight"
REFUSED = {
    "no scale": (None, lambda t: {k: v for k, v in t.items() if k != Q + "_scale_inv"},
                 f"tensor '{Q}' is float8_e4m3fn without its scale '{Q}_scale_inv'"),
    "scale shape": (None, lambda t: {**t, Q + "_scale_inv": torch.ones(2, 1)},
                    f"scale '{Q}_scale_inv' has shape (2, 1), expected (1, 1)"),
    "bf16 scale": (None, lambda t: {**t, Q + "_scale_inv": t[Q + "_scale_inv"].to(torch.bfloat16)},
                   f"scale '{Q}_scale_inv' has dtype bfloat16; mtpctl reads float32 block scales only"),
    "quant_method": (lambda c: {**c, "quantization_config": {**QUANT, "quant_method": "gptq"}}, None,
                     "quant_method 'gptq' is not supported"),
    "fmt": (lambda c: {**c, "quantization_config": {**QUANT, "fmt": "e5m2"}}, None, "fmt 'e5m2' is not supported"),
    "static": (lambda c: {**c, "quantization_config": {**QUANT, "activation_scheme": "static"}}, None,
               "activation_scheme 'static' is not supported"),
    "per-tensor": (lambda c: {**c, "quantization_config": {k: v for k, v in QUANT.items() if k != "weight_block_size"}},
                   None, "per-tensor FP8 scales are not supported"),
    "no config": (lambda c: {k: v for k, v in c.items() if k != "quantization_config"}, None,
                  "_scale_inv' is a block scale, but config.json has no quantization_config"),
    "e5m2": (None, lambda t: {**t, Q: t[Q].float().to(torch.float8_e5m2)},
             f"tensor '{Q}' has a scale '{Q}_scale_inv' but dtype float8_e5m2"),
    "int8": (None, lambda t: {**{k: v for k, v in t.items() if k != Q + "_scale_inv"},
                              Q: torch.ones(t[Q].shape, dtype=torch.int8)},
             f"tensor '{Q}' has dtype int8: quantized weights other than block-scaled float8_e4m3fn"),
}


@pytest.mark.parametrize("what", list(REFUSED))
def test_other_quantizations_are_refused_in_one_line(checkpoints, tmp_path, capsys, what):
    config, tensors, message = REFUSED[what]
    folder = _edited(checkpoints["llama", "saved"][1], tmp_path / "edited", config, tensors)
    code, out, err = cli(capsys, "generate", "--model", folder, "--max-new-tokens", 2, "--no-chat", "abc")
    assert_one_line_exit_2(code, out, err, message)


def _with_mtp_layer(src, dest, quantized: bool):
    """A copy of checkpoint ``src`` (2 layers) with one MTP layer at ``model.layers.2``: the last layer's
    names with fresh random values, the extras, copies of embedding and lm_head; its projections
    quantized as the body's (``quantized``) or their dequantized values."""
    gen = torch.Generator().manual_seed(5)
    tensors = load_file(str(src / "model.safetensors"))
    mtp = {"model.layers.2." + n[len("model.layers.1."):]: torch.randn(t.shape, generator=gen) * 0.2
           if t.dim() > 1 else t.float().clone() for n, t in sorted(tensors.items())
           if n.startswith("model.layers.1.") and not n.endswith("_scale_inv")}
    mtp.update({"model.layers.2.eh_proj.weight": torch.randn(64, 128, generator=gen) * 0.2,
                **{f"model.layers.2.{n}.weight": torch.ones(64) for n in ("enorm", "hnorm", "shared_head.norm")},
                "model.layers.2.shared_head.head.weight": tensors["lm_head.weight"].clone(),
                "model.layers.2.embed_tokens.weight": tensors["model.embed_tokens.weight"].clone()})
    for name in quantized_names(mtp):
        codes, scale = quantize(mtp[name])
        mtp.update({name: codes, name + "_scale_inv": scale} if quantized else {name: dequantized(codes, scale)})
    return _edited(src, dest, lambda c: {**c, "num_nextn_predict_layers": 1}, lambda t: {**t, **mtp})


def test_an_fp8_mtp_layer_drafts_as_its_dequantized_values(checkpoints, tmp_path, capsys):
    import mtpctl
    from mtpctl.drafters.mtp import MtpLayers

    _, fp8_src, float_src = checkpoints["glm4_moe", "stacked"]
    fp8_folder = _with_mtp_layer(fp8_src, tmp_path / "fp8", quantized=True)
    float_folder = _with_mtp_layer(float_src, tmp_path / "float", quantized=False)
    stored = load_file(str(fp8_folder / "model.safetensors"))
    assert stored["model.layers.2.eh_proj.weight"].dtype == torch.float8_e4m3fn
    ours, theirs = (MtpLayers(Decoder.from_folder(f), f) for f in (fp8_folder, float_folder))
    assert torch.equal(ours.eh_proj, theirs.eh_proj)
    for (name, a), b in zip(ours.block.state_dict().items(), theirs.block.state_dict().values()):
        assert torch.equal(a, b), name
    plain = mtpctl.load(str(fp8_folder), speculate="none", dtype="float32", threads=1)
    spec = mtpctl.load(str(fp8_folder), speculate="mtp", dtype="float32", speculate_policy="always", threads=1)
    for prompt in PROMPTS:
        expected = plain.pipeline.generate(list(prompt), NEW).token_ids
        assert spec.pipeline.generate(list(prompt), NEW).token_ids == expected
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "abc abc"}) + "\n")
    code, out, err = cli(capsys, "add-heads", "--kind", "mtp", "-m", fp8_folder, "--data", data, "--self-distill",
                         "--out", tmp_path / "refreshed", "--threads", 1, "--device", "cpu")
    assert_one_line_exit_2(code, out, err, "holds block-scaled FP8 weights: a refreshed MTP layer is not written")
    assert "(--measure-only)" in err and not (tmp_path / "refreshed").exists()


def test_a_quantized_lm_head_reads_dequantized_alone_and_in_the_model(checkpoints, tmp_path):
    """lm_head [259, 64]: three block rows, the last partial; read alone (what heads and exports read)
    and loaded in the model, both its dequantized values."""
    from mtpctl.model.config import DecoderConfig
    from mtpctl.model.weights import read_lm_head

    head = "lm_head.weight"
    codes, scale = quantize(load_file(str(checkpoints["llama", "saved"][2] / "model.safetensors"))[head])
    folder = _edited(checkpoints["llama", "saved"][1], tmp_path / "head", None,
                     lambda t: {**t, head: codes, head + "_scale_inv": scale})
    assert scale.shape == (3, 1)
    expected = dequantized(codes, scale)
    assert torch.equal(read_lm_head(folder, DecoderConfig.from_folder(folder)), expected)
    assert torch.equal(Decoder.from_folder(folder).lm_head, expected)
