"""Medusa and Hydra heads and their drafters.

Medusa (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding
Heads"): K heads read the target's last hidden state h_t (after the final norm). The target's own
lm_head predicts token t+1 (the pending token); head k (k = 1..K) predicts token t+1+k. Each head is
``head_layers`` residual blocks ``x + SiLU(W x + b)`` (W, b start at zero, so a block starts as the
identity) then a vocabulary projection: the frozen target lm_head shared by all heads, or a trainable
copy per head (``own_lm_head``).

Hydra (Ankner et al. 2024, "Hydra: Sequentially-Dependent Draft Heads for Medusa Decoding"): the
heads depend on each other. In mtpctl's form (``kind: hydra``) head k reads head k-1's output
features and the embedding of the token drafted before it: ``z_k = blocks_k(z_{k-1} + W_k e(x_k))``
with ``z_0 = h_t``, ``x_1`` the pending token and ``x_k`` (k > 1) the candidate of head k-1 that the
tree node extends. A draft tree is then built level by level (:meth:`MedusaHeads.draft_tree`): each
node's children come from its own path, not from a candidate list shared by every node of a depth.
Trained on the target's own tokens (teacher forcing), the heads see at training time exactly the
inputs of every path the target can accept.

Medusa heads run in their drafter (:class:`MedusaDrafter`) on the row of the target's pass that
acceptance committed last, or inside an exported graph, whose passes carry their logits.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mtpctl.decode.drafter import Call, Drafter, TargetStep, check_finite
from mtpctl.decode.tree import DraftTree
from mtpctl.drafters.heads.config import HeadsConfig
from mtpctl.drafters.heads.tree import StaticTree
from mtpctl.model.decoder import Decoder
from mtpctl.model.linears import TiledLinear, projection_copy, tiles_take


class ResBlock(nn.Module):
    """``x + SiLU(W x + b)`` with W, b ``[hidden, hidden]``, ``[hidden]`` initialised to zero (identity)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size, dtype=dtype)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K Medusa heads.

    With ``cfg.draft_vocab_size`` V_d > 0 the heads score only V_d frequent tokens, listed in the
    ``token_map`` buffer ``[V_d]`` (their target ids), through the matching rows of the projection:
    training and drafting cost V_d / vocab of a full projection (vocabulary truncation, as vLLM's
    Medusa ``truncated_vocab_size``); verification by the target stays over the full vocabulary.

    With ``cfg.token_conditioned`` each head also reads the embedding e of the pending token (the
    token the target just predicted, known before drafting): its input is ``h + W_k e`` with W_k
    ``[hidden, hidden]`` starting at zero (so training starts from plain Medusa). Head 1 then predicts
    the token after a known one rather than two ahead blind: the idea of conditioning draft heads on
    the tokens before them, from Hydra (Ankner et al. 2024) and EAGLE (Li et al. 2024), reduced to the
    one token that is always known.

    Args:
        cfg: the heads' config (count, blocks per head, own lm_head, sizes).
        dtype: parameter dtype.
        target_lm_head: ``[vocab, hidden]`` the target's lm_head weight: the initial value of every
            own lm_head, and the frozen projection of truncated shared heads. Required unless the
            heads share the full lm_head (then the caller passes ``lm_head`` to :meth:`forward`).
        token_map: ``[V_d]`` target ids of the draft vocabulary (required when V_d > 0).
        blocked: also hold the truncated projection in a decoding layout (the target's, else oneDNN's
            blocked one: :func:`mtpctl.model.linears.projection_copy`).
        target_kernel: the target's lm_head module; with ``blocked``, a packed one (int4 weights) lends
            the projection its own codes, a tiled one (dense bfloat16) its layout
            (:func:`mtpctl.model.linears.projection_copy`).
    """

    def __init__(self, cfg: HeadsConfig, dtype: torch.dtype = torch.float32,
                 target_lm_head: Optional[torch.Tensor] = None, token_map: Optional[torch.Tensor] = None,
                 blocked: bool = False, target_kernel: Optional[nn.Module] = None):
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList(
            nn.Sequential(*(ResBlock(cfg.hidden_size, dtype) for _ in range(cfg.head_layers)))
            for _ in range(cfg.num_heads))
        self.token_proj: Optional[nn.ParameterList] = None
        if cfg.token_conditioned:
            self.token_proj = nn.ParameterList(nn.Parameter(torch.zeros(cfg.hidden_size, cfg.hidden_size, dtype=dtype))
                                               for _ in range(cfg.num_heads))
        truncated = cfg.draft_vocab_size > 0
        if truncated:
            if token_map is None or token_map.shape != (cfg.draft_vocab_size,):
                raise ValueError(f"a draft vocabulary of {cfg.draft_vocab_size} needs token_map [{cfg.draft_vocab_size}]")
            self.register_buffer("token_map", token_map.to(torch.long).clone())
        else:
            self.token_map = None
        needs_rows = cfg.own_lm_head or truncated
        if needs_rows and target_lm_head is None:
            raise ValueError("own or truncated lm_heads need target_lm_head (the target's lm_head weight)")
        rows = (target_lm_head[self.token_map] if truncated else target_lm_head) if needs_rows else None
        self.lm_heads: Optional[nn.ParameterList] = None
        if cfg.own_lm_head:
            self.lm_heads = nn.ParameterList(nn.Parameter(rows.detach().to(dtype).clone()) for _ in range(cfg.num_heads))
        # frozen rows of the target's lm_head for truncated shared heads: derived, never saved
        projection = rows.detach().to(dtype).clone() if truncated and not cfg.own_lm_head else None
        self.register_buffer("projection", projection, persistent=False)
        # decoding: the same projection in a decoding layout (no state_dict entry)
        self.projection_kernel = projection_copy(projection, self.token_map, blocked, target_kernel)

    @property
    def sequential(self) -> bool:
        """Hydra heads: head k reads head k-1's features and the token drafted before it."""
        return self.cfg.kind == "hydra"

    def features(self, hidden_states: torch.Tensor, token_embeds: Optional[torch.Tensor] = None,
                 count: Optional[int] = None) -> torch.Tensor:
        """``[..., hidden]`` -> each head's features before the vocabulary projection ``[..., K, hidden]``
        (the first ``count`` heads only, ``[..., count, hidden]``, when given: Medusa heads).

        ``token_embeds``: token-conditioned Medusa heads, the pending tokens' embeddings
        ``[..., hidden]``; Hydra heads, ``[..., K, hidden]`` the embeddings of x_1 (the pending token)
        to x_K, the tokens each head reads (teacher forcing in training).

        Raises:
            ValueError: token-conditioned heads without ``token_embeds``.
        """
        blocks = self.blocks[:count] if count is not None and not self.sequential else self.blocks
        if self.token_proj is None:
            return torch.stack([b(hidden_states) for b in blocks], dim=-2)
        if token_embeds is None:
            raise ValueError("token-conditioned heads need the pending token's embedding (token_embeds)")
        if not self.sequential:
            return torch.stack([b(hidden_states + F.linear(token_embeds, w))
                                for b, w in zip(blocks, self.token_proj)], dim=-2)
        feats, z = [], hidden_states
        for k in range(self.cfg.num_heads):
            z = self.head_step(k, z, token_embeds[..., k, :])
            feats.append(z)
        return torch.stack(feats, dim=-2)

    def head_step(self, k: int, states: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        """Head k+1's features ``[..., hidden]`` from its input state (h for the first head, else the
        previous head's features) ``[..., hidden]`` and the embedding of the token it reads ``[..., hidden]``."""
        return self.blocks[k](states + F.linear(token_embeds, self.token_proj[k]))

    def project(self, feats: torch.Tensor, lm_head: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                head: Optional[int] = None) -> torch.Tensor:
        """Features -> float32 logits over the draft vocabulary: ``[..., K, hidden] -> [..., K, V_d]``,
        or for one ``head`` (0-based) ``[..., hidden] -> [..., V_d]``. ``lm_head`` as in
        :meth:`draft_vocab_logits`."""
        if self.lm_heads is not None:
            if head is not None:
                return F.linear(feats, self.lm_heads[head]).float()
            return torch.stack([F.linear(feats[..., k, :], w) for k, w in zip(range(feats.shape[-2]), self.lm_heads)],
                               dim=-2).float()
        if self.projection_kernel is not None:
            return self.projection_kernel(feats).float()
        if self.projection is not None:
            return F.linear(feats, self.projection).float()
        if lm_head is None:
            raise ValueError("heads that share the target's lm_head need it passed as lm_head")
        return lm_head(feats).float()

    def draft_vocab_logits(self, hidden_states: torch.Tensor,
                           lm_head: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                           token_embeds: Optional[torch.Tensor] = None, count: Optional[int] = None) -> torch.Tensor:
        """Logits over the draft vocabulary, ``[..., hidden] -> [..., K, V_d]`` float32 (V_d = vocab
        without truncation). ``lm_head`` is the target's projection, used only by heads that share
        the full lm_head (e.g. :meth:`mtpctl.model.decoder.Decoder.logits`); ``token_embeds`` and
        ``count`` (the first heads only) as in :meth:`features`."""
        return self.project(self.features(hidden_states, token_embeds, count), lm_head)

    def draft_tree(self, hidden_state: torch.Tensor, pending: int, tree: StaticTree, max_nodes: int,
                   embed: Callable[[torch.Tensor], torch.Tensor],
                   lm_head: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> DraftTree:
        """Hydra heads: the draft tree of ``tree``'s first ``max_nodes`` paths, grown level by level
        from the target's hidden state ``[hidden]`` at the pending token ``pending``.

        A node at depth d-1 (the pending token at depth 0) is expanded by head d from its own state
        and token; its rank-r child is the head's r-th candidate. One head call per depth, batched
        over the nodes expanded there. ``embed`` maps token ids ``[M]`` to embeddings ``[M, hidden]``.
        """
        paths = tree.paths[:max_nodes]
        tokens: Dict[tuple, int] = {(): pending}
        states: Dict[tuple, torch.Tensor] = {(): hidden_state}
        for depth in range(1, max(len(p) for p in paths) + 1):
            level = [p for p in paths if len(p) == depth]
            expand = sorted({p[:-1] for p in level})
            z = self.head_step(depth - 1, torch.stack([states[q] for q in expand]),
                               embed(torch.tensor([tokens[q] for q in expand])))
            top = check_finite(self.project(z, lm_head, head=depth - 1), "the Hydra heads").topk(
                1 + max(p[-1] for p in level), dim=-1).indices
            if self.token_map is not None:
                top = self.token_map[top]
            row = {q: j for j, q in enumerate(expand)}
            for p in level:
                tokens[p] = int(top[row[p[:-1]], p[-1]])
                states[p] = z[row[p[:-1]]]
        return tree.fill(pending, tokens, max_nodes)

    def forward(self, hidden_states: torch.Tensor,
                lm_head: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                full_vocab: bool = True, token_embeds: Optional[torch.Tensor] = None,
                count: Optional[int] = None) -> torch.Tensor:
        """Draft logits of every head (or of the first ``count``) over the full vocabulary.

        Args:
            hidden_states: ``[..., hidden]``, the target's after its final norm.
            lm_head: the target's vocabulary projection ``[..., hidden] -> [..., vocab]``, for heads
                that share the full lm_head.
            full_vocab: False returns :meth:`draft_vocab_logits` (training).
            token_embeds: embeddings of the tokens the heads read (token-conditioned heads), see
                :meth:`features`.
            count: run only the first ``count`` heads (a draft tree that deep needs no more);
                None runs all K.

        Returns:
            ``[..., K, vocab]`` (``[..., count, vocab]``) float32 (-inf outside a truncated draft vocabulary); head k's row
            predicts the token k+1 places after the pending one.
        """
        logits = self.draft_vocab_logits(hidden_states, lm_head, token_embeds, count)
        return self.full_vocab(logits) if full_vocab else logits

    def full_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary ``[..., V_d]`` -> over the full vocabulary ``[..., vocab]``,
        -inf outside the draft vocabulary (unchanged without one)."""
        if self.token_map is None:
            return logits
        full = logits.new_full(logits.shape[:-1] + (self.cfg.vocab_size,), float("-inf"))
        return full.index_copy_(-1, self.token_map, logits)


class StackedHeads:
    """The feature layers of a Medusa drafter's first ``count`` heads, stacked for drafting: the
    token projections of every head in one matrix (they read the same embedding) and each residual
    block layer of every head in one batched matmul, so a draft step runs a few ops instead of a few
    per head. Each head's numbers are those of :meth:`MedusaHeads.features`: bit for bit in bfloat16,
    to rounding in float32 (torch's one-row float32 matmul sums in another order; drafts only, so
    verification stays exact either way). In bfloat16, two heads' features for one row take 0.12 ms
    instead of 0.27 on this project's CPU. Holds copies of those weights, made when built (the heads
    are frozen when drafting).

    bfloat16 heads where the native kernels build (``tiles``, the default there) run each product on
    the tiled matmul instead (:func:`mtpctl.model.native.bf16_tiles`, the layout of a dense bfloat16
    target): a head's block layer is one call on its own tiles, its bias added to the float32 sums
    before the one rounding to bfloat16, as in torch's product. The same values to rounding (the sums
    run in another order); right after a target's pass, with the weights out of cache, two heads'
    features for one row take about 0.40 ms instead of 0.69.

    Args:
        heads: Medusa heads (not Hydra: those run head by head on the tree's own paths).
        count: the heads to run, from the first.
        tiles: run on the tiled matmul (None: where the heads are bfloat16 and the kernels build).
    """

    def __init__(self, heads: MedusaHeads, count: int, tiles: Optional[bool] = None):
        self.count = count
        hidden = heads.cfg.hidden_size
        # [count * H, H]: every head's token projection, one after another
        token_proj = None if heads.token_proj is None else torch.cat([w.detach() for w in heads.token_proj[:count]])
        linears = [[blocks[i].linear for blocks in heads.blocks[:count]] for i in range(heads.cfg.head_layers)]
        if tiles is None:
            weight = next(heads.blocks.parameters(), None)
            tiles = weight is not None and weight.device.type == "cpu" and tiles_take(weight.dtype, (hidden, hidden))
        self.tiled = bool(tiles)
        if self.tiled:  # the token projections as one TiledLinear; per layer each head's (TiledLinear, float32 bias)
            self.token_proj = None if token_proj is None else TiledLinear(token_proj)
            self.layers = [[(TiledLinear(lin.weight.detach()), lin.bias.detach().float()) for lin in layer]
                           for layer in linears]
        else:  # the token projections [count * H, H]; per layer every head's bias [count, 1, H] and W.T [count, H, H]
            self.token_proj = token_proj
            self.layers = [(torch.stack([lin.bias.detach() for lin in layer])[:, None, :],
                            torch.stack([lin.weight.detach().T for lin in layer])) for layer in linears]

    def __call__(self, hidden: torch.Tensor, token_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``hidden`` ``[R, H]`` (and the pending tokens' embeddings ``[R, H]`` for token-conditioned heads)
        -> each head's features ``[R, count, H]``."""
        rows = hidden.shape[0]
        x = hidden[:, None, :].expand(rows, self.count, hidden.shape[-1])
        if self.token_proj is not None:
            if token_embeds is None:
                raise ValueError("token-conditioned heads need the pending token's embedding (token_embeds)")
            proj = self.token_proj(token_embeds) if self.tiled else F.linear(token_embeds, self.token_proj)
            x = x + proj.view(rows, self.count, -1)
        if self.tiled:
            return self._tiled_blocks(x)
        x = x.transpose(0, 1)  # [count, R, H]: head k's rows together
        for bias, weight_t in self.layers:
            x = x + F.silu(torch.baddbmm(bias, x, weight_t))
        return x.transpose(0, 1)

    def _tiled_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """The block layers on the tiles: ``[R, count, H]`` -> ``[R, count, H]``, head by head."""
        heads = []
        for k in range(self.count):
            h = x[:, k].contiguous()
            for layer in self.layers:
                linear, bias = layer[k]
                h = h + F.silu((linear(h, out_dtype=torch.float32) + bias).to(h.dtype))
            heads.append(h)
        return torch.stack(heads, dim=1)


class MedusaDrafter(Drafter):
    """Drafts a static tree from Medusa heads at the target's last committed row.

    The drafter owns its heads and runs them on that row's hidden state (the K heads' vocabulary
    projections in one call; heads deeper than the tree are not run), then takes each head's top-k
    into the tree. With ``heads`` None it reads the logits of heads fused into an exported graph
    (``out.head_logits``; token-conditioned heads there read the row's argmax as the pending token:
    exact for greedy decoding, with sampling another pending token only lowers acceptance).
    Candidates are deterministic (q one-hot), so rejection sampling stays lossless.

    Args:
        tree: the static tree of ranks.
        heads: the heads (in the target's dtype), or None for heads fused into the target's graph.
        target: the target decoder (its embedding and lm_head), required with ``heads``.
    """

    def __init__(self, tree: StaticTree, heads: Optional[MedusaHeads] = None, target: Optional[Decoder] = None):
        if heads is not None and target is None:
            raise ValueError("Medusa heads draft with the target's embedding and lm_head: pass the target")
        self.tree, self.heads, self.target = tree, heads, target
        self.budget = len(tree.paths)
        self._stacked = StackedHeads(heads, tree.depth) if heads is not None and not heads.sequential else None

    def fork(self) -> "MedusaDrafter":
        """Itself: it keeps no per-request state (see :meth:`mtpctl.decode.drafter.Drafter.fork`)."""
        return self

    def propose(self, context: Sequence[int], max_tokens: int, last: Optional[TargetStep] = None) -> DraftTree:
        pending = context[-1]
        if last is None or max_tokens <= 0:
            return DraftTree(pending)
        return self.draft(last, pending, max_tokens)

    def propose_together(self, calls: Sequence[Call]) -> List[DraftTree]:
        """:meth:`propose` for several requests at once: the heads run once on every row's hidden
        state (Hydra heads and heads fused into a graph: one call each)."""
        live = [i for i, (context, max_tokens, last) in enumerate(calls) if last is not None and max_tokens > 0]
        if self.heads is None or self.heads.sequential or len(live) < 2:
            return [self.propose(*call) for call in calls]
        hidden = torch.stack([calls[i][2].out.hidden_states[calls[i][2].row] for i in live])
        pending = torch.tensor([calls[i][0][-1] for i in live])
        top = self._top(hidden, pending, self.tree.max_rank)  # [rows, depth, ranks]
        trees = [DraftTree(call[0][-1]) for call in calls]
        for j, i in enumerate(live):
            trees[i] = self.tree.draft(int(pending[j]), top[j], calls[i][1])
        return trees

    def draft(self, last: TargetStep, pending: int, max_tokens: int) -> DraftTree:
        """The tree's first ``max_tokens`` paths under ``pending``, filled with each head's top-k."""
        return self.tree.draft(pending, self.candidates(last, pending, self.tree.max_rank), max_tokens)

    def candidates(self, last: TargetStep, pending: int, k: int) -> torch.Tensor:
        """The first ``tree.depth`` heads' top ``k`` token ids ``[depth, k]`` at ``last.row``, best first."""
        if self.heads is None:
            return self.logits(last, pending).topk(k, dim=-1).indices
        return self._top(last.out.hidden_states[last.row], pending, k)

    def logits(self, last: TargetStep, pending: int) -> torch.Tensor:
        """The first ``tree.depth`` heads' logits ``[depth, vocab]`` (float32) at ``last.row``."""
        if self.heads is None:
            if last.out.head_logits is None:
                raise ValueError("this backend's passes carry no MTP head logits: load the heads for the drafter")
            return check_finite(last.out.head_logits[last.row][:self.tree.depth], "the MTP heads")
        return self._run_heads(last.out.hidden_states[last.row], pending)

    def _run_heads(self, hidden: torch.Tensor, pending, full_vocab: bool = True, check: bool = True) -> torch.Tensor:
        """The first ``tree.depth`` heads' logits ``[..., depth, vocab]`` (``[..., depth, V_d]`` over a
        draft vocabulary when not ``full_vocab``) for ``hidden`` ``[..., hidden]`` (one row, or several
        stacked), ``pending`` the token(s) each row drafts after; NaN and +inf refused unless not ``check``."""
        embeds = self.target.embed[pending].to(hidden.dtype) if self.heads.cfg.token_conditioned else None
        rows = hidden.reshape(-1, hidden.shape[-1])
        with torch.inference_mode():
            feats = self._stacked(rows, embeds.reshape(rows.shape) if embeds is not None else None)
            logits = self.heads.project(feats, self.target.logits).reshape(*hidden.shape[:-1], self.tree.depth, -1)
            if full_vocab:
                logits = self.heads.full_vocab(logits)
        return check_finite(logits, "the MTP heads") if check else logits

    def _top(self, hidden: torch.Tensor, pending, k: int) -> torch.Tensor:
        """The first ``tree.depth`` heads' top ``k`` token ids ``[..., depth, k]``: ranked within the
        draft vocabulary, then mapped to target ids (no scatter into the full vocabulary). Only the
        top values are checked for NaN and +inf: topk ranks a NaN above every number, so any NaN or
        +inf in a row's logits is among its top values."""
        values, top = self._run_heads(hidden, pending, full_vocab=False, check=False).topk(k, dim=-1)
        check_finite(values, "the MTP heads")
        return top if self.heads.token_map is None else self.heads.token_map[top]


class HydraDrafter(MedusaDrafter):
    """Drafts with Hydra heads: the tree grown level by level from the target's last committed row
    (:meth:`MedusaHeads.draft_tree`), each node expanded from its own path. Candidates are
    deterministic (q one-hot).

    Args:
        tree: the static tree of ranks.
        heads: Hydra heads (``cfg.kind == "hydra"``), in the target's dtype.
        target: the target decoder (its embedding and lm_head).
    """

    def __init__(self, tree: StaticTree, heads: MedusaHeads, target: Decoder):
        super().__init__(tree, heads, target)

    def draft(self, last: TargetStep, pending: int, max_tokens: int) -> DraftTree:
        hidden = last.out.hidden_states[last.row]
        dtype = hidden.dtype
        with torch.inference_mode():
            return self.heads.draft_tree(hidden, pending, self.tree, max_tokens,
                                         embed=lambda ids: self.target.embed[ids].to(dtype), lm_head=self.target.logits)
