"""Deciding which draft tokens the target keeps.

Glossary (also in docs/glossary.md):
- draft tokens: the tokens a drafter proposes after the pending token, as a chain or a draft tree.
- accepted tokens: the draft tokens on the path the target agrees with; ``accept length`` counts them
  plus the one token every verify step adds (the bonus or recovered token).
- recovered token: after the last draft candidate at a node is rejected, a token drawn from the
  residual distribution ``norm(max(0, p - q))`` (greedy: the target's argmax) at that node.
- bonus token: when a leaf of the draft is accepted, the target's own next token after it, free.

Greedy acceptance walks from the root and follows the child whose token equals the target's argmax,
so the output is token for token that of plain greedy decoding, whatever the tree's shape.

Speculative rejection sampling (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"; Chen et al. 2023) accepts draft x with probability ``min(1, p(x) / q(x))``
and otherwise samples from ``norm(max(0, p - q))``, which leaves the output distributed as p. Over a
draft tree, the siblings at a node are tried in turn, each against the residual left by the ones
rejected before it (multi-candidate speculative sampling: Miao et al. 2024, "SpecInfer"; Chen et al.
2023, "Cascade Speculative Drafting"); for deterministic candidates (q one-hot) the residual after
rejecting x is p with x removed, renormalised, so each committed token is still distributed as p.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from mtpctl.decode.sampling import SamplingParams, probs_from_logits, sample


@dataclass
class Acceptance:
    """Outcome of verifying one draft (chain or tree)."""

    accepted: List[int]  # the accepted draft tokens, in path order (length a <= draft depth)
    next_token: int  # the bonus token (a leaf was accepted) or the recovered token
    nodes: List[int] = field(default_factory=list)  # draft indices of the accepted tokens, in path order

    @property
    def tokens(self) -> List[int]:
        """Tokens this step commits: accepted drafts then the bonus/recovered token (a + 1)."""
        return self.accepted + [self.next_token]

    @property
    def rows(self) -> List[int]:
        """Rows of the verify pass (root = 0, draft node i = i + 1) on the committed path: the KV
        entries to keep. The last one's prediction is ``next_token``."""
        return [0] + [n + 1 for n in self.nodes]


def children_of(parents: Optional[Sequence[int]], k: int) -> Dict[int, List[int]]:
    """Draft node index -> its children's indices, in draft order; -1 is the root (pending token).
    ``parents`` None is a chain of ``k`` nodes."""
    if parents is None:
        parents = range(-1, k - 1)
    children: Dict[int, List[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    return children


def accept_greedy(draft: Sequence[int], logits, parents: Optional[Sequence[int]] = None) -> Acceptance:
    """Greedy verification of a chain or a draft tree.

    Args:
        draft: k draft token ids.
        logits: ``[k + 1, vocab]`` (a tensor, or a :class:`~mtpctl.runtime.engine.StepOutput` that
            computes rows on demand); row 0 follows the pending token, row i + 1 follows draft node i.
            Rows off the accepted path are not read.
        parents: ``[k]`` parent of each draft node (-1 = root), None for a chain.
    """
    children = children_of(parents, len(draft))
    node, nodes = -1, []
    target = int(logits[0].argmax())
    while True:
        match = next((c for c in children.get(node, ()) if draft[c] == target), None)
        if match is None:
            return Acceptance([draft[n] for n in nodes], target, nodes)
        node = match
        nodes.append(node)
        target = int(logits[node + 1].argmax())


def accept_rejection_sampling(draft: Sequence[int], logits, params: SamplingParams,
                              generator: torch.Generator, draft_probs: Optional[torch.Tensor] = None,
                              parents: Optional[Sequence[int]] = None) -> Acceptance:
    """Speculative rejection sampling of a chain or a draft tree (Leviathan et al. 2023, Algorithm 1;
    siblings tried in turn against the running residual, as in SpecInfer).

    Args:
        draft: k draft token ids.
        logits: ``[k + 1, vocab]`` target logits, read row by row (as in :func:`accept_greedy`).
        params: sampling settings; the target distribution p is ``probs_from_logits(logits, params)``.
        generator: drives every random draw.
        draft_probs: ``[k, vocab]`` the drafter's distribution q per node, or None for a
            deterministic drafter (q is the one-hot of the draft token: prompt lookup, top-k of MTP
            heads).
        parents: ``[k]`` parent of each draft node (-1 = root), None for a chain.
    """
    children = children_of(parents, len(draft))
    node, nodes = -1, []
    while True:
        p = probs_from_logits(logits[node + 1], params)
        for child in children.get(node, ()):
            token = int(draft[child])
            q_row = draft_probs[child] if draft_probs is not None else None
            q_tok = float(q_row[token]) if q_row is not None else 1.0
            u = float(torch.rand((), generator=generator))
            if q_tok > 0 and u < min(1.0, float(p[token]) / q_tok):
                nodes.append(child)
                node = child
                break
            p = _residual(p, token, q_row)
        else:
            return Acceptance([int(draft[n]) for n in nodes], sample(p, generator), nodes)


def _residual(p: torch.Tensor, token: int, q_row: Optional[torch.Tensor]) -> torch.Tensor:
    """``norm(max(0, p - q))``; q one-hot at ``token`` when ``q_row`` is None. Where the residual is
    all zero (p == q) rejection had probability zero, so p is returned unchanged."""
    if q_row is None:
        residual = p.clone()
        residual[token] = 0.0
    else:
        residual = torch.clamp(p - q_row, min=0.0)
    total = float(residual.sum())
    return residual / total if total > 0 else p


def accept_typical(draft: Sequence[int], logits, params: SamplingParams, generator: torch.Generator,
                   parents: Optional[Sequence[int]] = None, threshold: float = 0.09,
                   alpha: float = 0.3) -> Acceptance:
    """Typical acceptance (Cai et al. 2024, "Medusa", sec. 3.3.1): LOSSY, output no longer follows p.

    At each node the first child x (in draft order) with ``p(x) > min(threshold, alpha * exp(-H(p)))``
    is accepted, H being the entropy of the target's distribution p there; when none is, the next
    token is sampled from p. Offered only as an explicit option (``--acceptance typical``).

    Args: as :func:`accept_rejection_sampling`; ``threshold`` (epsilon) and ``alpha`` (delta) as in the paper.
    """
    children = children_of(parents, len(draft))
    node, nodes = -1, []
    while True:
        p = probs_from_logits(logits[node + 1], params)
        entropy = float(-(p * torch.log(p.clamp(min=1e-20))).sum())
        bar = min(threshold, alpha * float(torch.exp(torch.tensor(-entropy))))
        match = next((c for c in children.get(node, ()) if float(p[int(draft[c])]) > bar), None)
        if match is None:
            return Acceptance([int(draft[n]) for n in nodes], sample(p, generator), nodes)
        node = match
        nodes.append(node)
