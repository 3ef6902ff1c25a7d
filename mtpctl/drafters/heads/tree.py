"""Static draft trees of MTP heads (Medusa's sparse tree of top-k candidates): the tree's shape as
paths of ranks, grown from the heads' held-out accuracy, and filled with each step's candidates into
a :class:`~mtpctl.decode.tree.DraftTree`."""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch

from mtpctl.decode.tree import DraftTree
from mtpctl.errors import BadInput

#: draft tree size (nodes) per mode when neither a tree nor a size is given. Measured with the
#: recipe's heads (BENCHMARKS.md, heads section): in float32 4 nodes beat 2 and 8 in one run (1.73x,
#: 1.55x, 1.62x plain) and tied them in the next (with ngram 1.74x vs 1.73x and 1.75x); in int4, whose
#: rows cost about 1 ms each, 2 nodes beat 4 (0.95x vs 0.82x); in dense bfloat16 2 and 4 are within the
#: host's swings (with ngram 1.26x vs 1.22x, alone 1.12x vs 1.21x).
DEFAULT_TREE_NODES = {"float32": 4, "bfloat16": 2, "int4": 2}


@dataclass(frozen=True)
class StaticTree:
    """A static draft tree (Medusa's sparse tree of top-k candidates).

    Each node is a path ``(r1, ..., rd)``: the rank-r1 candidate of head 1, then under it the rank-r2
    candidate of head 2, and so on. Nodes are ordered by depth (then path), so parents precede
    children and every prefix of the node list is itself a tree.
    """

    paths: Tuple[Tuple[int, ...], ...]

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]], num_heads: int) -> "StaticTree":
        """Check and order a list of paths.

        Raises:
            BadInput: an empty tree, an empty path, a negative rank, a duplicate path, a path deeper
                than ``num_heads``, or a path whose parent path is not in the tree.
        """
        if not paths:
            raise BadInput("the draft tree has no paths")
        nodes = set()
        for raw in paths:
            if not isinstance(raw, (list, tuple)) or not raw or not all(isinstance(r, int) and r >= 0 for r in raw):
                raise BadInput(f"draft tree path {raw!r} is not a non-empty list of ranks >= 0")
            path = tuple(raw)
            if path in nodes:
                raise BadInput(f"draft tree path {list(path)} appears twice")
            if len(path) > num_heads:
                raise BadInput(f"draft tree path {list(path)} is {len(path)} deep; the heads predict {num_heads} tokens")
            nodes.add(path)
        for path in nodes:
            if len(path) > 1 and path[:-1] not in nodes:
                raise BadInput(f"draft tree path {list(path)} has no parent path {list(path[:-1])} in the tree")
        return cls(tuple(sorted(nodes, key=lambda p: (len(p), p))))

    @property
    def depth(self) -> int:
        return max(len(p) for p in self.paths)

    @property
    def max_rank(self) -> int:
        """Candidates needed per head (1 + the largest rank)."""
        return 1 + max(r for p in self.paths for r in p)

    def draft(self, pending: int, topk: torch.Tensor, max_nodes: int) -> DraftTree:
        """The draft tree of these paths under ``pending``, filled from ``topk`` ``[K, >= max_rank]``
        candidate ids (head-major: path ``(r1, ..., rd)`` takes head d's rank-rd candidate), cut to its
        first ``max_nodes`` paths."""
        ids = topk.tolist()
        return self.fill(pending, {p: ids[len(p) - 1][p[-1]] for p in self.paths[:max_nodes]}, max_nodes)

    def fill(self, pending: int, tokens: Dict[Tuple[int, ...], int], max_nodes: int) -> DraftTree:
        """The draft tree of the first ``max_nodes`` paths under ``pending``, path p holding
        ``tokens[p]`` (node i + 1 is path i: parents precede children, every prefix is a tree)."""
        tree = DraftTree(pending)
        node = {(): 0}
        for p in self.paths[:max_nodes]:
            node[p] = tree.add(node[p[:-1]], tokens[p])
        return tree


def tree_from_accuracy(topk_accuracy: Sequence[Sequence[float]], nodes: int) -> StaticTree:
    """The tree of ``nodes`` paths that maximises the expected accept length when head k's rank-r
    candidate is right with probability ``topk_accuracy[k][r]``, independently (the construction of
    Medusa, Cai et al. 2024, sec. 3.3.1): grows greedily from the root by the highest path probability.

    Raises:
        BadInput: ``nodes`` < 1 or no accuracy figures.
    """
    if nodes < 1 or not topk_accuracy or not topk_accuracy[0]:
        raise BadInput(f"cannot build a draft tree of {nodes} nodes from {len(topk_accuracy)} head accuracies")
    acc = [list(row) for row in topk_accuracy]
    frontier = [(-acc[0][0], (0,))]
    chosen: List[Tuple[int, ...]] = []
    while frontier and len(chosen) < nodes:
        neg, path = heapq.heappop(frontier)
        chosen.append(path)
        prob = -neg
        depth, rank = len(path) - 1, path[-1]
        if rank + 1 < len(acc[depth]):  # the next sibling
            parent_prob = prob / acc[depth][rank] if acc[depth][rank] > 0 else 0.0
            heapq.heappush(frontier, (-parent_prob * acc[depth][rank + 1], path[:-1] + (rank + 1,)))
        if depth + 1 < len(acc):  # the first child
            heapq.heappush(frontier, (-prob * acc[depth + 1][0], path + (0,)))
    return StaticTree.from_paths(chosen, len(acc))


def expected_accepted(acc: Sequence[Sequence[float]], tree: StaticTree) -> float:
    """Expected accepted draft tokens per step of ``tree`` when head k's rank-r candidate is right
    with probability ``acc[k][r]``, independently."""
    total = 0.0
    for path in tree.paths:
        prob = 1.0
        for depth, rank in enumerate(path):
            prob *= acc[depth][rank]
        total += prob
    return total
