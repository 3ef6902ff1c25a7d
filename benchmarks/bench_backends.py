"""Greedy decoding speed of the onnxruntime backend against the torch backend (eager), in one run.

Methods (greedy, batch 1, float32, CPU), each run on every prompt, interleaved per prompt with the
order rotated (:func:`mtpctl.runtime.bench.run_interleaved`), one warm-up run each:

* ``torch-plain`` / ``torch-ngram``: the native runtime (``--backend torch``);
* ``ort-plain`` / ``ort-ngram``: the exported fused graph on onnxruntime (``--backend onnxruntime``);
* with ``--heads DIR``: ``torch-heads`` / ``ort-heads``, the Medusa tree drafter (the heads fused
  into the graph for onnxruntime).

Tokens/s is total new tokens over total wall time per method, prefill included. Every method's
output is compared with ``torch-plain``'s (greedy speculation is lossless).

Usage::

    python benchmarks/bench_backends.py [--model smollm2-135m] [--heads DIR] [--limit 4]
        [--max-new-tokens 64] [--threads N] [--write BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
from pathlib import Path

from sections import write_section

from mtpctl.convert.onnx_export import export_onnx
from mtpctl.model.sources import resolve_model
from mtpctl.runtime.bench import cpu_model, load_prompts, run_interleaved
from mtpctl.runtime.drafters import NgramDrafter
from mtpctl.runtime.ort_engine import OrtSession
from mtpctl.decode.sampling import SamplingParams
from mtpctl.runtime.session import Session, set_threads

BEGIN, END = "<!-- bench_backends:begin -->", "<!-- bench_backends:end -->"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--heads", default=None, help="MTP head folder (mtpctl add-heads) for the heads rows")
    parser.add_argument("--limit", type=int, default=4, help="prompts (one per category, built-in set)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--draft-len", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch and onnxruntime alike")
    parser.add_argument("--write", default=None, help="put the report in this markdown file")
    args = parser.parse_args()
    folder = resolve_model(args.model)
    prompts, seen = [], set()
    for p in load_prompts():  # one prompt per category, in file order
        if p.category not in seen:
            seen.add(p.category)
            prompts.append(p)
    prompts = prompts[:args.limit]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "onnx"
        print(f"exporting {folder} to {out}", file=sys.stderr)
        export_onnx(folder, out, Path(args.heads) if args.heads else None)
        if args.threads:
            set_threads(args.threads)
        torch_s, ort_s = Session(folder), OrtSession(out, args.threads)
        encoded = [torch_s.codec.encode_messages(list(p.messages)) for p in prompts]
        greedy = SamplingParams(0.0)

        def method(session, drafter, k, heads=None):
            if heads is None:
                return lambda ids: session.generate(ids, args.max_new_tokens, greedy, drafter, k)
            return lambda ids: session.generate(ids, args.max_new_tokens, greedy, drafter, k, (), None, heads)

        methods = {"torch-plain": method(torch_s, None, 0), "ort-plain": method(ort_s, None, 0),
                   "torch-ngram": method(torch_s, NgramDrafter(), args.draft_len),
                   "ort-ngram": method(ort_s, NgramDrafter(), args.draft_len)}
        if args.heads:
            for name, session in (("torch-heads", torch_s), ("ort-heads", ort_s)):
                heads = session.load_heads(Path(args.heads))
                drafter = session.heads_drafter(heads)
                methods[name] = method(session, drafter, len(drafter.tree.paths), heads)
        runs = run_interleaved(methods, encoded, 1, progress=lambda line: print(line, file=sys.stderr))
    reference = [r.token_ids for r in runs["torch-plain"].results]
    lines = [BEGIN, "## onnxruntime backend vs torch (eager)", "",
             f"Command: `python benchmarks/{Path(__file__).name} {shlex.join(sys.argv[1:])}`", "",
             f"Model {args.model}, float32, greedy, batch 1, {len(prompts)} prompts (one per category of the "
             f"built-in set), {args.max_new_tokens} new tokens, n-gram draft length {args.draft_len}; "
             f"CPU: {cpu_model()}, threads: {args.threads or 'library defaults'}; one run, methods interleaved per prompt; tokens/s = new tokens / wall time "
             "(prefill included). `same output` compares each method with torch-plain token for token.", "",
             "| method | tokens/s | vs torch-plain | tau | same output |", "|---|---:|---:|---:|---|"]
    base = None
    for name, run in runs.items():
        new = sum(r.stats.new_tokens for r in run.results)
        secs = sum(r.stats.total_ms for r in run.results) / 1e3
        tps = new / secs
        base = base or tps
        steps = sum(r.stats.decode_steps for r in run.results)
        tau = sum(sum(r.stats.accepted_per_step) for r in run.results) / steps if steps else float("nan")
        same = sum(r.token_ids == ref for r, ref in zip(run.results, reference))
        lines.append(f"| {name} | {tps:.1f} | {tps / base:.2f}x | {tau:.2f} | {same}/{len(run.results)} |")
    lines.append(END)
    report = "\n".join(lines) + "\n"
    print(report)
    if args.write:
        write_section(Path(args.write), report.rstrip("\n"), BEGIN, END)


if __name__ == "__main__":
    main()
