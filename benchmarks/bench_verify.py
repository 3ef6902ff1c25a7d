"""What one verify pass of the torch engine costs, by numeric mode and draft shape.

Times ``TorchEngine.verify`` (the forward pass only: no logits, no drafting) after a prefill of
``--context`` tokens, for a plain one-token step, chains of N tokens and trees of N nodes (a root with a
depth-2 spine and leaves), and prints a Markdown table of milliseconds per pass (median of ``--reps``)
and the ratio to the plain step. A verify pass of N tokens costing r times a plain step pays off only
when a step commits more than r tokens on average.

    python benchmarks/bench_verify.py --modes bfloat16,int4 --context 200
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mtpctl.convert.sources import resolve_model
from mtpctl.runtime.engine import TorchEngine
from mtpctl.runtime.session import Session

MODES = {"float32": ("float32", "dense"), "bfloat16": ("bfloat16", "dense"), "int4": ("bfloat16", "int4")}


def tree_parents(n: int) -> list:
    """A root, a spine of depth 2 under its first child, and the rest as the root's children."""
    return [-1, 0, 1][:n] + [0] * max(0, n - 3)


def time_pass(engine: TorchEngine, tokens: list, parents, reps: int) -> float:
    engine.verify(tokens, parents)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        engine.verify(tokens, parents)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--modes", default="float32,bfloat16,int4")
    p.add_argument("--context", type=int, default=200, help="committed tokens before the pass")
    p.add_argument("--sizes", default="4,8", help="chain and tree sizes (tokens in the pass, the root included)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = resolve_model(args.model)
    sizes = [int(n) for n in args.sizes.split(",")]
    print(f"Context {args.context} tokens, {torch.get_num_threads()} threads, median of {args.reps} passes (ms; "
          "ratio to the plain step)\n")
    print("| mode | plain | " + " | ".join(f"chain-{n}" for n in sizes) + " | " + " | ".join(f"tree-{n}" for n in sizes) + " |")
    print("|---|---:|" + "---:|" * (2 * len(sizes)))
    for mode in args.modes.split(","):
        session = Session(folder, *MODES[mode])
        engine = TorchEngine(session.model, args.context + max(sizes) + 1)
        engine.prefill(list(range(100, 100 + args.context)))
        plain = time_pass(engine, [5], None, args.reps)
        cells = [f"{plain:.1f}"]
        for shape in ("chain", "tree"):
            for n in sizes:
                ms = time_pass(engine, [5] * n, None if shape == "chain" else tree_parents(n), args.reps)
                cells.append(f"{ms:.1f} ({ms / plain:.2f}x)")
        print(f"| {mode} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
