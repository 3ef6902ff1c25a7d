"""TensorRT: profile and limits logic, the builder's API calls (on a stand-in module), one clear
error where tensorrt/CUDA are missing, and the exported graphs' operators against the documented list."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("onnx")

import onnx  # noqa: E402
from helpers import make_heads, truncated_heads, write_tiny_checkpoint  # noqa: E402

from mtpctl.cli.main import main  # noqa: E402
from mtpctl.export import tensorrt as trt_build  # noqa: E402
from mtpctl.export.onnx import export_onnx  # noqa: E402
from mtpctl.errors import BadInput  # noqa: E402
from mtpctl.backends import tensorrt as trt_engine  # noqa: E402
from mtpctl.backends.tensorrt import (TensorRTUnavailable, TrtLimits, builder_flags, check_limits,  # noqa: E402
                                       profile_shapes, require_tensorrt)

OPS_FILE = Path(trt_engine.__file__).resolve().parent.parent / "data" / "tensorrt_onnx_ops.txt"
HAVE_TRT = importlib.util.find_spec("tensorrt") is not None


def limits(**kw) -> TrtLimits:
    base = dict(max_batch=4, max_new_tokens=32, max_past=1000, opt_batch=2, opt_new_tokens=8, opt_past=300,
                vocab_size=259, num_heads=3, num_layers=2, kv_heads=2, head_dim=16)
    base.update(kw)
    return TrtLimits(**base)


def test_profile_mask_is_past_plus_new_tokens_at_min_opt_max():
    shapes = profile_shapes(limits())
    assert shapes["input_ids"] == ((1, 1), (2, 8), (4, 32))
    assert shapes["position_ids"] == shapes["input_ids"]
    assert shapes["attention_mask"] == ((1, 1, 1), (2, 8, 308), (4, 32, 1032))
    assert shapes["past_key.0"] == ((1, 2, 0, 16), (2, 2, 300, 16), (4, 2, 1000, 16))
    assert set(shapes) == {"input_ids", "position_ids", "attention_mask", "past_key.0", "past_value.0",
                           "past_key.1", "past_value.1"}
    for name in ("input_ids", "attention_mask"):
        for point in range(3):  # mask total = past + N, past from the KV inputs, at every point
            batch, n = shapes["input_ids"][point]
            assert shapes["attention_mask"][point] == (batch, n, shapes["past_value.1"][point][2] + n)


@pytest.mark.parametrize("bad", [dict(opt_new_tokens=40), dict(opt_past=0), dict(max_batch=0, opt_batch=0),
                                 dict(precision="int3")])
def test_inconsistent_limits_refused(bad):
    with pytest.raises(BadInput):
        profile_shapes(limits(**bad))


def test_build_limits_checked_before_decoding():
    lim = limits()
    check_limits(lim, draft_len=31, capacity=1001, vocab_size=259, heads_needed=3)  # exactly at the limits
    with pytest.raises(BadInput, match="--trt-max-new-tokens 33"):
        check_limits(lim, draft_len=32, capacity=100, vocab_size=259)
    with pytest.raises(BadInput, match="--trt-max-past 1001"):
        check_limits(lim, draft_len=3, capacity=1002, vocab_size=259)
    with pytest.raises(BadInput, match="vocabulary of 259"):
        check_limits(lim, draft_len=3, capacity=100, vocab_size=300)
    with pytest.raises(BadInput, match="reads 4 MTP heads"):
        check_limits(lim, draft_len=3, capacity=100, vocab_size=259, heads_needed=4)


def test_precision_flags_and_limits_round_trip(tmp_path):
    assert builder_flags("fp32") == [] and builder_flags("fp16") == ["FP16"] and builder_flags("bf16") == ["BF16"]
    (tmp_path / "model.plan").write_bytes(b"x")
    limits(precision="bf16").save(tmp_path)
    assert TrtLimits.load(tmp_path) == limits(precision="bf16")
    with pytest.raises(BadInput, match="no TensorRT engine"):
        TrtLimits.load(tmp_path / "missing")


@pytest.mark.skipif(HAVE_TRT, reason="tensorrt is installed here")
def test_missing_tensorrt_is_one_clear_error(tiny_folder, tmp_path, capsys):
    with pytest.raises(TensorRTUnavailable, match="TensorRT is not available"):
        require_tensorrt()
    out = tmp_path / "trt"
    assert main(["export", str(tiny_folder), "--onnx", str(out), "--trt"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mtpctl: error: TensorRT is not available") and err.count("\n") == 1
    assert not out.exists() and list(tmp_path.iterdir()) == []  # failed before exporting anything
    export_onnx(tiny_folder, tmp_path / "onnx")
    assert main(["generate", "--backend", "tensorrt", "-m", str(tmp_path / "onnx"), "hi"]) == 2
    assert "TensorRT is not available" in capsys.readouterr().err


class FakeTensorRT:
    """Stands in for the tensorrt module: records what the builder is asked to do."""

    __version__ = "10.0-fake"

    def __init__(self):
        self.calls = SimpleNamespace(shapes={}, flags=[], parsed=None, network_flags=None)
        calls = self.calls

        class Logger:
            WARNING = 2

            def __init__(self, level):
                pass

        class Profile:
            def set_shape(self, name, low, opt, high):
                calls.shapes[name] = (tuple(low), tuple(opt), tuple(high))

        class Config:
            def set_flag(self, flag):
                calls.flags.append(flag)

            def add_optimization_profile(self, profile):
                calls.profile = profile

        class Builder:
            def __init__(self, logger):
                pass

            def create_network(self, flags):
                calls.network_flags = flags
                return object()

            def create_builder_config(self):
                return Config()

            def create_optimization_profile(self):
                return Profile()

            def build_serialized_network(self, network, config):
                return b"serialized-engine"

        class OnnxParser:
            num_errors = 0

            def __init__(self, network, logger):
                pass

            def parse_from_file(self, path):
                calls.parsed = path
                return True

        class Engine:  # a deserialized engine: what a session needs before its first pass
            def create_execution_context(self):
                return object()

            def get_tensor_dtype(self, name):
                return "float32"

        class Runtime:
            def __init__(self, logger):
                pass

            def deserialize_cuda_engine(self, data):
                calls.deserialized = data
                return Engine()

        self.Logger, self.Builder, self.OnnxParser, self.Runtime = Logger, Builder, OnnxParser, Runtime
        self.BuilderFlag = SimpleNamespace(FP16="FP16", BF16="BF16")
        self.NetworkDefinitionCreationFlag = SimpleNamespace()  # TensorRT 10: no EXPLICIT_BATCH
        self.float32, self.float16, self.int64, self.int32, self.bool = "float32", "float16", "int64", "int32", "bool"


def test_export_with_trt_build_on_a_stand_in_tensorrt(tiny_folder, tmp_path, monkeypatch, capsys):
    fake = FakeTensorRT()
    monkeypatch.setattr(trt_build, "require_tensorrt", lambda: fake)
    monkeypatch.setattr(trt_engine, "require_tensorrt", lambda: fake)
    heads = make_heads(tmp_path / "heads", tiny_folder)
    out = tmp_path / "engine"
    assert main(["export", str(tiny_folder), "--heads", str(heads), "--onnx", str(out), "--trt",
                 "--trt-precision", "bf16", "--trt-max-new-tokens", "16", "--trt-max-past", "100", "--json"]) == 0
    manifest = json.loads(capsys.readouterr().out)
    assert (out / "model.plan").read_bytes() == b"serialized-engine"
    assert {"model.plan", "trt_limits.json"} <= set(manifest["files"])
    saved = TrtLimits.load(out)
    assert (saved.max_new_tokens, saved.max_past, saved.opt_new_tokens, saved.num_heads, saved.vocab_size,
            saved.precision, saved.tensorrt_version) == (16, 100, 8, 3, 259, "bf16", "10.0-fake")
    assert fake.calls.flags == ["BF16"] and fake.calls.network_flags == 0
    assert fake.calls.parsed.endswith("model.onnx")
    assert fake.calls.shapes["attention_mask"] == ((1, 1, 1), (1, 8, 108), (1, 16, 116))
    assert fake.calls.shapes["past_key.1"] == ((1, 2, 0, 16), (1, 2, 100, 16), (1, 2, 100, 16))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine", "heads"]


def test_requests_beyond_the_context_or_the_engine_limits_exit_2_on_the_tensorrt_backend(tiny_folder, tmp_path,
                                                                                         monkeypatch, capsys):
    """The TensorRT session goes through the same checks as every backend before its first pass: a
    prompt that fills the context, and a generation past the engine's build limits, are one clear
    line and exit code 2 (no CUDA is touched before them)."""
    fake = FakeTensorRT()
    monkeypatch.setattr(trt_build, "require_tensorrt", lambda: fake)
    monkeypatch.setattr(trt_engine, "require_tensorrt", lambda: fake)
    out = tmp_path / "engine"
    assert main(["export", str(tiny_folder), "--onnx", str(out), "--trt", "--trt-max-past", "40"]) == 0
    capsys.readouterr()
    base = ["generate", "--backend", "tensorrt", "-m", str(out), "--no-chat"]
    assert main(base + ["x" * 200]) == 2  # 200 byte tokens: the tiny model's context holds 128
    err = capsys.readouterr().err
    assert "the prompt has 200 tokens; the model's context holds 128" in err and err.count("\n") == 1
    assert main(base + ["--max-new-tokens", "64", "hello"]) == 2  # past 40 committed tokens
    err = capsys.readouterr().err
    assert "built for 40" in err and "--trt-max-past" in err and err.count("\n") == 1
    assert fake.calls.deserialized == b"serialized-engine"


def supported_ops():
    lines = OPS_FILE.read_text(encoding="utf-8").splitlines()
    header = "\n".join(line for line in lines if line.startswith("#"))
    assert "onnx/onnx-tensorrt" in header and "docs/operators.md" in header and "TensorRT" in header
    return {line.strip() for line in lines if line.strip() and not line.startswith("#")}


GRAPHS = {"llama+heads": {}, "llama+truncated-heads": {}, "qwen2": dict(model_type="qwen2"), "qwen3": dict(model_type="qwen3"),
          "mistral-window": dict(model_type="mistral", sliding_window=5),
          "gemma3": dict(model_type="gemma3_text", sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                         query_pre_attn_scalar=16, final_logit_softcapping=30.0)}


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_every_exported_operator_is_documented_by_tensorrt(name, tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "m", **GRAPHS[name])
    heads = make_heads(tmp_path / "h", folder) if name == "llama+heads" else None
    if name == "llama+truncated-heads":  # a draft vocabulary (token_map): scattered into -inf logits
        from mtpctl.model.decoder import Decoder

        heads = truncated_heads(tmp_path / "h", folder, Decoder.from_folder(folder), own=False)
    export_onnx(folder, tmp_path / "x", heads)
    proto = onnx.load(str(tmp_path / "x" / "model.onnx"), load_external_data=False)
    used = {n.op_type for n in proto.graph.node}
    assert used - supported_ops() == set()
    opset = max(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))
    assert 17 <= opset <= 20  # TensorRT 10.0 parses opsets 9 to 20
