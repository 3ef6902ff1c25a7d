"""MTP heads against plain greedy decoding of the same runtime, per numeric mode and draft-tree size,
in one process.

For each mode (float32, dense bfloat16, bfloat16 with int4 weights) it loads the target and the
heads once, then runs plain decoding, the heads with each tree size, and (with ``--ngram``) prompt
lookup alone and merged with each tree (``--retrieval``: and a retrieval tree of the heads'
datastore; ``--dynamic``: EAGLE-2's dynamic tree of each size beside the static one, EAGLE heads
only), interleaved on the same prompts of the built-in set (none of which the heads were trained
on), with ``mtpctl.bench``'s harness and figures. Prints one markdown table on stdout:
tokens/s, the paired speedup over plain (median over prompts, p10-p90), tau, acceptance by depth and
whether the output is plain greedy's, token for token.

    .venv/bin/python benchmarks/bench_heads.py --heads heads/smollm2-medusa --modes bfloat16,int4 --trees 2,4,8 --limit 2
"""

from __future__ import annotations

import argparse
import sys

import torch

from mtpctl.backends.torch import TorchSession, set_threads
from mtpctl.bench.harness import load_prompts, run_interleaved, summarize
from mtpctl.bench.report import select_prompts
from mtpctl.decode.sampling import SamplingParams
from mtpctl.drafters.build import DraftOptions, build, load_parts
from mtpctl.errors import MtpctlError
from mtpctl.model.sources import resolve_model

MODES = {"float32": ("float32", "dense"), "bfloat16": ("bfloat16", "dense"), "int4": ("bfloat16", "int4")}


def lengths(text: str) -> list:
    """``3,4`` -> [3, 4]; ``0`` -> [] (off)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected numbers like 3 or 3,4, got {text!r}") from e
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"numbers must not be negative, got {text!r}")
    return sorted({v for v in values if v > 0})


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--heads", required=True, help="head folder from mtpctl add-heads")
    p.add_argument("--model", default="smollm2-135m", help="target: alias, folder or .gguf (as mtpctl --model)")
    p.add_argument("--modes", default="float32,bfloat16,int4", help=f"numeric modes, from {','.join(MODES)}")
    p.add_argument("--trees", type=lengths, default="4,8,16", help="tree sizes (nodes) to try in every mode")
    p.add_argument("--limit", type=int, default=2, help="prompts per category of the built-in set")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt")
    p.add_argument("--ngram", type=lengths, default="0",
                   help="also run prompt lookup of this many tokens alone and merged with each tree; a list (3,4) "
                        "A/Bs several lengths in one run (0 = off)")
    p.add_argument("--retrieval", type=int, default=0,
                   help="also merge a retrieval tree of this many nodes (the heads' datastore) into each heads+ngram "
                        "tree (0 = off; needs --ngram)")
    p.add_argument("--dynamic", action="store_true",
                   help="also run EAGLE-2's dynamic tree of each size (EAGLE and EAGLE-3 heads), beside the static one")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (None: torch's default)")
    args = p.parse_args(argv)
    if args.retrieval and not args.ngram:
        p.error("--retrieval merges into the heads+ngram trees: give --ngram too")
    unknown = [m for m in args.modes.split(",") if m not in MODES]
    if unknown:
        p.error(f"unknown mode(s) {unknown}: choose from {', '.join(MODES)}")
    return args


def methods_of(session, args):
    """Method name -> (spec, drafter settings) of one mode's run."""
    out = {"plain": ("none", DraftOptions())}
    for k in args.ngram:
        out[f"ngram-{k}"] = ("ngram", DraftOptions(draft_len=k))
    for n in args.trees:
        for dynamic in (False, True) if args.dynamic else (False,):
            tree = f"{n}-dynamic" if dynamic else f"{n}"
            out[f"heads-{tree}"] = ("heads", DraftOptions(heads_dir=args.heads, tree_nodes=n, dynamic_tree=dynamic))
            for k in args.ngram:
                out[f"heads-{tree}+ngram-{k}"] = ("heads+ngram", DraftOptions(heads_dir=args.heads, tree_nodes=n,
                                                                               draft_len=k, dynamic_tree=dynamic))
        for k in args.ngram:
            if args.retrieval:
                out[f"heads-{n}+ngram-{k}+retrieval-{args.retrieval}"] = (
                    "heads+ngram+retrieval", DraftOptions(heads_dir=args.heads, tree_nodes=n, draft_len=k,
                                                          retrieval_nodes=args.retrieval))
    return out


def run_mode(folder, mode, args, prompts):
    dtype, weights = MODES[mode]
    session = TorchSession(folder, dtype, weights)
    ids = [session.codec.encode_messages(list(p.messages)) for p in prompts]
    needs = ("heads", "retrieval") if args.retrieval else ("heads",)
    shared = load_parts(session, needs, DraftOptions(heads_dir=args.heads))  # heads and datastore loaded once
    greedy = SamplingParams()
    runners = {}
    for name, (spec, opts) in methods_of(session, args).items():
        drafter = build(session, spec, opts, greedy, shared)
        runners[name] = (lambda d: lambda x: session.generate(x, args.max_new_tokens, greedy, d))(drafter)
    runs = run_interleaved(runners, ids, 1, progress=lambda line: print(f"{mode}: {line}", file=sys.stderr))
    return [(mode, name, summarize(r, runs["plain"] if name != "plain" else None)) for name, r in runs.items()]


def table(rows) -> str:
    lines = ["| mode | method | tokens/s | speedup vs plain (p10-p90) | tau | acceptance by depth | same tokens as plain |",
             "|---|---|---:|---:|---:|---|---|"]
    for mode, name, s in rows:
        speed = "1.00 (baseline)" if name == "plain" else f"{s['speedup']:.2f} ({s['speedup_p10']:.2f}-{s['speedup_p90']:.2f})"
        acc = ", ".join(f"{a:.2f}" for a in s["acceptance_by_position"]) or "-"
        same = "-" if name == "plain" else f"{s['same_as_plain']}/{s['runs']}"
        lines.append(f"| {mode} | {name} | {s['tokens_per_s']:.1f} | {speed} | {s['tau']:.2f} | {acc} | {same} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    set_threads(args.threads)
    try:
        folder = resolve_model(args.model)
        prompts = select_prompts(load_prompts(), None, args.limit)
        rows = [row for mode in args.modes.split(",") for row in run_mode(folder, mode, args, prompts)]
    except MtpctlError as e:  # a missing model or head folder: one line, as the CLI gives it
        print(f"bench_heads.py: error: {e}", file=sys.stderr)
        return e.exit_code
    print(f"{len(prompts)} prompts of the built-in set ({args.limit} per category), greedy, {args.max_new_tokens} "
          f"new tokens, {torch.get_num_threads()} threads; one interleaved run per mode.\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
