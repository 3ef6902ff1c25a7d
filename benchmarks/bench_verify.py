"""What one verify pass of the torch engine costs, by numeric mode and draft shape.

Times ``TorchEngine.verify`` (the forward pass only: no logits, no drafting) after a prefill of
``--context`` tokens, for a plain one-token step, chains of N tokens and trees of N nodes (a root with a
depth-2 spine and leaves), and prints a Markdown table of milliseconds per pass (median of ``--reps``)
and the ratio to the plain step. A verify pass of N tokens costing r times a plain step pays off only
when a step commits more than r tokens on average. ``--kernels default,blocked`` also times the dense
modes with torch's default linear kernel (a Decoder loaded as plain Parameters) beside a TorchSession's
decoding layout (bfloat16: the native kernels' tiles, labelled "tiles"; float32: oneDNN's blocked
layout, "blocked"), rows of the two alternating pass by pass. ``--attention torch,native`` likewise times
torch's batch-invariant attention ops against the native kernels (``mtpctl.model.native``), and
``--int4-kernels torch,native`` torch's int4 matmul against the native one (csrc/int4_matmul.c).

    python benchmarks/bench_verify.py --modes bfloat16,int4 --context 200
    python benchmarks/bench_verify.py --modes float32,bfloat16 --kernels default,blocked --sizes 8,16
    python benchmarks/bench_verify.py --modes bfloat16,float32 --attention torch,native --sizes 8,16
    python benchmarks/bench_verify.py --modes int4 --int4-kernels torch,native --sizes 4,8
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mtpctl.backends.torch import TorchEngine, TorchSession
from mtpctl.decode.tree import DraftTree
from mtpctl.model.decoder import DTYPES, Decoder
from mtpctl.model.sources import resolve_model

MODES = {"float32": ("float32", "dense"), "bfloat16": ("bfloat16", "dense"), "int4": ("bfloat16", "int4")}


def tree_parents(n: int) -> list:
    """A root, a spine of depth 2 under its first child, and the rest as the root's children."""
    return [-1, 0, 1][:n] + [0] * max(0, n - 3)


def time_pass(engine: TorchEngine, tree: DraftTree, reps: int) -> float:
    engine.verify(tree)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        engine.verify(tree)
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
    p.add_argument("--kernels", default="blocked",
                   help="dense modes: blocked (a TorchSession's layout: bfloat16 tiles, float32 oneDNN's blocked "
                        "layout), default (torch's kernel) or both")
    p.add_argument("--int4-kernels", default="native",
                   help="int4 mode: native (csrc/int4_matmul.c, where it builds), torch (torch's int4 kernel) or both")
    p.add_argument("--attention", default="native",
                   help="native (the C kernel, where it builds), torch (torch's ops) or both")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = resolve_model(args.model)
    sizes = [int(n) for n in args.sizes.split(",")]
    print(f"Context {args.context} tokens, {torch.get_num_threads()} threads, median of {args.reps} passes (ms; "
          "ratio to the plain step)\n")
    print("| mode | kernel | attention | plain | " + " | ".join(f"chain-{n}" for n in sizes) + " | "
          + " | ".join(f"tree-{n}" for n in sizes) + " |")
    print("|---|---|---|---:|" + "---:|" * (2 * len(sizes)))
    shapes = [("plain", 1)] + [(shape, n) for shape in ("chain", "tree") for n in sizes]
    for mode in args.modes.split(","):
        kernels = [f"int4-{k}" for k in args.int4_kernels.split(",")] if mode == "int4" else args.kernels.split(",")
        engines = {}
        labels = {}
        for kernel in kernels:
            if kernel == "default":
                model = Decoder.from_folder(folder, DTYPES[MODES[mode][0]])
            elif kernel == "int4-torch":
                model = Decoder.from_folder(folder, torch.bfloat16, packed=True, blocked=True, native_int4=False)
            else:
                model = TorchSession(folder, *MODES[mode]).model
            labels[kernel] = {"TiledLinear": "tiles"}.get(type(model.layers[0].qkv).__name__, kernel)
            for attention in args.attention.split(","):
                engine = TorchEngine(model, args.context + max(sizes) + 1, native=attention == "native")
                engine.prefill(list(range(100, 100 + args.context)))
                engines[kernel, attention] = engine
        times = {(k, shape, n): [] for k in engines for shape, n in shapes}
        for _ in range(args.reps):  # alternate the kernels pass by pass: load changes hit both alike
            for shape, n in shapes:
                for kernel, engine in engines.items():
                    tree = DraftTree.from_parents([5] * n, tree_parents(n)) if shape == "tree" else DraftTree.chain([5] * n)
                    times[kernel, shape, n].append(time_pass(engine, tree, 1))
        for kernel in engines:
            plain = statistics.median(times[kernel, "plain", 1])
            cells = [f"{plain:.1f}"] + [f"{statistics.median(times[kernel, shape, n]):.1f} "
                                        f"({statistics.median(times[kernel, shape, n]) / plain:.2f}x)"
                                        for shape, n in shapes[1:]]
            print(f"| {mode} | {labels[kernel[0]]} | {kernel[1]} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
