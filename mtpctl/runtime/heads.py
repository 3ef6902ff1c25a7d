"""MTP heads at decode time: Medusa heads, their versioned config, static draft trees, and the
drafter that turns the heads' outputs into a draft tree.

Medusa (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding
Heads"): K heads read the target's last hidden state h_t (after the final norm). The target's own
lm_head predicts token t+1 (the pending token); head k (k = 1..K) predicts token t+1+k. Each head is
``head_layers`` residual blocks ``x + SiLU(W x + b)`` (W, b start at zero, so a block starts as the
identity) then a vocabulary projection: the frozen target lm_head shared by all heads, or a trainable
copy per head (``own_lm_head``).

A head folder holds ``mtp_config.json`` (:class:`HeadsConfig`) and ``mtp_heads.safetensors``; the
target's weights are referenced by their sha256 (:func:`mtpctl.runtime.weights.weights_hash`).
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

FORMAT_VERSION = 1
CONFIG_FILE = "mtp_config.json"
WEIGHTS_FILE = "mtp_heads.safetensors"
KINDS = ("medusa",)


@dataclass
class HeadsConfig:
    """What ``mtp_config.json`` records about a set of MTP heads (format version 1).

    ``tree`` is the default static draft tree (paths of top-k ranks, see :class:`StaticTree`);
    ``topk_accuracy[k][r]`` the held-out probability that head k+1's rank-r candidate is the target's
    token, from which trees of any size are built (:func:`tree_from_accuracy`).
    """

    kind: str  # "medusa"
    num_heads: int  # K
    head_layers: int  # residual blocks per head
    own_lm_head: bool  # a trainable vocabulary projection per head (else the target's lm_head)
    hidden_size: int
    vocab_size: int  # logits width of the target (rows of its lm_head)
    target: str  # how the target was named when the heads were trained (alias, folder, repo id)
    target_hash: str  # sha256 of the target's safetensors files
    tree: List[List[int]] = field(default_factory=list)
    topk_accuracy: List[List[float]] = field(default_factory=list)  # [K][ranks]
    training: dict = field(default_factory=dict)  # the settings and figures of the training run
    format_version: int = FORMAT_VERSION
    mtpctl_version: str = ""

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
            cfg = cls(**raw)
        except (ValueError, TypeError, AttributeError) as err:
            raise CorruptModel(f"{path} is not a valid head config: {err}") from err
        if cfg.kind not in KINDS:
            raise UnsupportedModel(f"{path}: head kind {cfg.kind!r} is not supported (known: {', '.join(KINDS)})")
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

    Args:
        cfg: the heads' config (count, blocks per head, own lm_head, sizes).
        dtype: parameter dtype.
        lm_head_init: ``[vocab, hidden]`` initial value of every own lm_head (the target's lm_head);
            required when ``cfg.own_lm_head``.
    """

    def __init__(self, cfg: HeadsConfig, dtype: torch.dtype = torch.float32,
                 lm_head_init: Optional[torch.Tensor] = None):
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList(
            nn.Sequential(*(ResBlock(cfg.hidden_size, dtype) for _ in range(cfg.head_layers)))
            for _ in range(cfg.num_heads))
        self.lm_heads: Optional[nn.ParameterList] = None
        if cfg.own_lm_head:
            if lm_head_init is None:
                raise ValueError("own_lm_head needs lm_head_init (the target's lm_head weight)")
            self.lm_heads = nn.ParameterList(nn.Parameter(lm_head_init.detach().to(dtype).clone())
                                             for _ in range(cfg.num_heads))

    def features(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` -> each head's features before the vocabulary projection ``[..., K, hidden]``."""
        return torch.stack([blocks(hidden_states) for blocks in self.blocks], dim=-2)

    def forward(self, hidden_states: torch.Tensor, lm_head: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Draft logits of every head.

        Args:
            hidden_states: ``[..., hidden]``, the target's after its final norm.
            lm_head: the target's vocabulary projection ``[..., hidden] -> [..., vocab]`` (used when
                the heads share it; e.g. :meth:`mtpctl.runtime.model.Decoder.logits`).

        Returns:
            ``[..., K, vocab]`` float32; head k's row predicts the token k+1 places after the pending one.
        """
        feats = self.features(hidden_states)
        if self.lm_heads is None:
            return lm_head(feats).float()
        return torch.stack([F.linear(feats[..., k, :], w) for k, w in enumerate(self.lm_heads)], dim=-2).float()

    def expected_tensors(self) -> Dict[str, Tuple[int, ...]]:
        """Tensor name -> shape in ``mtp_heads.safetensors``."""
        return {name: tuple(p.shape) for name, p in self.state_dict().items()}

    def save(self, folder: Path) -> None:
        """Write ``mtp_config.json`` and ``mtp_heads.safetensors`` (float32) into an existing ``folder``
        (callers write to a temporary folder and rename it, see :mod:`mtpctl.convert.heads_training`)."""
        from safetensors.torch import save_file

        self.cfg.save(folder)
        save_file({k: v.detach().float().contiguous() for k, v in self.state_dict().items()},
                  str(Path(folder) / WEIGHTS_FILE), metadata={"format": "pt", "mtpctl_kind": self.cfg.kind})

    @classmethod
    def load(cls, folder: Path, dtype: torch.dtype = torch.float32) -> "MedusaHeads":
        """Load heads from a head folder, strictly (missing, unexpected, mis-shaped, NaN tensors).

        Raises:
            BadInput, CorruptModel, UnsupportedModel: see :meth:`HeadsConfig.load` and
                :func:`mtpctl.runtime.weights.load_tensors`.
        """
        from mtpctl.runtime.weights import load_tensors

        cfg = HeadsConfig.load(folder)
        placeholder = torch.zeros(cfg.vocab_size, cfg.hidden_size) if cfg.own_lm_head else None
        with torch.device("meta"):
            shapes = cls(cfg, dtype, placeholder).expected_tensors()
        path = Path(folder) / WEIGHTS_FILE
        if not path.is_file():
            raise CorruptModel(f"{folder} has {CONFIG_FILE} but no {WEIGHTS_FILE}")
        tensors = load_tensors([path], shapes)
        heads = cls(cfg, dtype, placeholder)
        heads.load_state_dict({k: v.to(dtype) for k, v in tensors.items()})
        heads.requires_grad_(False)
        return heads


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
    """Drafts a static tree from the MTP heads' logits at the target's last committed row.

    The engine computes the heads with the verify pass (:meth:`StepOutput.draft_logits`), so a step
    is one fused draft/verify call; this class only picks each head's top-k and lays out the tree.
    Candidates are deterministic (q one-hot), so rejection sampling stays lossless.
    """

    def __init__(self, tree: StaticTree):
        self.tree = tree

    def propose(self, context: Sequence[int], max_tokens: int, last: Optional[TargetStep] = None) -> Draft:
        if last is None or max_tokens <= 0:
            return Draft([])
        logits = last.out.draft_logits(last.row)  # [K, vocab]
        topk = logits[: self.tree.depth].topk(self.tree.max_rank, dim=-1).indices
        return self.tree.draft(topk, max_tokens)
