"""Lookahead decoding (Fu, Bailis, Stoica and Zhang, "Break the Sequential Dependency of LLM Inference
Using Lookahead Decoding", ICML 2024): drafts from the target's own Jacobi iterations, with no extra
weights.

Glossary:
- window: ``W`` columns and ``N - 1`` levels of guessed tokens. The token of level l, column c guesses
  the token ``c + l`` places after the pending token; level 0 of column 0 is the pending token itself,
  so level 0 holds columns 1.. (the *base*), the other levels columns 0..W-1.
- lookahead branch: the window's tokens, verified in the same pass as the draft tree as extra rows
  (:class:`~mtpctl.decode.tree.ExtraRows`): a token sees the committed tokens, the pending token,
  the base tokens to its left and its own column below it, i.e. one causal sentence of guesses. The
  target's argmax at the newest level's tokens is the next Jacobi iterate: it becomes a new level, the
  oldest level is dropped (after a warm-up of N - 2 steps that fills the levels).
- n-gram pool: each column, read upwards and followed by the new iterate, is an n-gram of N tokens;
  the pool keeps, per first token, the last ``G`` distinct continuations (least recently seen dropped),
  harvested from the window every step and from the prompt and output as they are committed. It lives
  for one generation.
- verification branch: up to ``G`` pooled continuations of the pending token, as a trie of draft
  tokens; acceptance is the usual one, so greedy output is plain greedy's and sampling accepts a
  candidate with the target's probability, tries the next on rejection and samples the residual
  (the reference's SpecInfer-style rule, :func:`~mtpctl.decode.acceptance.accept_rejection_sampling`).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from mtpctl.decode.attention import MAX_DRAFT_DEPTH
from mtpctl.decode.drafter import Drafter, TargetStep
from mtpctl.decode.engine import StepOutput
from mtpctl.decode.sampling import greedy_token
from mtpctl.decode.tree import DraftTree, ExtraRows
from mtpctl.errors import BadInput


@dataclass(frozen=True)
class LookaheadSettings:
    """``--lookahead W,N,G``: the window's columns, the n-gram size (the window has N - 1 levels; a
    candidate drafts N - 1 tokens) and the most candidates verified per step (and kept per first
    token in the pool).

    The defaults keep a pass small for a CPU, where every row of a pass costs (the reference's 7B
    defaults, W=15, N=5, G=15, make passes of 120 rows): 3,2,3 is a pass of at most 6 rows (the
    root, a window of 2 tokens, 3 one-token candidates). On SmolLM2-135M in bfloat16 over the built-in
    prompt set it gave tau 1.28 against 1.31-1.43 for 3,3,2 to 7,4,7, whose passes of 10 to 42 rows
    cost more than they win here (docs/decisions/lookahead-window.md)."""

    window: int = 3
    ngram: int = 2
    candidates: int = 3

    @classmethod
    def parse(cls, text: str) -> "LookaheadSettings":
        """``"5,4,5"`` -> the settings.

        Raises:
            BadInput: not three whole numbers separated by commas.
        """
        try:
            window, ngram, candidates = (int(v) for v in text.split(","))
        except ValueError:
            raise BadInput(f"lookahead {text!r}: expected W,N,G, three whole numbers such as 4,3,3",
                           option="lookahead") from None
        return cls(window, ngram, candidates)

    def window_rows(self, step: int) -> int:
        """Rows of the window at warm-up step ``step`` (1-based; from N - 1 on, the full window): the
        base shrinks by one column a step while each new level is one column wider than it."""
        s = min(step, self.ngram - 1)
        width = self.window + self.ngram - 1 - s  # each upper level's width once s levels exist
        return (width - 1) + (s - 1) * width

    @property
    def rows(self) -> int:
        """The most rows a step adds to the pass: its widest window and G candidates of N - 1 tokens."""
        window = max(self.window_rows(s) for s in range(1, self.ngram))
        return window + self.candidates * (self.ngram - 1)

    @property
    def depth(self) -> int:
        """The farthest a window token sits after the pending token (its position offset)."""
        return max(self.window + self.ngram - 3, self.ngram - 1)

    def check(self, context_length: int) -> None:
        """Refuse settings no pass can carry.

        Raises:
            BadInput: W < 1, N < 2 or G < 1; a window or candidate deeper than verification supports
                (:data:`~mtpctl.decode.attention.MAX_DRAFT_DEPTH`); a pass longer than the context.
        """
        w, n, g = self.window, self.ngram, self.candidates
        if w < 1 or n < 2 or g < 1:
            raise BadInput(f"lookahead {w},{n},{g}: needs a window W >= 1, an n-gram size N >= 2 and G >= 1 "
                           "candidates", option="lookahead")
        if self.depth > MAX_DRAFT_DEPTH:
            raise BadInput(f"lookahead {w},{n},{g}: the window reaches {self.depth} tokens past the pending one "
                           f"(W + N - 3); verification supports {MAX_DRAFT_DEPTH}", option="lookahead")
        if self.rows + 2 > context_length:
            raise BadInput(f"lookahead {w},{n},{g}: a pass of {self.rows + 1} rows does not fit the model's context of "
                           f"{context_length} tokens with a prompt", option="lookahead")


class NgramPool:
    """n-grams by first token: per token, the last ``size`` distinct continuations seen, least
    recently seen first."""

    def __init__(self, size: int):
        self.size = size
        self._by_first: Dict[int, "OrderedDict[Tuple[int, ...], None]"] = {}

    def add(self, gram: Sequence[int]) -> None:
        """Record ``gram`` (its first token, then its continuation); a known one becomes the most recent."""
        kept = self._by_first.setdefault(int(gram[0]), OrderedDict())
        continuation = tuple(int(t) for t in gram[1:])
        if continuation in kept:
            kept.move_to_end(continuation)
            return
        kept[continuation] = None
        if len(kept) > self.size:
            kept.popitem(last=False)

    def continuations(self, first: int) -> List[Tuple[int, ...]]:
        """The continuations of ``first``, most recently seen first."""
        return list(reversed(self._by_first.get(first, ())))


class LookaheadDrafter(Drafter):
    """Lookahead decoding as a drafter (implements :class:`~mtpctl.decode.drafter.Drafter`): each step
    a trie of the pool's continuations of the pending token, with the Jacobi window attached as extra
    rows (the window first: when a step's room is smaller than the window, the window waits and the
    step verifies candidates only). ``budget`` counts both.

    Args:
        settings: W, N and G.
        seed: seeds the choice of the window's first guesses (tokens of the prompt, as the reference).
    """

    def __init__(self, settings: LookaheadSettings = LookaheadSettings(), seed: int = 0):
        self.settings = settings
        self.budget = settings.rows
        self.seed = seed
        self._forks = 0
        self._reset([])

    def fork(self) -> "LookaheadDrafter":
        """A drafter with the same settings and a window and pool of its own (see
        :meth:`mtpctl.decode.drafter.Drafter.fork`)."""
        self._forks += 1
        return LookaheadDrafter(self.settings, seed=self.seed * 7919 + self._forks)

    def _reset(self, context: List[int]) -> None:
        """A new generation: an empty pool and a window of the context's tokens."""
        s = self.settings
        self.pool = NgramPool(s.candidates)
        self.seen: List[int] = []  # the context of the last call, whose n-grams are pooled
        self.levels: List[List[int]] = []  # levels[0]: the base (columns 1..); levels[l]: columns 0..
        self._sent: Optional[ExtraRows] = None  # the window rows attached to the last proposal
        self._sent_root = -1
        if context:
            rng = random.Random(self.seed)
            self.levels = [[rng.choice(context) for _ in range(s.window + s.ngram - 3)]]

    def propose(self, context: Sequence[int], max_tokens: int, last: Optional[TargetStep] = None) -> DraftTree:
        context = list(context)
        if last is None or last.rows is None or not self.levels or context[:len(self.seen)] != self.seen:
            self._reset(context)
        elif self._sent is not None and last.tree is not None and last.tree.extra is self._sent:
            self._advance(last)
        self._sent = None
        self._pool_context(context)
        pending = context[-1]
        tree = DraftTree(pending)
        if max_tokens <= 0:
            return tree
        window = self._window()
        room = max_tokens - len(window) if len(window) <= max_tokens else max_tokens
        for continuation in self.pool.continuations(pending)[:self.settings.candidates]:
            node = 0
            for token in continuation:
                child = tree.child(node, token)
                if child is None:
                    if tree.drafted >= room:
                        break
                    child = tree.add(node, token)
                node = child
        if len(window) and len(window) <= max_tokens:
            tree.extra, self._sent, self._sent_root = window, window, pending
        return tree

    def _pool_context(self, context: List[int]) -> None:
        """Pool the n-grams of the context that end after what was pooled before (prompt and output)."""
        n = self.settings.ngram
        for end in range(max(len(self.seen) + 1, n), len(context) + 1):
            self.pool.add(context[end - n:end])
        self.seen = context

    # -- the window ---------------------------------------------------------------------------------
    def _layout(self) -> List[List[int]]:
        """Extra-row index of each window token, ``[level][column]`` (level 0's column 0 is the root:
        -1); rows are laid out level by level, so a token's row order is its position order."""
        layout, start = [], 0
        for level, tokens in enumerate(self.levels):
            layout.append(([-1] if level == 0 else []) + list(range(start, start + len(tokens))))
            start += len(tokens)
        return layout

    def _window(self) -> ExtraRows:
        """The window as extra rows: token (level, column) at offset column + level, seeing the base
        tokens to its left and its own column below it (every row sees the root, row 0 of the pass)."""
        layout = self._layout()
        tokens, offsets, sees = [], [], []
        for level, columns in enumerate(layout):
            for column, row in enumerate(columns):
                if row < 0:
                    continue  # the root: a node of the tree, not a window row
                left = layout[0][1:column + (level > 0)]  # level 0: the base before it; above: up to its column
                below = [layout[lv][column] for lv in range(1, level)]
                tokens.append(self.levels[level][column - (level == 0)])
                offsets.append(column + level)
                sees.append(tuple(left + below))
        return ExtraRows(tuple(tokens), tuple(offsets), tuple(sees))

    def _advance(self, last: TargetStep) -> None:
        """The pass that carried the window gave the next Jacobi iterate (the argmax at the newest
        level): a new level during the warm-up; then harvest each column's n-gram and drop the oldest
        level."""
        out, first = last.out, len(last.tree)
        layout = self._layout()
        top = len(self.levels) - 1
        rows = [0 if r < 0 else first + r for r in layout[top]]  # pass rows of the newest level, columns 0..
        if isinstance(out, StepOutput):  # the newest level's logits in one lm_head call (rows alone: read each)
            out.prefetch(rows)
        new = [greedy_token(out[row]) for row in rows]
        levels = self.levels
        if top < self.settings.ngram - 2:  # warm-up: one level more, every level one column narrower
            self.levels = [levels[0][1:]] + [level[1:] for level in levels[1:]] + [new[1:]]
            return
        for column in range(len(new)):
            bottom = self._sent_root if column == 0 else levels[0][column - 1]
            self.pool.add([bottom] + [levels[lv][column] for lv in range(1, top + 1)] + [new[column]])
        upper = levels[1:] + [new]
        self.levels = [upper[0][1:]] + upper[1:]
