"""MTP heads at decode time: Medusa heads, their versioned config, static draft trees, and the
drafter that turns the heads' outputs into a draft tree.

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

A head folder holds ``mtp_config.json`` (:class:`HeadsConfig`) and ``mtp_heads.safetensors``; the
target's weights are referenced by their sha256 (:func:`mtpctl.model.weights.weights_hash`).
"""

from __future__ import annotations

import heapq
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from mtpctl.errors import BadInput, CorruptModel, UnsupportedModel
from mtpctl.runtime.drafters import Draft, TargetStep
from mtpctl.runtime.eagle import EagleLayerConfig
from mtpctl.model.linears import blocked_copy

FORMAT_VERSION = 1
CONFIG_FILE = "mtp_config.json"
WEIGHTS_FILE = "mtp_heads.safetensors"
KINDS = ("medusa", "hydra", "eagle")


@dataclass
class HeadsConfig:
    """What ``mtp_config.json`` records about a set of MTP heads (format version 1).

    ``tree`` is the default static draft tree (paths of top-k ranks, see :class:`StaticTree`);
    ``topk_accuracy[k][r]`` the held-out probability that head k+1's rank-r candidate is the target's
    token, from which trees of any size are built (:func:`tree_from_accuracy`).
    """

    kind: str  # "medusa", "hydra" (sequential heads; always token-conditioned) or "eagle" (one draft layer)
    num_heads: int  # K: the deepest draft (for eagle, the draft steps evaluated)
    head_layers: int  # residual blocks per head
    own_lm_head: bool  # a trainable vocabulary projection per head (else the target's lm_head)
    hidden_size: int
    vocab_size: int  # logits width of the target (rows of its lm_head)
    draft_vocab_size: int = 0  # heads score only this many frequent tokens (token_map); 0 = all
    token_conditioned: bool = False  # heads also read the pending token's embedding (see MedusaHeads)
    target: str = ""  # how the target was named when the heads were trained (alias, folder, repo id)
    target_hash: str = ""  # sha256 of the target's safetensors files
    tree: List[List[int]] = field(default_factory=list)
    topk_accuracy: List[List[float]] = field(default_factory=list)  # [K][ranks]
    training: dict = field(default_factory=dict)  # the settings and figures of the training run
    format_version: int = FORMAT_VERSION
    mtpctl_version: str = ""
    layer: Optional[EagleLayerConfig] = None  # eagle: the draft layer's shapes (a mapping in the JSON)

    def __post_init__(self) -> None:
        if self.kind == "hydra" and not self.token_conditioned:
            raise ValueError("hydra heads read tokens, so token_conditioned must be true")
        if isinstance(self.layer, dict):
            self.layer = EagleLayerConfig(**self.layer)
        elif self.layer is not None and not isinstance(self.layer, EagleLayerConfig):
            raise ValueError(f"layer must be a mapping of the draft layer's shapes, got {self.layer!r}")
        if (self.kind == "eagle") != (self.layer is not None):
            raise ValueError("eagle heads, and only they, need the draft layer's shapes (layer)")
        if self.kind == "eagle" and self.own_lm_head:
            raise ValueError("eagle heads project through the target's lm_head (own_lm_head must be false)")

    def save(self, folder: Path) -> None:
        """Write ``mtp_config.json`` into ``folder``."""
        (Path(folder) / CONFIG_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, folder: Path) -> "HeadsConfig":
        """Read and check ``folder/mtp_config.json``.

        Raises:
            BadInput: the folder or its config is missing (not a head folder).
            CorruptModel: the config is malformed.
            UnsupportedModel: a newer format version or an unknown head kind.
        """
        path = Path(folder) / CONFIG_FILE
        if not path.is_file():
            raise BadInput(f"{folder} is not an MTP head folder (no {CONFIG_FILE}); make one with mtpctl add-heads")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            version = raw.get("format_version")
            if not isinstance(version, int) or version > FORMAT_VERSION:
                raise UnsupportedModel(f"{path}: format_version {version!r}; this mtpctl reads up to "
                                       f"{FORMAT_VERSION} (upgrade mtpctl)")
            if raw.get("kind") not in KINDS:
                raise UnsupportedModel(f"{path}: head kind {raw.get('kind')!r} is not supported (known: "
                                       f"{', '.join(KINDS)})")
            cfg = cls(**raw)
            if not all(isinstance(getattr(cfg, n), int) for n in ("num_heads", "head_layers", "hidden_size",
                                                                    "vocab_size", "draft_vocab_size")):
                raise ValueError("sizes must be integers")
        except (ValueError, TypeError, AttributeError) as err:
            raise CorruptModel(f"{path} is not a valid head config: {err}") from err
        if cfg.num_heads < 1 or cfg.head_layers < 0:
            raise CorruptModel(f"{path}: num_heads {cfg.num_heads} and head_layers {cfg.head_layers} are not valid")
        return cfg


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
        blocked: also hold the truncated projection in oneDNN's blocked layout (for decoding; see
            :func:`mtpctl.model.linears.blocked_copy`).
    """

    def __init__(self, cfg: HeadsConfig, dtype: torch.dtype = torch.float32,
                 target_lm_head: Optional[torch.Tensor] = None, token_map: Optional[torch.Tensor] = None,
                 blocked: bool = False):
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
        # decoding: the same projection in oneDNN's blocked layout (no state_dict entry)
        self.projection_kernel = blocked_copy(projection, blocked)

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

    def draft_tree(self, hidden_state: torch.Tensor, pending: int, tree: "StaticTree", max_nodes: int,
                   embed: Callable[[torch.Tensor], torch.Tensor],
                   lm_head: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> Draft:
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
            top = self.project(z, lm_head, head=depth - 1).topk(1 + max(p[-1] for p in level), dim=-1).indices
            if self.token_map is not None:
                top = self.token_map[top]
            row = {q: j for j, q in enumerate(expand)}
            for p in level:
                tokens[p] = int(top[row[p[:-1]], p[-1]])
                states[p] = z[row[p[:-1]]]
        return Draft([tokens[p] for p in paths], tree.parents[:len(paths)])

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
        if self.token_map is None or not full_vocab:
            return logits
        full = logits.new_full(logits.shape[:-1] + (self.cfg.vocab_size,), float("-inf"))
        return full.index_copy_(-1, self.token_map, logits)

    def save(self, folder: Path) -> None:
        """Write the head folder's two files into an existing ``folder`` (see :func:`save_heads`)."""
        save_heads(self, folder)

    @classmethod
    def load(cls, folder: Path, dtype: torch.dtype = torch.float32,
             target_lm_head: Optional[torch.Tensor] = None) -> "MedusaHeads":
        """Load medusa or hydra heads strictly; see :func:`load_heads` (which loads every kind).

        Raises:
            BadInput, CorruptModel, UnsupportedModel: see :func:`load_heads`; BadInput also for an
                eagle head folder.
        """
        cfg = HeadsConfig.load(folder)
        if cfg.kind == "eagle":
            raise BadInput(f"{folder} holds an eagle head: load it with load_heads")
        return load_strict(cls, folder, cfg, dtype, target_lm_head)


def load_heads(folder: Path, dtype: torch.dtype = torch.float32,
               target_lm_head: Optional[torch.Tensor] = None, blocked: bool = False) -> nn.Module:
    """Load MTP heads of any kind from a head folder: :class:`MedusaHeads` (medusa, hydra) or
    :class:`~mtpctl.runtime.eagle.EagleHead` (eagle); strictly (missing, unexpected, mis-shaped,
    NaN tensors are errors).

    Args:
        target_lm_head: ``[vocab, hidden]`` the target's lm_head weight, needed by heads with a
            truncated draft vocabulary or their own lm_heads (see :class:`MedusaHeads`).
        blocked: for decoding, hold the draft-vocabulary projection in oneDNN's blocked layout too.

    Raises:
        BadInput, CorruptModel, UnsupportedModel: see :meth:`HeadsConfig.load` and
            :func:`mtpctl.model.weights.load_tensors`; BadInput also when ``target_lm_head``
            is needed and missing or mis-shaped.
    """
    from mtpctl.runtime.eagle import EagleHead

    cfg = HeadsConfig.load(folder)
    return load_strict(EagleHead if cfg.kind == "eagle" else MedusaHeads, folder, cfg, dtype, target_lm_head,
                       blocked)


def load_strict(cls, folder: Path, cfg: HeadsConfig, dtype: torch.dtype,
                target_lm_head: Optional[torch.Tensor], blocked: bool = False) -> nn.Module:
    """Build ``cls(cfg, dtype, target_lm_head, token_map, blocked)`` from ``folder``'s weights, strictly."""
    from mtpctl.model.weights import load_tensors

    shape = (cfg.vocab_size, cfg.hidden_size)
    if cfg.own_lm_head or cfg.draft_vocab_size:
        if target_lm_head is None or tuple(target_lm_head.shape) != shape:
            raise BadInput(f"heads in {folder} need the target's lm_head {list(shape)}")
    with torch.device("meta"):  # shapes only, no memory
        placeholder = torch.zeros(shape) if cfg.own_lm_head or cfg.draft_vocab_size else None
        token_map = torch.zeros(cfg.draft_vocab_size, dtype=torch.long) if cfg.draft_vocab_size else None
        expected = cls(cfg, dtype, placeholder, token_map).state_dict()
    path = Path(folder) / WEIGHTS_FILE
    if not path.is_file():
        raise CorruptModel(f"{folder} has {CONFIG_FILE} but no {WEIGHTS_FILE}")
    tensors = load_tensors([path], {name: tuple(t.shape) for name, t in expected.items()})
    for name, t in tensors.items():
        if t.is_floating_point() != expected[name].is_floating_point():
            raise CorruptModel(f"{path}: tensor {name!r} is {t.dtype}; expected "
                               f"{'a floating point' if expected[name].is_floating_point() else 'an integer'} dtype")
    if token_map is not None:
        token_map = tensors["token_map"]
        if int(token_map.min()) < 0 or int(token_map.max()) >= cfg.vocab_size or len(set(token_map.tolist())) != len(token_map):
            raise CorruptModel(f"{path}: token_map holds ids outside the vocabulary or repeats one")
    heads = cls(cfg, dtype, target_lm_head, token_map, blocked)
    heads.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()})
    heads.requires_grad_(False)
    return heads


def save_heads(heads: nn.Module, folder: Path) -> None:
    """Write ``mtp_config.json`` and ``mtp_heads.safetensors`` (float32) of any head kind into an
    existing ``folder`` (callers write to a temporary folder and rename it, see
    :mod:`mtpctl.convert.heads_training`)."""
    from safetensors.torch import save_file

    heads.cfg.save(folder)
    save_file({k: (v.detach().float() if v.is_floating_point() else v).contiguous()
               for k, v in heads.state_dict().items()},
              str(Path(folder) / WEIGHTS_FILE), metadata={"format": "pt", "mtpctl_kind": heads.cfg.kind})


def check_heads_match(cfg: HeadsConfig, hidden_size: int, vocab_size: int, target_hash: Optional[str]) -> None:
    """Raise BadInput unless heads of ``cfg`` were made for this target (sizes, and the weights'
    sha256 when ``target_hash`` is given)."""
    if cfg.hidden_size != hidden_size or cfg.vocab_size != vocab_size:
        raise BadInput(f"these heads were made for a model with hidden size {cfg.hidden_size} and vocabulary "
                       f"{cfg.vocab_size}; the target has {hidden_size} and {vocab_size} (train heads for it "
                       "with mtpctl add-heads)")
    if target_hash is not None and cfg.target_hash != target_hash:
        raise BadInput(f"these heads were trained on another model ({cfg.target}, weights sha256 "
                       f"{cfg.target_hash[:12]}...); the target's weights hash to {target_hash[:12]}... "
                       "(train heads for it with mtpctl add-heads)")


@dataclass(frozen=True)
class StaticTree:
    """A static draft tree (Medusa's sparse tree of top-k candidates).

    Each node is a path ``(r1, ..., rd)``: the rank-r1 candidate of head 1, then under it the rank-r2
    candidate of head 2, and so on. Nodes are ordered by depth (then path), so parents precede
    children and every prefix of the node list is itself a tree.
    """

    paths: Tuple[Tuple[int, ...], ...]

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]], num_heads: int) -> "StaticTree":
        """Check and order a list of paths.

        Raises:
            BadInput: an empty tree, an empty path, a negative rank, a duplicate path, a path deeper
                than ``num_heads``, or a path whose parent path is not in the tree.
        """
        if not paths:
            raise BadInput("the draft tree has no paths")
        nodes = set()
        for raw in paths:
            if not isinstance(raw, (list, tuple)) or not raw or not all(isinstance(r, int) and r >= 0 for r in raw):
                raise BadInput(f"draft tree path {raw!r} is not a non-empty list of ranks >= 0")
            path = tuple(raw)
            if path in nodes:
                raise BadInput(f"draft tree path {list(path)} appears twice")
            if len(path) > num_heads:
                raise BadInput(f"draft tree path {list(path)} is {len(path)} deep; the heads predict {num_heads} tokens")
            nodes.add(path)
        for path in nodes:
            if len(path) > 1 and path[:-1] not in nodes:
                raise BadInput(f"draft tree path {list(path)} has no parent path {list(path[:-1])} in the tree")
        return cls(tuple(sorted(nodes, key=lambda p: (len(p), p))))

    @property
    def parents(self) -> List[int]:
        """``[nodes]`` each node's parent index (-1 = the pending token)."""
        index = {p: i for i, p in enumerate(self.paths)}
        return [index[p[:-1]] if len(p) > 1 else -1 for p in self.paths]

    @property
    def depth(self) -> int:
        return max(len(p) for p in self.paths)

    @property
    def max_rank(self) -> int:
        """Candidates needed per head (1 + the largest rank)."""
        return 1 + max(r for p in self.paths for r in p)

    def draft(self, topk: torch.Tensor, max_nodes: int) -> Draft:
        """The draft tree of these paths filled from ``topk`` ``[K, >= max_rank]`` candidate ids
        (head-major), cut to its first ``max_nodes`` nodes."""
        n = min(len(self.paths), max_nodes)
        ids = topk.tolist()
        tokens = [ids[len(p) - 1][p[-1]] for p in self.paths[:n]]
        return Draft(tokens, self.parents[:n])


def tree_from_accuracy(topk_accuracy: Sequence[Sequence[float]], nodes: int) -> StaticTree:
    """The tree of ``nodes`` paths that maximises the expected accept length when head k's rank-r
    candidate is right with probability ``topk_accuracy[k][r]``, independently (the construction of
    Medusa, Cai et al. 2024, sec. 3.3.1): grows greedily from the root by the highest path probability.

    Raises:
        BadInput: ``nodes`` < 1 or no accuracy figures.
    """
    if nodes < 1 or not topk_accuracy or not topk_accuracy[0]:
        raise BadInput(f"cannot build a draft tree of {nodes} nodes from {len(topk_accuracy)} head accuracies")
    acc = [list(row) for row in topk_accuracy]
    frontier = [(-acc[0][0], (0,))]
    chosen: List[Tuple[int, ...]] = []
    while frontier and len(chosen) < nodes:
        neg, path = heapq.heappop(frontier)
        chosen.append(path)
        prob = -neg
        depth, rank = len(path) - 1, path[-1]
        if rank + 1 < len(acc[depth]):  # the next sibling
            parent_prob = prob / acc[depth][rank] if acc[depth][rank] > 0 else 0.0
            heapq.heappush(frontier, (-parent_prob * acc[depth][rank + 1], path[:-1] + (rank + 1,)))
        if depth + 1 < len(acc):  # the first child
            heapq.heappush(frontier, (-prob * acc[depth + 1][0], path + (0,)))
    return StaticTree.from_paths(chosen, len(acc))


class MedusaDrafter:
    """Drafts a static tree from the MTP heads at the target's last committed row.

    Medusa heads run with the verify pass (:meth:`StepOutput.draft_logits`), so a step is one fused
    draft/verify call; this class only picks each head's top-k and lays out the tree. Hydra heads
    (``sequential``) grow the tree level by level from that row (:meth:`StepOutput.draft_tree`).
    Candidates are deterministic (q one-hot), so rejection sampling stays lossless.
    """

    def __init__(self, tree: StaticTree, sequential: bool = False):
        self.tree = tree
        self.sequential = sequential

    def propose(self, context: Sequence[int], max_tokens: int, last: Optional[TargetStep] = None) -> Draft:
        if last is None or max_tokens <= 0:
            return Draft([])
        if self.sequential:  # context[-1] is the pending token
            return last.out.draft_tree(last.row, context[-1], self.tree, max_tokens)
        # [K, vocab], -inf outside a draft vocabulary
        logits = last.out.draft_logits(last.row, context[-1], heads=self.tree.depth)  # heads deeper than the tree: not run
        topk = logits[: self.tree.depth].topk(self.tree.max_rank, dim=-1).indices
        return self.tree.draft(topk, max_tokens)
