"""Drafters: cheap proposers of draft tokens that the target then verifies.

Every drafter implements :class:`Drafter`; the decoding loop knows nothing else about it. A draft is
a chain (prompt lookup, draft models) or a draft tree (MTP heads): a tree lists each node's parent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Protocol, Sequence

import torch

from mtpctl.runtime.engine import MAX_DRAFT_DEPTH


@dataclass
class Draft:
    """Proposed draft tokens: a chain, or a draft tree given ``parents``.

    The root of every draft is the pending token (the target's last prediction, not yet verified);
    node i's parent is ``parents[i]`` (an index into ``tokens``, -1 for the root), and parents precede
    their children. ``parents`` None means a chain (``[-1, 0, 1, ...]``).
    """

    tokens: List[int]  # [k] draft token ids (k may be 0: propose nothing, run a plain step)
    parents: Optional[List[int]] = None  # [k] parent of each node, -1 = the pending token; None = chain
    probs: Optional[torch.Tensor] = None  # [k, vocab] drafter distribution q per node, None if deterministic

    @property
    def depth(self) -> int:
        """Longest root-to-leaf path in draft tokens (k for a chain): the most a step can accept."""
        if self.parents is None:
            return len(self.tokens)
        depths: List[int] = []
        for p in self.parents:
            depths.append(1 if p < 0 else depths[p] + 1)
        return max(depths, default=0)


@dataclass
class TargetStep:
    """The target's last forward pass as a drafter sees it: ``out`` (a
    :class:`~mtpctl.runtime.engine.StepOutput`) and ``row``, the row whose prediction is the pending
    token. MTP drafters read ``out.hidden_states[row]`` or ``out.draft_logits(row)``. After a verify
    pass ``rows`` lists the rows it committed (the accepted path, ``row`` last); after prefill it is
    None and the torch engine's output carries every prompt row as ``out.prompt_hidden_states``
    (EAGLE reads the hidden states of every committed position)."""

    out: object
    row: int
    rows: Optional[List[int]] = None  # [m] rows of ``out`` committed, in position order; None after prefill


class Drafter(Protocol):
    """Proposes up to ``max_tokens`` draft tokens (tree nodes) to follow ``context`` (prompt +
    committed output ids, the pending token last); ``last`` is the target's last forward pass."""

    def propose(self, context: Sequence[int], max_tokens: int, last: Optional[TargetStep] = None) -> Draft: ...


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

    def propose(self, context: Sequence[int], max_tokens: int, last: Optional[TargetStep] = None) -> Draft:
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


class MergedDrafter:
    """The proposals of several deterministic drafters merged into one draft tree: a trie of their
    token paths, so a path two drafters share is verified once (e.g. MTP heads' tree plus a prompt
    lookup chain: the heads guess generic continuations, the n-gram copies from the context).

    Each drafter proposes up to its own budget of tokens; their new nodes are taken in order until
    ``max_tokens`` nodes are reached, and nodes deeper than ``max_depth`` are left out (a merged
    draft is a tree, and the torch engine verifies trees up to
    :data:`mtpctl.runtime.engine.MAX_DRAFT_DEPTH` deep).
    Candidates stay deterministic (their draft distributions one-hot), so greedy and tree rejection
    sampling over the merged tree stay lossless.

    Args:
        drafters: ``(drafter, max_nodes)`` pairs.
        max_depth: the deepest node kept (draft tokens below the pending one).

    Raises:
        ValueError (from :meth:`propose`): a drafter that samples its tokens (a draft with ``probs``),
            whose distribution a merged tree cannot carry.
    """

    def __init__(self, drafters: Sequence[tuple], max_depth: int = MAX_DRAFT_DEPTH):
        self.drafters = list(drafters)
        self.max_depth = max_depth

    def propose(self, context: Sequence[int], max_tokens: int, last: Optional[TargetStep] = None) -> Draft:
        index: dict = {}  # token path -> node
        tokens: List[int] = []
        parents: List[int] = []
        for drafter, budget in self.drafters:
            if len(tokens) >= max_tokens:
                break
            draft = drafter.propose(context, budget, last)
            if draft.probs is not None:
                raise ValueError("MergedDrafter merges deterministic drafters only (this one samples)")
            paths: List[tuple] = []
            for i, token in enumerate(draft.tokens):
                parent = i - 1 if draft.parents is None else draft.parents[i]
                path = (paths[parent] if parent >= 0 else ()) + (token,)
                paths.append(path)
                if path in index or (len(path) > 1 and path[:-1] not in index) or len(tokens) >= max_tokens \
                        or len(path) > self.max_depth:
                    continue
                index[path] = len(tokens)
                tokens.append(token)
                parents.append(index[path[:-1]] if len(path) > 1 else -1)
        return Draft(tokens, parents)
