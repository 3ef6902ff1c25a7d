"""The decoding loop: prefill, then draft -> verify -> accept -> commit until a stop.

One loop serves plain decoding (no drafter, or a drafter that proposes nothing) and every kind of
speculation; only the drafter differs.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable, List, Optional, Sequence

from mtpctl.decode.acceptance import accept_greedy, accept_rejection_sampling, accept_typical
from mtpctl.decode.drafter import Drafter, TargetStep
from mtpctl.decode.engine import Engine
from mtpctl.decode.tree import DraftTree
from mtpctl.decode.sampling import SamplingParams, next_token
from mtpctl.decode.stopping import CONTEXT, StopChecker


@dataclass
class GenerationStats:
    """Figures of one generation; every count is of committed tokens only.

    ``tau`` (mean accepted length) is committed tokens per decode step, the bonus/recovered token
    counted, so plain decoding has tau = 1. ``acceptance_rate`` is accepted draft tokens over draft
    tokens verified (None when nothing was drafted). Times are in ms, rates in tokens/s; TTFT covers
    prefill and the first token; ``tokens_per_s`` is new tokens over the whole generation time.
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
    kv_cache_bytes: int = 0  # memory of the KV cache allocated for this generation

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
        """All figures, derived ones included, as plain JSON-ready values."""
        out = asdict(self)
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


def generate(engine: Engine, prompt_ids: Sequence[int], stop: StopChecker, sampling: SamplingParams,
             drafter: Optional[Drafter] = None, on_text: Optional[Callable[[str], None]] = None,
             acceptance: str = "exact") -> GenerationResult:
    """Generate from ``prompt_ids`` until ``stop`` says so, speculating with ``drafter``.

    Lossless: greedy output equals plain greedy decoding token for token; sampled output follows the
    target's distribution (speculative rejection sampling).

    Args:
        engine: a backend (:class:`mtpctl.decode.engine.Engine`); its capacity bounds prompt + output
            + the drafter's budget.
        prompt_ids: prompt token ids ``[T]``, T >= 1.
        stop: stop conditions (EOS, stop strings, max new tokens), checked on every committed token.
        sampling: greedy or sampling settings.
        drafter: proposes up to its ``budget`` of draft tokens a step (a chain or a draft tree); None
            for plain decoding.
        on_text: called with each piece of text as soon as it is final (streaming).
        acceptance: ``exact`` (lossless: greedy or rejection sampling) or ``typical`` (Medusa's
            typical acceptance when sampling: lossy, see :func:`accept_typical`).

    Raises:
        ValueError: empty prompt, a prompt that leaves no room in the engine's capacity, or a draft
            tree whose root is not the pending token.
    """
    if not prompt_ids:
        raise ValueError("the prompt has no tokens")
    if len(prompt_ids) >= engine.capacity:
        raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the context holds {engine.capacity}")
    budget = drafter.budget if drafter is not None else 0
    generator = sampling.generator()
    stats = GenerationStats(prompt_tokens=len(prompt_ids), kv_cache_bytes=engine.kv_cache_bytes)
    start = time.perf_counter()
    out = engine.prefill(prompt_ids)
    last = TargetStep(out, len(out) - 1)
    pending = next_token(out[last.row], sampling, generator)
    stats.ttft_ms = (time.perf_counter() - start) * 1e3
    done = _commit([pending], stop, on_text)
    while not done:
        if engine.length + 1 > engine.capacity:
            stop.end(CONTEXT)
            break
        step_start = time.perf_counter()
        room = min(budget, stop.max_new_tokens - len(stop.tokens) - 1, engine.capacity - engine.length - 1)
        tree = drafter.propose(list(prompt_ids) + stop.tokens, room, last) if room > 0 else DraftTree(pending)
        if tree.tokens[0] != pending:
            raise ValueError(f"the drafter's tree is rooted at token {tree.tokens[0]}, not the pending token {pending}")
        out = engine.verify(tree)
        if sampling.greedy:
            result = accept_greedy(tree, out)
        elif acceptance == "typical":
            result = accept_typical(tree, out, sampling, generator)
        else:
            result = accept_rejection_sampling(tree, out, sampling, generator)
        engine.commit(result.path)
        last = TargetStep(out, result.path[-1], list(result.path))
        pending = result.next_token
        before = len(stop.tokens)
        done = _commit(result.tokens, stop, on_text)
        committed = len(stop.tokens) - before
        stats.decode_steps += 1
        stats.accepted_tokens += min(len(result.accepted), committed)
        stats.accepted_per_step.append(committed)
        stats.drafted_per_step.append(tree.drafted)
        stats.depth_per_step.append(tree.depth)
        stats.step_ms.append((time.perf_counter() - step_start) * 1e3)
    stats.total_ms = (time.perf_counter() - start) * 1e3
    stats.new_tokens = len(stop.tokens)
    if on_text:
        on_text(stop.stream())
    return GenerationResult(list(stop.tokens), stop.text, stop.finish_reason, stats)


def _commit(tokens: Sequence[int], stop: StopChecker, on_text) -> bool:
    """Push tokens one by one until a stop; stream what became final. True when generation ended."""
    for token in tokens:
        if stop.push(token):
            return True
    if on_text:
        piece = stop.stream()
        if piece:
            on_text(piece)
    return False
