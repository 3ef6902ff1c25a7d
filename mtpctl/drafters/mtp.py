"""Native MTP layers: the target checkpoint's own multi-token-prediction layers as a drafter.

DeepSeek-V3 (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", section 2.2), GLM-4.5, Qwen3.5 / Qwen3-Next
and Xiaomi MiMo ship MTP layers beside the body, each family in its own layout
(:mod:`mtpctl.model.families.mtp_layouts`, the family's ``mtp_layout``): two RMSNorms, a projection
``[H, 2H]``, a full decoder block of the family (DeepSeek's and GLM's a MoE layer, Qwen's a full-attention
layer, MiMo's a Qwen2 layer), a final norm, and optionally copies of the target's lm_head and embedding.

Row j of an MTP layer reads the target's hidden state ``h_j`` (after its final norm) and the next token
``x_{j+1}``: ``u_j = proj [norm_e(embed(x_{j+1})) ; norm_h(h_j)]`` (MiMo: the hidden state first), runs
the block (attention over rows ``0..j`` of the layer's own KV cache; on a hybrid Gated DeltaNet body too
the block attends, so its cache is a KV cache and the body's recurrent state is not the drafter's) and
gives ``g_j``; the final norm then the head turn ``g_j`` into logits for ``x_{j+2}``.

A checkpoint may declare several layers (DeepSeek-V3's sequential MTP modules): layer i (0-based) row j
reads layer i-1's output at row j (raw or normed, :class:`MtpSettings`, whose defaults are the layout's
engine's) and the token ``x_{j+i+1}``, and predicts ``x_{j+i+2}``; so layer i drafts depth i+1, each
with its own KV cache, as transformers' ``MtpModel`` chains them (row j of layer i at position
j + i + 1). Drafting deeper than the last layer reuses it on its own output (as vLLM does): the next row
reads its output and the token just drafted.

:class:`MtpLayers` reads one layer strictly from the checkpoint (:func:`read_mtp_layers`: all of them);
:class:`MtpDrafter` keeps each layer's KV cache indexed by position, as the EAGLE drafter does
(:mod:`mtpctl.drafters.heads.eagle`): each call first runs the rows whose inputs the target committed
(their true hidden states and tokens, overwriting what draft rows wrote there), then drafts a chain of k
tokens past them, which the next call overwrites.
"""

from __future__ import annotations

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
from mtpctl.model.decoder import Decoder, _Filler, _rms_norm, _rms_norm_float32_scale, expected_tensors, stored_norm
from mtpctl.model.families import FAMILIES
from mtpctl.model.families.mtp_layouts import MtpLayout, MtpSettings
from mtpctl.model.weights import (MemoryTensors, TensorInfo, check_finite as check_finite_tensor, read_headers,
                                  shard_files)

__all__ = ["MtpDrafter", "MtpLayers", "MtpSettings", "check_mtp_layers", "mtp_drafter", "read_mtp_layers"]

#: the MtpLayers attribute of each role of a layout's own tensors (:data:`~mtpctl.model.families.mtp_layouts.ROLES`)
ATTRS = {"embedding_norm": "enorm", "hidden_norm": "hnorm", "projection": "eh_proj", "final_norm": "norm"}
#: the block's names in the one-layer decoder that runs it
BLOCK = "model.layers.0."


def check_mtp_layers(cfg: DecoderConfig, folder: Path, option: str = "speculate",
                     instead: str = "draft with another drafter") -> None:
    """Refuse a checkpoint without MTP layers mtpctl reads (``instead``: what to do then).

    Raises:
        UnsupportedModel: a family whose MTP layout is not read.
        BadInput: a checkpoint that declares no MTP layers.
    """
    layout = cfg.family.mtp_layout
    if layout is None:
        known = ", ".join(t for t, family in FAMILIES.items() if family.mtp_layout is not None)
        raise UnsupportedModel(f"MTP layers of {cfg.family.model_type} checkpoints are not read (known layouts: "
                               f"{known})", option=option)
    if cfg.mtp_layers <= 0:
        raise BadInput(f"{folder} has no MTP layers ({layout.count_keys[0]} is 0): {instead}", option=option)


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


def block_config(layout: MtpLayout, raw: dict) -> DecoderConfig:
    """The config of the one-layer decoder that runs an MTP block: config.json's body (``raw``, its text
    part) with one layer, the layout's :attr:`~mtpctl.model.families.mtp_layouts.MtpLayout.block_config`,
    no MTP layers of its own and the lm_head tied (its embedding is the target's)."""
    counts = {key: 0 for key in layout.count_keys}
    return DecoderConfig.from_dict({**raw, "num_hidden_layers": 1, **dict(layout.block_config), **counts,
                                    "tie_word_embeddings": True})


class MtpLayers:
    """MTP layer ``index`` (0: the first) of a checkpoint, ready to draft beside the target ``model``.

    The block is held as a one-layer :class:`~mtpctl.model.decoder.Decoder` (``self.block``: its
    ``layers[0]``, rope tables and KV cache shapes; its embedding is the target's, not copied; its own
    final norm unused). ``tensors`` (name after :attr:`prefix` -> value) gives the layer instead of the
    checkpoint (a layer grafted onto a checkpoint without one: :mod:`mtpctl.train.mtp_graft`).

    Attributes:
        layout: the family's :class:`~mtpctl.model.families.mtp_layouts.MtpLayout`.
        settings: the :class:`MtpSettings` it runs with, the layout's defaults filled in.
        prefix: what the layer's checkpoint names start with (``model.layers.{L}.``, ``mtp.``).
        names: attribute (``enorm``, ``hnorm``, ``eh_proj``, ``norm``) -> checkpoint name after
            :attr:`prefix` of the layer's own tensors besides its block (``norm`` absent where the final
            norm is the body's).
        block_prefix: the block's prefix after :attr:`prefix`.
        enorm, hnorm, norm: ``[H]`` the RMSNorm weights of the embedding, the hidden state and the
            block's output (held as ``offset + w`` in float32 where the layout stores offsets).
        eh_proj: ``[H, 2H]`` the projection.
        embed: ``[V, H]`` the embedding the layer reads (its own copy, or the target's).
        head: ``[V, H]`` its own lm_head copy where used and unlike the target's lm_head, else None (the
            target's lm_head, on its kernels).
        count: MTP layers the checkpoint declares.
        index: which of them this is (it drafts depth ``index + 1``; its rows sit ``index`` positions
            later than the first layer's).
        shapes: checkpoint name (after :attr:`prefix`) -> shape of every tensor of the layer read.
        stored: checkpoint name (after :attr:`prefix`) -> value as read of each one-dimensional tensor of
            the layer where norms hold an offset (writing back gives unchanged norms as stored, bit for bit).
    """

    def __init__(self, model: Decoder, folder: Path, settings: MtpSettings = MtpSettings(), index: int = 0,
                 tensors: Optional[Dict[str, torch.Tensor]] = None):
        cfg = model.cfg
        if tensors is None:
            check_mtp_layers(cfg, folder)
        count = cfg.mtp_layers if tensors is None else 1  # given tensors: one layer grafted (mtpctl.train.mtp_graft)
        if not 0 <= index < count:
            raise BadInput(f"{folder} declares {count} MTP layer(s): there is no layer {index}", option="mtp")
        self.index = index
        layout = cfg.family.mtp_layout
        raw = cfg.family.text_part(read_json(Path(folder) / "config.json"))
        for key, value in layout.refused:
            if raw.get(key) == value:
                raise UnsupportedModel(f"{folder}: config.json sets {key}={value!r}, an MTP layout mtpctl does not "
                                       "read", option="speculate")
        self.model, self.layout, self.count = model, layout, count
        self.settings = layout.settings_for(settings)
        self.cfg = block_config(layout, raw)
        if self.cfg.layer_windows[0] is not None:
            raise UnsupportedModel(f"{folder}: a sliding-window MTP block is not read", option="speculate")
        n = layout.number(cfg.num_hidden_layers, index)
        self.prefix, self.block_prefix = layout.prefix.format(n=n), layout.block.format(n=n)
        roles = layout.names(n)
        self.names = {ATTRS[role]: name for role, name in roles.items() if role in ATTRS}
        self.copies = (roles.get("head_copy"), roles.get("embedding_copy"))
        if tensors is None:
            tensors = self._read(Path(folder))
        else:  # the layer's tensors given (names after the prefix), checked as read ones are
            tensors = dict(tensors)
            self._check_layout({name: tuple(t.shape) for name, t in tensors.items()}, f"MTP layer {self.prefix}")
        self.shapes = {name: tuple(t.shape) for name, t in tensors.items()}
        self.offset = cfg.norm_offset if layout.offset_norms else 0.0
        self.stored = {name: t for name, t in tensors.items() if t.dim() == 1} if self.offset else {}
        self._norm = _rms_norm_float32_scale if self.offset else _rms_norm
        dtype, device = model.dtype, model.device  # the layer's own tensors go where the body's are
        held = {attr: tensors.pop(name) for attr, name in self.names.items()}
        self.eh_proj = held.pop("eh_proj").to(device, dtype)
        for attr, value in held.items():
            setattr(self, attr, value.to(device).float() + self.offset if self.offset else value.to(device, dtype))
        if "norm" not in held:  # the body's own final norm (held as the body holds it)
            self.norm = model.norm.detach()
        own_head, own_embed = (tensors.pop(name, None) if name else None for name in self.copies)
        use_own = self.settings.own_vocab
        self.embed = own_embed.to(device, dtype) if use_own and own_embed is not None else model.embed.detach()
        self.head = None
        if use_own and own_head is not None:
            head = own_head.to(device, dtype)
            target = model.dense_lm_head()
            if not (head.shape == target.shape and torch.equal(head, target.to(dtype))):
                self.head = head
        block = {self.block_name(name): t for name, t in tensors.items()}
        block["model.embed_tokens.weight"] = self.embed
        block["model.norm.weight"] = torch.zeros(self.cfg.hidden_size, dtype=dtype, device=device)  # unused
        self.block = Decoder(self.cfg, dtype, model.device, lazy=True)
        _Filler(self.block, _Source(block, shared=("model.embed_tokens.weight",)), False, False, None).run()
        self.block.layer_stack = False
        self.eps = cfg.rms_norm_eps

    def block_name(self, name: str) -> str:
        """The one-layer decoder's name of the block's tensor ``name`` (after :attr:`prefix`)."""
        return BLOCK + name[len(self.block_prefix):]

    def checkpoint_name(self, block_name: str) -> str:
        """The inverse of :meth:`block_name`."""
        return self.block_prefix + block_name[len(BLOCK):]

    def in_block(self, name: str) -> bool:
        """Whether checkpoint name ``name`` (after :attr:`prefix`) is the block's."""
        return name.startswith(self.block_prefix) and name not in self.names.values() and name not in self.copies

    def stored_value(self, name: str, held: torch.Tensor) -> torch.Tensor:
        """The checkpoint value of the layer's own tensor ``name`` (after :attr:`prefix`) holding ``held``:
        a norm held with an offset given back as stored where unchanged (:func:`~mtpctl.model.decoder.stored_norm`)."""
        if self.offset and name != self.names["eh_proj"]:
            return stored_norm(held, self.stored.get(name), self.offset)
        return held

    def _read(self, folder: Path) -> Dict[str, torch.Tensor]:
        """The layer's tensors (names after :attr:`prefix`), checked: the block's names and
        shapes are the family's layer's, the others are present with their shapes, and every value is
        finite; block-scaled FP8 weights dequantized to float32 (their scales consumed)."""
        files = shard_files(folder)
        mine = set(self.names.values()) | {c for c in self.copies if c}
        found = {name[len(self.prefix):]: info for name, info in read_headers(files).items()
                 if name.startswith(self.prefix) and (name[len(self.prefix):] in mine
                                                      or name[len(self.prefix):].startswith(self.block_prefix))}
        where = f"{folder}: MTP layer {self.prefix}"
        pairs = fp8.pair_scales({n: i.shape for n, i in found.items()}, {n: i.dtype for n, i in found.items()},
                                self.cfg.fp8_block, where)
        if not found:
            raise CorruptModel(f"{folder} declares {self.count} MTP layer(s) but holds none of the tensors of "
                               f"MTP layer {self.prefix}{self.block_prefix}: a fine-tuning tool may have dropped them "
                               "(mtpctl add-heads --kind mtp can graft a new layer)", option="graft")
        self._check_layout({n: tuple(i.shape) for n, i in found.items() if n not in pairs.values()}, where)
        out = _read_tensors(self.prefix, found)
        for weight, scale in pairs.items():
            out[weight] = fp8.dequantize_stack(out[weight], out.pop(scale), self.cfg.fp8_block)
        for name, value in out.items():
            check_finite_tensor(self.prefix + name, value, str(folder))
        return out

    def _check_layout(self, found: Dict[str, tuple], where: str) -> None:
        """Raise CorruptModel unless ``found`` (name after the prefix -> shape) is an MTP layer of the
        published layout: the family's block, the layout's own tensors, the optional copies, with their
        shapes."""
        h, v = self.cfg.hidden_size, self.cfg.vocab_size
        names = {self.block_name(name) for name in found if self.in_block(name)}
        shapes = {self.checkpoint_name(name): tuple(shape) for name, shape in
                  expected_tensors(self.cfg, names).items() if name.startswith(BLOCK)}
        shapes.update({name: (h, 2 * h) if attr == "eh_proj" else (h,) for attr, name in self.names.items()})
        shapes.update({name: (v, h) for name in self.copies if name})
        missing = sorted(set(shapes) - set(found) - set(self.copies))
        unexpected = sorted(set(found) - set(shapes))
        if missing or unexpected:
            what = f"missing {missing[0]!r}" if missing else f"unexpected {unexpected[0]!r}"
            raise CorruptModel(f"{where} does not have the published layout ({what})")
        for name, shape in found.items():
            if shape != shapes[name]:
                raise CorruptModel(f"{where}{name} has shape {shape}, expected {shapes[name]}")

    def new_cache(self, capacity: int):
        """An empty KV cache of the block for ``capacity`` rows: keys and values only (on a hybrid body
        the block attends, and the body's Gated DeltaNet states are not the drafter's)."""
        cache = self.block.new_cache(capacity)
        cache.linear = None
        self.block.reserve_rope(capacity + 1 + self.index)  # row s of layer i sits at position s + 1 + i
        return cache

    def rows(self, hidden: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor, cache) -> torch.Tensor:
        """Run rows ``(hidden [M, H], tokens [M])`` at consecutive ``slots [M]`` (from ``cache.length``)
        through the layer, each attending to the slots up to its own; writes their KV (uncommitted) and
        returns the block's raw outputs ``g [M, H]``. Row s sits at position s + 1 + :attr:`index`
        (transformers'; the attention reads relative positions only)."""
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
        """The block's input ``eh_proj [enorm(e) ; hnorm(h)]`` (``[..., H]``; the hidden state first with
        :attr:`MtpSettings.hidden_first`) of hidden states and token embeddings ``[..., H]``."""
        parts = (self._norm(embeds, self.enorm, self.eps), self._norm(hidden.to(embeds.dtype), self.hnorm, self.eps))
        return F.linear(torch.cat(parts[::-1] if self.settings.hidden_first else parts, dim=-1), self.eh_proj)

    def run_block(self, x: torch.Tensor, slots: torch.Tensor, cache, mask: torch.Tensor) -> torch.Tensor:
        """The block's raw outputs ``[B, N, H]`` of inputs ``x [B, N, H]`` at ``slots [1 or B, N]``
        (row s at position s + 1 + :attr:`index`), writing their keys and values into ``cache`` (a KV cache, or any
        object with its ``length`` and ``write``) and attending as ``mask [B or 1, 1, N, slots]`` says."""
        positions = slots + 1 + self.index
        cos, sin = (t.unsqueeze(2) for t in self.block.rope(positions))
        return self.block.layers[0](x, cos, sin, cache, mask)

    def normed(self, g: torch.Tensor) -> torch.Tensor:
        """The final norm of the block's outputs."""
        return self._norm(g, self.norm, self.eps)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[M, V]`` of normed outputs ``[M, H]``."""
        if self.head is not None:
            return F.linear(normed, self.head).float()
        return self.model.logits(normed)

    def carried(self, g: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        """What the next recursive step reads as its hidden state (:attr:`MtpSettings.carry`)."""
        return normed if self.settings.carry == "normed" else g


def read_mtp_layers(model: Decoder, folder: Path, settings: MtpSettings = MtpSettings()) -> List[MtpLayers]:
    """Every MTP layer the checkpoint in ``folder`` declares (:class:`MtpLayers` each), in order."""
    first = MtpLayers(model, folder, settings)
    return [first] + [MtpLayers(model, folder, settings, k) for k in range(1, first.count)]


class MtpDrafter(Drafter):
    """Drafts a chain of up to ``budget`` tokens with the checkpoint's MTP layers: token 1 from layer 0's
    row of the target's last committed hidden state and the pending token, token i+1 from layer i's row
    at the same position (reading layer i-1's output there and token i), tokens past the last layer by
    running it again on its own output (recursively). Drafts are greedy (q None): rejection sampling
    commits the target's own samples, so sampled requests stay seed-stable.

    Each layer i holds the rows whose inputs are committed: row j once the target committed ``h_j`` and
    the token ``x_{j+i+1}``; its KV cache holds them, and :attr:`kept` the inputs of the rows after them
    known so far (the target's hidden states for layer 0, layer i-1's carried outputs for layer i).

    Attributes:
        layers: the :class:`MtpLayers`, one per layer (shared by forks).
        caches: this request's KV cache of each layer; ``caches[i].length`` rows hold committed rows.
        kept: per layer, the committed inputs ``[rows, H]`` of its rows not run yet.
        history: with several layers, every committed hidden state of the target (to rebuild the layers'
            rows when positions are taken back); None with one.
        record: a list each call appends its chain to, ``(position of the pending token, draft tokens)``,
            shared by forks (tests compare them with transformers'); None: nothing kept.
    """

    def __init__(self, layers: Sequence[MtpLayers], budget: int, record: Optional[list] = None):
        if not 1 <= budget <= MAX_DRAFT_DEPTH:
            raise BadInput(f"MTP drafting takes 1 to {MAX_DRAFT_DEPTH} tokens a step, not {budget}", option="draft_len")
        self.layers, self.budget, self.record = list(layers), budget, record
        self.caches = [layer.new_cache(256) for layer in self.layers]
        self.kept: List[List[torch.Tensor]] = [[] for _ in self.layers]
        self.history: Optional[List[torch.Tensor]] = [] if len(self.layers) > 1 else None
        self.held = 0  # positions whose hidden states were seen (run or kept)

    def fork(self) -> "MtpDrafter":
        """The same layers with empty KV caches of their own."""
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
            self.kept[0].append(hidden)
            if self.history is not None:
                self.history.append(hidden)
            self.held = n
            k = min(max_tokens, self.budget)
            if k <= 0:
                return DraftTree(pending)
            drafted = self._draft(list(context), n, k)
        if self.record is not None:
            self.record.append((n, drafted))
        return DraftTree.chain([pending] + drafted)

    def _draft(self, context: List[int], n: int, k: int) -> List[int]:
        """``k`` draft tokens after the pending token at position ``n``: each layer used runs its rows from
        its cache's length to n - 1 (those reading drafted tokens, or outputs that did, last), commits
        the ones whose inputs are committed and hands their carried outputs to the next layer."""
        self._reserve(n + k)
        drafted: List[int] = []
        used = min(k, len(self.layers))
        commits, draft_rows, g = [], None, None
        for i in range(used):
            layer, cache = self.layers[i], self.caches[i]
            first = cache.length
            kept = torch.cat(self.kept[i]) if self.kept[i] else draft_rows[:0]
            rows = kept if draft_rows is None else torch.cat((kept, draft_rows))
            if rows.shape[0] != n - first:
                raise ValueError(f"MTP layer {i} holds inputs of {rows.shape[0]} rows, not {n - first}: it missed "
                                 "a target pass")
            tokens = torch.tensor((context + drafted)[first + i + 1:n + i + 1], dtype=torch.long)
            g = layer.rows(rows.to(layer.eh_proj.dtype), tokens, torch.arange(first, n), cache)  # rows first..n-1
            cache.advance(n - first)
            normed = layer.normed(g)
            drafted.append(self._argmax(layer, normed[-1:]))
            valid = max(n - i - first, 0)  # rows first..n-1-i read committed tokens only
            commits.append(first + valid)
            self.kept[i] = [kept[valid:]] if kept.shape[0] > valid else []
            if i + 1 < len(self.layers):
                carried = layer.carried(g, normed)
                if valid:
                    self.kept[i + 1].append(carried[:valid])
                draft_rows = carried[valid:]
        layer, cache = self.layers[used - 1], self.caches[used - 1]
        g = g[-1:]
        while len(drafted) < k:  # past the last layer: the last layer again on its own output
            g = layer.rows(layer.carried(g, layer.normed(g)), torch.tensor([drafted[-1]]),
                           torch.tensor([cache.length]), cache)
            cache.advance(1)
            drafted.append(self._argmax(layer, layer.normed(g)))
        for cache, length in zip(self.caches, commits):
            cache.rollback(length)
        return drafted

    @staticmethod
    def _argmax(layer: MtpLayers, normed: torch.Tensor) -> int:
        return int(check_finite(layer.logits(normed), "the MTP layer")[0].argmax())

    def _committed(self, last: TargetStep) -> torch.Tensor:
        if last.rows is not None:
            return last.out.hidden_states[list(last.rows)]
        if last.out.prompt_hidden_states is None:
            raise ValueError("MTP drafting needs every prompt row's hidden states (the torch backend)")
        return last.out.prompt_hidden_states

    def _forget(self, start: int) -> None:
        """Forget positions from ``start`` on (their rows are recomputed when seen again). With several
        layers every layer's rows are rebuilt from the target's hidden states kept in :attr:`history`."""
        if self.history is not None:
            kept = torch.cat(self.history)[:start] if self.history else None
            for cache in self.caches:
                cache.rollback(0)
            self.kept = [[kept] if kept is not None and kept.shape[0] else []] + [[] for _ in self.layers[1:]]
            self.history = list(self.kept[0])
            self.held = start
            return
        cache = self.caches[0]
        kept_from = cache.length
        if start <= kept_from:
            cache.rollback(start)
            self.kept[0] = []
        else:
            rows = torch.cat(self.kept[0])[: start - kept_from]
            self.kept[0] = [rows] if rows.shape[0] else []
        self.held = start

    def _reserve(self, slots: int) -> None:
        for i, cache in enumerate(self.caches):
            if slots > cache.capacity:
                grown = self.layers[i].new_cache(max(slots, 2 * cache.capacity))
                grown.copy_committed(cache)
                self.caches[i] = grown


def mtp_drafter(session, budget: int, settings: Optional[MtpSettings] = None,
                record: Optional[list] = None) -> MtpDrafter:
    """The MTP drafter of ``session``'s target (its checkpoint's own layers, all of them), ``budget``
    tokens a step.

    Raises:
        BadInput: a backend without the torch model, a target without MTP layers, a budget out of range.
        UnsupportedModel: a family whose MTP layout is not read.
        CorruptModel: an MTP layer without the published layout.
    """
    if session.model is None:
        raise BadInput(f"MTP layers draft beside the torch backend's target, not {session.backend}", option="backend")
    settings = settings or MtpSettings()
    settings.check()
    return MtpDrafter(read_mtp_layers(session.model, session.folder, settings), budget, record)
