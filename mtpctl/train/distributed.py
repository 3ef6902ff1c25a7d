"""One process or many (``torchrun --nproc-per-node N``): ranks, the device each rank trains on,
the process group's backend (NCCL on CUDA, gloo on the CPU), barriers, and progress from rank 0 only.

Under torchrun a CUDA rank takes the GPU its ``LOCAL_RANK`` names; the backend follows from the
device, never from what happens to be installed.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
import torch

from mtpctl.errors import BadInput, MtpctlError
from mtpctl.model.device import resolve_device

#: how long a rank waits at a barrier for the others: the ranks share the feature extraction shard by
#: shard, so the longest wait is about one shard's extraction (plus loading the target) on the slowest rank
DISTRIBUTED_TIMEOUT = datetime.timedelta(hours=1)


def rank() -> int:
    """This process's rank (0 outside torchrun)."""
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def world_size() -> int:
    """The number of processes (1 outside torchrun)."""
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def is_main_process() -> bool:
    """True outside torchrun, and on rank 0 under it."""
    return rank() == 0


def launched_world_size() -> int:
    """The number of processes torchrun started (``WORLD_SIZE``; 1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_rank() -> int:
    """This process's rank on its node (``LOCAL_RANK``; 0 outside torchrun)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def backend_for(device: torch.device) -> str:
    """The process group's backend for ranks on ``device``: NCCL for CUDA, gloo for the CPU."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def rank_device(name: str = "auto") -> torch.device:
    """The device this rank computes on: ``name`` resolved (:func:`mtpctl.model.device.resolve_device`),
    a CUDA device always with its index (``cuda`` alone: the current one); under torchrun with several
    processes a CUDA rank takes ``cuda:LOCAL_RANK``.

    Raises:
        BadInput: see :func:`resolve_device`; ``cuda:N`` under torchrun with several processes (each
            rank takes its own GPU), or fewer GPUs than ``LOCAL_RANK`` needs.
    """
    device = resolve_device(name)
    if device.type != "cuda":
        return device
    if launched_world_size() <= 1:
        return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
    if device.index is not None:
        raise BadInput(f"device {name!r} under torchrun: each rank takes the GPU of its LOCAL_RANK; give cuda or "
                       "auto", option="device")
    if local_rank() >= torch.cuda.device_count():
        raise BadInput(f"LOCAL_RANK {local_rank()} needs {local_rank() + 1} GPUs, torch sees "
                       f"{torch.cuda.device_count()}", option="device")
    return torch.device("cuda", local_rank())


def init_distributed(device: str = "auto") -> torch.device:
    """Resolve this rank's device (:func:`rank_device`) and, when launched by ``torchrun`` with
    several processes, join the process group with that device's backend (:func:`backend_for`).
    Calling it again returns the device and joins nothing.

    Raises:
        BadInput: see :func:`rank_device`.
        MtpctlError: the process group cannot be joined.
    """
    where = rank_device(device)
    if where.type == "cuda":
        torch.cuda.set_device(where)
    if launched_world_size() <= 1 or torch.distributed.is_initialized():
        return where
    try:
        torch.distributed.init_process_group(backend_for(where), timeout=DISTRIBUTED_TIMEOUT,
                                             device_id=where if where.type == "cuda" else None)
    except (RuntimeError, ValueError) as err:
        raise MtpctlError(f"cannot join the torchrun process group: {err}") from err
    return where


def barrier(device: torch.device) -> None:
    """Wait for every rank (nothing outside torchrun)."""
    if world_size() <= 1:
        return
    if torch.device(device).type == "cuda":
        torch.distributed.barrier(device_ids=[torch.device(device).index or 0])
    else:
        torch.distributed.barrier()


def log(message: str) -> None:
    """Progress goes to stderr, from rank 0 only."""
    if rank() == 0:
        print(f"mtpctl: {message}", file=sys.stderr, flush=True)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Meter:
    """Progress as plain lines on stderr (rank 0 prints them): done of total, positions per second and the
    time left at that pace, at most one line every ``every`` seconds and one at :meth:`close`.

    Args:
        label: what is measured (``features``, ``train``).
        total: units to do (sequences, optimizer steps).
        unit: their name, plural.
        done: units already done (a resumed run), not counted in the pace.
    """

    def __init__(self, label: str, total: int, unit: str, done: int = 0, every: float = 10.0):
        self.label, self.total, self.unit, self.every = label, total, unit, every
        self.done, self.start_done, self.positions = done, done, 0
        self.started = self.shown = time.monotonic()
        self.notes: dict = {}

    def update(self, n: int = 1, positions: int = 0) -> None:
        """``n`` more units done, covering ``positions`` positions."""
        self.done += n
        self.positions += positions
        if time.monotonic() - self.shown >= self.every:
            self.show()

    def note(self, **values) -> None:
        """Figures shown after the pace on the next line (``loss=...``)."""
        self.notes.update(values)

    def line(self) -> str:
        """The progress line as it stands."""
        elapsed = max(time.monotonic() - self.started, 1e-9)
        parts = [f"{self.done}/{self.total} {self.unit}"]
        if self.positions:
            parts.append(f"{self.positions / elapsed:,.0f} positions/s")
        new = self.done - self.start_done
        if 0 < new and self.done < self.total:
            parts.append(f"ETA {_duration((self.total - self.done) * elapsed / new)}")
        parts += [f"{k} {v}" for k, v in self.notes.items()]
        return f"{self.label}: " + ", ".join(parts)

    def show(self) -> None:
        """Print the progress line now."""
        self.shown = time.monotonic()
        log(self.line())

    def write(self, message: str) -> None:
        """A line of its own (an evaluation's figures)."""
        log(message)

    def close(self) -> None:
        """The last line, where anything was done."""
        if self.done > self.start_done:
            self.show()

