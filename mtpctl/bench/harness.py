"""Latency benchmark: every method on the same prompts in one process, interleaved over rounds.

A method is a named way to decode (plain, n-gram speculation, ...). One round runs every prompt with
every method, the method order rotated from prompt to prompt, so a machine whose speed drifts
affects all methods alike. Figures (glossary in docs/glossary.md):

- TTFT: prefill + first token, ms; ITL: each decode step's time divided among the tokens it
  committed (tokens of one step arrive together), ms, as p50/p90/p99 over all tokens.
- tokens/s: new tokens / generation time over all runs of the method.
- speedup: per (prompt, round) pair, plain's time per token over the method's; its median and
  p10..p90 spread (a paired ratio cancels the prompt's and the moment's own speed).
- tau: committed tokens per decode step (bonus counted); acceptance by draft position j: accepted
  draft tokens at position j / draft tokens proposed at position j.
- same as plain: runs whose tokens equal plain's run of the same prompt and round (greedy
  speculation is lossless: every run; with sampling, or for peers with other numerics, fewer).
- device peak memory (CUDA only): the most torch allocated (and reserved) on the device in one run of
  the method, each run's peak reset when it starts (:func:`device_peaks`).
- failed: a peer that crashed, hung or could not start (:class:`~mtpctl.bench.peer_process.PeerFailed`):
  its row says why and carries no figures; the other methods run on.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from mtpctl.bench.peer_process import PeerFailed
from mtpctl.errors import BadInput
from mtpctl.decode.loop import GenerationResult

BUILTIN_PROMPTS = Path(__file__).resolve().parent.parent / "data" / "bench_prompts.jsonl"


@dataclass(frozen=True)
class BenchPrompt:
    """One prompt of a benchmark set: its category (e.g. ``code``) and its conversation."""

    category: str
    messages: tuple  # ({"role": ..., "content": ...}, ...): one user turn, or a multi-turn chat


def load_prompts(path: Optional[Path] = None) -> List[BenchPrompt]:
    """Read a JSONL prompt set: ``{"category": ..., "prompt": "..."}`` or ``{"category": ...,
    "messages": [...]}`` per line (default: the built-in set, 7 categories of 10 prompts).

    Raises:
        BadInput: unreadable file, bad JSON, or a record without a prompt.
    """
    path = Path(path or BUILTIN_PROMPTS)
    prompts = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise BadInput(f"cannot read prompt set {path}: {err}") from err
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise BadInput(f"{path}:{number}: not JSON ({err})") from err
        if not isinstance(record, dict) or not (record.get("prompt") or record.get("messages")):
            raise BadInput(f"{path}:{number}: each line must be a JSON object with 'prompt' or 'messages'")
        messages = record.get("messages") or [{"role": "user", "content": str(record["prompt"])}]
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "content" in m for m in messages):
            raise BadInput(f"{path}:{number}: 'messages' must be a list of {{role, content}} objects")
        prompts.append(BenchPrompt(str(record.get("category", "default")), tuple(messages)))
    if not prompts:
        raise BadInput(f"{path} holds no prompt")
    return prompts


@dataclass
class MethodRuns:
    """Every run of one method: results in (round, prompt) order; ``failed`` the reason a peer stopped
    (its runs so far are not reported)."""

    name: str
    results: List[GenerationResult] = field(default_factory=list)
    prompt_index: List[int] = field(default_factory=list)
    failed: Optional[str] = None


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """The q-th percentile (0..100) of ``values`` by linear interpolation; None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def itl_samples(result: GenerationResult) -> List[float]:
    """Inter-token latencies (ms) of one generation: each step's time spread over its tokens."""
    out: List[float] = []
    for ms, tokens in zip(result.stats.step_ms, result.stats.accepted_per_step):
        out.extend([ms / tokens] * tokens if tokens else [])
    return out


def acceptance_by_position(results: Sequence[GenerationResult]) -> List[float]:
    """Acceptance rate at each draft position (tree depth, 0-based), over all decode steps of
    ``results``: steps that accepted a token at depth j / steps whose draft reached depth j."""
    proposed: List[int] = []
    accepted: List[int] = []
    for r in results:
        for drafted, committed in zip(r.stats.depth_per_step, r.stats.accepted_per_step):
            for j in range(drafted):
                if j == len(proposed):
                    proposed.append(0)
                    accepted.append(0)
                proposed[j] += 1
                accepted[j] += int(j < committed - 1)
    return [a / p for a, p in zip(accepted, proposed)]


def summarize(runs: MethodRuns, plain: Optional[MethodRuns], weight_bytes: Optional[int] = None) -> dict:
    """Figures of one method (see the module docstring); ``plain`` pairs runs for the speedup.

    ``weight_bytes``: memory of the weights the method runs (target + drafter), bytes; with it the
    summary gives ``peak_memory_bytes`` = weights + the largest KV cache a run allocated (the memory
    the method needs, not the process's RSS, which is shared by every method of the run). On a CUDA
    device it also gives the device's measured peaks (:func:`device_peaks`).
    """
    if runs.failed:
        return failed_summary(runs)
    results = runs.results
    new_tokens = sum(r.stats.new_tokens for r in results)
    total_ms = sum(r.stats.total_ms for r in results)
    steps = sum(r.stats.decode_steps for r in results)
    drafted = sum(r.stats.draft_tokens for r in results)
    itl = [x for r in results for x in itl_samples(r)]
    ttft = [r.stats.ttft_ms for r in results if r.stats.ttft_ms is not None]
    summary = {
        "method": runs.name, "runs": len(results), "new_tokens": new_tokens,
        "tokens_per_s": new_tokens / (total_ms / 1e3) if total_ms else 0.0,
        "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_mean": statistics.fmean(ttft) if ttft else None,
        "itl_ms_p50": percentile(itl, 50), "itl_ms_p90": percentile(itl, 90), "itl_ms_p99": percentile(itl, 99),
        "tau": sum(sum(r.stats.accepted_per_step) for r in results) / steps if steps else None,
        "acceptance_rate": sum(r.stats.accepted_tokens for r in results) / drafted if drafted else None,
        "acceptance_by_position": acceptance_by_position(results),
        "accept_length_histogram": _histogram([n for r in results for n in r.stats.accepted_per_step]),
        "peak_memory_bytes": (weight_bytes + max(r.stats.kv_cache_bytes for r in results)
                              if weight_bytes is not None and results else None),
        "profile_ms_per_step": step_profile(results),
        **device_peaks(results),
    }
    if plain is not None:
        ratios = [_ms_per_token(p) / _ms_per_token(m) for p, m in zip(plain.results, results)
                  if m.stats.new_tokens and p.stats.new_tokens]
        summary.update(speedup=percentile(ratios, 50), speedup_p10=percentile(ratios, 10),
                       speedup_p90=percentile(ratios, 90),
                       same_as_plain=sum(m.token_ids == p.token_ids for p, m in zip(plain.results, results)))
    return summary


#: the figures of a row (:func:`summarize`), each None in a failed peer's row
FIGURES = ("tokens_per_s", "ttft_ms_p50", "ttft_ms_mean", "itl_ms_p50", "itl_ms_p90", "itl_ms_p99", "tau",
           "acceptance_rate", "peak_memory_bytes", "profile_ms_per_step", "speedup", "speedup_p10", "speedup_p90",
           "same_as_plain")


def failed_summary(runs: MethodRuns) -> dict:
    """The row of a peer that failed: why, how many runs it completed, no figures."""
    return {"method": runs.name, "failed": runs.failed, "runs": len(runs.results), "new_tokens": 0,
            "acceptance_by_position": [], "accept_length_histogram": {}, **dict.fromkeys(FIGURES)}


#: the device memory figures of a run on CUDA (:func:`mtpctl.model.device.peak_memory`)
DEVICE_PEAKS = ("device_peak_allocated_bytes", "device_peak_reserved_bytes")
#: the tables' device memory column (header, alignment), where the runs measured a CUDA device
DEVICE_COLUMN = (" device peak MiB (allocated / reserved) |", "---:|")


def device_cell(row: dict) -> str:
    """A table row's device memory cell: its peaks in MiB, allocated / reserved (``-`` where not measured)."""
    return " " + " / ".join("-" if row.get(key) is None else f"{row[key] / 2**20:.1f}" for key in DEVICE_PEAKS) + " |"


def device_peaks(results: Sequence[GenerationResult]) -> Dict[str, int]:
    """The highest of each device memory peak over ``results`` (``device_peak_allocated_bytes``,
    ``device_peak_reserved_bytes``: each run's own, its peaks reset when it started,
    :func:`mtpctl.model.device.peak_memory`); {} where no run measured one (the CPU, peers)."""
    out: Dict[str, int] = {}
    for r in results:
        for key, value in r.stats.device_memory.items():
            out[key] = max(out.get(key, 0), value)
    return out


PHASES = ("draft", "verify", "logits", "accept", "commit")


def step_profile(results: Sequence[GenerationResult]) -> Optional[Dict[str, float]]:
    """Mean ms per decode step by phase (:attr:`GenerationStats.phase_ms`), ``other`` the rest of the
    step, and ``outside_pass`` everything but the target's pass and its lm_head rows; None for runs
    without phases (peers)."""
    steps = sum(r.stats.decode_steps for r in results)
    if not steps or not any(r.stats.phase_ms for r in results):
        return None
    out = {p: sum(r.stats.phase_ms.get(p, 0.0) for r in results) / steps for p in PHASES}
    step = sum(sum(r.stats.step_ms) for r in results) / steps
    out["other"] = max(0.0, step - sum(out.values()))
    out["step"] = step
    out["outside_pass"] = step - out["verify"] - out["logits"]
    return out


def _ms_per_token(result: GenerationResult) -> float:
    return result.stats.total_ms / result.stats.new_tokens


def _histogram(values: Sequence[int]) -> Dict[str, int]:
    counts: Dict[str, int] = {}
    for v in values:
        counts[str(v)] = counts.get(str(v), 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: int(kv[0])))


def run_interleaved(methods: Dict[str, Callable[[List[int]], GenerationResult]],
                    prompts: Sequence[List[int]], repeats: int, warmup: bool = True,
                    progress: Optional[Callable[[str], None]] = None) -> Dict[str, MethodRuns]:
    """Run every method on every prompt, ``repeats`` rounds, the method order rotated per prompt.

    Args:
        methods: name -> function generating from one prompt's token ids.
        prompts: the prompt set, as token ids (chat template applied).
        repeats: rounds (>= 1).
        warmup: run each method once on the first prompt before timing.
        progress: called with one line per run (e.g. written to stderr).

    Returns:
        name -> :class:`MethodRuns`, runs in the same (round, prompt) order for every method.
    """
    names = list(methods)
    runs = {name: MethodRuns(name) for name in names}
    if warmup and prompts:
        for name in names:
            attempt(runs[name], methods[name], prompts[0])
    for rnd in range(repeats):
        for i, prompt in enumerate(prompts):
            shift = (rnd * len(prompts) + i) % len(names)
            for name in names[shift:] + names[:shift]:
                result = attempt(runs[name], methods[name], prompt)
                if result is None:
                    continue
                runs[name].results.append(result)
                runs[name].prompt_index.append(i)
                if progress:
                    progress(f"round {rnd + 1}/{repeats} prompt {i + 1}/{len(prompts)} {name}: "
                             f"{result.stats.new_tokens} tokens, {result.stats.tokens_per_s:.1f} tokens/s")
    return runs


def attempt(runs: MethodRuns, method: Callable[[List[int]], GenerationResult],
            prompt: List[int]) -> Optional[GenerationResult]:
    """One run of ``method``; None once it failed: a peer's :class:`PeerFailed` marks ``runs`` failed
    (and is told on stderr by the caller's table), any other error is raised."""
    if runs.failed:
        return None
    try:
        return method(prompt)
    except PeerFailed as err:
        runs.failed = str(err)
        return None
