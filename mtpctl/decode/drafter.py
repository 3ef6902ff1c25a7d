"""The drafter contract: what a drafter sees of the target and what it proposes.

Every drafter (:mod:`mtpctl.drafters`) subclasses :class:`Drafter`; the decoding loop knows nothing
else about it. A drafter owns whatever it drafts with (MTP heads, an EAGLE layer and its cache, a
draft model and its engine, a datastore).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, List, Optional, Sequence, Tuple, Union

import torch

from mtpctl.decode.engine import StepOutput
from mtpctl.decode.tree import DraftTree
from mtpctl.errors import NonFinite


@dataclass
class TargetStep:
    """The target's last forward pass as a drafter sees it: ``out`` and ``row``, the row whose
    prediction is the pending token. MTP drafters read ``out.hidden_states[row]`` (or an exported
    graph's ``out.head_logits[row]``). After a verify pass ``rows`` lists the rows it committed (the
    accepted path, ``row`` last) and ``tree`` the draft tree it verified; after prefill both are None,
    and the torch engine's output carries every prompt row as ``out.prompt_hidden_states`` (EAGLE reads
    every committed position)."""

    out: StepOutput
    row: int
    rows: Optional[List[int]] = None  # [m] rows of ``out`` committed, in position order; None after prefill
    tree: Optional[DraftTree] = None  # the tree that pass verified (its extra rows follow its nodes); None after prefill


#: one row's proposal request: (context, max_tokens, last), the arguments of ``Drafter.propose``
Call = Tuple[Sequence[int], int, Optional[TargetStep]]


def aux_layers_of(*drafters: Optional["Drafter"]) -> Tuple[int, ...]:
    """The target layers whose residual streams every pass must return to these drafters (their
    :attr:`Drafter.aux_layers`: EAGLE-3 reads them), sorted, each once."""
    return tuple(sorted({layer for d in drafters if _declared(d) for layer in d.aux_layers}))


def family(drafter: "Drafter") -> Hashable:
    """A hashable key saying which drafters propose together (:attr:`Drafter.family`: a draft model's
    forks, the draft model; a merge, its members' families; by default the drafter itself, by
    identity: requests that share one drafter without per-request state)."""
    return drafter.family if _declared(drafter) else ("drafter", id(drafter))


def propose_all(drafters: Sequence["Drafter"], calls: Sequence[Call]) -> List[Union[DraftTree, NonFinite]]:
    """``drafters[i].propose(*calls[i])`` for drafters of one :func:`family`, in one call where they
    can: :meth:`Drafter.propose_together` on a drafter the requests share (MTP heads run once on every
    row's hidden state), :meth:`Drafter.propose_forks` on forks (a draft model's passes packed across
    the requests); a single call: ``propose``. ``propose_forks`` may give a row whose drafter's values
    were not finite its :class:`~mtpctl.errors.NonFinite` in place of a tree (the others' trees are
    theirs alone); one call each raises it for the whole call."""
    first = drafters[0]
    if len(calls) > 1 and _declared(first):
        if all(d is first for d in drafters):
            return first.propose_together(calls)
        return first.propose_forks(drafters, calls)
    return [d.propose(*call) for d, call in zip(drafters, calls)]


def finished(drafter: Optional["Drafter"], prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
    """Tell ``drafter`` (None: plain decoding) that a request it served has ended
    (:meth:`Drafter.finished`)."""
    if _declared(drafter):
        drafter.finished(prompt_ids, output_ids)


def _declared(drafter) -> bool:
    """Whether ``drafter`` declares the optional parts of the contract (a :class:`Drafter`). An object
    that only has ``budget``, ``propose`` and ``fork`` (a test's scripted drafter) drafts as well:
    it gets the base class's defaults (no aux layers, its own family, one call per row, no hook)."""
    return isinstance(drafter, Drafter)


def check_finite(logits: torch.Tensor, who: str) -> torch.Tensor:
    """``logits`` unchanged when no value is NaN or +inf (-inf marks tokens a drafter never proposes,
    e.g. outside MTP heads' draft vocabulary).

    Raises:
        NonFinite: a NaN or +inf, named by ``who`` (the drafter whose logits they are).
    """
    if bool(torch.isnan(logits).any() or torch.isposinf(logits).any()):
        raise NonFinite(f"{who}'s logits hold NaN or inf: its weights or this input overflow; no token was taken "
                        "from them")
    return logits


class Drafter:
    """The base of every drafter: proposes up to ``max_tokens`` draft tokens (tree nodes under the
    root) to follow ``context`` (prompt + committed output ids, the pending token last), as a tree
    rooted at the pending token; ``last`` is the target's last forward pass. ``budget`` is the most
    draft tokens the drafter proposes in one step (the loop never asks for more; the KV cache is
    sized for it).

    A subclass implements :meth:`propose` and sets ``budget``; the rest is optional, declared here
    with its default: :attr:`aux_layers` (none), :attr:`samples_drafts` (no), :meth:`fork` (itself), :attr:`family` (itself),
    :meth:`propose_together` and :meth:`propose_forks` (one :meth:`propose` per request) and
    :meth:`finished` (nothing)."""

    budget: int
    #: target layers whose residual streams each pass must return to the drafter (EAGLE-3's), sorted
    aux_layers: Tuple[int, ...] = ()
    #: whether its drafts are sampled from its own distribution (trees with ``q``: a draft model when
    #: sampling), verified by rejection sampling, so a seeded sampled request's tokens depend on the
    #: drafter's draws; a deterministic drafter's requests commit the target's own samples, the same
    #: as without a drafter (:mod:`mtpctl.decode.acceptance`)
    samples_drafts: bool = False

    def propose(self, context: Sequence[int], max_tokens: int, last: Optional[TargetStep] = None) -> DraftTree:
        raise NotImplementedError(f"{type(self).__name__} does not implement propose")

    def fork(self) -> "Drafter":
        """A drafter for another request: the same weights and data (heads, datastore, draft model),
        its own per-request state (an EAGLE layer's KV cache, a draft model's engine). A batch gives
        each request its own fork. By default itself: a drafter that keeps no such state (every
        drafter that does overrides this)."""
        return self

    @property
    def family(self) -> Hashable:
        """Which drafters propose together (see :func:`family`): by default this drafter alone, by
        identity (the requests of a batch that share it, when :meth:`fork` returns itself)."""
        return ("drafter", id(self))

    def propose_together(self, calls: Sequence[Call]) -> List[Union[DraftTree, NonFinite]]:
        """:meth:`propose` for several requests sharing this drafter, ``calls[i]`` for request i; by
        default :meth:`propose_forks` with this drafter for every request."""
        return self.propose_forks([self] * len(calls), calls)

    @staticmethod
    def propose_forks(drafters: Sequence["Drafter"], calls: Sequence[Call]) -> List[Union[DraftTree, NonFinite]]:
        """:meth:`propose` of each request's drafter of one family (``drafters[i]`` for ``calls[i]``);
        by default one call each."""
        return [d.propose(*call) for d, call in zip(drafters, calls)]

    def finished(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """A request this drafter served has ended with ``output_ids`` after ``prompt_ids`` (a drafter
        that learns from what the target wrote keeps it here). Nothing by default."""
