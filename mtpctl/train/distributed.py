"""One process or many (``torchrun --nproc-per-node N``, DDP over gloo on CPU): ranks, progress
from rank 0 only, and joining the process group."""

from __future__ import annotations

import datetime
import os
import sys

import torch

from mtpctl.errors import MtpctlError

#: how long the other ranks wait at a barrier while rank 0 self-distills (minutes to hours)
DISTRIBUTED_TIMEOUT = datetime.timedelta(hours=6)


def rank() -> int:
    """This process's rank (0 outside torchrun)."""
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def world_size() -> int:
    """The number of processes (1 outside torchrun)."""
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def is_main_process() -> bool:
    """True outside torchrun, and on rank 0 under it."""
    return rank() == 0


def log(message: str) -> None:
    """Progress goes to stderr, from rank 0 only."""
    if rank() == 0:
        print(f"mtpctl: {message}", file=sys.stderr, flush=True)


def progress_bar(total: int, desc: str):
    """A tqdm bar on stderr on rank 0, None on the other ranks."""
    if rank() != 0:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=f"mtpctl: {desc}", unit="it", leave=False, dynamic_ncols=True)


def init_distributed() -> bool:
    """Join the process group when launched by ``torchrun`` (gloo on CPU); True when distributed."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or torch.distributed.is_initialized():
        return torch.distributed.is_initialized()
    try:
        torch.distributed.init_process_group("gloo", timeout=DISTRIBUTED_TIMEOUT)
    except (RuntimeError, ValueError) as err:
        raise MtpctlError(f"cannot join the torchrun process group: {err}") from err
    return True
