"""Recipes by budget, side by side: for each head folder, what its recipe took to train and what its heads
predict on held-out prompts (its mtp_config.json), and heads+ngram against plain decoding on the benchmark's
built-in prompts (unseen in training) per numeric mode, each mode one `mtpctl bench` run per folder.

    .venv/bin/python benchmarks/bench_recipes.py --heads heads/smollm2-medusa,heads/smollm2-medusa-long --threads 2

Prints markdown on stdout (a table per question), progress on stderr. Time it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MTPCTL = ".venv/bin/mtpctl"
MODES = {"bfloat16": ["--dtype", "bfloat16"], "int4": ["--dtype", "bfloat16", "--weights", "int4"]}


def training_row(folder: Path) -> list:
    """Recipe figures of a head folder: wall time, positions, held-out top-1, expected and measured tau."""
    t = json.loads((folder / "mtp_config.json").read_text(encoding="utf-8")).get("training", {})
    times, measured = t.get("timings_s", {}), t.get("measured") or {}
    magpie = ((t.get("magpie") or {}).get("stats") or {}).get("kept")
    tau = measured.get("tau", {})
    return [f"`{folder}`", _minutes(times.get("total_s")), magpie if magpie is not None else 0, t.get("positions"),
            " / ".join(f"{a:.3f}" for a in t.get("held_out_top1", [])), t.get("expected_tau"),
            tau.get("heads", "-"), tau.get("heads+ngram", "-"),
            f"{measured.get('prompts')} x {measured.get('max_new_tokens')}" if tau else "-"]


def _minutes(seconds) -> str:
    return f"{seconds / 60:.1f}" if seconds is not None else "-"


def bench(folder: Path, mode: str, limit: int, threads: int) -> dict:
    """heads+ngram and plain figures of one `mtpctl bench` run of ``folder`` in ``mode``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        command = [MTPCTL, "bench", *MODES[mode], "--methods", "plain,heads+ngram", "--heads", str(folder),
                   "--limit", str(limit), "--threads", str(threads), "--json", str(out)]
        print(f"$ {shlex.join(command)}", file=sys.stderr, flush=True)
        done = subprocess.run(command, cwd=ROOT, stdout=subprocess.DEVNULL)
        if done.returncode:
            raise SystemExit(f"bench_recipes.py: error: `{shlex.join(command)}` exited with {done.returncode}")
        methods = {m["method"]: m for m in json.loads(out.read_text(encoding="utf-8"))["methods"]}
    return {"plain": methods["plain"], "heads+ngram": methods["heads+ngram"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", required=True, help="head folders, comma-separated (one per recipe)")
    p.add_argument("--modes", default="bfloat16,int4", help=f"comma-separated: {', '.join(MODES)}")
    p.add_argument("--limit", type=int, default=2, help="prompts per category of the built-in set")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    folders = [Path(h) for h in args.heads.split(",")]
    modes = args.modes.split(",")
    missing = [str(f) for f in folders if not (f / "mtp_config.json").is_file()] + [m for m in modes if m not in MODES]
    if missing:
        p.error(f"not a head folder or mode: {', '.join(missing)}")
    print("| head folder | recipe wall min | Magpie prompts kept | positions | held-out top-1 per head | expected tau "
          "| measured tau, heads | measured tau, heads+ngram | held-out prompts x tokens |")
    print("|---|---:|---:|---:|---|---:|---:|---:|---|")
    for folder in folders:
        print("| " + " | ".join(str(x) for x in training_row(folder)) + " |")
    print()
    print("| head folder | mode | plain tokens/s | heads+ngram tokens/s | speedup (p10-p90) | tau | same as plain |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for folder in folders:
        for mode in modes:
            r = bench(folder, mode, args.limit, args.threads)
            h = r["heads+ngram"]
            print(f"| `{folder}` | {mode} | {r['plain']['tokens_per_s']:.1f} | {h['tokens_per_s']:.1f} | "
                  f"{h['speedup']:.2f} ({h['speedup_p10']:.2f}-{h['speedup_p90']:.2f}) | {h['tau']:.2f} | "
                  f"{h['same_as_plain']}/{h['runs']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
