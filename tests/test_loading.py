"""Config parsing and strict safetensors loading: every malformed checkpoint is a clear error."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import BLOCKED_DTYPES, tiny_config_dict
from mtpctl.errors import CorruptModel, UnsupportedModel
from mtpctl.model.config import DecoderConfig
from mtpctl.model.decoder import Decoder
from mtpctl.model.linears import blocked_layout_available
from mtpctl.model.row_invariance import dense_path, path_of
from mtpctl.decode.tree import DraftTree


@pytest.fixture
def folder(tiny_folder, tmp_path):
    """A writable copy of the tiny checkpoint."""
    return shutil.copytree(tiny_folder, tmp_path / "copy")


def rewrite(folder, change):
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))


def test_loads_and_ties_lm_head(folder):
    model = Decoder.from_folder(folder)
    assert model.lm_head is model.embed
    assert model.layers[0].qkv.shape == ((4 + 2 * 2) * 16, 64)  # q, k, v fused


@pytest.mark.skipif(not blocked_layout_available(), reason="this torch build has no oneDNN linear ops")
@pytest.mark.parametrize("dtype", BLOCKED_DTYPES)
def test_blocked_linears_keep_the_same_values(folder, dtype):
    dense = Decoder.from_folder(folder, dtype)
    model = Decoder.from_folder(folder, dtype, blocked=True)
    # each linear on the fastest path that holds on this CPU (oneDNN's is not row-invariant under AMX)
    for linear, shape in ((model.layers[0].qkv, tuple(dense.layers[0].qkv.shape)), (model.lm_head, tuple(dense.embed.shape))):
        assert path_of(linear) == dense_path(dtype, shape)
    assert torch.equal(model.layers[0].qkv.dense(), dense.layers[0].qkv)
    assert torch.equal(model.dense_lm_head(), model.embed)  # tied: the embedding stays dense
    relaid = not path_of(model.lm_head).startswith("fixed-rows")  # fixed-row blocks read the embedding itself
    assert model.weight_bytes == dense.weight_bytes + relaid * model.lm_head.nbytes  # + the head's re-laid copy


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop("model.norm.weight"), "missing tensor"),
    (lambda t: t.update(extra=torch.zeros(2)), "unexpected tensor"),
    (lambda t: t.update({"model.norm.weight": torch.ones(65)}), "has shape"),
    (lambda t: t["model.layers.1.mlp.down_proj.weight"].view(-1).__setitem__(3, float("nan")), "NaN"),
])
def test_strict_loading_rejects_bad_tensors(folder, change, message):
    rewrite(folder, change)
    with pytest.raises(CorruptModel, match=message):
        Decoder.from_folder(folder)


def test_truncated_safetensors_is_corrupt(folder):
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CorruptModel, match="not a readable safetensors"):
        Decoder.from_folder(folder)


def test_sharded_index_naming_a_missing_shard(folder):
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "shard-2.safetensors"}}))
    with pytest.raises(CorruptModel, match="shard-2"):
        Decoder.from_folder(folder)


def test_config_variants():
    qwen2 = DecoderConfig.from_dict(tiny_config_dict(model_type="qwen2"))
    assert qwen2.attention_bias and not qwen2.qk_norm
    qwen3 = DecoderConfig.from_dict(tiny_config_dict(model_type="qwen3"))
    assert qwen3.qk_norm and not qwen3.attention_bias
    mixed = DecoderConfig.from_dict(tiny_config_dict(
        sliding_window=8, layer_types=["full_attention", "sliding_attention"]))
    assert mixed.layer_windows == (None, 8)
    llama3 = DecoderConfig.from_dict(tiny_config_dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}))
    assert llama3.rope.rope_type == "llama3" and llama3.rope.factor == 8.0


@pytest.mark.parametrize("overrides, error", [
    ({"model_type": "gpt2"}, UnsupportedModel),
    ({"hidden_act": "gelu"}, UnsupportedModel),
    ({"rope_scaling": {"rope_type": "yarn"}}, UnsupportedModel),
    ({"hidden_size": None}, CorruptModel),
])
def test_unsupported_or_broken_configs(overrides, error):
    cfg = tiny_config_dict(**overrides)
    if cfg["hidden_size"] is None:
        del cfg["hidden_size"]
    with pytest.raises(error):
        DecoderConfig.from_dict(cfg)


def test_qwen_variants_run(tmp_path):
    from helpers import random_decoder
    from mtpctl.backends.torch import TorchEngine

    for model_type in ("qwen2", "qwen3"):
        model = random_decoder(model_type=model_type)
        logits = TorchEngine(model, 8).verify(DraftTree.chain([1, 2, 3])).logits
        assert logits.shape == (3, 259) and torch.isfinite(logits).all()
