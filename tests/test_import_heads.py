"""mtpctl models import-heads: heads written here by hand in each published layout (Medusa's original
pickle, vLLM's Medusa layout, EAGLE-1 and EAGLE-3 in the speculators and EAGLE layouts) import into
head folders that decode losslessly, export and bench; an EAGLE-1 or EAGLE-3 import computes what
vLLM's layer computes (references written from vLLM's code, in this file); a pickle carrying
anything but tensors is refused without running it; every strictness error is one line and exit
code 2; the target is never loaded whole (its config.json and the tensors the heads need)."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
import torch.nn.functional as F
from helpers import generate_json, write_tiny_checkpoint
from safetensors.torch import load_file, save_file

from mtpctl.cli.main import main
from mtpctl.drafters.heads.config import HeadsConfig
from mtpctl.drafters.heads.eagle3 import Eagle3Head
from mtpctl.drafters.heads.folder import load_heads
from mtpctl.drafters.heads.medusa import MedusaHeads
from mtpctl.model.decoder import Decoder
from mtpctl.model.weights import weights_hash

H, V, I, NH, NKV, D = 64, 259, 128, 4, 2, 16  # the tiny model's sizes


def rand(*shape, seed=0, scale=0.1):
    return scale * torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def medusa_original(folder: pathlib.Path, heads=5, config_heads=2, vocab=V, hidden=H) -> pathlib.Path:
    """FasterDecoding's layout: medusa_lm_head.pt (a pickled state dict) and a config whose head count
    is wrong, as uploaded configs often are."""
    folder.mkdir(parents=True)
    sd = {}
    for k in range(heads):
        sd[f"{k}.0.linear.weight"] = rand(hidden, hidden, seed=k)
        sd[f"{k}.0.linear.bias"] = rand(hidden, seed=10 + k)
        sd[f"{k}.1.weight"] = rand(vocab, hidden, seed=20 + k, scale=1.0)
    torch.save(sd, folder / "medusa_lm_head.pt")
    (folder / "config.json").write_text(json.dumps({"medusa_num_heads": config_heads, "medusa_num_layers": 1,
                                                    "base_model_name_or_path": "some/base"}))
    return folder


def run(args, capsys):
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_original_medusa_pickle_imports_with_the_head_count_the_tensors_say(tiny_folder, tmp_path, capsys):
    src = medusa_original(tmp_path / "src")
    out = tmp_path / "heads"
    code, stdout, err = run(["models", "import-heads", str(src), "--target", str(tiny_folder), "--out", str(out),
                             "--json"], capsys)
    assert code == 0, err
    assert "config.json says 2 heads; the weights hold 5: using 5" in err
    summary = json.loads(stdout)
    assert (summary["layout"], summary["kind"], summary["num_heads"]) == ("medusa", "medusa", 5)
    cfg = HeadsConfig.load(out)
    assert cfg.target_hash == weights_hash(tiny_folder) and cfg.own_lm_head and cfg.tree == [[0] * d for d in range(1, 6)]
    heads = load_heads(out, torch.float32, Decoder.from_folder(tiny_folder).dense_lm_head())
    sd = torch.load(src / "medusa_lm_head.pt", weights_only=True)
    assert torch.equal(heads.blocks[3][0].linear.weight, sd["3.0.linear.weight"])
    assert torch.equal(heads.lm_heads[4], sd["4.1.weight"])


def test_imported_heads_decode_export_and_bench_like_trained_ones(tiny_folder, tmp_path, capsys):
    out = tmp_path / "heads"
    assert main(["models", "import-heads", str(medusa_original(tmp_path / "src")), "--target", str(tiny_folder),
                 "--out", str(out)]) == 0
    args = ["-m", str(tiny_folder), "--max-new-tokens", "24", "count: 3 4"]
    plain, spec = generate_json(main, capsys, args), generate_json(main, capsys, args + ["--speculate", "heads", "--heads", str(out)])
    assert spec["token_ids"] == plain["token_ids"] and spec["stats"]["draft_tokens"] > 0
    for fmt in ("vllm", "trtllm"):
        assert main(["export", str(out), "--format", fmt, "--out", str(tmp_path / fmt)]) == 0
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"category": "x", "prompt": "count: 1 2 3"}) + "\n")
    assert main(["bench", "-m", str(tiny_folder), "--methods", "plain,heads", "--heads", str(out), "--prompts",
                 str(prompts), "--max-new-tokens", "12", "--json", str(tmp_path / "b.json")]) == 0
    report = json.loads((tmp_path / "b.json").read_text())
    heads_row = next(m for m in report["methods"] if m["method"] == "heads")
    assert heads_row["same_as_plain"] == heads_row["runs"] == 1


class Touch:
    """Pickles as a call to Path.touch: whoever unpickles it with a full unpickler creates the file."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.path),)


@pytest.mark.parametrize("payload", ["object", "nested", "list"])
def test_a_pickle_with_anything_but_tensors_is_refused_unrun(payload, tiny_folder, tmp_path, capsys):
    src = medusa_original(tmp_path / "src")
    sd = torch.load(src / "medusa_lm_head.pt", weights_only=True)
    marker = tmp_path / "ran"
    bad = {"object": {**sd, "extra": Touch(marker)}, "nested": {"state_dict": sd}, "list": list(sd.values())}[payload]
    torch.save(bad, src / "medusa_lm_head.pt")
    code, _, err = run(["models", "import-heads", str(src), "--target", str(tiny_folder), "--out",
                        str(tmp_path / "out")], capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith("mtpctl: error: ")
    assert {"object": "objects other than tensors", "nested": "not a tensor", "list": "not a mapping"}[payload] in err
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_vllm_medusa_layout_without_biases_imports(tiny_folder, tmp_path, capsys):
    src = tmp_path / "vllm"
    src.mkdir()
    save_file({**{f"blocks.{k}.layers.0.weight": rand(H, H, seed=k) for k in range(2)},
               **{f"lm_heads.{k}.weight": rand(V, H, seed=5 + k) for k in range(2)}}, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps({"model_type": "medusa", "num_heads": 2, "num_hidden_layers": 1,
                                                 "hidden_size": H, "vocab_size": V, "truncated_vocab_size": V,
                                                 "medusa_fc_bias": False, "original_lm_head": False}))
    assert main(["models", "import-heads", str(src), "--target", str(tiny_folder), "--out", str(tmp_path / "o")]) == 0
    heads = load_heads(tmp_path / "o", torch.float32, Decoder.from_folder(tiny_folder).dense_lm_head())
    assert isinstance(heads, MedusaHeads) and heads.cfg.num_heads == 2 and not heads.blocks[1][0].linear.bias.any()



def test_the_target_is_read_from_its_config_and_the_tensors_the_heads_need_not_loaded(tmp_path, capsys, monkeypatch):
    """An untied target: shared Medusa heads are recognised by its lm_head.weight, an EAGLE-3 copy of its
    embedding is dropped (and one of its own refused), all with Decoder.from_folder refusing to run."""
    target = write_tiny_checkpoint(tmp_path / "untied", seed=4, tie_word_embeddings=False)
    weights = load_file(str(target / "model.safetensors"))
    assert not torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])

    def refuse(*args, **kwargs):
        raise AssertionError("import-heads loaded the whole target")

    monkeypatch.setattr(Decoder, "from_folder", refuse)
    shared = tmp_path / "vllm"
    shared.mkdir()
    save_file({**{f"blocks.{k}.layers.0.weight": rand(H, H, seed=k) for k in range(2)},
               "lm_heads.0.weight": weights["lm_head.weight"]}, str(shared / "model.safetensors"))
    (shared / "config.json").write_text(json.dumps({"model_type": "medusa", "num_heads": 2, "num_hidden_layers": 1,
                                                    "hidden_size": H, "vocab_size": V, "truncated_vocab_size": V,
                                                    "medusa_fc_bias": False, "original_lm_head": True}))
    code, _, err = run(["models", "import-heads", str(shared), "--target", str(target), "--out",
                        str(tmp_path / "o-medusa")], capsys)
    assert code == 0, err
    assert not HeadsConfig.load(tmp_path / "o-medusa").own_lm_head  # the target's lm_head.weight, not its embedding
    tensors = eagle3_tensors("layers.0.", torch.arange(120))
    copy = write_eagle3(tmp_path / "copy", "speculators",
                        {**tensors, "embed_tokens.weight": weights["model.embed_tokens.weight"]}, 120, False)
    code, _, err = run(["models", "import-heads", str(copy), "--target", str(target), "--out",
                        str(tmp_path / "o-eagle3")], capsys)
    assert code == 0 and "embed_tokens.weight is the target's embedding: dropped" in err, err
    own = write_eagle3(tmp_path / "own", "speculators", {**tensors, "embed_tokens.weight": rand(V, H, seed=7)}, 120, False)
    code, _, err = run(["models", "import-heads", str(own), "--target", str(target), "--out",
                        str(tmp_path / "o-own")], capsys)
    assert code == 2 and "embeddings of their own" in err and not (tmp_path / "o-own").exists()

# --- EAGLE-3 -------------------------------------------------------------------------------------


def eagle3_tensors(prefix: str, draft_ids: torch.Tensor, seed=0) -> dict:
    """An EAGLE-3 head for the tiny model written by hand with the engines' tensor names."""
    shapes = {"input_layernorm.weight": (H,), "hidden_norm.weight": (H,), "post_attention_layernorm.weight": (H,),
              "self_attn.q_proj.weight": (NH * D, 2 * H), "self_attn.k_proj.weight": (NKV * D, 2 * H),
              "self_attn.v_proj.weight": (NKV * D, 2 * H), "self_attn.o_proj.weight": (H, NH * D),
              "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I)}
    out = {}
    for i, (name, shape) in enumerate(shapes.items()):
        out[prefix + name] = 1.0 + rand(*shape, seed=seed + i) if "norm" in name else rand(*shape, seed=seed + i, scale=0.2)
    out.update({"fc.weight": rand(H, 3 * H, seed=seed + 50, scale=0.2), "norm.weight": 1.0 + rand(H, seed=seed + 51),
                "lm_head.weight": rand(len(draft_ids), H, seed=seed + 52, scale=1.0),
                "d2t": draft_ids - torch.arange(len(draft_ids))})
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[draft_ids] = True
    out["t2d"] = t2d
    return out


def rms(x, w, eps=1e-5):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def vllm_eagle3_logits(t: dict, prefix: str, aux: torch.Tensor, embeds: torch.Tensor, before: bool) -> torch.Tensor:
    """vLLM's Eagle3 LlamaDecoderLayer (layer 0) + norm + lm_head + d2t, over T rows at positions
    0..T-1 with causal attention, written from vLLM's code: the reference an import must reproduce.
    Returns full-vocabulary logits [T, V] (-inf outside the draft vocabulary)."""
    p = lambda n: t[prefix + n]  # noqa: E731
    hidden = aux @ t["fc.weight"].T
    e = rms(embeds, p("input_layernorm.weight"))
    normed = rms(hidden, p("hidden_norm.weight"))
    residual = normed if before else hidden
    x = torch.cat([e, normed], -1)
    q = (x @ p("self_attn.q_proj.weight").T).view(-1, NH, D)
    k = (x @ p("self_attn.k_proj.weight").T).view(-1, NKV, D)
    v = (x @ p("self_attn.v_proj.weight").T).view(-1, NKV, D)
    pos = torch.arange(len(x)).float()
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))
    ang = torch.cat([pos[:, None] * inv] * 2, -1)[:, None]
    rot = lambda y: y * ang.cos() + torch.cat([-y[..., D // 2:], y[..., :D // 2]], -1) * ang.sin()  # noqa: E731
    q, k = rot(q), rot(k)
    k, v = k.repeat_interleave(NH // NKV, 1), v.repeat_interleave(NH // NKV, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / D ** 0.5
    scores = scores.masked_fill(torch.ones(len(x), len(x)).triu(1).bool(), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(len(x), -1) @ p("self_attn.o_proj.weight").T
    residual = residual + attn
    h = rms(residual, p("post_attention_layernorm.weight"))
    mlp = (F.silu(h @ p("mlp.gate_proj.weight").T) * (h @ p("mlp.up_proj.weight").T)) @ p("mlp.down_proj.weight").T
    out = rms(mlp + residual, t["norm.weight"]) @ t["lm_head.weight"].T
    full = torch.full((len(x), V), float("-inf"))
    full[:, torch.arange(len(t["d2t"])) + t["d2t"]] = out
    return full


def write_eagle3(folder, layout, tensors, draft, before=None, ids=(0, 1, 2)):
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    layer = {"model_type": "llama", "hidden_size": H, "intermediate_size": I, "num_attention_heads": NH,
             "num_key_value_heads": NKV, "head_dim": D, "num_hidden_layers": 1, "rms_norm_eps": 1e-5,
             "rope_theta": 10000.0, "vocab_size": V}
    if layout == "speculators":
        config = {"speculators_model_type": "eagle3", "transformer_layer_config": layer, "draft_vocab_size": draft,
                  "target_hidden_size": H, "eagle_aux_hidden_state_layer_ids": list(ids),
                  "speculators_config": {"algorithm": "eagle3", "proposal_methods": [{"speculative_tokens": 2}],
                                         "verifier": {"name_or_path": "x"}}}
    else:
        config = {**layer, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": draft}
    if before is not None:
        config["norm_before_residual"] = before
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("layout,prefix,before", [("speculators", "layers.0.", True), ("speculators", "layers.0.", None),
                                                  ("eagle", "midlayer.", False)])
def test_eagle3_import_computes_what_vllms_layer_computes(layout, prefix, before, tiny_folder, tiny_model, tmp_path, capsys):
    draft_ids = torch.randperm(V, generator=torch.Generator().manual_seed(1))[:120].sort().values
    tensors = eagle3_tensors(prefix, draft_ids)
    src = write_eagle3(tmp_path / "src", layout, tensors, 120, before)
    code, _, err = run(["models", "import-heads", str(src), "--target", str(tiny_folder), "--out",
                        str(tmp_path / "o")], capsys)
    assert code == 0, err
    if before is None:
        assert "norm_before_residual: taken as false" in err
    if layout == "eagle":
        assert "reading [0, 1, 2], the engines' default" in err
    head = load_heads(tmp_path / "o", torch.float32, Decoder.from_folder(tiny_folder).dense_lm_head())
    assert isinstance(head, Eagle3Head) and head.cfg.draft_vocab_size == 120
    aux = rand(1, 5, 3 * H, seed=9, scale=1.0)
    embeds = tiny_model.embed[torch.tensor([[3, 7, 11, 2, 9]])]
    g = head(aux, embeds, torch.ones(1, 5, dtype=torch.bool), 1)[0][0]
    mine = torch.full((5, V), float("-inf"))
    mine[:, head.token_map] = head.logits(g)
    torch.testing.assert_close(mine, vllm_eagle3_logits(tensors, prefix, aux[0], embeds[0], bool(before)),
                               atol=1e-4, rtol=1e-4)


def test_imported_eagle3_heads_decode_losslessly(tiny_folder, tmp_path, capsys):
    draft_ids = torch.arange(0, 240, 2)
    src = write_eagle3(tmp_path / "src", "speculators", eagle3_tensors("layers.0.", draft_ids), 120, False)
    out = tmp_path / "o"
    assert main(["models", "import-heads", str(src), "--target", str(tiny_folder), "--out", str(out)]) == 0
    args = ["-m", str(tiny_folder), "--max-new-tokens", "24", "count: 3 4"]
    spec = generate_json(main, capsys, args + ["--speculate", "heads+ngram", "--heads", str(out)])
    assert spec["token_ids"] == generate_json(main, capsys, args)["token_ids"]
    assert main(["export", str(out), "--format", "eagle", "--out", str(tmp_path / "again")]) == 0


# --- EAGLE-1 -------------------------------------------------------------------------------------


def eagle1_tensors(fc: str, prefix: str, seed=3, bias=True) -> dict:
    """EAGLE-1 heads for the tiny model with the engines' names: no input layernorm, fc over [embedding; feature]."""
    shapes = {"self_attn.q_proj.weight": (NH * D, H), "self_attn.k_proj.weight": (NKV * D, H),
              "self_attn.v_proj.weight": (NKV * D, H), "self_attn.o_proj.weight": (H, NH * D),
              "post_attention_layernorm.weight": (H,), "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H),
              "mlp.down_proj.weight": (H, I)}
    out = {prefix + n: (1.0 + rand(*s, seed=seed + i)) if "norm" in n else rand(*s, seed=seed + i, scale=0.2)
           for i, (n, s) in enumerate(shapes.items())}
    out[fc + "weight"] = rand(H, 2 * H, seed=seed + 40, scale=0.2)
    if bias:
        out[fc + "bias"] = rand(H, seed=seed + 41)
    return out


def write_eagle1(folder, layout, tensors):
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    layer = {"model_type": "llama", "hidden_size": H, "intermediate_size": I, "num_attention_heads": NH,
             "num_key_value_heads": NKV, "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "vocab_size": V}
    config = layer if layout == "eagle1" else {"speculators_model_type": "eagle", "transformer_layer_config": layer,
                                                "layernorms": False, "fusion_bias": True}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def vllm_eagle1_logits(t, fc, prefix, feats, embeds, lm_head):
    """vLLM's EagleLlamaForCausalLM (llama_eagle.py), written from its code: fc over [embedding;
    feature] (here with the checkpoint's bias), the layer without input layernorm, no final norm,
    the target's lm_head. T rows, causal, positions 0..T-1."""
    p = lambda n: t[prefix + n]  # noqa: E731
    x = torch.cat([embeds, feats], -1) @ t[fc + "weight"].T + t.get(fc + "bias", torch.zeros(H))
    q = (x @ p("self_attn.q_proj.weight").T).view(-1, NH, D)
    k = (x @ p("self_attn.k_proj.weight").T).view(-1, NKV, D)
    v = (x @ p("self_attn.v_proj.weight").T).view(-1, NKV, D)
    ang = torch.cat([torch.arange(len(x)).float()[:, None] * (1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D)))] * 2,
                    -1)[:, None]
    rot = lambda y: y * ang.cos() + torch.cat([-y[..., D // 2:], y[..., :D // 2]], -1) * ang.sin()  # noqa: E731
    q, k = rot(q), rot(k).repeat_interleave(NH // NKV, 1)
    scores = (torch.einsum("qhd,khd->hqk", q, k) / D ** 0.5).masked_fill(torch.ones(len(x), len(x)).triu(1).bool(),
                                                                        float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.repeat_interleave(NH // NKV, 1)).reshape(len(x), -1)
    x = x + attn @ p("self_attn.o_proj.weight").T
    h = rms(x, p("post_attention_layernorm.weight"))
    out = x + (F.silu(h @ p("mlp.gate_proj.weight").T) * (h @ p("mlp.up_proj.weight").T)) @ p("mlp.down_proj.weight").T
    return out @ lm_head.T


@pytest.mark.parametrize("layout,fc,prefix", [("eagle1", "fc.", "layers.0."),
                                              ("speculators-eagle1", "fusion_fc.", "transformer.")])
def test_eagle1_import_computes_what_vllms_layer_computes_and_decodes_losslessly(layout, fc, prefix, tiny_folder,
                                                                               tiny_model, tmp_path, capsys):
    tensors = eagle1_tensors(fc, prefix)
    src = write_eagle1(tmp_path / "src", layout, tensors)
    out = tmp_path / "o"
    code, stdout, err = run(["models", "import-heads", str(src), "--target", str(tiny_folder), "--out", str(out),
                             "--json"], capsys)
    assert code == 0, err
    assert json.loads(stdout)["layout"] == layout
    lm_head = Decoder.from_folder(tiny_folder).dense_lm_head()
    head = load_heads(out, torch.float32, lm_head)
    assert head.cfg.kind == "eagle" and head.cfg.layer.eagle1
    feats = rand(1, 5, H, seed=8, scale=1.0)
    embeds = tiny_model.embed[torch.tensor([[3, 7, 11, 2, 9]])]
    g = head(feats, embeds, torch.ones(1, 5, dtype=torch.bool), 1)[0][0]
    torch.testing.assert_close(g @ lm_head.T, vllm_eagle1_logits(tensors, fc, prefix, feats[0], embeds[0], lm_head),
                               atol=1e-4, rtol=1e-4)
    args = ["-m", str(tiny_folder), "--max-new-tokens", "24", "count: 3 4"]
    spec = generate_json(main, capsys, args + ["--speculate", "heads", "--heads", str(out)])
    assert spec["token_ids"] == generate_json(main, capsys, args)["token_ids"] and spec["stats"]["draft_tokens"] > 0


def strictness_cases(tmp_path):
    """(name, source folder, words of the error) for each way a Medusa or EAGLE-3 file can be wrong."""
    cases = []

    def medusa(name, change):
        src = medusa_original(tmp_path / name, heads=2, config_heads=2)
        sd = torch.load(src / "medusa_lm_head.pt", weights_only=True)
        change(sd)
        torch.save(sd, src / "medusa_lm_head.pt")
        return src

    cases.append(("missing", medusa("missing", lambda sd: sd.pop("1.0.linear.bias")), "missing tensor"))
    cases.append(("unexpected", medusa("unexpected", lambda sd: sd.update({"0.0.linear.scale": torch.ones(H)})),
                  "unexpected tensor"))
    cases.append(("misshaped", medusa("misshaped", lambda sd: sd.update({"1.0.linear.bias": torch.ones(H + 1)})),
                  "has shape"))
    cases.append(("nan", medusa("nan", lambda sd: sd["0.0.linear.weight"].__setitem__((0, 0), float("nan"))),
                  "NaN"))
    cases.append(("hidden", medusa_original(tmp_path / "hidden", heads=2, config_heads=2, hidden=32), "hidden size 32"))
    cases.append(("vocab", medusa_original(tmp_path / "vocab", heads=2, config_heads=2, vocab=300),
                  "vocabulary of 300"))
    ids = torch.arange(120)
    bad_d2t = eagle3_tensors("layers.0.", ids)
    bad_d2t["d2t"] = bad_d2t["d2t"] + 500
    cases.append(("d2t", write_eagle3(tmp_path / "d2t", "speculators", bad_d2t, 120, False), "d2t and t2d"))
    cases.append(("layers", write_eagle3(tmp_path / "layers", "speculators", eagle3_tensors("layers.0.", ids), 120,
                                         False, ids=(0, 1, 9)), "model of 2 layers"))
    cases.append(("ids", write_eagle3(tmp_path / "ids", "speculators", eagle3_tensors("layers.0.", ids), 120, False,
                                      ids=("2",)), "target layers ['2']"))
    eagle1 = write_eagle1(tmp_path / "eagle1", "eagle1", eagle1_tensors("fc.", "layers.0."))
    (eagle1 / "config.json").write_text(json.dumps({**json.loads((eagle1 / "config.json").read_text()),
                                                    "layernorms": True}))
    cases.append(("eagle1", eagle1, "EAGLE-1 variant"))
    other = tmp_path / "other"
    other.mkdir()
    save_file({"weight": rand(2, 2)}, str(other / "model.safetensors"))
    cases.append(("other", other, "not a layout mtpctl imports"))
    return cases


def test_each_strictness_error_is_one_line_and_exit_2(tiny_folder, tmp_path, capsys):
    for name, src, words in strictness_cases(tmp_path):
        code, _, err = run(["models", "import-heads", str(src), "--target", str(tiny_folder), "--out",
                            str(tmp_path / f"out-{name}")], capsys)
        assert code == 2 and err.count("\n") == 1 and words in err, (name, err)
        assert not (tmp_path / f"out-{name}").exists()
