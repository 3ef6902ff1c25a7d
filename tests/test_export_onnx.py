"""mtpctl export --onnx: the fused draft/verify graph, its manifest, and the output-folder rules."""

from __future__ import annotations

import hashlib
import json

import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from helpers import TREE, make_heads, trace_as_over_2gb, write_tiny_checkpoint  # noqa: E402

from mtpctl.cli.main import main  # noqa: E402
from mtpctl.export import onnx as onnx_export  # noqa: E402
from mtpctl.export.onnx import export_onnx  # noqa: E402
from mtpctl.errors import BadInput, UnsupportedModel  # noqa: E402
from mtpctl.model.weights import weights_hash  # noqa: E402


@pytest.fixture(scope="module")
def exported(tiny_folder, tmp_path_factory):
    """(plain export, export with heads) of the tiny checkpoint."""
    root = tmp_path_factory.mktemp("exports")
    heads = make_heads(root / "heads", tiny_folder)
    return export_onnx(tiny_folder, root / "plain"), export_onnx(tiny_folder, root / "medusa", heads), root


def test_graph_io_symbolic_axes_and_metadata(exported):
    plain, medusa, root = exported
    io = {v["name"]: v for v in plain["inputs"] + plain["outputs"]}
    assert io["input_ids"]["shape"] == ["batch", "new_tokens"] and io["input_ids"]["dtype"] == "int64"
    assert io["attention_mask"]["shape"] == ["batch", "new_tokens", "total_length"]
    assert io["attention_mask"]["dtype"] == "bool"
    assert io["past_key.1"]["shape"] == ["batch", 2, "past_length", 16]  # 2 KV heads (GQA), head_dim 16
    assert io["present_value.1"]["shape"] == ["batch", 2, "total_length", 16]
    assert io["logits"]["shape"] == ["batch", "new_tokens", 259]
    assert io["hidden_states"]["shape"] == ["batch", "new_tokens", 64]
    assert "medusa_logits" not in io
    heads_io = {v["name"]: v for v in medusa["outputs"]}
    assert heads_io["medusa_logits"]["shape"] == ["batch", "new_tokens", 3, 259]
    proto = onnx.load(str(root / "medusa" / "model.onnx"), load_external_data=False)
    assert max(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")) >= 17
    meta = {p.key: p.value for p in proto.metadata_props}
    assert meta["mtpctl_version"] == __import__("mtpctl").__version__
    assert json.loads(meta["tree"]) == TREE
    assert json.loads(meta["heads"])["num_heads"] == 3
    # every weight above 1 KiB lives in the external data file, not in the graph
    big = [t for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert {e.value for t in big for e in t.external_data if e.key == "location"} == {"model.onnx.data"}
    assert sum(len(t.raw_data) for t in proto.graph.initializer) < 64 * 1024
    assert len(big) >= 2 * 4 + 1  # qkv, o_proj, gate_up, down per layer; embeddings
    onnx.checker.check_model(str(root / "medusa" / "model.onnx"), full_check=True)
    inferred = onnx.shape_inference.infer_shapes(onnx.load(str(root / "plain" / "model.onnx")), strict_mode=True)
    assert len(inferred.graph.value_info) > 0


def test_manifest_hashes_and_tokenizer(exported, tiny_folder):
    plain, _, root = exported
    folder = root / "plain"
    listed = set(plain["files"])
    assert listed == {p.name for p in folder.iterdir()} - {"manifest.json"}
    for name, entry in plain["files"].items():
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == entry["sha256"]
    assert plain["target_hash"] == weights_hash(tiny_folder)
    assert "tokenizer.json" in plain["tokenizer_files"] and "model.onnx" not in plain["tokenizer_files"]
    assert json.loads((folder / "manifest.json").read_text()) == plain


def test_weights_traced_one_file_per_tensor_end_in_one_aligned_data_file(tiny_folder, tmp_path, monkeypatch):
    """The >2 GB path on a tiny model: torch's per-tensor files become model.onnx.data (tensors of
    ALIGN_MIN_BYTES or more at multiples of ALIGN_BYTES), listed with its sha256; nothing else is left."""
    seen = trace_as_over_2gb(monkeypatch)
    monkeypatch.setattr(onnx_export, "ALIGN_MIN_BYTES", 4096)
    folder = tmp_path / "x"
    manifest = export_onnx(tiny_folder, folder, make_heads(tmp_path / "heads", tiny_folder))
    assert len(seen[0]) > 10 and "raw.onnx" in seen[0]  # the graph and one file per initializer
    assert sorted(p.name for p in folder.iterdir()) == sorted([*manifest["files"], "manifest.json"])
    assert manifest["graph_data"] == "model.onnx.data"
    data = folder / "model.onnx.data"
    assert manifest["files"]["model.onnx.data"]["sha256"] == hashlib.sha256(data.read_bytes()).hexdigest()
    proto = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    constants = [a.t for n in proto.graph.node for a in n.attribute if a.type == onnx.AttributeProto.TENSOR]
    assert max(len(t.raw_data) for t in constants) >= 4096  # read back from the trace's files into the graph
    assert all(t.data_location == onnx.TensorProto.DEFAULT for t in constants)
    spans = {}
    for t in proto.graph.initializer:
        if len(t.raw_data):
            assert len(t.raw_data) < 1024, t.name
            continue
        info = {e.key: e.value for e in t.external_data}
        assert t.data_location == onnx.TensorProto.EXTERNAL and info["location"] == "model.onnx.data", t.name
        offset, length = int(info["offset"]), int(info["length"])
        assert length < 4096 or offset % onnx_export.ALIGN_BYTES == 0, t.name
        spans[t.name] = (offset, offset + length)
    assert any(end - begin >= 4096 for begin, end in spans.values())
    ordered = sorted(spans.values())
    assert all(a[1] <= b[0] for a, b in zip(ordered, ordered[1:])) and ordered[-1][1] == data.stat().st_size
    onnx.checker.check_model(str(folder / "model.onnx"), full_check=True)
    full = onnx.load(str(folder / "model.onnx"))  # the weights read back from the data file
    assert {t.name: len(t.raw_data) for t in full.graph.initializer if t.name in spans} == \
        {name: end - begin for name, (begin, end) in spans.items()}


def test_a_graph_over_the_protobuf_limit_without_its_weights_is_refused(tiny_folder, tmp_path, monkeypatch):
    monkeypatch.setattr(onnx_export, "PROTOBUF_LIMIT", 1000)
    with pytest.raises(UnsupportedModel, match="over protobuf's 1000-byte limit"):
        export_onnx(tiny_folder, tmp_path / "x")
    assert list(tmp_path.iterdir()) == []


def test_existing_output_refused_then_overwritten(tiny_folder, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(BadInput, match="already exists"):
        export_onnx(tiny_folder, out)
    assert (out / "keep.txt").exists()
    export_onnx(tiny_folder, out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "model.onnx").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary or old folder left


def test_interrupted_export_leaves_nothing(tiny_folder, tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(onnx_export, "write_manifest", boom)
    with pytest.raises(KeyboardInterrupt):
        export_onnx(tiny_folder, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_heads_of_another_model_refused(tiny_folder, tmp_path):
    other = write_tiny_checkpoint(tmp_path / "other", seed=5)
    heads = make_heads(tmp_path / "heads", other)
    with pytest.raises(BadInput, match="trained on another model"):
        export_onnx(tiny_folder, tmp_path / "out", heads)
    wide = make_heads(tmp_path / "wide", tiny_folder, hidden=32)
    with pytest.raises(BadInput, match="hidden size 32"):
        export_onnx(tiny_folder, tmp_path / "out", wide)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heads", "other", "wide"]


def test_cli_export_and_refusal(tiny_folder, tmp_path, capsys):
    out = tmp_path / "new" / "cli-out"  # missing parent folders are created
    assert main(["export", str(tiny_folder), "--onnx", str(out), "--json"]) == 0
    manifest = json.loads(capsys.readouterr().out)
    assert manifest["graph"] == "model.onnx" and (out / "manifest.json").is_file()
    assert main(["export", str(tiny_folder), "--onnx", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mtpctl: error: ") and "--overwrite" in err and err.count("\n") == 1
    heads = make_heads(tmp_path / "h", tiny_folder)
    assert main(["export", str(heads), "--onnx", str(tmp_path / "from-heads")]) == 0  # target from the heads
    assert json.loads((tmp_path / "from-heads" / "manifest.json").read_text())["heads"]["num_heads"] == 3


def test_symbolic_batch_and_empty_past(exported):
    """Two sequences in one batch give each sequence's batch-1 logits; a past of 0 slots is a prefill."""
    import numpy as np

    from mtpctl.backends.onnxruntime import OrtGraph

    _, _, root = exported
    graph = OrtGraph(root / "medusa")

    def run(ids, pos, mask, past):
        feeds = {"input_ids": ids, "position_ids": pos, "attention_mask": mask, **dict(zip(graph.names.past, past))}
        return graph.session.run(graph.names.outputs, feeds)

    ids = np.array([[257, 10, 11, 12], [257, 99, 98, 97]], dtype=np.int64)
    pos = np.tile(np.arange(4), (2, 1)).astype(np.int64)
    mask = np.tile(np.tril(np.ones((4, 4), dtype=bool)), (2, 1, 1))
    empty = [np.zeros((2, 2, 0, 16), dtype=np.float32)] * 4
    both = run(ids, pos, mask, empty)
    assert both[0].shape == (2, 4, 259) and both[2].shape == (2, 4, 3, 259) and both[3].shape == (2, 2, 4, 16)
    for row in range(2):
        one = run(ids[row:row + 1], pos[row:row + 1], mask[row:row + 1], [e[:1] for e in empty])
        assert np.abs(one[0][0] - both[0][row]).max() < 1e-4
        assert np.abs(one[2][0] - both[2][row]).max() < 1e-4
