"""A draft model and MTP heads in one draft tree: the small model guesses a chain, the target's heads
add their own tree from the last committed row and, under each node of the chain, their candidates for
the next position (head d + 1's top :data:`GRAFT` under the chain's node at depth d: "the small model
guesses 4, the large model's heads predict 2 each"). One verify pass checks everything; acceptance is
the usual one over the merged tree, so the hybrid is lossless.

Every candidate is deterministic: the draft model drafts its greedy chain here whatever the sampling
settings (the merged tree's q is one-hot, as for every merged tree), which keeps tree rejection
sampling exact without a draft distribution per branch (a trie shares nodes between branches, and a
sampled draft's q would not hold for a node another branch also proposed).
"""

from __future__ import annotations

from typing import Optional, Sequence

from mtpctl.decode.drafter import Drafter, TargetStep
from mtpctl.decode.tree import DraftTree
from mtpctl.drafters.draft_model import DraftModelDrafter
from mtpctl.drafters.heads.medusa import MedusaDrafter
from mtpctl.drafters.merged import merge_trees

#: the heads' candidates grafted under each node of the draft chain (with the recipe's Medusa heads and
#: a 24-layer self-draft of SmolLM2, tau 1.99 with no graft, 1.99 with 1, 2.00 with 2 or 3: the heads'
#: own tree already holds most of what they would graft; docs/decisions/heads-plus-draft.md)
GRAFT = 1


def grafts_heads(heads) -> bool:
    """Whether ``heads`` (a heads drafter) can graft candidates under a draft chain: Medusa heads run
    here (their heads predict each position from the committed row alone). Hydra and EAGLE heads
    expand each node from its own path, and heads fused into a graph are torch-less: those merge as
    separate trees."""
    return type(heads) is MedusaDrafter and heads.heads is not None and not heads.heads.sequential


class HybridDrafter(Drafter):
    """The heads' tree, the draft model's greedy chain and the heads' candidates grafted under the
    chain's nodes, merged into one trie (in that order: when room is short, grafts go first, then the
    chain's tail). Implements :class:`~mtpctl.decode.drafter.Drafter`.

    Args:
        heads: a Medusa heads drafter (:func:`grafts_heads`).
        draft: the draft model's drafter, greedy.
        graft: candidates grafted under each chain node.
    """

    def __init__(self, heads: MedusaDrafter, draft: DraftModelDrafter, graft: int = GRAFT):
        if draft.sampling is not None and not draft.sampling.greedy:
            raise ValueError("a draft model inside a merged tree drafts greedily (its q would not hold in a trie)")
        self.heads, self.draft, self.graft = heads, draft, graft
        self.budget = heads.budget + draft.budget + graft * min(draft.budget, heads.tree.depth - 1)

    def fork(self) -> "HybridDrafter":
        """The same heads with a fork of the draft model (its own KV cache)."""
        return HybridDrafter(self.heads, self.draft.fork(), self.graft)

    @property
    def draft_state_bytes(self) -> int:
        """What the draft model keeps to roll its chain back (a hybrid draft's states), bytes."""
        return self.draft.draft_state_bytes

    def finished(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """The heads and the draft model hear that the request ended."""
        self.heads.finished(prompt_ids, output_ids)
        self.draft.finished(prompt_ids, output_ids)

    def propose(self, context: Sequence[int], max_tokens: int, last: Optional[TargetStep] = None) -> DraftTree:
        pending = context[-1]
        chain = self.draft.propose(context, min(self.draft.budget, max_tokens), last)
        if last is None or max_tokens <= 0:
            return merge_trees(pending, [chain], max_tokens)
        tree = self.heads.tree
        top = self.heads.candidates(last, pending, max(tree.max_rank, self.graft))  # [depth, k]
        grown = tree.draft(pending, top[:, :tree.max_rank], self.heads.budget)
        grafted = DraftTree.chain(chain.tokens)
        for node in range(1, len(chain)):
            depth = chain.depths[node]
            if depth < len(top):  # head depth + 1 predicts the token after this node
                for token in top[depth, :self.graft].tolist():
                    if grafted.child(node, token) is None:
                        grafted.add(node, token)
        return merge_trees(pending, [grown, grafted], max_tokens)
