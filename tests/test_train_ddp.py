"""Medusa and Hydra training under DDP when a micro-batch has fewer positions than there are ranks:
every rank still takes part in each gradient all-reduce (a rank with no position contributes zero),
so the run ends and every rank holds the same heads, equal to one process's."""

import os
import subprocess
import sys
from pathlib import Path

import torch

import ddp_heads_worker as worker

REPO = Path(__file__).resolve().parents[1]


def test_a_rank_without_positions_contributes_a_zero_loss_that_reaches_every_parameter(tmp_path):
    """The empty slice's loss is 0 and its backward gives every trainable parameter a (zero) gradient:
    what DDP's reducer needs from each rank before it averages."""
    from mtpctl.train.trainer import Positions, Trainer

    for kind, conditioned in (("medusa", False), ("medusa", True), ("hydra", False)):
        settings = worker.settings(kind)
        settings.condition_on_token = conditioned
        trainer = Trainer(worker.random_decoder(seed=1), worker.tiny_features(), settings, tmp_path / kind)
        empty = Positions(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
        loss, per_head = trainer._loss(empty, torch.ones(settings.num_heads))
        loss.backward()
        assert loss.item() == 0 and per_head.tolist() == [0.0] * settings.num_heads
        assert all(p.grad is not None and not p.grad.any() for p in trainer.params), kind


def test_three_ranks_finish_with_a_micro_batch_smaller_than_the_world(tmp_path):
    """torchrun --nproc-per-node 3 (gloo): the last micro-batch of each epoch holds 2 positions, so rank 2
    has none; the run ends, the three ranks' heads are identical and equal a single process's."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                           str(REPO / "tests/ddp_heads_worker.py"), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    from safetensors.torch import load_file

    for kind in ("medusa", "hydra"):
        ranks = [load_file(str(tmp_path / f"{kind}-rank{r}.safetensors")) for r in range(3)]
        single = worker.train(kind, tmp_path / f"single-{kind}")
        for name, value in ranks[0].items():
            assert all(torch.equal(value, other[name]) for other in ranks[1:]), (kind, name)
            assert torch.allclose(value, single[name], atol=1e-4), (kind, name)
