"""The draft tree: the one shape every drafter proposes, the engine verifies, acceptance walks, merging
extends and exported graphs take as a mask.

Glossary:
- node: one token of a verify pass. Node 0, the root, is the pending token (the target's last
  prediction, not yet in the KV cache); nodes 1..N-1 are draft tokens.
- parent: ``parents[i]`` is the node that node i follows (-1 for the root); parents precede their
  children, so every prefix of the node list is itself a tree.
- depth: distance from the root (root 0); a node's position is the committed length + its depth.
- path: the nodes from the root down to a node, root first; acceptance commits one path.
- chain: a tree where node i follows node i - 1 (prompt lookup, draft models).

Row i of a verify pass is node i, so the engine, acceptance and commit use the same indices: no
shifting anywhere. A tree may carry extra rows after its nodes (:class:`ExtraRows`: lookahead
decoding's Jacobi window), which the pass computes but acceptance never reads and commit never keeps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch


@dataclass(frozen=True)
class ExtraRows:
    """Rows of a verify pass that are not draft tokens, carried after a tree's N nodes (rows N..N+M-1):
    lookahead decoding's Jacobi window, whose predictions feed its n-gram pool. Row r holds
    ``tokens[r]`` at position ``committed length + offsets[r]`` (the root at offset 0) and attends to
    the committed tokens, the root, the earlier extra rows ``sees[r]`` (in position order) and itself,
    never to the tree's other nodes; no node attends to it. Acceptance never reads these rows and
    commit never keeps their KV; the drafter that attached them reads their logits in its next call
    (:attr:`mtpctl.decode.drafter.TargetStep.tree` is the tree the pass verified).

    Raises:
        ValueError: lengths that differ, an offset below 1, or a row that sees a row not before it.
    """

    tokens: Tuple[int, ...]
    offsets: Tuple[int, ...]
    sees: Tuple[Tuple[int, ...], ...]

    def __post_init__(self):
        if not len(self.tokens) == len(self.offsets) == len(self.sees):
            raise ValueError(f"extra rows: {len(self.tokens)} tokens, {len(self.offsets)} offsets, {len(self.sees)} "
                             "attention lists")
        for r, (offset, seen) in enumerate(zip(self.offsets, self.sees)):
            if offset < 1 or any(not 0 <= j < r for j in seen):
                raise ValueError(f"extra row {r} at offset {offset} sees rows {list(seen)}: offsets start at 1 and a "
                                 "row sees only rows before it")

    def __len__(self) -> int:
        return len(self.tokens)


class DraftTree:
    """Tokens of one verify pass as a tree rooted at the pending token.

    Build one with :meth:`chain` or :meth:`root` and :meth:`add`; once handed to the engine it is
    read only.

    Attributes:
        tokens: ``[N]`` token ids, ``tokens[0]`` the pending token.
        parents: ``[N]`` parent node of each node, ``parents[0] == -1``.
        depths: ``[N]`` each node's depth (root 0).
        q: ``[N, vocab]`` float32, row i the drafter's distribution that node i's token was drawn from
            (row 0 unused); None for deterministic drafts (q one-hot at each draft token).
        extra: rows the pass carries after the nodes (:class:`ExtraRows`), or None.
    """

    def __init__(self, root: int):
        self.tokens: List[int] = [int(root)]
        self.parents: List[int] = [-1]
        self.depths: List[int] = [0]
        self.q: Optional[torch.Tensor] = None
        self.extra: Optional[ExtraRows] = None
        self._children: List[List[int]] = [[]]
        self._by_edge: Dict[Tuple[int, int], int] = {}
        self._chain = True

    @classmethod
    def chain(cls, tokens: Sequence[int], q: Optional[torch.Tensor] = None) -> "DraftTree":
        """A chain: ``tokens[0]`` the root, each next token following the one before; ``q``
        ``[len(tokens) - 1, vocab]`` the draft tokens' distributions (stored with a zero row for the root).

        Raises:
            ValueError: no token, or ``q`` with another number of rows than draft tokens.
        """
        if not len(tokens):
            raise ValueError("a draft tree needs its root (the pending token)")
        tree = cls(tokens[0])
        for token in tokens[1:]:
            tree.add(len(tree) - 1, token)
        if q is not None:
            if q.shape[0] != len(tokens) - 1:
                raise ValueError(f"{q.shape[0]} draft distributions for {len(tokens) - 1} draft tokens")
            tree.q = torch.cat((q.new_zeros(1, q.shape[1]), q))
        return tree

    @classmethod
    def from_parents(cls, tokens: Sequence[int], parents: Sequence[int]) -> "DraftTree":
        """A tree given every node's token and parent (``parents[0] == -1``, the root).

        Raises:
            ValueError: lengths that differ, a root with a parent, or a parent that does not precede
                its child.
        """
        if len(tokens) != len(parents) or not len(tokens) or parents[0] != -1:
            raise ValueError(f"a draft tree needs one parent per token and a root first (parent -1); got "
                             f"{len(tokens)} tokens and parents {list(parents)[:4]}...")
        tree = cls(tokens[0])
        for token, parent in zip(tokens[1:], parents[1:]):
            tree.add(parent, token)
        return tree

    def add(self, parent: int, token: int) -> int:
        """Append a node holding ``token`` under node ``parent``; returns its index.

        Raises:
            ValueError: ``parent`` is not a node of this tree.
        """
        if not 0 <= parent < len(self.tokens):
            raise ValueError(f"draft tree node {len(self.tokens)} has parent {parent}: parents must precede children")
        node = len(self.tokens)
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self._children.append([])
        self._children[parent].append(node)
        self._by_edge.setdefault((parent, int(token)), node)
        self._chain = self._chain and parent == node - 1
        return node

    def child(self, parent: int, token: int) -> Optional[int]:
        """The first child of ``parent`` holding ``token``, or None."""
        return self._by_edge.get((parent, int(token)))

    def children(self, node: int) -> List[int]:
        """The children of ``node``, in the order they were added."""
        return self._children[node]

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def drafted(self) -> int:
        """Draft tokens (every node but the root)."""
        return len(self.tokens) - 1

    @property
    def rows(self) -> int:
        """Rows of the verify pass: the nodes, then the extra rows."""
        return len(self.tokens) + (len(self.extra) if self.extra is not None else 0)

    @property
    def pass_tokens(self) -> List[int]:
        """The tokens of the verify pass's rows: the nodes', then the extra rows'."""
        return self.tokens + (list(self.extra.tokens) if self.extra is not None else [])

    @property
    def depth(self) -> int:
        """The deepest node's depth: the most draft tokens one step can accept."""
        return max(self.depths)

    @property
    def is_chain(self) -> bool:
        """Each node follows the one before (its slots sit at their positions: no tree attention)."""
        return self._chain

    def path(self, node: int) -> List[int]:
        """Nodes from the root down to ``node``, root first."""
        out = [node]
        while self.parents[out[-1]] >= 0:
            out.append(self.parents[out[-1]])
        return out[::-1]

    def ancestor_mask(self) -> torch.Tensor:
        """``[N, N]`` bool, True where node j is node i or one of its ancestors (who attends to whom)."""
        n = len(self.tokens)
        mask = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            mask[i] |= mask[self.parents[i]]
        return mask

    def depth_tensor(self) -> torch.Tensor:
        """``[N]`` long, the depths."""
        return torch.tensor(self.depths, dtype=torch.long)

    def __repr__(self) -> str:
        extra = f", extra={len(self.extra)} rows" if self.extra is not None else ""
        return f"DraftTree(tokens={self.tokens}, parents={self.parents}{extra})"
