"""The drafter contract: what a drafter sees of the target and what it proposes.

Every drafter (:mod:`mtpctl.drafters`) implements :class:`Drafter`; the decoding loop knows nothing
else about it. A drafter owns whatever it drafts with (MTP heads, an EAGLE layer and its cache, a
draft model and its engine, a datastore).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Protocol, Sequence, Tuple, Union

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
    """The target layers whose residual streams every pass must return to these drafters (a drafter's
    optional ``aux_layers``: EAGLE-3 reads them), sorted, each once."""
    return tuple(sorted({layer for d in drafters if d is not None for layer in getattr(d, "aux_layers", ())}))


def family(drafter: "Drafter"):
    """A hashable key saying which drafters propose together: what a drafter's optional ``family``
    names (a draft model's forks: the draft model; a merge: its members' families), else the drafter
    itself, by identity (requests that share one drafter without per-request state)."""
    named = getattr(drafter, "family", None)
    return ("drafter", id(drafter)) if named is None else named


def propose_all(drafters: Sequence["Drafter"], calls: Sequence[Call]) -> List[Union[DraftTree, NonFinite]]:
    """``drafters[i].propose(*calls[i])`` for drafters of one :func:`family`, in one call where they
    can: ``propose_together`` on a drafter the requests share (MTP heads run once on every row's
    hidden state), ``propose_forks`` on forks (a draft model's passes packed across the requests);
    else one call each (a single call: ``propose``). ``propose_forks`` gives a row whose drafter's
    values were not finite its :class:`~mtpctl.errors.NonFinite` in place of a tree (the others' trees
    are theirs alone); the other ways raise it for the whole call."""
    first = drafters[0]
    if len(calls) > 1:
        together = getattr(first, "propose_together", None)
        if together is not None and all(d is first for d in drafters):
            return together(calls)
        forks = getattr(first, "propose_forks", None)
        if forks is not None:
            return forks(drafters, calls)
    return [d.propose(*call) for d, call in zip(drafters, calls)]


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


class Drafter(Protocol):
    """Proposes up to ``max_tokens`` draft tokens (tree nodes under the root) to follow ``context``
    (prompt + committed output ids, the pending token last), as a tree rooted at the pending token;
    ``last`` is the target's last forward pass. ``budget`` is the most draft tokens the drafter
    proposes in one step (the loop never asks for more; the KV cache is sized for it)."""

    budget: int

    def propose(self, context: Sequence[int], max_tokens: int, last: Optional[TargetStep] = None) -> DraftTree: ...

    def fork(self) -> "Drafter":
        """A drafter for another request: the same weights and data (heads, datastore, draft model),
        its own per-request state (an EAGLE layer's KV cache, a draft model's engine); a drafter that
        keeps no such state returns itself. A batch gives each request its own fork."""
