"""A self-draft: the target run through a subset of its own layers as its draft model (layer skipping
as in Draft & Verify, Zhang et al. 2023, and SWIFT, Xia et al. 2024). No training and no extra
weights: the kept layers, the embedding, the final norm and the lm_head are the target's own tensors;
the draft has its own KV cache, holding only the kept layers. Its vocabulary is the target's by
construction, so it drafts in the target's ids and, when sampling, reports its own distribution.

Which layers to keep is given (``self:0-11,20-29``: ranges of 0-based layer numbers) or chosen by a
short measured search on calibration prompts (:func:`search_layers`): the target answers a few
built-in prompts greedily; each layer's importance is the agreement (the share of positions where
the subset's argmax equals the target's) of the model without that layer; layers are then dropped
least important first, the agreement of each smaller subset measured, and the subset with the best
estimated speedup kept (:func:`estimated_speedup`). The choice is stored as a small versioned JSON
file keyed by the target's weights and numeric mode, so later runs reuse it.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from mtpctl.decode.attention import attention_masks, plans_on
from mtpctl.decode.sampling import SamplingParams
from mtpctl.drafters.draft_model import DraftModelDrafter
from mtpctl.errors import BadInput
from mtpctl.files import mtpctl_home, write_file
from mtpctl.model.decoder import Decoder

SELF = "self"
FORMAT_VERSION = 1
KIND = "mtpctl-self-draft"
#: calibration: the last prompt of each category of the built-in prompt set (the benchmarks take the
#: first ones), its last PROMPT_TOKENS tokens, and the target's first ANSWER_TOKENS greedy tokens
CALIBRATION_PROMPTS = Path(__file__).resolve().parent.parent / "data" / "bench_prompts.jsonl"
PROMPT_TOKENS, ANSWER_TOKENS = 48, 24
#: the search keeps at least this share of the layers
MIN_SHARE = 0.25
#: draft lengths the speedup estimate considers
DRAFT_LENGTHS = range(1, 9)


def is_self(draft_model: Optional[str]) -> bool:
    """Whether a draft-model setting names the self-draft (``self`` or ``self:...``)."""
    return draft_model is not None and (draft_model == SELF or draft_model.startswith(SELF + ":"))


def parse_layers(text: str, num_layers: int) -> Tuple[int, ...]:
    """``0-11,20-29`` -> the kept layers, in order (0-based, ranges inclusive).

    Raises:
        BadInput: not a comma-separated list of numbers and ranges, an empty or reversed range, a
            layer the model does not have, or a layer named twice.
    """
    layers: List[int] = []
    for piece in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", piece)
        if match is None:
            raise BadInput(f"self-draft layers {text!r}: expected numbers and ranges such as 0-11,20-29",
                           option="draft_model")
        first, last = int(match.group(1)), int(match.group(2) or match.group(1))
        if last < first:
            raise BadInput(f"self-draft layers {text!r}: the range {first}-{last} is reversed", option="draft_model")
        layers += range(first, last + 1)
    outside = [i for i in layers if i >= num_layers]
    if outside:
        raise BadInput(f"self-draft layers {text!r}: the model has {num_layers} layers (0-{num_layers - 1}), "
                       f"not layer {outside[0]}", option="draft_model")
    if len(set(layers)) != len(layers):
        twice = next(i for i in layers if layers.count(i) > 1)
        raise BadInput(f"self-draft layers {text!r}: layer {twice} is named twice", option="draft_model")
    return tuple(sorted(layers))


def format_layers(layers: Sequence[int]) -> str:
    """(0, 1, 2, 5) -> ``0-2,5``: the syntax :func:`parse_layers` reads."""
    runs: List[List[int]] = []
    for i in layers:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def layer_subset(model: Decoder, layers: Sequence[int]) -> Decoder:
    """The decoder ``model`` run through ``layers`` only: the same parameter tensors (nothing is
    copied), embedding, final norm and lm_head; each kept layer renumbered to its place in the subset,
    so the subset's KV cache holds the kept layers only (a hybrid body's: its kept attention layers' slots
    and its kept Gated DeltaNet layers' states, the layer types renumbered with them). ``model`` itself is
    left unchanged."""
    sub = copy.copy(model)  # shares the parameter and buffer dicts: the same tensors
    sub._modules = dict(model._modules)  # its own module table, so replacing its layers leaves model's alone
    deltanet = model.cfg.deltanet
    if deltanet is not None and deltanet.layer_types:
        deltanet = dataclasses.replace(deltanet, layer_types=tuple(deltanet.layer_types[i] for i in layers))
    sub.cfg = dataclasses.replace(model.cfg, num_hidden_layers=len(layers), deltanet=deltanet,
                                  layer_windows=tuple(model.cfg.layer_windows[i] for i in layers))
    kept = []
    for place, index in enumerate(layers):
        layer = copy.copy(model.layers[index])  # the same weights under another cache index
        layer.index, layer.cfg = place, sub.cfg  # its cache index counts the subset's attention layers
        kept.append(layer)
    sub.layers = nn.ModuleList(kept)
    sub.local_rope = tuple(model.local_rope[i] for i in layers)
    return sub


def self_drafter(session, spec: str, sampling: SamplingParams, draft_len: Optional[int],
                 progress: Optional[Callable[[str], None]] = None) -> DraftModelDrafter:
    """The self-draft ``spec`` names for ``session``'s target (a torch session): ``self`` (the stored
    search result for this target and mode, searched now when there is none), ``self:LAYERS``
    (given layers, :func:`parse_layers`) or ``self:FILE.json`` (a stored search result).

    Raises:
        BadInput: a session without a torch model, bad layers, or a stored choice that does not fit.
    """
    model = session.model  # None: an exported graph
    if model is None:
        raise BadInput(f"the self-draft drafts for the torch backend only, not {session.backend}", option="backend")
    given = spec[len(SELF) + 1:] if spec != SELF else ""
    if not given:
        layers = stored_or_searched(session, progress)
    elif given.endswith(".json"):
        layers = read_choice(Path(given), session)
    else:
        layers = parse_layers(given, model.cfg.num_hidden_layers)
    source = {"folder": str(session.folder), "verdict": "identical",
              "mode": f"ids (self-draft: layers {format_layers(layers)} of {model.cfg.num_hidden_layers})",
              "layers": list(layers)}
    return DraftModelDrafter(layer_subset(model, layers), model.cfg.vocab_size, sampling, draft_len,
                             seed=sampling.seed, source=source, shared_weights=True)


# -- the stored choice -----------------------------------------------------------------------------------
def choice_path(session) -> Path:
    """Where the search result for ``session``'s target (weights and numeric mode) is stored."""
    return mtpctl_home() / "self-draft" / f"{session.target_hash()[:16]}-{session.mode}.json"


def stored_or_searched(session, progress: Optional[Callable[[str], None]] = None) -> Tuple[int, ...]:
    """The layers stored for this target and mode; searched (:func:`search_layers`) and stored when
    none are. ``progress`` receives one line before a search starts."""
    path = choice_path(session)
    if path.is_file():
        return read_choice(path, session)
    if progress is not None:
        progress(f"self-draft: choosing the layers on calibration prompts (once for this model and mode; "
                 f"stored in {path})")
    record = search_layers(session)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file(path, json.dumps(record, indent=1) + "\n")
    if progress is not None:
        chosen = next(c for c in record["candidates"] if c["kept"] == len(record["layers"]))
        verdict = "" if chosen["estimated_speedup"] > 1 else ": layer skipping does not pay on this model by this estimate"
        progress(f"self-draft: layers {chosen['layers']} of {session.model.cfg.num_hidden_layers} agree with the "
                 f"target on {chosen['agreement']:.0%} of tokens; estimated {chosen['estimated_speedup']:.2f}x plain "
                 f"at draft length {chosen['draft_len']}{verdict}")
    return tuple(record["layers"])


def read_choice(path: Path, session) -> Tuple[int, ...]:
    """The layers of a stored search result, checked to be made for ``session``'s target.

    Raises:
        BadInput: unreadable, not a self-draft choice of this format, or made for other weights.
    """
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BadInput(f"cannot read the self-draft choice {path}: {err}", option="draft_model") from err
    if not isinstance(record, dict) or record.get("kind") != KIND or record.get("format_version") != FORMAT_VERSION:
        raise BadInput(f"{path} is not a self-draft choice (format_version {FORMAT_VERSION}); delete it to search "
                       "again", option="draft_model")
    if record.get("target_sha256") != session.target_hash():
        raise BadInput(f"the self-draft choice {path} was made for other weights ({record.get('target')}); delete it "
                       "to search again", option="draft_model")
    layers = record.get("layers")
    if not isinstance(layers, list) or not layers or not all(isinstance(i, int) and i >= 0 for i in layers):
        raise BadInput(f"the self-draft choice {path} holds no list of layers", option="draft_model")
    return parse_layers(format_layers(sorted(layers)), session.model.cfg.num_hidden_layers)


# -- the search --------------------------------------------------------------------------------------------
def calibration_sequences(session) -> List[Tuple[List[int], int]]:
    """``(ids, start)`` per calibration prompt: its last :data:`PROMPT_TOKENS` prompt tokens and the
    target's first :data:`ANSWER_TOKENS` greedy tokens; positions from ``start`` on predict answer
    tokens."""
    last: Dict[str, dict] = {}
    for line in CALIBRATION_PROMPTS.read_text(encoding="utf-8").splitlines():
        if line.strip():
            record = json.loads(line)
            last[record["category"]] = record
    sequences = []
    for record in last.values():
        messages = record.get("messages") or [{"role": "user", "content": record["prompt"]}]
        ids = session.codec.encode_messages(messages)[-PROMPT_TOKENS:]
        answer = session.generate(ids, ANSWER_TOKENS, SamplingParams()).token_ids
        sequences.append((ids + answer, len(ids) - 1))
    return sequences


class _Agreement:
    """Teacher-forced agreement of layer subsets with the full target on calibration sequences: the
    share of answer positions where the subset's argmax is the target's. Keeps the hidden states that
    enter each layer of the full model, so a subset that keeps the first k layers starts from there."""

    def __init__(self, model: Decoder, sequences: Sequence[Tuple[List[int], int]]):
        self.model = model
        self.passes = [_Prefill(model, ids, start) for ids, start in sequences]
        self.inputs: List[List[torch.Tensor]] = []  # per sequence, the hidden states entering each layer
        self.targets: List[torch.Tensor] = []
        for prefill in self.passes:
            x, states = prefill.embed(), []
            for index in range(model.cfg.num_hidden_layers):
                states.append(x)
                x = prefill.layer(index, x)
            self.inputs.append(states)
            self.targets.append(prefill.argmax(x))

    def __call__(self, layers: Sequence[int]) -> float:
        """Agreement of the model run through ``layers`` (increasing) with the full model."""
        full = range(self.model.cfg.num_hidden_layers)
        skip = next((k for k, (a, b) in enumerate(zip(layers, full)) if a != b), len(layers))  # the shared prefix
        agree = total = 0
        for prefill, states, target in zip(self.passes, self.inputs, self.targets):
            x = states[skip]
            for index in layers[skip:]:
                x = prefill.layer(index, x)
            agree += int((prefill.argmax(x) == target).sum())
            total += len(target)
        return agree / max(total, 1)


class _Prefill:
    """One calibration sequence run layer by layer through the target (a prefill on a scratch KV
    cache: each layer writes its own slots, nothing is kept)."""

    def __init__(self, model: Decoder, ids: List[int], start: int):
        self.model, self.ids, self.start = model, ids, start
        n = len(ids)
        self.cache = model.new_cache(n)
        self.positions = positions = torch.arange(n, device=model.device)[None]
        self.masks = plans_on(attention_masks(model.cfg.layer_windows, 0, torch.arange(n), None, n), model.device)
        self.ropes = {local: tuple(t.unsqueeze(2) for t in model.rope(positions, local)) for local in (False, True)}

    def embed(self) -> torch.Tensor:
        model = self.model
        x = torch.nn.functional.embedding(torch.tensor([self.ids], device=model.device), model.embed)
        return x * model.embed_scale if model.embed_scale is not None else x

    def layer(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """The full model's layer ``index`` on hidden states ``x`` ``[1, n, hidden]``."""
        model = self.model
        cos, sin = self.ropes[model.local_rope[index]]
        with torch.inference_mode():
            return model.layers[index](x, cos, sin, self.cache, self.masks[model.cfg.layer_windows[index]],
                                       positions=self.positions)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """The argmax ``[m]`` at the positions that predict answer tokens."""
        model = self.model
        with torch.inference_mode():
            return model.logits(model.final_norm(x[0, self.start:-1], model.norm, model.cfg.rms_norm_eps)).argmax(-1)


def estimated_speedup(agreement: float, kept_share: float, draft_len: int) -> float:
    """Tokens per unit of time against plain decoding, for a chain of ``draft_len`` draft tokens each
    accepted with probability ``agreement`` (independently), a draft token costing ``kept_share`` of a
    target step and a verify pass costing one target step."""
    a = min(agreement, 1.0 - 1e-9)
    tokens = (1 - a ** (draft_len + 1)) / (1 - a)
    return tokens / (1 + draft_len * kept_share)


def search_layers(session) -> dict:
    """Choose the layers of ``session``'s self-draft by measured agreement on the calibration
    prompts: each layer's importance (the agreement without it), then subsets dropping the least
    important layers first, down to :data:`MIN_SHARE` of the layers; the subset whose best draft
    length gives the highest :func:`estimated_speedup` wins. Returns the record to store (versioned
    JSON: target, mode, calibration, every subset's figures, the layers chosen). Deterministic for a
    given target and numeric mode."""
    model = session.model
    cfg = model.cfg
    n_layers = cfg.num_hidden_layers
    agreement = _Agreement(model, calibration_sequences(session))
    importance = [agreement([i for i in range(n_layers) if i != drop]) for drop in range(n_layers)]
    order = sorted(range(n_layers), key=lambda i: (importance[i], i))  # most needed first: the least agreement without it
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_layer = cfg.hidden_size * (2 * q + 2 * kv + 3 * cfg.intermediate_size)  # multiply-adds per token
    head = cfg.vocab_size * cfg.hidden_size
    candidates = []
    for kept in range(n_layers - 1, max(1, round(n_layers * MIN_SHARE)) - 1, -1):
        layers = sorted(order[:kept])
        share = (kept * per_layer + head) / (n_layers * per_layer + head)
        a = agreement(layers)
        best = max(DRAFT_LENGTHS, key=lambda k: estimated_speedup(a, share, k))
        candidates.append({"layers": format_layers(layers), "kept": kept, "agreement": round(a, 4),
                           "cost_share": round(share, 4), "draft_len": best,
                           "estimated_speedup": round(estimated_speedup(a, share, best), 4)})
    chosen = max(candidates, key=lambda c: (c["estimated_speedup"], -c["kept"]))
    return {"format_version": FORMAT_VERSION, "kind": KIND, "target": str(session.folder),
            "target_sha256": session.target_hash(), "mode": session.mode,
            "calibration": {"prompts": str(CALIBRATION_PROMPTS.name), "prompt_tokens": PROMPT_TOKENS,
                            "answer_tokens": ANSWER_TOKENS},
            "importance": [round(a, 4) for a in importance], "candidates": candidates,
            "layers": list(parse_layers(chosen["layers"], n_layers)), "draft_len": chosen["draft_len"],
            "estimated_speedup": chosen["estimated_speedup"]}
