"""The benchmark's report: prompts picked by category, every figure per method and category with
the settings and the machine, the markdown table, the JSON file, the plot, and the gates a pipeline
exits on."""

from __future__ import annotations

import io
import json
import os
import platform
from pathlib import Path
from typing import Dict, Optional

from mtpctl.bench.harness import DEVICE_COLUMN, DEVICE_PEAKS, device_cell, summarize
from mtpctl.decode.cost_table import cpu_name
from mtpctl.bench.peer_process import PeerFailed
from mtpctl.errors import BadInput, GateFailed
from mtpctl.files import write_file


def select_prompts(prompts, categories: Optional[str], limit: Optional[int]):
    """Keep the listed categories (all when None), at most ``limit`` prompts each."""
    wanted = [c.strip() for c in categories.split(",")] if categories else None
    known = {p.category for p in prompts}
    for c in wanted or []:
        if c not in known:
            raise BadInput(f"no prompt in category {c!r} (have: {', '.join(sorted(known))})", option="categories")
    kept, counts = [], {}
    for p in prompts:
        if (wanted is None or p.category in wanted) and counts.get(p.category, 0) < (limit or 1 << 30):
            counts[p.category] = counts.get(p.category, 0) + 1
            kept.append(p)
    return kept


def build_report(runs, prompts, weight_bytes: Dict[str, int], settings: dict) -> dict:
    """Every figure: per method overall, per category tokens/s, the settings and the machine.
    ``weight_bytes``: method -> bytes of the weights it runs (peers unknown: omitted)."""
    import torch

    plain = runs["plain"]
    methods = [summarize(r, plain if name != "plain" else None, weight_bytes.get(name)) for name, r in runs.items()]
    categories: Dict[str, Dict[str, float]] = {}
    for name, r in runs.items():
        for result, i in zip([] if r.failed else r.results, r.prompt_index):
            cat = categories.setdefault(prompts[i].category, {}).setdefault(name, [0, 0.0])
            cat[0] += result.stats.new_tokens
            cat[1] += result.stats.total_ms
    per_category = {c: {n: t / (ms / 1e3) if ms else 0.0 for n, (t, ms) in m.items()} for c, m in categories.items()}
    machine = {"cpu": cpu_name(), "logical_cpus": os.cpu_count(), "threads": torch.get_num_threads(),
               "torch": torch.__version__, "python": platform.python_version()}
    return {"format_version": 1, "settings": settings, "machine": machine, "methods": methods,
            "tokens_per_s_by_category": per_category}


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(report: dict) -> str:
    """The methods as a markdown table (the same numbers as the JSON, rounded)."""
    device = any(DEVICE_PEAKS[0] in m for m in report["methods"])  # measured on CUDA
    lines = ["| method | tokens/s | speedup (p10-p90) | TTFT p50 ms | ITL p50 / p90 / p99 ms | tau | acceptance "
             "| by position | same as plain | peak memory MiB |" + (DEVICE_COLUMN[0] if device else ""),
             "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|" + (DEVICE_COLUMN[1] if device else "")]
    for m in report["methods"]:
        if m.get("failed"):
            lines.append(f"| {m['method']} | failed after {m['runs']} run(s): {m['failed']} |" + " - |" * (8 + device))
            continue
        speed = "1.00 (baseline)" if m["method"] == "plain" else (
            f"{_fmt(m.get('speedup'), '.2f')} ({_fmt(m.get('speedup_p10'), '.2f')}-{_fmt(m.get('speedup_p90'), '.2f')})")
        itl = " / ".join(_fmt(m[k], ".1f") for k in ("itl_ms_p50", "itl_ms_p90", "itl_ms_p99"))
        positions = " ".join(f"{a:.2f}" for a in m["acceptance_by_position"]) or "-"
        same = "-" if m.get("same_as_plain") is None else f"{m['same_as_plain']}/{m['runs']}"
        lines.append(f"| {m['method']} | {m['tokens_per_s']:.1f} | {speed} | {_fmt(m['ttft_ms_p50'], '.1f')} | {itl} "
                     f"| {_fmt(m['tau'], '.2f')} | {_fmt(m['acceptance_rate'], '.2f')} | {positions} "
                     f"| {same} | {_fmt(m['peak_memory_bytes'] and m['peak_memory_bytes'] / 2**20, '.1f')} |"
                     + (device_cell(m) if device else ""))
    cats = report["tokens_per_s_by_category"]
    names = [m["method"] for m in report["methods"] if not m.get("failed")]
    lines += ["", "| category | " + " | ".join(f"{n} tokens/s" for n in names) + " |",
              "|---|" + "---:|" * len(names)]
    for c, row in cats.items():
        lines.append(f"| {c} | " + " | ".join(f"{row.get(n, 0.0):.1f}" for n in names) + " |")
    return "\n".join(lines)


def write_json(path: Path, report: dict) -> None:
    """Write the report atomically (a temporary file, then rename). BadInput if it cannot be written."""
    write_file(Path(path), json.dumps(report, indent=2))


def plot(path: Path, report: dict, runs) -> None:
    """tokens/s per method and the accept-length histogram of the speculative ones (matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise BadInput("plots need matplotlib: pip install 'mtpctl[plot]'", option="plot_path") from err
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    measured = [m for m in report["methods"] if not m.get("failed")]
    left.barh([m["method"] for m in measured], [m["tokens_per_s"] for m in measured])  # horizontal: long names stay readable
    left.invert_yaxis()
    left.set_xlabel("tokens/s")
    left.set_title("decoding speed")
    for m in measured:
        hist = m["accept_length_histogram"]
        if m["method"] != "plain" and hist:
            right.bar([int(k) for k in hist], list(hist.values()), alpha=0.6, label=m["method"])
    right.set_xlabel("accept length per step (bonus counted)")
    right.set_ylabel("decode steps")
    right.set_title("accepted length")
    if right.get_legend_handles_labels()[0]:
        right.legend()
    fig.tight_layout()
    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format=path.suffix.lstrip(".") or "png")
    finally:
        plt.close(fig)
    write_file(path, buffer.getvalue())


def check_gates(rows: list, min_speedup: Optional[float], max_p99_ms: Optional[float]) -> None:
    """Raise GateFailed (exit 1) naming each method (at each batch size, for ``--batch-sizes`` rows)
    that misses a gate; ``plain`` has no speedup gate. ``rows``: a report's ``methods``, or the rows of
    :func:`mtpctl.bench.batched.summarize_batched`."""
    misses = []
    for m in rows:
        name = m["method"] + (f" at batch {m['batch_size']}" if "batch_size" in m else "")
        if min_speedup is not None and m["method"] != "plain" and m.get("speedup") is not None \
                and m["speedup"] < min_speedup:
            misses.append(f"{name} speedup {m['speedup']:.4g} < {min_speedup}")
        if max_p99_ms is not None and m["itl_ms_p99"] is not None and m["itl_ms_p99"] > max_p99_ms:
            misses.append(f"{name} p99 ITL {m['itl_ms_p99']:.2f} ms > {max_p99_ms}")
    if misses:
        raise GateFailed("gate missed: " + "; ".join(misses))


def check_peers(rows: list) -> None:
    """Raise PeerFailed (exit 4) naming each peer that failed, once the table and JSON are written
    (after :func:`check_gates`: a missed gate exits 1 first)."""
    failed = [f"{m['method']}: {m['failed']}" for m in rows if m.get("failed")]
    if failed:
        raise PeerFailed("peer failed (its row is marked failed, every other figure was written): " + "; ".join(failed))


def format_profile(report: dict) -> str:
    """Where each method's decode steps spend their time (ms per step) and what lies outside the
    target's pass, against plain decoding's whole step."""
    plain = next((m.get("profile_ms_per_step") for m in report["methods"] if m["method"] == "plain"), None)
    lines = ["| method | draft | verify (pass) | logits | accept | commit | other | step | outside the pass | "
             "outside / plain step |", "|---|" + "---:|" * 9]
    for m in report["methods"]:
        p = m.get("profile_ms_per_step")
        if not p:
            continue
        share = f"{p['outside_pass'] / plain['step']:.0%}" if plain else "-"
        lines.append(f"| {m['method']} | " + " | ".join(f"{p[k]:.2f}" for k in ("draft", "verify", "logits", "accept",
                                                                               "commit", "other", "step", "outside_pass"))
                     + f" | {share} |")
    return "\n".join(lines)
