"""The torch engine: the small interface every backend implements for the decoding loop.

``prefill(prompt)`` fills the KV cache and returns the last position's output; ``verify(tokens,
parents)`` scores a chain or a draft tree of N tokens in one forward pass without committing it
(both return a :class:`StepOutput`: hidden states, logits by row);
``commit(offsets)`` keeps the KV entries of the accepted tokens. The loop, drafters and acceptors
are backend-free and only use this interface.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch
from torch import nn

from mtpctl.model.decoder import AttentionGroup, AttentionPlan, Decoder
from mtpctl.model.native import SlotPlan, kernel_runs


class StepOutput:
    """One forward pass: hidden states of its N tokens and their logits, computed on demand.

    ``out[i]`` is row i's logits ``[vocab]`` (float32); ``out.logits`` all rows ``[N, vocab]``.
    With an int4 lm_head, rows are computed one at a time as they are read (an acceptor stops at the
    first rejection, and the int4 kernel's cost grows with the rows of a call); otherwise all rows are
    computed together at the first read (a dense lm_head reads its weights once for all N rows, far
    cheaper than N one-row calls).
    """

    def __init__(self, model: Decoder, hidden_states: torch.Tensor, heads: Optional[nn.Module] = None,
                 prompt_hidden_states: Optional[torch.Tensor] = None):
        self.model = model
        self.heads = heads
        self.hidden_states = hidden_states  # [N, hidden], after the final norm
        self.prompt_hidden_states = prompt_hidden_states  # prefill: [T, hidden] every prompt row; else None
        self._rows: Dict[int, torch.Tensor] = {}
        self._all: Optional[torch.Tensor] = None
        self._draft: Dict[tuple, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.hidden_states.shape[0]

    def __getitem__(self, i: int) -> torch.Tensor:
        i = i % len(self)
        if self._all is not None:
            return self._all[i]
        if not self.model.logits_by_row:
            return self.logits[i]
        if i not in self._rows:
            with torch.inference_mode():
                self._rows[i] = self.model.logits(self.hidden_states[i:i + 1])[0]
        return self._rows[i]

    def draft_logits(self, i: int, token: Optional[int] = None, heads: Optional[int] = None) -> torch.Tensor:
        """The MTP heads' logits at row i, ``[K, vocab]`` float32 (head k predicts the token k + 1
        places after row i's prediction ``token``, which token-conditioned heads read). Computed for
        the rows a drafter reads (the accepted one), the K heads' vocabulary projections in one call;
        with ``heads`` only the first ``heads`` heads run (``[heads, vocab]``; Medusa heads, which
        do not read each other).

        Raises:
            ValueError: the engine has no MTP heads, or token-conditioned heads get no ``token``.
        """
        self._require_heads()
        i = i % len(self)
        key = (i, token, heads)
        if key not in self._draft:
            embeds = None
            if self.heads.cfg.token_conditioned:
                if token is None:
                    raise ValueError("token-conditioned heads need the pending token")
                embeds = self.model.embed[token].to(self.hidden_states.dtype)
            with torch.inference_mode():
                self._draft[key] = self.heads(self.hidden_states[i], self.model.logits, token_embeds=embeds, count=heads)
        return self._draft[key]

    def draft_tree(self, i: int, token: int, tree, max_nodes: int):
        """Hydra heads: the draft tree (:class:`mtpctl.runtime.drafters.Draft`) of ``tree``'s first
        ``max_nodes`` paths grown from row i, whose prediction is ``token``
        (:meth:`mtpctl.runtime.heads.MedusaHeads.draft_tree`).

        Raises:
            ValueError: the engine has no MTP heads.
        """
        self._require_heads()
        dtype = self.hidden_states.dtype
        with torch.inference_mode():
            return self.heads.draft_tree(self.hidden_states[i % len(self)], token, tree, max_nodes,
                                         embed=lambda ids: self.model.embed[ids].to(dtype), lm_head=self.model.logits)

    def _require_heads(self) -> None:
        if self.heads is None:
            raise ValueError("this engine runs no MTP heads")

    @property
    def logits(self) -> torch.Tensor:
        """All rows' logits ``[N, vocab]`` float32."""
        if self._all is None:
            with torch.inference_mode():
                self._all = self.model.logits(self.hidden_states)
        return self._all


def tree_positions(parents: Sequence[int]) -> tuple:
    """Depths ``[N]`` and ancestor mask ``tree_mask [N, N]`` (True where j is i or an ancestor of i)
    of a draft tree given each node's parent index (-1 for the root; parents precede children).

    Raises:
        ValueError: a parent index does not precede its child.
    """
    n = len(parents)
    depth = [0] * n
    tree_mask = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p < 0:
            continue
        if p >= i:
            raise ValueError(f"draft tree node {i} has parent {p}: parents must precede children")
        depth[i] = depth[p] + 1
        tree_mask[i] |= tree_mask[p]
    return torch.tensor(depth, dtype=torch.long), tree_mask


def graph_step_inputs(past: int, n: int, parents: Optional[Sequence[int]]) -> tuple:
    """Position ids ``[1, N]`` and the bool attention mask ``[1, N, past + N]`` (True = may attend)
    of a pass of N tokens (a chain, or a draft tree given ``parents``) after ``past`` committed ones,
    as an exported graph takes them (:mod:`mtpctl.runtime.ort_engine`, :mod:`mtpctl.runtime.trt_engine`).

    Raises:
        ValueError: a parent index does not precede its child.
    """
    if parents is None:
        depth, new = torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril()
    else:
        depth, new = tree_positions(parents)
    mask = torch.ones(1, n, past + n, dtype=torch.bool)
    mask[0, :, past:] = new
    return (past + depth)[None], mask


#: a token's attention head (slots read in place) ends on a multiple of this many slots (16: a tail of
#: 32 slots; 32 cost a tree of 12 nodes about 3 ms more per verify pass in dense bfloat16, the longer
#: tails' copies and batched matmuls)
HEAD_BLOCK = 16
#: slots of a token's attention tail (gathered in path order): the committed slots after its head,
#: then its path; the head ends at least HEAD_BLOCK slots before the token, so draft trees may be up
#: to ``MAX_DRAFT_DEPTH`` deep and still keep every head inside the committed slots (a chain's slots
#: all sit at their positions already: any length)
TAIL = 2 * HEAD_BLOCK
MAX_DRAFT_DEPTH = TAIL - HEAD_BLOCK


def head_length(position: int) -> int:
    """Head length of a token at ``position``: the largest multiple of ``HEAD_BLOCK`` that is at most
    ``position - HEAD_BLOCK`` (0 near the start). A function of the position alone, so plain decoding
    and a verify pass split a token's attention the same way; its tail then holds HEAD_BLOCK + 1 to
    TAIL slots (p + 1 below position TAIL)."""
    return max(0, (position - HEAD_BLOCK) // HEAD_BLOCK * HEAD_BLOCK)


def _check_depth(depth: torch.Tensor, tree_mask: Optional[torch.Tensor]) -> None:
    """ValueError for a draft tree deeper than :data:`MAX_DRAFT_DEPTH` (chains may be any length)."""
    if tree_mask is not None and depth.shape[0] and int(depth.max()) > MAX_DRAFT_DEPTH:
        raise ValueError(f"a draft tree of depth {int(depth.max())} is deeper than the {MAX_DRAFT_DEPTH} the attention supports")


def attention_plan(windows, length: int, depth: torch.Tensor, tree_mask: Optional[torch.Tensor]) -> dict:
    """Attention window -> :class:`AttentionPlan` of a decode or verify pass of N tokens at
    positions ``length + depth`` after ``length`` committed slots; ``tree_mask [N, N]`` (None = a
    chain) says which nodes are on each token's path.

    Raises:
        ValueError: a draft tree deeper than :data:`MAX_DRAFT_DEPTH` (chains may be any length).
    """
    n = depth.shape[0]
    _check_depth(depth, tree_mask)
    pos = (length + depth).tolist()
    heads = tuple(head_length(p) for p in pos)
    tail_slots = torch.zeros(n, TAIL, dtype=torch.long)
    tail_pos = torch.zeros(n, TAIL, dtype=torch.long)
    valid = torch.zeros(n, TAIL, dtype=torch.bool)
    for i in range(n):
        if tree_mask is None:  # a chain: every slot already sits at its position, as in plain decoding
            slots = positions = list(range(heads[i], pos[i] + 1))
        else:
            path = tree_mask[i].nonzero().flatten().tolist()  # ancestors (root first), then itself
            slots = list(range(heads[i], length)) + [length + j for j in path]
            positions = list(range(heads[i], length)) + [length + int(depth[j]) for j in path]
        tail_slots[i, :len(slots)] = torch.tensor(slots)
        tail_pos[i, :len(slots)] = torch.tensor(positions)
        valid[i, :len(slots)] = True
    moved = valid & (tail_slots != tail_slots[:, :1] + torch.arange(TAIL)[None])  # not where the window has them
    rows, cols = moved.nonzero(as_tuple=True)
    fixes = (rows, cols, tail_slots[rows, cols]) if len(rows) else None
    plans = {}
    query = torch.tensor(pos)[:, None]
    by_head = {head: [i for i, h in enumerate(heads) if h == head] for head in sorted(set(heads))}
    for window in set(windows):
        tail_mask, head_mask = valid, None
        if window is not None:
            tail_mask = valid & (query - tail_pos < window)
            head_mask = (query - torch.arange(max(heads))[None]) < window
        groups = []
        for head, rows in by_head.items():
            allowed = tail_mask[rows]
            if head:
                allowed = torch.cat((torch.ones(len(rows), head, dtype=torch.bool) if head_mask is None
                                     else head_mask[rows, :head], allowed), dim=-1)
            bias = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))[None, None, :, None]
            groups.append(AttentionGroup(head, None if len(rows) == n else torch.tensor(rows), bias))
        plans[window] = AttentionPlan(tail_slots, tuple(groups), fixes)
    return plans


def slot_plan(windows, length: int, depth: torch.Tensor, tree_mask: Optional[torch.Tensor]) -> dict:
    """Attention window -> :class:`~mtpctl.model.native.SlotPlan` of a decode or verify pass of N
    tokens at positions ``length + depth`` written to slots ``[length, length + N)`` after ``length``
    committed slots; ``tree_mask [N, N]`` (None = a chain) says which nodes are on each token's path.

    Token i lists the committed slots from its window's start, then its path's slots root first:
    exactly the slots, in the same order, that plain decoding of the path lists for it.

    Raises:
        ValueError: a draft tree deeper than :data:`MAX_DRAFT_DEPTH` (as :func:`attention_plan`, so
            both attention paths accept the same drafts; chains may be any length).
    """
    n = depth.shape[0]
    _check_depth(depth, tree_mask)
    on_path = torch.ones(n, n, dtype=torch.bool).tril() if tree_mask is None else tree_mask
    pos = length + depth
    plans = {}
    for window in set(windows):
        allowed = on_path if window is None else on_path & ((pos[:, None] - pos[None, :]) < window)
        order = torch.argsort((~allowed).to(torch.int8), dim=1, stable=True)  # path nodes first, root first
        slots = torch.where(allowed, length + torch.arange(n), -1).gather(1, order)
        paths = slots[:, :max(1, int(allowed.sum(1).max()))].contiguous()  # once per pass, not per layer
        starts = torch.zeros(n, dtype=torch.long) if window is None else (pos - window + 1).clamp(0, length)
        plans[window] = SlotPlan(starts, length, paths)
    return plans


def attention_masks(windows, length: int, depth: torch.Tensor, tree_mask: Optional[torch.Tensor],
                    capacity: int) -> Dict[Optional[int], torch.Tensor]:
    """Bool masks ``[1, 1, N, capacity]`` (True = may attend) per attention window, for N new tokens
    at positions ``length + depth`` written to slots ``[length, length + N)`` after ``length``
    committed slots (slot j holds position j). ``tree_mask [N, N]`` None means a chain (causal).

    Prefill uses these masks; decode and verify passes use :func:`attention_plan` instead, so that a
    token's attention sums run over the same slots in the same order whether it is scored alone
    (plain decoding) or inside a verify pass.
    """
    n = depth.shape[0]
    pos = length + depth
    new_allowed = tree_mask if tree_mask is not None else torch.ones(n, n, dtype=torch.bool).tril()
    allowed = torch.zeros(n, capacity, dtype=torch.bool)
    allowed[:, :length] = True
    allowed[:, length:length + n] = new_allowed
    slot_pos = torch.arange(capacity)
    slot_pos[length:length + n] = pos
    masks: Dict[Optional[int], torch.Tensor] = {}
    for window in set(windows):
        windowed = allowed if window is None else allowed & ((pos[:, None] - slot_pos[None, :]) < window)
        masks[window] = windowed[None, None]
    return masks


class TorchEngine:
    """Runs a :class:`Decoder` on one sequence (batch 1) with its own KV cache.

    Args:
        model: the target decoder.
        capacity: KV cache slots (tokens) to allocate: prompt + new tokens + the largest draft.
        heads: MTP heads (:class:`mtpctl.runtime.heads.MedusaHeads`) run with every pass: each
            :class:`StepOutput` then offers ``draft_logits``.
        native: decode and verify passes attend with the native kernel (:mod:`mtpctl.model.native`)
            where it can be built and takes the model's attention shape (None, the default), always
            (True: ValueError where it cannot), or never (False: torch's ops, :func:`attention_plan`).
            Either way each token of a verify pass gets bit for bit what plain decoding gives it
            (the engine's ``native`` attribute says which runs).
    """

    def __init__(self, model: Decoder, capacity: int, heads: Optional[nn.Module] = None,
                 native: Optional[bool] = None):
        self.model = model
        self.heads = heads
        self.cache = model.new_cache(capacity, spare=TAIL)  # a lone token reads its tail in place
        cfg = model.cfg
        self.native = native is not False and kernel_runs(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        if native and not self.native:
            raise ValueError("native attention was asked for, but the kernel could not be built or does not take "
                             f"head_dim {cfg.head_dim} with {cfg.num_attention_heads} heads over {cfg.num_key_value_heads} KV heads")

    @property
    def length(self) -> int:
        """Committed tokens in the KV cache."""
        return self.cache.length

    @property
    def kv_cache_bytes(self) -> int:
        """Memory held by the KV cache, bytes."""
        return self.cache.nbytes

    @property
    def capacity(self) -> int:
        """KV cache slots allocated (tokens)."""
        return self.cache.capacity

    @torch.inference_mode()
    def _forward(self, tokens: Sequence[int], parents: Optional[Sequence[int]], last_only: bool) -> StepOutput:
        if self.length + len(tokens) > self.capacity:
            raise ValueError(f"KV cache overflow: {self.length + len(tokens)} slots needed, {self.capacity} allocated")
        if parents is None:
            depth, tree_mask = torch.arange(len(tokens)), None
        else:
            depth, tree_mask = tree_positions(parents)
        windows = self.model.cfg.layer_windows
        ids = torch.tensor([list(tokens)], dtype=torch.long)
        positions = (self.length + depth)[None]
        if last_only:  # prefill feeds plain and speculative decoding alike: it may use the fast kernel
            masks = attention_masks(windows, self.length, depth, tree_mask, self.capacity)
            hidden = self.model(ids, positions, self.cache, masks)[0]
        else:
            plan = slot_plan if self.native else attention_plan
            hidden = self.model(ids, positions, self.cache, None, plan(windows, self.length, depth, tree_mask))[0]
        if last_only:
            return StepOutput(self.model, hidden[-1:], self.heads, prompt_hidden_states=hidden)
        return StepOutput(self.model, hidden, self.heads)

    def prefill(self, prompt_ids: Sequence[int]) -> StepOutput:
        """Reset the cache, run and commit the prompt; returns the last position's output (one row)."""
        self.cache.reset()
        out = self._forward(prompt_ids, None, last_only=True)
        self.cache.advance(len(prompt_ids))
        return out

    def verify(self, tokens: Sequence[int], parents: Optional[Sequence[int]] = None) -> StepOutput:
        """Score N tokens (a chain, or a draft tree given ``parents``) after the committed ones.

        Row i of the output is the target's prediction for the token following node i. Nothing is
        committed.
        """
        return self._forward(tokens, parents, last_only=False)

    def commit(self, offsets: Sequence[int]) -> None:
        """Keep the KV of the verified nodes at ``offsets`` (root first, in path order)."""
        self.cache.keep(offsets)
