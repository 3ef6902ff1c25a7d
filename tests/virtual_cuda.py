"""A virtual CUDA device for the tests: a CPU-only torch made to believe it has one GPU, so that the
pure-torch path's device code runs here and what would cost (or crash) on a real GPU is counted.

Tensors the code puts on ``cuda`` stay on the CPU but are tagged (by storage); a TorchFunctionMode
sees every torch call and records, with the calling line in mtpctl:

- ``mixup``: an op mixing a device tensor with a host tensor of one or more dims (a crash on a GPU);
- ``sync``: a host sync on a device tensor (``int``/``float``/``bool``, ``item``, ``tolist``,
  ``nonzero``, a boolean-mask index, ``.cpu()``/``.to("cpu")``);
- ``h2d``: a host-to-device copy (``.to(cuda)``, ``torch.tensor(..., device=cuda)``, a host index
  tensor into a device tensor), noting whether it is non-blocking;
- ``barrier``: a ``torch.cuda.synchronize()`` (the site: the caller of :func:`mtpctl.model.device.clock`);

a sync's ``detail`` is the dtype and shape of the tensor brought to the host (what a GPU would copy);
``torch.cuda.max_memory_allocated``/``max_memory_reserved`` answer the bytes of every device tensor made
so far (the mode keeps them alive: a bound, not an allocator's peak);

and, inside :meth:`VirtualCuda.counting`, the ops that launch a kernel on a device tensor (a new
storage, or in place; views launch nothing). It finds device mix-ups, syncs and launch counts, not
CUDA numerics and not speed.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import weakref
from pathlib import Path
from typing import List, NamedTuple

import torch
from torch.overrides import TorchFunctionMode

ROOT = str(Path(__file__).resolve().parents[1] / "mtpctl")
CPU, VDEV = torch.device("cpu"), torch.device("cuda", 0)
_DEVICE = torch._C.TensorBase.__dict__["device"]
_IS_CUDA = torch._C.TensorBase.__dict__["is_cuda"]
FACTORIES = {"zeros", "empty", "ones", "arange", "full", "tensor", "as_tensor", "eye", "rand", "randn", "randint",
             "randperm", "linspace", "empty_strided", "scalar_tensor", "zeros_like", "ones_like", "empty_like",
             "full_like"}
SYNCS = {"__int__", "__float__", "__bool__", "__index__", "item", "tolist", "nonzero", "unique", "masked_select",
         "__format__", "__repr__", "argwhere", "numpy"}
INPLACE = {"__setitem__", "__iadd__", "__imul__", "__isub__", "__itruediv__"}
#: tensor methods that allocate without a kernel (memory as it is)
ALLOCATIONS = {"new_empty", "new_empty_strided"}


class Event(NamedTuple):
    kind: str  # "sync", "h2d", "mixup", "barrier"
    what: str
    site: str
    step: int  # VirtualCuda.step when it happened
    detail: str = ""  # a sync: the dtype and shape brought to the host


def _site(skip: str = "") -> str:
    """The innermost mtpctl frame calling into torch (outside a file ending in ``skip``), as
    ``path:line (function)``."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if name.startswith(ROOT) and not (skip and name.endswith(skip)):
            return f"{f.f_code.co_filename[len(ROOT) - 6:]}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return "?"


def _flat(x, out: list) -> list:
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, (list, tuple)):
        for y in x:
            _flat(y, out)
    elif isinstance(x, dict):
        for y in x.values():
            _flat(y, out)
    return out


def _cuda(dev):
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return None


class VirtualCuda(TorchFunctionMode):
    """The mode; use through :func:`virtual_cuda`. ``events`` lists what was seen; ``step`` is a counter
    the caller advances (events carry it) to tell decode steps apart."""

    def __init__(self):
        super().__init__()
        self.keep: list = []  # tagged tensors' storages stay alive, so they are not reused untagged
        self.ptrs: set = set()
        self.empty: dict = {}  # id -> weak reference of each empty device tensor (no memory to know it by)
        self.bytes: dict = {}  # storage pointer -> its bytes, for every tagged storage
        self.events: List[Event] = []
        self.step = 0
        self.ops = None  # a Counter of kernel-launching ops while counting

    def _ptr(self, t):
        if t.is_meta or t.numel() == 0:
            return None
        return t.untyped_storage().data_ptr()

    def tagged(self, t) -> bool:
        p = self._ptr(t)
        if p is None:  # an empty tensor has no memory to know it by: known by the tensor itself
            held = self.empty.get(id(t))
            return held is not None and held() is t
        return p in self.ptrs

    def tag(self, out):
        for t in _flat(out, []):
            p = self._ptr(t)
            if p is None and not t.is_meta:
                self.empty[id(t)] = weakref.ref(t)
            elif p is not None:
                self.keep.append(t.untyped_storage())  # the memory, not the tensor: a tensor may still die
                self.ptrs.add(p)
                self.bytes[p] = t.untyped_storage().nbytes()
        return out

    def _ev(self, kind: str, what: str, detail: str = "") -> None:
        self.events.append(Event(kind, what, _site(), self.step, detail))

    def synchronize(self, *args, **kwargs) -> None:
        """``torch.cuda.synchronize``: recorded as a barrier at the line that asked for the time."""
        self.events.append(Event("barrier", "synchronize", _site("model/device.py"), self.step))

    def device_bytes(self, *args, **kwargs) -> int:
        """Bytes of every device tensor made so far (``max_memory_allocated`` and ``_reserved``)."""
        return sum(self.bytes.values())

    @contextlib.contextmanager
    def counting(self):
        """Count the kernel-launching ops on device tensors inside (yields the Counter)."""
        prev, self.ops = self.ops, collections.Counter()
        try:
            yield self.ops
        finally:
            if prev is not None:
                prev.update(self.ops)
            self.ops = prev

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        owner = getattr(func, "__self__", None)
        if owner is _DEVICE:
            return VDEV if self.tagged(args[0]) else func(*args, **kwargs)
        if owner is _IS_CUDA:
            return self.tagged(args[0])
        name = getattr(func, "__qualname__", getattr(func, "__name__", str(func)))
        short = name.split(".")[-1]
        tensors = _flat(args, []) + _flat(kwargs, [])
        dev = [t for t in tensors if self.tagged(t)]
        if short in ("to", "cuda", "cpu") and name.startswith(("TensorBase.", "Tensor.")):
            return self._move(func, short, args, kwargs)
        if short == "pin_memory" and name.startswith(("TensorBase.", "Tensor.")):
            return args[0]  # a CPU-only torch cannot pin: host memory as it is
        kwargs.pop("pin_memory", None)
        to_dev = _cuda(kwargs.get("device"))
        if to_dev:
            kwargs["device"] = CPU
        if short in FACTORIES and not name.startswith(("TensorBase.", "Tensor.")):
            out = func(*args, **kwargs)
            if to_dev and short in ("tensor", "as_tensor"):
                self._ev("h2d", f"torch.{short}(..., device=cuda)")
            return self.tag(out) if to_dev or (dev and short.endswith("_like") and "device" not in kwargs) else out
        if dev:
            if short in SYNCS:
                self._ev("sync", short, _shape(dev[0]))
            index = _flat(args[1], []) if short in ("__getitem__", "__setitem__") and len(args) > 1 else []
            if short == "__getitem__" and any(t.dtype == torch.bool for t in index):
                self._ev("sync", "boolean-mask index")
            host = [t for t in tensors if not self.tagged(t) and not t.is_meta and t.dim() > 0]
            if host:
                if all(any(h is i for i in index) for h in host):
                    self._ev("h2d", f"host index tensor in {short}")
                elif short in ("__setitem__", "copy_"):
                    self._ev("h2d", f"host tensor copied in {short}"
                                    + (" non_blocking" if kwargs.get("non_blocking") else ""))
                elif short not in ("__set__", "_has_compatible_shallow_copy_type"):
                    self._ev("mixup", f"{short} of device and host tensors {[tuple(h.shape) for h in host][:3]}")
        out_dtype = kwargs.pop("out_dtype", None) if dev else None
        if out_dtype is not None:  # a product into a wider dtype (CUDA's alone): the operands widened, exactly
            args = tuple(a.to(out_dtype) if isinstance(a, torch.Tensor) else a for a in args)
        out = func(*args, **kwargs)
        inplace = short in INPLACE or (short.endswith("_") and not short.startswith("__"))
        if dev and short not in SYNCS and not (inplace and not self.tagged(args[0])):
            self.tag(out)
        if self.ops is not None and dev and short not in SYNCS and short not in ALLOCATIONS:
            if short == "__setitem__" or kwargs.get("out") is not None or isinstance(out, torch.Tensor) and (
                    inplace or self._ptr(out) not in {self._ptr(t) for t in tensors}):
                self.ops[short] += 1
        return out

    def _move(self, func, short, args, kwargs):
        src = args[0]
        target = {"cpu": False, "cuda": True}.get(short)
        if short == "to":
            rest = []
            for a in args[1:]:
                if isinstance(a, torch.Tensor):
                    target = self.tagged(a)
                    rest.append(CPU)
                elif isinstance(a, (torch.device, str)):
                    target = _cuda(a)
                    rest.append(CPU)
                else:
                    rest.append(a)
            if "device" in kwargs:
                target = _cuda(kwargs["device"])
                kwargs["device"] = CPU
            out = func(src, *rest, **kwargs)
        else:
            out = src.to(CPU, non_blocking=kwargs.get("non_blocking", False))
        was = self.tagged(src)
        if target is None or target == was:  # a dtype change, or already there
            if was and self.ops is not None and self._ptr(out) != self._ptr(src):
                self.ops[short] += 1
            return self.tag(out) if was else out
        if out.numel() and self._ptr(out) == self._ptr(src):
            out = out.clone()
        if target:
            self._ev("h2d", ".to(cuda)" + (" non_blocking" if kwargs.get("non_blocking") else " blocking"))
            return self.tag(out)
        self._ev("sync", ".cpu()" if short == "cpu" else ".to(cpu)", _shape(src))
        return out


def _shape(t: torch.Tensor) -> str:
    """``int64[3]``: a tensor's dtype and shape."""
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"


@contextlib.contextmanager
def virtual_cuda():
    """Inside: ``torch.cuda`` reports one device and the yielded :class:`VirtualCuda` watches every
    torch call (restored on exit)."""
    saved = {name: getattr(torch.cuda, name) for name in
             ("is_available", "device_count", "current_device", "set_device", "is_bf16_supported", "synchronize",
              "reset_peak_memory_stats", "max_memory_allocated", "max_memory_reserved")}
    mode = VirtualCuda()
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda.set_device = lambda d: None
    torch.cuda.is_bf16_supported = lambda *a, **k: True
    torch.cuda.synchronize = mode.synchronize
    torch.cuda.reset_peak_memory_stats = lambda *a, **k: None
    torch.cuda.max_memory_allocated = torch.cuda.max_memory_reserved = mode.device_bytes
    try:
        with mode:
            yield mode
    finally:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)


class _Weak:
    """A tensor the recording read but did not make, held weakly: a graph keeps no tensor alive."""

    def __init__(self, t: torch.Tensor):
        base = t._base if t._base is not None else t  # a view keeps its base alive: freed when the base dies
        self.ref, self.base, self.what = weakref.ref(t), weakref.ref(base), _shape(t)
        self.view = (t.shape, t.stride(), t.storage_offset())

    def get(self) -> torch.Tensor:
        t, base = self.ref(), self.base()
        if t is None and base is not None:  # the view died, its memory did not: the graph reads it still
            return base.as_strided(*self.view)
        if t is None:
            raise RuntimeError(f"a replay reads a {self.what} tensor freed since the capture (on a GPU its memory "
                               "may hold another tensor's values by then)")
        return t


class _Tape(TorchFunctionMode):
    """Records every torch call made inside it (the function, its arguments, what it returned); the
    tensors it read that no recorded call made are held weakly (:class:`_Weak`)."""

    def __init__(self):
        super().__init__()
        self.calls: list = []
        self.made: set = set()  # ids of the recorded calls' results (held by the recording)

    def _hold(self, x):
        if isinstance(x, torch.Tensor):
            return x if id(x) in self.made else _Weak(x)
        if isinstance(x, (list, tuple)):
            return type(x)(self._hold(y) for y in x) if not hasattr(x, "_fields") else x
        if isinstance(x, dict):
            return {k: self._hold(v) for k, v in x.items()}
        return x

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.calls.append((func, self._hold(args), self._hold(kwargs), out))
        self.made.update(id(t) for t in _flat(out, []))
        return out


def _resolve(x):
    """A recorded argument with its weakly held tensors taken back."""
    if isinstance(x, _Weak):
        return x.get()
    if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
        return type(x)(_resolve(y) for y in x)
    if isinstance(x, dict):
        return {k: _resolve(v) for k, v in x.items()}
    return x


def _into(recorded, new) -> None:
    """A replayed call's result written where the recorded one lives (later calls read it there)."""
    if isinstance(recorded, torch.Tensor) and isinstance(new, torch.Tensor):
        same = (recorded.data_ptr() == new.data_ptr() and recorded.stride() == new.stride()
                and recorded.shape == new.shape)
        if not same:  # a view of what it was recorded from (or an in-place op's own tensor): nothing to copy
            recorded.copy_(new)
    elif isinstance(recorded, (list, tuple)) and isinstance(new, (list, tuple)):
        for r, n in zip(recorded, new):
            _into(r, n)


class TapeCapture:
    """A CUDA graph's stand-in for :class:`mtpctl.backends.step_graphs.StepGraphs`: capture runs the step
    once, recording each torch call; a replay calls them again on the recorded tensors, each result
    written into the tensor the recording returned, and runs no Python in between, as a graph
    replays its kernels on fixed memory without the host code that launched them. A step that read a
    value on the host, or sliced at a host int, that changes from step to step replays it stale and
    computes the wrong token; a replay that reads a tensor freed since the capture (the graph keeps
    none alive) raises. ``mode``: the :class:`VirtualCuda` whose syncs and host-to-device copies
    during a capture (which a real capture refuses) go to ``capture_events``; while it counts, a replay
    counts as one launch (``graph replay``), as a graph's launch is one call on the host."""

    def __init__(self, mode: VirtualCuda):
        self.mode = mode
        self.capture_events: List[Event] = []

    def __call__(self, step):
        tape = _Tape()
        seen = len(self.mode.events)
        with tape:
            out = step()
        self.capture_events += self.mode.events[seen:]

        def replay():
            counting, self.mode.ops = self.mode.ops, None  # the host launches the graph, not its kernels
            try:
                for func, args, kwargs, recorded in tape.calls:
                    _into(recorded, func(*_resolve(args), **_resolve(kwargs)))
            finally:
                self.mode.ops = counting
            if counting is not None:
                counting["graph replay"] += 1

        return replay, out
