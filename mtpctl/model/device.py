"""Where the target computes and with which kernels: the device (``auto``, ``cpu``, ``cuda``,
``cuda:N``) and the kernel path (``native``: the C kernels of :mod:`mtpctl.model.native`, CPU only;
``torch``: torch's own ops, the path every device runs).

The pure-torch path keeps speculation's output that of plain decoding by computing every linear
layer of a pass in blocks of exactly :attr:`Placement.rows` rows (:class:`~mtpctl.model.linears.FixedRowsLinear`):
a row's result then comes from a product of one shape whatever else the pass carries. Attention
runs on :func:`mtpctl.model.decoder._attention`, which reads a token's cache slots the same way
alone and inside a verify pass. How far that holds on a device is measured, not assumed
(docs/numerics.md, "The pure-torch path").
"""

from __future__ import annotations

import contextlib
import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from mtpctl.errors import BadInput

DEVICES = ("auto", "cpu", "cuda", "cuda:N")
KERNELS = ("auto", "native", "torch")
#: the CUDA device whose queued work every timer boundary waits for (:func:`timed_on`); None: no wait
_TIMED: ContextVar[Optional[torch.device]] = ContextVar("mtpctl_timed_device", default=None)
#: rows of each block a linear layer of the pure-torch path computes, per device type: on a CPU a
#: block's rows cost compute (a one-row step computes 4), on a GPU a decode step is bound by reading
#: the weights, so 64 rows cost about what one does
FIXED_ROWS = {"cpu": 4, "cuda": 64}


@dataclass(frozen=True)
class Placement:
    """A resolved ``device`` and kernel path.

    Attributes:
        device: where weights, KV cache and activations live.
        kernels: ``"native"`` (the C kernels; CPU only) or ``"torch"``.
    """

    device: torch.device
    kernels: str

    @property
    def native(self) -> bool:
        return self.kernels == "native"

    @property
    def rows(self) -> int:
        """Rows of a linear layer's fixed-shape blocks on the pure-torch path."""
        return FIXED_ROWS.get(self.device.type, FIXED_ROWS["cuda"])

    def describe(self) -> str:
        """``cpu/native``, ``cuda:0/torch``: what ``--json`` reports."""
        return f"{self.device}/{self.kernels}"


def pin_device_numerics(device: torch.device) -> dict:
    """On a CUDA device, turn off every torch switch that lets a product round below its dtype: TF32 for
    float32 matmuls and convolutions (``fp32_precision = "ieee"``) and the reduced-precision reductions
    of float16 and bfloat16 matmuls (on by default). These are process-wide torch settings: a session on
    a GPU sets them when it opens, so that another library's choice (or torch's default) never changes
    what a pass computes. Returns :func:`device_numerics`; nothing is changed on a CPU."""
    if device.type == "cuda":
        matmul = torch.backends.cuda.matmul
        matmul.fp32_precision = "ieee"
        torch.backends.cudnn.fp32_precision = "ieee"
        matmul.allow_fp16_reduced_precision_reduction = False
        matmul.allow_bf16_reduced_precision_reduction = False
    return device_numerics(device)


def device_numerics(device: torch.device) -> dict:
    """The precision switches in force for ``device`` (what ``--json`` reports as ``device_numerics``):
    on CUDA, float32 matmul and convolution precision (``ieee``: no TF32) and whether float16 / bfloat16
    matmuls may reduce in lower precision; {} on a CPU, where torch has no such switch."""
    if device.type != "cuda":
        return {}
    matmul = torch.backends.cuda.matmul
    return {"float32_matmul": matmul.fp32_precision, "float32_conv": torch.backends.cudnn.fp32_precision,
            "float16_reduced_precision_reduction": matmul.allow_fp16_reduced_precision_reduction,
            "bfloat16_reduced_precision_reduction": matmul.allow_bf16_reduced_precision_reduction}


def widening_products(device: torch.device) -> bool:
    """Whether products of bfloat16 operands into float32 (``torch.bmm(..., out_dtype=torch.float32)``) run
    on ``device``: on CUDA in torch 2.8 and later, not on a CPU. Where they run, a bfloat16 model keeps a
    bfloat16 KV cache (:meth:`mtpctl.model.decoder.Decoder.new_cache`); tried on a 1x1 product each
    time it is asked (once a cache), so no answer outlives the torch or device it was found on."""
    if device.type == "cpu":
        return False
    one = torch.ones(1, 1, 1, dtype=torch.bfloat16, device=device)
    try:
        torch.bmm(one, one, out_dtype=torch.float32)
    except (NotImplementedError, RuntimeError, TypeError):  # this torch or device has no such product
        return False
    return True


def resolve_device(name: str = "auto") -> torch.device:
    """``auto`` (a CUDA GPU when torch sees one, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``.

    Raises:
        BadInput: an unknown name, or CUDA asked for where torch sees no GPU (a CPU-only build of
            torch, no driver, or no such index).
    """
    name = str(name).strip().lower()
    if name == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise BadInput(f"unknown device {name!r} (choose from {', '.join(DEVICES)})", option="device") from err
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise BadInput(f"unknown device {name!r} (choose from {', '.join(DEVICES)})", option="device")
    if not torch.cuda.is_available():
        why = "this torch is a CPU-only build" if torch.version.cuda is None else "torch sees no CUDA GPU"
        raise BadInput(f"device {name!r} asked for, but {why}; run on the CPU (device cpu or auto), or install a "
                       "CUDA build of torch on a machine with an NVIDIA GPU", option="device")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise BadInput(f"device {name!r} asked for, but torch sees {torch.cuda.device_count()} CUDA GPU(s)",
                       option="device")
    return device


def resolve_placement(device: str = "auto", kernels: str = "auto") -> Placement:
    """The device and the kernel path to run on: ``auto`` kernels are the native ones on the CPU and
    torch's elsewhere.

    Raises:
        BadInput: see :func:`resolve_device`; an unknown kernel path, or native kernels off the CPU.
    """
    where = resolve_device(device)
    kernels = str(kernels).strip().lower()
    if kernels not in KERNELS:
        raise BadInput(f"unknown kernels {kernels!r} (choose from {', '.join(KERNELS)})", option="kernels")
    if kernels == "auto":
        kernels = "native" if where.type == "cpu" else "torch"
    if kernels == "native" and where.type != "cpu":
        raise BadInput(f"the native kernels run on the CPU only; on {where} use the torch kernels", option="kernels")
    return Placement(where, kernels)


def _cuda(device) -> Optional[torch.device]:
    """``device`` (a name or a torch.device) where it is a CUDA device, else None (None, a CPU)."""
    if device is None:
        return None
    device = torch.device(device)
    return device if device.type == "cuda" else None


@contextlib.contextmanager
def timed_on(device) -> Iterator[None]:
    """Inside, every timer boundary of decoding (:func:`clock`) first waits for the work queued on
    ``device`` where it is a CUDA device: GPU work is asynchronous, so without the wait a phase's time
    lands in whichever later phase first waits for the device (the pass's time in acceptance, where
    the argmax ids come to the host). Nothing changes on a CPU (or ``device`` None). ``mtpctl bench``
    times its runs inside; plain generation does not, as a wait at every phase would stop the host
    queueing the next phase's kernels while the GPU still runs the last one."""
    token = _TIMED.set(_cuda(device))
    try:
        yield
    finally:
        _TIMED.reset(token)


def clock() -> float:
    """``time.perf_counter()`` seconds, taken after the device of the enclosing :func:`timed_on` has
    finished its queued work (CUDA only; no wait elsewhere or outside :func:`timed_on`)."""
    device = _TIMED.get()
    if device is not None:
        torch.cuda.synchronize(device)
    return time.perf_counter()


@contextlib.contextmanager
def peak_memory(device) -> Iterator[dict]:
    """Measures the peak of torch's CUDA memory on ``device`` inside: the peaks are reset on entry and
    on exit the yielded dict holds ``device_peak_allocated_bytes`` (``torch.cuda.max_memory_allocated``:
    tensors, the weights already held included) and ``device_peak_reserved_bytes``
    (``max_memory_reserved``: what torch's caching allocator held from the driver); it stays empty on a
    CPU (or ``device`` None). The CUDA context and memory allocated outside torch are not counted."""
    cuda = _cuda(device)
    out: dict = {}
    if cuda is not None:
        torch.cuda.reset_peak_memory_stats(cuda)
    yield out
    if cuda is not None:
        out.update(device_peak_allocated_bytes=int(torch.cuda.max_memory_allocated(cuda)),
                   device_peak_reserved_bytes=int(torch.cuda.max_memory_reserved(cuda)))


@contextlib.contextmanager
def measured(device) -> Iterator[dict]:
    """One benchmark run on ``device``: its timer boundaries synchronized (:func:`timed_on`) and its
    device memory peak measured (:func:`peak_memory`, the yielded dict)."""
    with timed_on(device), peak_memory(device) as memory:
        yield memory
