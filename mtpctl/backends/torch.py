"""The torch backend: mtpctl's own runtime on a checkpoint folder (:class:`TorchEngine` over the
:class:`~mtpctl.model.decoder.Decoder` and its position-indexed KV cache; :class:`TorchSession`)."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional, Sequence

import torch

from mtpctl.decode.attention import TAIL, attention_masks, attention_plan, slot_plan, tree_shape
from mtpctl.decode.session import Session
from mtpctl.decode.tree import DraftTree
from mtpctl.errors import UnsupportedModel
from mtpctl.model.decoder import DTYPES, Decoder
from mtpctl.model.linears import PackedLinear
from mtpctl.model.native import kernel_runs
from mtpctl.model.tokenizer import TextCodec
from mtpctl.model.weights import weights_hash

WEIGHTS = ("dense", "int4")


class TorchStepOutput:
    """One forward pass: hidden states of its N tokens and their logits, computed on demand.

    ``out[i]`` is row i's logits ``[vocab]`` (float32); ``out.logits`` all rows ``[N, vocab]``.
    With an int4 lm_head, rows are computed one at a time as they are read (an acceptor stops at the
    first rejection, and the int4 kernel's cost grows with the rows of a call); otherwise all rows are
    computed together at the first read (a dense lm_head reads its weights once for all N rows, far
    cheaper than N one-row calls).
    """

    head_logits = None  # MTP heads run in their drafter, not in the pass

    def __init__(self, model: Decoder, hidden_states: torch.Tensor, prompt_hidden_states: Optional[torch.Tensor] = None,
                 aux_hidden_states: Optional[Dict[int, torch.Tensor]] = None):
        self.model = model
        self.hidden_states = hidden_states  # [N, hidden], after the final norm
        self.prompt_hidden_states = prompt_hidden_states  # prefill: [T, hidden] every prompt row; else None
        # the engine's aux_layers: layer id -> [rows, hidden] residual stream of every row of the pass
        # (prefill: every prompt row), see Decoder.forward; None without aux_layers
        self.aux_hidden_states = aux_hidden_states
        self._rows: Dict[int, torch.Tensor] = {}
        self._all: Optional[torch.Tensor] = None

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

    @property
    def logits(self) -> torch.Tensor:
        """All rows' logits ``[N, vocab]`` float32."""
        if self._all is None:
            with torch.inference_mode():
                self._all = self.model.logits(self.hidden_states)
        return self._all


class TorchEngine:
    """Runs a :class:`Decoder` on one sequence (batch 1) with its own KV cache
    (:class:`mtpctl.decode.engine.Engine`).

    Args:
        model: the target decoder.
        capacity: KV cache slots (tokens) to allocate: prompt + new tokens + the largest draft.
        native: decode and verify passes attend with the native kernel (:mod:`mtpctl.model.native`)
            where it can be built and takes the model's attention shape (None, the default), always
            (True: ValueError where it cannot), or never (False: torch's ops,
            :func:`mtpctl.decode.attention.attention_plan`). Either way each token of a verify pass
            gets bit for bit what plain decoding gives it (the engine's ``native`` attribute says
            which runs).
        aux_layers: layer ids whose residual stream each pass's output also carries
            (``aux_hidden_states``, for EAGLE-3 drafters; see :meth:`Decoder.forward`).
    """

    def __init__(self, model: Decoder, capacity: int, native: Optional[bool] = None, aux_layers: Sequence[int] = ()):
        self.model = model
        self.aux_layers = tuple(aux_layers)
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
    def _forward(self, tree: DraftTree, prefill: bool) -> TorchStepOutput:
        if self.length + len(tree) > self.capacity:
            raise ValueError(f"KV cache overflow: {self.length + len(tree)} slots needed, {self.capacity} allocated")
        depth, tree_mask = tree_shape(tree)
        windows = self.model.cfg.layer_windows
        ids = torch.tensor([tree.tokens], dtype=torch.long)
        positions = (self.length + depth)[None]
        aux = dict.fromkeys(self.aux_layers) if self.aux_layers else None
        if prefill:  # prefill feeds plain and speculative decoding alike: it may use the fast kernel
            masks = attention_masks(windows, self.length, depth, tree_mask, self.capacity)
            hidden = self.model(ids, positions, self.cache, masks, aux=aux)[0]
            return TorchStepOutput(self.model, hidden[-1:], hidden, _first_row(aux))
        plan = slot_plan if self.native else attention_plan
        hidden = self.model(ids, positions, self.cache, None, plan(windows, self.length, depth, tree_mask), aux=aux)[0]
        return TorchStepOutput(self.model, hidden, aux_hidden_states=_first_row(aux))

    def prefill(self, prompt_ids: Sequence[int]) -> TorchStepOutput:
        """Reset the cache, run and commit the prompt; returns the last position's output (one row)."""
        self.cache.reset()
        out = self._forward(DraftTree.chain(prompt_ids), prefill=True)
        self.cache.advance(len(prompt_ids))
        return out

    def verify(self, tree: DraftTree) -> TorchStepOutput:
        """Score the tree's N nodes after the committed tokens; row i is the target's prediction for
        the token following node i. Nothing is committed."""
        return self._forward(tree, prefill=False)

    def commit(self, path: Sequence[int]) -> None:
        """Keep the KV of the verified nodes ``path`` (root first)."""
        self.cache.keep(path)

    def rollback(self, length: int) -> None:
        """Forget the committed tokens from ``length`` on."""
        self.cache.rollback(length)


def _first_row(aux: Optional[Dict[int, torch.Tensor]]) -> Optional[Dict[int, torch.Tensor]]:
    """The one sequence's ``[N, hidden]`` of each ``[1, N, hidden]`` aux layer output."""
    return None if aux is None else {layer: h[0] for layer, h in aux.items()}


class TorchSession(Session):
    """Target model + tokenizer of a checkpoint folder, on the torch backend.

    Args:
        folder: Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer files).
        dtype: ``"float32"`` (default) or ``"bfloat16"``: weights, activations and KV cache.
        weights: ``"dense"`` (default), or ``"int4"`` to keep 4-/8-bit group-quantized weights (GGUF
            Q4_1/Q8_0 imports) packed for the int4 CPU kernel (needs bfloat16; see
            :mod:`mtpctl.model.linears`).

    Raises:
        CorruptModel, UnsupportedModel: see :meth:`Decoder.from_folder` and :class:`TextCodec`.
    """

    backend = "torch"

    def __init__(self, folder: Path, dtype: str = "float32", weights: str = "dense"):
        if dtype not in DTYPES:
            raise UnsupportedModel(f"dtype {dtype!r} is not supported (choose from {', '.join(DTYPES)})", option="dtype")
        if weights not in WEIGHTS:
            raise UnsupportedModel(f"weights {weights!r} is not supported (choose from {', '.join(WEIGHTS)})",
                                   option="weights")
        super().__init__(folder, TextCodec(Path(folder)))
        self._target_hash: Optional[str] = None
        self.aux_layers: tuple = ()  # layer ids each pass also returns (set by an EAGLE-3 drafter's build)
        self.model = Decoder.from_folder(self.folder, DTYPES[dtype], packed=weights == "int4", blocked=True)
        if weights == "int4" and not self.model.packed_weights:
            raise UnsupportedModel(f"no weight of {self.folder} is 4-/8-bit group-quantized (GGUF Q4_1/Q8_0), "
                                   "so it has no int4 weights to keep: load its dense weights", option="weights")

    @property
    def context_length(self) -> int:
        return self.model.cfg.max_position_embeddings

    @property
    def vocab_size(self) -> int:
        return self.model.cfg.vocab_size

    @property
    def weight_bytes(self) -> int:
        return self.model.weight_bytes

    def new_engine(self, capacity: int) -> TorchEngine:
        return TorchEngine(self.model, capacity, aux_layers=self.aux_layers)

    @property
    def attention(self) -> str:
        """What decode and verify passes attend with: ``"native"`` (the C kernel,
        :mod:`mtpctl.model.native`) or ``"torch"`` (torch's ops: no compiler, a shape the kernel
        does not take, or ``MTPCTL_NATIVE_ATTENTION=0``). Greedy output can differ between the two at
        near-ties; each is reproduced exactly by speculation."""
        cfg = self.model.cfg
        return "native" if kernel_runs(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) else "torch"

    @property
    def int4_kernel(self) -> Optional[str]:
        """What the packed 4-/8-bit weights run on (int4 weights): ``"native"`` when all of them run
        on ``csrc/int4_matmul.c``, ``"torch"`` when any runs on torch's int4 kernel (no compiler,
        ``MTPCTL_NATIVE_ATTENTION=0``, or a weight whose rows are not a multiple of 4); None for dense
        weights."""
        packed = [m for m in self.model.modules() if isinstance(m, PackedLinear)]
        if not packed:
            return None
        return "native" if all(m.native for m in packed) else "torch"

    @property
    def mode(self) -> str:
        """``float32``, ``bfloat16`` or ``int4``: what a decode step costs depends on it."""
        return "int4" if self.model.packed_weights else ("bfloat16" if self.model.dtype == torch.bfloat16 else "float32")

    def target_hash(self) -> str:
        """sha256 of the target's safetensors files (see :func:`mtpctl.model.weights.weights_hash`)."""
        if self._target_hash is None:
            self._target_hash = weights_hash(self.folder)
        return self._target_hash


def set_threads(threads: Optional[int]) -> None:
    """Use ``threads`` CPU threads for torch ops (None keeps torch's default)."""
    if threads:
        torch.set_num_threads(threads)
