"""The TensorRT backend: build limits and optimization profiles of an engine built from the fused
draft/verify graph (``mtpctl export --onnx ... --trt``), and its runner for the shared graph engine
(:mod:`mtpctl.backends.graph`).

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
from typing import Dict, List, Tuple

from mtpctl.errors import BadInput, CorruptModel, UnsupportedModel
from mtpctl.backends.graph import GraphSession, GraphStepOutput, io_names

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
            "with CUDA (pip install 'mtpctl[gpu]' on such a machine); without them the exported ONNX graph "
            "runs on the onnxruntime backend") from err
    import torch

    if not torch.cuda.is_available():
        raise TensorRTUnavailable("TensorRT needs a CUDA GPU and none is visible; without one the exported ONNX "
                                  "graph runs on the onnxruntime backend")
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
                           "mtpctl export MODEL --onnx OUT/ --trt", option="model")
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
                       f"{limits.max_new_tokens} (rebuild it with mtpctl export --trt-max-new-tokens {draft_len + 1}, or draft less)")
    if capacity - 1 > limits.max_past:
        raise BadInput(f"this generation may hold {capacity - 1} past tokens; the TensorRT engine was built for "
                       f"{limits.max_past} (rebuild it with mtpctl export --trt-max-past {capacity - 1}, or generate fewer tokens)")
    if vocab_size != limits.vocab_size:
        raise BadInput(f"the TensorRT engine has a vocabulary of {limits.vocab_size}, the model {vocab_size}")
    if heads_needed > limits.num_heads:
        raise BadInput(f"the drafter reads {heads_needed} MTP heads; the TensorRT engine has {limits.num_heads} "
                       "(export the model with its heads)")


def builder_flags(precision: str) -> List[str]:
    """Names of the ``tensorrt.BuilderFlag`` members a precision sets (fp32: none)."""
    return {"fp32": [], "fp16": ["FP16"], "bf16": ["BF16"]}[precision]




class TrtGraph:
    """A deserialized TensorRT engine and its execution context: the
    :class:`~mtpctl.backends.graph.GraphRunner` of TensorRT, KV arrays as CUDA tensors.

    Raises:
        TensorRTUnavailable: no tensorrt or no CUDA device; BadInput: no engine in the folder;
        CorruptModel: the engine cannot be deserialized (e.g. built by another TensorRT version).
    """

    def __init__(self, folder: Path):
        trt = require_tensorrt()
        self.folder = Path(folder)
        self.limits = TrtLimits.load(self.folder)
        lim = self.limits
        self.num_layers, self.kv_heads, self.head_dim = lim.num_layers, lim.kv_heads, lim.head_dim
        self.max_pass = lim.max_new_tokens
        self.names = io_names(lim.num_layers, lim.num_heads > 0)
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = runtime.deserialize_cuda_engine((self.folder / ENGINE_FILE).read_bytes())
        if self.engine is None:
            raise CorruptModel(f"TensorRT cannot load {self.folder / ENGINE_FILE} (built by TensorRT "
                               f"{lim.tensorrt_version or '?'}, this is {trt.__version__}); rebuild it")
        self.context = self.engine.create_execution_context()
        self.dtypes = {name: _torch_dtype(trt, self.engine.get_tensor_dtype(name)) for name in self.names.outputs}
        self._stream = None  # a CUDA stream, made at the first pass

    def empty_past(self) -> list:
        import torch

        empty = torch.zeros((1, self.kv_heads, 0, self.head_dim), dtype=torch.float32, device="cuda")
        return [empty] * (2 * self.num_layers)

    def run(self, ids, positions, mask, past) -> tuple:
        import torch

        if self._stream is None:
            self._stream = torch.cuda.Stream()
        feeds = {"input_ids": ids.cuda(), "position_ids": positions.cuda(), "attention_mask": mask.cuda()}
        feeds.update(zip(self.names.past, past))
        for name, tensor in feeds.items():
            self.context.set_input_shape(name, tuple(tensor.shape))
            self.context.set_tensor_address(name, tensor.data_ptr())
        outs = []
        for name in self.names.outputs:
            out = torch.empty(tuple(self.context.get_tensor_shape(name)), dtype=self.dtypes[name], device="cuda")
            self.context.set_tensor_address(name, out.data_ptr())
            outs.append(out)
        if not self.context.execute_async_v3(self._stream.cuda_stream):
            raise RuntimeError("TensorRT execution failed")
        self._stream.synchronize()
        heads = 1 if self.limits.num_heads else 0
        out = GraphStepOutput(outs[0][0].float().cpu(), outs[1][0].float().cpu(),
                              outs[2][0].float().cpu() if heads else None)
        return out, outs[2 + heads:]

    def keep(self, kv, slots, length: int) -> list:
        if slots is None:
            return [a[:, :, :length].contiguous() for a in kv]
        index = slots.cuda()
        return [a.index_select(2, index) for a in kv]


def _torch_dtype(trt, dtype):
    import torch

    table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.int64: torch.int64,
             trt.int32: torch.int32, trt.bool: torch.bool}
    if hasattr(trt, "bfloat16"):
        table[trt.bfloat16] = torch.bfloat16
    return table[dtype]


class TrtSession(GraphSession):
    """An export folder with a TensorRT engine, ready to generate; each request is checked against
    the engine's build limits before its first pass.

    Raises:
        TensorRTUnavailable, BadInput, CorruptModel: see :class:`TrtGraph`.
    """

    backend = "tensorrt"

    def __init__(self, folder: Path):
        super().__init__(folder, TrtGraph(folder))

    @property
    def weight_bytes(self) -> int:
        return (self.folder / ENGINE_FILE).stat().st_size

    def check_request(self, capacity: int, budget: int) -> None:
        check_limits(self.runner.limits, budget, capacity, self.vocab_size)
