"""Native MTP layers: the target checkpoint's own multi-token-prediction layers as a drafter.

DeepSeek-V3 (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", section 2.2) and GLM-4.5 ship
``num_nextn_predict_layers`` MTP layers after the body's, in the layout ``model.layers.{L + k}.*`` (L =
``num_hidden_layers``): ``enorm`` and ``hnorm`` (RMSNorms), ``eh_proj [H, 2H]``, a full decoder block
of the family (attention and MoE: transformers builds it with ``first_k_dense_replace = 0``),
``shared_head.norm``, and optionally ``shared_head.head [V, H]`` and ``embed_tokens [V, H]`` (copies
of the target's lm_head and embedding in the published checkpoints).

Row j of an MTP layer reads the target's hidden state ``h_j`` (after its final norm) and the next token
``x_{j+1}``: ``u_j = eh_proj [enorm(embed(x_{j+1})) ; hnorm(h_j)]``, runs the block (attention over
rows ``0..j`` of the layer's own KV cache) and gives ``g_j``; ``shared_head.norm`` then the head turn
``g_j`` into logits for ``x_{j+2}``. Drafting deeper than the trained layers reuses the layer on its
own output (as vLLM does): the next row reads ``g`` (raw or normed, :class:`MtpSettings`) and the
token just drafted.

:class:`MtpLayers` reads the layer strictly from the checkpoint; :class:`MtpDrafter` keeps its KV cache
indexed by position, as the EAGLE drafter does (:mod:`mtpctl.drafters.heads.eagle`): each call first
runs the rows the target committed in its last pass with their true hidden states (overwriting what
draft rows wrote there), then drafts a chain of k tokens past them, which the next call overwrites.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

from mtpctl.decode.attention import MAX_DRAFT_DEPTH
from mtpctl.decode.drafter import Drafter, TargetStep, check_finite
from mtpctl.decode.tree import DraftTree
from mtpctl.errors import BadInput, CorruptModel, UnsupportedModel
from mtpctl.model import fp8
from mtpctl.model.config import DecoderConfig, read_json
from mtpctl.model.decoder import Decoder, _Filler, _rms_norm, expected_tensors
from mtpctl.model.weights import (MemoryTensors, TensorInfo, check_finite as check_finite_tensor, read_headers,
                                  shard_files)

#: families whose checkpoints carry MTP layers in the published ``model.layers.{L + k}`` layout
FAMILIES = ("glm4_moe", "deepseek_v3")
#: the tensors of an MTP layer besides its decoder block (``optional``: copies of the target's)
EXTRAS = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
OPTIONAL = ("shared_head.head.weight", "embed_tokens.weight")


@dataclass(frozen=True)
class MtpSettings:
    """Where the engines running these layers differ (docs/heads.md, "Native MTP layers").

    Attributes:
        carry: what a recursive step reads as the hidden state of the step before: ``raw`` (the block's
            output before ``shared_head.norm``: vLLM's and the DeepSeek-V3 report's ``h^k``) or
            ``normed`` (after it: transformers' ``MtpModel``, whose layer output is post-normed).
        zero_first_embedding: zero the token embedding of the row at position 0 (vLLM's
            ``inputs_embeds[positions == 0] = 0``); transformers does not.
        own_vocab: use the layer's own ``embed_tokens`` / ``shared_head.head`` where the checkpoint has
            them (vLLM); False: the target's embedding and lm_head always (transformers).
        hidden_first: ``eh_proj`` reads ``[hnorm(h) ; enorm(e)]`` instead of ``[enorm(e) ; hnorm(h)]``
            (transformers' ``mtp_hidden_states_first``; not DeepSeek's or GLM's order).
    """

    carry: str = "raw"
    zero_first_embedding: bool = False
    own_vocab: bool = True
    hidden_first: bool = False

    def check(self) -> None:
        if self.carry not in ("raw", "normed"):
            raise BadInput(f"MTP carry {self.carry!r}: choose raw or normed", option="mtp")


def check_mtp_layers(cfg: DecoderConfig, folder: Path, option: str = "speculate",
                     instead: str = "draft with another drafter") -> None:
    """Refuse a checkpoint without MTP layers mtpctl reads (``instead``: what to do then).

    Raises:
        UnsupportedModel: a family whose MTP layout is not read.
        BadInput: a checkpoint that declares no MTP layers.
    """
    if cfg.family.model_type not in FAMILIES:
        raise UnsupportedModel(f"MTP layers of {cfg.family.model_type} checkpoints are not read (known layouts: "
                               f"{', '.join(FAMILIES)})", option=option)
    if cfg.mtp_layers <= 0:
        raise BadInput(f"{folder} has no MTP layers (num_nextn_predict_layers is 0): {instead}", option=option)


class _Source(MemoryTensors):
    """In-memory tensors whose ``shared`` names (the target's embedding) are taken as they are, not
    copied (the loader maps a tensor it may map)."""

    def __init__(self, tensors, shared=()):
        super().__init__(tensors)
        self.shared = set(shared)

    def mapped(self, name: str) -> Optional[torch.Tensor]:
        return self.tensors[name] if name in self.shared else None


def _read_tensors(prefix: str, found: Dict[str, TensorInfo]) -> Dict[str, torch.Tensor]:
    """The tensors ``prefix + name`` of ``found`` (name -> info), read file by file in their stored dtype."""
    from safetensors import safe_open

    by_file: Dict[Path, List[str]] = {}
    for name, info in found.items():
        by_file.setdefault(Path(info.path), []).append(name)
    out = {}
    for path, group in by_file.items():
        with safe_open(str(path), framework="pt") as handle:
            for name in group:
                out[name] = handle.get_tensor(prefix + name)
    return out


class MtpLayers:
    """The first MTP layer of a checkpoint, ready to draft beside the target ``model``.

    The block is held as a one-layer :class:`~mtpctl.model.decoder.Decoder` (``self.block``: its
    ``layers[0]``, rope tables and KV cache shapes; its embedding is the target's, not copied).

    Attributes:
        enorm, hnorm, norm: ``[H]`` the RMSNorm weights (``norm``: ``shared_head.norm``).
        eh_proj: ``[H, 2H]``.
        embed: ``[V, H]`` the embedding the layer reads (its own, or the target's).
        head: ``[V, H]`` its own ``shared_head.head`` where used and unlike the target's lm_head, else
            None (the target's lm_head, on its kernels).
        count: MTP layers the checkpoint declares (only the first drafts).
    """

    def __init__(self, model: Decoder, folder: Path, settings: MtpSettings = MtpSettings()):
        cfg = model.cfg
        check_mtp_layers(cfg, folder)
        self.model, self.settings, self.count = model, settings, cfg.mtp_layers
        raw = read_json(Path(folder) / "config.json")
        self.cfg = DecoderConfig.from_dict({**raw, "num_hidden_layers": 1, "first_k_dense_replace": 0,
                                            "num_nextn_predict_layers": 0, "num_mtp_layers": 0,
                                            "tie_word_embeddings": True})
        self.prefix = f"model.layers.{cfg.num_hidden_layers}."
        tensors = self._read(Path(folder), cfg.num_hidden_layers)
        #: checkpoint name (after :attr:`prefix`) -> shape of every tensor of the layer read
        self.shapes = {name: tuple(t.shape) for name, t in tensors.items()}
        dtype = model.dtype
        self.enorm, self.hnorm, self.eh_proj, self.norm = (tensors.pop(name).to(dtype) for name in EXTRAS)
        own_head, own_embed = (tensors.pop(name, None) for name in OPTIONAL)
        use_own = settings.own_vocab
        self.embed = own_embed.to(dtype) if use_own and own_embed is not None else model.embed.detach()
        self.head = None
        if use_own and own_head is not None:
            head = own_head.to(dtype)
            target = model.dense_lm_head()
            if not (head.shape == target.shape and torch.equal(head, target.to(dtype))):
                self.head = head
        block = {f"model.layers.0.{name}": t for name, t in tensors.items()}
        block["model.embed_tokens.weight"] = self.embed
        block["model.norm.weight"] = self.norm
        self.block = Decoder(self.cfg, dtype, model.device, lazy=True)
        _Filler(self.block, _Source(block, shared=("model.embed_tokens.weight",)), False, False, None).run()
        self.block.layer_stack = False
        self.eps = cfg.rms_norm_eps

    def _read(self, folder: Path, layers: int) -> Dict[str, torch.Tensor]:
        """The first MTP layer's tensors (names after ``model.layers.{layers}.``), checked: the block's
        names and shapes are the family's MoE layer's, the extras are present with their shapes, and
        every value is finite; block-scaled FP8 weights dequantized to float32 (their scales consumed)."""
        files = shard_files(folder)
        prefix = f"model.layers.{layers}."
        found = {name[len(prefix):]: info for name, info in read_headers(files).items() if name.startswith(prefix)}
        where = f"{folder}: MTP layer {prefix}"
        pairs = fp8.pair_scales({n: i.shape for n, i in found.items()}, {n: i.dtype for n, i in found.items()},
                                self.cfg.fp8_block, where)
        self._check_layout({n: i for n, i in found.items() if n not in pairs.values()}, where)
        out = _read_tensors(prefix, found)
        for weight, scale in pairs.items():
            out[weight] = fp8.dequantize_stack(out[weight], out.pop(scale), self.cfg.fp8_block)
        for name, value in out.items():
            check_finite_tensor(prefix + name, value, str(folder))
        return out

    def _check_layout(self, found: Dict[str, TensorInfo], where: str) -> None:
        """Raise CorruptModel unless ``found`` (name after the prefix -> info) is an MTP layer of the
        published layout: the family's MoE block, the extras, the optional copies, with their shapes."""
        h, v = self.cfg.hidden_size, self.cfg.vocab_size
        names = {f"model.layers.0.{name}" for name in found}
        block = {name[len("model.layers.0."):]: tuple(shape) for name, shape in
                 expected_tensors(self.cfg, names).items() if name.startswith("model.layers.0.")}
        shapes = {**block, "enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h),
                  "shared_head.norm.weight": (h,), "shared_head.head.weight": (v, h), "embed_tokens.weight": (v, h)}
        missing = sorted(set(shapes) - set(found) - set(OPTIONAL))
        unexpected = sorted(set(found) - set(shapes))
        if missing or unexpected:
            what = f"missing {missing[0]!r}" if missing else f"unexpected {unexpected[0]!r}"
            raise CorruptModel(f"{where} does not have the published layout ({what})")
        for name, info in found.items():
            if tuple(info.shape) != shapes[name]:
                raise CorruptModel(f"{where}{name} has shape {tuple(info.shape)}, expected {shapes[name]}")

    def new_cache(self, capacity: int):
        return self.block.new_cache(capacity)

    def rows(self, hidden: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor, cache) -> torch.Tensor:
        """Run rows ``(hidden [M, H], tokens [M])`` at consecutive ``slots [M]`` (from ``cache.length``)
        through the layer, each attending to the slots up to its own; writes their KV (uncommitted) and
        returns the block's raw outputs ``g [M, H]``. Row s sits at position s + 1 (transformers'; the
        attention reads relative positions only)."""
        device = self.eh_proj.device
        slots = slots.to(device)
        x = self.project(hidden, self.embedding(tokens.to(device), slots))
        mask = (torch.arange(cache.capacity, device=device)[None, :] <= slots[:, None])[None, None]
        return self.run_block(x[None], slots[None], cache, mask)[0]

    def embedding(self, tokens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The embeddings ``[..., H]`` of ``tokens`` read by rows at ``slots`` (same shape as
        ``tokens``): the row at slot 0 zeroed with :attr:`MtpSettings.zero_first_embedding`."""
        e = F.embedding(tokens, self.embed)
        if self.settings.zero_first_embedding:
            e = e.masked_fill((slots == 0)[..., None], 0)
        return e

    def project(self, hidden: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """The block's input ``eh_proj [enorm(e) ; hnorm(h)]`` (``[..., H]``) of hidden states and
        token embeddings ``[..., H]``."""
        parts = (_rms_norm(embeds, self.enorm, self.eps), _rms_norm(hidden.to(embeds.dtype), self.hnorm, self.eps))
        return F.linear(torch.cat(parts[::-1] if self.settings.hidden_first else parts, dim=-1), self.eh_proj)

    def run_block(self, x: torch.Tensor, slots: torch.Tensor, cache, mask: torch.Tensor) -> torch.Tensor:
        """The block's raw outputs ``[B, N, H]`` of inputs ``x [B, N, H]`` at ``slots [1 or B, N]``
        (row s at position s + 1), writing their keys and values into ``cache`` (a KV cache, or any
        object with its ``length`` and ``write``) and attending as ``mask [B or 1, 1, N, slots]`` says."""
        positions = slots + 1
        cos, sin = (t.unsqueeze(2) for t in self.block.rope(positions))
        return self.block.layers[0](x, cos, sin, cache, mask)

    def normed(self, g: torch.Tensor) -> torch.Tensor:
        """``shared_head.norm`` of the block's outputs."""
        return _rms_norm(g, self.norm, self.eps)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[M, V]`` of normed outputs ``[M, H]``."""
        if self.head is not None:
            return F.linear(normed, self.head).float()
        return self.model.logits(normed)

    def carried(self, g: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        """What the next recursive step reads as its hidden state (:attr:`MtpSettings.carry`)."""
        return normed if self.settings.carry == "normed" else g


class MtpDrafter(Drafter):
    """Drafts a chain of up to ``budget`` tokens with the checkpoint's MTP layer: token 1 from the row
    of the target's last committed hidden state and the pending token, tokens 2.. by running the layer
    again on its own output (recursively past its trained depth of one). Drafts are greedy (q None):
    rejection sampling commits the target's own samples, so sampled requests stay seed-stable.

    Attributes:
        layers: the :class:`MtpLayers` (shared by forks).
        cache: this request's KV cache of the layer; ``cache.length`` rows hold committed positions.
        record: a list each call appends its chain to, ``(position of the pending token, draft tokens)``,
            shared by forks (tests compare them with transformers'); None: nothing kept.
    """

    def __init__(self, layers: MtpLayers, budget: int, record: Optional[list] = None):
        if not 1 <= budget <= MAX_DRAFT_DEPTH:
            raise BadInput(f"MTP drafting takes 1 to {MAX_DRAFT_DEPTH} tokens a step, not {budget}", option="draft_len")
        self.layers, self.budget, self.record = layers, budget, record
        self.cache = layers.new_cache(256)
        self.kept: List[torch.Tensor] = []  # committed rows' hidden states not run yet (steps that drafted nothing)
        self.held = 0  # positions whose hidden states were seen (run or kept)

    def fork(self) -> "MtpDrafter":
        """The same layer with an empty KV cache of its own."""
        return MtpDrafter(self.layers, self.budget, self.record)

    def propose(self, context: Sequence[int], max_tokens: int, last: Optional[TargetStep] = None) -> DraftTree:
        """See :class:`~mtpctl.decode.drafter.Drafter`. The drafter must see every target pass (after
        prefill ``last.out.prompt_hidden_states``, after a verify pass ``last.rows``); a step that
        drafts nothing only keeps the committed rows' hidden states.

        Raises:
            ValueError: committed positions were skipped (the drafter missed a target pass), or a
                prefill output without the prompt's hidden states (backends other than torch).
        """
        pending = context[-1]
        if last is None:
            return DraftTree(pending)
        n = len(context) - 1  # position of the pending token
        with torch.inference_mode():
            hidden = self._committed(last)
            start = n - hidden.shape[0]
            if start < self.held:  # a new request (start 0) or positions taken back: forget them
                self._forget(start)
            if start != self.held:
                raise ValueError(f"the MTP drafter holds {self.held} positions but the target's last pass "
                                 f"committed positions from {start}: it must see every target pass")
            self.kept.append(hidden)
            self.held = n
            k = min(max_tokens, self.budget)
            if k <= 0:
                return DraftTree(pending)
            first = self.cache.length
            rows = torch.cat(self.kept) if len(self.kept) > 1 else hidden
            self.kept = []
            tokens = torch.tensor(list(context[first + 1:n + 1]), dtype=torch.long)
            self._reserve(n + k)
            g = self.layers.rows(rows.to(self.layers.eh_proj.dtype), tokens, torch.arange(first, n), self.cache)
            self.cache.advance(n - first)
            g = g[-1:]
            drafted: List[int] = []
            for step in range(k):
                normed = self.layers.normed(g)
                token = int(check_finite(self.layers.logits(normed), "the MTP layer")[0].argmax())
                drafted.append(token)
                if step + 1 == k:
                    break
                g = self.layers.rows(self.layers.carried(g, normed), torch.tensor([token]),
                                     torch.tensor([self.cache.length]), self.cache)
                self.cache.advance(1)
            self.cache.rollback(n)
        if self.record is not None:
            self.record.append((n, drafted))
        return DraftTree.chain([pending] + drafted)

    def _committed(self, last: TargetStep) -> torch.Tensor:
        if last.rows is not None:
            return last.out.hidden_states[list(last.rows)]
        if last.out.prompt_hidden_states is None:
            raise ValueError("MTP drafting needs every prompt row's hidden states (the torch backend)")
        return last.out.prompt_hidden_states

    def _forget(self, start: int) -> None:
        """Forget positions from ``start`` on (their rows are recomputed when seen again)."""
        kept_from = self.cache.length
        if start <= kept_from:
            self.cache.rollback(start)
            self.kept = []
        else:
            rows = torch.cat(self.kept)[: start - kept_from]
            self.kept = [rows] if rows.shape[0] else []
        self.held = start

    def _reserve(self, slots: int) -> None:
        if slots > self.cache.capacity:
            grown = self.layers.new_cache(max(slots, 2 * self.cache.capacity))
            length = self.cache.length
            grown.k[:, :, :, :length] = self.cache.k[:, :, :, :length]
            grown.v[:, :, :, :length] = self.cache.v[:, :, :, :length]
            grown.length = length
            self.cache = grown


def mtp_drafter(session, budget: int, settings: Optional[MtpSettings] = None,
                record: Optional[list] = None) -> MtpDrafter:
    """The MTP drafter of ``session``'s target (its checkpoint's own layers), ``budget`` tokens a step.

    Raises:
        BadInput: a backend without the torch model, a target without MTP layers, a budget out of range.
        UnsupportedModel: a family whose MTP layout is not read.
        CorruptModel: an MTP layer without the published layout.
    """
    if session.model is None:
        raise BadInput(f"MTP layers draft beside the torch backend's target, not {session.backend}", option="backend")
    settings = settings or MtpSettings()
    settings.check()
    return MtpDrafter(MtpLayers(session.model, session.folder, settings), budget, record)

