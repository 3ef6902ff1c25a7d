"""The ONNX Runtime engine: the decoding loop's engine interface (see
:class:`mtpctl.runtime.engine.TorchEngine`) over a fused draft/verify graph written by
``mtpctl export --onnx`` (:mod:`mtpctl.convert.onnx_export`).

Every pass (prefill included, with an empty past) runs the one graph: token ids ``[1, N]``,
positions, the attention mask ``[1, N, past + N]`` (causal for a chain, the ancestor mask for a
draft tree) and the committed KV cache ``[1, kv_heads, past, head_dim]`` per layer; it returns the
logits ``[1, N, vocab]``, hidden states, the Medusa heads' logits ``[1, N, K, vocab]`` when the
export has heads, and the present KV ``[1, kv_heads, past + N, head_dim]``. :meth:`OrtEngine.commit`
keeps the committed slots and the accepted path of the present KV.

onnxruntime is imported only when a graph is opened.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import numpy as np
import torch

from mtpctl.errors import BadInput, CorruptModel, UnsupportedModel
from mtpctl.runtime.session import generation_capacity

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
    """
    folder = Path(folder)
    path = folder / MANIFEST_FILE
    if not path.is_file() or not (folder / GRAPH_FILE).is_file():
        raise BadInput(f"{folder} is not an mtpctl ONNX export (no {MANIFEST_FILE} and {GRAPH_FILE}); "
                       "make one with mtpctl export MODEL --onnx OUT/")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorruptModel(f"{path} is not valid JSON: {err}") from err
    if manifest.get("format") != "mtpctl-onnx-export" or manifest.get("format_version", 0) > 1:
        raise UnsupportedModel(f"{path}: not an export format this mtpctl reads "
                               f"({manifest.get('format')!r} version {manifest.get('format_version')!r})")
    return manifest


def sha256_of(path: Path) -> Optional[str]:
    """sha256 (hex) of a file's bytes, or None when it cannot be read."""
    from hashlib import sha256

    digest = sha256()
    try:
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 22), b""):
                digest.update(block)
    except OSError:
        return None
    return digest.hexdigest()


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
        if sha256_of(path) != entry["sha256"]:
            raise CorruptModel(f"{path} does not match its sha256 in {MANIFEST_FILE}; re-export the model")


class OrtGraph:
    """An opened fused draft/verify graph (an ``onnxruntime.InferenceSession``) and its export's facts.

    Args:
        folder: an export folder (``manifest.json``, ``model.onnx``, ``model.onnx.data``).
        threads: intra-op CPU threads (None: onnxruntime's default).

    Raises:
        BadInput: not an export folder; UnsupportedModel: onnxruntime is not installed;
        CorruptModel: the graph cannot be loaded.
    """

    def __init__(self, folder: Path, threads: Optional[int] = None):
        try:
            import onnxruntime as ort
        except ImportError as err:
            raise UnsupportedModel("the onnxruntime backend needs onnxruntime: pip install 'mtpctl[onnx]'") from err
        self.folder = Path(folder)
        self.manifest = read_manifest(self.folder)
        m = self.manifest["model"]
        self.num_layers, self.kv_heads, self.head_dim = m["num_layers"], m["kv_heads"], m["head_dim"]
        self.vocab_size, self.context_length = m["vocab_size"], m["max_position_embeddings"]
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

    def run(self, ids: np.ndarray, positions: np.ndarray, mask: np.ndarray, past: Sequence[np.ndarray]):
        """One pass: ``ids``/``positions`` int64 ``[1, N]``, ``mask`` bool ``[1, N, past + N]``,
        ``past`` the 2 x layers KV arrays. Returns the outputs in :func:`io_names` order."""
        feeds = {"input_ids": ids, "position_ids": positions, "attention_mask": mask}
        feeds.update(zip(self.names.past, past))
        return self.session.run(self.names.outputs, feeds)


class OrtStepOutput:
    """One pass of the graph, read like :class:`mtpctl.runtime.engine.StepOutput`: ``out[i]`` row i's
    logits ``[vocab]``, ``out.logits`` ``[N, vocab]``, ``out.hidden_states`` ``[N, hidden]``,
    ``out.draft_logits(i)`` the heads' logits ``[K, vocab]`` (all float32 torch tensors sharing the
    graph's output buffers)."""

    def __init__(self, logits: np.ndarray, hidden: np.ndarray, medusa: Optional[np.ndarray]):
        self.logits = torch.from_numpy(logits)
        self.hidden_states = torch.from_numpy(hidden)
        self.prompt_hidden_states = None  # this backend returns the prompt's last row only
        self._medusa = None if medusa is None else torch.from_numpy(medusa)

    def __len__(self) -> int:
        return self.logits.shape[0]

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.logits[i % len(self)]

    def draft_logits(self, i: int, token=None, heads=None) -> torch.Tensor:
        """The MTP heads' logits at row i, ``[K, vocab]``, computed in the graph (token-conditioned
        heads read the row's argmax there as the pending token, so ``token`` is not used: exact for
        greedy decoding; with sampling a pending token other than the argmax only lowers acceptance).
        ``heads``: only the first ``heads`` rows (the graph runs all K).

        Raises:
            ValueError: the export has no MTP heads.
        """
        if self._medusa is None:
            raise ValueError("this export has no MTP heads (export with --heads DIR)")
        return self._medusa[i % len(self)][:heads]


class OrtEngine:
    """Runs an exported fused graph on one sequence (batch 1), holding its KV cache as arrays.

    Args:
        graph: the opened graph (:class:`OrtGraph`).
        capacity: the most tokens (committed + one pass) this engine accepts.
    """

    def __init__(self, graph: OrtGraph, capacity: int):
        self.graph = graph
        self._capacity = capacity
        self._kv: List[np.ndarray] = []
        self._present: Optional[List[np.ndarray]] = None
        self._length = 0
        self.reset()

    @property
    def length(self) -> int:
        """Committed tokens in the KV cache."""
        return self._length

    @property
    def capacity(self) -> int:
        """The most tokens the cache may hold (tokens)."""
        return self._capacity

    @property
    def kv_cache_bytes(self) -> int:
        """Memory of a full KV cache at ``capacity`` (float32 keys and values), bytes."""
        g = self.graph
        return 2 * g.num_layers * g.kv_heads * self._capacity * g.head_dim * 4

    def reset(self) -> None:
        """Forget every committed slot."""
        g = self.graph
        empty = np.zeros((1, g.kv_heads, 0, g.head_dim), dtype=np.float32)
        self._kv = [empty] * (2 * g.num_layers)
        self._present, self._length = None, 0

    def _run(self, tokens: Sequence[int], parents: Optional[Sequence[int]]) -> OrtStepOutput:
        from mtpctl.runtime.engine import graph_step_inputs

        n, past = len(tokens), self._length
        if past + n > self._capacity:
            raise ValueError(f"KV cache overflow: {past + n} slots needed, {self._capacity} allocated")
        positions, mask = graph_step_inputs(past, n, parents)
        outs = self.graph.run(np.asarray([tokens], dtype=np.int64), positions.numpy(), mask.numpy(), self._kv)
        heads = 1 if self.graph.has_heads else 0
        self._present = outs[2 + heads:]
        return OrtStepOutput(outs[0][0], outs[1][0], outs[2][0] if heads else None)

    def prefill(self, prompt_ids: Sequence[int]) -> OrtStepOutput:
        """Reset the cache, run and commit the prompt; returns the last position's output (one row)."""
        self.reset()
        out = self._run(prompt_ids, None)
        self.commit(range(len(prompt_ids)))
        medusa = None if out._medusa is None else out._medusa[-1:].numpy()
        return OrtStepOutput(out.logits[-1:].numpy(), out.hidden_states[-1:].numpy(), medusa)

    def verify(self, tokens: Sequence[int], parents: Optional[Sequence[int]] = None) -> OrtStepOutput:
        """Score N tokens (a chain, or a draft tree given ``parents``) after the committed ones; row i
        is the target's prediction for the token after node i. Nothing is committed."""
        return self._run(tokens, parents)

    def commit(self, offsets: Sequence[int]) -> None:
        """Keep the KV of the verified nodes at ``offsets`` (root first, in path order).

        Raises:
            ValueError: nothing was verified since the last commit.
        """
        if self._present is None:
            raise ValueError("commit without a verify pass")
        offsets = list(offsets)
        past = self._length
        total = self._present[0].shape[2]
        if offsets == list(range(total - past)):
            self._kv = list(self._present)  # everything accepted: the present KV as it is
        elif offsets == list(range(len(offsets))):
            self._kv = [np.ascontiguousarray(p[:, :, :past + len(offsets)]) for p in self._present]
        else:
            keep = np.concatenate([np.arange(past), past + np.asarray(offsets, dtype=np.int64)])
            self._kv = [np.take(p, keep, axis=2) for p in self._present]
        self._length = past + len(offsets)
        self._present = None


class FusedHeadsMixin:
    """MTP heads fused into an exported graph, for sessions over an export folder (``folder`` and
    ``manifest`` attributes): the same ``load_heads`` / ``heads_drafter`` as
    :class:`mtpctl.runtime.session.Session`."""

    @property
    def heads_config(self):
        """The exported heads' :class:`mtpctl.runtime.heads.HeadsConfig`, or None."""
        if not self.manifest.get("heads"):
            return None
        from mtpctl.runtime.heads import HeadsConfig

        return HeadsConfig.load(self.folder)

    def load_heads(self, folder: Path) -> "FusedHeads":
        """The MTP heads fused into the graph, checked to be the heads in ``folder`` (a head folder whose
        weights' sha256 the manifest records, or the export folder itself).

        Raises:
            BadInput: the export has no heads, or ``folder`` holds other heads.
            UnsupportedModel: ``folder`` holds heads no exported graph can run (hydra, eagle).
        """
        from mtpctl.runtime.heads import CONFIG_FILE, WEIGHTS_FILE, HeadsConfig

        folder = Path(folder)
        if folder.resolve() != self.folder.resolve() and (folder / CONFIG_FILE).is_file():
            kind = HeadsConfig.load(folder).kind
            if kind != "medusa":
                raise UnsupportedModel(f"{folder} holds {kind} heads, which run on the torch backend only "
                                       "(--backend torch)")
        heads = self.manifest_heads()
        if folder.resolve() != self.folder.resolve():
            if not (folder / CONFIG_FILE).is_file():
                raise BadInput(f"{folder} is not an MTP head folder (no {CONFIG_FILE})")
            if sha256_of(folder / WEIGHTS_FILE) != heads.get("weights_sha256"):
                raise BadInput(f"the heads in {folder} are not the ones fused into {self.folder}: re-export "
                               "with mtpctl export MODEL --heads DIR --onnx OUT/, or pass the export folder as --heads")
        return FusedHeads(self.heads_config)

    def manifest_heads(self) -> dict:
        """The manifest's record of the fused heads; BadInput when the export has none."""
        heads = self.manifest.get("heads")
        if not heads:
            raise BadInput(f"{self.folder} was exported without MTP heads: re-export with mtpctl export MODEL "
                           "--heads DIR --onnx OUT/")
        return heads

    def heads_drafter(self, heads: "FusedHeads", tree=None, tree_nodes: Optional[int] = None):
        """A :class:`mtpctl.runtime.heads.MedusaDrafter` over ``tree``, else a tree of ``tree_nodes``
        grown from the heads' accuracy, else the float32 default size (as
        :meth:`mtpctl.runtime.session.Session.heads_drafter`).

        Raises:
            BadInput: a tree deeper than the heads, or a size < 1.
        """
        from mtpctl.runtime.heads import MedusaDrafter, StaticTree, tree_from_accuracy
        from mtpctl.runtime.session import DEFAULT_TREE_NODES

        cfg = heads.cfg
        if tree is None:
            nodes = tree_nodes or DEFAULT_TREE_NODES["float32"]
            tree = tree_from_accuracy(cfg.topk_accuracy, nodes) if cfg.topk_accuracy else \
                StaticTree.from_paths(cfg.tree or [[0]], cfg.num_heads)
        elif tree.depth > cfg.num_heads:
            raise BadInput(f"the draft tree is {tree.depth} deep; the heads predict {cfg.num_heads} tokens")
        return MedusaDrafter(tree)


class OrtSession(FusedHeadsMixin):
    """An exported model (graph + tokenizer) ready to generate, like :class:`mtpctl.runtime.session.Session`.

    Args:
        folder: an ``mtpctl export --onnx`` folder.
        threads: CPU threads for onnxruntime.

    Raises:
        BadInput, CorruptModel, UnsupportedModel: see :class:`OrtGraph`.
    """

    backend = "onnxruntime"

    def __init__(self, folder: Path, threads: Optional[int] = None):
        from mtpctl.model.tokenizer import TextCodec

        self.folder = Path(folder)
        self.graph = OrtGraph(self.folder, threads)
        self.manifest = self.graph.manifest
        self.codec = TextCodec(self.folder)

    @property
    def context_length(self) -> int:
        return self.graph.context_length

    @property
    def vocab_size(self) -> int:
        return self.graph.vocab_size

    @property
    def weight_bytes(self) -> int:
        return self.graph.weight_bytes

    def encode(self, prompt: str, chat: bool = True) -> list:
        return self.codec.encode_prompt(prompt, chat)

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, sampling, drafter=None,
                 draft_len: int = 0, stop_strings: Sequence[str] = (),
                 on_text: Optional[Callable[[str], None]] = None, heads: Optional["FusedHeads"] = None,
                 acceptance: str = "exact"):
        """Generate with the decoding loop over an :class:`OrtEngine`; see
        :meth:`mtpctl.runtime.session.Session.generate` (``heads`` are the graph's own, from
        :meth:`load_heads`).

        Raises:
            BadInput: ``max_new_tokens`` < 1, the prompt does not fit the model's context, or heads
                asked of an export without them.
        """
        from mtpctl.decode.loop import generate
        from mtpctl.decode.stopping import StopChecker

        if heads is not None:
            self.manifest_heads()
        capacity = generation_capacity(len(prompt_ids), max_new_tokens, draft_len, self.context_length, acceptance)
        engine = self.new_engine(capacity)
        stop = StopChecker(self.codec.eos_ids, stop_strings, max_new_tokens, self.codec.decode)
        if acceptance == "exact":
            return generate(engine, prompt_ids, stop, sampling, drafter, draft_len, on_text)
        return generate(engine, prompt_ids, stop, sampling, drafter, draft_len, on_text, acceptance)

    def new_engine(self, capacity: int) -> OrtEngine:
        """An engine over this graph with room for ``capacity`` tokens."""
        return OrtEngine(self.graph, capacity)


@dataclass(frozen=True)
class FusedHeads:
    """MTP heads that run inside an exported graph: only their config is needed by the drafter."""

    cfg: object  # mtpctl.runtime.heads.HeadsConfig
