"""The library's front door: load a model (or an export) with a drafter, and generate.

    import mtpctl

    llm = mtpctl.load("smollm2-135m", dtype="bfloat16", speculate="heads+ngram", heads="heads/smollm2-medusa")
    result = llm.generate("What is a KV cache?", max_new_tokens=64)
    print(result.text, result.stats.tau)

Everything here is a thin layer over :func:`mtpctl.backends.open_session`,
:func:`mtpctl.drafters.build.build` and :meth:`mtpctl.decode.session.Session.generate`, which stay
available for finer control.
"""

from __future__ import annotations

import operator
from typing import Callable, List, Optional, Sequence, Union

from mtpctl.backends import open_session
from mtpctl.backends.torch import set_threads
from mtpctl.decode.drafter import Drafter
from mtpctl.decode.loop import GenerationResult
from mtpctl.decode.sampling import SamplingParams
from mtpctl.decode.session import Session
from mtpctl.drafters.build import DraftOptions, build, check, parse
from mtpctl.errors import BadInput
from mtpctl.model.sources import DEFAULT_MODEL

Prompt = Union[str, List[dict], Sequence[int]]


class LLM:
    """A loaded target (``session``) and the drafter it speculates with (None: plain decoding)."""

    def __init__(self, session: Session, drafter: Optional[Drafter] = None, speculate: str = "none"):
        self.session, self.drafter, self.speculate = session, drafter, speculate

    def encode(self, prompt: Prompt, chat: bool = True) -> List[int]:
        """Prompt ids of a text (chat template applied when ``chat``), a conversation
        (``[{"role": ..., "content": ...}]``) or ids given as they are.

        Raises:
            BadInput: a text or a message's role or content that is not valid Unicode (a lone
                surrogate), an empty prompt, or a prompt of none of these kinds (ids outside the
                model's vocabulary included).
        """
        if isinstance(prompt, str):
            return self.session.encode(prompt, chat)
        if not hasattr(prompt, "__iter__"):
            raise BadInput("a prompt is a string, a list of messages or a list of token ids, "
                           f"got {type(prompt).__name__}")
        items = list(prompt)
        if items and isinstance(items[0], dict):
            return self.session.codec.encode_messages(items)
        try:
            ids = [operator.index(i) for i in items]
        except TypeError as err:
            raise BadInput(f"a prompt of token ids must hold integers ({err})") from err
        if not ids:
            raise BadInput("the prompt is empty")
        if not all(0 <= i < self.session.vocab_size for i in ids):
            raise BadInput(f"a prompt's token ids must be from 0 to {self.session.vocab_size - 1}")
        return ids

    def generate(self, prompt: Prompt, max_new_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: Optional[int] = None, stop: Sequence[str] = (), chat: bool = True,
                 on_text: Optional[Callable[[str], None]] = None, acceptance: str = "exact") -> GenerationResult:
        """Generate after ``prompt`` (see :meth:`encode`): text, token ids, finish reason and statistics.
        Greedy (``temperature`` 0) output is plain greedy decoding's, token for token, whatever the
        drafter; sampled output follows the model's distribution.

        Raises:
            BadInput: an empty prompt, one that does not fit the context, or bad settings.
        """
        sampling = SamplingParams(temperature, top_k, top_p, seed)
        return self.session.generate(self.encode(prompt, chat), max_new_tokens, sampling, self.drafter, stop, on_text,
                                     acceptance)


def load(model: str = DEFAULT_MODEL, speculate: str = "none", heads: Optional[str] = None, backend: str = "torch",
         dtype: str = "float32", weights: str = "dense", threads: Optional[int] = None, device: str = "auto",
         kernels: str = "auto", sampling: SamplingParams = SamplingParams(), **drafter_settings) -> LLM:
    """Load ``model`` (an alias, checkpoint folder, .gguf file or hub id; an ``mtpctl export`` folder
    for the ``onnxruntime`` and ``tensorrt`` backends) and the drafter ``speculate`` names
    (``none``, ``ngram``, ``heads``, ``retrieval``, ``draft``, ``lookahead``, or several joined by ``+``).

    Args:
        heads: an MTP head folder (``mtpctl add-heads``) for the heads and retrieval drafters.
        device: ``auto`` (a CUDA GPU when torch sees one), ``cpu``, ``cuda`` or ``cuda:N``.
        kernels: ``auto`` (native on the CPU, torch elsewhere), ``native`` or ``torch`` (the pure-torch
            path; see :mod:`mtpctl.model.device`).
        sampling: the settings a draft model samples with (the target's, when generating sampled).
        drafter_settings: the other drafter settings, by their :class:`~mtpctl.drafters.build.DraftOptions`
            names (``tree_nodes``, ``draft_len``, ``draft_model`` (``"self"`` or ``"self:0-11,20-29"``: the
            target's own layers), ``datastore``, ``lookahead`` (``(W, N, G)``), ...).

    Raises:
        BadInput, ModelNotFound, CorruptModel, UnsupportedModel: the model, heads or settings are unusable.
    """
    parts = parse(speculate)
    opts = DraftOptions(heads_dir=heads, **drafter_settings)
    check(parts, opts)
    set_threads(threads)
    session = open_session(model, backend, dtype, weights, threads, device, kernels)
    return LLM(session, build(session, parts, opts, sampling), "+".join(parts) or "none")
