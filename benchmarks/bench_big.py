"""Memory and speed of mtpctl on a checkpoint of a real model's shapes (random bfloat16 weights).

Writes a synthetic checkpoint for ``--shape`` (mtpctl.model.synthetic; reused from ``--cache-dir``
when it is there), then, each in a child process of its own:

1. load: a bfloat16 TorchSession (what ``mtpctl generate --dtype bfloat16`` loads): seconds, and the
   child's peak resident memory (ru_maxrss) against the checkpoint's bytes, before and after the
   child's own start (python, torch and mtpctl imported) is taken off;
2. generate: ``mtpctl generate -m DIR --dtype bfloat16 --max-new-tokens N --json PROMPT``: its peak
   resident memory, wall seconds, time to first token and seconds per decoded token;
3. verify (unless ``--verify-sizes ''``): a verify pass of a chain of N tokens against a plain
   one-token step after a prefill of ``--context`` tokens (as benchmarks/bench_verify.py times them).

Prints a Markdown table and the command that made it. Timings need a quiet machine.

    python benchmarks/bench_big.py --shape benchmarks/shapes/llama-3.2-1b-like.json --cache-dir /tmp/synth --max-new-tokens 4
    python benchmarks/bench_big.py --shape benchmarks/shapes/llama-3.1-8b.json --cache-dir /data/synth --threads 16
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from mtpctl.model.config import DecoderConfig
from mtpctl.model.sources import resolve_model
from mtpctl.model.synthetic import checkpoint_bytes, write_synthetic_checkpoint

#: the child that loads a session and reports its seconds and resident memory
LOAD_CHILD = textwrap.dedent("""
    import json, resource, sys, time
    import torch
    from mtpctl.backends.torch import TorchSession
    if int(sys.argv[2]):
        torch.set_num_threads(int(sys.argv[2]))
    start_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    session = TorchSession(sys.argv[1], "bfloat16")
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "start_rss": start_rss, "held": session.model.weight_bytes}))
""")

#: the child that times verify passes of chains against a plain step
VERIFY_CHILD = textwrap.dedent("""
    import json, sys
    import torch
    sys.path.insert(0, sys.argv[6])  # benchmarks/: bench_verify's timing of a pass
    from bench_verify import time_pass
    from mtpctl.backends.torch import TorchSession
    from mtpctl.decode.tree import DraftTree
    folder, threads, context, sizes, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \\
        [int(n) for n in sys.argv[4].split(",")], int(sys.argv[5])
    if threads:
        torch.set_num_threads(threads)
    engine = TorchSession(folder, "bfloat16").new_engine(context + max(sizes) + 1)
    engine.prefill(list(range(100, 100 + context)))
    print(json.dumps({n: time_pass(engine, DraftTree.chain([5] * n), reps) for n in [1] + sizes}))
""")


def checkpoint(args, config: dict, base: Path) -> Path:
    """The synthetic checkpoint folder under ``base``: reused when its config is this shape's."""
    folder = base / f"{args.shape.stem}-seed{args.seed}-shards{args.shards}"
    config_file = folder / "config.json"
    if config_file.exists() and json.loads(config_file.read_text(encoding="utf-8")) == config:
        print(f"reusing {folder}", file=sys.stderr)
        return folder
    print(f"writing {folder} ...", file=sys.stderr)
    return write_synthetic_checkpoint(folder, config, args.shards, args.seed, resolve_model(args.tokenizer_from),
                                      overwrite=True)


def run_child(command: list) -> tuple:
    """(stdout, peak resident bytes, wall seconds) of a child process; raises on a non-zero exit."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(command, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak, not the largest child's so far
        proc.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            raise SystemExit(f"{shlex.join(command)} failed ({proc.returncode}):\n{err.read().decode()}")
        return out.read().decode(), usage.ru_maxrss * 1024, seconds


def measure_load(folder: Path, threads: int) -> dict:
    stdout, peak, _ = run_child([sys.executable, "-c", LOAD_CHILD, str(folder), str(threads)])
    return {**json.loads(stdout), "peak": peak}


def measure_generate(folder: Path, args) -> dict:
    command = [sys.executable, "-m", "mtpctl", "generate", "-m", str(folder), "--dtype", "bfloat16",
               "--max-new-tokens", str(args.max_new_tokens), "--json", args.prompt]
    if args.threads:
        command[4:4] = ["--threads", str(args.threads)]
    stdout, peak, seconds = run_child(command)
    result = json.loads(stdout)
    stats = result["stats"]
    decoded = max(1, stats["new_tokens"] - 1)
    return {"peak": peak, "seconds": seconds, "ttft_ms": stats["ttft_ms"], "new_tokens": stats["new_tokens"],
            "s_per_token": (stats["total_ms"] - stats["ttft_ms"]) / decoded / 1e3}


def measure_verify(folder: Path, args) -> dict:
    stdout, _, _ = run_child([sys.executable, "-c", VERIFY_CHILD, str(folder), str(args.threads), str(args.context),
                              args.verify_sizes, str(args.reps), str(Path(__file__).resolve().parent)])
    return {int(k): v for k, v in json.loads(stdout).items()}


def report(args, folder: Path, weights: int, load: dict, gen: dict, verify: dict) -> None:
    gib = 2 ** 30
    print(f"Checkpoint {folder}: {weights / gib:.2f} GiB of bfloat16 weights; the session holds "
          f"{load['held'] / gib:.2f} GiB\n")
    print("| run | peak RSS (GiB) | peak / weights | (peak - start) / weights | seconds | s / token |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| load | {load['peak'] / gib:.2f} | {load['peak'] / weights:.2f} | "
          f"{(load['peak'] - load['start_rss']) / weights:.2f} | {load['seconds']:.1f} | |")
    print(f"| generate {gen['new_tokens']} tokens | {gen['peak'] / gib:.2f} | {gen['peak'] / weights:.2f} | "
          f"{(gen['peak'] - load['start_rss']) / weights:.2f} | {gen['seconds']:.1f} (ttft {gen['ttft_ms'] / 1e3:.1f}) | "
          f"{gen['s_per_token']:.3f} |")
    if verify:
        plain = verify[1]
        print(f"\nVerify passes after {args.context} tokens, median of {args.reps} (ms; ratio to the plain step)\n")
        print("| plain | " + " | ".join(f"chain-{n}" for n in verify if n != 1) + " |")
        print("|---:|" + "---:|" * (len(verify) - 1))
        print(f"| {plain:.1f} | " + " | ".join(f"{t:.1f} ({t / plain:.2f}x)" for n, t in verify.items() if n != 1) + " |")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", type=Path, required=True, help="a config.json dict (benchmarks/shapes/*.json)")
    p.add_argument("--cache-dir", type=Path, default=None, help="keep (and reuse) the checkpoint here")
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer-from", default="smollm2-135m")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--prompt", default="Explain what a KV cache is.")
    p.add_argument("--threads", type=int, default=0, help="torch threads in the children (0: torch's default)")
    p.add_argument("--context", type=int, default=128, help="verify: committed tokens before the passes")
    p.add_argument("--verify-sizes", default="4,8", help="verify: chain lengths ('' skips the verify timing)")
    p.add_argument("--reps", type=int, default=5, help="verify: passes timed per size")
    args = p.parse_args(argv)
    config = json.loads(args.shape.read_text(encoding="utf-8"))
    weights = checkpoint_bytes(DecoderConfig.from_dict(config))
    base = args.cache_dir or Path(tempfile.mkdtemp(prefix="mtpctl-bench-big-"))
    try:
        folder = checkpoint(args, config, base)
        load = measure_load(folder, args.threads)
        gen = measure_generate(folder, args)
        verify = measure_verify(folder, args) if args.verify_sizes else {}
    finally:
        if args.cache_dir is None:
            shutil.rmtree(base, ignore_errors=True)
    report(args, folder, weights, load, gen, verify)


if __name__ == "__main__":
    main()
