"""The onnxruntime backend: same logits (1e-3) and the same greedy output as the torch backend."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from helpers import (TREE, first_divergence, make_heads, top2_gap, trace_as_over_2gb, truncated_heads,  # noqa: E402
                     write_tiny_checkpoint)

from mtpctl.backends.graph import GraphEngine, verify_manifest  # noqa: E402
from mtpctl.backends.onnxruntime import OrtGraph, OrtSession  # noqa: E402
from mtpctl.backends.torch import TorchEngine  # noqa: E402
from mtpctl.cli.main import main  # noqa: E402
from mtpctl.decode.loop import generate  # noqa: E402
from mtpctl.decode.sampling import SamplingParams  # noqa: E402
from mtpctl.decode.stopping import StopChecker  # noqa: E402
from mtpctl.decode.tree import DraftTree  # noqa: E402
from mtpctl.drafters.build import heads_drafter, heads_for  # noqa: E402
from mtpctl.drafters.heads.eagle import layer_config_for  # noqa: E402
from mtpctl.drafters.heads.folder import load_heads  # noqa: E402
from mtpctl.drafters.heads.medusa import MedusaDrafter  # noqa: E402
from mtpctl.drafters.heads.tree import StaticTree  # noqa: E402
from mtpctl.drafters.ngram import NgramDrafter  # noqa: E402
from mtpctl.errors import BadInput, CorruptModel, UnsupportedModel  # noqa: E402
from mtpctl.export.onnx import export_onnx  # noqa: E402
from mtpctl.model.decoder import Decoder  # noqa: E402

GEMMA = dict(model_type="gemma3_text", sliding_window=4, layer_types=["sliding_attention", "full_attention"],
             query_pre_attn_scalar=16, final_logit_softcapping=30.0, rope_local_base_freq=100.0)
VARIANTS = {"llama": {}, "qwen2-bias": dict(model_type="qwen2"), "qwen3-qknorm": dict(model_type="qwen3"),
            "mistral-window": dict(model_type="mistral", sliding_window=5), "gemma3": GEMMA}


def run(engine, prompt, drafter=None, steps=40):
    stop = StopChecker(set(), (), steps, lambda ids: "")
    return generate(engine, prompt, stop, SamplingParams(0.0), drafter).token_ids


def tree(tokens, parents=None):
    return DraftTree.chain(tokens) if parents is None else DraftTree.from_parents(tokens, parents)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_torch_prefill_tree_and_chain(variant, tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "m", seed=3, **VARIANTS[variant])
    export_onnx(folder, tmp_path / "x")
    ort, ref = GraphEngine(OrtGraph(tmp_path / "x"), 64), TorchEngine(Decoder.from_folder(folder), 64)
    prompt = [257, 10, 20, 30, 40, 50, 60, 70]
    assert torch.allclose(ort.prefill(prompt).logits, ref.prefill(prompt).logits, atol=1e-3)
    for tokens, parents, keep in (([5, 6, 7, 8, 9], [-1, 0, 0, 1, 3], [0, 1, 3]),  # tree, path kept
                                  ([11, 12, 13], None, [0, 1]),  # chain, prefix kept
                                  ([14], None, [0]),  # plain step
                                  ([15, 16, 17, 18], [-1, 0, 1, 1], [0, 1, 3])):
        a, b = ort.verify(tree(tokens, parents)), ref.verify(tree(tokens, parents))
        assert a.logits.shape == (len(tokens), 259)
        assert (a.logits - b.logits).abs().max() < 1e-3
        assert (a.hidden_states - b.hidden_states).abs().max() < 1e-3
        ort.commit(keep)
        ref.commit(keep)
        assert ort.length == ref.length
    # past the sliding windows: 8 + 3 + 2 + 1 + 3 = 17 committed tokens
    assert ort.length == 17


@pytest.mark.parametrize("variant", ["llama", "gemma3"])
def test_greedy_identical_to_torch_plain_and_ngram(variant, tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "m", seed=1, **VARIANTS[variant])
    export_onnx(folder, tmp_path / "x")
    graph, model = OrtGraph(tmp_path / "x"), Decoder.from_folder(folder)
    prompt = [257, 1, 2, 3, 1, 2, 3, 1, 2]
    want = run(TorchEngine(model, 80), prompt)
    assert run(GraphEngine(graph, 80), prompt) == want
    assert run(GraphEngine(graph, 80), prompt, NgramDrafter(3, 1, 4)) == want


def test_medusa_heads_fused_graph_matches_torch(tiny_folder, tmp_path):
    heads_dir = make_heads(tmp_path / "heads", tiny_folder, seed=2)
    export_onnx(tiny_folder, tmp_path / "x", heads_dir)
    model = Decoder.from_folder(tiny_folder)
    heads = load_heads(heads_dir)
    graph = OrtGraph(tmp_path / "x")
    ort, ref = GraphEngine(graph, 64), TorchEngine(model, 64)
    prompt = [257, 40, 41, 42]
    a, b = ort.prefill(prompt), ref.prefill(prompt)
    assert a.head_logits.shape == (1, 3, 259)
    assert (a.head_logits[0] - heads(b.hidden_states[0], model.logits)).abs().max() < 1e-3
    a, b = ort.verify(tree([1, 2, 3], [-1, 0, 0])), ref.verify(tree([1, 2, 3], [-1, 0, 0]))
    for row in range(3):
        assert (a.head_logits[row] - heads(b.hidden_states[row], model.logits)).abs().max() < 1e-3
    # the Medusa tree drafter over the fused graph gives plain greedy output, as on torch
    shape = StaticTree.from_paths(TREE, 3)
    plain = run(TorchEngine(model, 80), prompt)
    assert run(GraphEngine(graph, 80), prompt, MedusaDrafter(shape)) == plain
    assert run(TorchEngine(model, 80), prompt, MedusaDrafter(shape, heads, model)) == plain


def test_engine_errors_rollback_and_manifest_check(tiny_folder, tmp_path):
    export_onnx(tiny_folder, tmp_path / "x")
    engine = GraphEngine(OrtGraph(tmp_path / "x"), 8)
    with pytest.raises(ValueError, match="commit without"):
        engine.commit([0])
    out = engine.prefill([1, 2, 3])
    assert out.head_logits is None  # exported without heads
    with pytest.raises(ValueError, match="overflow"):
        engine.verify(DraftTree.chain([1] * 6))
    after = engine.verify(DraftTree.chain([4, 5]))
    engine.commit([0, 1])
    engine.rollback(3)  # back to the prompt: the same pass gives the same logits
    assert engine.length == 3 and torch.equal(engine.verify(DraftTree.chain([4, 5])).logits, after.logits)
    with pytest.raises(ValueError, match="roll the KV cache back"):
        engine.rollback(9)
    assert engine.kv_cache_bytes == 2 * 2 * 2 * 8 * 16 * 4
    verify_manifest(tmp_path / "x")
    data = tmp_path / "x" / "model.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 1
    data.write_bytes(bytes(raw))
    with pytest.raises(CorruptModel, match="sha256"):
        verify_manifest(tmp_path / "x")


def test_cli_generate_onnxruntime_backend(tiny_folder, tmp_path, capsys):
    import json

    export_onnx(tiny_folder, tmp_path / "x")
    args = ["--max-new-tokens", "12", "--no-chat", "--json", "hello hello hello"]
    assert main(["generate", "-m", str(tiny_folder)] + args) == 0
    torch_ids = json.loads(capsys.readouterr().out)["token_ids"]
    assert main(["generate", "--backend", "onnxruntime", "-m", str(tmp_path / "x"), "--speculate", "ngram"] + args) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == torch_ids
    assert main(["generate", "--backend", "onnxruntime", "-m", str(tiny_folder)] + args) == 2
    assert "not an mtpctl ONNX export" in capsys.readouterr().err

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"category": "t", "prompt": "abc abc abc"}\n')
    assert main(["bench", "--backend", "onnxruntime", "-m", str(tmp_path / "x"), "--prompts", str(prompts),
                 "--max-new-tokens", "6", "--methods", "plain,ngram", "--json", str(tmp_path / "b.json")]) == 0
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["settings"]["backend"] == "onnxruntime"
    assert main(["bench", "--backend", "onnxruntime", "-m", str(tmp_path / "x"), "--baseline", "transformers"]) == 2


def test_graph_traced_as_over_2gb_decodes_as_torch(tiny_folder, tmp_path, capsys, monkeypatch):
    """An export whose trace held its weights one file per tensor (torch's layout over 2 GB, on the tiny
    model) runs on --backend onnxruntime with the torch backend's greedy tokens, plain and with its heads."""
    import json

    trace_as_over_2gb(monkeypatch)
    heads_dir = make_heads(tmp_path / "heads", tiny_folder, seed=6)
    assert main(["export", str(tiny_folder), "--heads", str(heads_dir), "--onnx", str(tmp_path / "x")]) == 0
    capsys.readouterr()
    args = ["--max-new-tokens", "16", "--no-chat", "--json", "abcabc abcabc"]
    for extra in ([], ["--speculate", "heads", "--heads", str(heads_dir)]):
        assert main(["generate", "-m", str(tiny_folder)] + extra + args) == 0
        want = json.loads(capsys.readouterr().out)["token_ids"]
        assert main(["generate", "--backend", "onnxruntime", "-m", str(tmp_path / "x")] + extra + args) == 0
        assert json.loads(capsys.readouterr().out)["token_ids"] == want


@pytest.mark.real
@pytest.mark.slow
def test_real_smollm2_greedy_identical_over_many_steps(smollm2_folder, smollm2, tmp_path_factory):
    """SmolLM2-135M: logits within 1e-3 of torch, and 64 greedy tokens identical (plain and ngram)."""
    out = tmp_path_factory.mktemp("smol") / "onnx"
    export_onnx(smollm2_folder, out)
    session = OrtSession(out)
    prompt = smollm2.encode("List the planets of the solar system in order, one per line, with one fact each.")
    ref = TorchEngine(smollm2.model, 256)
    ort = session.new_engine(256)
    assert (ort.prefill(prompt).logits - ref.prefill(prompt).logits).abs().max() < 1e-3
    a, b = ort.verify(tree([28, 29, 30, 31], [-1, 0, 0, 2])), ref.verify(tree([28, 29, 30, 31], [-1, 0, 0, 2]))
    assert (a.logits - b.logits).abs().max() < 1e-3
    want = run(TorchEngine(smollm2.model, 256), prompt, steps=64)  # EOS ignored: 64 decode steps
    for drafter in (None, NgramDrafter()):
        got = run(session.new_engine(256), prompt, drafter, steps=64)
        assert len(got) == len(want) == 64
        if got != want:  # fp32 sums differ (~1e-5): only a near-tie may flip an argmax
            i = first_divergence(got, want)
            gap = top2_gap(TorchEngine(smollm2.model, 256).prefill(prompt + want[:i])[0])
            assert gap < 1e-3, f"diverged at token {i} with a top-2 logit gap of {gap}"


def test_session_heads_from_the_export(tiny_folder, tmp_path):
    heads_dir = make_heads(tmp_path / "heads", tiny_folder, seed=4)
    other = make_heads(tmp_path / "other", tiny_folder, seed=5)
    export_onnx(tiny_folder, tmp_path / "x", heads_dir)
    export_onnx(tiny_folder, tmp_path / "plain")
    session = OrtSession(tmp_path / "x")
    heads = heads_for(session, heads_dir)
    assert heads.module is None  # fused into the graph
    assert heads.cfg.num_heads == 3 and heads_for(session, tmp_path / "x").cfg.tree == TREE
    drafter = heads_drafter(session, heads, StaticTree.from_paths(TREE, 3))
    prompt = [257, 9, 8, 7]
    got = session.generate(prompt, 30, SamplingParams(0.0), drafter)
    want = OrtSession(tmp_path / "plain").generate(prompt, 30, SamplingParams(0.0))
    assert got.token_ids == want.token_ids and got.stats.decode_steps <= want.stats.decode_steps
    with pytest.raises(BadInput, match="not the ones fused"):
        heads_for(session, other)
    with pytest.raises(BadInput, match="without MTP heads"):
        heads_for(OrtSession(tmp_path / "plain"), heads_dir)
    eagle = tmp_path / "eagle"  # heads no graph can run: say so first, not "re-export with them"
    eagle.mkdir()
    cfg = json.loads((heads_dir / "mtp_config.json").read_text())
    model_cfg = Decoder.from_folder(tiny_folder).cfg
    cfg.update(kind="eagle", layer=asdict(layer_config_for(model_cfg)))
    (eagle / "mtp_config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModel, match="only the torch backend runs"):
        heads_for(OrtSession(tmp_path / "plain"), eagle)


@pytest.mark.parametrize("own", [False, True])
def test_truncated_draft_vocabulary_heads(own, tiny_folder, tmp_path):
    """Heads scoring a 100-token draft vocabulary (token_map): -inf elsewhere, as in torch; lossless."""
    model = Decoder.from_folder(tiny_folder)
    heads_dir = truncated_heads(tmp_path / "h", tiny_folder, model, own)
    export_onnx(tiny_folder, tmp_path / "x", heads_dir)
    heads = load_heads(heads_dir, torch.float32, model.dense_lm_head())
    graph = OrtGraph(tmp_path / "x")
    prompt = [257, 3, 4, 5]
    a = GraphEngine(graph, 64).prefill(prompt).head_logits[0]
    b = heads(TorchEngine(model, 64).prefill(prompt).hidden_states[0], model.logits)
    finite = torch.isfinite(b)
    assert int(finite.sum()) == 3 * 100 and torch.equal(torch.isfinite(a), finite)
    assert (a[finite] - b[finite]).abs().max() < 1e-3
    shape = StaticTree.from_paths(TREE, 3)
    assert run(GraphEngine(graph, 80), prompt, MedusaDrafter(shape)) == run(TorchEngine(model, 80), prompt)


def test_cli_speculate_heads_on_onnxruntime(tiny_folder, tmp_path, capsys):
    """--speculate heads over the heads fused into an export: the torch backend's tokens."""
    import json

    heads_dir = make_heads(tmp_path / "heads", tiny_folder, seed=6)
    export_onnx(tiny_folder, tmp_path / "x", heads_dir)
    args = ["--max-new-tokens", "16", "--no-chat", "--json", "--speculate", "heads", "abcabc"]
    assert main(["generate", "-m", str(tiny_folder), "--heads", str(heads_dir)] + args) == 0
    want = json.loads(capsys.readouterr().out)
    for heads_arg in (heads_dir, tmp_path / "x"):
        assert main(["generate", "--backend", "onnxruntime", "-m", str(tmp_path / "x"), "--heads", str(heads_arg)]
                    + args) == 0
        got = json.loads(capsys.readouterr().out)
        assert got["token_ids"] == want["token_ids"]
        assert got["stats"]["decode_steps"] == want["stats"]["decode_steps"]
