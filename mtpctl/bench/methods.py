"""The methods a benchmark compares: ``plain`` and drafter specs (:mod:`mtpctl.drafters.build`), each
built once for a session and run on every prompt with the same settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

from mtpctl.decode.drafter import Drafter
from mtpctl.decode.loop import GenerationResult
from mtpctl.decode.policy import Policy
from mtpctl.decode.sampling import SamplingParams
from mtpctl.decode.session import Session
from mtpctl.drafters.build import DraftOptions, build, check, draft_member, load_parts, parse
from mtpctl.errors import BadInput


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
    """One way to decode: ``run(prompt ids)`` generates with ``drafter`` (None: plain decoding);
    ``drafter_bytes`` is the memory of the drafter's own weights and data (heads, datastore, draft
    model; a self-draft's weights are the target's), bytes."""

    name: str
    run: Callable[[List[int]], GenerationResult]
    drafter: Optional[Drafter] = None
    drafter_bytes: int = 0


def build_methods(session: Session, names: Sequence[str], opts: DraftOptions, sampling: SamplingParams,
                  max_new_tokens: int, acceptance: str = "exact",
                  make_policy: Callable[[str], Optional[Policy]] = lambda name: None,
                  progress: Optional[Callable[[str], None]] = None) -> Dict[str, Method]:
    """Every method of ``names`` (see :func:`parse_methods`) for ``session``, the heads and datastore
    loaded once and shared; each generation speculates under a fresh ``make_policy(name)`` (None: every
    step drafts the whole budget); ``progress`` receives a line before a long preparation (a
    self-draft's layer search).

    Raises:
        BadInput, CorruptModel, UnsupportedModel: see :func:`mtpctl.drafters.build.build`.
    """
    specs = {name: () if name == "plain" else parse(name) for name in names}
    check([p for parts in specs.values() for p in parts], opts)
    shared = load_parts(session, tuple(dict.fromkeys(p for parts in specs.values() for p in parts if p != "draft")), opts)
    head_bytes = 0
    if shared.heads is not None and shared.heads.module is not None:  # heads fused into a graph are in its weights
        head_bytes = sum(t.numel() * t.element_size() for t in shared.heads.module.state_dict().values())
    store_bytes = shared.store.tokens.nbytes + shared.store.keys.nbytes if shared.store is not None else 0
    methods = {}
    for name, parts in specs.items():
        drafter = build(session, parts, opts, sampling, shared, progress)
        draft = draft_member(drafter)
        size = head_bytes * ("heads" in parts) + store_bytes * ("retrieval" in parts) + (draft.weight_bytes if draft else 0)

        def run(ids, drafter=drafter, name=name):
            return session.generate(ids, max_new_tokens, sampling, drafter, acceptance=acceptance,
                                    policy=make_policy(name))

        methods[name] = Method(name, run, drafter, size)
    return methods
