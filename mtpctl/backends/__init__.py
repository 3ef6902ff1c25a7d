"""Backends: what runs the target for the decoding loop. ``torch`` (mtpctl's own runtime on a
checkpoint), and the exported graph on ``onnxruntime`` or ``tensorrt`` (one graph engine shared by
both). :func:`open_session` opens any of them."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from mtpctl.decode.session import Session
from mtpctl.errors import BadInput

BACKENDS = ("torch", "onnxruntime", "tensorrt")


def open_session(model: str, backend: str = "torch", dtype: str = "float32", weights: str = "dense",
                 threads: Optional[int] = None, device: str = "auto", kernels: str = "auto",
                 cuda_graphs: bool = False) -> Session:
    """A session for ``model`` on ``backend``: a model (alias, folder, .gguf file, hub id) for
    ``torch``, an ``mtpctl export`` folder for the others. ``device`` and ``kernels`` place the torch
    backend (:func:`mtpctl.model.device.resolve_placement`); an exported graph's runtime picks its own.
    ``cuda_graphs``: the torch backend replays plain decode steps as CUDA graphs (a CUDA device).

    Raises:
        BadInput: an unknown backend, an exported backend with a dtype or weights other than
            float32/dense or a device or kernels other than auto, or a model that is not an export
            folder; a device that is not there (``cuda`` without a GPU).
        ModelNotFound, CorruptModel, UnsupportedModel: the model cannot be resolved or loaded, or
            onnxruntime or tensorrt (or a CUDA device) is missing.
    """
    if backend not in BACKENDS:
        raise BadInput(f"unknown backend {backend!r} (choose from {', '.join(BACKENDS)})", option="backend")
    if backend == "torch":
        from mtpctl.backends.torch import TorchSession
        from mtpctl.model.sources import resolve_model

        return TorchSession(resolve_model(model), dtype, weights, device, kernels, cuda_graphs)
    for setting, value in (("device", device), ("kernels", kernels)):
        if value != "auto":
            raise BadInput(f"the {backend} backend places the exported graph itself: {setting} takes auto there "
                           f"(not {value!r})", option=setting)
    if cuda_graphs:
        raise BadInput(f"CUDA graphs replay the torch backend's decode steps; the {backend} backend runs its own "
                       "graph", option="cuda_graphs")
    if dtype != "float32" or weights != "dense":
        raise BadInput(f"the {backend} backend runs the exported float32 graph: its dtype and weights are "
                       "float32 and dense", option="dtype" if dtype != "float32" else "weights")
    folder = Path(model).expanduser()
    if not folder.is_dir():
        raise BadInput(f"the {backend} backend takes an export folder (mtpctl export MODEL --onnx OUT/); "
                       f"{model!r} is not a folder", option="model")
    if backend == "onnxruntime":
        from mtpctl.backends.onnxruntime import OrtSession

        return OrtSession(folder, threads)
    from mtpctl.backends.tensorrt import TrtSession

    return TrtSession(folder)
