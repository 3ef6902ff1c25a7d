"""Draft-model speculation against plain greedy decoding and against HF transformers' assisted
generation, per (target, draft) pair, in one run.

For each pair the methods are (greedy, batch 1, float32, CPU): mtpctl plain, mtpctl with the draft
model (fixed ``--draft-len`` and ``auto``; ids, an id map or the cross-tokenizer text mode, as
``mtpctl pair`` decides), HF ``generate`` and HF assisted generation with the draft as
``assistant_model`` and both tokenizers. They run interleaved on the same prompts of the built-in
set (``mtpctl.bench``'s harness and figures). The HF methods run in processes of their own
(``mtpctl.bench.peer_process``): one that crashes or hangs (transformers' assisted generation has, on
some prompts) gets a row "failed after N of M prompts" with its reason, and every other figure is still
written. Prints one markdown table per pair on stdout; HF's tau and acceptance are not observable from
outside ``generate``.

    .venv/bin/python benchmarks/bench_draft_pair.py --pairs gemma3-270m:smollm2-135m --limit 1 --threads 2
"""

from __future__ import annotations

import argparse
import sys

import torch

from mtpctl.backends.torch import TorchSession, set_threads
from mtpctl.bench.harness import load_prompts, run_interleaved, summarize
from mtpctl.bench.peer_process import start_peer
from mtpctl.bench.report import select_prompts
from mtpctl.decode.sampling import SamplingParams
from mtpctl.drafters.build import DraftOptions, build
from mtpctl.model.sources import resolve_model


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def run_pair(target_name: str, draft_name: str, prompts, args) -> str:
    greedy = SamplingParams()
    target = TorchSession(resolve_model(target_name))
    chat = target.codec.has_chat_template
    encoded = [target.encode(p.messages[-1]["content"], chat=chat) for p in prompts]
    runners = {"mtpctl plain": lambda ids: target.generate(ids, args.max_new_tokens, greedy)}
    pairing = None
    for length in (args.draft_len, None):
        drafter = build(target, "draft", DraftOptions(draft_model=draft_name, draft_len=length), greedy)
        pairing = drafter.pairing
        runners[f"mtpctl draft (k={length or 'auto'})"] = (lambda d: lambda ids: target.generate(
            ids, args.max_new_tokens, greedy, d))(drafter)
    eos = target.codec.eos_ids
    request = {"peer": "transformers", "folder": str(target.folder), "threads": torch.get_num_threads(),
               "max_new_tokens": args.max_new_tokens, "eos_ids": sorted(eos)}
    opened = []
    try:
        runners["HF generate"], _ = start_peer("HF generate", request, eos, opened)
        runners["HF assisted"], _ = start_peer(
            "HF assisted", {**request, "assistant": str(resolve_model(draft_name))}, eos, opened)
        runs = run_interleaved(runners, encoded, 1, progress=lambda line: print(
            f"{target_name}<-{draft_name}: {line}", file=sys.stderr))
    finally:
        for peer in opened:
            peer.close()
    lines = [f"target `{target_name}`, draft `{draft_name}`: {pairing.verdict}, drafting in {pairing.mode}", "",
             "| method | tokens/s | speedup vs mtpctl plain (p10-p90) | tau | acceptance | same tokens as mtpctl plain |",
             "|---|---:|---:|---:|---:|---|"]
    for name, run in runs.items():
        s = summarize(run, runs["mtpctl plain"] if name != "mtpctl plain" else None)
        if s.get("failed"):
            lines.append(f"| {name} | failed after {s['runs']} of {len(encoded)} prompts: {s['failed']} "
                         "| - | - | - | - |")
            continue
        speed = "1.00 (baseline)" if name == "mtpctl plain" else \
            f"{s['speedup']:.2f} ({s['speedup_p10']:.2f}-{s['speedup_p90']:.2f})"
        same = "-" if name == "mtpctl plain" else f"{s['same_as_plain']}/{s['runs']}"
        lines.append(f"| {name} | {s['tokens_per_s']:.1f} | {speed} | {_fmt(s['tau'], '.2f')} "
                     f"| {_fmt(s['acceptance_rate'], '.2f')} | {same} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", default="gemma3-270m:smollm2-135m,smollm2-135m:gemma3-270m",
                        help="comma-separated TARGET:DRAFT pairs")
    parser.add_argument("--limit", type=int, default=1, help="prompts per category of the built-in set")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--draft-len", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    set_threads(args.threads)
    prompts = select_prompts(load_prompts(), None, args.limit)
    print(f"{len(prompts)} prompts of the built-in set (the last user turn; the target's chat template when it has one), "
          f"up to {args.max_new_tokens} new tokens, greedy, float32, batch 1; one interleaved run per pair.\n")
    for pair in args.pairs.split(","):
        target_name, draft_name = pair.split(":")
        print(run_pair(target_name, draft_name, prompts, args) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
