"""The library's front door: load a model (or an export) with a drafter, and generate.

    import mtpctl

    llm = mtpctl.load("smollm2-135m", dtype="bfloat16", speculate="heads+ngram", heads="heads/smollm2-medusa")
    result = llm.generate("What is a KV cache?", max_new_tokens=64)
    print(result.text, result.stats.tau)

Everything here is a thin layer over :func:`mtpctl.drafters.pipeline.assemble` (the one builder the
CLI and the benchmarks use too, with the same defaults: :data:`mtpctl.drafters.pipeline.DEFAULTS`)
and :meth:`mtpctl.decode.session.Session.generate`, which stay available for finer control.
"""

from __future__ import annotations

import operator
from typing import Callable, List, Optional, Sequence, Union

from mtpctl.decode.drafter import Drafter
from mtpctl.decode.loop import GenerationResult, Outcome
from mtpctl.decode.sampling import SamplingParams
from mtpctl.decode.session import GenerationRequest, Session
from mtpctl.drafters.build import DraftOptions
from mtpctl.drafters.pipeline import DEFAULTS, Pipeline, PipelineSpec, assemble
from mtpctl.errors import BadInput

Prompt = Union[str, List[dict], Sequence[int]]
_SAMPLING = SamplingParams()  # the sampling defaults


class LLM:
    """A loaded pipeline (:class:`~mtpctl.drafters.pipeline.Pipeline`): the target (``session``), the
    drafter it speculates with (``drafter``, None: plain decoding) and its speculation policy."""

    def __init__(self, pipeline: Pipeline):
        self.pipeline = pipeline

    @property
    def session(self) -> Session:
        return self.pipeline.session

    @property
    def drafter(self) -> Optional[Drafter]:
        return self.pipeline.drafter

    @property
    def speculate(self) -> str:
        """The drafter spec in merge order, ``none`` for plain decoding."""
        return self.pipeline.speculate

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
            if any(isinstance(i, bool) for i in items):
                raise TypeError("True and False are not token ids")
            ids = [operator.index(i) for i in items]
        except TypeError as err:
            raise BadInput(f"a prompt of token ids must hold integers ({err})") from err
        if not ids:
            raise BadInput("the prompt is empty")
        if not all(0 <= i < self.session.vocab_size for i in ids):
            raise BadInput(f"a prompt's token ids must be from 0 to {self.session.vocab_size - 1}")
        return ids

    def generate(self, prompt: Prompt, max_new_tokens: int = 256, temperature: float = _SAMPLING.temperature,
                 top_k: int = _SAMPLING.top_k, top_p: float = _SAMPLING.top_p, seed: Optional[int] = _SAMPLING.seed,
                 stop: Sequence[str] = (), chat: bool = True, on_text: Optional[Callable[[str], None]] = None,
                 acceptance: Optional[str] = None) -> GenerationResult:
        """Generate after ``prompt`` (see :meth:`encode`): text, token ids, finish reason and statistics,
        drafting under the speculation policy :func:`load` was given (by default ``auto``, as ``mtpctl
        generate``), with its acceptance rule unless ``acceptance`` names another. Greedy
        (``temperature`` 0) output is plain greedy decoding's, token for token, whatever the drafter;
        sampled output follows the model's distribution.

        Raises:
            BadInput: an empty prompt, one that does not fit the context, or bad settings.
        """
        try:
            sampling = SamplingParams(temperature, top_k, top_p, seed)
        except ValueError as err:
            raise BadInput(str(err)) from err
        return self.pipeline.generate(self.encode(prompt, chat), max_new_tokens, sampling, stop, on_text, acceptance)

    def generate_batch(self, requests: Sequence[GenerationRequest], max_batch: int = 8,
                       on_done: Optional[Callable[[int, Outcome], None]] = None) -> List[Outcome]:
        """Every request (prompt ids and its own settings), up to ``max_batch`` at once, as ``mtpctl
        generate --batch-file`` decodes them: each with its own fork of the drafter, under one fresh
        policy of :func:`load`'s (see :meth:`mtpctl.decode.session.Session.generate_batch`).

        Returns:
            one outcome per request, in input order: its result or the error that ended it alone.
        """
        return self.pipeline.generate_batch(requests, max_batch, on_done)


def load(model: str = DEFAULTS.model, speculate: str = DEFAULTS.speculate, heads: Optional[str] = None,
         backend: str = DEFAULTS.backend, dtype: str = DEFAULTS.dtype, weights: str = DEFAULTS.weights,
         threads: Optional[int] = DEFAULTS.threads, device: str = DEFAULTS.device, kernels: str = DEFAULTS.kernels,
         sampling: SamplingParams = _SAMPLING, speculate_policy: str = DEFAULTS.speculate_policy,
         acceptance: str = DEFAULTS.acceptance, cuda_graphs: bool = DEFAULTS.cuda_graphs, **drafter_settings) -> LLM:
    """Load ``model`` (an alias, checkpoint folder, .gguf file or hub id; an ``mtpctl export`` folder
    for the ``onnxruntime`` and ``tensorrt`` backends) and the drafter ``speculate`` names
    (``none``, ``ngram``, ``heads``, ``retrieval``, ``suffix``, ``draft``, ``lookahead``, or several joined by
    ``+``),
    as ``mtpctl generate`` does with the same settings (:func:`mtpctl.drafters.pipeline.assemble`).

    Args:
        heads: an MTP head folder (``mtpctl add-heads``) for the heads and retrieval drafters.
        device: ``auto`` (a CUDA GPU when torch sees one), ``cpu``, ``cuda`` or ``cuda:N``.
        kernels: ``auto`` (native on the CPU, torch elsewhere), ``native`` or ``torch`` (the pure-torch
            path; see :mod:`mtpctl.model.device`).
        sampling: the settings a draft model samples with (the target's, when generating sampled).
        speculate_policy: ``auto`` (a request drafts while its drafts are expected to pay, by the
            measured pass costs) or ``always`` (the drafter's whole budget every step).
        acceptance: ``exact`` (lossless) or ``typical`` (Medusa's typical acceptance when sampling).
        cuda_graphs: replay plain decode steps as CUDA graphs (``device="cuda"``, a dense model).
        drafter_settings: the other drafter settings, by their :class:`~mtpctl.drafters.build.DraftOptions`
            names (``tree_nodes``, ``draft_len``, ``draft_model`` (``"self"`` or ``"self:0-11,20-29"``: the
            target's own layers), ``datastore``, ``lookahead`` (``(W, N, G)``), ...).

    Raises:
        BadInput, ModelNotFound, CorruptModel, UnsupportedModel: the model, heads or settings are unusable.
    """
    spec = PipelineSpec(model, backend, dtype, weights, threads, device, kernels, speculate,
                        DraftOptions(heads_dir=heads, **drafter_settings), speculate_policy, acceptance, cuda_graphs)
    return LLM(assemble(spec, sampling))
