"""``mtpctl export HEADS --format speculators|eagle|vllm|trtllm``: trained heads in the checkpoint
layouts that serving engines load (:mod:`~mtpctl.export.medusa_layouts`,
:mod:`~mtpctl.export.eagle_layouts`), written atomically. The way back is
:func:`mtpctl.export.imports.read_layout`.

Which layout each format writes for each head kind (:data:`WRITES`); every other pair is refused
with one line naming the kinds the format takes and the recipe that trains them:

========================  =============  ===============  ============================
format                    medusa         eagle3           read by
========================  =============  ===============  ============================
``speculators``           --             speculators      vLLM (and the speculators package)
``eagle``                 --             EAGLE            SGLang, vLLM, TensorRT-LLM (PyTorch backend), EAGLE
``vllm``                  vLLM Medusa    speculators      vLLM
``trtllm``                Medusa         EAGLE            TensorRT-LLM (Medusa converter; PyTorch backend)
========================  =============  ===============  ============================

Medusa heads go only without token conditioning (no layout has the token projection), and to
``trtllm`` only without a draft vocabulary. Hydra and mtpctl's ``eagle`` layer (features after the
final norm, ``fc`` over [feature; embedding], normed input and output) are what no engine runs.

Every layout holds the heads only: the engine loads the target itself, by the name the layout
records (:func:`verifier_name`, or the caller's ``verifier``). The target is not loaded here: its
``config.json`` is read, its weights hashed (the heads must be made for them), and for Medusa heads
that share its lm_head (their layouts hold a copy) that one tensor is read alone from its
safetensors file, in its stored dtype (:func:`mtpctl.model.weights.read_lm_head`). The heads keep
the dtype they are stored in unless ``dtype`` is given.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import torch

from mtpctl.drafters.heads.config import HeadsConfig, check_heads_match
from mtpctl.drafters.heads.folder import MODULES, read_head_tensors
from mtpctl.errors import BadInput, CorruptModel, UnsupportedModel
from mtpctl.export import eagle_layouts, medusa_layouts
from mtpctl.files import output_folder
from mtpctl.model.config import DecoderConfig, read_json
from mtpctl.model.families import FAMILIES
from mtpctl.model.weights import read_lm_head, weights_hash

FORMATS = ("speculators", "eagle", "vllm", "trtllm")
#: format -> head kind -> the layout written
WRITES = {"speculators": {"eagle3": "speculators"}, "eagle": {"eagle3": "eagle"},
          "vllm": {"medusa": "vllm", "eagle3": "speculators"}, "trtllm": {"medusa": "medusa", "eagle3": "eagle"}}
#: head kind -> how to train heads of that kind for the default model
RECIPES = {"eagle3": "mtpctl add-heads --recipe recipes/smollm2-135m-eagle3.yaml",
           "medusa": "mtpctl add-heads --recipe recipes/smollm2-135m-medusa.yaml --no-condition-on-token"}
FULL_VOCABULARY = RECIPES["medusa"] + " --draft-vocab 0"  # Medusa heads TensorRT-LLM's layout takes
#: the dtypes heads may be written in (``dtype``)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: model_type -> its causal LM's Hugging Face architecture (its family's), for a target whose config.json does not
#: name its ``architectures`` (transformers writes them on save; hand-written configs may lack them)
ARCHITECTURES = {t: family.architecture for t, family in FAMILIES.items()}
#: torch dtype -> its name in a safetensors header
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}


def check_exportable(fmt: str, cfg: HeadsConfig) -> str:
    """The layout ``fmt`` writes for heads of ``cfg``.

    Raises:
        BadInput: an unknown format. UnsupportedModel: a head kind (or Medusa variant) the format
            cannot express, naming the kinds it takes and how to train them.
    """
    if fmt not in WRITES:
        raise BadInput(f"unknown format {fmt!r} (choose from {', '.join(FORMATS)})", option="fmt")
    kinds = WRITES[fmt]
    if cfg.kind not in kinds:
        train = "; ".join(f"{kind}: {RECIPES[kind]}" for kind in kinds)
        raise UnsupportedModel(f"the {fmt} format takes {' or '.join(kinds)} heads, not {cfg.kind} heads "
                               f"(to train them: {train})", option="fmt")
    if cfg.kind == "medusa" and cfg.token_conditioned:
        raise UnsupportedModel(f"token-conditioned Medusa heads have no place in the {fmt} format's Medusa layout: "
                               f"train plain ones ({RECIPES['medusa']}), or eagle3 heads ({RECIPES['eagle3']})",
                               option="fmt")
    if fmt == "trtllm" and cfg.kind == "medusa" and cfg.draft_vocab_size:
        raise BadInput("TensorRT-LLM's Medusa layout has no draft vocabulary (token_map): train the heads on the "
                       f"full vocabulary ({FULL_VOCABULARY}), or export to vllm", option="fmt")
    return kinds[cfg.kind]


@dataclass(frozen=True)
class Target:
    """What the layouts need of the target checkpoint, all from its ``config.json``: its folder, its
    shapes, its ``architectures`` and ``name``, how the serving machine names it (a hub id or a folder)."""

    folder: Path
    cfg: DecoderConfig
    architectures: List[str]
    name: str


def read_target(folder: Path, verifier: Optional[str] = None) -> Target:
    """The target checkpoint in ``folder``, from its ``config.json`` alone; named ``verifier``, else
    :func:`verifier_name`.

    Raises:
        BadInput: an empty ``verifier``. CorruptModel, UnsupportedModel: see :meth:`DecoderConfig.from_dict`
            and :func:`target_architectures`.
    """
    if verifier is not None and not verifier.strip():
        raise BadInput("the verifier's name is empty: give the target's hub id or its folder on the serving machine",
                       option="verifier")
    raw = read_json(Path(folder) / "config.json")
    return Target(Path(folder), DecoderConfig.from_dict(raw), target_architectures(raw),
                  verifier.strip() if verifier is not None else verifier_name(Path(folder)))


def target_architectures(raw: dict) -> List[str]:
    """The target's ``architectures`` as its ``config.json`` names them; for a config without the key,
    the causal LM of its ``model_type`` (:data:`ARCHITECTURES`).

    Raises:
        CorruptModel: ``architectures`` that is not a list of names, or no key and an unknown model_type.
    """
    found = raw.get("architectures")
    if found is None:  # a config.json without the key: the model_type's own causal LM stands in
        if raw.get("model_type") not in ARCHITECTURES:
            raise CorruptModel(f"config.json names no architectures, and model_type {raw.get('model_type')!r} has "
                               "none mtpctl knows: add the target's architectures to its config.json")
        return [ARCHITECTURES[raw["model_type"]]]
    if not isinstance(found, list) or not found or not all(isinstance(a, str) and a for a in found):
        raise CorruptModel(f"config.json's architectures is {found!r}, not a list of class names")
    return list(found)


def verifier_name(folder: Path) -> str:
    """How a serving machine names the target in ``folder``: the hub id of a folder the Hugging Face
    hub downloaded (``.../models--ORG--NAME/snapshots/REVISION``, where a hub id given as the model
    lands), else the folder's own name (a local checkpoint or an alias's import: the engine loads a
    copy of that folder by that name)."""
    folder = Path(folder).expanduser().resolve()
    repo = folder.parent.parent.name
    if folder.parent.name == "snapshots" and repo.startswith("models--") and len(repo) > len("models--"):
        return repo[len("models--"):].replace("--", "/", 1)
    return folder.name


def read_heads(folder: Path, cfg: HeadsConfig) -> Dict[str, torch.Tensor]:
    """The tensors of the head folder's weights by the names of its kind's module, each in its stored
    dtype, checked as :func:`~mtpctl.drafters.heads.folder.load_heads` checks them (names, shapes,
    finite values, floating point or integer as the module holds them, a token_map of distinct ids
    inside the vocabulary), without building the heads (which would need the target's lm_head).

    Raises:
        CorruptModel: no weights file, or tensors that fail the checks.
    """
    return read_head_tensors(Path(folder), cfg, _heads_on_meta(cfg))


def _heads_on_meta(cfg: HeadsConfig) -> Dict[str, torch.Tensor]:
    """The state dict of heads of ``cfg`` on the meta device: names, shapes and dtypes, no memory."""
    with torch.device("meta"):
        lm_head = torch.zeros(cfg.vocab_size, cfg.hidden_size)
        token_map = torch.zeros(cfg.draft_vocab_size, dtype=torch.long) if cfg.draft_vocab_size else None
        return MODULES[cfg.kind](cfg, torch.float32, lm_head, token_map).state_dict()


def check_dtype(dtype: Optional[str]) -> Optional[torch.dtype]:
    """The torch dtype named ``dtype`` (one of :data:`DTYPES`), or None for None.

    Raises:
        BadInput: another name.
    """
    if dtype is None:
        return None
    if dtype not in DTYPES:
        raise BadInput(f"heads cannot be written in {dtype!r} (choose from {', '.join(DTYPES)})", option="dtype")
    return DTYPES[dtype]


def _cast(tensors: Dict[str, torch.Tensor], dtype: Optional[torch.dtype]) -> Dict[str, torch.Tensor]:
    """``tensors`` with the floating-point ones in ``dtype`` (all unchanged for None)."""
    if dtype is None:
        return tensors
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}


def _dtype_name(tensors) -> str:
    """The dtype of most of the floating-point elements of ``tensors`` (config.json's ``torch_dtype``)."""
    counts: Counter = Counter()
    for t in tensors:
        if t.is_floating_point():
            counts[t.dtype] += t.numel()
    return str(counts.most_common(1)[0][0]).replace("torch.", "") if counts else "float32"


def layout_files(layout: str, cfg: HeadsConfig, state: Dict[str, torch.Tensor], target: Target,
                 lm_head: Optional[torch.Tensor] = None) -> tuple:
    """(tensor name -> tensor, ``config.json``, weights file name) of heads of ``cfg`` in ``layout``,
    from ``state`` (:func:`read_heads`); ``lm_head`` is the target's, for Medusa heads that share it."""
    dtype = _dtype_name([*state.values(), *([lm_head] if lm_head is not None else [])])
    if layout == "vllm":
        return medusa_layouts.vllm_tensors(cfg, state, lm_head), medusa_layouts.vllm_config(cfg, dtype), \
            medusa_layouts.VLLM_WEIGHTS
    if layout == "medusa":
        return medusa_layouts.medusa_tensors(cfg, state, lm_head), medusa_layouts.medusa_config(cfg, target.name), \
            medusa_layouts.MEDUSA_WEIGHTS
    if layout == "speculators":
        config = eagle_layouts.speculators_config(cfg, target.cfg, target.name, target.architectures, dtype)
    else:
        config = eagle_layouts.eagle_config(cfg, target.cfg, dtype)
    return eagle_layouts.eagle3_tensors(cfg, state, layout), config, eagle_layouts.WEIGHTS


def save_tensors(path: Path, tensors: Dict[str, torch.Tensor], metadata: Dict[str, str]) -> None:
    """Write ``tensors`` as a safetensors file, streaming one tensor's bytes at a time. A tensor under
    several names (the target's lm_head as every Medusa head's projection) is written under each
    without a copy in memory: safetensors' ``save_file`` refuses shared tensors. Tensors are laid out
    by element size, largest first, so that every tensor's bytes stay aligned for its dtype; bytes are
    the host's, little-endian as the format requires on every CPU mtpctl runs on (x86-64, AArch64)."""
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header: Dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    for name in order:
        t = tensors[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as handle:
        handle.write(len(raw).to_bytes(8, "little") + raw)
        for name in order:
            handle.write(memoryview(tensors[name].detach().contiguous().view(-1).view(torch.uint8).numpy()))


def export_serving_heads(fmt: str, model_folder: Path, heads_dir: Path, out: Path, overwrite: bool = False,
                         verifier: Optional[str] = None, dtype: Optional[str] = None) -> dict:
    """Export the heads in ``heads_dir`` (made for the checkpoint in ``model_folder``) to ``out`` in
    the layout ``fmt`` writes for their kind, heads only; written to a temporary folder and renamed.
    Returns ``config.json``.

    Args:
        verifier: the target's name where it is served (the speculators layout's verifier
            ``name_or_path``, the Medusa layout's ``base_model_name_or_path``); default
            :func:`verifier_name` of ``model_folder``.
        dtype: ``float32``, ``bfloat16`` or ``float16`` for every floating-point tensor written; by
            default the heads keep their stored dtype and a copy of the target's lm_head the target's.

    Raises:
        BadInput: ``out`` exists without ``overwrite``; heads of another model; an empty ``verifier``,
            an unknown ``dtype``.
        UnsupportedModel: a head kind the format cannot express (see :func:`check_exportable`).
        CorruptModel: unreadable checkpoint or heads.
    """
    cfg = HeadsConfig.load(Path(heads_dir))
    layout = check_exportable(fmt, cfg)
    cast = check_dtype(dtype)
    target = read_target(Path(model_folder), verifier)
    with output_folder(Path(out), overwrite) as tmp:
        check_heads_match(cfg, target.cfg.hidden_size, target.cfg.vocab_size, weights_hash(target.folder))
        state = _cast(read_heads(Path(heads_dir), cfg), cast)
        shared = layout in ("vllm", "medusa") and not cfg.own_lm_head
        lm_head = _cast({"lm_head": read_lm_head(target.folder, target.cfg)}, cast)["lm_head"] if shared else None
        tensors, config, name = layout_files(layout, cfg, state, target, lm_head)
        save_tensors(tmp / name, tensors, {"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return config
