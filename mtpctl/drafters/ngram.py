"""Prompt lookup decoding: drafts copied from the context itself."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from mtpctl.decode.drafter import Drafter, TargetStep
from mtpctl.decode.tree import DraftTree


class NgramDrafter(Drafter):
    """Prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding"; n-gram drafting).

    For n from ``ngram_max`` down to ``ngram_min``, find the latest earlier occurrence of the last n
    tokens of the context and propose the tokens that followed it. Proposes nothing when no n-gram
    matches, so a context where nothing repeats costs plain decoding steps, not useless verifies.
    The default shortest n-gram is 2: single-token matches are mostly chance on chat text, and their
    failed verifies cost more than they win (measured on SmolLM2-135M, see BENCHMARKS.md).

    ``budget``: the longest chain proposed (tokens).

    Raises:
        ValueError: ``1 <= ngram_min <= ngram_max`` does not hold, or a budget below 1.
    """

    def __init__(self, ngram_max: int = 3, ngram_min: int = 2, budget: int = 3):
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram-min <= ngram-max, got {ngram_min} and {ngram_max}")
        if budget < 1:
            raise ValueError(f"the prompt-lookup chain needs at least 1 token, got {budget}")
        self.ngram_max, self.ngram_min, self.budget = ngram_max, ngram_min, budget

    def fork(self) -> "NgramDrafter":
        """Itself: it keeps no per-request state (see :meth:`mtpctl.decode.drafter.Drafter.fork`)."""
        return self

    def propose(self, context: Sequence[int], max_tokens: int, last: Optional[TargetStep] = None) -> DraftTree:
        pending = context[-1]
        if max_tokens <= 0:
            return DraftTree(pending)
        ctx = torch.as_tensor(list(context), dtype=torch.long)
        for n in range(min(self.ngram_max, len(ctx) - 1), self.ngram_min - 1, -1):
            # windows that start early enough to have at least one token after them
            windows = ctx[:-1].unfold(0, n, 1)
            hits = (windows == ctx[-n:]).all(dim=1).nonzero()
            if len(hits):
                start = int(hits[-1]) + n
                return DraftTree.chain([pending] + ctx[start:start + max_tokens].tolist())
        return DraftTree(pending)
