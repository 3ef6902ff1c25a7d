"""Who attends to whom: every attention mask and slot plan of mtpctl, built in one place.

- :func:`attention_plan` and :func:`slot_plan`: decode and verify passes of the torch engine (torch's
  ops and the native kernel), built so that a token of a verify pass reads exactly the slots, in the
  same order, that plain decoding of its path reads (batch-invariant attention);
- :func:`attention_masks`: prefill and teacher-forced passes (the fused SDPA kernel);
- :func:`graph_step_inputs`: the positions and bool mask an exported graph takes;
- :func:`padded_batch_masks`: left-padded batches (self-distillation);
- :func:`draft_rows_mask`: the EAGLE layer's draft rows (committed rows, then the row's own path);
- :func:`unrolled_draft_mask`: the EAGLE layer's training-time test (each unrolled draft step).

A draft tree's shape comes from :class:`mtpctl.decode.tree.DraftTree` (depths, ancestor mask). An
attention window is None (full attention), a sliding window's length in tokens, or a
:class:`~mtpctl.model.config.Chunk` (chunked attention); a token at position p sees the positions
from :func:`~mtpctl.model.config.first_visible` to p, in every mask and plan alike.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch

from mtpctl.decode.tree import DraftTree
from mtpctl.model.config import first_visible
from mtpctl.model.decoder import AttentionGroup, AttentionPlan
from mtpctl.model.native import SlotPlan


def tree_shape(tree: DraftTree) -> tuple:
    """``(depth [R] long, tree_mask [R, R] bool or None)`` of a verify pass of ``tree.rows`` rows:
    None for a chain (every slot at its position, causal), else the tree's ancestor mask; with extra
    rows (:class:`~mtpctl.decode.tree.ExtraRows`) their offsets follow the nodes' depths and the mask
    grows by their rows (each sees the root, the extra rows it lists and itself)."""
    if tree.extra is None:
        if tree.is_chain:
            return torch.arange(len(tree)), None
        return tree.depth_tensor(), tree.ancestor_mask()
    n, extra = len(tree), tree.extra
    depth = torch.cat((tree.depth_tensor(), torch.tensor(extra.offsets, dtype=torch.long)))
    mask = torch.zeros(tree.rows, tree.rows, dtype=torch.bool)
    mask[:n, :n] = tree.ancestor_mask()
    for r, seen in enumerate(extra.sees):
        mask[n + r, [0] + [n + j for j in seen] + [n + r]] = True
    return depth, mask


def graph_step_inputs(past: int, tree: DraftTree) -> tuple:
    """Position ids ``[1, N]`` and the bool attention mask ``[1, N, past + N]`` (True = may attend)
    of a pass of the N nodes of ``tree`` after ``past`` committed tokens, as an exported graph takes
    them (:mod:`mtpctl.backends.graph`).

    Raises:
        ValueError: a tree with extra rows (exported graphs verify draft tree nodes only).
    """
    if tree.extra is not None:
        raise ValueError("exported graphs verify draft tree nodes only, not extra rows")
    n = len(tree)
    depth, tree_mask = tree_shape(tree)
    new = torch.ones(n, n, dtype=torch.bool).tril() if tree_mask is None else tree_mask
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
            tail_mask = valid & (tail_pos >= first_visible(window, query))
            head_mask = torch.arange(max(heads))[None] >= first_visible(window, query)
        groups = []
        for head, rows in by_head.items():
            allowed = tail_mask[rows]
            if head:
                allowed = torch.cat((torch.ones(len(rows), head, dtype=torch.bool) if head_mask is None
                                     else head_mask[rows, :head], allowed), dim=-1)
            bias = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))[None, None, :, None]
            groups.append(AttentionGroup(head, None if len(rows) == n else torch.tensor(rows), bias))
        plans[window] = AttentionPlan(tail_slots, tuple(groups), fixes, int(tail_slots[0, 0]) if n == 1 else None)
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
        allowed = on_path if window is None else on_path & (pos[None, :] >= first_visible(window, pos)[:, None])
        order = torch.argsort((~allowed).to(torch.int8), dim=1, stable=True)  # path nodes first, root first
        slots = torch.where(allowed, length + torch.arange(n), -1).gather(1, order)
        paths = slots[:, :max(1, int(allowed.sum(1).max()))].contiguous()  # once per pass, not per layer
        starts = first_visible(window, pos).clamp(0, length)
        plans[window] = SlotPlan(starts, torch.full((n,), length, dtype=torch.long), paths)
    return plans


def prefill_plan(windows, length: int, n: int) -> dict:
    """Attention window -> :class:`~mtpctl.model.native.SlotPlan` of a prefill pass of ``n`` prompt
    tokens at positions ``[length, length + n)`` after ``length`` committed slots, each written to the
    slot of its position before any token attends (the layer writes every token's key and value
    first). Token i lists the slots before its own, from its window's start, then itself: the slots,
    in the order, that decoding it alone after the tokens before it lists, without a path of
    ``n`` slots per token."""
    pos = length + torch.arange(n)
    plans = {}
    for window in set(windows):
        starts = first_visible(window, pos).clamp(min=0)
        plans[window] = SlotPlan(starts, pos.clone(), pos[:, None].clone())
    return plans


def pass_plans(windows, native: bool, sequences: Sequence[tuple]) -> dict:
    """Attention window -> the plan of a decode or verify pass whose rows are several sequences'
    tokens packed one sequence after another: a :class:`~mtpctl.model.native.SlotPlan` of every row
    (``native``: each sequence's :func:`slot_plan`, joined) or a tuple of one
    :class:`~mtpctl.model.decoder.AttentionPlan` per sequence (:func:`attention_plan`).
    ``sequences`` holds ``(length, depth [n], tree_mask [n, n] or None)`` per sequence, as
    :func:`tree_shape` gives them. Each token's slots are those of its own sequence's cache, so it
    reads what it would read decoded alone.

    Raises:
        ValueError: a draft tree deeper than :data:`MAX_DRAFT_DEPTH`.
    """
    if not native:
        per_sequence = [attention_plan(windows, length, depth, mask) for length, depth, mask in sequences]
        return {window: tuple(plans[window] for plans in per_sequence) for window in set(windows)}
    per_sequence = [slot_plan(windows, length, depth, mask) for length, depth, mask in sequences]
    if len(per_sequence) == 1:
        return per_sequence[0]
    joined = {}
    for window in set(windows):
        plans = [p[window] for p in per_sequence]
        width = max(p.paths.shape[1] for p in plans)
        paths = torch.cat([torch.nn.functional.pad(p.paths, (0, width - p.paths.shape[1]), value=-1) for p in plans])
        joined[window] = SlotPlan(torch.cat([p.starts for p in plans]), torch.cat([p.ends for p in plans]),
                                  paths.contiguous())
    return joined


def plans_on(plans: dict, device: torch.device) -> dict:
    """:func:`pass_plans`' torch-ops plans (a tuple of :class:`~mtpctl.model.decoder.AttentionPlan` per
    window) or masks with their tensors on ``device`` (the same objects where they are there already:
    on the CPU this costs nothing)."""
    def move(plan: AttentionPlan) -> AttentionPlan:
        groups = tuple(AttentionGroup(g.head, None if g.rows is None else to_device(g.rows, device),
                                      to_device(g.bias, device)) for g in plan.groups)
        fixes = None if plan.fixes is None else tuple(to_device(t, device) for t in plan.fixes)
        return AttentionPlan(to_device(plan.tail_slots, device), groups, fixes, plan.tail_start)

    if device.type == "cpu":
        return plans
    return {window: tuple(move(p) for p in plan) if isinstance(plan, tuple) else to_device(plan, device)
            for window, plan in plans.items()}


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``: itself on the CPU; elsewhere copied from pinned memory without
    blocking (the host goes on while the copy runs in stream order, before the kernels that read it)."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


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
        windowed = allowed if window is None else allowed & (slot_pos[None, :] >= first_visible(window, pos)[:, None])
        masks[window] = windowed[None, None]
    return masks


def padded_batch_masks(windows, valid: torch.Tensor, slot_pos: torch.Tensor, queries: torch.Tensor) -> dict:
    """Masks ``[batch, 1, N, capacity]`` per attention window of a left-padded batch (self-distillation)
    for the query slots ``queries [N]``: causal over slots, padding excluded, windows measured in
    positions. ``valid [batch, capacity]`` marks the slots holding real tokens and ``slot_pos [batch,
    capacity]`` each slot's position; a padded query row attends to itself only."""
    cap = valid.shape[1]
    slots = torch.arange(cap)
    allowed = valid[:, None, :] & (slots[None, None, :] <= queries[None, :, None])  # [b, N, cap]
    q_pos = slot_pos[:, queries]  # [b, N]
    masks = {}
    for window in set(windows):
        m = allowed if window is None else allowed & (slot_pos[:, None, :] >= first_visible(window, q_pos)[:, :, None])
        m = m | ~valid[:, queries][:, :, None] & (slots[None, None, :] == queries[None, :, None])
        masks[window] = m[:, None]
    return masks


def causal_mask(positions: torch.Tensor, slots: int) -> torch.Tensor:
    """``[M, slots]`` bool: a row at position p attends to slots ``[0, p]`` (slot j holds position j)."""
    return torch.arange(slots)[None, :] <= positions[:, None]


def draft_rows_mask(committed: int, paths: Sequence[Sequence[int]], slots: int) -> torch.Tensor:
    """``[M, slots]`` bool for M draft-tree rows of a drafter's own cache (the EAGLE layer): row i
    attends to the committed slots ``[0, committed)`` and the slots ``paths[i]`` of its own path."""
    mask = torch.zeros(len(paths), slots, dtype=torch.bool)
    mask[:, :committed] = True
    for i, path in enumerate(paths):
        mask[i, list(path)] = True
    return mask


def unrolled_draft_mask(t: int, step: int, valid: torch.Tensor) -> torch.Tensor:
    """``[B, 1, T, step * T]`` bool of draft step ``step`` (1-based) of the EAGLE layer's training-time
    test over a batch of T rows (``valid [B, T]``, False on padding), its keys being the ``step`` steps'
    rows side by side: query (step, p) attends to step 1's rows ``<= p - step + 1`` (the target's true
    features) and to step s's row ``p - step + s`` for s = 2..step (its own draft path), as at decode
    time; every query sees its own key, padding rows too."""
    rows = torch.arange(t)
    blocks = [rows[None, :] <= rows[:, None] - step + 1]
    blocks += [rows[None, :] == rows[:, None] - step + s for s in range(2, step + 1)]
    own = torch.zeros(t, step * t, dtype=torch.bool)
    own[rows, (step - 1) * t + rows] = True
    return (torch.cat(blocks, dim=1)[None, None] & valid.repeat(1, step)[:, None, None, :]) | own
