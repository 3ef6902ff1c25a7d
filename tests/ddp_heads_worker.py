"""One rank of tests/test_train_ddp.py, run under ``torchrun --nproc-per-node 3`` (gloo, CPU):
Medusa and Hydra heads trained on a tiny in-memory feature set whose micro-batches do not divide
among the ranks (the last holds fewer positions than there are ranks), each rank's heads written to
``OUT/<kind>-rank<r>.safetensors``. Also imported by the test for the single-process reference.

    python -m torch.distributed.run --standalone --nproc-per-node 3 tests/ddp_heads_worker.py OUT
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import random_decoder  # noqa: E402
from mtpctl.train.features import Features  # noqa: E402
from mtpctl.train.settings import TrainSettings  # noqa: E402
from mtpctl.train.trainer import Trainer  # noqa: E402

#: 5 sequences of 5 tokens, one held out: 16 training positions, micro-batches of 7, 7 and 2 positions
SEQUENCES, LENGTH, BATCH_TOKENS = 5, 5, 7
#: a rank that waits longer than this at an all-reduce fails instead of hanging (the library waits an hour)
WAIT = datetime.timedelta(seconds=60)


def tiny_features(hidden: int = 64, vocab: int = 259) -> Features:
    """Random features of ``SEQUENCES`` sequences of ``LENGTH`` tokens, every id on the target's path."""
    g = torch.Generator().manual_seed(0)
    total = SEQUENCES * LENGTH
    pred = torch.randint(0, vocab, (total,), generator=g)
    ids = torch.cat([torch.tensor([1]), pred[:-1]])
    return Features(torch.randn(total, hidden, generator=g).to(torch.bfloat16), pred,
                    torch.arange(0, total + 1, LENGTH), torch.zeros(SEQUENCES, dtype=torch.long), ids)


def settings(kind: str) -> TrainSettings:
    """Two epochs of two heads, micro-batches of ``BATCH_TOKENS`` positions, two a step."""
    return TrainSettings(kind=kind, num_heads=2, batch_tokens=BATCH_TOKENS, grad_accum=2, epochs=2, lr=3e-3,
                         holdout=0.2, measure_prompts=0)


def train(kind: str, work: Path) -> dict:
    """The heads' tensors after training ``kind`` heads on :func:`tiny_features` (in this process's group)."""
    work.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(random_decoder(seed=1), tiny_features(), settings(kind), work)
    trainer.train(resume=False)
    return {k: v.detach().clone().contiguous() for k, v in trainer.heads.state_dict().items()}


def main(out: str) -> None:
    """Join the process group (torchrun's environment), train each kind, write this rank's heads."""
    from safetensors.torch import save_file

    torch.distributed.init_process_group("gloo", timeout=WAIT)
    rank = torch.distributed.get_rank()
    try:
        for kind in ("medusa", "hydra"):
            heads = train(kind, Path(out) / f"work-{kind}-rank{rank}")
            save_file(heads, str(Path(out) / f"{kind}-rank{rank}.safetensors"))
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
