"""The engine contract: what the decoding loop, the drafters and acceptance need of a backend.

Every backend (:mod:`mtpctl.backends`) implements :class:`Engine` over one sequence and its KV cache,
and returns a :class:`StepOutput` from each pass. A verify pass scores the N nodes of a
:class:`~mtpctl.decode.tree.DraftTree` (row i = node i) without committing them; ``commit(path)``
keeps the KV of one root-first path of those nodes; ``rollback(length)`` forgets every committed
token from ``length`` on (the cache is indexed by position, so this costs nothing).
"""

from __future__ import annotations

from typing import Optional, Protocol, Sequence

import torch

from mtpctl.decode.tree import DraftTree


class StepOutput(Protocol):
    """One forward pass of N tokens.

    ``out[i]`` is row i's logits ``[vocab]`` float32 (computed on demand where that is cheaper);
    ``out.logits`` all rows ``[N, vocab]``.
    """

    hidden_states: torch.Tensor  # [N, hidden] after the final norm
    prompt_hidden_states: Optional[torch.Tensor]  # prefill: [T, hidden] every prompt row where kept, else None
    head_logits: Optional[torch.Tensor]  # [N, K, vocab] MTP heads run inside the pass (an exported graph), else None

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> torch.Tensor: ...

    def prefetch(self, rows: Sequence[int]) -> None:
        """Rows to be read soon: a backend may compute them together with other sequences' rows
        (optional; see :func:`mtpctl.decode.acceptance.accept_greedy_together`)."""

    def greedy(self, i: int) -> Optional[int]:
        """Row i's argmax (the first index of its largest logit) where the backend has it without
        reading the row again, else None (optional; see :func:`mtpctl.decode.acceptance.accept_greedy`).
        None, never a token, for a row holding NaN or inf."""

    @property
    def logits(self) -> torch.Tensor: ...


class Engine(Protocol):
    """A backend running the target on one sequence with its own KV cache."""

    @property
    def length(self) -> int:
        """Committed tokens in the KV cache."""

    @property
    def capacity(self) -> int:
        """The most tokens (committed + one pass) the cache holds."""

    @property
    def kv_cache_bytes(self) -> int:
        """Memory held by the KV cache at ``capacity``, bytes."""

    def prefill(self, prompt_ids: Sequence[int]) -> StepOutput:
        """Forget the cache, run and commit the prompt; returns the last position's output (one row)."""

    def verify(self, tree: DraftTree) -> StepOutput:
        """Score the tree's N nodes after the committed tokens (row i: the prediction after node i);
        nothing is committed."""

    def commit(self, path: Sequence[int]) -> None:
        """Keep the KV of the last verify pass's nodes ``path`` (root first)."""

    def rollback(self, length: int) -> None:
        """Forget the committed tokens from ``length`` on."""
