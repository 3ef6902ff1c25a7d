"""``--backend``: which engine runs the decoding loop (torch, onnxruntime, tensorrt), shared by
``mtpctl generate`` and ``mtpctl bench``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import click

from mtpctl.model.sources import resolve_model
from mtpctl.errors import BadInput

BACKENDS = ("torch", "onnxruntime", "tensorrt")

backend_option = click.option(
    "--backend", type=click.Choice(BACKENDS), default="torch", show_default=True,
    help="torch: the native runtime on a checkpoint. onnxruntime: an `mtpctl export --onnx` folder given "
         "as --model. tensorrt: an export folder with an engine built by `mtpctl export --trt` (needs a "
         "CUDA GPU and tensorrt).")


def open_session(model: str, backend: str, dtype: str = "float32", weights: str = "dense",
                 threads: Optional[int] = None):
    """A session (``encode``, ``generate``, ``codec``, ``folder``) for ``model`` on ``backend``.

    Raises:
        BadInput: an exported backend with --dtype/--weights other than float32/dense, or a model
            that is not an export folder.
        UnsupportedModel: onnxruntime or tensorrt (or a CUDA device) is missing.
    """
    if backend == "torch":
        from mtpctl.runtime.session import Session

        return Session(resolve_model(model), dtype, weights)
    if dtype != "float32" or weights != "dense":
        raise BadInput(f"--backend {backend} runs the exported float32 graph: drop --dtype/--weights")
    folder = Path(model).expanduser()
    if not folder.is_dir():
        raise BadInput(f"--backend {backend} takes an export folder as --model (mtpctl export MODEL --onnx OUT/); "
                       f"{model!r} is not a folder")
    if backend == "onnxruntime":
        from mtpctl.runtime.ort_engine import OrtSession

        return OrtSession(folder, threads)
    from mtpctl.runtime.trt_engine import TrtSession

    return TrtSession(folder)
