"""``mtpctl bench --rounds N``: the same prompts N times in a row, each round reported on its own.

A drafter that learns from the responses it has served (the suffix drafter's global index) drafts
from none of this run's responses in round 1 and from the earlier rounds' responses from round 2 on:
round 1 is cold, rounds 2+ are warm. Every method learns only from its own runs (each method has
its own drafter). The warm-up (every method once on the first prompt) is forgotten before round 1:
each learning drafter's global index goes back to what it held once built (nothing, or what a cache
file held). With ``--batch-sizes`` each round runs every method at every batch size, the requests of
one run joining and leaving the batch as rows free up, so a request learns from the requests of its
run that finished before it started.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

from mtpctl.bench.batched import format_batched, run_batch_sizes, summarize_batched
from mtpctl.bench.harness import MethodRuns, attempt, run_interleaved
from mtpctl.bench.report import build_report, format_table
from mtpctl.drafters.suffix import index_stats, stats_line, suffix_member


def learning(drafters: Dict[str, object]) -> Dict[str, object]:
    """The methods whose drafter learns from the responses it serves (name -> its suffix drafter)."""
    found = {name: suffix_member(drafter) for name, drafter in drafters.items()}
    return {name: member for name, member in found.items() if member is not None}


def forgetting(drafters: Dict[str, object]) -> Callable[[], None]:
    """A function that puts every learning drafter's global index back to what it holds now."""
    held = {name: (member, member.cache.sequences()) for name, member in learning(drafters).items()}

    def forget() -> None:
        for member, sequences in held.values():
            member.cache.restore(sequences)
    return forget


def run_rounds(runners: Dict[str, Callable], prompts: Sequence[List[int]], rounds: int, forget: Callable[[], None],
               progress: Optional[Callable[[str], None]] = None) -> List[Dict[str, MethodRuns]]:
    """Each round's runs (:func:`~mtpctl.bench.harness.run_interleaved` over every prompt once), after a
    warm-up of every method on the first prompt that ``forget()`` then forgets."""
    for name, run in runners.items():
        attempt(MethodRuns(name), run, prompts[0])  # a peer that fails here fails again in round 1's row
    forget()
    out = []
    for number in range(1, rounds + 1):
        out.append(run_interleaved(runners, prompts, 1, warmup=False, progress=_round_progress(progress, number, rounds)))
    return out


def _round_progress(progress: Optional[Callable[[str], None]], number: int, rounds: int) -> Callable[[str], None]:
    """``progress`` for one round's runs: their "round 1/1" lines renamed to this round of ``rounds``."""
    def tell(line: str) -> None:
        if progress:
            progress(line.replace("round 1/1", f"round {number}/{rounds}", 1))
    return tell


def run_batched_rounds(session, drafters: Dict[str, object], prompts: Sequence[List[int]], sizes: Sequence[int],
                       make_request, make_policy, acceptance: str, rounds: int, forget: Callable[[], None],
                       progress: Optional[Callable[[str], None]] = None) -> List[dict]:
    """Each round's runs at every batch size (:func:`~mtpctl.bench.batched.run_batch_sizes`, one round
    each), the learning drafters' global indexes put back first."""
    forget()
    out = []
    for number in range(1, rounds + 1):
        out.append(run_batch_sizes(session, drafters, prompts, sizes, make_request, make_policy, acceptance,
                                   progress=_round_progress(progress, number, rounds), rounds=1))
    return out


def heading(number: int, rounds: int, learners: Dict[str, object], start: int) -> str:
    """What round ``number`` of ``rounds`` is: cold or warm for the ``learners`` (their global indexes
    held ``start`` responses when the run began)."""
    if not learners:
        return f"Round {number} of {rounds} (no method learns from earlier rounds)"
    names = ", ".join(learners)
    if number == 1 and start:
        return f"Round 1 of {rounds}: each suffix drafter's global index starts from the cache file's {start} responses " \
               f"({names})"
    if number == 1:
        return f"Round 1 of {rounds}: cold (each suffix drafter's global index holds no response yet: {names})"
    held = "round 1" if number == 2 else f"rounds 1-{number - 1}"
    return f"Round {number} of {rounds}: warm (each suffix drafter's global index holds the responses of {held}: {names})"


def round_reports(per_round: List[Dict[str, MethodRuns]], prompts, weights: Dict[str, int], settings: dict,
                  drafters: Dict[str, object], start: int) -> List[dict]:
    """A report per round (:func:`~mtpctl.bench.report.build_report`) with its ``round``, ``warm``,
    ``heading`` and each learning method's global index after it (``suffix_index``)."""
    learners = learning(drafters)
    reports = []
    for number, runs in enumerate(per_round, 1):
        report = build_report(runs, prompts, weights, {**settings, "rounds": len(per_round)})
        report.update(round=number, warm=bool(learners) and number > 1,
                      heading=heading(number, len(per_round), learners, start))
        reports.append(report)
    if reports:  # the indexes as the last round left them
        reports[-1]["suffix_index"] = {name: index_stats(d) for name, d in learners.items()}
    return reports


def batched_reports(per_round: List[dict], weights: Dict[str, int], drafters: Dict[str, object],
                    start: int) -> List[dict]:
    """Per round: its rows (:func:`~mtpctl.bench.batched.summarize_batched`), ``round``, ``warm``, ``heading``;
    the last also each learning method's global index (``suffix_index``)."""
    learners = learning(drafters)
    reports = [{"round": number, "warm": bool(learners) and number > 1,
                "heading": heading(number, len(per_round), learners, start), "rows": summarize_batched(runs, weights)}
               for number, runs in enumerate(per_round, 1)]
    if reports:  # the indexes as the last round left them
        reports[-1]["suffix_index"] = {name: index_stats(d) for name, d in learners.items()}
    return reports


def format_rounds(reports: List[dict]) -> str:
    """Each round's heading and table (:func:`format_table`, or :func:`format_batched` for batch rows),
    then the learning drafters' global indexes."""
    parts = [f"{r['heading']}\n\n" + (format_batched(r["rows"]) if "rows" in r else format_table(r)) for r in reports]
    indexes = reports[-1].get("suffix_index") if reports else None
    if indexes:
        parts.append("\n".join(f"- {name}: {stats_line(stats)}" for name, stats in indexes.items()))
    return "\n\n".join(parts)


def gate_rows(reports: List[dict]) -> List[dict]:
    """Every round's method figures (or batch rows), each named with its round, for the gates."""
    rows = []
    for r in reports:
        for m in r.get("rows") or r["methods"]:
            rows.append({**m, "method": f"{m['method']} (round {r['round']})"})
    return rows
