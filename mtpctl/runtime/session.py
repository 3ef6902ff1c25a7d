"""A loaded target model and its tokenizer, ready to generate text: what the CLI, benchmarks and
library users call."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from mtpctl.errors import BadInput, UnsupportedModel
from mtpctl.runtime.drafters import Drafter
from mtpctl.runtime.engine import MAX_DRAFT_DEPTH, TorchEngine
from mtpctl.model.native import kernel_runs
from mtpctl.decode.loop import GenerationResult, generate
from mtpctl.runtime.eagle import EagleDrafter
from mtpctl.runtime.heads import (
    HeadsConfig,
    MedusaDrafter,
    StaticTree,
    check_heads_match,
    load_heads,
    tree_from_accuracy,
)
from mtpctl.model.decoder import DTYPES, Decoder
from mtpctl.model.linears import PackedLinear
from mtpctl.decode.sampling import SamplingParams
from mtpctl.decode.stopping import StopChecker
from mtpctl.model.tokenizer import TextCodec
from mtpctl.model.weights import weights_hash

WEIGHTS = ("dense", "int4")
#: draft tree size (nodes) per mode when neither --tree nor --tree-nodes is given. Measured with the
#: recipe's heads (BENCHMARKS.md, eighth session): 4 nodes beat 8 in float32 (1.67x vs 1.55x plain)
#: and dense bfloat16 (1.59x vs 1.54x); in int4, whose kernel pays for every row, 2 nodes beat 3 and 4
#: (1.04x, 1.01x, 0.83x).
DEFAULT_TREE_NODES = {"float32": 4, "bfloat16": 4, "int4": 2}


class Session:
    """Target model + tokenizer of a checkpoint folder.

    Args:
        folder: Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer files).
        dtype: ``"float32"`` (default) or ``"bfloat16"``: weights, activations and KV cache.
        weights: ``"dense"`` (default), or ``"int4"`` to keep 4-/8-bit group-quantized weights (GGUF
            Q4_1/Q8_0 imports) packed for the int4 CPU kernel (needs bfloat16; see
            :mod:`mtpctl.model.linears`).

    Raises:
        CorruptModel, UnsupportedModel: see :meth:`Decoder.from_folder` and :class:`TextCodec`.
    """

    def __init__(self, folder: Path, dtype: str = "float32", weights: str = "dense"):
        if dtype not in DTYPES:
            raise UnsupportedModel(f"dtype {dtype!r} is not supported (choose from {', '.join(DTYPES)})")
        if weights not in WEIGHTS:
            raise UnsupportedModel(f"weights {weights!r} is not supported (choose from {', '.join(WEIGHTS)})")
        self.folder = Path(folder)
        self._target_hash: Optional[str] = None
        self.codec = TextCodec(self.folder)
        self.model = Decoder.from_folder(self.folder, DTYPES[dtype], packed=weights == "int4", blocked=True)
        if weights == "int4" and not self.model.packed_weights:
            raise UnsupportedModel(f"no weight of {self.folder} is 4-/8-bit group-quantized (GGUF Q4_1/Q8_0): "
                                   "use --weights dense")

    @property
    def context_length(self) -> int:
        """The most tokens (prompt + output) the model can attend to."""
        return self.model.cfg.max_position_embeddings

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
        """What the packed 4-/8-bit weights run on (``--weights int4``): ``"native"`` when all of them
        run on ``csrc/int4_matmul.c``, ``"torch"`` when any runs on torch's int4 kernel (no compiler,
        ``MTPCTL_NATIVE_ATTENTION=0``, or a weight whose rows are not a multiple of 4); None for dense
        weights."""
        packed = [m for m in self.model.modules() if isinstance(m, PackedLinear)]
        if not packed:
            return None
        return "native" if all(m.native for m in packed) else "torch"

    @property
    def vocab_size(self) -> int:
        """Rows of the model's lm_head: every token id it can produce is below this."""
        return self.model.cfg.vocab_size

    def encode(self, prompt: str, chat: bool = True) -> list:
        """Prompt text -> ids (chat template applied when ``chat`` and the model has one)."""
        return self.codec.encode_prompt(prompt, chat)

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingParams,
                 drafter: Optional[Drafter] = None, draft_len: int = 0, stop_strings: Sequence[str] = (),
                 on_text: Optional[Callable[[str], None]] = None, heads: Optional[torch.nn.Module] = None,
                 acceptance: str = "exact") -> GenerationResult:
        """Generate up to ``max_new_tokens`` after ``prompt_ids``; see :func:`mtpctl.decode.loop.generate`.
        ``heads`` (from :meth:`load_heads`) run with every verify pass, for a :class:`MedusaDrafter`
        (an :class:`~mtpctl.runtime.eagle.EagleDrafter` holds its head itself).

        Raises:
            BadInput: ``max_new_tokens`` < 1, or the prompt does not fit the model's context.
        """
        capacity = generation_capacity(len(prompt_ids), max_new_tokens, draft_len, self.context_length, acceptance)
        engine = TorchEngine(self.model, capacity, heads)
        stop = StopChecker(self.codec.eos_ids, stop_strings, max_new_tokens, self.codec.decode)
        return generate(engine, prompt_ids, stop, sampling, drafter, draft_len, on_text, acceptance)

    def target_hash(self) -> str:
        """sha256 of the target's safetensors files (see :func:`mtpctl.model.weights.weights_hash`)."""
        if self._target_hash is None:
            self._target_hash = weights_hash(self.folder)
        return self._target_hash

    def load_heads(self, folder: Path) -> torch.nn.Module:
        """MTP heads of any kind (:func:`mtpctl.runtime.heads.load_heads`) from a head folder, in this
        session's dtype, checked against this target.

        Raises:
            BadInput: not a head folder, or heads made for another model (sizes or weight hash).
            CorruptModel, UnsupportedModel: see :func:`mtpctl.runtime.heads.load_heads`.
        """
        cfg = HeadsConfig.load(folder)
        check_heads_match(cfg, self.model.cfg.hidden_size, self.model.cfg.vocab_size, self.target_hash())
        return load_heads(folder, self.model.dtype, self.model.dense_lm_head(), blocked=True)

    def heads_drafter(self, heads: torch.nn.Module, tree: Optional[StaticTree] = None,
                      tree_nodes: Optional[int] = None) -> Drafter:
        """A drafter over ``tree``; else a tree of ``tree_nodes`` grown from the heads' held-out
        accuracy; else the default size for this dtype and weights (:data:`DEFAULT_TREE_NODES`).

        Raises:
            BadInput: a tree deeper than the heads or than verification supports, a rank past the
                heads' candidates, or a size < 1.
        """
        cfg = heads.cfg
        if tree is None:
            nodes = tree_nodes or DEFAULT_TREE_NODES[self.mode]
            tree = tree_from_accuracy(cfg.topk_accuracy, nodes) if cfg.topk_accuracy else \
                StaticTree.from_paths(cfg.tree or [[0]], cfg.num_heads)
        elif tree.depth > cfg.num_heads:
            raise BadInput(f"the draft tree is {tree.depth} deep; the heads predict {cfg.num_heads} tokens")
        if tree.depth > MAX_DRAFT_DEPTH:
            raise BadInput(f"the draft tree is {tree.depth} deep; verification supports trees up to {MAX_DRAFT_DEPTH}")
        candidates = cfg.draft_vocab_size or cfg.vocab_size
        if tree.max_rank > candidates:
            raise BadInput(f"the draft tree asks for rank {tree.max_rank - 1}; the heads rank {candidates} candidates")
        if cfg.kind == "eagle":
            dtype = self.model.dtype
            return EagleDrafter(heads, tree, lambda ids: self.model.embed[ids].to(dtype), self.model.logits)
        return MedusaDrafter(tree, sequential=heads.sequential)

    @property
    def mode(self) -> str:
        """``float32``, ``bfloat16`` or ``int4``: what a decode step costs depends on it."""
        return "int4" if self.model.packed_weights else ("bfloat16" if self.model.dtype == torch.bfloat16 else "float32")


def generation_capacity(prompt_tokens: int, max_new_tokens: int, draft_len: int, context_length: int,
                        acceptance: str = "exact") -> int:
    """KV cache slots one generation needs (prompt + output + the largest draft + 1, at most the
    model's context), after checking the request.

    Raises:
        BadInput: an unknown acceptance rule, ``max_new_tokens`` < 1, or a prompt that fills the context.
    """
    if acceptance not in ("exact", "typical"):
        raise BadInput(f"acceptance {acceptance!r}: choose exact or typical")
    if max_new_tokens < 1:
        raise BadInput(f"max new tokens must be at least 1, got {max_new_tokens}")
    if prompt_tokens >= context_length:
        raise BadInput(f"the prompt has {prompt_tokens} tokens; the model's context holds "
                       f"{context_length} (prompt and output together)")
    return min(context_length, prompt_tokens + max_new_tokens + draft_len + 1)


def set_threads(threads: Optional[int]) -> None:
    """Use ``threads`` CPU threads for torch ops (None keeps torch's default)."""
    if threads:
        torch.set_num_threads(threads)
