"""``mtpctl bench --batch-sizes``: every method at every batch size, on the same requests.

At each batch size B the whole request set (the selected prompts) runs through
:meth:`~mtpctl.decode.session.Session.generate_batch` with ``max_batch`` B, once per method and
round: ``rounds`` rounds, each over every batch size and method in turn, the methods' order rotated
from one run to the next, so a method and plain at the same size run minutes apart at most and
a machine whose speed drifts hits them alike. Figures per (method, B):

- tokens/s: all new tokens over the wall time of every round's run (throughput);
- speedup: the median over rounds of that round's tokens/s over plain's at the same batch size
  (paired: the ratio of two runs close in time), with the lowest and highest round;
- TTFT p50: from the run's start (every request arrives at once, so it includes waiting for a row);
- ITL p50 / p99: each step's time divided among the tokens a request committed in it;
- tau and acceptance over every request's steps;
- same as plain: requests whose tokens equal plain decoding's at batch size 1 (greedy: all of them);
- peak memory: the weights plus the KV caches of the B largest requests held at once; on CUDA also the
  device's measured peaks, allocated and reserved (the highest of the rounds' runs, each reset when it started).
"""

from __future__ import annotations

import statistics
from typing import Callable, Dict, List, Optional, Sequence

from mtpctl.bench.harness import DEVICE_COLUMN, DEVICE_PEAKS, device_cell, itl_samples, percentile
from mtpctl.decode.loop import GenerationResult
from mtpctl.decode.session import GenerationRequest, Session
from mtpctl.errors import MtpctlError
from mtpctl.model.device import clock, measured

#: one run of the request set: ``{"results": [GenerationResult per request], "wall_ms": float}``, and on
#: CUDA the device's peaks during it (``device_peak_allocated_bytes``, ``device_peak_reserved_bytes``)
Run = dict


def run_batch_sizes(session: Session, drafters: Dict[str, object], prompts: Sequence[List[int]],
                    batch_sizes: Sequence[int], make_request: Callable[[List[int]], GenerationRequest],
                    make_policy: Callable[[str], object], acceptance: str = "exact",
                    progress: Optional[Callable[[str], None]] = None, rounds: int = 1) -> Dict[tuple, List[Run]]:
    """(method, batch size) -> its runs, one per round, for every method (name -> drafter, None for
    plain) at every batch size, each run under a fresh ``make_policy(name)``.

    Raises:
        MtpctlError: a request that failed (the benchmark's requests must all run).
    """
    names = list(drafters)
    runs: Dict[tuple, List[Run]] = {}
    turn = 0
    for round_ in range(rounds):
        for size in batch_sizes:
            shift = turn % len(names)
            turn += 1
            for name in names[shift:] + names[:shift]:
                requests = [make_request(ids) for ids in prompts]
                with measured(session.torch_device) as memory:  # on CUDA: phases synchronized, the peak measured
                    start = clock()
                    outcomes = session.generate_batch(requests, drafters[name], size, make_policy(name), acceptance)
                    wall_ms = (clock() - start) * 1e3
                failed = next((o for o in outcomes if isinstance(o, MtpctlError)), None)
                if failed is not None:
                    raise failed
                runs.setdefault((name, size), []).append({"results": outcomes, "wall_ms": wall_ms, **memory})
                if progress:
                    progress(f"round {round_ + 1}/{rounds} batch {size} {name}: {len(outcomes)} requests, "
                             f"{sum(r.stats.new_tokens for r in outcomes)} tokens, {_rate(outcomes, wall_ms):.1f} tokens/s")
    return runs


def _rate(results: Sequence[GenerationResult], wall_ms: float) -> float:
    """tokens/s of ``results`` generated in ``wall_ms``."""
    return sum(r.stats.new_tokens for r in results) / (wall_ms / 1e3) if wall_ms else 0.0


def _rates(runs: List[Run]) -> List[float]:
    """tokens/s of each run."""
    return [_rate(run["results"], run["wall_ms"]) for run in runs]


def _total_rate(runs: List[Run]) -> float:
    """tokens/s over every run together."""
    return _rate([r for run in runs for r in run["results"]], sum(run["wall_ms"] for run in runs))


def _speedups(runs: List[Run], plain: Optional[List[Run]]) -> List[float]:
    """Each round's tokens/s over plain's in the same round (a peer's single run: over plain's rate
    across its rounds); none where plain made no tokens."""
    if not plain:
        return []
    if len(runs) == len(plain):
        return [rate / base for rate, base in zip(_rates(runs), _rates(plain)) if base > 0]
    total = _total_rate(plain)
    return [rate / total for rate in _rates(runs)] if total > 0 else []


def summarize_batched(runs: Dict[tuple, List[Run]], weight_bytes: Dict[str, int]) -> List[dict]:
    """One figure set per (method, batch size), in batch-size then method order (see the module
    docstring); ``weight_bytes``: method -> bytes of its weights (target + drafter)."""
    reference = {size: rounds[0]["results"] for (name, size), rounds in runs.items() if name == "plain"}
    first = reference[min(reference)] if reference else None
    rows = []
    for (name, size), rounds in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0] != "plain")):
        if rounds[0].get("failed"):  # a peer's run that failed: its reason, no figures
            rows.append({"method": name, "batch_size": size, "failed": rounds[0]["failed"], "requests": 0,
                         "tokens_per_s": None, "speedup": None, "itl_ms_p99": None})
            continue
        results: List[GenerationResult] = [r for run in rounds for r in run["results"]]
        tokens = sum(r.stats.new_tokens for r in results)
        ratios = _speedups(rounds, runs.get(("plain", size)))
        steps = sum(r.stats.decode_steps for r in results)
        drafted = sum(r.stats.draft_tokens for r in results)
        itl = [x for r in results for x in itl_samples(r)]
        ttft = [r.stats.ttft_ms for r in results if r.stats.ttft_ms is not None]
        kv = sorted((r.stats.kv_cache_bytes for r in rounds[0]["results"]), reverse=True)[:size]
        rows.append({
            "method": name, "batch_size": size, "requests": len(results), "rounds": len(rounds), "new_tokens": tokens,
            "tokens_per_s": _total_rate(rounds),
            "speedup": statistics.median(ratios) if ratios else None,
            "speedup_range": [min(ratios), max(ratios)] if len(ratios) > 1 and name != "plain" else None,
            "ttft_ms_p50": percentile(ttft, 50), "itl_ms_p50": percentile(itl, 50), "itl_ms_p99": percentile(itl, 99),
            "tau": sum(sum(r.stats.accepted_per_step) for r in results) / steps if steps else None,
            "acceptance_rate": sum(r.stats.accepted_tokens for r in results) / drafted if drafted else None,
            "same_as_plain": (sum(a.token_ids == first[i % len(first)].token_ids  # a peer's run: every round's requests
                                  for run in rounds for i, a in enumerate(run["results"])) if first else None),
            "peak_memory_bytes": (weight_bytes[name] + sum(kv)) if name in weight_bytes else None,
            **{key: max(run[key] for run in rounds) for key in DEVICE_PEAKS if key in rounds[0]},
        })
    return rows


def stops_paying(rows: List[dict]) -> Dict[str, Optional[int]]:
    """Method -> the smallest batch size at which it is slower than plain (None: it never is)."""
    out: Dict[str, Optional[int]] = {}
    for row in rows:
        if row["method"] == "plain":
            continue
        out.setdefault(row["method"], None)
        if row["speedup"] is not None and row["speedup"] < 1.0 and out[row["method"]] is None:
            out[row["method"]] = row["batch_size"]
    return out


def format_batched(rows: List[dict]) -> str:
    """The rows as a markdown table, then where each method stops paying."""
    def f(value, spec):
        return "-" if value is None else format(value, spec)

    def speedup(r):
        spread = r.get("speedup_range")
        return f(r["speedup"], ".2f") + (f" ({spread[0]:.2f}-{spread[1]:.2f})" if spread else "")

    device = any(DEVICE_PEAKS[0] in r for r in rows)  # measured on CUDA
    lines = ["| batch | method | tokens/s | speedup vs plain (lowest-highest round) | TTFT p50 ms from arrival | ITL p50 / p99 ms | tau | acceptance "
             "| same as plain | peak memory MiB |" + (DEVICE_COLUMN[0] if device else ""),
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|" + (DEVICE_COLUMN[1] if device else "")]
    for r in rows:
        if r.get("failed"):
            lines.append(f"| {r['batch_size']} | {r['method']} | failed: {r['failed']} |" + " - |" * (7 + device))
            continue
        lines.append(f"| {r['batch_size']} | {r['method']} | {r['tokens_per_s']:.1f} | {speedup(r)} "
                     f"| {f(r['ttft_ms_p50'], '.0f')} | {f(r['itl_ms_p50'], '.1f')} / {f(r['itl_ms_p99'], '.1f')} "
                     f"| {f(r['tau'], '.2f')} | {f(r['acceptance_rate'], '.2f')} "
                     f"| {r['same_as_plain']}/{r['requests']} "
                     f"| {f(r['peak_memory_bytes'] and r['peak_memory_bytes'] / 2 ** 20, '.1f')} |"
                     + (device_cell(r) if device else ""))
    paying = stops_paying(rows)
    if paying:
        lines.append("")
        lines += [f"- {name}: " + (f"slower than plain from batch size {size}" if size else
                                   "never slower than plain at the batch sizes measured")
                  for name, size in paying.items()]
    return "\n".join(lines)


def plot_batched(path, rows: List[dict]) -> None:
    """Throughput against batch size, one line per method (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r["method"] for r in rows):
        points = [(r["batch_size"], r["tokens_per_s"]) for r in rows if r["method"] == name and not r.get("failed")]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (requests decoded at once)")
    ax.set_ylabel("tokens/s (all requests)")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
