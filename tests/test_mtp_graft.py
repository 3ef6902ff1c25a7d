"""``add-heads --kind mtp --graft``: a checkpoint whose family has an MTP layout but whose MTP tensors were
dropped (as fine-tuning tools save them: LlamaFactory#10496, ms-swift#9050) gets a new layer, initialised
from the body, trained by self-distillation and added in a new shard.

Checkpoints: tests/test_native_mtp.py's tiny glm4_moe with its MTP layer dropped (config still declaring
one; stored in bfloat16 with the router's score bias in float32, as released), its count-0 copy, a tiny
transformers Qwen3.5 text body whose config has no MTP key (a hybrid body, ``1 + w`` norms, its last
full-attention layer not its last layer), a MiMo body (Qwen2's; the hidden state first) and
tests/test_native_mtp_ernie.py's ERNIE-4.5-MoE with its layer dropped (its final norm the body's)."""

import json
import os
import random

import pytest
import torch

from helpers import assert_one_line_exit_2, cli, copy_tokenizer_files, random_reference_model, write_tiny_checkpoint

from test_native_mtp import LAYERS, folders  # noqa: F401 (a fixture)
from test_native_mtp_ernie import folder as ernie  # noqa: F401 (a fixture)
from test_native_mtp_layouts import MIMO

transformers = pytest.importorskip("transformers")

MTP = f"model.layers.{LAYERS}."
WORDS = "apple river stone cloud seven green market window orange winter music paper".split()
PROMPTS = ([5, 17, 42, 99, 130], [200, 3, 3, 64, 81, 12, 7])


def _tensors(folder):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _dropped(src, out, count=None):
    """``src`` with its MTP tensors gone, in bfloat16 (the router's score bias float32), config.json's
    count set to ``count`` (None: left as it was)."""
    from safetensors.torch import save_file

    out.mkdir()
    for entry in src.iterdir():
        if entry.suffix != ".safetensors":
            (out / entry.name).write_bytes(entry.read_bytes())
    tensors = {n: t if n.endswith("e_score_correction_bias") else t.to(torch.bfloat16)
               for n, t in _tensors(src).items() if not n.startswith(MTP)}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if count is not None:
        cfg = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": count}))
    return out


def _data(root, n=48):
    rng = random.Random(0)
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": " ".join(rng.choice(WORDS) for _ in range(4))}) + "\n"
                            for _ in range(n)))
    return data


def _settings(**kw):
    from mtpctl.train.settings import TrainSettings

    base = dict(kind="mtp", num_heads=1, self_distill=True, response_tokens=16, lr=1e-2, steps=40, holdout=0.25,
                batch_tokens=512, measure_prompts=0)
    return TrainSettings(**{**base, **kw})


def _load(folder, speculate="none", **kw):
    import mtpctl

    return mtpctl.load(str(folder), speculate=speculate, dtype="float32", threads=1, **kw)


def _lossless(folder, out):
    expected = [_load(folder).pipeline.generate(list(p), 16).token_ids for p in PROMPTS]
    llm = _load(out, "mtp", speculate_policy="always", draft_len=3)
    assert [llm.pipeline.generate(list(p), 16).token_ids for p in PROMPTS] == expected


@pytest.fixture(scope="module")
def glm(folders, tmp_path_factory):  # noqa: F811
    """(root, the dropped glm4_moe checkpoint, its count-0 copy, data, home, the grafted (folder, summary))."""
    from mtpctl.train.mtp_refresh import refresh_mtp

    root = tmp_path_factory.mktemp("mtp_graft")
    dropped = _dropped(folders["glm4_moe"], root / "dropped")
    zero = _dropped(folders["glm4_moe"], root / "zero", count=0)
    data, home = _data(root), root / "home"
    summary = refresh_mtp(dropped, [data], root / "grafted", _settings(), home, device="cpu", graft=True)
    return root, dropped, zero, data, home, (root / "grafted", summary)


def test_without_graft_a_dropped_layer_is_refused_in_one_line_naming_graft(glm, tmp_path, capsys, monkeypatch):
    root, dropped, zero, data, home, (grafted, _) = glm
    monkeypatch.setenv("MTPCTL_HOME", str(home))
    base = ["add-heads", "--kind", "mtp", "--data", data, "--self-distill", "--threads", 1, "--device", "cpu"]
    code, out, err = cli(capsys, *base, "-m", dropped, "--out", tmp_path / "x")
    assert_one_line_exit_2(code, out, err, "declares 1 MTP layer(s) (num_nextn_predict_layers) but holds none of "
                                           "their tensors")
    assert err.rstrip().endswith("(--graft)"), err
    code, out, err = cli(capsys, *base, "-m", zero, "--out", tmp_path / "x")
    assert_one_line_exit_2(code, out, err, "has no MTP layers (num_nextn_predict_layers is 0): graft a new one")
    assert err.rstrip().endswith("(--graft)"), err
    code, out, err = cli(capsys, *base, "-m", grafted, "--out", tmp_path / "x", "--graft")
    assert_one_line_exit_2(code, out, err, "already holds its MTP layer: refresh it without grafting (--graft)")
    code, out, err = cli(capsys, *base, "-m", dropped, "--graft", "--measure-only")
    assert_one_line_exit_2(code, out, err, "a grafted MTP layer is new")
    code, out, err = cli(capsys, "add-heads", "--kind", "eagle", *base[3:], "-m", dropped, "--graft", "--out",
                         tmp_path / "x")
    assert code == 2 and "--graft builds a checkpoint's missing MTP layer: use it with --kind mtp" in err
    code, out, err = cli(capsys, "generate", "-m", dropped, "--speculate", "mtp", "--max-new-tokens", 2, "--no-chat",
                         "--threads", 1, "abc")
    assert_one_line_exit_2(code, out, err, "holds none of the tensors of MTP layer model.layers.3.")
    assert not (tmp_path / "x").exists()


def test_the_grafted_checkpoint_adds_the_layer_and_changes_nothing_else(glm, folders):  # noqa: F811
    from mtpctl.model.weights import read_headers, shard_files

    _, dropped, _, _, _, (grafted, summary) = glm
    old, new = _tensors(dropped), _tensors(grafted)
    assert all(torch.equal(old[n], new[n]) and old[n].dtype == new[n].dtype for n in old)
    assert os.stat(grafted / "model.safetensors").st_ino == os.stat(dropped / "model.safetensors").st_ino  # linked
    added = {n: t for n, t in new.items() if n not in old}
    published = {n: tuple(i.shape) for n, i in read_headers(shard_files(folders["glm4_moe"])).items()
                 if n.startswith(MTP)}
    assert {n: tuple(t.shape) for n, t in added.items()} == published  # the layout's names and shapes
    assert {n for n, t in added.items() if t.dtype != torch.bfloat16} == {MTP + "mlp.gate.e_score_correction_bias"}
    assert new[MTP + "mlp.gate.e_score_correction_bias"].dtype == torch.float32
    index = json.loads((grafted / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {**{n: "model.safetensors" for n in old},
                                   **{n: "model-mtp.safetensors" for n in added}}
    cfg, src_cfg = (json.loads((f / "config.json").read_text()) for f in (grafted, dropped))
    assert cfg == src_cfg and cfg["num_nextn_predict_layers"] == 1
    assert summary["grafted"]["tensors"] == len(added)
    # frozen copies stay the target's; the trained ones moved off their start
    assert torch.equal(new[MTP + "shared_head.head.weight"], old["lm_head.weight"])
    assert torch.equal(new[MTP + "embed_tokens.weight"], old["model.embed_tokens.weight"])
    assert not torch.equal(new[MTP + "eh_proj.weight"][:, 64:], torch.eye(64, dtype=torch.bfloat16))


def test_the_grafted_layer_drafts_losslessly_and_trains(glm):
    _, dropped, _, _, _, (grafted, summary) = glm
    _lossless(dropped, grafted)
    before, after = summary["before"]["acceptance"][0], summary["after"]["acceptance"][0]
    assert summary["before"]["chains"] > 50 and after > before + 0.1, summary


def test_the_fresh_layer_starts_from_the_body(glm):
    """The block is the body's last MoE layer; the projection passes the hidden state through; enorm and
    hnorm are ones, the final norm the body's; the count-0 config is set to one layer."""
    from mtpctl.model.config import DecoderConfig
    from mtpctl.train.mtp_graft import fresh_layer, grafted_config

    _, dropped, zero, _, _, _ = glm
    cfg = DecoderConfig.from_folder(dropped)
    fresh, old = fresh_layer(dropped, cfg), _tensors(dropped)
    last = f"model.layers.{LAYERS - 1}."
    block = {n[len(last):]: t for n, t in old.items() if n.startswith(last)}
    assert all(torch.equal(fresh[n], t) and fresh[n].dtype == t.dtype for n, t in block.items())
    h = 64
    proj = fresh["eh_proj.weight"].float()
    assert torch.equal(proj[:, h:], torch.eye(h)) and not proj[:, :h].any()  # [enorm(e) ; hnorm(h)]: h through
    assert all(torch.equal(fresh[n].float(), torch.ones(h)) for n in ("enorm.weight", "hnorm.weight"))
    assert torch.equal(fresh["shared_head.norm.weight"], old["model.norm.weight"])
    assert grafted_config(DecoderConfig.from_folder(zero), zero)["num_nextn_predict_layers"] == 1


@pytest.fixture(scope="module")
def bodies(tmp_path_factory):
    """layout -> a checkpoint folder without MTP tensors or count key: a Qwen3.5 text body, a MiMo one."""
    from test_qwen3_5 import reference_model as qwen3_5

    root = tmp_path_factory.mktemp("graft_bodies")
    tokenizer = write_tiny_checkpoint(root / "tokenizer")
    out = {}
    for name, body in (("qwen3_5_text", qwen3_5()), ("mimo", random_reference_model("qwen2", **MIMO))):
        folder = root / name
        body.save_pretrained(str(folder))
        copy_tokenizer_files(tokenizer, folder)
        if name == "mimo":  # transformers has no mimo class: Qwen2's body, renamed
            cfg = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "mimo",
                                                            "architectures": ["MiMoForCausalLM"]}))
        out[name] = folder
    return out


@pytest.mark.parametrize("layout", ["qwen3_5_text", "mimo"])
def test_graft_on_other_layouts(bodies, layout, tmp_path):
    """Qwen3.5: the block copies the last full-attention layer (1 of linear, full, linear), its ``1 + w``
    norms start at 0 (stored); MiMo: the projection reads the hidden state first. Both configs lack the
    count key (set to 1), both load with ``--speculate mtp`` and equal plain greedy decoding."""
    from safetensors.torch import load_file

    from mtpctl.train.mtp_refresh import refresh_mtp

    folder = bodies[layout]
    summary = refresh_mtp(folder, [_data(tmp_path, 16)], tmp_path / "out", _settings(steps=20, response_tokens=12),
                          tmp_path / "home", device="cpu", graft=True)
    assert summary["after"]["chains"] > 0
    if layout == "qwen3_5_text":  # 0 -> 0.27 here; MiMo's random body (N(0, 0.2) weights) learns little in 20 steps
        assert summary["after"]["acceptance"][0] > summary["before"]["acceptance"][0] + 0.1, summary
    old, new = _tensors(folder), _tensors(tmp_path / "out")
    assert all(torch.equal(old[n], new[n]) for n in old)
    added = load_file(str(tmp_path / "out" / "model-mtp.safetensors"))
    assert set(added) == set(new) - set(old) and all(t.dtype == torch.float32 for t in added.values())
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    if layout == "qwen3_5_text":
        assert cfg["mtp_num_hidden_layers"] == 1
        assert "mtp.layers.0.self_attn.q_proj.weight" in added and "mtp.fc.weight" in added
        assert not any("linear_attn" in n for n in added)
        o_proj = "self_attn.o_proj.weight"
        assert added["mtp.layers.0." + o_proj].shape == old["model.layers.1." + o_proj].shape
    else:
        assert cfg["num_nextn_predict_layers"] == 1
        assert {"model.mtp_layers.0.input_proj.weight", "model.mtp_layers.0.self_attn.q_proj.bias"} <= set(added)
    _lossless(folder, tmp_path / "out")


@pytest.mark.parametrize("layout", ["qwen3_5_text", "mimo"])
def test_fresh_layer_initialisation_on_other_layouts(bodies, layout):
    from mtpctl.model.config import DecoderConfig
    from mtpctl.train.mtp_graft import fresh_layer

    folder = bodies[layout]
    fresh, old = fresh_layer(folder, DecoderConfig.from_folder(folder)), _tensors(folder)
    h = 64
    if layout == "qwen3_5_text":
        assert torch.equal(fresh["layers.0.self_attn.q_proj.weight"], old["model.layers.1.self_attn.q_proj.weight"])
        assert not fresh["pre_fc_norm_embedding.weight"].any() and not fresh["pre_fc_norm_hidden.weight"].any()
        assert torch.equal(fresh["fc.weight"][:, h:], torch.eye(h)) and not fresh["fc.weight"][:, :h].any()
        assert torch.equal(fresh["norm.weight"], old["model.norm.weight"])
    else:  # [hidden_layernorm(h) ; token_layernorm(e)]
        proj = fresh["input_proj.weight"]
        assert torch.equal(proj[:, :h], torch.eye(h)) and not proj[:, h:].any()
        assert torch.equal(fresh["self_attn.q_proj.bias"], old["model.layers.1.self_attn.q_proj.bias"])
        assert torch.equal(fresh["token_layernorm.weight"], torch.ones(h))


def test_graft_on_ernie_adds_the_published_layout(ernie, tmp_path):  # noqa: F811
    """No final norm of its own (the body's ``model.norm``); the block a dense layer (index 0's kind)."""
    from safetensors.torch import save_file

    from mtpctl.train.mtp_refresh import refresh_mtp

    src = tmp_path / "src"
    src.mkdir()
    for entry in ernie.iterdir():
        if entry.suffix != ".safetensors":
            (src / entry.name).write_bytes(entry.read_bytes())
    published = _tensors(ernie)
    mtp = {n for n in published if n.startswith("model.mtp_")}
    save_file({n: t for n, t in published.items() if n not in mtp}, str(src / "model.safetensors"),
              metadata={"format": "pt"})
    refresh_mtp(src, [_data(tmp_path, 8)], tmp_path / "out", _settings(steps=3, response_tokens=8), tmp_path / "home",
                device="cpu", graft=True)
    new = _tensors(tmp_path / "out")
    assert {n: tuple(t.shape) for n, t in new.items() if n not in published or n in mtp} == \
        {n: tuple(published[n].shape) for n in mtp}
    _lossless(src, tmp_path / "out")


def test_add_tensors_extends_a_sharded_index_and_refuses_clashes(tmp_path):
    from safetensors.torch import load_file, save_file

    from mtpctl.errors import BadInput, CorruptModel
    from mtpctl.model.rewrite import add_tensors

    src = tmp_path / "src"
    src.mkdir()
    names = {"model-00001-of-00002.safetensors": "a", "model-00002-of-00002.safetensors": "b"}
    for file, tensor in names.items():
        save_file({tensor: torch.ones(2)}, str(src / file))
    index = {"metadata": {"total_size": 16}, "weight_map": {t: f for f, t in names.items()}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    (src / "config.json").write_text("{}")
    out = add_tensors(src, tmp_path / "out", {"c": torch.zeros(3, dtype=torch.bfloat16)}, {"n": 1})
    written = json.loads((out / "model.safetensors.index.json").read_text())
    assert written == {"metadata": {"total_size": 22},
                       "weight_map": {**index["weight_map"], "c": "model-mtp.safetensors"}}
    assert json.loads((out / "config.json").read_text()) == {"n": 1}
    assert load_file(str(out / "model-mtp.safetensors"))["c"].dtype == torch.bfloat16
    assert all(os.stat(out / f).st_ino == os.stat(src / f).st_ino for f in names)
    with pytest.raises(CorruptModel, match="already has the tensor 'a'"):
        add_tensors(src, tmp_path / "other", {"a": torch.ones(2)})
    with pytest.raises(BadInput, match="already exists"):
        add_tensors(src, out, {"c": torch.ones(3)})
    assert not (tmp_path / "other").exists()
