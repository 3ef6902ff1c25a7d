"""One sequence's Gated DeltaNet states, held beside its KV cache (:attr:`mtpctl.model.kv_cache.KVCache.linear`).

A KV cache rolls back by forgetting slots; a Gated DeltaNet layer's state has absorbed every token it
saw, so it is kept, not rolled back (docs/numerics.md, "Gated DeltaNet layers"). A pass stages the
state after each of its tokens (:meth:`LinearCache.stage`: every node of a verified draft tree, or the
last token of a prefill pass) without touching the committed one; committing a root-first path of
the pass's tokens (:meth:`LinearCache.keep`) makes the staged state of the path's last token the
committed state: bit for bit what plain decoding of those tokens would hold, since each node's state
was computed from its parent's by the same step code.

A target's cache keeps nothing else: it never rolls back. A draft model's cache rolls back after each
rejection, so it keeps a short history (:meth:`LinearCache.keep_history`): the committed states at the
last few commits, each the very state object committed then (states are never written in place, so
keeping one copies nothing), and :meth:`LinearCache.rollback` makes the one of an earlier length the
committed state again, bit for bit what it was.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

from mtpctl.errors import UnsupportedModel
from mtpctl.model.gated_deltanet import GatedDeltaNetConfig, LinearState


class LinearCache:
    """The committed :class:`LinearState` of each Gated DeltaNet layer of one sequence, and the states
    the last pass staged.

    Attributes:
        committed: layer index -> the state after the committed tokens.
        staged: layer index -> {token offset in the last pass -> the state after that token}.
        history: how many earlier commits' states are kept for :meth:`rollback` (0: none).
        past: ``(committed length, committed states)`` at each of the last ``history`` commits before
            the current one, oldest first.
    """

    def __init__(self, cfg: GatedDeltaNetConfig, layers: Sequence[int], device="cpu"):
        self.cfg, self.layers, self.device = cfg, tuple(layers), device
        self.committed: Dict[int, LinearState] = {}
        self.staged: Dict[int, Dict[int, LinearState]] = {}
        self.history = 0
        self.past: List[Tuple[int, Dict[int, LinearState]]] = []
        self.reset()

    def reset(self) -> None:
        """Every layer back to the state before a sequence's first token; nothing staged or kept."""
        self.committed = {i: LinearState.zeros(self.cfg, self.device) for i in self.layers}
        self.staged = {}
        self.past = []

    def keep_history(self, commits: int) -> None:
        """Keep the committed states of the last ``commits`` commits before the current one, so that
        :meth:`rollback` can return to the length of any of them (a draft model's cache: its last
        chain, one commit a draft token)."""
        self.history = max(int(commits), 0)
        self.past = self.past[len(self.past) - self.history:] if self.history else []

    def state(self, layer: int) -> LinearState:
        """The committed state of ``layer`` (a pass starts from it; it is never written in place)."""
        return self.committed[layer]

    def stage(self, layer: int, states: Dict[int, LinearState]) -> None:
        """The states after the tokens of a pass in ``layer`` (offset in the pass -> state)."""
        self.staged[layer] = states

    def keep(self, offsets: Sequence[int], length: int) -> None:
        """Commit the pass's tokens ``offsets`` (a root-first path) after ``length`` committed tokens:
        each layer's state becomes the one staged after the last of them (the one before it joins the
        history, when one is kept). An empty path keeps the committed states.

        Raises:
            ValueError: the last pass staged no state after that token (a prefill pass stages only
                its last token's).
        """
        offsets = list(offsets)
        if offsets:
            last = offsets[-1]
            if any(last not in self.staged.get(i, {}) for i in self.layers):
                raise ValueError(f"no Gated DeltaNet state was kept after token {last} of the last pass")
            if self.history:
                self.past = (self.past + [(length, self.committed)])[-self.history:]
            self.committed = {i: self.staged[i][last] for i in self.layers}
        self.staged = {}

    def reachable(self, length: int, committed: int) -> int:
        """The most tokens, at most ``length``, that a sequence of ``committed`` tokens can roll back to:
        ``length`` itself from ``committed`` on, else the longest kept commit's length up to it, else 0
        (the empty sequence, whose state is zeros)."""
        if length >= committed:
            return committed
        return max((n for n, _ in self.past if n <= length), default=0)

    def rollback(self, length: int, committed: int) -> None:
        """Roll the sequence back from ``committed`` tokens to ``length``: the state kept at that length
        becomes the committed one (the history after it is dropped); to ``committed`` itself or to 0
        nothing needs keeping.

        Raises:
            UnsupportedModel: to a length whose state was not kept (:meth:`reachable` says which are).
        """
        self.staged = {}
        if length == committed:
            return
        if length == 0:
            self.reset()
            return
        kept = [states for n, states in self.past if n == length]
        if not kept:
            raise UnsupportedModel(f"cannot roll a Gated DeltaNet state back from {committed} to {length} tokens "
                                   "(its state there was not kept): a drafter that rewinds its cache further than "
                                   "its last chain does not run on this model")
        self.committed = kept[0]
        self.past = [(n, states) for n, states in self.past if n < length]

    @property
    def nbytes(self) -> int:
        """Memory held by the committed states, bytes."""
        return sum(s.nbytes for s in self.committed.values())

    @property
    def past_bytes(self) -> int:
        """Memory held by the states kept for rollback (:attr:`past`), bytes."""
        return sum(s.nbytes for _, states in self.past for s in states.values())

    @property
    def staged_bytes(self) -> int:
        """Memory held by the states the last pass staged, bytes."""
        return sum(s.nbytes for states in self.staged.values() for s in states.values())
