"""MTP heads vs plain greedy decoding of the same runtime, per numeric mode, in one process.

For each mode (float32, dense bfloat16, bfloat16 with int4 weights) it loads the target and the
heads, then runs plain decoding and heads decoding (for each tree size) interleaved on the same
prompts of the built-in benchmark set (none of which the heads were trained on), and reports tokens/s,
the paired speedup (median over prompts of plain's time per token over the method's), tau (mean
accepted length, bonus token counted), the acceptance rate by tree depth, and whether the output is
token for token plain greedy's. With ``--write FILE`` the section between the ``bench_heads`` markers
of FILE is replaced.

    python benchmarks/bench_heads.py --heads heads/smollm2-medusa --limit 2 --write BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
from sections import write_section

from mtpctl.model.sources import resolve_model
from mtpctl.errors import MtpctlError
from mtpctl.runtime.bench import cpu_model, load_prompts, run_interleaved, summarize
from mtpctl.runtime.drafters import MergedDrafter, NgramDrafter
from mtpctl.runtime.heads import HeadsConfig
from mtpctl.runtime.retrieval import DATASTORE_FILE, Datastore, RetrievalDrafter
from mtpctl.decode.sampling import SamplingParams
from mtpctl.runtime.session import Session

#: how each head kind's section of BENCHMARKS.md is made: the add-heads arguments, the section markers
RECIPES = {"medusa": "--recipe recipes/smollm2-135m-medusa.yaml",
           "hydra": "--recipe recipes/smollm2-135m-medusa.yaml --kind hydra",
           "eagle": "--recipe recipes/smollm2-135m-eagle.yaml"}


def markers(kind: str) -> tuple:
    """(begin, end) markers of a head kind's section (Medusa keeps the original unnamed ones)."""
    name = "bench_heads" if kind == "medusa" else f"bench_heads_{kind}"
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
MODES = {"float32": ("float32", "dense"), "bfloat16": ("bfloat16", "dense"), "int4": ("bfloat16", "int4")}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--heads", required=True, help="head folder from mtpctl add-heads")
    p.add_argument("--model", default="smollm2-135m", help="target: alias, folder or .gguf (as mtpctl --model)")
    p.add_argument("--modes", default="float32,bfloat16,int4", help=f"numeric modes to run, from {','.join(MODES)}")
    p.add_argument("--trees", default="4,8,16", help="tree sizes (nodes) to try in every mode")
    p.add_argument("--limit", type=int, default=2, help="prompts per category of the built-in set")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt")
    p.add_argument("--ngram", type=lengths, default="0",
                   help="also run n-gram drafting alone and merged with each heads tree, this many tokens; "
                        "a comma list (3,4) A/Bs several lengths in one run (0 = off)")
    p.add_argument("--retrieval", type=int, default=0,
                   help="also merge a retrieval tree of this many nodes (the heads' datastore) into each "
                        "heads+ngram tree (0 = off; needs --ngram)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (None: torch's own)")
    p.add_argument("--write", type=Path, default=None, help="replace the bench_heads section of this file")
    args = p.parse_args(argv)
    if args.retrieval and not args.ngram:
        p.error("--retrieval merges into the heads+ngram trees: give --ngram too")
    return args


def lengths(text: str) -> list:
    """``--ngram`` values: "3,4" -> [3, 4]; "0" -> [] (off)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected lengths like 3 or 3,4, got {text!r}") from e
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"lengths must not be negative, got {text!r}")
    return sorted({v for v in values if v > 0})


def run_mode(folder, heads_dir, mode, trees, prompts, max_new, ngrams=(), retrieval=0):
    dtype, weights = MODES[mode]
    session = Session(folder, dtype, weights)
    heads = session.load_heads(heads_dir)
    ids = [session.codec.encode_messages(list(p.messages)) for p in prompts]
    store = Datastore.load(Path(heads_dir) / DATASTORE_FILE, session.vocab_size) if retrieval else None
    greedy = SamplingParams()
    methods = {"plain": lambda x: session.generate(x, max_new, greedy)}
    for ngram in ngrams:
        methods[f"ngram-{ngram}"] = (lambda k: lambda x: session.generate(x, max_new, greedy, NgramDrafter(), k))(ngram)
    for n in trees:
        drafter = session.heads_drafter(heads, tree_nodes=n)
        methods[f"heads-{n}"] = (lambda d: lambda x: session.generate(x, max_new, greedy, d, len(d.tree.paths),
                                                                       heads=heads))(drafter)
        for ngram in ngrams:
            merged = MergedDrafter([(drafter, n), (NgramDrafter(), ngram)])
            methods[f"heads-{n}+ngram-{ngram}"] = (lambda d, k: lambda x: session.generate(
                x, max_new, greedy, d, k, heads=heads))(merged, n + ngram)
            if retrieval:
                merged = MergedDrafter([(drafter, n), (NgramDrafter(), ngram), (RetrievalDrafter(store), retrieval)])
                methods[f"heads-{n}+ngram-{ngram}+retrieval-{retrieval}"] = (lambda d, k: lambda x: session.generate(
                    x, max_new, greedy, d, k, heads=heads))(merged, n + ngram + retrieval)
    runs = run_interleaved(methods, ids, 1, progress=lambda line: print(f"{mode}: {line}", file=sys.stderr))
    plain = runs["plain"]
    rows = []
    for name, r in runs.items():
        s = summarize(r, plain if name != "plain" else None)
        same = sum(a.token_ids == b.token_ids for a, b in zip(r.results, plain.results))
        rows.append({"mode": mode, "method": name, "tokens_per_s": s["tokens_per_s"], "speedup": s.get("speedup"),
                     "speedup_p10": s.get("speedup_p10"), "speedup_p90": s.get("speedup_p90"), "tau": s["tau"],
                     "acceptance_by_position": s["acceptance_by_position"], "same_as_plain": same,
                     "prompts": len(ids)})
    return rows


def render(rows, args, cfg: HeadsConfig, seconds: float) -> str:
    t = cfg.training
    ngram = f" --ngram {','.join(map(str, args.ngram))}" if args.ngram else ""
    ngram += f" --retrieval {args.retrieval}" if args.retrieval else ""
    threads = f" --threads {args.threads}" if args.threads else ""
    begin, end = markers(cfg.kind)
    title = "MTP heads (self-distilled)" if cfg.kind == "medusa" else f"{cfg.kind} heads (self-distilled)"
    lines = [begin, f"## {title} vs plain greedy of the same runtime", "",
             f"Command: `.venv/bin/python benchmarks/bench_heads.py --heads HEADS --modes {args.modes} "
             f"--trees {args.trees}{ngram} --limit {args.limit} --max-new-tokens {args.max_new_tokens}{threads}` "
             f"(`--write {args.write.name if args.write else 'FILE'}` replaces this section), where HEADS is "
             f"the output of `.venv/bin/mtpctl add-heads {RECIPES[cfg.kind]} --out HEADS`.",
             "",
             f"Machine: {cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
             f"Python {platform.python_version()}; {rows[0]['prompts']} prompts of the built-in set "
             f"({args.limit} per category; the heads never saw them), greedy, {args.max_new_tokens} new tokens; "
             f"one interleaved run per mode, {seconds / 60:.1f} min in all.", "",
             (f"Heads: one EAGLE layer, {cfg.num_heads} draft steps unrolled in training"
              if cfg.kind == "eagle" else
              f"Heads: {cfg.num_heads} x {cfg.kind}, {cfg.head_layers} block(s), token-conditioned: "
              f"{cfg.token_conditioned}") +
             f", draft vocabulary {cfg.draft_vocab_size or 'full'}; trained on "
             f"{t.get('positions')} positions; held-out top-1 per head (per draft step, given the earlier "
             f"ones right, for hydra and eagle) {t.get('held_out_top1')} (held-out "
             "sequences of the recipe's own prompt set); recipe wall time "
             f"{t.get('timings_s', {}).get('total_s', '?')} s (features and training; self-distillation included "
             "when not cached).", "",
             "| mode | method | tokens/s | speedup vs plain (p10-p90) | tau | acceptance by depth | same tokens as plain |",
             "|---|---|---:|---:|---:|---|---|"]
    for r in rows:
        speed = "1.00x" if r["speedup"] is None else f"{r['speedup']:.2f}x ({r['speedup_p10']:.2f}-{r['speedup_p90']:.2f})"
        acc = ", ".join(f"{a:.2f}" for a in r["acceptance_by_position"]) or "-"
        lines.append(f"| {r['mode']} | {r['method']} | {r['tokens_per_s']:.1f} | {speed} | {r['tau']:.2f} | {acc} | "
                     f"{r['same_as_plain']}/{r['prompts']} |")
    lines += ["", "- heads-N: a static tree of N nodes grown from the heads' held-out top-k accuracy "
              "(`--tree-nodes N`). ngram-K: prompt lookup of up to K tokens. heads-N+ngram-K: the two merged "
              "into one draft tree (`mtpctl generate --speculate heads+ngram --draft-len K`); +retrieval-R: a "
              "retrieval tree of R nodes (REST) from the datastore the heads carry, the target's own "
              "self-distilled text, merged in too (`--speculate heads+ngram+retrieval --retrieval-nodes R`). tau counts the "
              "bonus token, so plain decoding has tau = 1. Speedup: the median over prompts of plain's time "
              "per token over the method's (p10-p90 in brackets). Acceptance by depth d: steps that accepted "
              "a draft token at depth d / steps whose draft reached depth d.",
              "- Every kernel on the path is batch-invariant (int4; dense bfloat16 and float32 weights in "
              "oneDNN's blocked layout), so the heads' output must equal plain greedy exactly.", end]
    return "\n".join(lines)



def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except MtpctlError as e:  # a missing model or head folder: one line, as the CLI gives it
        print(f"bench_heads.py: error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


def run(args) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = resolve_model(args.model)
    prompts = []
    for p in load_prompts():
        if sum(q.category == p.category for q in prompts) < args.limit:
            prompts.append(p)
    trees = [int(n) for n in args.trees.split(",")]
    start = time.perf_counter()
    rows = []
    for mode in args.modes.split(","):
        rows += run_mode(folder, args.heads, mode, trees, prompts, args.max_new_tokens, args.ngram, args.retrieval)
    cfg = HeadsConfig.load(args.heads)
    text = render(rows, args, cfg, time.perf_counter() - start)
    print(json.dumps(rows, indent=1))
    if args.write:
        write_section(args.write, text, *markers(cfg.kind))


if __name__ == "__main__":
    sys.exit(main())
