"""Deciding which draft tokens the target keeps.

Glossary (also in docs/glossary.md):
- draft tokens: the k tokens a drafter proposes after the last committed token.
- accepted tokens: the leading draft tokens the target agrees with; ``accept length`` counts them
  plus the one token every verify step adds (the bonus or recovered token).
- recovered token: after the first rejected draft token, a token drawn from the residual
  distribution ``norm(max(0, p - q))`` (greedy: the target's argmax) at that position.
- bonus token: when all k drafts are accepted, the target's own next token at position k, free.

Greedy acceptance keeps drafts while they equal the target's argmax, so the output is token for token
that of plain greedy decoding. Speculative rejection sampling (Leviathan et al. 2023, "Fast Inference
from Transformers via Speculative Decoding"; Chen et al. 2023) accepts draft x with probability
``min(1, p(x) / q(x))``, which leaves the output distribution equal to the target's ``p``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from mtpctl.runtime.sampling import SamplingParams, probs_from_logits, sample


@dataclass
class Acceptance:
    """Outcome of verifying one chain of draft tokens."""

    accepted: List[int]  # the accepted draft tokens, in order (length a <= k)
    next_token: int  # the bonus token (a == k) or the recovered token (a < k)

    @property
    def tokens(self) -> List[int]:
        """Tokens this step commits: accepted drafts then the bonus/recovered token (a + 1)."""
        return self.accepted + [self.next_token]


def accept_greedy(draft: Sequence[int], logits) -> Acceptance:
    """Greedy verification of a chain.

    Args:
        draft: k draft token ids.
        logits: ``[k + 1, vocab]`` (a tensor, or a :class:`~mtpctl.runtime.engine.StepOutput` that
            computes rows on demand); row i is the target's prediction after the i-th verified token
            (row 0 follows the last committed token). Rows after the first rejection are not read.
    """
    a = 0
    target = int(logits[0].argmax())
    while a < len(draft) and draft[a] == target:
        a += 1
        target = int(logits[a].argmax())
    return Acceptance(list(draft[:a]), target)


def accept_rejection_sampling(draft: Sequence[int], logits, params: SamplingParams,
                              generator: torch.Generator,
                              draft_probs: Optional[torch.Tensor] = None) -> Acceptance:
    """Speculative rejection sampling of a chain (Leviathan et al. 2023, Algorithm 1).

    Args:
        draft: k draft token ids.
        logits: ``[k + 1, vocab]`` target logits, read row by row (as in :func:`accept_greedy`).
        params: sampling settings; the target distribution p is ``probs_from_logits(logits, params)``.
        generator: drives every random draw.
        draft_probs: ``[k, vocab]`` the drafter's distribution q per position, or None for a
            deterministic drafter (q is the one-hot of the draft token, e.g. prompt lookup).
    """
    accepted: List[int] = []
    for i, token in enumerate(draft):
        p = probs_from_logits(logits[i], params)
        q_row = draft_probs[i] if draft_probs is not None else None
        q_tok = float(q_row[token]) if q_row is not None else 1.0
        p_tok = float(p[token])
        u = float(torch.rand((), generator=generator))
        if q_tok > 0 and u < min(1.0, p_tok / q_tok):
            accepted.append(int(token))
            continue
        if q_row is None:
            residual = p.clone()
            residual[token] = 0.0
        else:
            residual = torch.clamp(p - q_row, min=0.0)
        total = float(residual.sum())
        # residual is zero only when p == q, in which case rejection has probability zero.
        return Acceptance(accepted, sample(residual / total if total > 0 else p, generator))
    return Acceptance(accepted, sample(probs_from_logits(logits[len(draft)], params), generator))
