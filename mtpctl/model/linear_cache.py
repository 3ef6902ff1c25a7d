"""One sequence's Gated DeltaNet states, held beside its KV cache (:attr:`mtpctl.model.kv_cache.KVCache.linear`).

A KV cache rolls back by forgetting slots; a Gated DeltaNet layer's state has absorbed every token it
saw, so it is kept, not rolled back (docs/numerics.md, "Gated DeltaNet layers"). A pass stages the
state after each of its tokens (:meth:`LinearCache.stage`: every node of a verified draft tree, or the
last token of a prefill pass) without touching the committed one; committing a root-first path of
the pass's tokens (:meth:`LinearCache.keep`) makes the staged state of the path's last token the
committed state: bit for bit what plain decoding of those tokens would hold, since each node's state
was computed from its parent's by the same step code.
"""

from __future__ import annotations

from typing import Dict, Sequence

from mtpctl.errors import UnsupportedModel
from mtpctl.model.gated_deltanet import GatedDeltaNetConfig, LinearState


class LinearCache:
    """The committed :class:`LinearState` of each Gated DeltaNet layer of one sequence, and the states
    the last pass staged.

    Attributes:
        committed: layer index -> the state after the committed tokens.
        staged: layer index -> {token offset in the last pass -> the state after that token}.
    """

    def __init__(self, cfg: GatedDeltaNetConfig, layers: Sequence[int], device="cpu"):
        self.cfg, self.layers, self.device = cfg, tuple(layers), device
        self.committed: Dict[int, LinearState] = {}
        self.staged: Dict[int, Dict[int, LinearState]] = {}
        self.reset()

    def reset(self) -> None:
        """Every layer back to the state before a sequence's first token; nothing staged."""
        self.committed = {i: LinearState.zeros(self.cfg, self.device) for i in self.layers}
        self.staged = {}

    def state(self, layer: int) -> LinearState:
        """The committed state of ``layer`` (a pass starts from it; it is never written in place)."""
        return self.committed[layer]

    def stage(self, layer: int, states: Dict[int, LinearState]) -> None:
        """The states after the tokens of a pass in ``layer`` (offset in the pass -> state)."""
        self.staged[layer] = states

    def keep(self, offsets: Sequence[int]) -> None:
        """Commit the pass's tokens ``offsets`` (a root-first path): each layer's state becomes the one
        staged after the last of them. An empty path keeps the committed states.

        Raises:
            ValueError: the last pass staged no state after that token (a prefill pass stages only
                its last token's).
        """
        offsets = list(offsets)
        if offsets:
            last = offsets[-1]
            if any(last not in self.staged.get(i, {}) for i in self.layers):
                raise ValueError(f"no Gated DeltaNet state was kept after token {last} of the last pass")
            self.committed = {i: self.staged[i][last] for i in self.layers}
        self.staged = {}

    def check_rollback(self, length: int, committed: int) -> None:
        """A rollback of the sequence from ``committed`` tokens to ``length``: only to where it is.

        Raises:
            UnsupportedModel: to fewer tokens (a Gated DeltaNet state cannot forget tokens).
        """
        if length != committed:
            raise UnsupportedModel(f"cannot roll a Gated DeltaNet state back from {committed} to {length} tokens "
                                   "(it keeps no history): a draft model or drafter that rewinds its cache does "
                                   "not run on this model")
        self.staged = {}

    @property
    def nbytes(self) -> int:
        """Memory held by the committed states, bytes."""
        return sum(s.nbytes for s in self.committed.values())

    @property
    def staged_bytes(self) -> int:
        """Memory held by the states the last pass staged, bytes."""
        return sum(s.nbytes for states in self.staged.values() for s in states.values())
