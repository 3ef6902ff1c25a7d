"""The onnxruntime backend: an ``mtpctl export --onnx`` folder run by ONNX Runtime (CPU, or CUDA where
onnxruntime-gpu finds a GPU), through the shared graph engine (:mod:`mtpctl.backends.graph`).

onnxruntime is imported only when a graph is opened.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np
import torch

from mtpctl.backends.graph import GRAPH_DATA_FILE, GRAPH_FILE, GraphSession, GraphStepOutput, io_names, read_manifest
from mtpctl.errors import CorruptModel, UnsupportedModel


class OrtGraph:
    """An opened fused draft/verify graph (an ``onnxruntime.InferenceSession``): the
    :class:`~mtpctl.backends.graph.GraphRunner` of onnxruntime, KV arrays as numpy.

    Args:
        folder: an export folder (``manifest.json``, ``model.onnx``, ``model.onnx.data``).
        threads: intra-op CPU threads (None: onnxruntime's default).

    Raises:
        BadInput: not an export folder; UnsupportedModel: onnxruntime is not installed;
        CorruptModel: the graph cannot be loaded.
    """

    max_pass = None

    def __init__(self, folder: Path, threads: Optional[int] = None):
        try:
            import onnxruntime as ort
        except ImportError as err:
            raise UnsupportedModel("the onnxruntime backend needs onnxruntime: pip install 'mtpctl[onnx]'") from err
        self.folder = Path(folder)
        self.manifest = read_manifest(self.folder)
        m = self.manifest["model"]
        self.num_layers, self.kv_heads, self.head_dim = m["num_layers"], m["kv_heads"], m["head_dim"]
        self.has_heads = self.manifest.get("heads") is not None
        self.names = io_names(self.num_layers, self.has_heads)
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3  # errors only: no per-initializer notes on stderr
        if threads:
            options.intra_op_num_threads = threads
        providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider")
                     if p in ort.get_available_providers()]
        try:
            self.session = ort.InferenceSession(str(self.folder / GRAPH_FILE), options, providers=providers)
        except Exception as err:  # onnxruntime raises its own untyped errors for unreadable graphs
            raise CorruptModel(f"onnxruntime cannot load {self.folder / GRAPH_FILE}: {err}") from err

    @property
    def weight_bytes(self) -> int:
        """Bytes of the graph's weights (the external data file)."""
        entry = self.manifest["files"].get(GRAPH_DATA_FILE)
        return int(entry["bytes"]) if entry else 0

    def empty_past(self) -> List[np.ndarray]:
        return [np.zeros((1, self.kv_heads, 0, self.head_dim), dtype=np.float32)] * (2 * self.num_layers)

    def run(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, past: Sequence[np.ndarray]):
        feeds = {"input_ids": ids.numpy(), "position_ids": positions.numpy(), "attention_mask": mask.numpy()}
        feeds.update(zip(self.names.past, past))
        outs = self.session.run(self.names.outputs, feeds)
        heads = 1 if self.has_heads else 0
        out = GraphStepOutput(torch.from_numpy(outs[0][0]), torch.from_numpy(outs[1][0]),
                              torch.from_numpy(outs[2][0]) if heads else None)
        return out, outs[2 + heads:]

    def keep(self, kv: Sequence[np.ndarray], slots: Optional[torch.Tensor], length: int) -> List[np.ndarray]:
        if slots is None:
            return [np.ascontiguousarray(a[:, :, :length]) for a in kv]
        index = slots.numpy()
        return [np.take(a, index, axis=2) for a in kv]


class OrtSession(GraphSession):
    """An exported model (graph + tokenizer) on onnxruntime, ready to generate.

    Args:
        folder: an ``mtpctl export --onnx`` folder.
        threads: CPU threads for onnxruntime.

    Raises:
        BadInput, CorruptModel, UnsupportedModel: see :class:`OrtGraph`.
    """

    backend = "onnxruntime"

    def __init__(self, folder: Path, threads: Optional[int] = None):
        super().__init__(folder, OrtGraph(folder, threads))

    @property
    def weight_bytes(self) -> int:
        return self.runner.weight_bytes
