"""Greedy decoding on the onnxruntime backend against the torch backend, in one run.

Exports the model (and, with ``--heads``, its Medusa heads fused into the graph) to a temporary
folder, then runs plain decoding, prompt lookup and (with heads) the heads drafter on both backends,
interleaved on the same prompts of the built-in set (float32, batch 1; ``mtpctl.bench``'s harness and
figures). Prints one markdown table on stdout; every method's output is compared with torch plain's.

    .venv/bin/python benchmarks/bench_backends.py --heads heads/smollm2-medusa --limit 1 --threads 2
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from mtpctl.backends.onnxruntime import OrtSession
from mtpctl.backends.torch import TorchSession, set_threads
from mtpctl.bench.harness import load_prompts, run_interleaved, summarize
from mtpctl.bench.report import select_prompts
from mtpctl.decode.sampling import SamplingParams
from mtpctl.drafters.build import DraftOptions, build
from mtpctl.export.onnx import export_onnx
from mtpctl.model.sources import resolve_model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--heads", default=None, help="MTP head folder (mtpctl add-heads) for the heads rows")
    parser.add_argument("--limit", type=int, default=1, help="prompts per category of the built-in set")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--draft-len", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch and onnxruntime alike")
    args = parser.parse_args(argv)
    set_threads(args.threads)
    folder = resolve_model(args.model)
    prompts = select_prompts(load_prompts(), None, args.limit)
    greedy = SamplingParams()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "onnx"
        print(f"exporting {folder} to {out}", file=sys.stderr)
        export_onnx(folder, out, Path(args.heads) if args.heads else None)
        sessions = {"torch": TorchSession(folder), "ort": OrtSession(out, args.threads)}
        encoded = [sessions["torch"].codec.encode_messages(list(p.messages)) for p in prompts]
        specs = {"plain": ("none", DraftOptions()), "ngram": ("ngram", DraftOptions(draft_len=args.draft_len))}
        if args.heads:  # the torch heads from the folder, the ort heads from the graph (the same weights)
            specs["heads"] = ("heads", DraftOptions(heads_dir=args.heads))
        runners = {}
        for backend, session in sessions.items():
            for name, (spec, opts) in specs.items():
                drafter = build(session, spec, opts, greedy)
                runners[f"{backend}-{name}"] = (lambda s, d: lambda ids: s.generate(ids, args.max_new_tokens, greedy, d))(
                    session, drafter)
        runs = run_interleaved(runners, encoded, 1, progress=lambda line: print(line, file=sys.stderr))
    print(f"{args.model}, float32, greedy, batch 1, {len(prompts)} prompts of the built-in set, {args.max_new_tokens} new "
          f"tokens, prompt lookup of {args.draft_len} tokens, threads {args.threads or 'the libraries defaults'}; "
          "one run, methods interleaved per prompt.\n")
    print("| method | tokens/s | speedup vs torch-plain (p10-p90) | tau | same tokens as torch-plain |")
    print("|---|---:|---:|---:|---|")
    for name, run in runs.items():
        s = summarize(run, runs["torch-plain"] if name != "torch-plain" else None)
        speed = "1.00 (baseline)" if name == "torch-plain" else f"{s['speedup']:.2f} ({s['speedup_p10']:.2f}-{s['speedup_p90']:.2f})"
        same = "-" if name == "torch-plain" else f"{s['same_as_plain']}/{s['runs']}"
        print(f"| {name} | {s['tokens_per_s']:.1f} | {speed} | {s['tau']:.2f} | {same} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
