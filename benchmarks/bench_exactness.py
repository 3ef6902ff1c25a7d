"""Greedy speculation against plain greedy on every matmul path this CPU can run: the native kernels'
own path and the AVX2 and portable paths forced (``MTPCTL_MATMUL_ISA``, with oneDNN and torch's kernels
held to the same instruction sets), in each numeric mode. Prints a markdown table: the path each product
took, its row-invariance verdict here, and whether prompt lookup (alone and in a batch of 3) gave plain
greedy's tokens. Each case runs tests/speculation_equals_plain.py in a process of its own.

    .venv/bin/python benchmarks/bench_exactness.py [--model smollm2-135m] [--tokens 24]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "speculation_equals_plain.py"
FORCED = {"auto": {}, "avx2": {"MTPCTL_MATMUL_ISA": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
          "portable": {"MTPCTL_MATMUL_ISA": "portable", "ONEDNN_MAX_CPU_ISA": "SSE41",
                       "ATEN_CPU_CAPABILITY": "default"}}
MODES = (("float32", "dense"), ("bfloat16", "dense"), ("bfloat16", "int4"))


def case(folder: str, isa: str, dtype: str, weights: str, tokens: int) -> dict:
    """One forced path and mode: the script's JSON, or {"error": its last stderr line}."""
    env = {**os.environ, **FORCED[isa]}
    done = subprocess.run([sys.executable, str(SCRIPT), folder, dtype, weights, str(tokens)], env=env,
                          capture_output=True, text=True)
    if done.returncode:
        return {"error": (done.stderr.strip().splitlines() or ["exit %d" % done.returncode])[-1]}
    return json.loads(done.stdout.splitlines()[-1])


def row(isa: str, dtype: str, weights: str, result: dict) -> str:
    mode = "int4" if weights == "int4" else dtype
    if "error" in result:
        return f"| {isa} | {mode} | - | - | - | error: {result['error']} | - | - |"
    paths = ", ".join(f"{p}: {v}" for p, v in result["matmul_paths"].items())
    same = f"{sum(result['ngram_equal'])}/{len(result['ngram_equal'])}"
    batch = f"{sum(result['batch_equal'])}/{len(result['batch_equal'])}"
    return (f"| {isa} | {mode} | {result['matmul_isa'] or '-'} | {paths} | {result['greedy_exactness']} | {same} | "
            f"{batch} | {result['ngram_accepted']} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="a model alias or checkpoint folder")
    p.add_argument("--tokens", type=int, default=24, help="new tokens per prompt")
    p.add_argument("--paths", default=",".join(FORCED), help=f"comma-separated, of {', '.join(FORCED)}")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from mtpctl.model.sources import resolve_model

    folder = str(resolve_model(args.model))
    lines = ["| forced path | mode | matmul_isa | paths and verdicts | greedy_exactness | prompt lookup = plain "
             "| batch of 3 = plain | drafts accepted |", "|---|---|---|---|---|---:|---:|---:|"]
    failed = False
    for isa in args.paths.split(","):
        for dtype, weights in MODES:
            result = case(folder, isa, dtype, weights, args.tokens)
            failed |= "error" in result or result["greedy_exactness"] != "bit-exact" \
                or not all(result["ngram_equal"] + result["batch_equal"])
            lines.append(row(isa, dtype, weights, result))
            print(lines[-1], file=sys.stderr, flush=True)
    print("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
