"""Which pass-cost table prices the auto speculation policy, and a small one measured on first use.

A table (``mtpctl/data/pass_costs*.json``, or one cached under ``$MTPCTL_HOME/pass_costs``) records
where it was measured (its ``source``): the model's shape (:func:`model_identity`: what a pass costs
depends on the shape of the model, not on its weights' values), the CPU (its model name, its class:
:func:`cpu_class`, and the path the native matmuls take there), the threads, the commit and date.
:func:`choose_table` picks, for a session's model and mode on this CPU:

1. ``shipped``: a shipped table measured on a model of this shape, for this mode, on a CPU of this
   class (an AMD AVX512-BF16 table does not price an Intel CPU with AMX, nor an AVX2 one);
2. ``cached``: a table measured here before for this model shape, mode, CPU and threads;
3. ``measured-on-first-use``: else a small one measured now (a few pass sizes and repetitions,
   bounded by :data:`BUDGET_S` seconds), cached (written atomically) and used;
4. ``borrowed``: with :data:`SWITCH` set to ``off``, no measuring: the shipped table of this CPU's
   matmul path, measured on another model or another class of CPU (``policy_table.cpu_class`` and
   ``running_cpu_class`` in ``--json`` say which).

What drafting adds to a step outside the pass (a :class:`~mtpctl.decode.policy.DraftCost`) goes with
the table: :func:`with_draft_cost` reads a shipped table's ``draft_ms`` of the method where it was
measured with this drafter (``benchmarks/bench_draft_costs.py``; heads of the kind its ``draft_heads``
names), and otherwise measures the session's own drafter on first use (:func:`measure_draft`, under a
key naming the method and its settings), kept in the cached table or beside the shipped one.

A cached table that does not read is refused (BadInput naming the file), left as it is.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

from mtpctl.decode.drafter import TargetStep, propose_all
from mtpctl.decode.policy import DraftCost, PassCosts, costs_file, load_costs, load_draft_cost
from mtpctl.decode.tree import DraftTree
from mtpctl.errors import BadInput
from mtpctl.files import mtpctl_home, write_file
from mtpctl.model.native import matmul_isa
from mtpctl.model.native_build import cpu_flags

#: environment variable: ``off`` (or 0, false, no) stops measuring a table on first use
SWITCH = "MTPCTL_MEASURE_POLICY"
#: the seconds a first-use measurement aims to stay within (its smallest plan runs whatever it costs)
BUDGET_S = 5.0
#: the format of the tables' JSON (4: a ``source`` records where the table was measured)
TABLE_VERSION = 4
#: the measurement plans, largest first: (request counts, draft-node counts, repetitions)
PLANS = (((1, 2, 4, 8), (2, 4, 8), 3), ((1, 2, 4), (2, 4), 2), ((1, 4), (4,), 1))
CONTEXT = 64  # committed tokens per sequence before a measured pass
TREE_NODES = 4  # draft nodes per request in a measured pass
#: a drafter's cost on first use: the request counts proposed for together (row_ms from their
#: difference) and the timed proposals of each (their median is kept)
DRAFT_ROWS = (1, 4)
DRAFT_REPS = 5


@dataclass(frozen=True)
class TableChoice:
    """The table the auto policy reads and where it came from.

    Attributes:
        source: ``shipped``, ``cached``, ``measured-on-first-use`` or ``borrowed``.
        path: the table's file.
        costs: its pass costs for ``mode``.
        mode: the numeric mode.
        model: the model the table was measured on (its recorded source's ``model``).
        cpu: the CPU it was measured on (model name and matmul path).
        cpu_class: that CPU's class (:func:`cpu_class`).
        draft: what the session's drafter adds to a step where rows draft (zero until
            :func:`with_draft_cost` prices it).
        draft_source: where ``draft`` came from: ``shipped`` (the table's ``draft_ms`` of the method),
            ``cached``, ``measured-on-first-use``, or None before it is priced.
    """

    source: str
    path: Path
    costs: PassCosts
    mode: str
    model: dict
    cpu: str
    draft: DraftCost = DraftCost()
    draft_source: Optional[str] = None
    cpu_class: str = ""

    def describe(self) -> dict:
        """The ``policy_table`` field of a JSON result."""
        draft = {"source": self.draft_source, "call_ms": self.draft.call_ms, "row_ms": self.draft.row_ms}
        return {"source": self.source, "model": self.model, "mode": self.mode, "cpu": self.cpu,
                "cpu_class": self.cpu_class, "running_cpu_class": cpu_class(), "path": str(self.path), "draft": draft}


def model_identity(cfg) -> dict:
    """What identifies a model's pass costs: its config's type and shape (a DecoderConfig), as its family
    says (:meth:`mtpctl.model.families.Family.cost_identity`)."""
    return cfg.family.cost_identity(cfg)


def _cpuinfo(field: str) -> Optional[str]:
    """The first value of ``field`` in /proc/cpuinfo (None where there is none or it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":")[0].strip() == field:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (or platform's answer)."""
    return _cpuinfo("model name") or platform.processor() or "unknown"


#: /proc/cpuinfo's vendor_id -> the vendor a CPU class names
VENDORS = {"AuthenticAMD": "amd", "GenuineIntel": "intel"}


def cpu_class() -> str:
    """The class of CPU a pass-cost table holds for: where verify rows cost alike. ``avx2`` and
    ``portable`` (the native matmul's path, any vendor), ``torch`` (no native matmul), and for
    AVX512-BF16 the vendor too, with ``amx`` where the CPU has AMX tiles (``amd avx512-bf16``, ``intel
    avx512-bf16 amx``): the libraries under torch pick other kernels there."""
    isa = matmul_isa()
    if isa != "avx512-bf16":
        return isa or "torch"
    vendor = VENDORS.get(_cpuinfo("vendor_id") or "", "other")
    return f"{vendor} {isa}" + (" amx" if "amx_bf16" in cpu_flags() else "")


def class_of(source: dict) -> str:
    """The CPU class a table's ``source`` was measured on: its ``cpu_class``, or for a table that
    records none, one read from its CPU's name and matmul path (AMX unknown: taken as absent)."""
    if source.get("cpu_class"):
        return str(source["cpu_class"])
    isa = source.get("matmul_isa")
    if isa != "avx512-bf16":
        return isa or "torch"
    name = str(source.get("cpu", ""))
    vendor = "amd" if "AMD" in name else "intel" if "Intel" in name else "other"
    return f"{vendor} {isa}"


def table_source(identity: dict, name: Optional[str] = None, threads: Optional[int] = None,
                 commit: Optional[str] = None) -> dict:
    """The ``source`` a table measured here now records: model identity (and ``name``, for people),
    CPU, matmul path, threads, torch, commit and date."""
    return {"model": {**identity, **({"name": name} if name else {})}, "cpu": cpu_name(), "cpu_class": cpu_class(),
            "matmul_isa": matmul_isa(),
            "threads": threads or torch.get_num_threads(), "torch": torch.__version__, "commit": commit,
            "date": datetime.date.today().isoformat()}


def measuring_on() -> bool:
    """Whether :data:`SWITCH` leaves first-use measuring on (unset, or anything but 0/false/off/no)."""
    return os.environ.get(SWITCH, "on").strip().lower() not in ("0", "false", "off", "no")


def read_source(path: Path) -> dict:
    """The ``source`` a table file records ({} where it records none or does not read)."""
    try:
        return dict(json.loads(Path(path).read_text(encoding="utf-8")).get("source") or {})
    except (OSError, ValueError, AttributeError, TypeError):
        return {}


def _same_model(source: dict, identity: dict) -> bool:
    """Whether a table's source was measured on a model of ``identity``'s shape."""
    recorded = source.get("model") or {}
    return isinstance(recorded, dict) and all(recorded.get(k) == v for k, v in identity.items())


def _cpu_label(source: dict) -> str:
    threads = source.get("threads")
    return f"{source.get('cpu', 'unknown')} ({source.get('matmul_isa')}, {threads} thread{'' if threads == 1 else 's'})"


def cache_path(identity: dict, mode: str, threads: int, prefix: str = "") -> Path:
    """Where the table of this model shape, mode, CPU and threads is cached (``prefix``: another file of
    the same key, :func:`draft_cache_path`)."""
    key = json.dumps([identity, mode, cpu_name(), matmul_isa(), threads], sort_keys=True)
    return mtpctl_home() / "pass_costs" / f"{prefix}{mode}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def choose_table(identity: dict, mode: str, measure: Optional[Callable[[], PassCosts]] = None) -> TableChoice:
    """The table for a model of ``identity`` in ``mode`` here (see the module's docstring); ``measure``
    measures one now (None: never measure, borrow).

    Raises:
        BadInput: a shipped table that does not read, or a damaged cached one (left as it is).
    """
    shipped = costs_file()
    source = read_source(shipped)
    if _same_model(source, identity) and class_of(source) == cpu_class():
        return TableChoice("shipped", shipped, load_costs(mode, shipped), mode, source.get("model"), _cpu_label(source),
                           cpu_class=class_of(source))
    threads = torch.get_num_threads()
    cached = cache_path(identity, mode, threads)
    if cached.is_file():
        try:
            costs = load_costs(mode, cached)
        except BadInput as err:
            raise BadInput(f"the pass-cost table cached at {cached} is damaged ({err}): delete it to measure "
                           "it again", option="speculate_policy") from err
        own = read_source(cached)
        return TableChoice("cached", cached, costs, mode, own.get("model"), _cpu_label(own), cpu_class=class_of(own))
    if measure is None or not measuring_on():
        return TableChoice("borrowed", shipped, load_costs(mode, shipped), mode, source.get("model"),
                           _cpu_label(source), cpu_class=class_of(source))
    costs = measure()
    own = table_source(identity, threads=threads)
    _cache(cached, table_document({mode: costs_entry(costs)}, own, "measured on first use"))
    return TableChoice("measured-on-first-use", cached, costs, mode, own["model"], _cpu_label(own),
                       cpu_class=own["cpu_class"])


def with_draft_cost(choice: TableChoice, method: str, key: str, measure: Optional[Callable[[], DraftCost]] = None,
                    heads_kind: Optional[str] = None) -> TableChoice:
    """``choice`` with its drafter's cost (what a step spends drafting outside the pass):

    - a shipped or borrowed table's ``draft_ms`` of ``method``, where it has one measured with this
      drafter (heads methods: heads of ``heads_kind``, the kind the table's ``draft_heads`` names);
    - else a cost measured here before under ``key`` (the method and a fingerprint of its settings),
      kept in the table's own file for a table measured here, else in :func:`draft_cache_path`;
    - else one measured now by ``measure`` and kept there;
    - with measuring off or ``measure`` None, the shipped table's ``draft_ms`` of ``method`` whatever
      it was measured with (zero where it has none).

    Raises:
        BadInput: a ``draft_ms`` entry that does not read, or a damaged cache file (left as it is).
    """
    measured_here = choice.source in ("cached", "measured-on-first-use")
    if not measured_here:
        shipped = shipped_draft_cost(choice.path, choice.mode, method, heads_kind)
        if shipped is not None:
            return dataclasses.replace(choice, draft=shipped, draft_source="shipped")
    path = choice.path if measured_here else draft_cache_path(choice.model, choice.mode, torch.get_num_threads())
    stored = _stored_draft_cost(path, choice.mode, key)
    if stored is not None:
        return dataclasses.replace(choice, draft=stored, draft_source="cached")
    if measure is not None and measuring_on():
        draft = measure()
        _cache_draft_cost(path, choice.mode, key, draft, choice.model)
        return dataclasses.replace(choice, draft=draft, draft_source="measured-on-first-use")
    return dataclasses.replace(choice, draft=load_draft_cost(choice.mode, method, costs_file()), draft_source="shipped")


def shipped_draft_cost(path: Path, mode: str, method: str, heads_kind: Optional[str]) -> Optional[DraftCost]:
    """The ``draft_ms`` of ``method`` in the table at ``path``, where it was measured with this drafter
    (for heads methods, heads of the kind its ``draft_heads`` names); None where it has none."""
    try:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
        entry = document["modes"][mode].get("draft_ms", {}).get(method)
        measured_with = document.get("draft_heads")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # the pass costs of this file were read already: load_costs names what is wrong with it
    if entry is None or ("heads" in method.split("+") and measured_with != heads_kind):
        return None
    return load_draft_cost(mode, method, path)


def draft_cache_path(model: dict, mode: str, threads: int) -> Path:
    """Where drafter costs measured here beside a shipped table are kept, for a model of this shape,
    mode, CPU and threads."""
    return cache_path(model, mode, threads, prefix="draft-")


def _stored_draft_cost(path: Path, mode: str, key: str) -> Optional[DraftCost]:
    """The drafter cost the file at ``path`` keeps under ``key`` (None where it keeps none).

    Raises:
        BadInput: a file that does not read (left as it is).
    """
    if not path.is_file():
        return None
    try:
        stored = json.loads(path.read_text(encoding="utf-8")).get("modes", {}).get(mode, {}).get("draft_ms", {})
        return load_draft_cost(mode, key, path) if key in stored else None
    except (OSError, ValueError, TypeError, AttributeError, BadInput) as err:
        raise BadInput(f"the cost table cached at {path} is damaged ({err}): delete it to measure it again",
                       option="speculate_policy") from err


def _cache_draft_cost(path: Path, mode: str, key: str, draft: DraftCost, model: dict) -> None:
    """Keep ``draft`` under ``key`` in the file at ``path`` (a table measured here, or a drafter-cost
    file made now), rewritten atomically."""
    document = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {
        "version": TABLE_VERSION, "what": "draft_ms[method and settings]: [call_ms, row_ms] of drafters measured "
        "here on first use, beside a shipped pass-cost table", "source": table_source(
            {k: v for k, v in model.items() if k != "name"}, model.get("name")), "modes": {}}
    document["modes"].setdefault(mode, {}).setdefault("draft_ms", {})[key] = [draft.call_ms, draft.row_ms]
    _cache(path, document)


def _cache(path: Path, document: dict) -> None:
    """Write a measured table to ``path`` atomically; where the cache cannot be written, the table is
    used uncached (measured again next time), with one warning line on stderr."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_file(path, json.dumps(document, indent=1) + "\n")
    except (OSError, BadInput) as err:
        print(f"mtpctl: warning: the measured pass-cost table was not cached ({err}); it will be measured again "
              "next time", file=sys.stderr)


def costs_entry(costs: PassCosts) -> dict:
    """A mode's entry of a table file."""
    return {"rows": list(costs.rows), "ms": [round(m, 3) for m in costs.ms], "nodes": list(costs.nodes),
            "node_ms": [[round(m, 3) for m in row] for row in costs.node_ms]}


def table_document(modes: Dict[str, dict], source: dict, command: str, context: int = CONTEXT) -> dict:
    """A table file's JSON: its modes' entries and where they were measured."""
    return {"version": TABLE_VERSION,
            "what": "ms of one verify pass (logits of every row read), per numeric mode: ms of S one-row requests "
                    "(S in rows), node_ms[S][E] what E draft nodes (E in nodes) add to it (median of paired "
                    "differences)",
            "command": command, "source": source, "context": context, "modes": modes}


def tree_parents(n: int) -> list:
    """A root, a spine of depth 2 under its first child, and the rest as the root's children."""
    return [-1, 0, 1][:n] + [0] * max(0, n - 3)


def with_nodes(requests: int, nodes: int) -> list:
    """The draft trees of a pass of ``requests`` requests carrying ``nodes`` draft nodes: trees of up to
    :data:`TREE_NODES` nodes on the first requests, one-row requests after them."""
    drafting = min(requests, max(1, -(-nodes // TREE_NODES))) if nodes else 0
    counts = [nodes // drafting + (i < nodes % drafting) for i in range(drafting)] + [0] * (requests - drafting)
    return [DraftTree.from_parents([5] * (n + 1), tree_parents(n + 1)) for n in counts]


def time_pass(session, engines: Sequence, trees: Sequence) -> float:
    """ms of one packed pass of ``trees`` over ``engines`` with every row's logits read."""
    start = time.perf_counter()
    outs = session.verify_together(engines, trees)
    for out, tree in zip(outs, trees):
        out.prefetch(range(len(tree)))
    for out, tree in zip(outs, trees):
        for i in range(len(tree)):
            out[i]
    return (time.perf_counter() - start) * 1e3


def propose_ms(session, drafter, contexts: Sequence[Sequence[int]], rows: int, reps: int) -> float:
    """Median ms of one decode step's proposal for ``rows`` requests together, each a fork of
    ``drafter`` over one of ``contexts`` in turn: each rep forks afresh and lets the forks read the
    prompt's prefill (untimed, as after a request's prefill), runs an untimed packed pass of the pending
    tokens (so the drafter's weights are as cold as in the loop, where the target's pass runs between
    two drafts), then times the proposal after that pass committed one token; the first two reps are
    warm-ups."""
    room = drafter.budget
    chosen = [list(contexts[i % len(contexts)]) for i in range(rows)]
    engines, prefills = [], []
    for context in chosen:
        engine = session.new_engine(len(context) + room + 8, getattr(drafter, "aux_layers", ()))
        prefills.append(engine.prefill(context[:-1]))
        engines.append(engine)
    trees = [DraftTree(context[-1]) for context in chosen]
    times = []
    for _ in range(reps + 2):
        forks = [drafter.fork() for _ in range(rows)]
        propose_all(forks, [(context, room, TargetStep(out, 0)) for context, out in zip(chosen, prefills)])
        outs = session.verify_together(engines, trees)
        calls = [(context + [context[0]], room, TargetStep(out, 0, [0], tree))
                 for context, out, tree in zip(chosen, outs, trees)]
        start = time.perf_counter()
        propose_all(forks, calls)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[2:])


def draft_cost(one_ms: float, many_ms: float, many: int) -> DraftCost:
    """``call_ms`` and ``row_ms`` from the medians of proposals for one row and for ``many`` rows, ms to
    3 places as stored."""
    row_ms = max(0.0, (many_ms - one_ms) / (many - 1))
    return DraftCost(round(max(0.0, one_ms - row_ms), 3), round(row_ms, 3))


def measure_draft(session, drafter, vocab: int = 1000, reps: int = DRAFT_REPS) -> DraftCost:
    """What ``drafter`` adds to a step of ``session`` outside the pass: proposals for
    :data:`DRAFT_ROWS` requests over synthetic contexts of :data:`CONTEXT` tokens."""
    contexts = [[(100 + 7 * i + j) % (vocab - 1) + 1 for j in range(CONTEXT)] for i in range(max(DRAFT_ROWS))]
    with torch.inference_mode():
        one, many = (propose_ms(session, drafter, contexts, rows, reps) for rows in DRAFT_ROWS)
    return draft_cost(one, many, max(DRAFT_ROWS))


def measure_small(session, budget_s: float = BUDGET_S, vocab: int = 1000) -> PassCosts:
    """A small table for ``session`` (a session whose ``verify_together`` packs requests): the largest
    of :data:`PLANS` whose passes, priced by one timed pass of the most rows, fit ``budget_s``."""
    engines = []
    for i in range(8):
        engine = session.new_engine(CONTEXT + 12)
        engine.prefill([(100 + 7 * i + j) % (vocab - 1) + 1 for j in range(CONTEXT)])
        engines.append(engine)
    time_pass(session, engines[:1], with_nodes(1, 0))  # warm-up
    big = time_pass(session, engines, with_nodes(8, 8)) / 1e3
    rows, nodes, reps = next((p for p in PLANS if big * _passes(*p) <= budget_s), PLANS[-1])
    return _measure(session, engines, rows, nodes, reps)


def _passes(rows: Tuple[int, ...], nodes: Tuple[int, ...], reps: int) -> int:
    """Passes a plan times: a warm-up of each, then each pair ``reps`` times."""
    return len(rows) * (len(nodes) + 1) + 2 * reps * len(rows) * len(nodes)


def _measure(session, engines: Sequence, rows: Tuple[int, ...], nodes: Tuple[int, ...], reps: int) -> PassCosts:
    """The medians of one plan, ms to 3 places as stored: plain passes, and what the nodes add (paired, in
    turn first and last)."""
    for s in rows:
        for e in (0,) + nodes:
            time_pass(session, engines[:s], with_nodes(s, e))
    plain = {s: [] for s in rows}
    added = {(s, e): [] for s in rows for e in nodes}
    for rep in range(reps):
        for s in rows:
            for e in nodes:
                order = (0, e) if rep % 2 == 0 else (e, 0)
                t = {n: time_pass(session, engines[:s], with_nodes(s, n)) for n in order}
                added[s, e].append(t[e] - t[0])
                plain[s].append(t[0])
    return PassCosts(rows, tuple(round(statistics.median(plain[s]), 3) for s in rows), nodes,
                     tuple(tuple(round(statistics.median(added[s, e]), 3) for e in nodes) for s in rows))
