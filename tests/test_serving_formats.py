"""mtpctl export --format vllm|trtllm: documented tensor names, shapes and config keys, and a round trip
back into MedusaHeads that decodes identically."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from test_export_onnx import TREE, make_heads

from mtpctl.cli.main import main
from mtpctl.export.serving import export_serving_heads, load_serving_heads
from mtpctl.errors import BadInput
from mtpctl.backends.torch import TorchEngine
from mtpctl.decode.loop import generate
from mtpctl.drafters.heads.config import HeadsConfig
from mtpctl.drafters.heads.folder import load_heads, save_heads
from mtpctl.drafters.heads.medusa import MedusaDrafter, MedusaHeads
from mtpctl.drafters.heads.tree import StaticTree
from mtpctl.model.decoder import Decoder
from mtpctl.decode.sampling import SamplingParams
from mtpctl.decode.stopping import StopChecker
from mtpctl.model.weights import weights_hash

HIDDEN, VOCAB, K = 64, 259, 3


def decode(model, heads, prompt, steps=30):
    stop = StopChecker(set(), (), steps, lambda ids: "")
    engine = TorchEngine(model, 80)
    return generate(engine, prompt, stop, SamplingParams(0.0),
                    MedusaDrafter(StaticTree.from_paths(TREE, K), heads, model)).token_ids


def truncated_heads(folder, target, model, own: bool):
    """Heads with a draft vocabulary of 100 tokens (token_map), own lm_heads or the target's rows."""
    cfg = HeadsConfig(kind="medusa", num_heads=K, head_layers=2, own_lm_head=own, hidden_size=HIDDEN,
                      vocab_size=VOCAB, draft_vocab_size=100, target=str(target), target_hash=weights_hash(target),
                      tree=TREE)
    g = torch.Generator().manual_seed(7)
    heads = MedusaHeads(cfg, target_lm_head=model.dense_lm_head(), token_map=torch.randperm(VOCAB, generator=g)[:100])
    with torch.no_grad():
        for name, p in heads.named_parameters():
            p.copy_(p + 0.1 * torch.randn(p.shape, generator=g))
    folder.mkdir()
    save_heads(heads, folder)
    return folder


def test_vllm_layout_names_shapes_config(tiny_folder, tmp_path):
    heads_dir = make_heads(tmp_path / "h", tiny_folder)
    config = export_serving_heads("vllm", tiny_folder, heads_dir, tmp_path / "v")
    assert set(config) >= {"model_type", "architectures", "hidden_size", "vocab_size", "num_heads",
                           "num_hidden_layers", "truncated_vocab_size", "medusa_fc_bias", "original_lm_head"}
    assert (config["model_type"], config["architectures"], config["num_heads"], config["num_hidden_layers"],
            config["hidden_size"], config["vocab_size"], config["truncated_vocab_size"],
            config["original_lm_head"], config["medusa_fc_bias"]) == ("medusa", ["MedusaModel"], K, 1, HIDDEN,
                                                                        VOCAB, VOCAB, True, True)
    assert json.loads((tmp_path / "v" / "config.json").read_text()) == config
    tensors = load_file(str(tmp_path / "v" / "model.safetensors"))
    want = {f"blocks.{k}.layers.0.{p}": (HIDDEN, HIDDEN) if p == "weight" else (HIDDEN,)
            for k in range(K) for p in ("weight", "bias")}
    want["lm_heads.0.weight"] = (VOCAB, HIDDEN)  # original_lm_head: one shared projection
    assert {k: tuple(v.shape) for k, v in tensors.items()} == want
    model = Decoder.from_folder(tiny_folder)
    assert torch.equal(tensors["lm_heads.0.weight"], model.dense_lm_head())
    source = load_file(str(heads_dir / "mtp_heads.safetensors"))
    assert torch.equal(tensors["blocks.2.layers.0.weight"], source["blocks.2.0.linear.weight"])


def test_trtllm_layout_names_shapes_config(tiny_folder, tmp_path):
    heads_dir = make_heads(tmp_path / "h", tiny_folder)
    config = export_serving_heads("trtllm", tiny_folder, heads_dir, tmp_path / "t")
    assert (config["medusa_num_heads"], config["num_medusa_heads"], config["medusa_num_layers"],
            config["hidden_size"], config["vocab_size"]) == (K, K, 1, HIDDEN, VOCAB)
    assert config["base_model_name_or_path"] == str(tiny_folder) and config["medusa_choices"] == TREE
    tensors = load_file(str(tmp_path / "t" / "medusa_lm_head.safetensors"))
    want = {}
    for k in range(K):
        want.update({f"{k}.0.linear.weight": (HIDDEN, HIDDEN), f"{k}.0.linear.bias": (HIDDEN,),
                     f"{k}.1.weight": (VOCAB, HIDDEN)})  # {head}.{num_layers}.weight: the lm_head
    assert {k: tuple(v.shape) for k, v in tensors.items()} == want


@pytest.mark.parametrize("fmt", ["vllm", "trtllm"])
@pytest.mark.parametrize("kind", ["shared", "own", "truncated-shared", "truncated-own"])
def test_round_trip_decodes_identically(fmt, kind, tiny_folder, tmp_path):
    model = Decoder.from_folder(tiny_folder)
    if kind.startswith("truncated"):
        heads_dir = truncated_heads(tmp_path / "h", tiny_folder, model, own=kind.endswith("own"))
    else:
        heads_dir = make_heads(tmp_path / "h", tiny_folder, own_lm_head=kind == "own", seed=3)
    original = load_heads(heads_dir, torch.float32, model.dense_lm_head())
    if fmt == "trtllm" and kind.startswith("truncated"):
        with pytest.raises(BadInput, match="no draft vocabulary"):
            export_serving_heads(fmt, tiny_folder, heads_dir, tmp_path / "out")
        assert not (tmp_path / "out").exists()
        return
    export_serving_heads(fmt, tiny_folder, heads_dir, tmp_path / "out")
    back = load_serving_heads(tmp_path / "out", model.dense_lm_head())
    assert back.cfg.own_lm_head == original.cfg.own_lm_head
    assert back.cfg.draft_vocab_size == original.cfg.draft_vocab_size and back.cfg.tree == TREE
    h = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(0))
    assert torch.equal(back(h, model.logits), original(h, model.logits))
    prompt = [257, 5, 6, 7, 5, 6]
    plain = generate(TorchEngine(model, 80), prompt, StopChecker(set(), (), 30, lambda ids: ""),
                     SamplingParams(0.0)).token_ids
    assert decode(model, back, prompt) == decode(model, original, prompt) == plain


def test_cli_format_refusals(tiny_folder, tmp_path, capsys):
    heads_dir = make_heads(tmp_path / "h", tiny_folder)
    assert main(["export", str(heads_dir), "--format", "vllm", "--out", str(tmp_path / "v"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model_type"] == "medusa"
    assert main(["export", str(heads_dir), "--format", "vllm", "--out", str(tmp_path / "v")]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(["export", str(tiny_folder), "--format", "trtllm", "--out", str(tmp_path / "t")]) == 2
    assert "give --heads DIR" in capsys.readouterr().err
    assert main(["export", str(heads_dir), "--format", "trtllm"]) == 2
    assert "needs --out" in capsys.readouterr().err
