"""The TensorRT engine: build limits and optimization profiles of an engine built from the fused
draft/verify graph (``mtpctl export --onnx ... --trt``), and the engine interface of the decoding
loop (see :class:`mtpctl.runtime.engine.TorchEngine`) over it.

TensorRT fixes, per optimization profile, the min / opt / max shape of every input. All of them
derive from one :class:`TrtLimits` (batch, new tokens per pass N, past length): the attention mask's
last axis is past + N and the past KV's length axis is past, at min, opt and max alike, so every
shape the engine accepts is one the graph can take. The limits are saved with the engine
(``trt_limits.json``) and checked against the decoding settings before the first step.

tensorrt and CUDA are needed to build or run an engine; where either is missing every entry point
raises :class:`TensorRTUnavailable` (exit code 2). tensorrt is imported only when needed.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from mtpctl.errors import BadInput, CorruptModel, UnsupportedModel
from mtpctl.runtime.ort_engine import FusedHeadsMixin  # numpy and torch only: no onnxruntime import

ENGINE_FILE = "model.plan"
LIMITS_FILE = "trt_limits.json"
PRECISIONS = ("fp32", "fp16", "bf16")


class TensorRTUnavailable(UnsupportedModel):
    """tensorrt is not installed or no CUDA device is visible (exit code 2)."""


def require_tensorrt():
    """Import and return the ``tensorrt`` module, checking for a CUDA device.

    Raises:
        TensorRTUnavailable: tensorrt is not installed, or there is no CUDA device.
    """
    try:
        import tensorrt
    except ImportError as err:
        raise TensorRTUnavailable(
            "TensorRT is not available: the tensorrt package is not installed, and it needs an NVIDIA GPU "
            "with CUDA (pip install 'mtpctl[gpu]' on such a machine); on this machine export without --trt "
            "and run the graph with --backend onnxruntime") from err
    import torch

    if not torch.cuda.is_available():
        raise TensorRTUnavailable("TensorRT needs a CUDA GPU and none is visible; export without --trt and run "
                                  "the graph with --backend onnxruntime")
    return tensorrt


@dataclass(frozen=True)
class TrtLimits:
    """What a TensorRT engine accepts, from which its optimization profile is derived.

    ``max_new_tokens`` bounds N, the tokens of one pass (a draft tree's nodes + 1, or a prefill
    chunk); ``max_past`` the committed tokens before a pass; ``opt_*`` are the shapes TensorRT tunes
    its kernels for. ``vocab_size``, ``num_heads`` (Medusa heads, 0 = none), ``num_layers``,
    ``kv_heads`` and ``head_dim`` describe the graph the engine was built from.
    """

    max_batch: int = 1
    max_new_tokens: int = 64
    max_past: int = 2048
    opt_batch: int = 1
    opt_new_tokens: int = 8
    opt_past: int = 512
    precision: str = "fp16"
    vocab_size: int = 0
    num_heads: int = 0
    num_layers: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    tensorrt_version: str = ""
    extra: dict = field(default_factory=dict)

    def check(self) -> None:
        """Raise BadInput unless ``1 <= opt <= max`` on every axis and the precision is known."""
        for name, opt, top in (("batch", self.opt_batch, self.max_batch),
                               ("new tokens", self.opt_new_tokens, self.max_new_tokens),
                               ("past length", self.opt_past, self.max_past)):
            if not 1 <= opt <= top:
                raise BadInput(f"TensorRT limits: {name} needs 1 <= opt ({opt}) <= max ({top})")
        if self.precision not in PRECISIONS:
            raise BadInput(f"TensorRT precision {self.precision!r}: choose from {', '.join(PRECISIONS)}")

    def save(self, folder: Path) -> None:
        (Path(folder) / LIMITS_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, folder: Path) -> "TrtLimits":
        """Read ``folder/trt_limits.json``.

        Raises:
            BadInput: no engine in the folder; CorruptModel: a malformed limits file.
        """
        path = Path(folder) / LIMITS_FILE
        if not path.is_file() or not (Path(folder) / ENGINE_FILE).is_file():
            raise BadInput(f"{folder} holds no TensorRT engine ({ENGINE_FILE} + {LIMITS_FILE}); build one with "
                           "mtpctl export MODEL --onnx OUT/ --trt")
        try:
            return cls(**json.loads(path.read_text(encoding="utf-8")))
        except (ValueError, TypeError) as err:
            raise CorruptModel(f"{path} is not a valid limits file: {err}") from err


def profile_shapes(limits: TrtLimits) -> Dict[str, Tuple[tuple, tuple, tuple]]:
    """Input name -> (min, opt, max) shapes of the one optimization profile.

    min is batch 1, one new token, empty past (a one-token prefill); opt and max use the limits.
    The attention mask's last axis is past + N and each past KV's length axis is past, in all three.

    Raises:
        BadInput: inconsistent limits (see :meth:`TrtLimits.check`).
    """
    from mtpctl.runtime.ort_engine import io_names

    limits.check()
    points = ((1, 1, 0), (limits.opt_batch, limits.opt_new_tokens, limits.opt_past),
              (limits.max_batch, limits.max_new_tokens, limits.max_past))
    names = io_names(limits.num_layers, limits.num_heads > 0)
    shapes: Dict[str, Tuple[tuple, tuple, tuple]] = {}
    for name in names.inputs:
        per_point = []
        for batch, n, past in points:
            if name in ("input_ids", "position_ids"):
                per_point.append((batch, n))
            elif name == "attention_mask":
                per_point.append((batch, n, past + n))
            else:
                per_point.append((batch, limits.kv_heads, past, limits.head_dim))
        shapes[name] = tuple(per_point)
    return shapes


def check_limits(limits: TrtLimits, draft_len: int, capacity: int, vocab_size: int,
                 heads_needed: int = 0) -> None:
    """Check decoding settings against an engine's build limits, before the first step.

    Args:
        draft_len: the most draft tokens (tree nodes) per step; a pass scores draft_len + 1 tokens.
        capacity: prompt + new tokens + draft the generation may need.
        vocab_size: the tokenizer/model vocabulary the loop expects.
        heads_needed: Medusa heads the drafter reads (0 = none).

    Raises:
        BadInput: a setting beyond what the engine was built for (says which limit to rebuild with).
    """
    if draft_len + 1 > limits.max_new_tokens:
        raise BadInput(f"a step verifies {draft_len + 1} tokens; the TensorRT engine was built for at most "
                       f"{limits.max_new_tokens} (rebuild with --trt-max-new-tokens {draft_len + 1} or draft less)")
    if capacity - 1 > limits.max_past:
        raise BadInput(f"this generation may hold {capacity - 1} past tokens; the TensorRT engine was built for "
                       f"{limits.max_past} (rebuild with --trt-max-past {capacity - 1} or generate fewer tokens)")
    if vocab_size != limits.vocab_size:
        raise BadInput(f"the TensorRT engine has a vocabulary of {limits.vocab_size}, the model {vocab_size}")
    if heads_needed > limits.num_heads:
        raise BadInput(f"the drafter reads {heads_needed} MTP heads; the TensorRT engine has {limits.num_heads} "
                       "(export with --heads)")


def builder_flags(precision: str) -> List[str]:
    """Names of the ``tensorrt.BuilderFlag`` members a precision sets (fp32: none)."""
    return {"fp32": [], "fp16": ["FP16"], "bf16": ["BF16"]}[precision]


class TrtStepOutput:
    """One pass of the engine, read like :class:`mtpctl.runtime.engine.StepOutput` (CPU float32)."""

    def __init__(self, logits, hidden, medusa):
        self.logits, self.hidden_states, self._medusa = logits, hidden, medusa
        self.prompt_hidden_states = None  # this backend returns the prompt's last row only

    def __len__(self) -> int:
        return self.logits.shape[0]

    def __getitem__(self, i: int):
        return self.logits[i % len(self)]

    def draft_logits(self, i: int, token=None, heads=None):
        """As :meth:`mtpctl.runtime.ort_engine.OrtStepOutput.draft_logits` (``token`` unused)."""
        if self._medusa is None:
            raise ValueError("this engine has no MTP heads (export with --heads DIR)")
        return self._medusa[i % len(self)][:heads]


class TrtGraph:
    """A deserialized TensorRT engine and its execution context.

    Raises:
        TensorRTUnavailable: no tensorrt or no CUDA device; BadInput: no engine in the folder;
        CorruptModel: the engine cannot be deserialized (e.g. built by another TensorRT version).
    """

    def __init__(self, folder: Path):
        trt = require_tensorrt()
        import torch

        from mtpctl.runtime.ort_engine import io_names

        self.folder = Path(folder)
        self.limits = TrtLimits.load(self.folder)
        self.names = io_names(self.limits.num_layers, self.limits.num_heads > 0)
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = runtime.deserialize_cuda_engine((self.folder / ENGINE_FILE).read_bytes())
        if self.engine is None:
            raise CorruptModel(f"TensorRT cannot load {self.folder / ENGINE_FILE} (built by TensorRT "
                               f"{self.limits.tensorrt_version or '?'}, this is {trt.__version__}); rebuild it")
        self.context = self.engine.create_execution_context()
        self.stream = torch.cuda.Stream()
        self.dtypes = {name: _torch_dtype(trt, self.engine.get_tensor_dtype(name)) for name in self.names.outputs}

    def run(self, feeds: Dict[str, "object"]) -> List["object"]:
        """Run one pass on CUDA tensors ``feeds`` (input name -> tensor); returns the outputs in
        :func:`mtpctl.runtime.ort_engine.io_names` order, as CUDA tensors."""
        import torch

        for name, tensor in feeds.items():
            self.context.set_input_shape(name, tuple(tensor.shape))
            self.context.set_tensor_address(name, tensor.data_ptr())
        outputs = []
        for name in self.names.outputs:
            shape = tuple(self.context.get_tensor_shape(name))
            out = torch.empty(shape, dtype=self.dtypes[name], device="cuda")
            self.context.set_tensor_address(name, out.data_ptr())
            outputs.append(out)
        if not self.context.execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError("TensorRT execution failed")
        self.stream.synchronize()
        return outputs


def _torch_dtype(trt, dtype):
    import torch

    table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.int64: torch.int64,
             trt.int32: torch.int32, trt.bool: torch.bool}
    if hasattr(trt, "bfloat16"):
        table[trt.bfloat16] = torch.bfloat16
    return table[dtype]


class TrtEngine:
    """Runs a TensorRT engine on one sequence (batch 1); KV cache as CUDA tensors. A prompt longer
    than the engine's ``max_new_tokens`` is prefilled in chunks (the same graph with a growing past).

    Args:
        graph: the loaded engine (:class:`TrtGraph`).
        capacity: the most tokens (committed + one pass) this engine accepts.
    """

    def __init__(self, graph: TrtGraph, capacity: int):
        self.graph = graph
        self._capacity = capacity
        self._kv: list = []
        self._present: Optional[list] = None
        self._length = 0
        self.reset()

    @property
    def length(self) -> int:
        return self._length

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def kv_cache_bytes(self) -> int:
        lim = self.graph.limits
        return 2 * lim.num_layers * lim.kv_heads * self._capacity * lim.head_dim * 4

    def reset(self) -> None:
        import torch

        lim = self.graph.limits
        empty = torch.zeros((1, lim.kv_heads, 0, lim.head_dim), dtype=torch.float32, device="cuda")
        self._kv = [empty] * (2 * lim.num_layers)
        self._present, self._length = None, 0

    def _run(self, tokens: Sequence[int], parents: Optional[Sequence[int]]) -> TrtStepOutput:
        import torch

        from mtpctl.runtime.engine import graph_step_inputs

        n, past = len(tokens), self._length
        if past + n > self._capacity:
            raise ValueError(f"KV cache overflow: {past + n} slots needed, {self._capacity} allocated")
        positions, mask = graph_step_inputs(past, n, parents)
        feeds = {"input_ids": torch.tensor([list(tokens)], dtype=torch.long).cuda(),
                 "position_ids": positions.cuda(), "attention_mask": mask.cuda()}
        feeds.update(zip(self.graph.names.past, self._kv))
        outs = self.graph.run(feeds)
        heads = 1 if self.graph.limits.num_heads else 0
        self._present = outs[2 + heads:]
        return TrtStepOutput(outs[0][0].float().cpu(), outs[1][0].float().cpu(),
                             outs[2][0].float().cpu() if heads else None)

    def prefill(self, prompt_ids: Sequence[int]) -> TrtStepOutput:
        """Reset the cache and commit the prompt in chunks of at most ``max_new_tokens``; returns the
        last position's output (one row)."""
        self.reset()
        chunk = self.graph.limits.max_new_tokens
        out = None
        for start in range(0, len(prompt_ids), chunk):
            part = list(prompt_ids[start:start + chunk])
            out = self._run(part, None)
            self.commit(range(len(part)))
        medusa = None if out._medusa is None else out._medusa[-1:]
        return TrtStepOutput(out.logits[-1:], out.hidden_states[-1:], medusa)

    def verify(self, tokens: Sequence[int], parents: Optional[Sequence[int]] = None) -> TrtStepOutput:
        return self._run(tokens, parents)

    def commit(self, offsets: Sequence[int]) -> None:
        """Keep the KV of the verified nodes at ``offsets`` (root first, in path order)."""
        import torch

        if self._present is None:
            raise ValueError("commit without a verify pass")
        offsets, past = list(offsets), self._length
        keep = torch.cat([torch.arange(past), past + torch.tensor(offsets, dtype=torch.long)]).cuda()
        self._kv = [p.index_select(2, keep) for p in self._present]
        self._length = past + len(offsets)
        self._present = None


class TrtSession(FusedHeadsMixin):
    """An export folder with a TensorRT engine, ready to generate (as :class:`OrtSession`).

    Raises:
        TensorRTUnavailable, BadInput, CorruptModel: see :class:`TrtGraph`.
    """

    backend = "tensorrt"

    def __init__(self, folder: Path):
        from mtpctl.runtime.ort_engine import read_manifest
        from mtpctl.model.tokenizer import TextCodec

        self.folder = Path(folder)
        self.manifest = read_manifest(self.folder)
        self.graph = TrtGraph(self.folder)
        self.codec = TextCodec(self.folder)

    @property
    def context_length(self) -> int:
        return int(self.manifest["model"]["max_position_embeddings"])

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["model"]["vocab_size"])

    @property
    def weight_bytes(self) -> int:
        return (self.folder / ENGINE_FILE).stat().st_size

    def encode(self, prompt: str, chat: bool = True) -> list:
        return self.codec.encode_prompt(prompt, chat)

    def generate(self, prompt_ids, max_new_tokens: int, sampling, drafter=None, draft_len: int = 0,
                 stop_strings=(), on_text=None, heads=None, acceptance: str = "exact"):
        """Generate over a :class:`TrtEngine` after checking the engine's build limits.

        Raises:
            BadInput: settings beyond the engine's limits (:func:`check_limits`), or a bad prompt.
        """
        from mtpctl.decode.loop import generate
        from mtpctl.decode.stopping import StopChecker

        if max_new_tokens < 1:
            raise BadInput(f"max new tokens must be at least 1, got {max_new_tokens}")
        capacity = min(self.context_length, len(prompt_ids) + max_new_tokens + draft_len + 1)
        needed = heads.cfg.num_heads if heads is not None else 0
        check_limits(self.graph.limits, draft_len, capacity, int(self.manifest["model"]["vocab_size"]), needed)
        engine = TrtEngine(self.graph, capacity)
        stop = StopChecker(self.codec.eos_ids, stop_strings, max_new_tokens, self.codec.decode)
        if acceptance == "exact":
            return generate(engine, prompt_ids, stop, sampling, drafter, draft_len, on_text)
        return generate(engine, prompt_ids, stop, sampling, drafter, draft_len, on_text, acceptance)
