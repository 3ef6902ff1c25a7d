"""The tau a head folder reaches when it decodes prompts it never trained on: the last step of
``add-heads`` (recorded in ``mtp_config.json`` as ``training.measured``).

Held-out accuracy predicts tau (``expected_tau``); this decodes. The prompts are those of the held-out
self-distilled sequences (the trainer's seeded split: no head saw them or their responses), each
decoded greedily for ``response_tokens`` new tokens plainly and with every method of
:data:`METHODS` (the heads' tree of ``tree_nodes`` nodes, the one ``expected_tau`` describes) under
the ``always`` policy (every step drafts its whole budget, so tau does not depend on the machine's
timing), in the self-distillation's dtype, batched. Tau is pooled over the
prompts: committed tokens over decode steps. Each method's output is compared with plain greedy
decoding token for token (lossless: every prompt must be the same).

Held-out prompts come from the training data's distribution; the benchmark's built-in prompts
(``mtpctl bench``) are the harder, unlike set that BENCHMARKS.md reports.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from mtpctl.decode.session import GenerationRequest
from mtpctl.drafters.build import DraftOptions, load_parts
from mtpctl.drafters.pipeline import PipelineSpec, Shared, assemble, open_target
from mtpctl.errors import MtpctlError

#: the drafters measured, besides plain decoding
METHODS = ("heads", "heads+ngram")
#: requests decoded together
BATCH = 8


@dataclass
class MeasureSettings:
    """What :func:`measure_tau` decodes: the target, the head folder, the dtype and device."""

    model: str  # the target's folder
    heads_dir: str
    dtype: str = "bfloat16"
    device: str = "cpu"
    max_new_tokens: int = 128
    tree_nodes: Optional[int] = None  # the heads' tree size (None: generate's default for the dtype)


def measure_tau(settings: MeasureSettings, prompts: Sequence[Sequence[int]]) -> dict:
    """Decode ``prompts`` (token ids, chat template applied) plainly and with each of :data:`METHODS`.

    Returns:
        ``{"prompts", "max_new_tokens", "dtype", "tree_nodes", "policy", "tau": {method: pooled tau},
        "new_tokens": {method: n}, "same_as_plain": {method: "k/n"}}``.

    Raises:
        MtpctlError: a prompt the target cannot decode (the first error met), or what loading the
            target or the heads raises.
    """
    spec = PipelineSpec(model=settings.model, dtype=settings.dtype, device=settings.device,
                        draft=DraftOptions(heads_dir=settings.heads_dir, tree_nodes=settings.tree_nodes),
                        speculate_policy="always")
    session = open_target(spec)
    used = tuple(dict.fromkeys(p for m in METHODS for p in m.split("+")))
    shared = Shared(session, load_parts(session, used, spec.draft), used)
    requests = [GenerationRequest(list(p), settings.max_new_tokens) for p in prompts]
    plain = _decode(assemble(spec, shared=shared), requests)
    out = {"prompts": len(prompts), "max_new_tokens": settings.max_new_tokens, "dtype": settings.dtype,
           "tree_nodes": settings.tree_nodes, "policy": "always", "tau": {}, "new_tokens": {}, "same_as_plain": {}}
    for method in METHODS:
        pipeline = assemble(replace(spec, speculate=method), shared=shared)
        results = _decode(pipeline, requests)
        steps = sum(r.stats.decode_steps for r in results)
        committed = sum(sum(r.stats.accepted_per_step) for r in results)
        out["tau"][method] = round(committed / steps, 3) if steps else None
        out["new_tokens"][method] = sum(r.stats.new_tokens for r in results)
        same = sum(r.token_ids == p.token_ids for r, p in zip(results, plain))
        out["same_as_plain"][method] = f"{same}/{len(results)}"
    return out


def _decode(pipeline, requests: List[GenerationRequest]) -> list:
    """The results of ``requests`` decoded by ``pipeline``; the first error raised."""
    outcomes = pipeline.generate_batch(requests, max_batch=BATCH)
    for outcome in outcomes:
        if isinstance(outcome, MtpctlError):
            raise outcome
    return outcomes


def held_out_prompts(store, seqs: Sequence[int], count: int) -> List[List[int]]:
    """The prompt ids (up to the response's first token) of the first ``count`` self-distilled
    sequences of ``seqs`` (held out), in order; plain-text sequences have no prompt and are skipped."""
    prompts = []
    for s in seqs:
        if len(prompts) == count:
            break
        loss_from = int(store.loss_from[s])
        if loss_from <= 0:
            continue
        shard, start = int(store.shard_of[s]), int(store.starts[s])
        prompts.append(store.index(shard).ids[start:start + loss_from].tolist())
    return prompts


def measured_line(measured: Dict) -> str:
    """One progress line of a measurement."""
    taus = ", ".join(f"{m} {t}" for m, t in measured["tau"].items())
    same = ", ".join(f"{m} {s}" for m, s in measured["same_as_plain"].items())
    return (f"measured tau on {measured['prompts']} held-out prompts ({measured['dtype']}, greedy, "
            f"{measured['max_new_tokens']} new tokens, {measured['tree_nodes']}-node tree): {taus}; same tokens as "
            f"plain: {same}")
