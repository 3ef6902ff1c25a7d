"""What a verify pass costs against the rows it carries: the table ``--speculate-policy auto`` reads.

For each numeric mode, times two kinds of packed pass (``TorchSession.verify_together``), with every
row's logits read (as greedy acceptance reads them), after ``--context`` committed tokens per
sequence, for each count M in ``--rows``:

- requests: M sequences of one row each (what M plain requests cost a step);
- tree: one sequence with a draft tree of M nodes (a root, a spine of depth 2, the rest the root's
  children: what a request's draft nodes cost).

A pass's cost splits into a part per sequence (its cache, its attention plan) and a part per row (the
linear layers, its logits); the policy combines the two tables (:class:`mtpctl.decode.policy.PassCosts`).
The median of ``--reps`` passes is kept, every shape and count interleaved pass by pass so a drifting
machine hits them alike.

Prints a Markdown table (ms and ratio to one row) and, with ``--write FILE``, stores the tables as
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

from bench_verify import tree_parents  # the tree shape bench_verify times (this folder)
from mtpctl.backends.torch import TorchSession
from mtpctl.bench.harness import cpu_model
from mtpctl.decode.tree import DraftTree
from mtpctl.files import write_file
from mtpctl.model.sources import resolve_model

MODES = {"float32": ("float32", "dense"), "bfloat16": ("bfloat16", "dense"), "int4": ("bfloat16", "int4")}


def time_pass(session: TorchSession, engines: list, trees: list) -> float:
    """ms of one packed pass of ``trees`` over ``engines`` with every row's logits read."""
    start = time.perf_counter()
    outs = session.verify_together(engines, trees)
    for out, tree in zip(outs, trees):  # as greedy acceptance reads a round: every row asked for, then read
        out.prefetch(range(len(tree)))
    for out, tree in zip(outs, trees):
        for i in range(len(tree)):
            out[i]
    return (time.perf_counter() - start) * 1e3


def passes(engines: list, m: int) -> dict:
    """shape -> (engines, trees) of a pass of ``m`` rows: m one-row requests, or one tree of m nodes."""
    return {"requests": (engines[:m], [DraftTree(5) for _ in range(m)]),
            "tree": (engines[:1], [DraftTree.from_parents([5] * m, tree_parents(m))])}


def measure(session: TorchSession, rows: list, context: int, reps: int) -> dict:
    """(shape, rows) -> median ms of that pass (:func:`passes`)."""
    engines = []
    for i in range(max(rows)):
        engine = session.new_engine(context + max(rows) + 1)
        engine.prefill([(100 + 7 * i + j) % 1000 + 10 for j in range(context)])
        engines.append(engine)
    for m in rows:
        for pair in passes(engines, m).values():
            time_pass(session, *pair)  # warm-up
    times = {}
    for _ in range(reps):
        for m in rows:
            for shape, pair in passes(engines, m).items():
                times.setdefault((shape, m), []).append(time_pass(session, *pair))
    return {key: statistics.median(t) for key, t in times.items()}


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
    print("| mode | pass | " + " | ".join(f"{m} rows" for m in rows) + " |")
    print("|---|---|" + "---:|" * len(rows))
    for mode in args.modes.split(","):
        session = TorchSession(folder, *MODES[mode])
        ms = measure(session, rows, args.context, args.reps)
        table[mode] = {"rows": rows, "ms": [round(ms["requests", m], 3) for m in rows],
                       "tree_ms": [round(ms["tree", m], 3) for m in rows]}
        for shape, label in (("requests", "M requests"), ("tree", "a tree of M")):
            base = ms[shape, rows[0]]
            print(f"| {mode} | {label} | " + " | ".join(f"{ms[shape, m]:.1f} ({ms[shape, m] / base:.2f}x)"
                                                      for m in rows) + " |")
    if args.write:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        doc = {"version": 2, "what": "ms of one verify pass (logits of every row read), per numeric mode: ms of M "
                                     "one-row sequences, tree_ms of one sequence with a draft tree of M nodes",
               "command": "python benchmarks/bench_pass_costs.py " + " ".join(argv or __import__("sys").argv[1:]),
               "machine": f"{cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
                          f"Python {platform.python_version()}",
               "model": args.model, "context": args.context, "commit": commit or None, "modes": table}
        write_file(Path(args.write), json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
