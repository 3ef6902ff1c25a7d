"""Drafters: cheap proposers of draft tokens that the target then verifies.

Every drafter implements :class:`Drafter`; the decoding loop knows nothing else about it. Later
drafters (MTP heads, draft models) implement the same interface.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Protocol, Sequence

import torch


@dataclass
class Draft:
    """Proposed draft tokens (a chain) and, for a sampling drafter, its distributions."""

    tokens: List[int]  # k draft token ids (k may be 0: propose nothing, run a plain step)
    probs: Optional[torch.Tensor] = None  # [k, vocab] drafter distribution q, None if deterministic


class Drafter(Protocol):
    """Proposes up to ``max_tokens`` tokens to follow ``context`` (prompt + committed output ids)."""

    def propose(self, context: Sequence[int], max_tokens: int) -> Draft: ...


class NgramDrafter:
    """Prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding"; n-gram drafting).

    For n from ``ngram_max`` down to ``ngram_min``, find the latest earlier occurrence of the last n
    tokens of the context and propose the tokens that followed it. Proposes nothing when no n-gram
    matches, so a context where nothing repeats costs plain decoding steps, not useless verifies.
    The default shortest n-gram is 2: single-token matches are mostly chance on chat text, and their
    failed verifies cost more than they win (measured on SmolLM2-135M, see BENCHMARKS.md).

    Raises:
        ValueError: ``1 <= ngram_min <= ngram_max`` does not hold.
    """

    def __init__(self, ngram_max: int = 3, ngram_min: int = 2):
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram-min <= ngram-max, got {ngram_min} and {ngram_max}")
        self.ngram_max, self.ngram_min = ngram_max, ngram_min

    def propose(self, context: Sequence[int], max_tokens: int) -> Draft:
        if max_tokens <= 0:
            return Draft([])
        ctx = torch.as_tensor(list(context), dtype=torch.long)
        for n in range(min(self.ngram_max, len(ctx) - 1), self.ngram_min - 1, -1):
            # windows that start early enough to have at least one token after them
            windows = ctx[:-1].unfold(0, n, 1)
            hits = (windows == ctx[-n:]).all(dim=1).nonzero()
            if len(hits):
                start = int(hits[-1]) + n
                return Draft(ctx[start:start + max_tokens].tolist())
        return Draft([])
