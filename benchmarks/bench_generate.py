"""Greedy decoding speed of mtpctl against HF transformers, on the same prompts, in one run.

Methods (all greedy, batch 1, CPU):

* ``hf``         -- transformers ``model.generate(do_sample=False)``, float32 (the reference);
* ``hf-pld``     -- the same with prompt lookup (``prompt_lookup_num_tokens=K``), float32;
* ``plain``      -- mtpctl's runtime without speculation, per dtype;
* ``ngram``      -- mtpctl's runtime with n-gram (prompt lookup) speculation, per dtype.

Every method runs every prompt; the methods are interleaved per prompt (their order rotated from
prompt to prompt) so that drift of the machine affects all of them alike. One warm-up generation per
method comes first. Tokens/s is total new tokens over total wall time per method, prefill included.
The CPU time other processes use during each generation is measured (/proc/stat); a generation that
shared the CPU with them is repeated once the CPU is quiet again (``--quiet-threshold``, ``--retries``).

Usage::

    python benchmarks/bench_generate.py [--model smollm2-135m] [--max-new-tokens 128]
        [--draft-len 3] [--dtypes float32,bfloat16[,bfloat16-int4]] [--prompts benchmarks/prompts.jsonl]
        [--limit N] [--threads N] [--quiet-threshold CORES] [--retries N]
        [--save-runs FILE] [--write BENCHMARKS.md]

Progress goes to stderr, the markdown report to stdout; ``--write FILE`` also puts the report in
FILE between the ``bench_generate`` markers (replacing the old section, or appended).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch

from mtpctl.runtime.bench import cpu_model

HERE = Path(__file__).resolve().parent
START_MARK = "<!-- bench_generate:start -->"
END_MARK = "<!-- bench_generate:end -->"
WARMUP_TOKENS = 32


# ----------------------------------------------------------------------------- data


@dataclass
class Run:
    """One generation of one method on one prompt."""

    tokens: List[int]  # new token ids, the EOS that ended the output included
    seconds: float  # wall time of the generate call
    steps: Optional[int] = None  # target forward passes that committed tokens after the prefill
    committed: Optional[int] = None  # tokens committed by those steps
    drafted: Optional[int] = None  # draft tokens verified
    accepted: Optional[int] = None  # draft tokens accepted
    other_cpu: Optional[float] = None  # cores used by other processes during the run
    attempts: int = 1  # runs made (contended ones are repeated)


@dataclass
class Method:
    """A way to generate: ``run(prompt_ids, max_new_tokens) -> Run``."""

    key: str  # unique id, e.g. "ngram/bfloat16"
    label: str  # row label in the table
    dtype: str
    run: Callable[[Sequence[int], int], Run]
    speculative: bool = False
    runs: List[Run] = field(default_factory=list)


@dataclass
class Prompt:
    """A benchmark prompt: its category, text, and token ids (chat template applied)."""

    category: str
    text: str
    ids: List[int] = field(default_factory=list)


def load_prompts(path: Path, limit: Optional[int]) -> List[Prompt]:
    """The ``{"category", "prompt"}`` records of a JSONL file, the first ``limit`` of them."""
    prompts = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            record = json.loads(line)
            prompts.append(Prompt(record["category"], record["prompt"]))
    return prompts[:limit] if limit else prompts


# ----------------------------------------------------------------------------- methods


def mtpctl_method(session, dtype: str, draft_len: int, speculative: bool) -> Method:
    """mtpctl greedy decoding, plain or with the n-gram drafter."""
    from mtpctl.runtime.drafters import NgramDrafter
    from mtpctl.decode.sampling import SamplingParams

    def run(ids: Sequence[int], max_new: int) -> Run:
        drafter = NgramDrafter() if speculative else None  # the CLI's defaults (n-grams 3..2)
        start = time.perf_counter()
        r = session.generate(ids, max_new, SamplingParams(), drafter=drafter,
                             draft_len=draft_len if speculative else 0)
        seconds = time.perf_counter() - start
        st = r.stats
        return Run(list(r.token_ids), seconds, st.decode_steps, sum(st.accepted_per_step),
                   st.draft_tokens, st.accepted_tokens)

    name = "ngram" if speculative else "plain"
    label = f"mtpctl + n-gram (k={draft_len})" if speculative else "mtpctl plain"
    return Method(f"{name}/{dtype}", label, dtype, run, speculative)


class LookupCounter:
    """Counts the verify steps and draft tokens of HF prompt lookup decoding.

    Wraps ``PromptLookupCandidateGenerator.get_candidates`` (called once per target forward pass
    of assisted decoding); the benchmark only reads the counts, generation is unchanged.
    """

    def __init__(self):
        from transformers.generation.candidate_generator import (
            PromptLookupCandidateGenerator,
        )

        self.steps = self.drafted = 0
        original = PromptLookupCandidateGenerator.get_candidates
        counter = self

        def counted(generator, input_ids, *args, **kwargs):
            candidates, logits = original(generator, input_ids, *args, **kwargs)
            counter.steps += 1
            counter.drafted += candidates.shape[1] - input_ids.shape[1]
            return candidates, logits

        PromptLookupCandidateGenerator.get_candidates = counted

    def reset(self) -> None:
        self.steps = self.drafted = 0


def trim_at_eos(tokens: List[int], eos_ids) -> List[int]:
    """``tokens`` up to and including the first EOS (HF may keep accepted tokens past it)."""
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[:i + 1]
    return tokens


def hf_method(model, eos_ids, lookup: int, counter: Optional[LookupCounter]) -> Method:
    """HF transformers greedy ``generate``; prompt lookup when ``lookup`` > 0 (needs ``counter``)."""
    eos = sorted(eos_ids)

    def run(ids: Sequence[int], max_new: int) -> Run:
        input_ids = torch.tensor([list(ids)], dtype=torch.long)
        kwargs = dict(do_sample=False, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=eos[0],
                      attention_mask=torch.ones_like(input_ids))
        if lookup:
            kwargs["prompt_lookup_num_tokens"] = lookup
            counter.reset()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids, **kwargs)
        seconds = time.perf_counter() - start
        tokens = trim_at_eos(out[0, input_ids.shape[1]:].tolist(), eos_ids)
        if not lookup:
            return Run(tokens, seconds)
        # HF's first forward pass both prefills and verifies; every pass commits accepted + 1
        steps = counter.steps
        return Run(tokens, seconds, steps, len(tokens), counter.drafted, max(0, len(tokens) - steps))

    if lookup:
        return Method("hf-pld/float32", f"HF generate + prompt lookup (K={lookup})", "float32", run, True)
    return Method("hf/float32", "HF generate (reference)", "float32", run)


def build_methods(folder: Path, dtypes: Sequence[str], draft_len: int):
    """The tokenizer (of the mtpctl sessions), all methods (HF first, then mtpctl per dtype) and the
    HF float32 model."""
    from transformers import AutoModelForCausalLM

    from mtpctl.runtime.session import Session

    sessions = {}
    for variant in dtypes:  # "float32", "bfloat16" or "bfloat16-int4" (int4-packed GGUF weights)
        dtype, _, weights = variant.partition("-")
        sessions[variant] = Session(folder, dtype=dtype, weights=weights or "dense")
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    codec = next(iter(sessions.values())).codec
    methods = [hf_method(model, codec.eos_ids, 0, None),
               hf_method(model, codec.eos_ids, draft_len, LookupCounter())]
    for dtype, session in sessions.items():
        methods.append(mtpctl_method(session, dtype, draft_len, speculative=False))
        methods.append(mtpctl_method(session, dtype, draft_len, speculative=True))
    return codec, methods, model


# ----------------------------------------------------------------------------- running


def log(msg: str) -> None:
    """Progress, to stderr (stdout carries the report)."""
    print(msg, file=sys.stderr, flush=True)


class OtherCpu:
    """CPU time used by other processes (in cores) between samples: all busy time in /proc/stat
    minus this process's own. Returns None where /proc/stat is unavailable."""

    def __init__(self):
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.last = self._read()

    def _read(self):
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return None
        busy = sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)  # minus idle, iowait
        own = os.times()
        return busy / self.tick, own.user + own.system, time.monotonic()

    def sample(self) -> Optional[float]:
        now, before = self._read(), self.last
        self.last = now
        if now is None or before is None or now[2] <= before[2]:
            return None
        return max(0.0, (now[0] - before[0]) - (now[1] - before[1])) / (now[2] - before[2])


def wait_until_quiet(meter: OtherCpu, threshold: float, patience_s: float = 180.0) -> None:
    """Sleep until other processes use under ``threshold`` cores for 3 s in a row (or patience ends)."""
    deadline, calm = time.monotonic() + patience_s, 0
    meter.sample()
    while calm < 3 and time.monotonic() < deadline:
        time.sleep(1.0)
        other = meter.sample()
        calm = calm + 1 if other is not None and other < threshold else 0


def timed_run(m: Method, ids: Sequence[int], max_new: int, meter: OtherCpu, threshold: float,
              retries: int) -> Run:
    """``m.run`` with the CPU other processes used meanwhile; a contended run is repeated (after
    waiting for a quiet CPU) up to ``retries`` times, and the last attempt is kept."""
    for attempt in range(retries + 1):
        meter.sample()
        run = m.run(ids, max_new)
        run.other_cpu, run.attempts = meter.sample(), attempt + 1
        if threshold <= 0 or run.other_cpu is None or run.other_cpu < threshold:
            break
        log(f"  {m.key}: other processes used {run.other_cpu:.2f} cores; waiting for a quiet CPU, rerunning")
        wait_until_quiet(meter, threshold / 2)
    return run


def run_all(methods: List[Method], prompts: List[Prompt], max_new: int, threshold: float, retries: int) -> None:
    """Warm up every method, then run every method on every prompt, interleaved (order rotated)."""
    meter = OtherCpu()
    wait_until_quiet(meter, threshold / 2 if threshold > 0 else float("inf"))
    log(f"warm-up: {len(methods)} methods x {WARMUP_TOKENS} tokens")
    for m in methods:
        m.run(prompts[0].ids, min(WARMUP_TOKENS, max_new))
    for i, prompt in enumerate(prompts):
        shift = i % len(methods)
        for m in methods[shift:] + methods[:shift]:
            m.runs.append(timed_run(m, prompt.ids, max_new, meter, threshold, retries))
        speeds = ", ".join(f"{m.key} {len(m.runs[-1].tokens) / m.runs[-1].seconds:.1f}" for m in methods)
        others = max((m.runs[-1].other_cpu or 0.0) for m in methods)
        log(f"[{i + 1}/{len(prompts)}] {prompt.category}: {speeds} tok/s (other processes <= {others:.2f} cores)")


# ----------------------------------------------------------------------------- figures


def tokens_per_s(runs: Sequence[Run]) -> float:
    """All new tokens over all wall time."""
    seconds = sum(r.seconds for r in runs)
    return sum(len(r.tokens) for r in runs) / seconds if seconds else 0.0


def tau(runs: Sequence[Run]) -> Optional[float]:
    """Tokens committed per target forward pass after the prefill (HF: including the first pass)."""
    steps = sum(r.steps or 0 for r in runs)
    return sum(r.committed or 0 for r in runs) / steps if steps else None


def acceptance(runs: Sequence[Run]) -> Optional[float]:
    """Accepted draft tokens over draft tokens verified (None when nothing was drafted)."""
    drafted = sum(r.drafted or 0 for r in runs)
    return sum(r.accepted or 0 for r in runs) / drafted if drafted else None


def first_divergence(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """Index of the first differing token (a length difference counts), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def reference_of(m: Method, keys) -> Optional[str]:
    """The method whose tokens ``m`` must reproduce: n-gram -> plain of its dtype, HF prompt lookup
    and mtpctl plain float32 -> HF greedy, other plain dtypes -> mtpctl plain float32."""
    if m.key.startswith("ngram/"):
        return f"plain/{m.dtype}"
    if m.key == "hf-pld/float32" or m.key == "plain/float32":
        return "hf/float32"
    if m.key.startswith("plain/") and "plain/float32" in keys:
        return "plain/float32"
    return None


def divergences(m: Method, ref: Method, prompts: List[Prompt], model) -> List[tuple]:
    """``(prompt number, token index, float32 logit gap)`` per prompt where ``m`` and ``ref`` differ.

    The gap is between the two diverging tokens, from HF's float32 model on the common prefix (None
    when one output merely ended earlier); a small gap means a near-tie that rounding can flip.
    """
    out = []
    for i, (run, base) in enumerate(zip(m.runs, ref.runs)):
        d = first_divergence(run.tokens, base.tokens)
        if d is None:
            continue
        gap = None
        if d < min(len(run.tokens), len(base.tokens)):
            context = torch.tensor([prompts[i].ids + base.tokens[:d]])
            with torch.inference_mode():
                logits = model(context).logits[0, -1].float()
            gap = abs(float(logits[run.tokens[d]] - logits[base.tokens[d]]))
        out.append((i + 1, d, gap))
    return out


def check_text(diffs: List[tuple], total: int, what: str) -> str:
    """The lossless cell: prompts equal to the reference, first divergences, largest logit gap."""
    text = f"{total - len(diffs)}/{total} = {what}"
    if diffs:
        text += "; first divergence " + ", ".join(f"p{p}@{d}" for p, d, _ in diffs[:3])
        text += " ..." if len(diffs) > 3 else ""
        gaps = [g for _, _, g in diffs if g is not None]
        if gaps:
            text += f"; fp32 logit gap there <= {max(gaps):.2g}"
    return text


def lossless_column(methods: List[Method], prompts: List[Prompt], model) -> Dict[str, str]:
    """The check shown in each method's row."""
    by_key = {m.key: m for m in methods}
    out = {}
    for m in methods:
        ref = reference_of(m, by_key)
        if m.key == "hf/float32":
            out[m.key] = "reference"
        elif ref is None:
            out[m.key] = ""
        else:
            label = "HF greedy" if ref == "hf/float32" else f"plain {m.dtype}" if m.speculative else "mtpctl fp32"
            out[m.key] = check_text(divergences(m, by_key[ref], prompts, model), len(m.runs), label)
    return out


def fmt(x: Optional[float], digits: int = 2) -> str:
    """A figure for the tables, a dash when there is none."""
    return "—" if x is None else f"{x:.{digits}f}"


def main_table(methods: List[Method], checks: Dict[str, str]) -> str:
    """One row per method: tokens/s, ratio to HF greedy, tau, acceptance, the lossless check."""
    by_key = {m.key: m for m in methods}
    base = tokens_per_s(by_key["hf/float32"].runs)
    rows = ["| method | dtype | new tokens | tokens/s | vs HF | tau | acceptance | lossless check (prompts) |",
            "|---|---|---:|---:|---:|---:|---:|---|"]
    for m in methods:
        tps = tokens_per_s(m.runs)
        t = tau(m.runs) if m.speculative else 1.0
        rows.append(f"| {m.label} | {m.dtype} | {sum(len(r.tokens) for r in m.runs)} | {tps:.1f} | "
                    f"{tps / base:.2f}x | {fmt(t)} | {fmt(acceptance(m.runs))} | {checks[m.key]} |")
    return "\n".join(rows)


def category_table(methods: List[Method], prompts: List[Prompt]) -> str:
    """Tokens/s per category and method; tau in brackets for speculative methods."""
    categories = list(dict.fromkeys(p.category for p in prompts))
    heads = [f"{m.label.split(' (')[0]} {m.dtype}" for m in methods]
    rows = ["| category (prompts) | " + " | ".join(heads) + " |", "|---|" + "---:|" * len(methods)]
    for cat in categories:
        idx = [i for i, p in enumerate(prompts) if p.category == cat]
        cells = []
        for m in methods:
            runs = [m.runs[i] for i in idx]
            cell = f"{tokens_per_s(runs):.1f}"
            if m.speculative:
                cell += f" ({fmt(tau(runs))})"
            cells.append(cell)
        rows.append(f"| {cat} ({len(idx)}) | " + " | ".join(cells) + " |")
    return "\n".join(rows)


# ----------------------------------------------------------------------------- report


def same_output_note(m: Method, plain: Method) -> List[str]:
    """Where speculation changed the output, its speed was measured on other text: say so, and give
    the ratio over the prompts whose outputs are identical."""
    same = [i for i, (a, b) in enumerate(zip(m.runs, plain.runs)) if a.tokens == b.tokens]
    if len(same) == len(m.runs):
        return []
    note = (f"The {m.dtype} n-gram outputs differ from plain on {len(m.runs) - len(same)}/{len(m.runs)} prompts "
            f"({sum(len(r.tokens) for r in m.runs)} vs {sum(len(r.tokens) for r in plain.runs)} tokens), "
            "so on those prompts the two rows time different text")
    if same:
        ratio = tokens_per_s([m.runs[i] for i in same]) / tokens_per_s([plain.runs[i] for i in same])
        note += f"; over the {len(same)} prompts with identical outputs, n-gram runs at {ratio:.2f}x plain"
    return [note + "."]


def speedup_notes(methods: List[Method], prompts: List[Prompt]) -> List[str]:
    """Data-driven notes: where n-gram speculation pays off and where it does not."""
    by_key = {m.key: m for m in methods}
    notes = []
    for m in methods:
        if not m.key.startswith("ngram/"):
            continue
        plain = by_key[f"plain/{m.dtype}"]
        ratios = []
        for cat in dict.fromkeys(p.category for p in prompts):
            idx = [i for i, p in enumerate(prompts) if p.category == cat]
            ratios.append((tokens_per_s([m.runs[i] for i in idx]) / tokens_per_s([plain.runs[i] for i in idx]), cat))
        best, worst = max(ratios), min(ratios)
        notes.append(f"n-gram vs plain mtpctl ({m.dtype}): {tokens_per_s(m.runs) / tokens_per_s(plain.runs):.2f}x "
                     f"overall; best on {best[1]} ({best[0]:.2f}x), worst on {worst[1]} ({worst[0]:.2f}x).")
        notes += same_output_note(m, plain)
    if "plain/bfloat16" in by_key and "plain/float32" in by_key:
        r = tokens_per_s(by_key["plain/bfloat16"].runs) / tokens_per_s(by_key["plain/float32"].runs)
        notes.append(f"bfloat16 plain runs at {r:.2f}x the float32 speed on this CPU.")
    return notes


def contention_notes(methods: List[Method], threshold: float) -> List[str]:
    """Notes on CPU used by other processes during the timed runs, and on reruns."""
    runs = [r for m in methods for r in m.runs]
    known = [r.other_cpu for r in runs if r.other_cpu is not None]
    if not known:
        return ["CPU use of other processes could not be measured (/proc/stat unavailable)."]
    notes = []
    reruns = sum(r.attempts - 1 for r in runs)
    if reruns:
        notes.append(f"{reruns} timed generations were repeated because other processes used at least "
                     f"{threshold:.2f} cores meanwhile (the benchmark waited for a quiet CPU first); "
                     "only the last attempt counts.")
    kept = [o for o in known if threshold > 0 and o >= threshold]
    if kept:
        notes.append(f"{len(kept)}/{len(known)} kept generations still ran beside other processes "
                     f"(up to {max(kept):.2f} cores): their figures are pessimistic.")
    return notes


def source_version() -> str:
    """The repository's commit, and whether mtpctl/ has uncommitted changes (call it before the run:
    the code is imported once, later edits do not affect it)."""
    import subprocess

    def git(*cmd):
        return subprocess.run(["git", "-C", str(HERE.parent), *cmd], capture_output=True, text=True,
                              timeout=30).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--", "mtpctl")
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    return f"git {commit or 'unknown'}" + (", with uncommitted changes in mtpctl/" if dirty else "")


def report(args, methods: List[Method], prompts: List[Prompt], folder: Path, model) -> str:
    """The markdown section; ``model`` (HF float32) measures logit gaps at divergences."""
    import transformers

    command = "python benchmarks/bench_generate.py " + shlex.join(sys.argv[1:])
    threads = torch.get_num_threads()
    known = [r.other_cpu for m in methods for r in m.runs if r.other_cpu is not None]
    lines = [
        "## Greedy decoding speed: mtpctl vs HF transformers",
        "",
        f"Command: `{command.strip()}`",
        "",
        f"- Date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- Machine: {cpu_model()}, {os.cpu_count()} logical CPUs, torch threads {threads}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}, Python {platform.python_version()}",
        f"- mtpctl source at the start of the run: {args.source}",
        f"- Model: `{args.model}` ({folder.name}); {len(prompts)} prompts from `{args.prompts}`, "
        f"up to {args.max_new_tokens} new tokens each, batch 1, greedy; draft length {args.draft_len}",
        f"- CPU used by other processes during the timed runs: "
        f"{fmt(sum(known) / len(known) if known else None)} cores on average, "
        f"{fmt(max(known) if known else None)} at most (means over each kept generation)",
        "",
        main_table(methods, lossless_column(methods, prompts, model)),
        "",
        "Tokens/s per category (tau in brackets for speculative methods):",
        "",
        category_table(methods, prompts),
        "",
        "Notes:",
        "",
    ]
    notes = [
        "Tokens/s = all new tokens / all wall time of the generate calls, per method; prefill, KV-cache "
        "setup and the EOS token included alike. Outputs stop at EOS or the token limit, so methods that "
        "agree token for token also produce the same number of tokens.",
        "tau = tokens committed per target forward pass after the prefill (plain decoding: 1). For HF prompt "
        "lookup the first pass both prefills and verifies drafts, so it is counted as a step; its steps and "
        "draft counts come from wrapping `PromptLookupCandidateGenerator.get_candidates` (read-only). "
        "Acceptance = accepted draft tokens / draft tokens verified.",
        "HF prompt lookup uses its defaults (n-gram sizes 2..1, K draft tokens); mtpctl's drafter matches "
        "n-grams of 3..2, so the two propose slightly different drafts.",
        "Lossless check: `pN@i` = prompt N first differs at new token i. mtpctl n-gram rows are compared with "
        "mtpctl plain of the same dtype (greedy speculation must not change the output); mtpctl plain float32 "
        "and HF prompt lookup with HF greedy; mtpctl plain of other dtypes with mtpctl plain float32 "
        "(rounding may legitimately change those). The gap is |logit(a) - logit(b)| of the two diverging "
        "tokens under HF's float32 model on the common prefix, a proxy for how close the tie was. Kernels that "
        "compute a row differently alone and inside a block (a one-token step vs a verify of several) can flip "
        "an argmax only at a near-tie: gaps around 1e-5 in float32, a few tenths at most in bfloat16 (8 "
        "significant bits; its logits stray that far from float32's). For n-gram vs plain of the same dtype, a "
        "divergence at a large gap would be a bug.",
        "The checkpoint is a GGUF Q4_1 import dequantized to float32 (weights on the 4-bit grid). The float32 "
        "and bfloat16 rows run it as dense matrices; bfloat16-int4 rows (if any) keep the 4-bit codes "
        "(mtpctl `--weights int4`).",
        "Methods are interleaved per prompt with their order rotated each prompt; one warm-up generation "
        f"({WARMUP_TOKENS} tokens) per method first. A generation during which other processes used "
        f"{args.quiet_threshold} cores or more is repeated once the CPU is quiet (at most {args.retries} times). "
        "This is a single run; on a 2-CPU machine, repeated runs moved the ratios by up to about 10%.",
    ]
    notes += speedup_notes(methods, prompts)
    notes += contention_notes(methods, args.quiet_threshold)
    lines += [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def write_section(path: Path, body: str) -> None:
    """Replace the marked section of ``path`` with ``body`` (append it when there is none)."""
    section = f"{START_MARK}\n{body}{END_MARK}\n"
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    start, end = text.find(START_MARK), text.find(END_MARK)
    if start != -1 and end > start:
        text = text[:start] + section + text[end + len(END_MARK):].lstrip("\n")
    else:
        text = text + ("\n" if text and not text.endswith("\n\n") else "") + section
    path.write_text(text, encoding="utf-8")


def save_runs(path: Path, methods: List[Method], prompts: List[Prompt]) -> None:
    """Every kept generation as a JSON line (method, prompt number, tokens, timing) for later study."""
    with path.open("w", encoding="utf-8") as out:
        for m in methods:
            for i, (run, prompt) in enumerate(zip(m.runs, prompts)):
                record = dict(method=m.key, prompt=i + 1, category=prompt.category, **vars(run))
                out.write(json.dumps(record) + "\n")


# ----------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="alias, checkpoint folder, .gguf file or hub id")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--draft-len", type=int, default=3, help="mtpctl draft length k = HF prompt_lookup_num_tokens")
    p.add_argument("--dtypes", default="float32,bfloat16",
                   help="dtypes of the mtpctl runs, float32 required; bfloat16-int4 = bfloat16 with int4-packed "
                        "GGUF weights (mtpctl --weights int4)")
    p.add_argument("--prompts", default="benchmarks/prompts.jsonl",
                   help="JSONL of {category, prompt}; a relative path is tried from here, then the repo root")
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--quiet-threshold", type=float, default=0.25, metavar="CORES",
                   help="rerun a generation during which other processes used this many cores (0: never)")
    p.add_argument("--retries", type=int, default=3, help="most reruns of one contended generation")
    p.add_argument("--save-runs", default=None, metavar="FILE", help="write every generation to a JSONL file")
    p.add_argument("--write", default=None, metavar="FILE", help="put the report in FILE's marked section")
    args = p.parse_args(argv)
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if "float32" not in args.dtypes:
        p.error("--dtypes must include float32 (the lossless checks compare against it)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    args.source = source_version()
    sys.path.insert(0, str(HERE.parent))
    from mtpctl.model.sources import resolve_model

    if args.threads:
        torch.set_num_threads(args.threads)
    prompts_path = Path(args.prompts)
    if not prompts_path.exists() and not prompts_path.is_absolute():
        prompts_path = HERE.parent / prompts_path
    prompts = load_prompts(prompts_path, args.limit)
    folder = resolve_model(args.model)
    log(f"model {folder}; {len(prompts)} prompts; threads {torch.get_num_threads()}")
    codec, methods, model = build_methods(folder, args.dtypes, args.draft_len)
    for prompt in prompts:
        prompt.ids = codec.encode_prompt(prompt.text, chat=True)
    run_all(methods, prompts, args.max_new_tokens, args.quiet_threshold, args.retries)
    body = report(args, methods, prompts, folder, model)
    print(body)
    if args.save_runs:
        save_runs(Path(args.save_runs), methods, prompts)
    if args.write:
        write_section(Path(args.write), body)
        log(f"wrote the report to {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
