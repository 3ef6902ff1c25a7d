"""Pairing draft models with a target by vocabulary (``mtpctl pair``), id maps, and the drafter built
from a pairing.

A draft model can only propose token ids the target understands. Two checkpoints are compared by
their tokenizers (token strings at every id, added tokens, special tokens, whether BOS/EOS are added,
normalizer, pre-tokenizer, model options and merges) and by the real width of their logits (the
lm_head rows, or the embedding rows when tied, read from the safetensors headers without loading
the weights):

- ``identical``: the same token string at the same id for every id either side can emit (an id with
  a token string below the logits width), the same special tokens and the same tokenization. Logits
  rows past the real vocabulary (padding) do not count, and are never proposed.
- ``mapped``: the same tokenization (base vocabulary strings, merges, normalizer, pre-tokenizer, BOS
  rule), but the strings sit at different ids, one side has extra added tokens, or special tokens
  differ: an id map (draft id -> target id, -1 = none) lets the draft run in the target's ids.
- ``incompatible``: the tokenizations differ (a changed token string, other merges or
  normalization, a different BOS rule): only the cross-tokenizer text mode can pair them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from mtpctl.errors import BadInput, CorruptModel
from mtpctl.files import write_file
from mtpctl.model.tokenizer import TextCodec

IDENTICAL, MAPPED, INCOMPATIBLE = "identical", "mapped", "incompatible"
USABLE = (IDENTICAL, MAPPED)
MAP_FORMAT = 1
#: text encoded to find the special tokens a tokenizer adds around a sequence (its BOS/EOS rule)
PROBE = "Hello world"
SPECIAL_ROLES = ("bos", "eos", "pad", "unk")


@dataclass
class Vocabulary:
    """The token side of one checkpoint folder.

    Attributes:
        strings: id -> token string, base vocabulary and added tokens.
        added: ids of added tokens (special tokens, chat markers, pads).
        embed_rows: rows of ``model.embed_tokens.weight``.
        logits_width: rows of ``lm_head.weight`` (the embedding rows when tied): the real width of
            the logits, which sizes every logits buffer and id map.
        specials: role (bos, eos, pad, unk) -> (token string, id), None where unset.
        adds: the special-token strings the tokenizer puts before and after a text (``prefix``,
            ``suffix``): its BOS/EOS rule.
        rule: normalizer, pre-tokenizer and model options (JSON of the ``tokenizers`` backend).
        merges_sha256: digest of the BPE merges (as string pairs), None without merges.
    """

    folder: Path
    codec: TextCodec
    strings: Dict[int, str]
    added: set
    embed_rows: int
    logits_width: int
    specials: Dict[str, Optional[tuple]]
    adds: Dict[str, List[str]]
    rule: dict
    merges_sha256: Optional[str]

    @property
    def emit(self) -> Dict[int, str]:
        """Ids the model can emit with their strings: a token string and a logits row."""
        return {i: s for i, s in self.strings.items() if i < self.logits_width}

    @property
    def padding_rows(self) -> int:
        """Logits rows without a token string (padding past the real vocabulary)."""
        return self.logits_width - len(self.emit)

    def summary(self) -> dict:
        return {"folder": str(self.folder), "tokens": len(self.strings), "added_tokens": len(self.added),
                "embedding_rows": self.embed_rows, "logits_width": self.logits_width,
                "padding_rows": self.padding_rows,
                "specials": {r: (list(v) if v else None) for r, v in self.specials.items()},
                "adds_before": self.adds["prefix"], "adds_after": self.adds["suffix"]}


def embedding_shapes(folder: Path) -> tuple:
    """(embedding rows, logits width) from the safetensors headers of ``folder`` (no weights loaded).

    Raises:
        CorruptModel: no safetensors file, or no ``embed_tokens.weight`` tensor.
    """
    from safetensors import safe_open

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise CorruptModel(f"no *.safetensors file in {folder}")
    embed = head = None
    for path in files:
        try:
            with safe_open(str(path), "pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    if name.endswith("embed_tokens.weight") and embed is None:
                        embed = handle.get_slice(name).get_shape()
                    elif name.endswith("lm_head.weight"):
                        head = handle.get_slice(name).get_shape()
        except (OSError, ValueError) as err:
            raise CorruptModel(f"cannot read {path}: {err}") from err
    if embed is None:
        raise CorruptModel(f"{folder} has no embed_tokens.weight tensor")
    return int(embed[0]), int((head or embed)[0])


def load_vocabulary(folder: Path) -> Vocabulary:
    """Read the tokenizer and the embedding shapes of a checkpoint folder.

    Raises:
        CorruptModel: unreadable tokenizer or weights (see :class:`TextCodec`, :func:`embedding_shapes`).
    """
    folder = Path(folder)
    codec = TextCodec(folder)
    tok = codec.tokenizer
    backend = getattr(tok, "backend_tokenizer", None)  # a Hugging Face tokenizer's attribute: fast ones only
    if backend is not None:
        strings = {int(i): s for s, i in backend.get_vocab(with_added_tokens=True).items()}
        added = {int(i) for i in backend.get_added_tokens_decoder()}
        spec = json.loads(backend.to_str())
        model = {k: v for k, v in (spec.get("model") or {}).items() if k not in ("vocab", "merges")}
        rule = {"normalizer": spec.get("normalizer"), "pre_tokenizer": spec.get("pre_tokenizer"), "model": model}
        merges = (spec.get("model") or {}).get("merges")
        merges_sha = None if merges is None else hashlib.sha256(json.dumps(
            [m.split(" ", 1) if isinstance(m, str) else list(m) for m in merges]).encode()).hexdigest()
    else:  # a slow tokenizer: compare what it exposes
        strings = {int(i): s for s, i in tok.get_vocab().items()}
        added = {int(i) for i in getattr(tok, "added_tokens_decoder", {})}  # older slow tokenizers lack it
        rule, merges_sha = {"class": type(tok).__name__}, None
    embed_rows, width = embedding_shapes(folder)
    specials = {}
    for role in SPECIAL_ROLES:  # its special tokens by role name: any may be unset
        text, ident = getattr(tok, f"{role}_token", None), getattr(tok, f"{role}_token_id", None)
        specials[role] = (str(text), int(ident)) if text is not None and ident is not None else None
    return Vocabulary(folder, codec, strings, added, embed_rows, width, specials, _adds(tok, strings), rule,
                      merges_sha)


def _adds(tok, strings: Dict[int, str]) -> Dict[str, List[str]]:
    """The token strings ``tok`` adds before and after a text when asked for special tokens."""
    plain = [int(i) for i in tok(PROBE, add_special_tokens=False)["input_ids"]]
    full = [int(i) for i in tok(PROBE)["input_ids"]]
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return {"prefix": [strings.get(i, str(i)) for i in full[:start]],
                    "suffix": [strings.get(i, str(i)) for i in full[start + len(plain):]]}
    return {"prefix": ["?"], "suffix": ["?"]}  # specials inside the text: no simple rule


@dataclass
class Pairing:
    """The verdict on one draft: ``identical``, ``mapped`` or ``incompatible``, why, and the evidence.

    ``id_map``: ``[draft logits_width]`` target id of each draft id, -1 where the target has no such
    token or the row is padding (never proposed); None for ``incompatible``.
    """

    target: Vocabulary
    draft: Vocabulary
    verdict: str
    reasons: List[str]
    evidence: dict
    id_map: Optional[List[int]] = field(default=None, repr=False)

    @property
    def usable(self) -> bool:
        """The draft runs in the target's ids (identical or mapped)."""
        return self.verdict in USABLE

    @property
    def mode(self) -> str:
        return {IDENTICAL: "ids", MAPPED: "mapped ids"}.get(self.verdict, "text (cross-tokenizer)")

    def to_dict(self) -> dict:
        return {"draft": str(self.draft.folder), "verdict": self.verdict, "usable": self.usable,
                "mode": self.mode, "reasons": self.reasons, "evidence": self.evidence}


def compare(target: Vocabulary, draft: Vocabulary) -> Pairing:
    """The verdict on ``draft`` as a drafter for ``target``, with its evidence: sizes, the first id
    whose strings differ (with both strings), special tokens, the BOS/EOS rule, tokenization rule."""
    t_emit, d_emit = target.emit, draft.emit
    evidence: dict = {"target": target.summary(), "draft": draft.summary()}
    first = _first_difference(target.strings, draft.strings)
    evidence["first_difference"] = first
    incompatible: List[str] = []
    for part in ("normalizer", "pre_tokenizer", "model", "class"):
        if target.rule.get(part) != draft.rule.get(part):
            incompatible.append(f"different {part.replace('_', '-')}: {_short(target.rule.get(part))} "
                                f"vs {_short(draft.rule.get(part))}")
    if target.merges_sha256 != draft.merges_sha256:
        incompatible.append("different BPE merges")
    for side, name in (("prefix", "before"), ("suffix", "after")):
        if target.adds[side] != draft.adds[side]:
            incompatible.append(f"different BOS/EOS rule: the target adds {target.adds[side]} {name} a text, "
                                f"the draft {draft.adds[side]}")
    t_base = {s for i, s in target.strings.items() if i not in target.added}
    d_base = {s for i, s in draft.strings.items() if i not in draft.added}
    if t_base != d_base:
        only_t, only_d = sorted(t_base - d_base), sorted(d_base - t_base)
        evidence["base_only_in_target"], evidence["base_only_in_draft"] = len(only_t), len(only_d)
        incompatible.append(f"base vocabularies differ: {len(only_t)} strings only in the target, {len(only_d)} "
                            f"only in the draft (first differing id {first['id']}: {first['target']!r} vs "
                            f"{first['draft']!r})" if first else "base vocabularies differ")
    if incompatible:
        return Pairing(target, draft, INCOMPATIBLE, incompatible, evidence)

    t_ids = {s: i for i, s in t_emit.items()}
    id_map = [-1] * draft.logits_width
    for i, s in d_emit.items():
        id_map[i] = t_ids.get(s, -1)
    moved = sum(1 for i, t in enumerate(id_map) if t >= 0 and t != i)
    d_strings = set(d_emit.values())
    draft_only = sorted(s for s in d_emit.values() if s not in t_ids)
    target_only = sorted(s for s in t_emit.values() if s not in d_strings)
    special_diffs = [f"{r}: target {target.specials[r]}, draft {draft.specials[r]}"
                     for r in SPECIAL_ROLES if target.specials[r] != draft.specials[r]]
    evidence.update(ids_moved=moved, draft_only_tokens=draft_only[:8], draft_only_count=len(draft_only),
                    target_only_tokens=target_only[:8], target_only_count=len(target_only),
                    special_token_differences=special_diffs)
    reasons = []
    if moved:
        reasons.append(f"{moved} tokens sit at other ids")
    if draft_only:
        reasons.append(f"{len(draft_only)} added tokens only in the draft (never proposed): {draft_only[:4]}")
    if target_only:
        reasons.append(f"{len(target_only)} added tokens only in the target (a context holding one is not "
                       f"drafted): {target_only[:4]}")
    reasons += [f"special token {d}" for d in special_diffs]
    if reasons:
        return Pairing(target, draft, MAPPED, reasons, evidence, id_map)
    padding = []
    for name, v in (("target", target), ("draft", draft)):
        if v.padding_rows:
            padding.append(f"the {name}'s logits have {v.padding_rows} padding rows past its {len(v.emit)} tokens "
                           "(never proposed)")
    return Pairing(target, draft, IDENTICAL, ["same tokens at the same ids, same special tokens and tokenization"]
                   + padding, evidence, id_map)


def _first_difference(a: Dict[int, str], b: Dict[int, str]) -> Optional[dict]:
    """The smallest id whose token strings differ (a missing id counts as None)."""
    for i in sorted(set(a) | set(b)):
        if a.get(i) != b.get(i):
            return {"id": i, "target": a.get(i), "draft": b.get(i)}
    return None


def _short(value, limit: int = 80) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def pair_folders(target: Path, drafts: Sequence[Path]) -> List[Pairing]:
    """Compare each draft folder with the target folder (tokenizers loaded once each)."""
    t = load_vocabulary(target)
    return [compare(t, load_vocabulary(d)) for d in drafts]


# -- id map files ------------------------------------------------------------------------------------
def write_id_map(path: Path, pairings: Sequence[Pairing]) -> None:
    """Write the id maps of ``pairings`` (JSON, ``format_version`` 1) atomically
    (:func:`mtpctl.files.write_file`).

    Format: ``{"format_version": 1, "kind": "mtpctl-id-map", "target": {"folder", "logits_width"},
    "drafts": [{"folder", "verdict", "logits_width", "draft_to_target": [target id or -1 per draft
    id] or null}]}``.

    Raises:
        BadInput: no pairing, or the file cannot be written.
    """
    if not pairings:
        raise BadInput("no draft to write an id map for")
    target = pairings[0].target
    data = {"format_version": MAP_FORMAT, "kind": "mtpctl-id-map",
            "target": {"folder": str(target.folder), "logits_width": target.logits_width},
            "drafts": [{"folder": str(p.draft.folder), "verdict": p.verdict, "logits_width": p.draft.logits_width,
                        "draft_to_target": p.id_map} for p in pairings]}
    write_file(Path(path), json.dumps(data))


def read_id_map(path: Path, target: Path, draft: Path, target_width: int, draft_width: int) -> Optional[List[int]]:
    """The draft -> target id map for (``target``, ``draft``) from an id map file; None when the
    pair is ``incompatible``.

    Raises:
        BadInput: unreadable file, unknown format, no entry for this pair, or widths that differ from
            the models' (the map was made for other checkpoints).
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BadInput(f"cannot read id map {path}: {err}") from err
    if not isinstance(data, dict) or data.get("kind") != "mtpctl-id-map" or data.get("format_version") != MAP_FORMAT:
        raise BadInput(f"{path} is not an mtpctl id map (format_version {MAP_FORMAT}); make one with mtpctl pair --out",
                       option="draft_map")
    def same(a, b) -> bool:
        return Path(a).resolve() == Path(b).resolve()

    if not same(data["target"]["folder"], target) or data["target"]["logits_width"] != target_width:
        raise BadInput(f"id map {path} was made for target {data['target']['folder']}, not {target}")
    for entry in data.get("drafts", []):
        if same(entry["folder"], draft):
            if entry["logits_width"] != draft_width:
                raise BadInput(f"id map {path}: the draft's logits width is {draft_width}, the map has "
                               f"{entry['logits_width']}")
            return entry["draft_to_target"]
    raise BadInput(f"id map {path} has no entry for draft {draft}")


# -- the drafter of a pairing --------------------------------------------------------------------------
def load_draft(folder, session):
    """The draft model of checkpoint ``folder`` in the target ``session``'s dtype, on its device and its
    kernel path (:class:`~mtpctl.backends.torch.TorchSession`).

    Raises:
        CorruptModel, UnsupportedModel: see :meth:`~mtpctl.model.decoder.Decoder.from_folder`.
    """
    from mtpctl.model.decoder import Decoder

    model, native = session.model, session.kernels == "native"
    draft = Decoder.from_folder(folder, model.dtype, blocked=native, native_int4=None if native else False,
                                device=model.device)
    if not native:
        draft.hold_fixed_rows(session.placement.rows, device_path=session.placement.device.type != "cpu")
    return draft


def draft_model_drafter(pairing: Pairing, draft_model, target_vocab: int, sampling, draft_len: Optional[int],
                        id_map: Optional[List[int]] = None, seed: Optional[int] = None):
    """A :class:`~mtpctl.drafters.draft_model.DraftModelDrafter` for a pairing: ids (identical, the
    padding rows masked), an id map (mapped; ``id_map`` overrides the computed one, e.g. read from
    ``--draft-map``) or the cross-tokenizer text mode (incompatible).

    Args:
        draft_model: the draft :class:`~mtpctl.model.decoder.Decoder`.
        target_vocab: the target's logits width (its lm_head rows).
        draft_len: fixed draft length, None for auto.
    """
    import torch

    from mtpctl.drafters.draft_model import DraftModelDrafter, TextBridge

    if pairing.usable:
        mapping = id_map if id_map is not None else pairing.id_map
        identity = len(mapping) == target_vocab and all(t == i for i, t in enumerate(mapping))
        return DraftModelDrafter(draft_model, target_vocab, sampling, draft_len, id_map=None if identity else mapping,
                                 seed=seed, pairing=pairing)
    draft = pairing.draft
    allowed = torch.zeros(draft.logits_width, dtype=torch.bool)
    allowed[list(draft.emit)] = True
    bridge = TextBridge.from_tokenizers(pairing.target.codec.tokenizer, draft.codec.tokenizer,
                                        sorted(draft.codec.eos_ids))
    return DraftModelDrafter(draft_model, target_vocab, sampling, draft_len, text=bridge, allowed=allowed, seed=seed,
                             pairing=pairing)


def session_drafter(session, draft_spec: str, sampling, draft_len: Optional[int], draft_map: Optional[Path] = None):
    """A draft-model drafter for ``session``'s target: resolve ``draft_spec``, pair it with the target,
    load its weights in the target's dtype and build the drafter (ids, id map, or cross-tokenizer
    text); its ``pairing`` says which.

    Args:
        session: a :class:`~mtpctl.backends.torch.TorchSession` (the target).
        draft_spec: alias, folder, .gguf file or hub id of the draft (:func:`resolve_model`).
        draft_len: fixed draft length, None for ``auto``.
        draft_map: an id map file from ``mtpctl pair --out`` (else the map is computed here).

    Raises:
        BadInput: a session without a torch model (exported backends), an id map for other models.
        ModelNotFound, CorruptModel, UnsupportedModel: the draft cannot be resolved or loaded.
    """
    from mtpctl.model.sources import resolve_model

    model = session.model  # None: an exported graph
    if model is None:
        raise BadInput(f"draft models draft for the torch backend only, not {session.backend}", option="backend")
    folder = resolve_model(draft_spec)
    pairing = compare(load_vocabulary(session.folder), load_vocabulary(folder))
    id_map = None
    if draft_map is not None:
        id_map = read_id_map(draft_map, session.folder, folder, pairing.target.logits_width, pairing.draft.logits_width)
    draft = load_draft(folder, session)
    return draft_model_drafter(pairing, draft, model.cfg.vocab_size, sampling, draft_len, id_map, sampling.seed)
