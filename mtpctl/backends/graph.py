"""The exported fused draft/verify graph as a backend: the export folder's format (I/O names,
``manifest.json``) and the one engine that onnxruntime (:mod:`mtpctl.backends.onnxruntime`) and
TensorRT (:mod:`mtpctl.backends.tensorrt`) share; they differ only in their :class:`GraphRunner`
(the array library and the runtime call).

Every pass (prefill included, with an empty past) runs the one graph: token ids ``[1, N]``,
positions, the attention mask ``[1, N, past + N]`` (causal for a chain, the ancestor mask for a
draft tree; :func:`mtpctl.decode.attention.graph_step_inputs`) and the committed KV cache ``[1,
kv_heads, past, head_dim]`` per layer; it returns the logits ``[1, N, vocab]``, hidden states, the
Medusa heads' logits ``[1, N, K, vocab]`` when the export has heads, and the present KV ``[1,
kv_heads, past + N, head_dim]``. :meth:`GraphEngine.commit` keeps the committed slots and the
accepted path of the present KV.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional, Protocol, Sequence

import torch

from mtpctl.decode.attention import graph_step_inputs
from mtpctl.decode.engine import StepOutput
from mtpctl.decode.session import Session
from mtpctl.decode.tree import DraftTree
from mtpctl.errors import BadInput, CorruptModel, UnsupportedModel
from mtpctl.files import sha256_file
from mtpctl.model.tokenizer import TextCodec

GRAPH_FILE = "model.onnx"
GRAPH_DATA_FILE = "model.onnx.data"
MANIFEST_FILE = "manifest.json"


@dataclass(frozen=True)
class IONames:
    """Input and output names of a fused draft/verify graph."""

    inputs: List[str]
    outputs: List[str]
    past: List[str]
    present: List[str]


def io_names(num_layers: int, heads: bool) -> IONames:
    """The graph's I/O names for ``num_layers`` layers, with or without Medusa heads' logits."""
    past = [f"past_{kind}.{i}" for i in range(num_layers) for kind in ("key", "value")]
    present = [f"present_{kind}.{i}" for i in range(num_layers) for kind in ("key", "value")]
    outputs = ["logits", "hidden_states"] + (["medusa_logits"] if heads else []) + present
    return IONames(["input_ids", "position_ids", "attention_mask"] + past, outputs, past, present)


def read_manifest(folder: Path) -> dict:
    """``folder/manifest.json`` of an export.

    Raises:
        BadInput: the folder is not an mtpctl export (no manifest or no graph).
        CorruptModel: the manifest is not valid JSON.
        UnsupportedModel: a format this mtpctl does not read.
    """
    folder = Path(folder)
    path = folder / MANIFEST_FILE
    if not path.is_file() or not (folder / GRAPH_FILE).is_file():
        raise BadInput(f"{folder} is not an mtpctl ONNX export (no {MANIFEST_FILE} and {GRAPH_FILE}); "
                       "make one with mtpctl export")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorruptModel(f"{path} is not valid JSON: {err}") from err
    if manifest.get("format") != "mtpctl-onnx-export" or manifest.get("format_version", 0) > 1:
        raise UnsupportedModel(f"{path}: not an export format this mtpctl reads "
                               f"({manifest.get('format')!r} version {manifest.get('format_version')!r})")
    return manifest


def verify_manifest(folder: Path) -> None:
    """Check every file listed in the manifest against its size and sha256.

    Raises:
        CorruptModel: a file is missing or its bytes differ from the manifest.
    """
    folder = Path(folder)
    for name, entry in read_manifest(folder)["files"].items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != entry["bytes"]:
            raise CorruptModel(f"{path} is missing or has the wrong size; re-export the model")
        try:
            same = sha256_file(path) == entry["sha256"]
        except OSError:
            same = False
        if not same:
            raise CorruptModel(f"{path} does not match its sha256 in {MANIFEST_FILE}; re-export the model")


class GraphStepOutput(StepOutput):
    """One pass of the graph (:class:`mtpctl.decode.engine.StepOutput`): every row's logits
    ``[N, vocab]``, hidden states ``[N, hidden]`` and, with fused heads, ``head_logits [N, K, vocab]``
    (CPU float32 torch tensors)."""

    prompt_hidden_states = None  # a graph returns the prompt's last row only

    def __init__(self, logits: torch.Tensor, hidden_states: torch.Tensor, head_logits: Optional[torch.Tensor]):
        self.logits, self.hidden_states, self.head_logits = logits, hidden_states, head_logits

    def __len__(self) -> int:
        return self.logits.shape[0]

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.logits[i % len(self)]

    def last(self) -> "GraphStepOutput":
        """The last row alone (what prefill returns)."""
        heads = None if self.head_logits is None else self.head_logits[-1:]
        return GraphStepOutput(self.logits[-1:], self.hidden_states[-1:], heads)


class GraphRunner(Protocol):
    """What a runtime supplies to run the graph: its facts, one pass, and its KV arrays' slots.

    KV arrays are ``[1, kv_heads, slots, head_dim]`` float32 in the runtime's own array type (numpy for
    onnxruntime, CUDA tensors for TensorRT); a list holds one key and one value array per layer.
    """

    num_layers: int
    kv_heads: int
    head_dim: int
    max_pass: Optional[int]  # the most tokens one pass takes (a TensorRT engine's limit); None: any

    def empty_past(self) -> List[Any]:
        """KV arrays of no slots."""

    def run(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
            past: Sequence[Any]) -> tuple:
        """One pass (``ids``/``positions`` int64 ``[1, N]``, ``mask`` bool ``[1, N, past + N]``): returns
        ``(GraphStepOutput, present KV arrays)``."""

    def keep(self, kv: Sequence[Any], slots: Optional[torch.Tensor], length: int) -> List[Any]:
        """KV arrays holding ``kv``'s ``slots`` (long ``[length]``), or its first ``length`` slots when
        ``slots`` is None, each contiguous."""


class GraphEngine:
    """Runs an exported graph on one sequence (:class:`mtpctl.decode.engine.Engine`), holding its KV
    cache as the runner's arrays. A prompt longer than the runner's ``max_pass`` is prefilled in
    chunks (the same graph with a growing past).

    Args:
        runner: the opened graph.
        capacity: the most tokens (committed + one pass) this engine accepts.
    """

    def __init__(self, runner: GraphRunner, capacity: int):
        self.runner = runner
        self._capacity = capacity
        self._kv: List[Any] = runner.empty_past()
        self._present: Optional[List[Any]] = None
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def kv_cache_bytes(self) -> int:
        """Memory of a full KV cache at ``capacity`` (float32 keys and values), bytes."""
        r = self.runner
        return 2 * r.num_layers * r.kv_heads * self._capacity * r.head_dim * 4

    def _run(self, tree: DraftTree) -> GraphStepOutput:
        n, past = len(tree), self._length
        if past + n > self._capacity:
            raise ValueError(f"KV cache overflow: {past + n} slots needed, {self._capacity} allocated")
        positions, mask = graph_step_inputs(past, tree)
        out, self._present = self.runner.run(torch.tensor([tree.tokens], dtype=torch.long), positions, mask, self._kv)
        return out

    def prefill(self, prompt_ids: Sequence[int]) -> GraphStepOutput:
        """Forget the cache, run and commit the prompt (in chunks of ``max_pass``); returns the last
        position's output (one row)."""
        self.rollback(0)
        chunk = self.runner.max_pass or len(prompt_ids)
        out = None
        for start in range(0, len(prompt_ids), chunk):
            part = list(prompt_ids[start:start + chunk])
            out = self._run(DraftTree.chain(part))
            self.commit(range(len(part)))
        return out.last()

    def verify(self, tree: DraftTree) -> GraphStepOutput:
        """Score the tree's N nodes after the committed tokens; nothing is committed."""
        return self._run(tree)

    def commit(self, path: Sequence[int]) -> None:
        """Keep the KV of the verified nodes ``path`` (root first).

        Raises:
            ValueError: nothing was verified since the last commit.
        """
        if self._present is None:
            raise ValueError("commit without a verify pass")
        path, past = list(path), self._length
        total = past + len(path)
        if path == list(range(len(path))):  # a prefix of the pass: no gather
            kept = self._present if total == self._present[0].shape[2] else self.runner.keep(self._present, None, total)
        else:
            slots = torch.cat([torch.arange(past), past + torch.tensor(path, dtype=torch.long)])
            kept = self.runner.keep(self._present, slots, total)
        self._kv, self._length, self._present = list(kept), total, None

    def rollback(self, length: int) -> None:
        """Forget the committed tokens from ``length`` on.

        Raises:
            ValueError: ``length`` is negative or beyond the committed tokens.
        """
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot roll the KV cache back to {length}: it holds {self._length} committed tokens")
        self._kv = self.runner.empty_past() if length == 0 else self.runner.keep(self._kv, None, length)
        self._length, self._present = length, None


class GraphSession(Session):
    """An export folder (graph, tokenizer, manifest) on a runner, ready to generate.

    Raises:
        BadInput, CorruptModel: see :func:`read_manifest` and :class:`TextCodec`.
    """

    def __init__(self, folder: Path, runner: GraphRunner):
        super().__init__(folder, TextCodec(Path(folder)))
        self.manifest = read_manifest(self.folder)
        self.runner = runner

    @property
    def context_length(self) -> int:
        return int(self.manifest["model"]["max_position_embeddings"])

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["model"]["vocab_size"])

    @property
    def fused_heads(self) -> Optional[dict]:
        """The manifest's record of the MTP heads fused into the graph (kind, count, tree, weights'
        sha256), or None."""
        return self.manifest.get("heads") or None

    def new_engine(self, capacity: int, aux_layers: Sequence[int] = ()) -> GraphEngine:
        if aux_layers:
            raise UnsupportedModel("an exported graph returns no intermediate layers: EAGLE-3 heads decode on the torch "
                                   "backend", option="backend")
        return GraphEngine(self.runner, capacity)
