"""Several drafters' proposals merged into one draft tree."""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

from mtpctl.decode.attention import MAX_DRAFT_DEPTH
from mtpctl.decode.drafter import Call, Drafter, TargetStep, aux_layers_of, family, finished, propose_all
from mtpctl.decode.tree import DraftTree
from mtpctl.errors import NonFinite


class MergedDrafter(Drafter):
    """The proposals of several deterministic drafters merged into one draft tree: a trie of their
    token paths, so a path two drafters share is verified once (e.g. MTP heads' tree plus a prompt
    lookup chain: the heads guess generic continuations, the n-gram copies from the context).

    Each drafter proposes up to its own budget of tokens; their new nodes are taken in order until
    ``max_tokens`` nodes are reached, and nodes deeper than ``max_depth`` are left out (a merged
    draft is a tree, and the torch engine verifies trees up to
    :data:`mtpctl.decode.attention.MAX_DRAFT_DEPTH` deep). A lookahead window (extra rows) comes
    first where it fits (:func:`merge_trees`). The merged budget is the sum of theirs. Candidates stay
    deterministic (their draft distributions one-hot; a draft model inside a merge drafts greedily),
    so greedy and tree rejection sampling over the merged tree stay lossless.

    Args:
        drafters: the drafters, in merge order.
        max_depth: the deepest node kept (draft tokens below the pending one).

    Raises:
        ValueError (from :meth:`propose`): a drafter that samples its tokens (a draft with ``probs``),
            whose distribution a merged tree cannot carry.
    """

    def __init__(self, drafters: Sequence, max_depth: int = MAX_DRAFT_DEPTH):
        self.drafters = list(drafters)
        self.max_depth = max_depth
        self.budget = sum(d.budget for d in self.drafters)
        self.aux_layers = aux_layers_of(*self.drafters)

    def fork(self) -> "MergedDrafter":
        """The same merge of each member's fork; itself when no member keeps per-request state (see
        :meth:`mtpctl.decode.drafter.Drafter.fork`)."""
        forks = [d.fork() for d in self.drafters]
        return self if all(f is d for f, d in zip(forks, self.drafters)) else MergedDrafter(forks, self.max_depth)

    @property
    def draft_state_bytes(self) -> int:
        """What its members keep to roll their drafts back (a hybrid draft model's states), bytes."""
        return sum(getattr(d, "draft_state_bytes", 0) for d in self.drafters)

    @property
    def family(self) -> tuple:
        """Its members' families (see :func:`mtpctl.decode.drafter.family`): merges of forks of the
        same members propose together."""
        return tuple(family(d) for d in self.drafters)

    @staticmethod
    def propose_forks(merges: Sequence["MergedDrafter"], calls: Sequence[Call]) -> List[Union[DraftTree, NonFinite]]:
        """:meth:`propose` of each request's merge (``merges[i]`` for ``calls[i]``, merges of one
        family), each member proposing for all the requests together where it can
        (:func:`mtpctl.decode.drafter.propose_all`); a row whose member gave an error
        (:class:`~mtpctl.errors.NonFinite`) gets that error in place of its tree."""
        proposals = []
        for m in range(len(merges[0].drafters)):
            members = [merge.drafters[m] for merge in merges]
            proposals.append(propose_all(members, [(context, member.budget if max_tokens > 0 else 0, last)
                                                   for member, (context, max_tokens, last) in zip(members, calls)]))
        merged: List[Union[DraftTree, NonFinite]] = []
        for i, (merge, (context, max_tokens, _)) in enumerate(zip(merges, calls)):
            failed = next((p[i] for p in proposals if isinstance(p[i], NonFinite)), None)
            merged.append(failed or merge._merge(context, max_tokens, [p[i] for p in proposals]))
        return merged

    def propose(self, context: Sequence[int], max_tokens: int, last: Optional[TargetStep] = None) -> DraftTree:
        # with max_tokens 0 the members only see the step (an EAGLE layer keeps its cache in step)
        return self._merge(context, max_tokens, [d.propose(context, d.budget if max_tokens > 0 else 0, last)
                                                 for d in self.drafters])

    def finished(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """Each member hears that the request ended (:meth:`mtpctl.decode.drafter.Drafter.finished`)."""
        for d in self.drafters:
            finished(d, prompt_ids, output_ids)

    def _merge(self, context: Sequence[int], max_tokens: int, trees: Sequence[DraftTree]) -> DraftTree:
        return merge_trees(context[-1], trees, max_tokens, self.max_depth)


def merge_trees(pending: int, trees: Sequence[DraftTree], max_tokens: int, max_depth: int = MAX_DRAFT_DEPTH) -> DraftTree:
    """Deterministic drafters' trees (in merge order) as one trie of at most ``max_tokens`` rows under
    ``pending``: a path two trees share is one path; nodes deeper than ``max_depth`` are left out. A
    tree's extra rows (a lookahead window, at most one tree's) come along when they fit: they are
    counted first, and the nodes fill the rest.

    Raises:
        ValueError: a tree that carries draft distributions (a sampled draft), which a merged tree
            cannot carry.
    """
    merged = DraftTree(pending)
    extra = next((t.extra for t in trees if t.extra is not None), None)
    if extra is not None and len(extra) <= max_tokens:
        merged.extra, max_tokens = extra, max_tokens - len(extra)
    for tree in trees:
        if merged.drafted >= max_tokens:
            break
        if tree.q is not None:
            raise ValueError("MergedDrafter merges deterministic drafters only (this one samples)")
        where = {0: 0}  # the member's node -> the merged tree's node (None: left out)
        for node in range(1, len(tree)):
            parent = where[tree.parents[node]]
            token = tree.tokens[node]
            found = None if parent is None else merged.child(parent, token)
            if found is None and parent is not None and merged.drafted < max_tokens \
                    and merged.depths[parent] < max_depth:
                found = merged.add(parent, token)
            where[node] = found
    return merged
