"""A loaded target model and its tokenizer, ready to generate text: what the CLI, benchmarks and
library users call."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from mtpctl.errors import BadInput, UnsupportedModel
from mtpctl.runtime.drafters import Drafter
from mtpctl.runtime.engine import TorchEngine
from mtpctl.runtime.generate import GenerationResult, generate
from mtpctl.runtime.model import DTYPES, Decoder
from mtpctl.runtime.sampling import SamplingParams
from mtpctl.runtime.stopping import StopChecker
from mtpctl.runtime.tokenizer import TextCodec

WEIGHTS = ("dense", "int4")


class Session:
    """Target model + tokenizer of a checkpoint folder.

    Args:
        folder: Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer files).
        dtype: ``"float32"`` (default) or ``"bfloat16"``: weights, activations and KV cache.
        weights: ``"dense"`` (default), or ``"int4"`` to keep 4-/8-bit group-quantized weights (GGUF
            Q4_1/Q8_0 imports) packed for the int4 CPU kernel (needs bfloat16; see
            :mod:`mtpctl.runtime.quant`).

    Raises:
        CorruptModel, UnsupportedModel: see :meth:`Decoder.from_folder` and :class:`TextCodec`.
    """

    def __init__(self, folder: Path, dtype: str = "float32", weights: str = "dense"):
        if dtype not in DTYPES:
            raise UnsupportedModel(f"dtype {dtype!r} is not supported (choose from {', '.join(DTYPES)})")
        if weights not in WEIGHTS:
            raise UnsupportedModel(f"weights {weights!r} is not supported (choose from {', '.join(WEIGHTS)})")
        self.folder = Path(folder)
        self.codec = TextCodec(self.folder)
        self.model = Decoder.from_folder(self.folder, DTYPES[dtype], packed=weights == "int4")
        if weights == "int4" and not self.model.packed_weights:
            raise UnsupportedModel(f"no weight of {self.folder} is 4-/8-bit group-quantized (GGUF Q4_1/Q8_0): "
                                   "use --weights dense")

    @property
    def context_length(self) -> int:
        """The most tokens (prompt + output) the model can attend to."""
        return self.model.cfg.max_position_embeddings

    def encode(self, prompt: str, chat: bool = True) -> list:
        """Prompt text -> ids (chat template applied when ``chat`` and the model has one)."""
        return self.codec.encode_prompt(prompt, chat)

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingParams,
                 drafter: Optional[Drafter] = None, draft_len: int = 0, stop_strings: Sequence[str] = (),
                 on_text: Optional[Callable[[str], None]] = None) -> GenerationResult:
        """Generate up to ``max_new_tokens`` after ``prompt_ids``; see :func:`mtpctl.runtime.generate.generate`.

        Raises:
            BadInput: ``max_new_tokens`` < 1, or the prompt does not fit the model's context.
        """
        if max_new_tokens < 1:
            raise BadInput(f"max new tokens must be at least 1, got {max_new_tokens}")
        if len(prompt_ids) >= self.context_length:
            raise BadInput(f"the prompt has {len(prompt_ids)} tokens; the model's context holds "
                           f"{self.context_length} (prompt and output together)")
        capacity = min(self.context_length, len(prompt_ids) + max_new_tokens + draft_len + 1)
        engine = TorchEngine(self.model, capacity)
        stop = StopChecker(self.codec.eos_ids, stop_strings, max_new_tokens, self.codec.decode)
        return generate(engine, prompt_ids, stop, sampling, drafter, draft_len, on_text)


def set_threads(threads: Optional[int]) -> None:
    """Use ``threads`` CPU threads for torch ops (None keeps torch's default)."""
    if threads:
        torch.set_num_threads(threads)
