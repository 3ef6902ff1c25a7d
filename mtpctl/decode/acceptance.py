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

Sampled acceptance of a deterministic draft (prompt lookup, retrieval, MTP heads' top-k, lookahead,
suffix: ``tree.q`` None) walks the same way, following the child whose token equals the target's
own sample at that position, drawn with the position's uniform (:func:`~mtpctl.decode.sampling.
position_uniform`): a draft token x is accepted with probability p(x), as by rejection sampling of a
one-hot draft, and every committed token is the token plain sampling would have drawn there, so a
seeded request's output is the same with any such drafter, draft size, batch or policy.

Speculative rejection sampling (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"; Chen et al. 2023) accepts draft x with probability ``min(1, p(x) / q(x))``
and otherwise samples from ``norm(max(0, p - q))``, which leaves the output distributed as p. Over a
draft tree, the siblings at a node are tried in turn, each against the residual left by the ones
rejected before it (multi-candidate speculative sampling: Miao et al. 2024, "SpecInfer"; Chen et al.
2023, "Cascade Speculative Drafting"); for deterministic candidates (q one-hot) the residual after
rejecting x is p with x removed, renormalised, so each committed token is still distributed as p.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch

from mtpctl.decode.sampling import SamplingParams, greedy_token, probs_from_logits, sample, sample_at
from mtpctl.decode.tree import DraftTree


@dataclass
class Acceptance:
    """Outcome of verifying one draft tree (a chain is a tree)."""

    path: List[int]  # the committed nodes, root first ([0] when no draft token is accepted): the KV to keep
    accepted: List[int]  # the accepted draft tokens, in path order (the tokens of path[1:])
    next_token: int  # the bonus token (a leaf was accepted) or the recovered token: path[-1]'s prediction

    @property
    def tokens(self) -> List[int]:
        """Tokens this step commits: accepted drafts then the bonus/recovered token (a + 1)."""
        return self.accepted + [self.next_token]


def _outcome(tree: DraftTree, path: List[int], next_token: int) -> Acceptance:
    return Acceptance(path, [tree.tokens[n] for n in path[1:]], next_token)


def accept_greedy(tree: DraftTree, logits) -> Acceptance:
    """Greedy verification: from the root, follow the child whose token is the target's argmax.

    Args:
        tree: the verified draft tree.
        logits: ``[N, vocab]`` (a tensor, or a :class:`~mtpctl.decode.engine.StepOutput` that computes
            rows on demand); row i is the target's prediction after node i. Rows off the accepted
            path are not read; where the output has a row's argmax already (its ``greedy``), that row is
            not read either.
    """
    return _follow(tree, lambda node, depth: _argmax(logits, node))


def accept_sampled_exact(tree: DraftTree, logits, params: SamplingParams, uniform: Callable[[int], float]) -> Acceptance:
    """Sampled verification of a deterministic draft (``tree.q`` None): from the root, follow the
    child whose token is the target's own sample at that node, drawn by inverse CDF with
    ``uniform(depth)`` (the uniform of the position a node at that depth predicts). The committed
    tokens are those plain sampling draws with the same uniforms; a draft token x is accepted with
    probability p(x), the acceptance rejection sampling gives a one-hot draft.

    Args: as :func:`accept_greedy`; ``params`` the sampling settings (p is ``probs_from_logits``).
    """
    return _follow(tree, lambda node, depth: sample_at(probs_from_logits(logits[node], params), uniform(depth)))


def _follow(tree: DraftTree, target: Callable[[int, int], int]) -> Acceptance:
    """Walk from the root along the children whose token is ``target(node, depth)``, the target's
    token after ``node`` (at ``depth``); the first token no child holds ends the walk."""
    node, path = 0, [0]
    while True:
        token = target(node, len(path) - 1)
        match = tree.child(node, token)
        if match is None:
            return _outcome(tree, path, token)
        node = match
        path.append(node)


def _argmax(logits, i: int) -> int:
    """Row i's argmax: the output's own (``greedy``) where it has one, else read from the row."""
    token = None if isinstance(logits, torch.Tensor) else logits.greedy(i)  # a pass's output may have it
    return token if token is not None else greedy_token(logits[i])


def accept_greedy_together(trees: Sequence[DraftTree], outs: Sequence) -> List[Acceptance]:
    """:func:`accept_greedy` of several sequences' trees. Every node of every tree is asked for first
    (``prefetch``, where the output has it), so a backend computes all the rows the walks may read in
    one call (one read of the lm_head's weights a step, whatever the depth accepted; a draft node's
    row costs little beside that); then each tree is walked as alone."""
    for tree, out in zip(trees, outs):
        if not isinstance(out, torch.Tensor):  # a pass's output (a tensor holds every row already)
            out.prefetch(range(len(tree)))
    return [accept_greedy(tree, out) for tree, out in zip(trees, outs)]


def accept_rejection_sampling(tree: DraftTree, logits, params: SamplingParams,
                              generator: torch.Generator) -> Acceptance:
    """Speculative rejection sampling of a draft tree (Leviathan et al. 2023, Algorithm 1; siblings
    tried in turn against the running residual, as in SpecInfer). The loop uses it for drafts
    sampled from the drafter's own distribution (a draft model); deterministic drafts go through
    :func:`accept_sampled_exact`, which accepts with the same probabilities.

    Args:
        tree: the verified draft tree; ``tree.q`` the drafter's distribution per node, or None for a
            deterministic drafter (q is the one-hot of the draft token: prompt lookup, top-k of MTP
            heads).
        logits: ``[N, vocab]`` target logits, read row by row (as in :func:`accept_greedy`).
        params: sampling settings; the target distribution p is ``probs_from_logits(logits, params)``.
        generator: drives every random draw.
    """
    node, path = 0, [0]
    while True:
        p = probs_from_logits(logits[node], params)
        for child in tree.children(node):
            token = tree.tokens[child]
            # the drafter's row where p is (a draft model on a GPU keeps q there; the row read comes to the host)
            q_row = tree.q[child].to(p.device) if tree.q is not None else None
            q_tok = float(q_row[token]) if q_row is not None else 1.0
            u = float(torch.rand((), generator=generator))
            if q_tok > 0 and u < min(1.0, float(p[token]) / q_tok):
                path.append(child)
                node = child
                break
            p = _residual(p, token, q_row)
        else:
            return _outcome(tree, path, sample(p, generator))


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


def accept_typical(tree: DraftTree, logits, params: SamplingParams, generator: torch.Generator,
                   threshold: float = 0.09, alpha: float = 0.3) -> Acceptance:
    """Typical acceptance (Cai et al. 2024, "Medusa", sec. 3.3.1): LOSSY, output no longer follows p.

    At each node the first child x (in draft order) with ``p(x) > min(threshold, alpha * exp(-H(p)))``
    is accepted, H being the entropy of the target's distribution p there; when none is, the next
    token is sampled from p. Offered only as an explicit option (``acceptance="typical"``).

    Args: as :func:`accept_rejection_sampling`; ``threshold`` (epsilon) and ``alpha`` (delta) as in the paper.
    """
    node, path = 0, [0]
    while True:
        p = probs_from_logits(logits[node], params)
        entropy = float(-(p * torch.log(p.clamp(min=1e-20))).sum())
        bar = min(threshold, alpha * float(torch.exp(torch.tensor(-entropy))))
        match = next((c for c in tree.children(node) if float(p[tree.tokens[c]]) > bar), None)
        if match is None:
            return _outcome(tree, path, sample(p, generator))
        node = match
        path.append(node)
