"""``mtpctl export --trt``: build a TensorRT engine from an exported fused draft/verify graph with
TensorRT's Python API (``tensorrt.Builder``, ``OnnxParser``, one optimization profile from
:func:`mtpctl.backends.tensorrt.profile_shapes`, FP16/BF16 builder flags).

The engine (``model.plan``) and its build limits (``trt_limits.json``) are written into the export
folder under temporary names and renamed when complete; the manifest is rewritten to list them.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from mtpctl.errors import UnsupportedModel
from mtpctl.backends.graph import GRAPH_FILE, read_manifest
from mtpctl.backends.tensorrt import (ENGINE_FILE, LIMITS_FILE, TrtLimits, builder_flags, profile_shapes,
                                       require_tensorrt)


def limits_for_export(folder: Path, limits: TrtLimits) -> TrtLimits:
    """``limits`` completed with the graph's facts from the export's manifest (layers, KV heads,
    head_dim, vocabulary, Medusa heads), and checked (BadInput if inconsistent)."""
    m = read_manifest(folder)
    model, heads = m["model"], m.get("heads")
    done = replace(limits, vocab_size=model["vocab_size"], num_layers=model["num_layers"], kv_heads=model["kv_heads"],
                   head_dim=model["head_dim"], num_heads=heads["num_heads"] if heads else 0)
    done.check()
    return done


def build_engine(folder: Path, limits: TrtLimits, progress=lambda line: None) -> TrtLimits:
    """Build ``folder/model.plan`` from ``folder/model.onnx`` for ``limits``; returns the limits saved.

    Raises:
        TensorRTUnavailable: tensorrt or a CUDA device is missing (checked first).
        UnsupportedModel: TensorRT's parser rejects the graph, or the build fails.
        BadInput: inconsistent limits.
    """
    trt = require_tensorrt()
    folder = Path(folder)
    limits = replace(limits_for_export(folder, limits), tensorrt_version=str(getattr(trt, "__version__", "")))
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    explicit = getattr(trt.NetworkDefinitionCreationFlag, "EXPLICIT_BATCH", None)  # TensorRT < 10 only
    network = builder.create_network(0 if explicit is None else 1 << int(explicit))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(folder / GRAPH_FILE)):  # reads model.onnx.data beside it
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise UnsupportedModel(f"TensorRT's ONNX parser rejects {folder / GRAPH_FILE}: {errors}")
    config = builder.create_builder_config()
    for flag in builder_flags(limits.precision):
        config.set_flag(getattr(trt.BuilderFlag, flag))
    profile = builder.create_optimization_profile()
    for name, (low, opt, high) in profile_shapes(limits).items():
        profile.set_shape(name, low, opt, high)
    config.add_optimization_profile(profile)
    progress(f"building the TensorRT engine ({limits.precision}, N <= {limits.max_new_tokens}, "
             f"past <= {limits.max_past}, batch <= {limits.max_batch})")
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise UnsupportedModel("TensorRT could not build an engine from the graph (see the TensorRT log above)")
    tmp = folder / f".{ENGINE_FILE}.tmp-{os.getpid()}"
    try:
        tmp.write_bytes(bytes(serialized))
        limits.save(folder)
        tmp.rename(folder / ENGINE_FILE)
    except BaseException:
        tmp.unlink(missing_ok=True)
        (folder / LIMITS_FILE).unlink(missing_ok=True)
        raise
    return limits
