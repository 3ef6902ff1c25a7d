"""mtpctl export --format speculators|eagle|vllm|trtllm: config keys, tensor names and shapes as the
engines' loaders read them (written out here from vLLM's, speculators' and the EAGLE / Medusa
checkpoints' own names, not from mtpctl's writer), a round trip back into mtpctl that decodes
identically, and the refusals."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from helpers import perturbed
from test_export_onnx import TREE, make_heads

from mtpctl.backends.torch import TorchEngine
from mtpctl.cli.main import main
from mtpctl.decode.loop import generate
from mtpctl.decode.sampling import SamplingParams
from mtpctl.decode.stopping import StopChecker
from mtpctl.drafters.heads.config import HeadsConfig
from mtpctl.drafters.heads.eagle3 import Eagle3Drafter, Eagle3Head, eagle3_layer_config
from mtpctl.drafters.heads.folder import load_heads, save_heads
from mtpctl.drafters.heads.medusa import MedusaDrafter, MedusaHeads
from mtpctl.drafters.heads.tree import StaticTree
from mtpctl.errors import BadInput, UnsupportedModel
from mtpctl.export.imports import read_layout
from mtpctl.export.serving import export_serving_heads
from mtpctl.model.decoder import Decoder
from mtpctl.model.weights import weights_hash

HIDDEN, VOCAB, K = 64, 259, 3
PROMPT = [257, 5, 6, 7, 5, 6]
# the tiny model's layer: 4 heads of 16 over 2 KV heads, MLP 128
Q, KV, MLP = 64, 32, 128


def stop(steps=30):
    return StopChecker(set(), (), steps, lambda ids: "")


def plain(model):
    return generate(TorchEngine(model, 80), PROMPT, stop(), SamplingParams(0.0)).token_ids


def decode(model, heads, paths=TREE):
    tree = StaticTree.from_paths(paths, heads.cfg.num_heads)
    if isinstance(heads, Eagle3Head):
        d = Eagle3Drafter(heads, tree, lambda ids: model.embed[ids])
        engine = TorchEngine(model, 80, aux_layers=heads.cfg.layer.aux_layers)
    else:
        d, engine = MedusaDrafter(tree, heads, model), TorchEngine(model, 80)
    result = generate(engine, PROMPT, stop(), SamplingParams(0.0), d)
    return result.token_ids, result.stats.accepted_tokens


def truncated_heads(folder, target, model, own: bool):
    """Medusa heads with a draft vocabulary of 100 tokens (token_map), own lm_heads or the target's rows."""
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


def eagle3_heads(folder, target, model, draft_vocab=100, seed=0):
    """An EAGLE-3 head folder with random weights (a draft vocabulary of ``draft_vocab`` random ids)."""
    layer = eagle3_layer_config(model.cfg)
    cfg = HeadsConfig("eagle3", K, 0, True, HIDDEN, VOCAB, draft_vocab, target=str(target),
                      target_hash=weights_hash(target), tree=TREE, layer=layer)
    g = torch.Generator().manual_seed(seed)
    token_map = torch.randperm(VOCAB, generator=g)[:draft_vocab].sort().values if draft_vocab else None
    torch.manual_seed(seed)
    folder.mkdir(parents=True)
    save_heads(perturbed(Eagle3Head(cfg, torch.float32, model.dense_lm_head(), token_map), seed), folder)
    return folder


def test_vllm_medusa_layout_names_shapes_config(tiny_folder, tmp_path):
    heads_dir = make_heads(tmp_path / "h", tiny_folder)
    config = export_serving_heads("vllm", tiny_folder, heads_dir, tmp_path / "v")
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


def test_trtllm_medusa_layout_names_shapes_config(tiny_folder, tmp_path):
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


#: the EAGLE-3 layer's tensors as vLLM's Eagle3LlamaForCausalLM loads them (q/k/v read [embedding; feature]: 2H)
EAGLE3_LAYER = {"input_layernorm.weight": (HIDDEN,), "hidden_norm.weight": (HIDDEN,),
                "post_attention_layernorm.weight": (HIDDEN,), "self_attn.q_proj.weight": (Q, 2 * HIDDEN),
                "self_attn.k_proj.weight": (KV, 2 * HIDDEN), "self_attn.v_proj.weight": (KV, 2 * HIDDEN),
                "self_attn.o_proj.weight": (HIDDEN, Q), "mlp.gate_proj.weight": (MLP, HIDDEN),
                "mlp.up_proj.weight": (MLP, HIDDEN), "mlp.down_proj.weight": (HIDDEN, MLP)}


@pytest.mark.parametrize("fmt,prefix", [("speculators", "layers.0."), ("eagle", "midlayer."), ("vllm", "layers.0."),
                                        ("trtllm", "midlayer.")])
def test_eagle3_layouts_names_shapes_and_vocabulary_maps(fmt, prefix, tiny_folder, tmp_path):
    heads_dir = eagle3_heads(tmp_path / "h", tiny_folder, Decoder.from_folder(tiny_folder))
    export_serving_heads(fmt, tiny_folder, heads_dir, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    want = {prefix + k: v for k, v in EAGLE3_LAYER.items()}
    want.update({"fc.weight": (HIDDEN, 3 * HIDDEN), "norm.weight": (HIDDEN,), "lm_head.weight": (100, HIDDEN),
                 "d2t": (100,), "t2d": (VOCAB,)})
    assert {k: tuple(v.shape) for k, v in tensors.items()} == want
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    token_map = load_file(str(heads_dir / "mtp_heads.safetensors"))["token_map"]
    assert torch.equal(torch.arange(100) + tensors["d2t"], token_map)  # target id = draft id + d2t[draft id]
    assert tensors["t2d"].sum() == 100 and bool(tensors["t2d"][token_map].all())


def test_speculators_config_has_what_vllm_reads(tiny_folder, tmp_path):
    heads_dir = eagle3_heads(tmp_path / "h", tiny_folder, Decoder.from_folder(tiny_folder))
    config = export_serving_heads("speculators", tiny_folder, heads_dir, tmp_path / "s")
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0]["speculative_tokens"] == K
    assert spec["verifier"]["name_or_path"] == str(tiny_folder.resolve()) and spec["verifier"]["architectures"]
    layer = config["transformer_layer_config"]
    assert (layer["num_hidden_layers"], layer["hidden_size"], layer["num_attention_heads"], layer["num_key_value_heads"],
            layer["head_dim"], layer["intermediate_size"], layer["vocab_size"]) == (1, HIDDEN, 4, 2, 16, MLP, VOCAB)
    assert (config["draft_vocab_size"], config["target_hidden_size"], config["eagle_aux_hidden_state_layer_ids"]) == \
        (100, HIDDEN, [0, 1, 2])
    assert config["norm_before_residual"] is False  # always written: vLLM reads a missing one as true
    eagle = export_serving_heads("eagle", tiny_folder, heads_dir, tmp_path / "e")
    assert eagle["architectures"] == ["LlamaForCausalLMEagle3"] and eagle["num_hidden_layers"] == 1
    assert eagle["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2] and eagle["draft_vocab_size"] == 100


MEDUSA_KINDS = ["shared", "own", "truncated-shared", "truncated-own"]


@pytest.mark.parametrize("fmt,kind", [(f, k) for f in ("vllm", "trtllm") for k in MEDUSA_KINDS] +
                         [(f, "eagle3") for f in ("speculators", "eagle", "vllm", "trtllm")] +
                         [("eagle", "eagle3-full-vocab")])
def test_round_trip_decodes_identically(fmt, kind, tiny_folder, tmp_path):
    model = Decoder.from_folder(tiny_folder)
    if kind.startswith("eagle3"):
        heads_dir = eagle3_heads(tmp_path / "h", tiny_folder, model, 0 if kind.endswith("full-vocab") else 100)
    elif kind.startswith("truncated"):
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
    notes = []
    _, back = read_layout(tmp_path / "out", model, notes)
    assert notes == [] and type(back) is type(original)
    assert back.cfg.own_lm_head == original.cfg.own_lm_head and back.cfg.layer == original.cfg.layer
    assert back.cfg.draft_vocab_size == original.cfg.draft_vocab_size and back.cfg.tree == TREE
    for name, value in original.state_dict().items():
        assert torch.equal(back.state_dict()[name], value), name
    tokens, accepted = decode(model, back)
    assert tokens == decode(model, original)[0] == plain(model)


@pytest.mark.parametrize("fmt", ["speculators", "eagle", "vllm", "trtllm"])
def test_kinds_a_format_cannot_express_are_refused_with_what_it_takes(fmt, tiny_folder, tmp_path):
    model = Decoder.from_folder(tiny_folder)
    conditioned = make_heads(tmp_path / "c", tiny_folder)
    cfg = json.loads((conditioned / "mtp_config.json").read_text())
    (conditioned / "mtp_config.json").write_text(json.dumps({**cfg, "token_conditioned": True}))
    from test_eagle import random_eagle

    eagle = tmp_path / "eagle"
    eagle.mkdir()
    head = random_eagle(model)
    head.cfg.target_hash = weights_hash(tiny_folder)
    save_heads(head, eagle)
    for folder in (eagle, conditioned) if fmt in ("vllm", "trtllm") else (eagle, make_heads(tmp_path / "m", tiny_folder)):
        with pytest.raises(UnsupportedModel) as caught:
            export_serving_heads(fmt, tiny_folder, folder, tmp_path / "out")
        assert caught.value.option == "fmt" and "recipes/smollm2-135m-eagle3.yaml" in str(caught.value)
        assert not (tmp_path / "out").exists()
    assert "takes eagle3 heads, not eagle heads" in str(pytest.raises(
        UnsupportedModel, export_serving_heads, "eagle", tiny_folder, eagle, tmp_path / "o").value)


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
    assert main(["export", str(heads_dir), "--format", "speculators", "--out", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "takes eagle3 heads, not medusa heads" in err and err.rstrip().endswith("(--format)")
    eagle3 = eagle3_heads(tmp_path / "e3", tiny_folder, Decoder.from_folder(tiny_folder))
    assert main(["export", str(eagle3), "--format", "eagle", "--out", str(tmp_path / "e")]) == 0
    assert "eagle3 heads (3 deep) in the eagle format" in capsys.readouterr().out
    assert main(["export", str(eagle3), "--onnx", str(tmp_path / "onnx")]) == 2
    assert "--format" in capsys.readouterr().err
