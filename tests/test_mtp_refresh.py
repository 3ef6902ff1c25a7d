"""``add-heads --kind mtp`` on a tiny glm4_moe checkpoint with one MTP layer in the published layout
(tests/test_native_mtp.py's, written in two shards with an index): per-depth acceptance measured
teacher-forced, the layer refreshed by self-distillation on the body, and written back into a new
checkpoint folder that transformers loads with ``use_mtp=True``.

The goal test: the layer trained on the body accepts well at depth 1; a stand-in for fine-tuning the
body (its last layer's weights replaced) makes it stale; the refresh restores it. The glm4_moe checkpoint
with two MTP layers (tests/test_native_mtp.py's) is refreshed whole, both layers chained as the drafter
chains them."""

import json
import os
import random
import shutil

import pytest
import torch

from helpers import assert_one_line_exit_2, cli, write_tiny_checkpoint

from test_native_mtp import LAYERS, _transformers_drafts, folders, two_layers  # noqa: F401 (fixtures)

transformers = pytest.importorskip("transformers")

MTP = f"model.layers.{LAYERS}."
WORDS = "apple river stone cloud seven green market window orange winter music paper".split()


def _settings(**kw):
    from mtpctl.train.settings import TrainSettings

    base = dict(kind="mtp", num_heads=1, self_distill=True, response_tokens=24, lr=1e-2, steps=100, holdout=0.2,
                batch_tokens=512, measure_prompts=0)
    return TrainSettings(**{**base, **kw})


def _shard(src, out):
    """``src`` (one model.safetensors) written as two shards and an index: the MTP layer and lm_head in
    the second."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    tensors = load_file(str(out / "model.safetensors"))
    os.remove(out / "model.safetensors")
    second = {n for n in tensors if n.startswith(MTP) or n == "lm_head.weight"}
    names = {"model-00001-of-00002.safetensors": sorted(set(tensors) - second),
             "model-00002-of-00002.safetensors": sorted(second)}
    for file, group in names.items():
        save_file({n: tensors[n] for n in group}, str(out / file), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": {n: file for file, group in names.items() for n in group}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out


def _headers(folder):
    from mtpctl.model.weights import read_headers, shard_files

    return {n: (i.path.name, i.dtype, i.shape) for n, i in read_headers(shard_files(folder)).items()}


def _tensors(folder):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def setup(folders, tmp_path_factory):  # noqa: F811
    """(root, sharded source checkpoint, prompt data, mtpctl home, the source refreshed: (folder, summary))."""
    from mtpctl.train.mtp_refresh import refresh_mtp

    root = tmp_path_factory.mktemp("mtp_refresh")
    source = _shard(folders["glm4_moe"], root / "source")
    rng = random.Random(0)
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": " ".join(rng.choice(WORDS) for _ in range(4))}) + "\n"
                            for _ in range(120)))
    home = root / "home"
    summary = refresh_mtp(source, [data], root / "trained", _settings(), home, device="cpu")
    return root, source, data, home, (root / "trained", summary)


def _body_changed(folder, out):
    """A stand-in for fine-tuning the body: the last body layer's attention and experts redrawn."""
    from mtpctl.model.rewrite import rewrite_checkpoint

    gen = torch.Generator().manual_seed(5)
    last = f"model.layers.{LAYERS - 1}."
    values = {n: torch.randn(t.shape, generator=gen) * 0.2 for n, t in _tensors(folder).items()
              if n.startswith(last) and t.dim() > 1}
    return rewrite_checkpoint(folder, out, values)


def test_refresh_restores_acceptance_after_the_body_changed(setup):
    from mtpctl.train.mtp_refresh import refresh_mtp

    root, _, data, home, (trained, first) = setup
    # the layer shipped with the checkpoint is random: the refresh trains it on the body
    assert first["before"]["acceptance"][0] < 0.05 and first["after"]["acceptance"][0] > 0.3, first
    changed = _body_changed(trained, root / "changed")
    again = refresh_mtp(changed, [data], root / "restored", _settings(), home, device="cpu")
    stale, restored = again["before"]["acceptance"][0], again["after"]["acceptance"][0]
    assert stale < first["after"]["acceptance"][0] - 0.2, (first, again)
    assert restored > stale + 0.2, again
    notes = json.loads((root / "restored" / "mtp_refresh.json").read_text())
    assert notes["after"] == again["after"] and notes["before"] == again["before"]


def test_write_back_changes_only_the_mtp_tensors_and_transformers_drafts_alike(setup, monkeypatch):
    from mtpctl.drafters.mtp import mtp_drafter
    from test_glm_deepseek_families import PROMPTS
    from test_native_mtp import NEW, _load
    from helpers import run

    _, source, _, _, (trained, _) = setup
    assert _headers(trained) == _headers(source)  # names, dtypes, shapes, shards
    assert json.loads((trained / "model.safetensors.index.json").read_text()) == \
        json.loads((source / "model.safetensors.index.json").read_text())
    body = "model-00001-of-00002.safetensors"
    assert os.stat(trained / body).st_ino == os.stat(source / body).st_ino  # linked, not rewritten
    old, new = _tensors(source), _tensors(trained)
    changed = {n for n in old if not torch.equal(old[n], new[n])}
    assert changed and all(n.startswith(MTP) for n in changed), changed
    assert {MTP + "eh_proj.weight", MTP + "enorm.weight", MTP + "shared_head.norm.weight"} <= changed
    assert not changed & {MTP + "shared_head.head.weight", MTP + "embed_tokens.weight",
                          MTP + "mlp.gate.e_score_correction_bias"}  # frozen
    llm = _load(trained, speculate_policy="always")
    for prompt in PROMPTS[:2]:
        hf_tokens, hf_drafts = _transformers_drafts(trained, "glm4_moe", list(prompt), monkeypatch)
        record = []
        ours = run(llm.session.model, mtp_drafter(llm.session, 1, record=record), max_new=NEW, prompt=list(prompt))
        assert ours.token_ids == hf_tokens[:len(ours.token_ids)]
        theirs = dict(hf_drafts)
        common = [n for n, _ in record if n in theirs]
        assert len(common) >= NEW // 4 and [dict(record)[n] for n in common] == [theirs[n] for n in common]


def test_unrolled_depths_equal_the_drafter_rows(folders):  # noqa: F811
    """The training-time test's depth s at row p is the decode-time draft s steps after the committed
    row p - s + 1 (its KV cache holding rows 0..p-s+1 and its own chain), for any inputs."""
    from mtpctl.drafters.mtp import MtpLayers, MtpSettings
    from mtpctl.train.mtp import MtpChain
    from mtpctl.train.target import TargetHead

    folder = folders["deepseek_v3"]
    for settings in (MtpSettings(), MtpSettings(carry="normed", zero_first_embedding=True)):
        layers = MtpLayers(TargetHead.from_folder(folder, torch.float32), folder, settings)
        chain = MtpChain(layers)
        gen = torch.Generator().manual_seed(0)
        t, h = 9, layers.eh_proj.shape[0]
        feats, tokens = torch.randn(1, t, h, generator=gen), torch.randint(0, 250, (1, t), generator=gen)
        with torch.no_grad():
            outs = chain(feats, tokens, torch.ones(1, t, dtype=torch.bool), 3)
            for q in range(t - 2):
                cache = layers.new_cache(32)
                g = layers.rows(feats[0, :q + 1], tokens[0, :q + 1], torch.arange(q + 1), cache)[-1:]
                cache.advance(q + 1)
                torch.testing.assert_close(g[0], outs[0][0, q])
                for s in (2, 3):
                    g = layers.rows(layers.carried(g, layers.normed(g)), tokens[0, q + s - 1:q + s],
                                    torch.tensor([cache.length]), cache)
                    cache.advance(1)
                    torch.testing.assert_close(g[0], outs[s - 1][0, q + s - 1], rtol=1e-4, atol=1e-4)


def _drafter_rows(layers, feats, tokens, q, depths):
    """The drafter's block outputs ``[depths][H]`` of the chain after committed row q (pending token
    ``tokens[q]``), run as :meth:`MtpDrafter._draft` runs them from empty caches, teacher-forced: each
    layer i runs rows 0..q reading layer i-1's carried outputs and ``tokens[j + i]``, the last layer then
    runs on its own output past them."""
    rows, out, g = feats[:q + 1], [], None
    for i, layer in enumerate(layers):
        cache = layer.new_cache(32)
        g = layer.rows(rows, tokens[i:q + 1 + i], torch.arange(q + 1), cache)
        cache.advance(q + 1)
        out.append(g[-1])
        rows = layer.carried(g, layer.normed(g))
    g = g[-1:]
    while len(out) < depths:
        g = layer.rows(layer.carried(g, layer.normed(g)), tokens[q + len(out):q + len(out) + 1],
                       torch.tensor([cache.length]), cache)
        cache.advance(1)
        out.append(g[0])
    return out


def test_unrolled_depths_of_two_layers_equal_the_drafter_rows(two_layers):  # noqa: F811
    """Two MTP layers: depth 2 at row p is layer 1's row p - 1 (reading layer 0's output at that row and
    x_{p+1}), depths 3 and 4 the second layer run again on its own output, the drafter's rows (to the
    rounding of matrix products over other row counts: about 1e-5 on values near 10 here, where a wrong
    row, token or cache gives O(1)); and a chain whose drafts the tokens follow drafts, through
    :class:`MtpDrafter` itself, the unrolled depths' argmaxes."""
    from types import SimpleNamespace

    from mtpctl.decode.drafter import TargetStep
    from mtpctl.drafters.mtp import MtpDrafter, MtpSettings, read_mtp_layers
    from mtpctl.train.mtp import MtpChain
    from mtpctl.train.target import TargetHead

    target = TargetHead.from_folder(two_layers, torch.float32)
    for settings in (MtpSettings(), MtpSettings(carry="normed", zero_first_embedding=True)):
        layers = read_mtp_layers(target, two_layers, settings)
        chain = MtpChain(layers)
        gen = torch.Generator().manual_seed(1)
        t, h = 9, layers[0].eh_proj.shape[0]
        feats, tokens = torch.randn(1, t, h, generator=gen), torch.randint(0, 250, (1, t), generator=gen)
        valid = torch.ones(1, t, dtype=torch.bool)
        with torch.no_grad():
            outs = chain(feats, tokens, valid, 4)
            for q in range(t - 3):
                for s, g in enumerate(_drafter_rows(layers, feats[0], tokens[0], q, 4)):
                    torch.testing.assert_close(g, outs[s][0, q + s], rtol=1e-5, atol=1e-4)
            # the drafter itself, after committed row q: with the tokens after the pending one set to its
            # drafts, the teacher-forced depths read what it read
            q, record = 3, []
            step = TargetStep(SimpleNamespace(prompt_hidden_states=feats[0, :q + 1], hidden_states=None), row=q)
            MtpDrafter(layers, 4, record=record).propose([0] + tokens[0, :q + 1].tolist(), 4, step)
            drafted = record[0][1]
            tokens[0, q + 1:q + 4] = torch.tensor(drafted[:3])
            outs = chain(feats, tokens, valid, 4)
            assert [int(chain.logits(outs[s][0, q + s], s + 1).argmax()) for s in range(4)] == drafted


def test_recursive_depth_three_reports_each_depth(setup):
    from mtpctl.train.mtp_refresh import refresh_mtp

    root, _, data, home, (trained, _) = setup
    summary = refresh_mtp(trained, [data], root / "deep", _settings(num_heads=3, steps=30), home, device="cpu")
    for when in ("before", "after"):
        acc, top1 = summary[when]["acceptance"], summary[when]["top1"]
        assert len(acc) == len(top1) == 3 and summary[when]["chains"] > 100
        assert acc[0] >= acc[1] >= acc[2] and all(a <= b for a, b in zip(acc, top1)) and acc[0] == top1[0]
    assert summary["before"]["acceptance"][0] > 0.3  # the trained layer, measured three deep
    assert summary["after"]["acceptance"][1] > 0  # depth 2 learned recursively


def test_cli_measures_refuses_and_reports(setup, folders, tmp_path, capsys, monkeypatch):  # noqa: F811
    _, source, data, home, (trained, _) = setup
    monkeypatch.setenv("MTPCTL_HOME", str(home))
    base = ["add-heads", "--kind", "mtp", "--data", data, "--self-distill", "--response-tokens", 24,
            "--threads", 1, "--device", "cpu"]
    code, out, err = cli(capsys, *base, "-m", trained, "--measure-only", "--json")
    assert code == 0, err
    reply = json.loads(out)
    assert reply["measured_on"] == "all" and len(reply["before"]["acceptance"]) == 1
    assert reply["before"]["acceptance"][0] > 0.3 and "acceptance by depth" in err
    llama = write_tiny_checkpoint(tmp_path / "llama")
    code, out, err = cli(capsys, *base, "-m", llama, "--out", tmp_path / "x")
    assert_one_line_exit_2(code, out, err, "MTP layers of llama checkpoints are not read")
    code, out, err = cli(capsys, *base, "-m", folders["plain"], "--out", tmp_path / "x")
    assert_one_line_exit_2(code, out, err, "has no MTP layers (num_nextn_predict_layers is 0)")
    code, out, err = cli(capsys, *base, "-m", source, "--out", trained)
    assert_one_line_exit_2(code, out, err, "already exists")
    code, out, err = cli(capsys, *base, "-m", source)
    assert_one_line_exit_2(code, out, err, "no output folder")
    code, out, err = cli(capsys, *base, "-m", source, "--out", tmp_path / "y", "--steps", 3, "--lr", 1e-2)
    assert code == 0, err
    assert out.splitlines()[0].startswith("MTP acceptance by depth") and out.splitlines()[1].startswith("depth 1:")
    assert (tmp_path / "y" / "mtp_refresh.json").exists() and not (tmp_path / "x").exists()


@pytest.mark.parametrize("model_type", ["glm4_moe", "deepseek_v3"])
def test_the_layer_as_read_writes_back_bit_for_bit(folders, model_type, tmp_path):  # noqa: F811
    """checkpoint_tensors inverts loading for both layouts (fused q/k/v or MLA projections, experts)."""
    from mtpctl.drafters.mtp import MtpLayers
    from mtpctl.errors import BadInput
    from mtpctl.model.rewrite import rewrite_checkpoint
    from mtpctl.train.mtp import MtpHead
    from mtpctl.train.target import TargetHead

    folder = folders[model_type]
    layers = MtpLayers(TargetHead.from_folder(folder, torch.float32), folder)
    values = {layers.prefix + n: v for n, v in MtpHead(layers).tensors().items()}
    assert set(values) == {layers.prefix + n for n in layers.shapes} - {MTP + "shared_head.head.weight",
                                                                         MTP + "embed_tokens.weight"}
    out = rewrite_checkpoint(folder, tmp_path / "same", values)
    old, new = _tensors(folder), _tensors(out)
    assert old.keys() == new.keys() and all(torch.equal(old[n], new[n]) and old[n].dtype == new[n].dtype for n in old)
    with pytest.raises(BadInput, match="already exists"):
        rewrite_checkpoint(folder, out, values)


def test_write_back_leaves_the_source_shards_modes_as_they_were(tmp_path):
    """Shards written back unchanged are hard links to the source's: finishing the output folder must not
    change their (shared) mode bits, e.g. a read-only hub cache file stays read-only."""
    import json
    import stat

    from safetensors.torch import save_file

    from mtpctl.model.rewrite import rewrite_checkpoint

    src = tmp_path / "src"
    src.mkdir()
    names = {"model-00001-of-00002.safetensors": "a", "model-00002-of-00002.safetensors": "b"}
    for file, tensor in names.items():
        save_file({tensor: torch.ones(2)}, str(src / file))
        (src / file).chmod(0o444)
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {t: f for f, t in names.items()}}))
    (src / "config.json").write_text("{}")
    out = rewrite_checkpoint(src, tmp_path / "out", {})
    for file in names:
        assert stat.S_IMODE((src / file).stat().st_mode) == 0o444
        assert (out / file).read_bytes() == (src / file).read_bytes()


def test_two_layers_refresh_end_to_end(two_layers, tmp_path, capsys, monkeypatch):  # noqa: F811
    """``add-heads --kind mtp`` on a checkpoint with two MTP layers: fewer depths than layers refused in
    one line; by default both layers measured and trained (depth 2: the second layer's), held-out
    acceptance at depth 2 raised; the write-back changes both layers' tensors and nothing else, and
    decodes as plain greedy."""
    from test_glm_deepseek_families import PROMPTS
    from test_native_mtp import NEW, _load

    rng = random.Random(1)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": " ".join(rng.choice(WORDS) for _ in range(4))}) + "\n"
                            for _ in range(48)))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("version: 1\nsettings:\n  holdout: 0.25\n")
    monkeypatch.setenv("MTPCTL_HOME", str(tmp_path / "home"))
    base = ["add-heads", "--recipe", recipe, "--kind", "mtp", "-m", two_layers, "--data", data, "--self-distill",
            "--response-tokens", 24, "--threads", 1, "--device", "cpu"]
    code, out, err = cli(capsys, *base, "--num-heads", 1, "--out", tmp_path / "x")
    assert_one_line_exit_2(code, out, err, "has 2 MTP layers, each drafting a depth of its own: measure and train "
                                           "at least 2 depths (--num-heads 2), not 1")
    code, out, err = cli(capsys, *base, "--steps", 40, "--lr", 1e-2, "--batch-tokens", 512, "--out", tmp_path / "out")
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 3 and lines[1].startswith("depth 1:") and lines[1].endswith("(MTP layer 1)")
    assert lines[2].startswith("depth 2:") and lines[2].endswith("(MTP layer 2)"), out
    notes = json.loads((tmp_path / "out" / "mtp_refresh.json").read_text())
    before, after = notes["before"]["acceptance"], notes["after"]["acceptance"]
    assert notes["layers"] == notes["depth"] == 2 and notes["before"]["chains"] > 100, notes
    assert before[1] < 0.05 and after[1] > before[1] + 0.1 and after[0] > before[0] + 0.2, notes
    second = f"model.layers.{LAYERS + 1}."
    old, new = _tensors(two_layers), _tensors(tmp_path / "out")
    assert _headers(tmp_path / "out") == _headers(two_layers)
    changed = {n for n in old if not torch.equal(old[n], new[n])}
    assert all(n.startswith((MTP, second)) for n in changed), changed
    for prefix in (MTP, second):  # both layers trained; the copies and the score bias frozen
        assert {prefix + "eh_proj.weight", prefix + "hnorm.weight", prefix + "self_attn.q_proj.weight"} <= changed
        assert not changed & {prefix + "shared_head.head.weight", prefix + "embed_tokens.weight",
                              prefix + "mlp.gate.e_score_correction_bias"}
    expected = _load(two_layers).pipeline.generate(list(PROMPTS[0]), NEW).token_ids
    llm = _load(tmp_path / "out", "mtp", speculate_policy="always", draft_len=3)
    assert llm.pipeline.generate(list(PROMPTS[0]), NEW).token_ids == expected
