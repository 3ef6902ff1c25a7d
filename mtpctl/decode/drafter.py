"""The drafter contract: what a drafter sees of the target and what it proposes.

Every drafter (:mod:`mtpctl.drafters`) implements :class:`Drafter`; the decoding loop knows nothing
else about it. A drafter owns whatever it drafts with (MTP heads, an EAGLE layer and its cache, a
draft model and its engine, a datastore).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Protocol, Sequence

from mtpctl.decode.engine import StepOutput
from mtpctl.decode.tree import DraftTree


@dataclass
class TargetStep:
    """The target's last forward pass as a drafter sees it: ``out`` and ``row``, the row whose
    prediction is the pending token. MTP drafters read ``out.hidden_states[row]`` (or an exported
    graph's ``out.head_logits[row]``). After a verify pass ``rows`` lists the rows it committed (the
    accepted path, ``row`` last); after prefill it is None, and the torch engine's output carries
    every prompt row as ``out.prompt_hidden_states`` (EAGLE reads every committed position)."""

    out: StepOutput
    row: int
    rows: Optional[List[int]] = None  # [m] rows of ``out`` committed, in position order; None after prefill


class Drafter(Protocol):
    """Proposes up to ``max_tokens`` draft tokens (tree nodes under the root) to follow ``context``
    (prompt + committed output ids, the pending token last), as a tree rooted at the pending token;
    ``last`` is the target's last forward pass. ``budget`` is the most draft tokens the drafter
    proposes in one step (the loop never asks for more; the KV cache is sized for it)."""

    budget: int

    def propose(self, context: Sequence[int], max_tokens: int, last: Optional[TargetStep] = None) -> DraftTree: ...
