"""The decoding loop: prefill, then draft -> verify -> accept -> commit until a stop, for one request
or many at once (continuous batching).

One loop serves plain decoding (no drafter, or a drafter that proposes nothing), every kind of
speculation and any number of requests: each step, every active request (a row) drafts its own tree
(of the size the speculation policy gives it, possibly none), one pass verifies every row's tree
together, and each row accepts and commits its own path. A request joins when a row is free and
leaves at its own stop, without pausing the others beyond its prefill.

Glossary (also in docs/glossary.md):
- request: one prompt with its settings (:class:`Request`); its result comes back in input order.
- row: an active request: its engine (KV cache), drafter, stop checks, sampling generator and
  figures (:class:`_Row`).
- step: one verify pass over every active row.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch

from mtpctl.decode.acceptance import (Acceptance, accept_greedy, accept_greedy_together, accept_rejection_sampling,
                                      accept_sampled_exact, accept_typical)
from mtpctl.decode.drafter import Call, Drafter, TargetStep, family, finished, propose_all
from mtpctl.decode.engine import Engine, StepOutput
from mtpctl.decode.policy import AlwaysDraft, Policy, accepted_by_size
from mtpctl.decode.sampling import SamplingParams, next_token, position_uniform
from mtpctl.decode.stopping import CONTEXT, StopChecker
from mtpctl.decode.tree import DraftTree
from mtpctl.errors import InternalFault, MtpctlError, NonFinite, OutputClosed
from mtpctl.model.device import clock


@dataclass
class GenerationStats:
    """Figures of one generation; every count is of committed tokens only.

    ``tau`` (mean accepted length) is committed tokens per decode step, the bonus/recovered token
    counted, so plain decoding has tau = 1. ``acceptance_rate`` is accepted draft tokens over draft
    tokens verified (None when nothing was drafted). Times are in ms from the request's arrival (the
    start of the ``generate`` call), rates in tokens/s; TTFT covers waiting for a row, prefill and the
    first token; ``tokens_per_s`` is new tokens over the whole generation time; a step's time is that
    of the whole batch's step. On a GPU, phases are timed as run only under
    :func:`~mtpctl.model.device.timed_on` (``mtpctl bench``): elsewhere a phase's time lands in the next
    one that waits for the device.
    """

    prompt_tokens: int = 0
    new_tokens: int = 0
    decode_steps: int = 0  # verify passes after prefill
    accepted_tokens: int = 0  # draft tokens accepted and committed
    ttft_ms: Optional[float] = 0.0  # None where not observable (peers' runs)
    total_ms: float = 0.0
    accepted_per_step: List[int] = field(default_factory=list)  # accept length (bonus counted) per step
    drafted_per_step: List[int] = field(default_factory=list)  # draft tokens (tree nodes) verified per step
    depth_per_step: List[int] = field(default_factory=list)  # longest draft path per step (chain: its length)
    step_ms: List[float] = field(default_factory=list)  # wall time of each decode step
    # the decode steps' time by phase, summed over steps (ms): draft (the drafters), verify (the
    # target's pass), logits (lm_head rows read), accept, commit (KV commit, stop checks, streaming)
    phase_ms: Dict[str, float] = field(default_factory=dict)
    kv_cache_bytes: int = 0  # memory of the KV cache allocated for this generation
    # a hybrid model's Gated DeltaNet states kept per draft tree node: the most a verify pass held
    # (every node's state in every such layer, until commit keeps one), bytes; 0 for other models
    draft_state_bytes_max: int = 0
    # a hybrid draft model's Gated DeltaNet states kept to roll its last chain back (one per draft step
    # and such layer, the drafter's draft_state_bytes): the most it held at a step, bytes; 0 for other drafters
    drafter_state_bytes_max: int = 0
    # the device's memory peaks during this generation, bytes (device_peak_allocated_bytes,
    # device_peak_reserved_bytes: mtpctl.model.device.peak_memory), where bench measured them on CUDA; else {}
    device_memory: Dict[str, int] = field(default_factory=dict)

    @property
    def tau(self) -> Optional[float]:
        return sum(self.accepted_per_step) / self.decode_steps if self.decode_steps else None

    @property
    def draft_tokens(self) -> int:
        """Draft tokens verified, over all steps."""
        return sum(self.drafted_per_step)

    @property
    def acceptance_rate(self) -> Optional[float]:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / (self.total_ms / 1e3) if self.total_ms > 0 else 0.0

    def to_dict(self) -> dict:
        """All figures, derived ones included, as plain JSON-ready values (``device_memory`` only where measured)."""
        out = asdict(self)
        if not self.device_memory:
            del out["device_memory"]
        out.update(draft_tokens=self.draft_tokens, tau=self.tau, acceptance_rate=self.acceptance_rate,
                   tokens_per_s=self.tokens_per_s)
        return out


@dataclass
class GenerationResult:
    """Generated token ids (EOS included when it ended the output), text and statistics."""

    token_ids: List[int]
    text: str
    finish_reason: str  # eos | stop | length | context
    stats: GenerationStats


@dataclass
class Request:
    """One generation: ``prompt_ids`` ``[T]`` (T >= 1), its stop conditions (``stop``: EOS, stop
    strings, max new tokens), its sampling settings (each request draws from its own generator) and
    its own ``drafter`` (None: plain decoding; a drafter serves one request at a time, see
    :meth:`mtpctl.decode.drafter.Drafter.fork`). ``on_text`` receives each piece of text as soon as
    it is final (streaming)."""

    prompt_ids: Sequence[int]
    stop: StopChecker
    sampling: SamplingParams = SamplingParams()
    drafter: Optional[Drafter] = None
    on_text: Optional[Callable[[str], None]] = None


#: engines -> one verify pass over every engine's draft tree (``Session.verify_together``)
VerifyMany = Callable[[Sequence[Engine], Sequence[DraftTree]], List[StepOutput]]


def _all_finite(row: torch.Tensor) -> bool:
    """True when no value of ``row`` is NaN or infinite. A finite sum says so (a NaN or an infinity makes
    the sum NaN or infinite) in one reduction, about a tenth of what ``isfinite(row).all()`` costs on a
    row of 49k logits; only a sum that is not finite (or that overflowed) needs the full check."""
    return math.isfinite(float(row.sum())) or bool(torch.isfinite(row).all())


class _CheckedRows:
    """A pass's output as acceptance reads it: each row's logits checked for NaN and inf on the way (an
    argmax the output has already, ``greedy``, is of a finite row)."""

    def __init__(self, out: StepOutput, where: str):
        self.out, self.where = out, where

    def __len__(self) -> int:
        return len(self.out)

    def prefetch(self, rows: Sequence[int]) -> None:
        self.out.prefetch(rows)

    def greedy(self, i: int) -> Optional[int]:
        """Row i's argmax where the pass's output has it (finite rows only), else None (read the row)."""
        return self.out.greedy(i)

    def __getitem__(self, i: int) -> torch.Tensor:
        row = self.out[i]
        if not _all_finite(row):
            raise NonFinite(f"the target's logits hold NaN or inf ({self.where}, row {i % len(self.out)} of its draft "
                            "tree): its weights or this input overflow; no token was taken from them")
        return row


class _Row:
    """One active request: prefilled at construction, then stepped by :func:`run`."""

    def __init__(self, index: int, request: Request, engine: Engine, arrival: float):
        self.index, self.request, self.engine, self.arrival = index, request, engine, arrival
        self.stop, self.drafter = request.stop, request.drafter
        self.generator = request.sampling.generator()  # a sampled draft's rejection draws (draft models)
        self.seed = request.sampling.stream_seed()  # the target's draws: one uniform per position
        self.context = list(request.prompt_ids)  # prompt + committed output, the pending token last
        self.stats = GenerationStats(prompt_tokens=len(self.context), kv_cache_bytes=engine.kv_cache_bytes)
        self.budget = self.drafter.budget if self.drafter is not None else 0
        self.steps = 0
        out = engine.prefill(self.context)
        self.last = TargetStep(out, len(out) - 1)
        first = self._first_token(out)
        self.stats.ttft_ms = (clock() - arrival) * 1e3
        self.done = self._commit([first])

    def _first_token(self, out: StepOutput) -> int:
        """The token after the prompt, from prefill's last row: greedy takes the pass's own argmax where it
        has one (``greedy``: on a GPU only the id comes to the host), else reads the row (NaN and inf refused)."""
        rows, sampling = _CheckedRows(out, "prefill"), self.request.sampling
        token = rows.greedy(self.last.row) if sampling.greedy else None
        return token if token is not None else next_token(rows[self.last.row], sampling, self.uniform(0))

    def uniform(self, depth: int) -> float:
        """The uniform of the token ``depth`` places after the next one this row commits: keyed by the
        request's seed and that token's position in its sequence, whatever the step or the batch."""
        return position_uniform(self.seed, len(self.context) + depth)

    def room(self) -> int:
        """The most draft tokens this step may verify: the drafter's budget, the tokens left after
        the pending one, and the KV slots left after it."""
        return min(self.budget, self.stop.max_new_tokens - len(self.stop.tokens) - 1,
                   self.engine.capacity - self.engine.length - 1)

    def call(self, max_tokens: int) -> Call:
        """This step's arguments to the drafter's ``propose``."""
        return self.context, max_tokens, self.last

    def check(self, tree: DraftTree) -> DraftTree:
        """The drafter's tree for this step, checked: rooted at the pending token, distributions finite."""
        pending = self.context[-1]
        if tree.tokens[0] != pending:
            raise ValueError(f"the drafter's tree is rooted at token {tree.tokens[0]}, not the pending token {pending}")
        if tree.q is not None and not bool(torch.isfinite(tree.q).all()):
            raise NonFinite(f"the drafter's distributions hold NaN or inf (step {self.steps + 1}): no token was "
                            "taken from them")
        return tree

    def checked(self, out: StepOutput) -> _CheckedRows:
        """This step's pass output as acceptance reads it (NaN and inf refused, naming the step)."""
        return _CheckedRows(out, f"step {self.steps + 1}")

    def accept(self, tree: DraftTree, out: StepOutput, acceptance: str) -> Acceptance:
        """Which path of ``tree`` the target keeps (this row's sampling settings): greedy's argmax;
        when sampling, the target's own sample at each position for a deterministic draft (the same
        tokens whatever the drafter), rejection sampling for a draft sampled from the drafter's ``q``."""
        sampling, rows = self.request.sampling, self.checked(out)
        if sampling.greedy:
            return accept_greedy(tree, rows)
        if acceptance == "typical":
            return accept_typical(tree, rows, sampling, self.generator)
        if tree.q is None:
            return accept_sampled_exact(tree, rows, sampling, self.uniform)
        return accept_rejection_sampling(tree, rows, sampling, self.generator)

    def settle(self, tree: DraftTree, out: StepOutput, result: Acceptance) -> None:
        """Commit this step's accepted path of ``tree`` (``result``), check the stops."""
        self.steps += 1
        staged = getattr(self.engine, "draft_state_bytes", 0)  # read before commit frees them
        self.engine.commit(result.path)
        self.last = TargetStep(out, result.path[-1], list(result.path), tree)
        before = len(self.stop.tokens)
        self.done = self._commit(result.tokens)
        committed = len(self.stop.tokens) - before
        s = self.stats
        s.decode_steps += 1
        s.accepted_tokens += min(len(result.accepted), committed)
        s.accepted_per_step.append(committed)
        s.drafted_per_step.append(tree.drafted)
        s.depth_per_step.append(tree.depth)
        s.draft_state_bytes_max = max(s.draft_state_bytes_max, staged)
        s.drafter_state_bytes_max = max(s.drafter_state_bytes_max, getattr(self.drafter, "draft_state_bytes", 0))

    def _commit(self, tokens: Sequence[int]) -> bool:
        """Push tokens one by one until a stop; stream what became final. True when generation ended."""
        on_text = self.request.on_text
        for token in tokens:
            self.context.append(token)
            if self.stop.push(token):
                return True
        if on_text:
            piece = self.stop.stream()
            if piece:
                on_text(piece)
        return False

    def result(self) -> GenerationResult:
        """The finished generation; streams the last of its text."""
        self.stats.total_ms = (clock() - self.arrival) * 1e3
        self.stats.new_tokens = len(self.stop.tokens)
        if self.request.on_text:
            self.request.on_text(self.stop.stream())
        return GenerationResult(list(self.stop.tokens), self.stop.text, self.stop.finish_reason, self.stats)


Outcome = Union[GenerationResult, MtpctlError]


def run(requests: Sequence[Request], new_engine: Callable[[Request], Engine], verify_many: VerifyMany,
        max_batch: int = 1, policy: Optional[Policy] = None, acceptance: str = "exact",
        on_done: Optional[Callable[[int, Outcome], None]] = None) -> List[Outcome]:
    """Generate every request, up to ``max_batch`` at once, speculating with each request's drafter.

    Lossless: every request's greedy output equals plain greedy decoding of it alone, token for
    token, whatever the batch and the draft sizes; sampled output follows the target's
    distribution (speculative rejection sampling), each request drawing from its own generator.

    Args:
        requests: the generations, in input order.
        new_engine: an engine (KV cache) sized for a request.
        verify_many: verifies several engines' draft trees in one pass.
        max_batch: the most requests decoded at once; the others wait for a free row, in order.
        policy: how many draft tokens each row may verify each step (default: every row its
            drafter's whole budget, :class:`~mtpctl.decode.policy.AlwaysDraft`).
        acceptance: ``exact`` (lossless: greedy or rejection sampling) or ``typical`` (Medusa's
            typical acceptance when sampling: lossy, see :func:`accept_typical`).
        on_done: called with a request's index and outcome as soon as it is known.

    Returns:
        one outcome per request, in input order: its :class:`GenerationResult`, or the
        :class:`~mtpctl.errors.MtpctlError` that ended it (a NaN in its logits, ...; an
        :class:`~mtpctl.errors.InternalFault` for a bug met in its own prefill, drafting, acceptance or
        commit, such as a draft tree not rooted at the pending token); a failed request does not
        disturb the others. A fault in the pass shared by every row ends the run.

    Raises:
        ValueError: an empty prompt or a prompt that leaves no room in its engine.
    """
    policy = policy or AlwaysDraft()
    arrival = clock()
    waiting = list(range(len(requests)))
    outcomes: List[Optional[Outcome]] = [None] * len(requests)
    reported: set = set()
    rows: List[_Row] = []
    while waiting or rows:
        waited = {r.index for r in rows}  # rows that wait while newcomers are prefilled
        admit_start = clock()
        while waiting and len(rows) < max_batch:
            index = waiting.pop(0)
            row = _admit(index, requests[index], new_engine, arrival, outcomes)
            rows += [row] if row is not None else []
        for row in rows:
            if row.engine.length + 1 > row.engine.capacity:
                row.stop.end(CONTEXT)
                row.done = True
        rows = _finish(rows, outcomes)
        if rows:
            admit_ms = (clock() - admit_start) * 1e3
            _step(rows, verify_many, policy, acceptance, outcomes, waited, admit_ms)
            rows = _finish(rows, outcomes)
        for index, outcome in enumerate(outcomes):
            if outcome is not None and index not in reported:
                reported.add(index)
                if on_done:
                    on_done(index, outcome)
    return outcomes


def _step(rows: List[_Row], verify_many: VerifyMany, policy: Policy, acceptance: str, outcomes: list,
          waited: set, admit_ms: float) -> None:
    """One step of every active row: draft (the policy's sizes), one pass over every tree, accept
    and commit each row's path; a row whose drafter or logits failed ends with its error."""
    times = [clock()]  # each a timer boundary: on a GPU under bench, after the device's queued work (timed_on)

    def lap() -> float:  # ms since the last lap
        times.append(clock())
        return (times[-1] - times[-2]) * 1e3

    sizes = policy.draft_sizes([r.room() for r in rows], [r.index for r in rows])
    allowed = {row.index: min(size, row.room()) for row, size in zip(rows, sizes)}
    trees = _propose(rows, [allowed[row.index] for row in rows], outcomes)
    rows = [r for r in rows if not r.done]
    if not rows:
        return
    phases = {"draft": lap()}
    outs = verify_many([r.engine for r in rows], [trees[r.index] for r in rows])
    phases["verify"] = lap()
    results = _accept_all(rows, trees, outs, acceptance, outcomes)
    phases["accept"] = lap()
    logits_ms = sum({id(s): s.ms for s in (o.logits_timer for o in outs) if s is not None}.values())
    phases["logits"], phases["accept"] = logits_ms, phases["accept"] - logits_ms
    for row, out, result in zip(rows, outs, results):
        if result is None:
            continue
        tree = trees[row.index]
        try:
            row.settle(tree, out, result)
        except Exception as err:  # noqa: BLE001 - this row's fault, recorded as its outcome (_row_error)
            outcomes[row.index], row.done = _row_error(err, "committing its tokens"), True
            continue
        accepted = row.stats.accepted_per_step[-1] - 1
        by_size = accepted_by_size(result.path, accepted, allowed[row.index]) if tree.extra is None else None
        policy.observe(row.index, tree.rows - 1, accepted, by_size)
    phases["commit"] = lap()
    step_ms = (times[-1] - times[0]) * 1e3
    for row in rows:
        if outcomes[row.index] is None:
            row.stats.step_ms.append(step_ms + (admit_ms if row.index in waited else 0.0))
            for phase, ms in phases.items():
                row.stats.phase_ms[phase] = row.stats.phase_ms.get(phase, 0.0) + ms


def _admit(index: int, request: Request, new_engine: Callable[[Request], Engine], arrival: float,
           outcomes: list) -> Optional[_Row]:
    """A row for ``request``, prefilled; None when its prefill failed (its outcome recorded)."""
    if not request.prompt_ids:
        raise ValueError("the prompt has no tokens")
    engine = new_engine(request)
    if len(request.prompt_ids) >= engine.capacity:
        raise ValueError(f"the prompt has {len(request.prompt_ids)} tokens; the context holds {engine.capacity}")
    try:
        return _Row(index, request, engine, arrival)
    except Exception as err:  # noqa: BLE001 - this row's fault, recorded as its outcome (_row_error)
        outcomes[index] = _row_error(err, "prefill")
        return None


def _row_error(err: Exception, where: str) -> MtpctlError:
    """What ends one row: its own :class:`~mtpctl.errors.MtpctlError`, or an
    :class:`~mtpctl.errors.InternalFault` (the exception as its cause) for any other exception its own
    work raised (a bug), so that the other rows go on. stdout closed by its reader ends the whole run."""
    if isinstance(err, OutputClosed):
        raise err
    if isinstance(err, MtpctlError):
        return err
    fault = InternalFault(f"internal error in this request ({where}): {type(err).__name__}: {err}")
    fault.__cause__ = err
    return fault


def _propose(rows: List[_Row], sizes: Sequence[int], outcomes: list) -> dict:
    """Each row's tree for this step (request index -> tree): its drafter's proposal of up to its size,
    rows whose drafters share a family proposing together (:func:`propose_all`); the pending token alone for a
    row without a drafter. A drafter sees every step, a size of 0 included (an EAGLE layer keeps its
    cache in step with the target's). A row whose drafter failed ends with its error."""
    trees, groups = {}, {}
    for row, size in zip(rows, sizes):
        if row.drafter is None:
            trees[row.index] = DraftTree(row.context[-1])
        else:
            groups.setdefault(family(row.drafter), []).append((row, max(size, 0)))
    for group in groups.values():
        try:
            proposed = propose_all([row.drafter for row, _ in group], [row.call(size) for row, size in group])
        except Exception as err:  # noqa: BLE001 - one row's fault: find it, the others draft again alone
            _row_error(err, "drafting")  # stdout closed ends the run
            proposed = [err] if len(group) == 1 else [None] * len(group)
        for (row, size), tree in zip(group, proposed):
            try:
                if isinstance(tree, Exception):  # this row's own error (propose_forks, or a lone row's)
                    raise tree
                trees[row.index] = row.check(tree if tree is not None else row.drafter.propose(*row.call(size)))
            except Exception as err:  # noqa: BLE001 - this row's fault, recorded as its outcome (_row_error)
                outcomes[row.index], row.done = _row_error(err, "drafting"), True
    return trees


def _accept_all(rows: List[_Row], trees: dict, outs: List[StepOutput], acceptance: str,
                outcomes: list) -> List[Optional[Acceptance]]:
    """Every row's acceptance of its tree: the greedy rows' logits asked for together
    (:func:`accept_greedy_together`: one lm_head call where the backend can), sampled rows one by
    one. A row whose logits hold NaN or inf ends with that error (None)."""
    results: List[Optional[Acceptance]] = [None] * len(rows)
    greedy = [i for i, row in enumerate(rows) if row.request.sampling.greedy]
    try:
        together = accept_greedy_together([trees[rows[i].index] for i in greedy],
                                          [rows[i].checked(outs[i]) for i in greedy])
        for i, result in zip(greedy, together):
            results[i] = result
    except Exception as err:  # noqa: BLE001 - find the row(s) at fault one by one; the others read again
        _row_error(err, "accepting")  # re-raises stdout closed
        for i in greedy:
            results[i] = _accept_one(rows[i], trees, outs[i], acceptance, outcomes)
    for i, row in enumerate(rows):
        if i not in greedy:
            results[i] = _accept_one(row, trees, outs[i], acceptance, outcomes)
    return results


def _accept_one(row: _Row, trees: dict, out: StepOutput, acceptance: str, outcomes: list) -> Optional[Acceptance]:
    try:
        return row.accept(trees[row.index], out, acceptance)
    except Exception as err:  # noqa: BLE001 - this row's fault, recorded as its outcome (_row_error)
        outcomes[row.index], row.done = _row_error(err, "accepting its draft"), True
        return None


def _finish(rows: List[_Row], outcomes: list) -> List[_Row]:
    """Record the finished rows' results; the rows still active."""
    active = []
    for row in rows:
        if not row.done:
            active.append(row)
        elif outcomes[row.index] is None:
            outcomes[row.index] = _result(row)
    return active


def _result(row: _Row) -> Outcome:
    """A finished row's result, after its drafter has been told what the request wrote
    (:func:`~mtpctl.decode.drafter.finished`)."""
    result = row.result()
    try:
        finished(row.drafter, row.request.prompt_ids, result.token_ids)
    except Exception as err:  # noqa: BLE001 - this row's fault, recorded as its outcome (_row_error)
        return _row_error(err, "telling its drafter it ended")
    return result


def generate(engine: Engine, prompt_ids: Sequence[int], stop: StopChecker, sampling: SamplingParams,
             drafter: Optional[Drafter] = None, on_text: Optional[Callable[[str], None]] = None,
             acceptance: str = "exact", policy: Optional[Policy] = None) -> GenerationResult:
    """Generate from ``prompt_ids`` until ``stop`` says so, speculating with ``drafter``: :func:`run`
    with one request on ``engine`` (``policy``: default every step drafts the drafter's whole budget).

    Lossless: greedy output equals plain greedy decoding token for token; sampled output follows the
    target's distribution (speculative rejection sampling).

    Raises:
        ValueError: see :func:`run`.
        MtpctlError: what ended the generation (:class:`~mtpctl.errors.NonFinite`: a NaN or inf in
            the logits).
    """
    request = Request(prompt_ids, stop, sampling, drafter, on_text)
    outcome = run([request], lambda _: engine, lambda engines, trees: [engine.verify(trees[0])],
                  policy=policy, acceptance=acceptance)[0]
    if isinstance(outcome, MtpctlError):
        raise outcome
    return outcome
