"""A loaded target and its tokenizer, ready to generate: the one ``generate`` path every backend's
session goes through (the request's checks, the KV cache sized for it, the loop)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Sequence

from mtpctl.decode.drafter import Drafter
from mtpctl.decode.engine import Engine
from mtpctl.decode.loop import GenerationResult, generate
from mtpctl.decode.sampling import SamplingParams
from mtpctl.decode.stopping import StopChecker
from mtpctl.errors import BadInput
from mtpctl.model.tokenizer import TextCodec

ACCEPTANCE = ("exact", "typical")


class Session:
    """Target + tokenizer; each backend (:mod:`mtpctl.backends`) subclasses it with its engine.

    Attributes:
        backend: the backend's name (``torch``, ``onnxruntime``, ``tensorrt``).
        folder: the checkpoint or export folder.
        codec: the tokenizer and chat template.
    """

    backend = ""

    def __init__(self, folder: Path, codec: TextCodec):
        self.folder = Path(folder)
        self.codec = codec

    @property
    def context_length(self) -> int:
        """The most tokens (prompt + output) the model can attend to."""
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        """Rows of the model's lm_head: every token id it can produce is below this."""
        raise NotImplementedError

    @property
    def weight_bytes(self) -> int:
        """Memory of the target's weights, bytes."""
        raise NotImplementedError

    def new_engine(self, capacity: int) -> Engine:
        """An engine with room for ``capacity`` tokens."""
        raise NotImplementedError

    def check_request(self, capacity: int, budget: int) -> None:
        """Raise BadInput where the backend cannot take a generation of ``capacity`` tokens whose
        drafter proposes up to ``budget`` tokens a step (beyond what the context allows: e.g. a
        TensorRT engine's build limits). Nothing to check by default."""

    def encode(self, prompt: str, chat: bool = True) -> list:
        """Prompt text -> ids (chat template applied when ``chat`` and the model has one)."""
        return self.codec.encode_prompt(prompt, chat)

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
                 drafter: Optional[Drafter] = None, stop_strings: Sequence[str] = (),
                 on_text: Optional[Callable[[str], None]] = None, acceptance: str = "exact") -> GenerationResult:
        """Generate up to ``max_new_tokens`` after ``prompt_ids``; see :func:`mtpctl.decode.loop.generate`.

        Raises:
            BadInput: ``max_new_tokens`` < 1, a prompt that does not fit the model's context, an
                unknown acceptance rule, or a request beyond the backend's limits.
        """
        budget = drafter.budget if drafter is not None else 0
        capacity = generation_capacity(len(prompt_ids), max_new_tokens, budget, self.context_length, acceptance)
        self.check_request(capacity, budget)
        engine = self.new_engine(capacity)
        stop = StopChecker(self.codec.eos_ids, stop_strings, max_new_tokens, self.codec.decode)
        return generate(engine, prompt_ids, stop, sampling, drafter, on_text, acceptance)


def generation_capacity(prompt_tokens: int, max_new_tokens: int, budget: int, context_length: int,
                        acceptance: str = "exact") -> int:
    """KV cache slots one generation needs (prompt + output + the largest draft + 1, at most the
    model's context), after checking the request.

    Raises:
        BadInput: an unknown acceptance rule, ``max_new_tokens`` < 1, or a prompt that fills the context.
    """
    if acceptance not in ACCEPTANCE:
        raise BadInput(f"acceptance {acceptance!r}: choose exact or typical", option="acceptance")
    if max_new_tokens < 1:
        raise BadInput(f"max new tokens must be at least 1, got {max_new_tokens}", option="max_new_tokens")
    if prompt_tokens >= context_length:
        raise BadInput(f"the prompt has {prompt_tokens} tokens; the model's context holds "
                       f"{context_length} (prompt and output together)")
    return min(context_length, prompt_tokens + max_new_tokens + budget + 1)
