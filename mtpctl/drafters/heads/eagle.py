"""EAGLE draft head: one transformer layer that drafts autoregressively at the feature level.

EAGLE (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty"): the
drafter reads the target's features (``hidden_states`` after the final norm) together with the next
token, ``u_p = W_fc [f_p ; e(x_{p+1})]``, runs one decoder layer (causal attention over every earlier
row, then a gated MLP) and predicts the feature of the next position, ``g_p ~ f_{p+1}``. The target's
own lm_head (or its rows for a draft vocabulary) turns ``g_p`` into draft logits for token x_{p+2}.
Drafting deeper feeds ``g_p`` back as the feature of position p+1, with the drafted token.

Row p of the layer: input ``(f_p, x_{p+1})``, output ``g_p``, attention over rows ``0..p``. At decode
time rows of committed positions read the target's true features; the rows of a draft tree read
predicted ones (their parent's output). Training unrolls these draft steps ("training-time test",
EAGLE-3, Li et al. 2025) so the layer learns from its own predicted features
(:mod:`mtpctl.train.eagle`).

The drafter (:class:`EagleDrafter`) keeps the layer's KV cache, indexed by position: after each
target pass it runs the newly committed rows with their true features, then grows a draft tree
level by level (each node expanded from its own path, as Hydra trees).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from mtpctl.decode.attention import causal_mask, draft_rows_mask, unrolled_draft_mask
from mtpctl.decode.drafter import Drafter, TargetStep, check_finite
from mtpctl.decode.tree import DraftTree
from mtpctl.drafters.heads.config import EagleLayerConfig, HeadsConfig
from mtpctl.drafters.heads.tree import StaticTree
from mtpctl.model.config import RopeConfig
from mtpctl.model.decoder import _rms_norm, _rotate, rope_inv_freq
from mtpctl.model.linears import TiledLinear, projection_copy, tiles_take

#: children drafted per node, and nodes expanded per level, of a dynamic tree at most
DYNAMIC_WIDTH = 4


class DraftLayer(nn.Module):
    """What the EAGLE and EAGLE-3 draft layers share: one decoder layer's rotary attention over a
    position-indexed cache and its SiLU-gated MLP, and the training-time test that unrolls draft steps.

    A subclass defines ``attention_inputs`` (a row's inputs -> residual stream and rotated q, k, v),
    ``finish`` (residual and attention -> the row's output, the feature the next draft step reads)
    and ``logits`` (that output -> draft logits). Parameters made here: ``qkv [(A + 2G) D, qkv_in]``,
    ``o_proj [H, A D]``, ``post_attention_norm [H]``, ``gate_up [2I, H]``, ``down [H, I]``.

    A decoding head (``blocked``, set by the subclass) of bfloat16 weights runs its products
    (:meth:`linear`) on the native matmul's tiles where the kernels build, as the target's own dense
    bfloat16 layers do (:class:`~mtpctl.model.linears.TiledLinear`: a draft's values equal torch's to
    bfloat16 rounding, which only changes what is drafted); the tiles are made at the first draft,
    after the weights are loaded, and held outside the state dict.
    """

    #: the products :meth:`linear` may run on tiles (those without a bias)
    TILED = ("fc", "qkv", "o_proj", "gate_up", "down", "lm_head")
    blocked = False
    _tiles: Optional[Dict[str, nn.Module]] = None

    def linear(self, x: torch.Tensor, name: str, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """``x @ W.T`` of the weight parameter ``name``: on its tiles for a decoding head's bfloat16 rows
        outside autograd (``out_dtype``: bfloat16, or the float32 sums), else torch's ``F.linear`` (in
        ``x``'s dtype)."""
        tiled = self.tiles().get(name) if self.blocked and x.dtype == torch.bfloat16 else None
        if tiled is not None and not torch.is_grad_enabled():
            return tiled(x, out_dtype=out_dtype)
        return F.linear(x, getattr(self, name))

    def tiles(self) -> Dict[str, nn.Module]:
        """The decoding tiles of the :data:`TILED` weights that take them (made once)."""
        if self._tiles is None:
            self._tiles = {name: TiledLinear(getattr(self, name).detach()) for name in self.TILED
                           if isinstance(getattr(self, name, None), torch.Tensor)
                           and tiles_take(getattr(self, name).dtype, tuple(getattr(self, name).shape))}
        return self._tiles

    def _init_layer(self, cfg: HeadsConfig, dtype: torch.dtype, qkv_in: int) -> None:
        lc: EagleLayerConfig = cfg.layer
        h, d = cfg.hidden_size, lc.head_dim
        self.q_size, self.kv_size = lc.attention_heads * d, lc.kv_heads * d
        self.qkv = normal_weight(dtype, self.q_size + 2 * self.kv_size, qkv_in)
        self.o_proj = normal_weight(dtype, h, self.q_size)
        self.post_attention_norm = nn.Parameter(torch.ones(h, dtype=dtype))
        self.gate_up = normal_weight(dtype, 2 * lc.intermediate_size, h)
        self.down = normal_weight(dtype, h, lc.intermediate_size)
        self.register_buffer("inv_freq", rope_inv_freq(RopeConfig(theta=lc.rope_theta), d), persistent=False)

    def rotary_qkv(self, inp: torch.Tensor, positions: torch.Tensor) -> tuple:
        """Attention input ``[..., T, qkv_in]`` at ``positions [..., T]`` -> rotated queries
        ``[..., A, T, D]`` and keys ``[..., G, T, D]``, values ``[..., G, T, D]``."""
        lc = self.cfg.layer
        qkv = self.linear(inp, "qkv")
        angles = positions[..., None].float() * self.inv_freq
        cos = torch.cat((angles.cos(), angles.cos()), dim=-1)[..., None, :].to(inp.dtype)
        sin = torch.cat((angles.sin(), angles.sin()), dim=-1)[..., None, :].to(inp.dtype)
        d = lc.head_dim
        q = _rotate(qkv[..., :self.q_size].unflatten(-1, (lc.attention_heads, d)), cos, sin)
        k = _rotate(qkv[..., self.q_size:self.q_size + self.kv_size].unflatten(-1, (lc.kv_heads, d)), cos, sin)
        v = qkv[..., self.q_size + self.kv_size:].unflatten(-1, (lc.kv_heads, d))
        return q.transpose(-2, -3), k.transpose(-2, -3), v.transpose(-2, -3)

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Attention ``[..., A, T, D]`` of queries ``[..., A, T, D]`` over ``keys``/``values``
        ``[..., G, S, D]``; ``mask`` ``[T, S]`` or ``[..., 1, T, S]`` (True = may attend)."""
        out = F.scaled_dot_product_attention(q.float(), keys.float(), values.float(), attn_mask=mask, enable_gqa=True)
        return out.to(q.dtype)

    def residual_mlp(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual stream ``[..., T, H]`` and attention ``[..., A, T, D]`` -> the stream after the
        attention's output projection and the MLP, each added to it (before any final norm)."""
        eps = self.cfg.layer.rms_norm_eps
        x = x + self.linear(attn.transpose(-2, -3).flatten(-2), "o_proj")
        gate, up = self.linear(_rms_norm(x, self.post_attention_norm, eps), "gate_up").chunk(2, dim=-1)
        return x + self.linear(F.silu(gate) * up, "down")

    def forward(self, feats: torch.Tensor, token_embeds: torch.Tensor, valid: torch.Tensor, steps: int) -> List[torch.Tensor]:
        """Training-time test: ``steps`` draft steps at every row of a batch of sequences, each step
        reading the previous step's output as its feature, with the attention a decode-time draft
        has. Returns ``[g_1, ..., g_steps]``, each ``[B, T, H]``: ``g_s`` at row p is the s-th draft
        step taken after the target's row p - s + 1, i.e. the prediction for token p + 2 when tokens
        up to p + 1 are right.

        Query (s, p) attends step-1 keys (true features) of rows ``<= p - s + 1`` and the step-s'
        key of row ``p - s + s'`` for s' = 2..s: the rows of its own draft path.

        Args:
            feats: ``[B, T, H]`` the target's features of each row (what the first step reads).
            token_embeds: ``[B, T, H]`` embeddings of each row's next token (teacher forcing).
            valid: ``[B, T]`` bool, False on padding.
            steps: draft steps to unroll (>= 1).
        """
        b, t, _ = feats.shape
        positions = torch.arange(t).expand(b, t)
        keys, values, outs = [], [], []
        current = feats
        for s in range(1, steps + 1):
            x, q, k, v = self.attention_inputs(current, token_embeds, positions)
            keys.append(k)
            values.append(v)
            mask = unrolled_draft_mask(t, s, valid)
            g = self.finish(x, self.attend(q, torch.cat(keys, 2), torch.cat(values, 2), mask))
            outs.append(g)
            current = torch.cat((feats[:, :1], g[:, :-1]), dim=1)  # row p reads row p-1's output
        return outs


def normal_weight(dtype: torch.dtype, *shape: int) -> nn.Parameter:
    """A parameter drawn from N(0, 0.02) with torch's global generator."""
    return nn.Parameter(torch.randn(shape, dtype=torch.float32).mul_(0.02).to(dtype))


class EagleHead(DraftLayer):
    """The EAGLE layer and its vocabulary projection.

    Parameters (``H`` hidden, ``A``/``G`` attention/KV heads of ``D`` dims, ``I`` MLP width):
    ``fc [H, 2H]``, ``input_norm [H]``, ``qkv [(A + 2G) D, H]``, ``o_proj [H, A D]``,
    ``post_attention_norm [H]``, ``gate_up [2I, H]``, ``down [H, I]``, ``out_norm [H]`` (RMSNorms,
    SiLU-gated MLP, RoPE). EAGLE-1's layer (``layer.eagle1``, imported heads) has ``fc_bias [H]``
    and neither ``input_norm`` nor ``out_norm``. With ``cfg.draft_vocab_size`` V_d > 0 the logits cover the ``token_map``
    ``[V_d]`` rows of the target's frozen lm_head (derived, never saved).

    Weights start as N(0, 0.02) draws from torch's global generator (``add-heads`` seeds it with
    ``--seed``), norms at one.

    Args:
        cfg: a :class:`~mtpctl.drafters.heads.config.HeadsConfig` of kind ``eagle`` (``layer`` set).
        dtype: parameter dtype.
        target_lm_head: ``[vocab, hidden]`` the target's lm_head (required with a draft vocabulary).
        token_map: ``[V_d]`` target ids of the draft vocabulary.
        blocked: also hold the projection in a decoding layout (the target's, else oneDNN's blocked
            one: :func:`mtpctl.model.linears.projection_copy`).
        target_kernel: the target's lm_head module; with ``blocked``, a packed one (int4 weights) lends
            the projection its own codes, a tiled one (dense bfloat16) its layout
            (:func:`mtpctl.model.linears.projection_copy`).

    Raises:
        ValueError: a draft vocabulary without ``token_map`` or ``target_lm_head``.
    """

    def __init__(self, cfg: HeadsConfig, dtype: torch.dtype = torch.float32, target_lm_head: Optional[torch.Tensor] = None,
                 token_map: Optional[torch.Tensor] = None, blocked: bool = False, target_kernel: Optional[nn.Module] = None):
        super().__init__()
        self.cfg = cfg
        h, eagle1 = cfg.hidden_size, cfg.layer.eagle1
        self.fc = normal_weight(dtype, h, 2 * h)
        self.fc_bias = nn.Parameter(torch.zeros(h, dtype=dtype)) if eagle1 else None
        self.input_norm = None if eagle1 else nn.Parameter(torch.ones(h, dtype=dtype))
        self._init_layer(cfg, dtype, h)
        self.out_norm = None if eagle1 else nn.Parameter(torch.ones(h, dtype=dtype))
        if cfg.draft_vocab_size:
            if token_map is None or target_lm_head is None or token_map.shape != (cfg.draft_vocab_size,):
                raise ValueError(f"a draft vocabulary of {cfg.draft_vocab_size} needs token_map and the target's lm_head")
            self.register_buffer("token_map", token_map.to(torch.long).clone())
            self.register_buffer("projection", target_lm_head[self.token_map].detach().to(dtype).clone(),
                                 persistent=False)
        else:
            self.token_map = None
            self.projection = None
        # decoding: the projection in a decoding layout too (no state_dict entry), the layer's products on tiles
        self.projection_kernel = projection_copy(self.projection, self.token_map, blocked, target_kernel)
        self.blocked = blocked

    def attention_inputs(self, feats: torch.Tensor, token_embeds: torch.Tensor, positions: torch.Tensor) -> tuple:
        """Rows ``(f_p, e(x_{p+1}))`` -> ``(x, q, k, v)``: the residual stream ``x [..., T, H]``, rotated
        queries ``[..., A, T, D]`` and keys ``[..., G, T, D]``, values ``[..., G, T, D]``.

        Args:
            feats: ``[..., T, H]`` features (the target's, or the layer's own predictions).
            token_embeds: ``[..., T, H]`` embeddings of the next tokens x_{p+1}.
            positions: ``[..., T]`` positions p (int64).
        """
        joined = torch.cat((feats, token_embeds), dim=-1)
        x = F.linear(joined, self.fc, self.fc_bias) if self.fc_bias is not None else self.linear(joined, "fc")
        inp = x if self.input_norm is None else _rms_norm(x, self.input_norm, self.cfg.layer.rms_norm_eps)
        return (x,) + self.rotary_qkv(inp, positions)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual stream ``[..., T, H]`` and attention ``[..., A, T, D]`` -> predicted features
        ``g [..., T, H]`` (after the output norm; EAGLE-1 has none)."""
        g = self.residual_mlp(x, attn)
        return g if self.out_norm is None else _rms_norm(g, self.out_norm, self.cfg.layer.rms_norm_eps)

    def logits(self, g: torch.Tensor, lm_head: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
        """Predicted features ``[..., H]`` -> float32 logits over the draft vocabulary ``[..., V_d]``
        (``lm_head``, the target's full projection, is needed without a draft vocabulary).

        Raises:
            ValueError: no draft vocabulary and no ``lm_head``.
        """
        if self.projection_kernel is not None:
            return self.projection_kernel(g).float()
        if self.projection is not None:
            return F.linear(g, self.projection).float()
        if lm_head is None:
            raise ValueError("an EAGLE head without a draft vocabulary needs the target's lm_head")
        return lm_head(g).float()


class EagleDrafter(Drafter):
    """Drafts a tree with an :class:`EagleHead`, keeping the head's KV cache across steps.

    At each call it first runs the rows the target committed in its last pass (``last.rows``:
    their true features and next tokens, the pending token last) at their positions, then expands
    the draft tree level by level: a node at depth d is expanded by one row at position n + d - 1 (n =
    the pending token's position) that reads its parent's prediction and its own token and attends to
    the committed rows and its own path. Draft-tree rows are written past the committed slots and
    overwritten by the next call. Candidates are deterministic (q one-hot), so rejection sampling
    stays lossless.

    Args:
        head: the EAGLE head (in the target's dtype).
        tree: the static tree of ranks (:class:`~mtpctl.drafters.heads.tree.StaticTree`).
        embed: token ids ``[M]`` -> embeddings ``[M, H]`` in the head's dtype.
        lm_head: the target's projection ``[..., H] -> [..., vocab]`` (heads without a draft vocabulary).
        dynamic: draft EAGLE-2's dynamic tree (:meth:`_draft_dynamic`) of the static tree's size instead
            of the static tree.
    """

    def __init__(self, head: EagleHead, tree: StaticTree, embed: Callable[[torch.Tensor], torch.Tensor],
                 lm_head: Optional[Callable[[torch.Tensor], torch.Tensor]] = None, dynamic: bool = False):
        self.head, self.tree, self.embed, self.lm_head, self.dynamic = head, tree, embed, lm_head, dynamic
        self.budget = len(tree.paths)
        lc = head.cfg.layer
        dtype, device = head.fc.dtype, head.fc.device
        self.keys = torch.zeros(lc.kv_heads, 0, lc.head_dim, dtype=dtype, device=device)  # [G, capacity, D]
        self.values = torch.zeros(lc.kv_heads, 0, lc.head_dim, dtype=dtype, device=device)
        self.length = 0  # positions whose KV was computed from the target's true features
        self.kept: List[torch.Tensor] = []  # committed rows' inputs [m, ...] not run yet (steps that drafted nothing)

    def fork(self) -> "EagleDrafter":
        """The same EAGLE layer and tree with an empty KV cache of its own (see
        :meth:`mtpctl.decode.drafter.Drafter.fork`)."""
        return EagleDrafter(self.head, self.tree, self.embed, self.lm_head, self.dynamic)

    def propose(self, context: Sequence[int], max_tokens: int, last: Optional[TargetStep] = None) -> DraftTree:
        """See :class:`~mtpctl.decode.drafter.Drafter`. The drafter must see every target pass:
        after prefill ``last.out.prompt_hidden_states``, after a verify pass ``last.rows``. A step
        that drafts nothing (``max_tokens`` 0: the policy holds the row back) only keeps the committed
        rows' inputs; the next step that drafts runs every kept row in one call (the layer's weights
        read once for them all).

        Raises:
            ValueError: committed positions were skipped (the drafter missed a target pass), or a
                prefill output without the prompt's hidden states (backends other than torch).
        """
        pending = context[-1]
        if last is None:
            return DraftTree(pending)
        n = len(context) - 1  # position of the pending token
        with torch.inference_mode():
            inputs = self.committed_inputs(last)
            start = n - inputs.shape[0]
            if start == 0:
                self.length, self.kept = 0, []
            held = self.length + sum(k.shape[0] for k in self.kept)
            if start != held:
                raise ValueError(f"the EAGLE drafter holds {held} positions but the target's last pass "
                                 f"committed positions from {start}: it must see every target pass")
            self.kept.append(inputs)
            if max_tokens <= 0:
                return DraftTree(pending)
            feats = self.features(torch.cat(self.kept) if len(self.kept) > 1 else inputs).to(self.keys.dtype)
            first, self.kept = self.length, []
            tokens = torch.tensor(list(context[first + 1:n + 1]), dtype=torch.long)
            positions = torch.arange(first, n)
            g = self._rows(feats, tokens, positions, torch.arange(first, n), causal_mask(positions, n))
            self.length = n
            if self.dynamic:
                return self._draft_dynamic(g[-1], pending, n, min(max_tokens, self.budget))
            return self._draft(g[-1], pending, n, max_tokens)

    def committed_inputs(self, last: TargetStep) -> torch.Tensor:
        """What the layer reads of the rows the target's last pass committed (after prefill: every
        prompt row), before :meth:`features`: their hidden states after the final norm ``[m, H]``.

        Raises:
            ValueError: a prefill output without the prompt's hidden states (backends other than torch).
        """
        if last.rows is not None:
            return last.out.hidden_states[list(last.rows)]
        if last.out.prompt_hidden_states is None:
            raise ValueError("EAGLE drafting needs every prompt row's hidden states (the torch backend)")
        return last.out.prompt_hidden_states

    def features(self, inputs: torch.Tensor) -> torch.Tensor:
        """The features ``[m, H]`` the layer's committed rows read, from :meth:`committed_inputs`."""
        return inputs

    def _rows(self, feats: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
              mask: torch.Tensor) -> torch.Tensor:
        """Run rows ``feats [M, H]`` / next ``tokens [M]`` at ``positions [M]``, write their KV to
        ``slots [M]`` and attend to slots ``[0, S)`` under ``mask [M, S]``; returns ``g [M, H]``."""
        device = self.keys.device  # the index tensors are built on the host; the layer runs where its weights are
        positions, slots, mask = positions.to(device), slots.to(device), mask.to(device)
        x, q, k, v = self.head.attention_inputs(feats, self.embed(tokens.to(device)), positions)
        end = int(slots.max()) + 1
        self._reserve(end)
        self.keys[:, slots] = k
        self.values[:, slots] = v
        return self.head.finish(x, self.head.attend(q, self.keys[:, :mask.shape[1]], self.values[:, :mask.shape[1]], mask))

    def _reserve(self, slots: int) -> None:
        if slots > self.keys.shape[1]:
            grow = max(slots, 2 * self.keys.shape[1], 256) - self.keys.shape[1]
            pad = self.keys.new_zeros(self.keys.shape[0], grow, self.keys.shape[2])
            self.keys = torch.cat((self.keys, pad), 1)
            self.values = torch.cat((self.values, pad.clone()), 1)

    def _draft(self, g_root: torch.Tensor, pending: int, n: int, max_tokens: int) -> DraftTree:
        paths = self.tree.paths[:max_tokens]
        depth = max(len(p) for p in paths)
        outputs: Dict[tuple, torch.Tensor] = {(): g_root}  # each expanded node's prediction
        slot_of: Dict[tuple, int] = {}
        tokens: Dict[tuple, int] = {}
        candidates = {(): self._top(g_root[None], paths, 1)[0]}
        next_slot = n
        for d in range(1, depth + 1):
            level = [p for p in paths if len(p) == d]
            for p in level:
                tokens[p] = candidates[p[:-1]][p[-1]]
            expand = sorted({p[:-1] for p in paths if len(p) == d + 1})
            if not expand:
                break
            slots = torch.arange(next_slot, next_slot + len(expand))
            for i, p in enumerate(expand):
                slot_of[p] = int(slots[i])
            mask = draft_rows_mask(n, [[slot_of[p[:j]] for j in range(1, d + 1)] for p in expand], int(slots[-1]) + 1)
            g = self._rows(torch.stack([outputs[p[:-1]] for p in expand]),
                           torch.tensor([tokens[p] for p in expand]), torch.full((len(expand),), n + d - 1),
                           slots, mask)
            next_slot += len(expand)
            top = self._top(g, paths, d + 1)
            for i, p in enumerate(expand):
                outputs[p] = g[i]
                candidates[p] = top[i]
        return self.tree.fill(pending, tokens, max_tokens)

    def _draft_dynamic(self, g_root: torch.Tensor, pending: int, n: int, max_tokens: int) -> DraftTree:
        """EAGLE-2's dynamic tree (Li et al. 2024, "EAGLE-2: Faster Inference of Language Models with
        Dynamic Draft Trees") of ``max_tokens`` nodes: each level drafts the top ``width`` children of
        the ``width`` nodes of the level above with the highest path log-probability (the sum of the
        draft's log-probabilities along the path; ``width = min(max_tokens, DYNAMIC_WIDTH)``), as deep
        as the head's draft steps and ``max_tokens`` allow; the tree keeps the ``max_tokens`` nodes
        with the highest path log-probability of every node drafted (a node's is at most its parent's,
        so the kept nodes are a tree). Its layer calls are the static tree's: one a level."""
        width = min(max_tokens, DYNAMIC_WIDTH)
        tokens: List[int] = []  # node i: its token, parent (-1: the pending token) and path log-probability
        parents: List[int] = []
        scores: List[float] = []
        depths: List[int] = []
        outputs: Dict[int, torch.Tensor] = {-1: g_root}  # an expanded node's layer output (its children's logits)
        slot_of: Dict[int, int] = {}
        expand, next_slot = [-1], n
        for d in range(1, min(self.head.cfg.num_heads, max_tokens) + 1):
            if d > 1:  # run the rows of the chosen nodes of depth d - 1 (each reads its parent's output)
                slots = torch.arange(next_slot, next_slot + len(expand))
                slot_of.update({node: int(slot) for node, slot in zip(expand, slots)})
                mask = draft_rows_mask(n, [self._path_slots(node, parents, slot_of) for node in expand],
                                       int(slots[-1]) + 1)
                g = self._rows(torch.stack([outputs[parents[node]] for node in expand]),
                               torch.tensor([tokens[node] for node in expand]), torch.full((len(expand),), n + d - 2),
                               slots, mask)
                next_slot += len(expand)
                outputs.update({node: g[i] for i, node in enumerate(expand)})
            logits = self.head.logits(torch.stack([outputs[node] for node in expand]), self.lm_head)
            top = check_finite(logits, "the EAGLE layer").float().log_softmax(-1).topk(width, dim=-1)
            ids = self.head.token_map[top.indices] if self.head.token_map is not None else top.indices
            children = []
            for node, logp, cand in zip(expand, top.values.tolist(), ids.tolist()):
                base = scores[node] if node >= 0 else 0.0
                for lp, token in zip(logp, cand):
                    children.append(len(tokens))
                    tokens.append(int(token))
                    parents.append(node)
                    scores.append(base + lp)
                    depths.append(d)
            expand = sorted(children, key=lambda i: (-scores[i], i))[:width]
        kept = sorted(range(len(tokens)), key=lambda i: (-scores[i], depths[i], i))[:max_tokens]
        tree, index = DraftTree(pending), {-1: 0}
        for i in sorted(kept, key=lambda i: (depths[i], i)):  # parents first
            index[i] = tree.add(index[parents[i]], tokens[i])
        return tree

    @staticmethod
    def _path_slots(node: int, parents: Sequence[int], slot_of: Dict[int, int]) -> List[int]:
        """The slots of the rows along ``node``'s path, its first draft token's first, its own last."""
        path = []
        while node >= 0:
            path.append(slot_of[node])
            node = parents[node]
        return path[::-1]

    def _top(self, g: torch.Tensor, paths: Sequence[Tuple[int, ...]], depth: int) -> List[List[int]]:
        """Candidate ids ``[M][ranks]`` for the children at ``depth`` of each row's node."""
        ranks = 1 + max(p[-1] for p in paths if len(p) == depth)
        top = check_finite(self.head.logits(g, self.lm_head), "the EAGLE layer").topk(ranks, dim=-1).indices
        if self.head.token_map is not None:
            top = self.head.token_map[top]
        return top.tolist()


def layer_config_for(target_cfg) -> EagleLayerConfig:
    """The shapes of one of the target's decoder layers (:class:`~mtpctl.model.config.DecoderConfig`)."""
    return EagleLayerConfig(target_cfg.num_attention_heads, target_cfg.num_key_value_heads, target_cfg.head_dim,
                            target_cfg.intermediate_size, float(target_cfg.rope.theta), float(target_cfg.rms_norm_eps))
