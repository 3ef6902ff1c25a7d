"""Retrieval drafting: draft trees looked up in a datastore of the target's own text.

REST (He et al. 2023, "REST: Retrieval-Based Speculative Decoding") drafts without a draft model:
it finds the longest suffix of the context in a datastore of token sequences and proposes the most
frequent continuations of that suffix as a draft tree. mtpctl's datastore is the target's own
greedy responses from self-distillation (``mtpctl add-heads`` writes it next to the heads), so
the continuations are the target's habits (its openings, list layouts, closing phrases), which the
context itself (prompt lookup) does not hold.

The datastore is a truncated suffix array: every position's next ``key_len`` tokens, sorted
lexicographically, kept as one ``[positions, key_len]`` matrix. Rows that match a suffix form one
contiguous block, and inside it the continuations are sorted too, so how often each continuation
prefix occurs is a run length.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from mtpctl.errors import BadInput
from mtpctl.decode.drafter import Drafter, TargetStep
from mtpctl.decode.tree import DraftTree

DATASTORE_FILE = "mtp_datastore.safetensors"
SEPARATOR = -1  # ends each sequence in the stored token stream; no match crosses it


@dataclass
class Datastore:
    """Token sequences indexed for suffix lookup.

    ``tokens`` is what is stored on disk (the sequences joined, each followed by ``SEPARATOR``);
    ``keys`` is built from it on load.
    """

    tokens: np.ndarray  # [T] int64 token ids, each sequence followed by SEPARATOR
    keys: np.ndarray  # [T, key_len] int32, column-major: row r = tokens[p : p + key_len] for the r-th
    #                   position p in lexicographic order, SEPARATOR-padded after a sequence's end

    @classmethod
    def from_sequences(cls, sequences: Sequence[Sequence[int]], key_len: int = 16) -> "Datastore":
        """Index ``sequences`` (lists of token ids); empty sequences are skipped.

        Raises:
            ValueError: no non-empty sequence, a negative token id, or ``key_len < 2``.
        """
        parts = [np.asarray(list(s) + [SEPARATOR], dtype=np.int64) for s in sequences if len(s)]
        if not parts:
            raise ValueError("a datastore needs at least one non-empty token sequence")
        tokens = np.concatenate(parts)
        if (tokens[tokens != SEPARATOR] < 0).any():
            raise ValueError("token ids must be >= 0")
        return cls.from_tokens(tokens, key_len)

    @classmethod
    def from_tokens(cls, tokens: np.ndarray, key_len: int = 16) -> "Datastore":
        """Index a stored token stream ([T], sequences each followed by ``SEPARATOR``)."""
        if key_len < 2:
            raise ValueError(f"key_len must be at least 2, got {key_len}")
        padded = np.concatenate([tokens, np.full(key_len, SEPARATOR, dtype=np.int64)])
        windows = np.lib.stride_tricks.sliding_window_view(padded, key_len)[: len(tokens)]
        # after a separator the rest of the window is padding, so no key spans two sequences
        ended = np.cumsum(windows == SEPARATOR, axis=1) > 0
        keys = np.where(ended, SEPARATOR, windows).astype(np.int32)
        keys = keys[tokens != SEPARATOR]
        order = np.lexsort(keys.T[::-1])
        return cls(tokens=tokens, keys=np.asfortranarray(keys[order]))

    @classmethod
    def load(cls, path: Path, vocab_size: int, key_len: int = 16) -> "Datastore":
        """Read a datastore file (safetensors, one 1-D integer tensor ``tokens``), strictly.

        Raises:
            BadInput: unreadable file, other or missing tensors, a tensor of the wrong shape or
                dtype, no token at all, token ids outside ``[0, vocab_size)`` or a recorded vocabulary
                size other than ``vocab_size`` (another model's datastore).
        """
        try:
            with safe_open(str(path), framework="pt") as handle:  # one read: tensors and metadata
                tensors = {name: handle.get_tensor(name) for name in handle.keys()}
                metadata = handle.metadata() or {}
        except (OSError, SafetensorError) as err:
            raise BadInput(f"cannot read datastore {path}: {err}") from err
        if set(tensors) != {"tokens"}:
            raise BadInput(f"datastore {path} must hold exactly one tensor 'tokens', found {sorted(tensors)}")
        tokens = tensors["tokens"]
        if tokens.dim() != 1 or tokens.dtype not in (torch.int32, torch.int64) or not len(tokens):
            raise BadInput(f"datastore {path}: 'tokens' must be a non-empty 1-D int32/int64 tensor, "
                           f"got {tuple(tokens.shape)} {tokens.dtype}")
        tokens = tokens.to(torch.int64).numpy()
        body = tokens[tokens != SEPARATOR]
        if not len(body):
            raise BadInput(f"datastore {path} holds no tokens (only sequence ends)")
        if body.min() < 0 or body.max() >= vocab_size:
            raise BadInput(f"datastore {path} holds token ids outside this model's vocabulary "
                           f"(0..{vocab_size - 1}): it was made for another model")
        made_for = metadata.get("vocab_size")
        if made_for is not None and made_for != str(vocab_size):
            raise BadInput(f"datastore {path} was made for a model with vocabulary {made_for}; this one has "
                           f"{vocab_size}: it was made for another model")
        return cls.from_tokens(tokens, key_len)

    def save(self, path: Path, vocab_size: Optional[int] = None) -> None:
        """Write the token stream (int32) as safetensors; ``vocab_size`` (the model's, recorded in the
        file's metadata) makes :meth:`load` refuse the datastore for a model of another vocabulary."""
        metadata = None if vocab_size is None else {"vocab_size": str(int(vocab_size))}
        save_file({"tokens": torch.from_numpy(self.tokens.astype(np.int32))}, str(path), metadata=metadata)

    @property
    def key_len(self) -> int:
        return self.keys.shape[1]

    def __len__(self) -> int:
        return len(self.keys)

    def match(self, suffix: Sequence[int]) -> tuple:
        """``(lo, hi)``: the rows of ``keys`` whose first ``len(suffix)`` tokens equal ``suffix``
        (``lo == hi`` when it does not occur)."""
        lo, hi = 0, len(self.keys)
        for j, token in enumerate(suffix):
            column, token = self.keys[lo:hi, j], np.int32(token)  # same dtype: no conversion of the column
            lo, hi = lo + int(column.searchsorted(token, "left")), lo + int(column.searchsorted(token, "right"))
            if lo == hi:
                break
        return lo, hi


class RetrievalDrafter(Drafter):
    """Proposes a draft tree of the most frequent datastore continuations of the context (REST).

    The longest suffix of the context (``max_match`` tokens down to ``min_match``) that occurs in
    the datastore selects its occurrences; every continuation prefix of up to ``depth`` tokens is a
    candidate node, counted over those occurrences (at most ``max_rows`` of them, evenly spaced over
    the sorted block, when a short suffix matches many). The ``max_tokens`` most frequent candidates
    (shallower first at equal counts) form the tree; a node whose share of the occurrences is below
    ``min_share`` is left out (a verify pass pays for every node; merged into a heads+ngram tree on 14
    benchmark prompts, the default 0.25 gave tau 2.07 with 6.41 nodes a step against 2.10 with 7.51
    without it: docs/decisions/merged-trees-and-retrieval.md). Deterministic, so
    greedy and tree rejection sampling stay lossless. ``budget``: the most nodes proposed a step.

    Raises:
        ValueError: bad settings (``1 <= min_match <= max_match``, ``max_match + depth <= key_len``).
    """

    def __init__(self, store: Datastore, max_match: int = 8, min_match: int = 1, depth: int = 8,
                 max_rows: int = 4096, min_share: float = 0.25, budget: int = 4):
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {min_match} and {max_match}")
        if max_match + depth > store.key_len or depth < 1:
            raise ValueError(f"max_match + depth must be within the datastore's key length {store.key_len}")
        self.store, self.max_match, self.min_match, self.depth = store, max_match, min_match, depth
        self.max_rows, self.min_share, self.budget = max_rows, min_share, budget

    def fork(self) -> "RetrievalDrafter":
        """Itself: it keeps no per-request state (see :meth:`mtpctl.decode.drafter.Drafter.fork`)."""
        return self

    def propose(self, context: Sequence[int], max_tokens: int, last: Optional[TargetStep] = None) -> DraftTree:
        pending = context[-1]
        if max_tokens <= 0:
            return DraftTree(pending)
        tail = list(context[-self.max_match:])
        for n in range(len(tail), self.min_match - 1, -1):
            lo, hi = self.store.match(tail[-n:])
            if hi > lo:
                return self._tree(pending, self.store.keys[lo:hi, n:n + self.depth], max_tokens)
        return DraftTree(pending)

    def _tree(self, pending: int, block: np.ndarray, max_tokens: int) -> DraftTree:
        """Top continuation prefixes of ``block`` ([rows, depth] sorted continuations) as a tree."""
        if len(block) > self.max_rows:
            block = block[np.linspace(0, len(block) - 1, self.max_rows).round().astype(np.int64)]
        rows = len(block)
        changed = np.zeros(rows - 1, dtype=bool)
        candidates = []  # (count, depth, row)
        for d in range(block.shape[1]):
            changed |= block[1:, d] != block[:-1, d]
            starts = np.flatnonzero(np.concatenate([[True], changed]))
            counts = np.diff(np.concatenate([starts, [rows]]))
            ok = (block[starts, d] != SEPARATOR) & (counts >= max(1, self.min_share * rows))
            starts, counts = starts[ok], counts[ok]
            if not len(starts):
                break
            top = np.argsort(-counts, kind="stable")[:max_tokens]
            candidates += [(int(counts[i]), d + 1, int(starts[i])) for i in top]
        # most frequent first, a parent (as frequent as its children at least) before its children: the
        # first k nodes of a larger draft are the draft of k nodes (what the auto policy's cuts assume)
        candidates.sort(key=lambda c: (-c[0], c[1]))
        tree = DraftTree(pending)
        node = {(): 0}  # token path -> its node
        for _, d, row in candidates[:max_tokens]:
            path = tuple(int(t) for t in block[row, :d])
            if path[:-1] in node:
                node[path] = tree.add(node[path[:-1]], path[-1])
        return tree
