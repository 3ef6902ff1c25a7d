"""The methods a benchmark compares: ``plain`` and drafter specs (:mod:`mtpctl.drafters.build`), each
a pipeline built once for a session by the one builder (:func:`mtpctl.drafters.pipeline.assemble`)
and run on every prompt with the same settings."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Sequence

from mtpctl.decode.drafter import Drafter
from mtpctl.decode.loop import GenerationResult
from mtpctl.decode.sampling import SamplingParams
from mtpctl.decode.session import Session
from mtpctl.drafters.build import check, draft_member, load_parts, parse
from mtpctl.drafters.pipeline import Pipeline, PipelineSpec, Shared, assemble
from mtpctl.errors import BadInput
from mtpctl.model.device import measured


def parse_methods(text: str) -> List[str]:
    """``plain,ngram`` -> the list, ``plain`` first (the speedup baseline); a method is ``plain`` or
    a drafter spec (``heads+ngram``, ``draft``), each once; a spec is named by its parts in merge
    order (``ngram+heads`` is the method ``heads+ngram``).

    Raises:
        BadInput: an unknown method.
    """
    names = []
    for name in (n.strip() for n in text.split(",") if n.strip()):
        parts = () if name == "plain" else parse(name)
        if name != "plain" and not parts:
            raise BadInput("unknown method 'none': plain decoding is the method 'plain'", option="methods")
        names.append("+".join(parts) or name)
    return ["plain"] + [n for n in dict.fromkeys(names) if n != "plain"]


@dataclass
class Method:
    """One way to decode: ``run(prompt ids)`` generates with ``pipeline`` (its ``drafter``, None: plain
    decoding, under a fresh policy each generation), on a GPU timed and measured as a benchmark run
    (:func:`mtpctl.model.device.measured`: its stats' ``device_memory``); ``drafter_bytes`` is the
    memory of the drafter's own weights and data (heads, datastore, draft model; a self-draft's weights
    are the target's), bytes."""

    name: str
    run: Callable[[List[int]], GenerationResult]
    pipeline: Pipeline
    drafter_bytes: int = 0

    @property
    def drafter(self) -> Optional[Drafter]:
        return self.pipeline.drafter


def build_methods(session: Session, names: Sequence[str], spec: PipelineSpec, sampling: SamplingParams,
                  max_new_tokens: int, progress: Optional[Callable[[str], None]] = None) -> Dict[str, Method]:
    """Every method of ``names`` (see :func:`parse_methods`) for ``session``, each a pipeline of
    ``spec`` drafting with its spec (:func:`mtpctl.drafters.pipeline.assemble`: the policy and
    acceptance rule of ``spec``), the heads and datastore loaded once and shared; ``progress``
    receives a line before a long preparation (a self-draft's layer search).

    Raises:
        BadInput, CorruptModel, UnsupportedModel: see :func:`mtpctl.drafters.pipeline.assemble`.
    """
    specs = {name: () if name == "plain" else parse(name) for name in names}
    used = tuple(dict.fromkeys(p for parts in specs.values() for p in parts))
    check(used, spec.draft)
    shared = Shared(session, load_parts(session, tuple(p for p in used if p != "draft"), spec.draft), used)
    head_bytes = 0
    if shared.parts.heads is not None and shared.parts.heads.module is not None:  # fused heads: the graph's weights
        head_bytes = sum(t.numel() * t.element_size() for t in shared.parts.heads.module.state_dict().values())
    store = shared.parts.store
    store_bytes = store.tokens.nbytes + store.keys.nbytes if store is not None else 0
    methods = {}
    for name, parts in specs.items():
        pipeline = assemble(replace(spec, speculate="+".join(parts) or "none"), sampling, progress, shared)
        draft = draft_member(pipeline.drafter)
        size = head_bytes * ("heads" in parts) + store_bytes * ("retrieval" in parts) + \
            (draft.weight_bytes if draft else 0)

        def run(ids, pipeline=pipeline):
            with measured(session.torch_device) as memory:  # on CUDA: phases synchronized, the peak measured
                result = pipeline.generate(ids, max_new_tokens, sampling)
            result.stats.device_memory = memory
            return result

        methods[name] = Method(name, run, pipeline, size)
    return methods
