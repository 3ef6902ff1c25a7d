"""Speculation policies: how many draft tokens each active row may verify in a step.

A verify pass costs more the more rows it carries; a draft pays only when the tokens it is expected
to add outweigh what its rows add to the pass. Alone, a request can afford a large draft; in a full
batch every draft row competes with the other requests' rows, and a drafter whose drafts keep failing
should stop drafting. A policy sees each row's room (the most it may draft this step) and the
outcome of each step (nodes drafted, draft tokens accepted) and returns each row's draft size.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache, partial
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple

from mtpctl.errors import BadInput
from mtpctl.model.native import matmul_isa


class Policy(Protocol):
    """Decides each step's draft size per row; rows are named by their request's index."""

    def draft_sizes(self, rooms: Sequence[int], rows: Sequence[int]) -> list:
        """The most draft tokens each row may propose this step (0: a plain step), at most its room."""

    def observe(self, row: int, drafted: int, accepted: int, by_size: Optional[Sequence[int]] = None) -> None:
        """A row's step: ``drafted`` nodes verified, ``accepted`` draft tokens accepted; ``by_size``
        ``[s]`` (s the size the row was allowed), when known: the draft tokens that the same tree
        cut to its first k nodes would have had accepted, k = 1..s (see :func:`accepted_by_size`)."""


def accepted_by_size(path: Sequence[int], accepted: int, allowed: int) -> List[int]:
    """What a draft tree cut to its first k nodes (k = 1..``allowed``) would have had accepted, from
    the path the target kept (``path``: node indices, root 0 first, each node after its parent)
    and the draft tokens committed (``accepted``, fewer than the path's where a stop cut them):
    its nodes up to k. Exact for greedy acceptance of drafters whose smaller drafts are the first
    nodes of their larger ones (every drafter's static tree or chain, and merges of them); with
    sampling, an estimate (another cut would have drawn other random numbers)."""
    nodes = sorted(path[1:])
    return [min(accepted, sum(1 for n in nodes if n <= k)) for k in range(1, allowed + 1)]


class AlwaysDraft:
    """Every row drafts as much as its room allows, every step (``--speculate-policy always``)."""

    def draft_sizes(self, rooms: Sequence[int], rows: Sequence[int]) -> list:
        return list(rooms)

    def observe(self, row: int, drafted: int, accepted: int, by_size: Optional[Sequence[int]] = None) -> None:
        pass


def _interpolate(points: Tuple[int, ...], ms: Tuple[float, ...], x: float) -> float:
    """``ms`` at ``x``: linear between measured ``points`` (increasing), and past the last one along the
    last segment; ``ms[0]`` below the first."""
    if x <= points[0]:
        return ms[0]
    for i in range(1, len(points)):
        if x <= points[i] or i == len(points) - 1:
            return ms[i - 1] + (ms[i] - ms[i - 1]) * (x - points[i - 1]) / (points[i] - points[i - 1])
    return ms[-1]


@dataclass(frozen=True)
class PassCosts:
    """What a verify pass costs against the requests and draft nodes it carries, for one numeric mode
    on one machine (measured by ``benchmarks/bench_pass_costs.py --write``, stored in
    ``mtpctl/data/pass_costs.json``).

    ``ms`` is a pass of S one-row requests (a plain step of S requests); ``node_ms`` what E draft
    nodes add to that pass (spread over the requests as draft trees of up to 4 nodes), each measured
    as the median of differences between passes timed next to each other, so that a drifting machine
    does not blur a difference of a millisecond between two tables timed apart. A pass of S
    requests carrying W rows costs ``ms(S) + node_ms(S, W - S)``, linear between the measured points
    (and from no nodes at no cost); a node count's values across request counts are read through a
    running median of three, so one low median (a node priced at half what it costs beside one
    request fewer and one more) does not make drafting look cheap there. Without ``node_ms`` a draft
    node costs what another request's
    row does.

    Attributes:
        rows: ``[K]`` increasing request counts S measured.
        ms: ``[K]`` the median time of a pass of that many one-row requests, ms.
        nodes: ``[E]`` increasing draft-node counts measured; empty when not measured.
        node_ms: ``[K][E]`` the median time those nodes add to the pass of ``rows[k]`` requests, ms.
    """

    rows: Tuple[int, ...]
    ms: Tuple[float, ...]
    nodes: Tuple[int, ...] = ()
    node_ms: Tuple[Tuple[float, ...], ...] = ()

    def __call__(self, sequences: float, rows: Optional[float] = None) -> float:
        """The cost of a pass of ``sequences`` requests carrying ``rows`` rows in all (default: one row
        each), ms."""
        return self.at(sequences)(sequences if rows is None else rows)

    def at(self, sequences: float) -> Callable[[float], float]:
        """``rows -> ms`` of a pass of ``sequences`` requests: the table at one request count, its
        interpolation across request counts done once (the policy prices many row counts a step)."""
        return _curve(self, sequences)


def _running_median(values: Sequence[float]) -> Tuple[float, ...]:
    """Each value replaced by the median of itself and its two neighbours (the first and last kept): one
    measured point far from both of its neighbours is taken for noise."""
    inner = [sorted(values[i - 1:i + 2])[1] for i in range(1, len(values) - 1)]
    return tuple(values[:1]) + tuple(inner) + tuple(values[-1:]) if len(values) > 2 else tuple(values)


@lru_cache(maxsize=256)
def _curve(costs: PassCosts, sequences: float) -> Callable[[float], float]:
    """:meth:`PassCosts.at`: what the nodes add, interpolated across request counts for each node
    count measured (each node count's values across request counts smoothed by a running median of
    three, never below 0, never less than fewer nodes add), then linear in the nodes from no nodes at
    no cost."""
    if not costs.nodes:
        return partial(_interpolate, costs.rows, costs.ms)
    base = _interpolate(costs.rows, costs.ms, sequences)
    points = (0,) + costs.nodes
    added = [0.0]
    for j in range(len(costs.nodes)):  # more nodes never cost less (a noisy median can dip)
        column = _running_median([row[j] for row in costs.node_ms])
        added.append(max(added[-1], _interpolate(costs.rows, column, sequences)))
    return partial(_plus_nodes, base, points, tuple(added), sequences)


def _plus_nodes(base: float, points: Tuple[int, ...], added: Tuple[float, ...], sequences: float, rows: float) -> float:
    return base + _interpolate(points, added, rows - sequences)


@dataclass(frozen=True)
class DraftCost:
    """What drafting adds to a step outside the pass, for one drafter in one numeric mode (measured by
    ``benchmarks/bench_draft_costs.py``, stored beside the pass costs): ``call_ms`` once a step where
    any row drafts (MTP heads run once over every drafting row) and ``row_ms`` per drafting row.
    Zero where not measured: the pass alone is priced."""

    call_ms: float = 0.0
    row_ms: float = 0.0

    def __call__(self, drafting: int) -> float:
        """ms a step spends drafting for ``drafting`` rows."""
        return self.call_ms + self.row_ms * drafting if drafting > 0 else 0.0


class CostModelPolicy:
    """``--speculate-policy auto``: drafts only where they are expected to pay for the rows they add.

    Each row keeps means of the draft tokens it got accepted and of the nodes it drafted, over the
    steps it drafted: running means (weight ``decay`` on the past) that start from ``prior_steps``
    outcomes' worth of the pooled means of every row observed so far (before any, one accepted token
    for the whole room), so one failed first draft does not stop a row whose drafts pay on average
    (acceptance of a single step is a coin toss); and the same for each size k its tree could have
    been cut to (its first k nodes), from what the target kept of it (``by_size`` in
    :meth:`observe`). A step's cost is the measured cost of a pass of its requests and rows
    (:class:`PassCosts`). Each step starts from every row's pending
    token alone (one row each, one token each) and admits the rows' drafts in order of accepted tokens
    per node, each at the size that raises the expected tokens per ms most, while it rises. So a lone
    request drafts whenever its drafts are worth their rows, and cuts them where a node costs more
    than it brings (in int4 a fifth row costs a pass far more than a fourth); a full batch drafts
    less or not at all, and a row whose drafts keep failing stops drafting. A row left out or cut
    short drafts its whole budget now and then to measure itself again (a probe): a row never
    measured first, else the one held back longest (at least ``probe_every`` steps), while the probes
    add at most ``probe_share`` of the expected step time (a probe that adds 4 rows to a pass of 16
    costs a fifth of that step: one every step would cost more than any draft gains). Decisions
    depend on the outcomes and the table only, never on the clock, so a seeded sampled request gives
    the same tokens on every run. A step's cost also counts what drafting itself takes outside the
    pass (``draft``: the drafter's call and its rows), so near the break-even a batch does not draft
    where the drafter's own work eats the gain.

    Args:
        costs: the pass costs of the mode the session runs (:class:`PassCosts`).
        draft: what the session's drafter adds to a step where rows draft (:class:`DraftCost`).
        decay: weight of the past in the running means.
        probe_every: steps a row is held back before it may probe.
        probe_share: the most of the expected step time that probes may add.
        prior_steps: the weight, in outcomes, of the pooled means a row's own means start from.
    """

    def __init__(self, costs: PassCosts, draft: DraftCost = DraftCost(), decay: float = 0.9, probe_every: int = 4,
                 probe_share: float = 0.03, prior_steps: float = 2.0):
        self.costs, self.decay, self.probe_every, self.probe_share = costs, decay, probe_every, probe_share
        self.draft, self.prior_steps = draft, prior_steps
        # running means [steps, accepted tokens, nodes]: of a row's drafts whose cuts are not known, and
        # of each cut k of the drafts whose cuts are (by_size in observe)
        self._whole: Dict[int, List[float]] = {}
        self._cuts: Dict[int, Dict[int, List[float]]] = {}
        # the same means pooled over every row (plain means of every outcome): a new row's prior
        self._pooled_whole: List[float] = [0, 0.0, 0.0]
        self._pooled_cuts: Dict[int, List[float]] = {}
        self._held_back: Dict[int, int] = {}  # steps since the row last drafted its whole room
        self._outcomes: Dict[int, int] = {}  # drafting steps observed per row
        self._probe_credit = float("inf")  # ms probes may still add (see _probe); the first probe is free

    def draft_sizes(self, rooms: Sequence[int], rows: Sequence[int]) -> list:
        sizes, nodes = [0] * len(rows), [0.0] * len(rows)
        tokens, width, drafting = float(len(rows)), float(len(rows)), 0
        cost = self.costs.at(len(rows))  # ms of a pass of these rows' requests by its rows

        def step(width: float, drafting: int) -> float:  # ms of the step: its pass and its drafting
            return cost(width) + self.draft(drafting)

        order = sorted((i for i, room in enumerate(rooms) if room > 0), key=lambda i: -self._value(rows[i], rooms[i]))
        for i in order:
            best, rate = None, tokens / step(width, drafting)
            for size, gain, count in self._options(rows[i], rooms[i]):
                if (tokens + gain) / step(width + count, drafting + 1) > rate:
                    best, rate = (size, gain, count), (tokens + gain) / step(width + count, drafting + 1)
            if best is not None:
                sizes[i], nodes[i] = best[0], best[2]
                tokens, width, drafting = tokens + best[1], width + best[2], drafting + 1
        self._probe(sizes, nodes, rooms, rows, order, width, drafting, step)
        for i in order:
            self._held_back[rows[i]] = 0 if sizes[i] == rooms[i] else self._held_back.get(rows[i], 0) + 1
        return sizes

    def _options(self, row: int, room: int) -> List[Tuple[int, float, float]]:
        """(size, expected accepted tokens, expected nodes) of each size the row may draft: every cut
        smaller than its room it has measured, and its room (:meth:`_full`)."""
        cuts = self._cuts.get(row, {})
        return [(k, cuts[k][1], cuts[k][2]) for k in range(1, room) if k in cuts] + [(room,) + self._full(row, room)]

    def _full(self, row: int, room: int) -> Tuple[float, float]:
        """(expected accepted tokens, expected nodes) of the row's whole room: its cut at the room (at
        the largest it was allowed, when never allowed so much), else the means of its drafts (1 token
        for the whole room before any)."""
        cuts = self._cuts.get(row)
        if cuts:
            _, accepted, nodes = cuts[min(room, max(cuts))]
            return accepted, nodes
        _, accepted, nodes = self._whole.get(row, (0, 1.0, float(room)))
        return accepted, min(nodes, float(room))

    def _probe(self, sizes: list, nodes: list, rooms: Sequence[int], rows: Sequence[int], order: Sequence[int],
               width: float, drafting: int, step: Callable[[float, int], float]) -> None:
        """Lets one row held back draft its whole room anyway (sets its size): one never measured first,
        else the one held back longest (at least ``probe_every`` steps), when the probes' credit covers
        what it adds to the step of ``width`` rows, ``drafting`` of them drafting (``step``: ms of the
        step by its rows and drafting rows). The credit grows by ``probe_share`` of each step's expected
        cost, up to one step's or one probe's."""
        step_ms = step(width, drafting)
        waiting = [i for i in order if sizes[i] < rooms[i]
                   and (rows[i] not in self._outcomes or self._held_back.get(rows[i], 0) >= self.probe_every)]
        probe = max(waiting, key=lambda i: (rows[i] not in self._outcomes, self._held_back.get(rows[i], 0)), default=None)
        extra = 0.0
        if probe is not None:
            full = self._full(rows[probe], rooms[probe])[1]
            extra = step(width + max(0.0, full - nodes[probe]), drafting + (sizes[probe] == 0)) - step_ms
        self._probe_credit = min(self._probe_credit + self.probe_share * step_ms, max(step_ms, extra))
        if probe is not None and extra <= self._probe_credit:
            sizes[probe], self._probe_credit = rooms[probe], self._probe_credit - extra

    def _value(self, row: int, room: int) -> float:
        """Expected accepted tokens per drafted node."""
        accepted, nodes = self._full(row, room)
        return accepted / max(nodes, 1e-3)

    @staticmethod
    def _update(entry: List[float], accepted: float, nodes: float, decay: float = 1.0) -> None:
        """One more outcome into running means ``[steps, accepted, nodes]``: a plain mean over the first
        outcomes (the prior's counted as steps), then weight ``decay`` on the past."""
        entry[0] += 1
        w = max(1.0 - decay, 1.0 / entry[0])
        entry[1] += w * (accepted - entry[1])
        entry[2] += w * (nodes - entry[2])

    def _learn(self, means: Dict[int, List[float]], key: int, pooled: List[float], accepted: float,
               nodes: float, share: float = 1.0) -> None:
        """One outcome into a row's means and into the pooled ones. A row's new means start from
        ``prior_steps`` outcomes of the pooled means, or before any outcome of the prior of an
        unmeasured row: one accepted token for the whole room (``share`` of it for a cut of the tree)."""
        if key not in means:
            means[key] = [self.prior_steps] + ([pooled[1], pooled[2]] if pooled[0] else [share, nodes])
        self._update(means[key], accepted, nodes, self.decay)
        self._update(pooled, accepted, nodes)

    def observe(self, row: int, drafted: int, accepted: int, by_size: Optional[Sequence[int]] = None) -> None:
        if drafted == 0:
            return  # a plain step (chosen, or the drafter found nothing): nothing learnt about its drafts, no rows spent
        self._outcomes[row] = self._outcomes.get(row, 0) + 1
        if not by_size:
            self._learn(self._whole, row, self._pooled_whole, accepted, drafted)
            return
        cuts = self._cuts.setdefault(row, {})
        for k, kept in enumerate(by_size, start=1):
            self._learn(cuts, k, self._pooled_cuts.setdefault(k, [0, 0.0, 0.0]), kept, min(k, drafted),
                        k / len(by_size))


POLICIES = ("auto", "always")
COSTS_FILE = Path(__file__).resolve().parent.parent / "data" / "pass_costs.json"


def costs_file() -> Path:
    """The pass-cost table of this CPU's kind: ``pass_costs-ISA.json`` beside :data:`COSTS_FILE` where one
    was measured for the path the native matmuls take here (``avx2``: a CPU with AVX2 and FMA but no
    AVX512-BF16, where a verify row costs several times its share on an AVX512-BF16 one), else
    :data:`COSTS_FILE` (measured with AVX512-BF16)."""
    isa = matmul_isa()
    own = COSTS_FILE.with_name(f"pass_costs-{isa}.json") if isa else None
    return own if own is not None and own.is_file() else COSTS_FILE


def _check_table(costs: PassCosts) -> None:
    """Raises ValueError for a table the policy cannot interpolate: counts that do not rise from 1 or
    more, times that are not finite (JSON takes NaN), sizes that do not match."""
    for name, counts in (("request counts", costs.rows), ("node counts", costs.nodes)):
        if any(c < 1 for c in counts) or any(b <= a for a, b in zip(counts, counts[1:])):
            raise ValueError(f"{name} {list(counts)} do not rise from 1 or more")
    if not costs.rows:
        raise ValueError("no request counts")
    if len(costs.ms) != len(costs.rows):
        raise ValueError(f"{len(costs.rows)} request counts and {len(costs.ms)} times")
    if costs.nodes and (len(costs.node_ms) != len(costs.rows) or any(len(row) != len(costs.nodes) for row in costs.node_ms)):
        raise ValueError(f"node_ms is not {len(costs.rows)} rows of {len(costs.nodes)} times")
    if not all(math.isfinite(m) for m in costs.ms + tuple(m for row in costs.node_ms for m in row)):
        raise ValueError("a time that is not a finite number")


def load_costs(mode: str, path: Optional[Path] = None) -> PassCosts:
    """The pass costs of ``mode`` (``float32``, ``bfloat16``, ``int4``) from ``path`` (default: this CPU's
    table, :func:`costs_file`).

    Raises:
        BadInput: an unreadable file, or no costs for ``mode`` in it.
    """
    path = costs_file() if path is None else path
    try:
        table = json.loads(Path(path).read_text(encoding="utf-8"))
        entry = table["modes"][mode]
        costs = PassCosts(tuple(int(r) for r in entry["rows"]), tuple(float(m) for m in entry["ms"]),
                          tuple(int(n) for n in entry.get("nodes", ())),
                          tuple(tuple(float(m) for m in row) for row in entry.get("node_ms", ())))
        _check_table(costs)
        return costs
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise BadInput(f"no pass costs for mode {mode} in {path} ({err}): measure them with "
                       "benchmarks/bench_pass_costs.py (docs/batching.md)", option="speculate_policy") from err


def load_draft_cost(mode: str, method: Optional[str], path: Optional[Path] = None) -> DraftCost:
    """What the drafter of ``method`` (``heads+ngram``, ...) adds to a step in ``mode``, from the
    ``draft_ms`` entry of that mode in ``path`` (``{method: [call_ms, row_ms]}``); zero for a method
    not measured.

    Raises:
        BadInput: an unreadable file, or an entry that is not two finite times of 0 or more.
    """
    path = costs_file() if path is None else path
    try:
        entry = json.loads(Path(path).read_text(encoding="utf-8"))["modes"][mode].get("draft_ms", {}).get(method)
        if entry is None:
            return DraftCost()
        call_ms, row_ms = (float(m) for m in entry)
        if not (math.isfinite(call_ms) and math.isfinite(row_ms) and call_ms >= 0 and row_ms >= 0):
            raise ValueError(f"{entry} are not two finite times of 0 or more")
        return DraftCost(call_ms, row_ms)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise BadInput(f"no draft costs of {method} for mode {mode} in {path} ({err}): measure them with "
                       "benchmarks/bench_draft_costs.py (docs/batching.md)", option="speculate_policy") from err


def make_policy(name: str, mode: Optional[str], method: Optional[str] = None, costs: Optional[PassCosts] = None,
                draft: Optional[DraftCost] = None) -> Policy:
    """The policy ``name`` (:data:`POLICIES`) for a session running in ``mode`` (None: a backend
    that verifies one request per pass, where every row drafts as alone), its requests drafting with
    ``method`` (the ``--speculate`` value, which names the drafter's measured cost), priced by
    ``costs`` (default: this CPU's shipped table) and ``draft``, the drafter's cost (default: the
    shipped table's of ``method``); see :mod:`mtpctl.decode.cost_table` for the tables of the model
    and drafter in use.

    Raises:
        BadInput: an unknown name, or see :func:`load_costs` and :func:`load_draft_cost`.
    """
    if name not in POLICIES:
        raise BadInput(f"speculation policy {name!r}: choose {' or '.join(POLICIES)}", option="speculate_policy")
    if name == "always" or mode is None:
        return AlwaysDraft()
    return CostModelPolicy(load_costs(mode) if costs is None else costs,
                           load_draft_cost(mode, method) if draft is None else draft)
