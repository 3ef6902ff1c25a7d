"""The engine contract: what the decoding loop, the drafters and acceptance need of a backend.

Every backend (:mod:`mtpctl.backends`) implements :class:`Engine` over one sequence and its KV cache,
and returns a :class:`StepOutput` from each pass. A verify pass scores the N nodes of a
:class:`~mtpctl.decode.tree.DraftTree` (row i = node i) without committing them; ``commit(path)``
keeps the KV of one root-first path of those nodes; ``rollback(length)`` forgets every committed
token from ``length`` on (the cache is indexed by position, so this costs nothing).
"""

from __future__ import annotations

from typing import Dict, Optional, Protocol, Sequence

import torch

from mtpctl.decode.tree import DraftTree


class LogitsTimer(Protocol):
    """What a pass's logits cost: ``ms`` spent computing them (shared by the sequences of a packed pass)."""

    ms: float


class StepOutput:
    """One forward pass of N tokens; each backend's output subclasses it.

    ``out[i]`` is row i's logits ``[vocab]`` float32 (computed on demand where that is cheaper);
    ``out.logits`` all rows ``[N, vocab]``. What a backend may not have is declared here with its
    default: no prompt rows, no MTP head logits, no aux layers, no lm_head timer, nothing to
    prefetch, no argmax taken ahead.
    """

    hidden_states: torch.Tensor  # [N, hidden] after the final norm
    logits: torch.Tensor  # [N, vocab] float32, every row (an attribute or a property computing them)
    prompt_hidden_states: Optional[torch.Tensor] = None  # prefill: [T, hidden] every prompt row where kept
    head_logits: Optional[torch.Tensor] = None  # [N, K, vocab] MTP heads run inside the pass (an exported graph)
    # the engine's aux_layers: layer id -> [N, hidden] residual stream of every row (EAGLE-3 reads them)
    aux_hidden_states: Optional[Dict[int, torch.Tensor]] = None
    logits_timer: Optional[LogitsTimer] = None  # the time its logits took, where the backend measures it

    def __len__(self) -> int:
        raise NotImplementedError

    def __getitem__(self, i: int) -> torch.Tensor:
        raise NotImplementedError

    def prefetch(self, rows: Sequence[int]) -> None:
        """Rows to be read soon: a backend may compute them together with other sequences' rows
        (see :func:`mtpctl.decode.acceptance.accept_greedy_together`). Nothing by default."""

    def greedy(self, i: int) -> Optional[int]:
        """Row i's argmax (the first index of its largest logit) where the backend has it without
        reading the row again, else None (the default; see :func:`mtpctl.decode.acceptance.accept_greedy`).
        None, never a token, for a row holding NaN or inf."""
        return None


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
