"""What a verify pass costs against the rows it carries: the table ``--speculate-policy auto`` reads.

For each numeric mode, times one packed pass (``TorchSession.verify_together``) over M sequences of
one row each, after ``--context`` committed tokens per sequence, with every row's logits read (what
acceptance reads of a plain step), for M in ``--rows``; the median of ``--reps`` passes, the rows
counts interleaved pass by pass so a drifting machine hits them alike. A draft node costs a pass
about what another request's row costs (the linear layers dominate), so one table serves both.

Prints a Markdown table (ms and ratio to one row) and, with ``--write FILE``, stores the table as
JSON (``mtpctl/data/pass_costs.json`` is the one the CLI and library read):

    python benchmarks/bench_pass_costs.py --modes float32,bfloat16,int4 --threads 2 --write mtpctl/data/pass_costs.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

from mtpctl.backends.torch import TorchSession
from mtpctl.bench.harness import cpu_model
from mtpctl.decode.tree import DraftTree
from mtpctl.files import write_file
from mtpctl.model.sources import resolve_model

MODES = {"float32": ("float32", "dense"), "bfloat16": ("bfloat16", "dense"), "int4": ("bfloat16", "int4")}


def time_pass(session: TorchSession, engines: list, reps: int = 1) -> float:
    """ms of one packed pass over ``engines`` (one pending token each) with every row's logits read."""
    trees = [DraftTree(5) for _ in engines]
    start = time.perf_counter()
    for _ in range(reps):
        outs = session.verify_together(engines, trees)
        for out in outs:  # as greedy acceptance reads a round: every row asked for, then read
            out.prefetch([0])
        for out in outs:
            out[0]
    return (time.perf_counter() - start) * 1e3 / reps


def measure(session: TorchSession, rows: list, context: int, reps: int) -> dict:
    """rows -> median ms of a pass of that many one-row sequences."""
    engines = []
    for i in range(max(rows)):
        engine = session.new_engine(context + 2)
        engine.prefill([(100 + 7 * i + j) % 1000 + 10 for j in range(context)])
        engines.append(engine)
    for m in rows:
        time_pass(session, engines[:m])  # warm-up
    times = {m: [] for m in rows}
    for _ in range(reps):
        for m in rows:
            times[m].append(time_pass(session, engines[:m]))
    return {m: statistics.median(t) for m, t in times.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="model alias or folder")
    p.add_argument("--modes", default="float32,bfloat16,int4", help="numeric modes, comma-separated")
    p.add_argument("--rows", default="1,2,4,8,12,16,24,32,48,64", help="rows per pass, comma-separated")
    p.add_argument("--context", type=int, default=200, help="committed tokens per sequence before the pass")
    p.add_argument("--reps", type=int, default=7, help="passes per row count (the median is kept)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--write", default=None, help="store the table as JSON here (for the auto policy)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = sorted({int(r) for r in args.rows.split(",")})
    folder = resolve_model(args.model)
    table = {}
    print(f"Context {args.context} tokens per sequence, {torch.get_num_threads()} threads, median of {args.reps} "
          "passes (ms; ratio to one row)\n")
    print("| mode | " + " | ".join(f"{m} rows" for m in rows) + " |")
    print("|---|" + "---:|" * len(rows))
    for mode in args.modes.split(","):
        session = TorchSession(folder, *MODES[mode])
        ms = measure(session, rows, args.context, args.reps)
        table[mode] = {"rows": rows, "ms": [round(ms[m], 3) for m in rows]}
        print(f"| {mode} | " + " | ".join(f"{ms[m]:.1f} ({ms[m] / ms[rows[0]]:.2f}x)" for m in rows) + " |")
    if args.write:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        doc = {"version": 1, "what": "ms of one verify pass of N one-row sequences (logits read), per numeric mode",
               "command": "python benchmarks/bench_pass_costs.py " + " ".join(argv or __import__("sys").argv[1:]),
               "machine": f"{cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
                          f"Python {platform.python_version()}",
               "model": args.model, "context": args.context, "commit": commit or None, "modes": table}
        write_file(Path(args.write), json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
