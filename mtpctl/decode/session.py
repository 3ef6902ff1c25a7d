"""A loaded target and its tokenizer, ready to generate: the one ``generate`` path every backend's
session goes through (the request's checks, the KV cache sized for it, the loop)."""

from __future__ import annotations

from pathlib import Path
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, List, Optional, Sequence

from mtpctl.decode.drafter import Drafter, aux_layers_of
from mtpctl.decode.engine import Engine, StepOutput
from mtpctl.decode.loop import GenerationResult, Outcome, Request, generate, run
from mtpctl.decode.policy import Policy
from mtpctl.decode.sampling import SamplingParams
from mtpctl.decode.stopping import StopChecker
from mtpctl.decode.tree import DraftTree
from mtpctl.errors import BadInput, MtpctlError
from mtpctl.model.tokenizer import TextCodec

if TYPE_CHECKING:
    from mtpctl.model.decoder import Decoder

ACCEPTANCE = ("exact", "typical")


class Session:
    """Target + tokenizer; each backend (:mod:`mtpctl.backends`) subclasses it with its engine.

    Attributes:
        backend: the backend's name (``torch``, ``onnxruntime``, ``tensorrt``).
        folder: the checkpoint or export folder.
        codec: the tokenizer and chat template.
        model: the target's torch :class:`~mtpctl.model.decoder.Decoder` where the backend runs one
            (torch: drafters that run beside it, MTP heads, a draft model, a self-draft, read its
            embedding, lm_head and layers); None where the target is an exported graph.
        extra_rows: whether a verify pass takes rows beyond the draft tree's nodes (a tree's
            ``extra``: lookahead decoding's window); an exported graph verifies tree nodes only.

    What a backend may lack is declared here with its default (:attr:`mode`, :attr:`policy_mode`,
    :attr:`fused_heads`, :attr:`torch_device`), so that callers read it without probing the session's type.
    """

    backend = ""
    model: Optional["Decoder"] = None
    extra_rows: bool = False

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

    @property
    def mode(self) -> str:
        """``float32``, ``bfloat16`` or ``int4``: the target's numeric mode (what a decode step costs
        depends on it; the heads' default tree size follows it). ``float32`` by default (an exported
        graph computes in float32)."""
        return "float32"

    @property
    def policy_mode(self) -> Optional[str]:
        """The mode whose measured pass costs the auto speculation policy reads
        (:func:`mtpctl.decode.policy.make_policy`), or None (the default) where those tables do not
        describe the passes: a backend that verifies one request per pass, where every request
        drafts its whole budget."""
        return None

    @property
    def fused_heads(self) -> Optional[dict]:
        """What the backend records of MTP heads fused into its passes (an exported graph's manifest
        entry: kind, count, tree, weights' sha256), or None (the default: no heads in the pass)."""
        return None

    @property
    def torch_device(self) -> Optional[str]:
        """The torch device the target's passes queue their work on and allocate from (``cpu``,
        ``cuda:0``), or None (the default) where the target is an exported graph, whose outputs come back
        finished and whose memory torch does not allocate (what ``mtpctl bench`` synchronizes and measures,
        :func:`mtpctl.model.device.measured`)."""
        return None

    def new_engine(self, capacity: int, aux_layers: Sequence[int] = ()) -> Engine:
        """An engine with room for ``capacity`` tokens whose passes also return the residual streams of
        ``aux_layers`` (what the drafter reads: :func:`mtpctl.decode.drafter.aux_layers_of`).

        Raises:
            UnsupportedModel: aux layers a backend cannot return.
        """
        raise NotImplementedError

    def check_request(self, capacity: int, budget: int) -> None:
        """Raise BadInput where the backend cannot take a generation of ``capacity`` tokens whose
        drafter proposes up to ``budget`` tokens a step (beyond what the context allows: e.g. a
        TensorRT engine's build limits). Nothing to check by default."""

    def encode(self, prompt: str, chat: bool = True, parse_special: bool = False) -> list:
        """Prompt text -> ids (chat template applied when ``chat`` and the model has one; control-token
        strings in the text stay text unless ``parse_special``, see
        :meth:`~mtpctl.model.tokenizer.TextCodec.encode_prompt`)."""
        return self.codec.encode_prompt(prompt, chat, parse_special)

    def verify_together(self, engines: Sequence[Engine], trees: Sequence[DraftTree]) -> List[StepOutput]:
        """One step of several requests: each engine's draft tree verified, nothing committed. By
        default one pass per engine; backends that pack several sequences into one pass (torch)
        override it."""
        return [engine.verify(tree) for engine, tree in zip(engines, trees)]

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
                 drafter: Optional[Drafter] = None, stop_strings: Sequence[str] = (),
                 on_text: Optional[Callable[[str], None]] = None, acceptance: str = "exact",
                 policy: Optional[Policy] = None) -> GenerationResult:
        """Generate up to ``max_new_tokens`` after ``prompt_ids``; see :func:`mtpctl.decode.loop.generate`
        (``policy``: how much to draft each step, default all the drafter's budget).

        Raises:
            BadInput: ``max_new_tokens`` < 1, a prompt that does not fit the model's context, an
                unknown acceptance rule, or a request beyond the backend's limits.
            NonFinite: a NaN or inf in the target's or the drafter's logits.
        """
        budget = drafter.budget if drafter is not None else 0
        capacity = generation_capacity(len(prompt_ids), max_new_tokens, budget, self.context_length, acceptance)
        self.check_request(capacity, budget)
        engine = self.new_engine(capacity, aux_layers_of(drafter))
        stop = StopChecker(self.codec.eos_ids, stop_strings, max_new_tokens, self.codec.decode)
        return generate(engine, prompt_ids, stop, sampling, drafter, on_text, acceptance, policy)

    def generate_batch(self, requests: Sequence[GenerationRequest], drafter: Optional[Drafter] = None,
                       max_batch: int = 8, policy: Optional[Policy] = None, acceptance: str = "exact",
                       on_done: Optional[Callable[[int, Outcome], None]] = None) -> List[Outcome]:
        """Generate every request, up to ``max_batch`` at once (continuous batching), each speculating
        with its own fork of ``drafter`` (:meth:`~mtpctl.decode.drafter.Drafter.fork`); see
        :func:`mtpctl.decode.loop.run`. Each request's KV cache holds its prompt, its output and its
        largest draft, not the model's whole context. ``on_done(index, outcome)`` is called as each
        admitted request finishes (progress).

        Returns:
            one outcome per request, in input order: a :class:`GenerationResult`, or the
            :class:`~mtpctl.errors.MtpctlError` that refused or ended that request alone (a prompt
            that does not fit the context, a NaN in its logits, ...).

        Raises:
            BadInput: ``max_batch`` < 1 or an unknown acceptance rule.
        """
        if max_batch < 1:
            raise BadInput(f"the batch must hold at least 1 request, got {max_batch}", option="max_batch")
        if acceptance not in ACCEPTANCE:
            raise BadInput(f"acceptance {acceptance!r}: choose exact or typical", option="acceptance")
        budget = drafter.budget if drafter is not None else 0
        outcomes: List[Optional[Outcome]] = [None] * len(requests)
        admitted, capacity = [], {}
        for index, r in enumerate(requests):
            try:
                capacity[index] = generation_capacity(len(r.prompt_ids), r.max_new_tokens, budget,
                                                      self.context_length, acceptance)
                self.check_request(capacity[index], budget)
            except MtpctlError as err:
                outcomes[index] = err
                continue
            stop = StopChecker(self.codec.eos_ids, r.stop_strings, r.max_new_tokens, self.codec.decode)
            admitted.append((index, Request(r.prompt_ids, stop, r.sampling, drafter.fork() if drafter else None,
                                            r.on_text)))
        sizes = [capacity[index] for index, _ in admitted]
        engines = iter(sizes)
        aux = aux_layers_of(drafter)
        done = run([request for _, request in admitted], lambda _: self.new_engine(next(engines), aux),
                   self.verify_together, max_batch, policy, acceptance,
                   (lambda i, outcome: on_done(admitted[i][0], outcome)) if on_done else None)
        for (index, _), outcome in zip(admitted, done):
            outcomes[index] = outcome
        return outcomes


@dataclass
class GenerationRequest:
    """One request of :meth:`Session.generate_batch`: prompt ids ``[T]`` and its own settings."""

    prompt_ids: Sequence[int]
    max_new_tokens: int = 256
    sampling: SamplingParams = SamplingParams()
    stop_strings: Sequence[str] = ()
    on_text: Optional[Callable[[str], None]] = None


def generation_capacity(prompt_tokens: int, max_new_tokens: int, budget: int, context_length: int,
                        acceptance: str = "exact") -> int:
    """KV cache slots one generation needs (prompt + output + the largest draft + 1, at most the
    model's context), after checking the request.

    Raises:
        BadInput: an unknown acceptance rule, ``max_new_tokens`` < 1, or a prompt that fills the context.
    """
    if acceptance not in ACCEPTANCE:
        raise BadInput(f"acceptance {acceptance!r}: choose exact or typical", option="acceptance")
    if prompt_tokens < 1:
        raise BadInput("the prompt has no tokens")
    if max_new_tokens < 1:
        raise BadInput(f"max new tokens must be at least 1, got {max_new_tokens}", option="max_new_tokens")
    if prompt_tokens >= context_length:
        raise BadInput(f"the prompt has {prompt_tokens} tokens; the model's context holds "
                       f"{context_length} (prompt and output together)")
    return min(context_length, prompt_tokens + max_new_tokens + budget + 1)
