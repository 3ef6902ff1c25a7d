"""Checkpoints shaped like real Llama 3.x ones (GQA, llama3 rope scaling, untied head, bfloat16
shards with an index), written by mtpctl.model.synthetic: strict streamed loading, the CLI on them,
and the memory loading takes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

from mtpctl.cli.main import main
from mtpctl.errors import CorruptModel
from mtpctl.model.config import DecoderConfig
from mtpctl.model.decoder import Decoder, expected_tensors
from mtpctl.model.linears import BlockedLinear, FixedRowsLinear, PackedLinear, TiledLinear
from mtpctl.model.synthetic import (checkpoint_bytes, checkpoint_tensors, shard_names, write_index, write_shard,
                                    write_synthetic_checkpoint)
from mtpctl.model.weights import INDEX, load_tensors, safetensors_files


def llama3_config(**overrides) -> dict:
    """A small Llama 3.x-style config with SmolLM2's vocabulary size (its tokenizer works with it)."""
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 128,
           "intermediate_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 32, "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
           "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
           "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}
    cfg.update(overrides)
    return cfg


@pytest.fixture(scope="module")
def llama3_folder(tmp_path_factory):
    """A bfloat16 checkpoint in 3 shards with an index, no tokenizer (read-only for tests)."""
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("llama3") / "ckpt", llama3_config(), shards=3, seed=7)


@pytest.fixture
def folder(llama3_folder, tmp_path):
    """A writable copy of the checkpoint."""
    return shutil.copytree(llama3_folder, tmp_path / "copy")


def reference(folder, dtype, **kwargs) -> Decoder:
    """The checkpoint read whole into memory, then copied in (what loading did before it streamed)."""
    cfg = DecoderConfig.from_folder(folder)
    model = Decoder(cfg, dtype)
    model.load_hf_tensors(load_tensors(safetensors_files(folder), expected_tensors(cfg)), **kwargs)
    return model


def weights_of(model: Decoder) -> dict:
    """Every weight as a dense tensor (a kernel-held one through its own ``dense``)."""
    out = {}
    for prefix, module in model.named_modules():
        out.update((f"{prefix}.{k}", p.detach()) for k, p in module._parameters.items() if p is not None)
        if isinstance(module, (TiledLinear, BlockedLinear, FixedRowsLinear)):
            out[prefix] = module.dense()
    return out


def test_the_folder_is_sharded_like_a_hub_checkpoint(llama3_folder):
    index = json.loads((llama3_folder / INDEX).read_text())
    names = shard_names(3)
    assert sorted(set(index["weight_map"].values())) == names == ["model-00001-of-00003.safetensors",
                                                                   "model-00002-of-00003.safetensors",
                                                                   "model-00003-of-00003.safetensors"]
    cfg = DecoderConfig.from_folder(llama3_folder)
    assert set(index["weight_map"]) == set(expected_tensors(cfg))  # untied: lm_head.weight is there
    assert index["metadata"]["total_size"] == checkpoint_bytes(cfg)
    tensors = {k: v for n in names for k, v in load_file(str(llama3_folder / n)).items()}
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert torch.equal(tensors["model.norm.weight"], torch.ones(128, dtype=torch.bfloat16))
    assert 0.015 < float(tensors["model.layers.0.mlp.up_proj.weight"].float().std()) < 0.025
    assert cfg.rope.rope_type == "llama3" and cfg.num_key_value_heads == 2 and not cfg.tie_word_embeddings


def test_the_same_seed_writes_the_same_tensors_whatever_the_shards(tmp_path):
    one = write_synthetic_checkpoint(tmp_path / "one", llama3_config(num_hidden_layers=2), shards=1, seed=3)
    four = write_synthetic_checkpoint(tmp_path / "four", llama3_config(num_hidden_layers=2), shards=4, seed=3)
    assert not (one / INDEX).exists() and len(list(four.glob("*.safetensors"))) == 4
    a = load_file(str(one / "model.safetensors"))
    b = {k: v for f in four.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("dtype, kwargs", [(torch.bfloat16, {}), (torch.bfloat16, {"blocked": True}),
                                           (torch.float32, {}), (torch.bfloat16, {"packed": True, "blocked": True})])
def test_streamed_loading_equals_loading_everything_first(llama3_folder, dtype, kwargs):
    model = Decoder.from_folder(llama3_folder, dtype, **kwargs)
    ref = reference(llama3_folder, dtype, **kwargs)
    got, want = weights_of(model), weights_of(ref)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in got)
    assert not any(p.is_meta for p in model.parameters())
    assert not any(isinstance(m, PackedLinear) for m in model.modules())  # random weights are on no int4 grid
    assert model.lm_head is not model.embed


def test_a_bfloat16_embedding_is_mapped_from_its_file_not_copied(llama3_folder):
    model = Decoder.from_folder(llama3_folder, torch.bfloat16)
    shard = llama3_folder / json.loads((llama3_folder / INDEX).read_text())["weight_map"]["model.embed_tokens.weight"]
    assert model.embed.untyped_storage().nbytes() == shard.stat().st_size  # a view into the mapped file
    converted = Decoder.from_folder(llama3_folder, torch.float32)
    assert converted.embed.untyped_storage().nbytes() == converted.embed.nbytes


def test_fused_projections_whose_parts_sit_in_different_shards(tmp_path):
    """q in one shard, k and v in the next; gate and up apart: each still lands in its rows."""
    cfg_dict = llama3_config(num_hidden_layers=2)
    tensors = checkpoint_tensors(DecoderConfig.from_dict(cfg_dict))
    cut = next(i for i, (name, _) in enumerate(tensors) if name.endswith("0.self_attn.k_proj.weight"))
    up = next(i for i, (name, _) in enumerate(tensors) if name.endswith("1.mlp.up_proj.weight"))
    groups = [tensors[:cut], tensors[cut:up], tensors[up:]]
    folder = tmp_path / "split"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg_dict))
    names = shard_names(3)
    for group, name in zip(groups, names):
        write_shard(folder / name, group, torch.bfloat16, seed=5, std=0.02)
    write_index(folder / INDEX, groups, names, 2)
    for kwargs in ({}, {"blocked": True}):
        got, want = weights_of(Decoder.from_folder(folder, torch.bfloat16, **kwargs)), weights_of(
            reference(folder, torch.bfloat16, **kwargs))
        assert all(torch.equal(got[k], want[k]) for k in want)


def rewrite_shard(folder, tensor, change):
    """Apply ``change`` to the tensors of the shard that holds ``tensor``."""
    path = folder / json.loads((folder / INDEX).read_text())["weight_map"][tensor]
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def nan_at(name, index):
    def change(tensors):
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[index] = float("nan")
    return change


@pytest.mark.parametrize("tensor, change, message", [
    ("model.layers.1.mlp.gate_proj.weight", lambda t: t.update({"model.layers.1.mlp.gate_proj.weight": torch.zeros(
        255, 128, dtype=torch.bfloat16)}), "has shape \\(255, 128\\), expected \\(256, 128\\)"),
    ("model.layers.2.self_attn.v_proj.weight", lambda t: t.pop("model.layers.2.self_attn.v_proj.weight"),
     "missing tensor"),
    ("model.norm.weight", lambda t: t.update(extra=torch.zeros(2)), "unexpected tensor"),
    ("model.layers.0.self_attn.k_proj.weight", nan_at("model.layers.0.self_attn.k_proj.weight", 4000), "NaN"),
    ("model.embed_tokens.weight", nan_at("model.embed_tokens.weight", 49152 * 128 - 1), "NaN"),  # the last value
    ("lm_head.weight", nan_at("lm_head.weight", 12345), "NaN"),
])
def test_bad_tensors_in_a_shard_are_corrupt(folder, tensor, change, message):
    rewrite_shard(folder, tensor, change)
    for dtype in (torch.bfloat16, torch.float32):
        with pytest.raises(CorruptModel, match=message):
            Decoder.from_folder(folder, dtype)


def test_a_missing_shard_is_corrupt(folder):
    (folder / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CorruptModel, match="missing: model-00002-of-00003.safetensors"):
        Decoder.from_folder(folder, torch.bfloat16)


def test_a_truncated_shard_is_corrupt(folder):
    path = folder / "model-00003-of-00003.safetensors"
    path.write_bytes(path.read_bytes()[:path.stat().st_size - 10])
    with pytest.raises(CorruptModel, match="not a readable safetensors"):
        Decoder.from_folder(folder, torch.bfloat16)


@pytest.mark.real
def test_generate_through_the_cli_with_the_real_tokenizer(tmp_path, capsys, monkeypatch, smollm2_folder):
    monkeypatch.setenv("MTPCTL_HOME", str(tmp_path / "home"))
    folder = write_synthetic_checkpoint(tmp_path / "ckpt", llama3_config(), shards=3, seed=7,
                                        tokenizer_from=smollm2_folder)
    results = []
    for extra in ([], ["--speculate", "ngram"]):
        code = main(["generate", "-m", str(folder), "--dtype", "bfloat16", "--max-new-tokens", "8", "--json",
                     *extra, "Repeat after me: one two three, one two three."])
        out, err = capsys.readouterr()
        assert code == 0, err
        results.append(json.loads(out))
    plain, ngram = results
    assert plain["token_ids"] == ngram["token_ids"] and 1 <= len(plain["token_ids"]) <= 8
    assert ngram["speculate"] == "ngram" and plain["dtype"] == "bfloat16"


@pytest.mark.real
@pytest.mark.slow
def test_heads_trained_on_it_decode_and_export_for_an_engine(tmp_path, capsys, monkeypatch, smollm2_folder):
    """The pipeline on a Llama 3.x-shaped, sharded bfloat16 checkpoint: EAGLE-3 heads self-distilled on
    a few hundred positions, greedy decoding with them equal to plain, and the speculators export naming
    the checkpoint's own architecture and folder, not a local path."""
    monkeypatch.setenv("MTPCTL_HOME", str(tmp_path / "home"))
    folder = write_synthetic_checkpoint(tmp_path / "llama3-ckpt", llama3_config(), shards=3, seed=7,
                                        tokenizer_from=smollm2_folder)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Write a short note number {i} about caches."}) + "\n"
                            for i in range(24)))
    heads = tmp_path / "heads"
    code = main(["add-heads", "-m", str(folder), "--kind", "eagle3", "--num-heads", "2", "--data", str(data),
                 "--self-distill", "--response-tokens", "24", "--epochs", "1", "--device", "cpu",
                 "--measure-prompts", "0", "--out", str(heads), "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert 200 <= json.loads(out)["positions"] <= 1000
    results = []
    for spec in (["--speculate", "none"], ["--speculate", "heads", "--heads", str(heads)]):
        code = main(["generate", "-m", str(folder), "--dtype", "bfloat16", *spec, "--max-new-tokens", "12", "--json",
                     "Write a short note about caches."])
        out, err = capsys.readouterr()
        assert code == 0, err
        results.append(json.loads(out)["token_ids"])
    assert results[0] == results[1]
    export = tmp_path / "speculators"
    code = main(["export", str(heads), "--format", "speculators", "--out", str(export)])
    _, err = capsys.readouterr()
    assert code == 0, err
    verifier = json.loads((export / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": "llama3-ckpt", "architectures": ["LlamaForCausalLM"]}


#: a checkpoint of about 250 MB of bfloat16 weights: big enough that a second copy shows
MEMORY_CONFIG = {"vocab_size": 49152, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 6,
                 "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64}

PEAK_SCRIPT = textwrap.dedent("""
    import json, resource, sys, torch
    from mtpctl.model.decoder import Decoder
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model = Decoder.from_folder(sys.argv[1], torch.bfloat16, blocked=sys.argv[2] == "blocked")
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"grew": (after - before) * 1024, "held": model.weight_bytes}))
""")


def test_loading_takes_the_weights_not_twice_them(tmp_path):
    """A bfloat16 checkpoint loaded as bfloat16: the process's peak resident memory grows by the
    weights it ends up holding plus about one tensor, not by a second copy of the checkpoint (the
    peak is measured in a child process; its own start, torch's import, is taken off)."""
    folder = write_synthetic_checkpoint(tmp_path / "ckpt", llama3_config(**MEMORY_CONFIG), shards=3)
    assert_loads_without_a_second_copy(folder, largest=49152 * 768 * 2, ratio=1.4)  # largest: the embedding


def assert_loads_without_a_second_copy(folder, largest: int, ratio: float) -> None:
    """Loading ``folder`` as bfloat16, dense and blocked, grows the peak resident memory (measured in a
    child process, its start-up taken off) by at most the weights held plus ``largest`` bytes (one
    tensor) and 32 MiB, and by under ``ratio`` times the checkpoint's weights."""
    weights = checkpoint_bytes(DecoderConfig.from_folder(folder))
    assert weights > 200 << 20
    for layout in ("dense", "blocked"):
        run = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(folder), layout], capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        got = json.loads(run.stdout)
        assert got["grew"] < got["held"] + largest + (32 << 20), (layout, got, weights)
        assert got["grew"] < ratio * weights, (layout, got, weights)


def qwen3_moe_config(**overrides) -> dict:
    """A small Qwen3-MoE config (the family of benchmarks/shapes/qwen3-moe-scaled.json)."""
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 49152,
           "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 32, "hidden_act": "silu", "num_experts": 8,
           "num_experts_per_tok": 2, "moe_intermediate_size": 64, "norm_topk_prob": True, "decoder_sparse_step": 1,
           "mlp_only_layers": [], "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
           "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}
    cfg.update(overrides)
    return cfg


def test_a_moe_checkpoint_holds_one_tensor_per_expert_and_loads_like_the_stacked_one(tmp_path):
    """A qwen3_moe config's synthetic checkpoint: the experts one tensor each, as save_pretrained writes
    them (or stacked with per_expert=False), sharded with an index; both load strictly and decode (their
    values differ: a tensor's values are seeded by its name)."""
    per = write_synthetic_checkpoint(tmp_path / "per", qwen3_moe_config(), shards=3, seed=5)
    stacked = write_synthetic_checkpoint(tmp_path / "stacked", qwen3_moe_config(), shards=3, seed=5,
                                         per_expert=False)
    index = json.loads((per / INDEX).read_text())["weight_map"]
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in index
    assert not any("gate_up_proj" in n for n in index)
    assert "model.layers.1.mlp.experts.gate_up_proj" in json.loads((stacked / INDEX).read_text())["weight_map"]
    cfg = DecoderConfig.from_folder(per)
    assert checkpoint_bytes(cfg) == json.loads((per / INDEX).read_text())["metadata"]["total_size"]
    a, b = Decoder.from_folder(per, torch.bfloat16), Decoder.from_folder(stacked, torch.bfloat16)
    assert a.layers[1].experts_gate_up.dtype == torch.bfloat16
    # the same values: expert e's gate rows, then its up rows (seeded by name, so compare with the file)
    gate = load_file(str(per / index["model.layers.1.mlp.experts.3.gate_proj.weight"]))[
        "model.layers.1.mlp.experts.3.gate_proj.weight"]
    assert torch.equal(a.layers[1].experts_gate_up[3, :64], gate)
    for layer in (0, 1):
        assert a.layers[layer].experts_down.shape == b.layers[layer].experts_down.shape == (8, 128, 64)
    from mtpctl.backends.torch import TorchEngine

    for model in (a, b):
        assert torch.isfinite(TorchEngine(model, 16).prefill([5, 6, 7, 8]).logits).all()


def test_expert_tensors_are_read_straight_into_their_stacked_parameters(tmp_path, monkeypatch):
    """Loading a per-expert bfloat16 checkpoint as bfloat16: every expert tensor is read once, by
    read_into, into a view of its layer's final expert parameter (no tensor read whole first, no
    stack or float copy made afterwards); the parameters are the ones filled."""
    from mtpctl.model.weights import CheckpointReader

    folder = write_synthetic_checkpoint(tmp_path / "ckpt", qwen3_moe_config(), shards=2)
    targets, whole = {}, []
    read_into, read = CheckpointReader.read_into, CheckpointReader.read

    def spy_into(self, name, out):
        targets[name] = (out.untyped_storage().data_ptr(), out.dtype)
        return read_into(self, name, out)

    def spy_read(self, name):
        whole.append(name)
        return read(self, name)

    monkeypatch.setattr(CheckpointReader, "read_into", spy_into)
    monkeypatch.setattr(CheckpointReader, "read", spy_read)
    for blocked in (False, True):
        targets.clear()
        whole.clear()
        model = Decoder.from_folder(folder, torch.bfloat16, blocked=blocked)
        assert not [n for n in whole if ".experts." in n]
        for n, layer in enumerate(model.layers):
            for attr, proj in (("experts_gate_up", "gate_proj"), ("experts_gate_up", "up_proj"),
                               ("experts_down", "down_proj")):
                param = getattr(layer, attr)
                assert isinstance(param, torch.nn.Parameter) and param.dtype == torch.bfloat16
                for e in range(8):
                    ptr, dtype = targets[f"model.layers.{n}.mlp.experts.{e}.{proj}.weight"]
                    assert (ptr, dtype) == (param.untyped_storage().data_ptr(), torch.bfloat16), (n, e, proj)


MOE_MEMORY_CONFIG = {"hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
                     "head_dim": 64, "num_experts": 64, "num_experts_per_tok": 4, "moe_intermediate_size": 256}


def test_loading_a_moe_checkpoint_takes_the_weights_not_twice_them(tmp_path):
    """A per-expert bfloat16 MoE checkpoint loaded as bfloat16: peak resident memory grows by the
    weights held plus about one tensor, as for a dense one."""
    folder = write_synthetic_checkpoint(tmp_path / "ckpt", qwen3_moe_config(**MOE_MEMORY_CONFIG), shards=3)
    assert_loads_without_a_second_copy(folder, largest=49152 * 512 * 2, ratio=1.3)  # largest: the embedding
