"""One way in: the settings of a generation pipeline, their one set of defaults, and the one function
that assembles the pipeline from them, for the library (:func:`mtpctl.api.load`), ``mtpctl
generate``, ``mtpctl bench`` and the benchmark's methods (:mod:`mtpctl.bench.methods`) alike.

:class:`PipelineSpec` holds every setting besides the request's own (prompt, max new tokens,
sampling, stops): the target and where it computes, the drafter spec and its settings
(:class:`~mtpctl.drafters.build.DraftOptions`), the speculation policy and the acceptance rule.
:func:`check_spec` refuses bad settings before any model loads; :func:`assemble` checks them, sets
the threads, opens the session, builds the drafter and checks the policy's cost table, and returns a
:class:`Pipeline`, whose :meth:`Pipeline.generate` decodes under a fresh policy each call.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

from mtpctl.backends import BACKENDS, open_session
from mtpctl.backends.torch import set_threads
from mtpctl.decode.drafter import Drafter
from mtpctl.decode.loop import GenerationResult, Outcome
from mtpctl.decode.cost_table import (TableChoice, choose_table, measure_draft, measure_small, model_identity,
                                      with_draft_cost)
from mtpctl.decode.policy import POLICIES, Policy, make_policy
from mtpctl.decode.sampling import SamplingParams
from mtpctl.decode.session import ACCEPTANCE, GenerationRequest, Session
from mtpctl.drafters.build import DraftOptions, Parts, build, check, parse
from mtpctl.errors import BadInput
from mtpctl.model.sources import DEFAULT_MODEL


@dataclass(frozen=True)
class PipelineSpec:
    """What a pipeline is made of, with the defaults the library and the CLI share (the CLI's options
    take theirs from here).

    Attributes:
        model: an alias, checkpoint folder, .gguf file or hub id; an ``mtpctl export`` folder for
            the exported backends.
        backend: ``torch``, ``onnxruntime`` or ``tensorrt``.
        dtype: ``float32`` or ``bfloat16`` (the torch backend).
        weights: ``dense``, or ``int4`` (GGUF Q4_1/Q8_0 weights kept packed; bfloat16).
        threads: CPU threads for torch's ops (None: torch's default).
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
        kernels: ``auto``, ``native`` or ``torch``.
        speculate: the drafter spec (``none``, ``ngram``, ``heads+ngram``, ...;
            :func:`mtpctl.drafters.build.parse`).
        draft: the drafters' settings.
        speculate_policy: ``auto`` (each request drafts while its drafts are expected to pay, by the
            measured pass costs) or ``always`` (the whole budget every step).
        acceptance: ``exact`` (lossless) or ``typical`` (Medusa's typical acceptance when sampling).
        cuda_graphs: replay plain decode steps as CUDA graphs (the torch backend on a CUDA device,
            :mod:`mtpctl.backends.step_graphs`).
    """

    model: str = DEFAULT_MODEL
    backend: str = "torch"
    dtype: str = "float32"
    weights: str = "dense"
    threads: Optional[int] = None
    device: str = "auto"
    kernels: str = "auto"
    speculate: str = "none"
    draft: DraftOptions = field(default_factory=DraftOptions)
    speculate_policy: str = "auto"
    acceptance: str = "exact"
    cuda_graphs: bool = False


#: the defaults, read by the library's signatures and the CLI's options
DEFAULTS = PipelineSpec()


def check_spec(spec: PipelineSpec, parts: Optional[Sequence[str]] = None) -> Tuple[str, ...]:
    """The parsed drafter spec of ``spec`` after refusing what cannot work, before any model loads;
    ``parts`` checks the drafters' settings against these parts instead (a benchmark's methods
    together).

    Raises:
        BadInput: an unknown drafter, backend, policy or acceptance rule, or drafter settings that
            are missing or that no drafter uses (:func:`mtpctl.drafters.build.check`).
    """
    names = parse(spec.speculate)
    check(names if parts is None else parts, spec.draft)
    if spec.backend not in BACKENDS:
        raise BadInput(f"unknown backend {spec.backend!r} (choose from {', '.join(BACKENDS)})", option="backend")
    if spec.speculate_policy not in POLICIES:
        raise BadInput(f"speculation policy {spec.speculate_policy!r}: choose {' or '.join(POLICIES)}",
                       option="speculate_policy")
    if spec.acceptance not in ACCEPTANCE:
        raise BadInput(f"acceptance {spec.acceptance!r}: choose {' or '.join(ACCEPTANCE)}", option="acceptance")
    return names


def open_target(spec: PipelineSpec) -> Session:
    """The session of ``spec``'s target, torch's threads set first.

    Raises:
        BadInput, ModelNotFound, CorruptModel, UnsupportedModel: see :func:`mtpctl.backends.open_session`.
    """
    set_threads(spec.threads)
    return open_session(spec.model, spec.backend, spec.dtype, spec.weights, spec.threads, spec.device, spec.kernels,
                        spec.cuda_graphs)


@dataclass
class Shared:
    """What the pipelines of one run share (a benchmark's methods): the open session, the heads and
    datastore loaded once (:func:`mtpctl.drafters.build.load_parts`), and the drafter parts of every
    pipeline together, against which the drafters' settings are checked."""

    session: Session
    parts: Parts
    used: Tuple[str, ...]


@dataclass
class Pipeline:
    """A loaded target, its drafter (None: plain decoding) and how it speculates: what
    :func:`assemble` returns.

    Attributes:
        spec: the settings it was assembled from.
        session: the target's session.
        drafter: the drafter ``spec.speculate`` names, built for the session.
        parts: the parsed drafter spec (``()`` for plain decoding).
        table: the pass-cost table the auto policy reads and where it came from (None: the policy
            reads none, ``always`` or a session without packed passes; see
            :func:`mtpctl.decode.cost_table.choose_table`).
    """

    spec: PipelineSpec
    session: Session
    drafter: Optional[Drafter]
    parts: Tuple[str, ...]
    table: Optional[TableChoice] = None

    @property
    def speculate(self) -> str:
        """The drafter spec in merge order (``heads+ngram``), ``none`` for plain decoding."""
        return "+".join(self.parts) or "none"

    def new_policy(self) -> Policy:
        """A fresh speculation policy of ``spec.speculate_policy`` for this session's mode and drafter
        (a policy learns from the requests it serves: one per generation or batch).

        Raises:
            BadInput: see :func:`mtpctl.decode.policy.make_policy`.
        """
        return _policy(self.spec, self.session, self.parts, self.table)

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
                 stop_strings: Sequence[str] = (), on_text: Optional[Callable[[str], None]] = None,
                 acceptance: Optional[str] = None) -> GenerationResult:
        """One request with the pipeline's drafter, a fresh policy and its acceptance rule (``acceptance``:
        another one for this request); see :meth:`mtpctl.decode.session.Session.generate`."""
        return self.session.generate(prompt_ids, max_new_tokens, sampling, self.drafter, stop_strings, on_text,
                                     acceptance or self.spec.acceptance, self.new_policy())

    def generate_batch(self, requests: Sequence[GenerationRequest], max_batch: int = 8,
                       on_done: Optional[Callable[[int, Outcome], None]] = None) -> List[Outcome]:
        """Every request, up to ``max_batch`` at once, with the pipeline's drafter, one fresh policy and
        the acceptance rule (see :meth:`mtpctl.decode.session.Session.generate_batch`)."""
        return self.session.generate_batch(requests, self.drafter, max_batch, self.new_policy(), self.spec.acceptance,
                                           on_done)


def assemble(spec: PipelineSpec = DEFAULTS, sampling: SamplingParams = SamplingParams(),
             progress: Optional[Callable[[str], None]] = None, shared: Optional[Shared] = None) -> Pipeline:
    """The pipeline ``spec`` describes: its settings checked before anything loads, torch's threads
    set, the target's session opened, the policy's cost table checked (a missing one is an error
    before a long build) and the drafter built.

    Args:
        spec: the settings.
        sampling: the settings a draft model samples with (the target's, when generating sampled).
        progress: receives a line before a long preparation (a self-draft's layer search).
        shared: the session, heads and datastore of other pipelines of this run to use (none opened
            or loaded here), the drafters' settings checked against every pipeline's parts.

    Raises:
        BadInput, ModelNotFound, CorruptModel, UnsupportedModel: see :func:`check_spec`,
            :func:`open_target` and :func:`mtpctl.drafters.build.build`.
    """
    names = check_spec(spec, shared.used if shared is not None else None)
    session = shared.session if shared is not None else open_target(spec)
    table = _table(spec, session) if names else None  # chosen (measured on first use) before a long build
    _policy(spec, session, names, table)
    drafter = build(session, names, spec.draft, sampling, shared.parts if shared is not None else None, progress)
    if table is not None:
        config = heads_config(spec.draft.heads_dir)
        table = with_draft_cost(table, "+".join(names), draft_key(spec, names, config),
                                lambda: measure_draft(session, drafter, vocab=session.vocab_size), heads_kind(config))
    return Pipeline(spec, session, drafter, names, table)


def heads_config(heads_dir: Optional[str]) -> bytes:
    """The bytes of a head folder's ``mtp_config.json`` (empty without a folder or that file)."""
    config = Path(heads_dir or "") / "mtp_config.json"
    return config.read_bytes() if heads_dir and config.is_file() else b""


def heads_kind(config: bytes) -> Optional[str]:
    """The head kind a folder's ``mtp_config.json`` bytes (:func:`heads_config`) name, None without any."""
    try:
        return json.loads(config).get("kind") if config else None
    except (ValueError, AttributeError):
        return None  # the heads' loader says what is wrong with the folder


def draft_key(spec: PipelineSpec, names: Sequence[str], config: bytes) -> str:
    """The key a drafter's cost is cached under: the method and a fingerprint of what its cost depends on
    (the drafters' settings and the head folder's ``mtp_config.json`` bytes, :func:`heads_config`)."""
    settings = json.dumps(asdict(spec.draft), sort_keys=True, default=str)
    return f"{'+'.join(names)} {hashlib.sha256(settings.encode() + config).hexdigest()[:12]}"


def _table(spec: PipelineSpec, session: Session) -> Optional[TableChoice]:
    """The pass-cost table of the session's model and mode for the auto policy (None where the policy
    reads none; :func:`assemble` asks only where a drafter is built: plain decoding decides no draft
    sizes, so it never measures one)."""
    if spec.speculate_policy != "auto" or session.policy_mode is None or session.model is None:
        return None
    return choose_table(model_identity(session.model.cfg), session.policy_mode,
                        lambda: measure_small(session, vocab=session.vocab_size))


def _policy(spec: PipelineSpec, session: Session, names: Sequence[str], table: Optional[TableChoice]) -> Policy:
    """A fresh policy of ``spec`` for ``session``'s mode, priced by ``table`` (None: this CPU's shipped
    one) and its drafter cost (where not priced yet, the shipped table's of the drafter ``names``)."""
    costs = table.costs if table is not None else None
    draft = table.draft if table is not None and table.draft_source is not None else None
    return make_policy(spec.speculate_policy, session.policy_mode, "+".join(names) or None, costs, draft)
