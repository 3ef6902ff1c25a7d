"""What drafting adds to a decode step outside the target's pass, per numeric mode and method: the
cost the ``--speculate-policy auto`` policy charges a step where rows draft, beside the pass costs.

For each mode and method, S requests of the built-in prompts (prefilled, then one plain pass whose
rows the drafters read), each rep a pass first (so the drafter's weights are as cold as in the
decoding loop, where the target's pass runs between two drafts), then one timed proposal of every
row together, as the loop makes it. From the medians at 1 and at ``--rows`` rows: ``row_ms`` per
drafting row and ``call_ms`` once a step. Prints a Markdown table; with ``--write FILE`` stores them
as ``draft_ms`` (``{method: [call_ms, row_ms]}``) in each mode of that pass-cost table, which
``benchmarks/bench_pass_costs.py --write`` made, the rest of it kept:

    python benchmarks/bench_draft_costs.py --heads heads/smollm2-medusa --threads 2 --write mtpctl/data/pass_costs.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import torch

from mtpctl.backends.torch import TorchSession
from mtpctl.bench.harness import load_prompts
from mtpctl.decode.cost_table import draft_cost, propose_ms
from mtpctl.drafters.build import DraftOptions, build
from mtpctl.drafters.pipeline import heads_config, heads_kind
from mtpctl.files import write_file
from mtpctl.model.sources import resolve_model

MODES = {"float32": ("float32", "dense"), "bfloat16": ("bfloat16", "dense"), "int4": ("bfloat16", "int4")}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="model alias or folder")
    p.add_argument("--heads", required=True, help="MTP head folder (add-heads) for the heads methods")
    p.add_argument("--modes", default="float32,bfloat16,int4", help="numeric modes, comma-separated")
    p.add_argument("--methods", default="ngram,suffix,heads,heads+ngram", help="--speculate values, comma-separated")
    p.add_argument("--rows", type=int, default=8, help="the larger request count timed (the other is 1)")
    p.add_argument("--reps", type=int, default=30, help="proposals per count (the median is kept)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--write", default=None, help="the pass-cost table (JSON) to store draft_ms in")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = resolve_model(args.model)
    table = json.loads(Path(args.write).read_text(encoding="utf-8")) if args.write else None
    print(f"{torch.get_num_threads()} threads, median of {args.reps} proposals, each after a pass: ms a step "
          f"spends drafting\n")
    print(f"| mode | method | 1 row | {args.rows} rows | call_ms | row_ms |")
    print("|---|---|---:|---:|---:|---:|")
    for mode in args.modes.split(","):
        session = TorchSession(folder, *MODES[mode])
        prompts = [session.codec.encode_messages(list(q.messages)) for q in load_prompts()[::10]]
        costs = {}
        with torch.inference_mode():
            for method in args.methods.split(","):
                drafter = build(session, method, DraftOptions(heads_dir=args.heads))
                one = propose_ms(session, drafter, prompts, 1, args.reps)
                many = propose_ms(session, drafter, prompts, args.rows, args.reps)
                cost = draft_cost(one, many, args.rows)
                costs[method] = [cost.call_ms, cost.row_ms]
                print(f"| {mode} | {method} | {one:.2f} | {many:.2f} | {cost.call_ms:.2f} | {cost.row_ms:.2f} |")
        if table is not None:
            table["modes"][mode]["draft_ms"] = costs
    if table is not None:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        table["draft_what"] = ("draft_ms[method]: [call_ms, row_ms], ms a step spends drafting outside the pass: "
                               "call_ms once where any row drafts, row_ms per drafting row")
        table["draft_command"] = "python benchmarks/bench_draft_costs.py " + " ".join(argv or __import__("sys").argv[1:])
        table["draft_commit"] = commit or None
        table["draft_heads"] = heads_kind(heads_config(args.heads))  # the heads methods' costs hold for this kind
        write_file(Path(args.write), json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
