"""What a verify pass costs against the requests and draft nodes it carries: the table
``--speculate-policy auto`` reads.

For each numeric mode, after ``--context`` committed tokens per sequence, times packed passes
(``TorchSession.verify_together``, every row's logits read as greedy acceptance reads them):

- S requests of one row each, for each S in ``--rows`` (what S plain requests cost a step);
- the same S requests carrying E draft nodes more, for each E in ``--nodes``, spread over the
  requests as draft trees of up to 4 nodes (a root, a spine of depth 2, the rest the root's children).

What the nodes add is the median over ``--reps`` of the difference between the pass with them and
the plain pass timed next to it (before it and after it in turn): paired, so the host's drift (often
more than the difference) cancels. The policy reads both (:class:`mtpctl.decode.policy.PassCosts`).

Prints a Markdown table (ms) and, with ``--write FILE``, stores the tables as JSON
(``mtpctl/data/pass_costs.json`` is the one the CLI and library read on an AVX512-BF16 CPU), each
table recording its ``source``: the model's identity (its config's shape), CPU, matmul path,
threads, commit and date (see :mod:`mtpctl.decode.cost_table` for how the policy picks one):

    python benchmarks/bench_pass_costs.py --modes float32,bfloat16,int4 --threads 2 --write mtpctl/data/pass_costs.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench_verify import tree_parents  # the tree shape bench_verify times (this folder)
from mtpctl.backends.torch import TorchSession
from mtpctl.decode.cost_table import model_identity, table_document, table_source
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


TREE_NODES = 4  # draft nodes per request in a measured pass (the default heads' tree)


def with_nodes(requests: int, nodes: int) -> list:
    """The draft trees of a pass of ``requests`` requests carrying ``nodes`` draft nodes: trees of up to
    :data:`TREE_NODES` nodes on the first requests (all the nodes on the requests there are when
    they do not fit), one-row requests after them."""
    drafting = min(requests, max(1, -(-nodes // TREE_NODES))) if nodes else 0
    counts = [nodes // drafting + (i < nodes % drafting) for i in range(drafting)] + [0] * (requests - drafting)
    return [DraftTree.from_parents([5] * (n + 1), tree_parents(n + 1)) for n in counts]


def measure(session: TorchSession, rows: list, nodes: list, context: int, reps: int) -> tuple:
    """(median ms of a pass of S requests for S in ``rows``, and the median ms that E nodes add to it
    ``[S][E]``, each difference taken against the plain pass timed next to it)."""
    engines = []
    for i in range(max(rows)):
        engine = session.new_engine(context + max(nodes, default=0) + 2)
        engine.prefill([(100 + 7 * i + j) % 1000 + 10 for j in range(context)])
        engines.append(engine)
    for s in rows:
        for e in [0] + nodes:
            time_pass(session, engines[:s], with_nodes(s, e))  # warm-up
    plain = {s: [] for s in rows}
    added = {(s, e): [] for s in rows for e in nodes}
    for rep in range(reps):
        for s in rows:
            for e in nodes:  # each pair in turn plain first and nodes first, so warm caches favour neither
                order = (0, e) if rep % 2 == 0 else (e, 0)
                t = {n: time_pass(session, engines[:s], with_nodes(s, n)) for n in order}
                added[s, e].append(t[e] - t[0])
                plain[s].append(t[0])
    return ({s: statistics.median(t) for s, t in plain.items()},
            {key: statistics.median(t) for key, t in added.items()})


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="model alias or folder")
    p.add_argument("--modes", default="float32,bfloat16,int4", help="numeric modes, comma-separated")
    p.add_argument("--rows", default="1,2,4,8,12,16,24,32,48,64", help="requests per pass, comma-separated")
    p.add_argument("--nodes", default="1,2,3,4,6,8,12,16,24,32", help="draft nodes added to a pass, comma-separated")
    p.add_argument("--context", type=int, default=200, help="committed tokens per sequence before the pass")
    p.add_argument("--reps", type=int, default=15, help="passes per count (the median is kept)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--write", default=None, help="store the table as JSON here (for the auto policy)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = sorted({int(r) for r in args.rows.split(",")})
    nodes = sorted({int(n) for n in args.nodes.split(",")})
    folder = resolve_model(args.model)
    table = {}
    print(f"Context {args.context} tokens per sequence, {torch.get_num_threads()} threads, median of {args.reps} "
          "passes: a pass of S one-row requests (ms), and what E draft nodes add to it (ms, paired)\n")
    print("| mode | requests | pass | " + " | ".join(f"+{e} nodes" for e in nodes) + " |")
    print("|---|---:|---:|" + "---:|" * len(nodes))
    for mode in args.modes.split(","):
        session = TorchSession(folder, *MODES[mode])
        plain, added = measure(session, rows, nodes, args.context, args.reps)
        table[mode] = {"rows": rows, "ms": [round(plain[s], 3) for s in rows], "nodes": nodes,
                       "node_ms": [[round(added[s, e], 3) for e in nodes] for s in rows]}
        for s in rows:
            print(f"| {mode} | {s} | {plain[s]:.1f} | " + " | ".join(f"{added[s, e]:+.1f}" for e in nodes) + " |")
    if args.write:
        write_table(Path(args.write), table, model_identity(session.model.cfg), args, argv)


def write_table(path: Path, modes: dict, identity: dict, args, argv) -> None:
    """Store the measured ``modes`` at ``path`` with their source: the model's identity (its config's
    shape, and the name it was given), the CPU, matmul path, threads, torch, Python, commit and date."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    source = {**table_source(identity, args.model, torch.get_num_threads(), commit or None),
              "python": platform.python_version()}
    command = "python benchmarks/bench_pass_costs.py " + " ".join(argv or sys.argv[1:])
    write_file(path, json.dumps(table_document(modes, source, command, args.context), indent=1) + "\n")


if __name__ == "__main__":
    main()
