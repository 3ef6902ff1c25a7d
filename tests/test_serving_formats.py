"""mtpctl export --format speculators|eagle|vllm|trtllm: config keys, tensor names and shapes as the
engines' loaders read them (written out here from vLLM's, speculators' and the EAGLE / Medusa
checkpoints' own names, not from mtpctl's writer), a round trip back into mtpctl that decodes
identically, and the refusals."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import TREE, make_heads, perturbed, random_eagle, truncated_heads

from mtpctl.backends.torch import TorchEngine
from mtpctl.cli.main import main
from mtpctl.decode.loop import generate
from mtpctl.decode.sampling import SamplingParams
from mtpctl.decode.stopping import StopChecker
from mtpctl.drafters.heads.config import HeadsConfig
from mtpctl.drafters.heads.eagle3 import Eagle3Drafter, Eagle3Head, eagle3_layer_config
from mtpctl.drafters.heads.folder import load_heads, save_heads
from mtpctl.drafters.heads.medusa import MedusaDrafter
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
    assert config["base_model_name_or_path"] == "tiny-llama" and config["medusa_choices"] == TREE  # the folder's name
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
    assert spec["verifier"] == {"name_or_path": "tiny-llama", "architectures": ["LlamaForCausalLM"]}
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


# --- targets at scale: only config.json and the tensors a layout holds are read, in their stored dtypes ---


def bf16_checkpoint(src, dest, shards=False):
    """A copy of checkpoint ``src`` with its weights in bfloat16; with ``shards``, in two files and a
    ``model.safetensors.index.json`` (the lm_head, when untied, in the second)."""
    shutil.copytree(src, dest)
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(str(dest / "model.safetensors")).items()}
    (dest / "model.safetensors").unlink()
    cfg = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16"}))
    if not shards:
        save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
        return dest
    second = {"lm_head.weight", "model.norm.weight"}
    parts = {"model-00001-of-00002.safetensors": sorted(set(tensors) - second),
             "model-00002-of-00002.safetensors": sorted(second & set(tensors))}
    for file, names in parts.items():
        save_file({n: tensors[n] for n in names}, str(dest / file), metadata={"format": "pt"})
    weight_map = {n: file for file, names in parts.items() for n in names}
    (dest / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dest


@pytest.fixture
def no_decoder(monkeypatch):
    """Building the target's Decoder fails: an export must not load the target's weights."""
    def refuse(*args, **kwargs):
        raise AssertionError("the export built the target's Decoder")

    monkeypatch.setattr(Decoder, "from_folder", classmethod(refuse))
    monkeypatch.setattr(Decoder, "__init__", refuse)


@pytest.mark.parametrize("fmt", ["vllm", "trtllm", "speculators", "eagle"])
def test_formats_write_heads_only_without_building_the_target(fmt, tiny_folder, tmp_path, request):
    heads_dir = make_heads(tmp_path / "h", tiny_folder) if fmt in ("vllm", "trtllm") else \
        eagle3_heads(tmp_path / "h", tiny_folder, Decoder.from_folder(tiny_folder))
    request.getfixturevalue("no_decoder")
    config = export_serving_heads(fmt, tiny_folder, heads_dir, tmp_path / "out")
    weights = "medusa_lm_head.safetensors" if config.get("medusa_num_heads") else "model.safetensors"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(["config.json", weights])
    tensors = load_file(str(tmp_path / "out" / weights))
    assert not any("embed_tokens" in n or n.startswith("model.layers.") for n in tensors)  # nothing of the target
    if fmt in ("vllm", "trtllm"):  # the shared lm_head: the tied checkpoint's embedding, bit for bit
        embed = load_file(str(tiny_folder / "model.safetensors"))["model.embed_tokens.weight"]
        assert torch.equal(tensors["lm_heads.0.weight" if fmt == "vllm" else "0.1.weight"], embed)


@pytest.mark.parametrize("fmt,name", [("vllm", "lm_heads.0.weight"), ("trtllm", "2.1.weight")])
def test_bf16_target_lm_head_stays_bf16_read_through_the_index(fmt, name, tmp_path, no_decoder):
    from helpers import write_tiny_checkpoint

    target = bf16_checkpoint(write_tiny_checkpoint(tmp_path / "f32", tie_word_embeddings=False), tmp_path / "bf16",
                             shards=True)
    heads_dir = make_heads(tmp_path / "h", target)
    export_serving_heads(fmt, target, heads_dir, tmp_path / "out")
    weights = "model.safetensors" if fmt == "vllm" else "medusa_lm_head.safetensors"
    tensors = load_file(str(tmp_path / "out" / weights))
    stored = load_file(str(target / "model-00002-of-00002.safetensors"))["lm_head.weight"]
    assert tensors[name].dtype == torch.bfloat16 and torch.equal(tensors[name], stored)
    assert tensors[name.replace(".1.weight", ".0.linear.weight") if fmt == "trtllm" else
                   "blocks.0.layers.0.weight"].dtype == torch.float32  # the heads' own dtype, as stored
    export_serving_heads(fmt, target, heads_dir, tmp_path / "f16", dtype="float16")
    assert {t.dtype for t in load_file(str(tmp_path / "f16" / weights)).values()} == {torch.float16}


def test_heads_keep_their_stored_dtype_unless_dtype_is_given(tiny_folder, tmp_path):
    heads_dir = eagle3_heads(tmp_path / "h", tiny_folder, Decoder.from_folder(tiny_folder))
    path = heads_dir / "mtp_heads.safetensors"
    stored = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(str(path)).items()}
    save_file(stored, str(path), metadata={"format": "pt"})
    config = export_serving_heads("speculators", tiny_folder, heads_dir, tmp_path / "s")
    tensors = load_file(str(tmp_path / "s" / "model.safetensors"))
    assert {t.dtype for n, t in tensors.items() if n not in ("d2t", "t2d")} == {torch.bfloat16}
    assert torch.equal(tensors["fc.weight"], stored["fc"]) and config["torch_dtype"] == "bfloat16"
    assert config["transformer_layer_config"]["torch_dtype"] == "bfloat16"
    config = export_serving_heads("eagle", tiny_folder, heads_dir, tmp_path / "e", dtype="float32")
    assert load_file(str(tmp_path / "e" / "model.safetensors"))["fc.weight"].dtype == torch.float32
    assert config["torch_dtype"] == "float32"
    with pytest.raises(BadInput) as caught:
        export_serving_heads("eagle", tiny_folder, heads_dir, tmp_path / "x", dtype="int8")
    assert caught.value.option == "dtype" and not (tmp_path / "x").exists()


@pytest.mark.parametrize("model_type,architectures", [("qwen2", ["Qwen2ForCausalLM"]), ("qwen3", ["Qwen3ForCausalLM"]),
                                                      ("qwen3", None), ("mistral", None)])
def test_verifier_architectures_are_the_targets_own(model_type, architectures, tmp_path):
    from helpers import write_tiny_checkpoint

    target = write_tiny_checkpoint(tmp_path / "target", model_type=model_type, architectures=architectures)
    if architectures is None:  # a config.json without the key: the model_type's causal LM
        cfg = json.loads((target / "config.json").read_text())
        del cfg["architectures"]
        (target / "config.json").write_text(json.dumps(cfg))
    heads_dir = eagle3_heads(tmp_path / "h", target, Decoder.from_folder(target))
    config = export_serving_heads("speculators", target, heads_dir, tmp_path / "s")
    want = architectures or [{"qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}[model_type]]
    assert config["speculators_config"]["verifier"]["architectures"] == want
    assert config["transformer_layer_config"]["architectures"] == ["LlamaForCausalLM"]  # the draft layer's own


def test_every_family_has_an_architecture_for_configs_without_one():
    from mtpctl.export.serving import ARCHITECTURES
    from mtpctl.model.families import FAMILIES

    assert set(ARCHITECTURES) == set(FAMILIES)


def test_verifier_is_a_hub_id_or_the_folder_name_never_a_local_path(tiny_folder, tmp_path):
    hub = tmp_path / "hub" / "models--SomeOrg--Some-Model-8B" / "snapshots" / "0123abcd"
    shutil.copytree(tiny_folder, hub)
    medusa, eagle3 = make_heads(tmp_path / "m", hub), eagle3_heads(tmp_path / "e", hub, Decoder.from_folder(hub))
    spec = export_serving_heads("speculators", hub, eagle3, tmp_path / "s")["speculators_config"]["verifier"]
    assert spec["name_or_path"] == "SomeOrg/Some-Model-8B"
    assert export_serving_heads("trtllm", hub, medusa, tmp_path / "t")["base_model_name_or_path"] == \
        "SomeOrg/Some-Model-8B"
    named = export_serving_heads("speculators", hub, eagle3, tmp_path / "n", verifier="org/served-name")
    assert named["speculators_config"]["verifier"]["name_or_path"] == "org/served-name"
    for folder in ("s", "t", "n"):  # no local path outside the mtpctl entry (the head folder's own record)
        config = json.loads((tmp_path / folder / "config.json").read_text())
        del config["mtpctl"]
        assert str(tmp_path) not in json.dumps(config)
    with pytest.raises(BadInput) as caught:
        export_serving_heads("eagle", hub, eagle3, tmp_path / "x", verifier=" ")
    assert caught.value.option == "verifier"


def test_cli_verifier_and_dtype(tiny_folder, tmp_path, capsys):
    eagle3 = eagle3_heads(tmp_path / "e3", tiny_folder, Decoder.from_folder(tiny_folder))
    assert main(["export", str(eagle3), "--format", "speculators", "--out", str(tmp_path / "s"),
                 "--verifier", "Qwen/Qwen3-8B", "--dtype", "bfloat16"]) == 0
    captured = capsys.readouterr()
    assert "heads only, not the target" in captured.err and "Qwen/Qwen3-8B" in captured.err
    assert "eagle3 heads (3 deep) in the speculators format (2 files" in captured.out
    config = json.loads((tmp_path / "s" / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == "Qwen/Qwen3-8B"
    assert load_file(str(tmp_path / "s" / "model.safetensors"))["fc.weight"].dtype == torch.bfloat16
    assert main(["export", str(eagle3), "--format", "eagle", "--out", str(tmp_path / "e")]) == 0
    assert "as tiny-llama" in capsys.readouterr().err
    assert main(["export", str(eagle3), "--format", "eagle", "--out", str(tmp_path / "x"), "--verifier", ""]) == 2
    assert capsys.readouterr().err.rstrip().endswith("(--verifier)")
    assert main(["export", str(tiny_folder), "--onnx", str(tmp_path / "onnx"), "--dtype", "bfloat16"]) == 2
    assert "--dtype" in capsys.readouterr().err and not (tmp_path / "onnx").exists()


def test_save_tensors_streams_shared_and_mixed_dtype_tensors(tmp_path):
    from safetensors import safe_open

    from mtpctl.export.serving import save_tensors

    shared = torch.randn(7, 3).to(torch.bfloat16)
    tensors = {"a": shared, "b": shared, "flag": torch.tensor([True, False, True]), "ids": torch.arange(5),
               "w": torch.randn(2, 3)[:, 1:], "h": torch.ones(3, dtype=torch.float16)}
    save_tensors(tmp_path / "x.safetensors", tensors, {"format": "pt"})
    back = load_file(str(tmp_path / "x.safetensors"))
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], v) and back[k].dtype == v.dtype
                                                 for k, v in tensors.items())
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}
