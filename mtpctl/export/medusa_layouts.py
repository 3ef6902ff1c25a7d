"""Medusa heads in the layouts serving engines load, and the way back into
:class:`~mtpctl.drafters.heads.medusa.MedusaHeads`.

Layouts (facts read from the engines' loaders; the tensors are mtpctl's own, renamed):

vLLM (``vllm/model_executor/models/medusa.py``, ``vllm/transformers_utils/configs/medusa.py``): a
folder with ``config.json`` (``model_type: "medusa"``, ``architectures: ["MedusaModel"]``,
``hidden_size``, ``vocab_size``, ``num_heads``, ``num_hidden_layers`` = residual blocks per head,
``truncated_vocab_size``, ``medusa_fc_bias``, ``original_lm_head``, ``max_paths``, ``topk``) and
``model.safetensors`` with ``blocks.{k}.layers.{j}.weight`` ``[hidden, hidden]`` and ``.bias``
``[hidden]`` (with ``medusa_fc_bias``), ``lm_heads.{k}.weight`` ``[vocab | truncated_vocab, hidden]``
(with ``original_lm_head`` one shared ``lm_heads.0.weight``, the target's full lm_head, which vLLM
slices by ``token_map``), and ``token_map`` ``[truncated_vocab]`` for a draft vocabulary. Served with
``--speculative-config '{"method": "medusa", "model": OUT, ...}'``.

Medusa (the original repository's layout, FasterDecoding/Medusa; what TensorRT-LLM's
``examples/medusa/convert_checkpoint.py --medusa_model_dir`` and ``load_medusa_hf`` read): a folder
with ``config.json`` (``medusa_num_heads``, ``medusa_num_layers``, ``hidden_size``, ``vocab_size``,
``base_model_name_or_path``) and ``medusa_lm_head.safetensors`` (or the original ``medusa_lm_head.pt``
pickle) with ``{k}.{j}.linear.weight`` ``[hidden, hidden]``, ``{k}.{j}.linear.bias`` ``[hidden]`` and
``{k}.{L}.weight`` ``[vocab, hidden]`` (L = blocks per head: the head's vocabulary projection). It
has no draft vocabulary. TensorRT-LLM's converter casts each tensor to its own ``--dtype`` as it
reads it, so the tensors of one file may differ in dtype (heads that share the target's lm_head get
it in the target's dtype). Uploaded configs often give the wrong head count (``medusa_num_heads``):
the tensors decide, and the reader says so.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Dict, List, Optional, Tuple

import torch

from mtpctl.drafters.heads.config import HeadsConfig
from mtpctl.drafters.heads.medusa import MedusaHeads
from mtpctl.errors import BadInput, CorruptModel
from mtpctl.export.entry import meta, mtpctl_entry
from mtpctl.model.weights import check_tensors

VLLM_WEIGHTS = "model.safetensors"
MEDUSA_WEIGHTS = "medusa_lm_head.safetensors"
MEDUSA_PICKLE = "medusa_lm_head.pt"
_MEDUSA_NAME = re.compile(r"^(\d+)\.(\d+)\.(?:linear\.)?(weight|bias)$")
_VLLM_BLOCK = re.compile(r"^blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)$")


def _blocks(cfg: HeadsConfig, state: Dict[str, torch.Tensor], name) -> Dict[str, torch.Tensor]:
    """Each head's residual blocks, renamed by ``name(k, j, part)``."""
    return {name(k, j, part): state[f"blocks.{k}.{j}.linear.{part}"]
            for k in range(cfg.num_heads) for j in range(cfg.head_layers) for part in ("weight", "bias")}


def vllm_tensors(cfg: HeadsConfig, state: Dict[str, torch.Tensor],
                 target_lm_head: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
    """vLLM tensor name -> tensor for heads of ``cfg`` from ``state``, the head folder's tensors by
    :class:`MedusaHeads`' names, each in its own dtype. ``target_lm_head`` ``[vocab, hidden]`` (needed
    by heads without their own lm_heads) is written as the shared ``lm_heads.0.weight``."""
    out = _blocks(cfg, state, lambda k, j, part: f"blocks.{k}.layers.{j}.{part}")
    if cfg.own_lm_head:
        out.update({f"lm_heads.{k}.weight": state[f"lm_heads.{k}"] for k in range(cfg.num_heads)})
    else:  # vLLM slices a full lm_head by token_map itself
        out["lm_heads.0.weight"] = _needed(target_lm_head)
    if cfg.draft_vocab_size:
        out["token_map"] = state["token_map"]
    return out


def vllm_config(cfg: HeadsConfig, dtype: str = "float32") -> dict:
    """vLLM's Medusa ``config.json`` for heads of ``cfg`` (weights in ``dtype``)."""
    tree = cfg.tree or [[0]]
    return {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size, "num_heads": cfg.num_heads, "num_hidden_layers": cfg.head_layers,
            "truncated_vocab_size": cfg.draft_vocab_size or cfg.vocab_size, "medusa_fc_bias": True,
            "original_lm_head": not cfg.own_lm_head, "max_paths": len(tree),
            "topk": 1 + max(r for path in tree for r in path), "torch_dtype": dtype, "mtpctl": meta(cfg)}


def medusa_tensors(cfg: HeadsConfig, state: Dict[str, torch.Tensor],
                   target_lm_head: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
    """Medusa (original repository, TensorRT-LLM) tensor name -> tensor for heads of ``cfg`` from
    ``state`` (as :func:`vllm_tensors`); each head's vocabulary projection is its own lm_head, or
    ``target_lm_head`` itself (one tensor under every head's name, in its own dtype) for heads that
    share it."""
    out = _blocks(cfg, state, lambda k, j, part: f"{k}.{j}.linear.{part}")
    for k in range(cfg.num_heads):
        out[f"{k}.{cfg.head_layers}.weight"] = state[f"lm_heads.{k}"] if cfg.own_lm_head else _needed(target_lm_head)
    return out


def _needed(target_lm_head: Optional[torch.Tensor]) -> torch.Tensor:
    """``target_lm_head``, which heads sharing it cannot be written without (ValueError when None)."""
    if target_lm_head is None:
        raise ValueError("heads that share the target's lm_head need target_lm_head to be written")
    return target_lm_head


def medusa_config(cfg: HeadsConfig, base_model: str) -> dict:
    """The Medusa heads' ``config.json`` of the original layout (what TensorRT-LLM's converter reads);
    ``base_model`` is the target's name where it is served (``base_model_name_or_path``)."""
    return {"medusa_num_heads": cfg.num_heads, "num_medusa_heads": cfg.num_heads,
            "medusa_num_layers": cfg.head_layers, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
            "base_model_name_or_path": base_model, "max_draft_len": max(len(cfg.tree or [[0]]), 1),
            "medusa_choices": cfg.tree, "mtpctl": meta(cfg)}


def detect(config: dict, names) -> Optional[str]:
    """``vllm`` or ``medusa`` when the config and tensor names are Medusa heads in that layout."""
    if config.get("model_type") == "medusa" or any(_VLLM_BLOCK.match(n) for n in names):
        return "vllm"
    if any(_MEDUSA_NAME.match(n) for n in names):
        return "medusa"
    return None


def _counted(found: Dict[int, set], what: str) -> Tuple[int, int]:
    """(heads, blocks per head) of ``found`` (head -> its block indices), every head alike."""
    if not found:
        raise CorruptModel(f"no Medusa head tensors ({what})")
    heads = max(found) + 1
    layers = {len(found.get(k, ())) for k in range(heads)}
    if len(layers) != 1:
        raise CorruptModel(f"the Medusa heads have different numbers of blocks ({sorted(layers)}); each head has the same")
    return heads, layers.pop()


def _note_count(config: dict, keys, found: int, what: str, notes: List[str]) -> None:
    given = next((config[k] for k in keys if k in config), None)
    if given is not None and given != found:
        notes.append(f"config.json says {given} {what}; the weights hold {found}: using {found}")


def read_medusa(layout: str, config: dict, tensors: Dict[str, torch.Tensor], target_lm_head: torch.Tensor,
                notes: List[str]) -> MedusaHeads:
    """Medusa heads from a layout's ``config.json`` and tensors, checked strictly (every tensor named
    and shaped as the counts found in the tensors say, all finite) against the target's lm_head
    ``[vocab, hidden]``. Heads whose every projection is the target's (or its ``token_map`` rows)
    come back sharing it; others with their own.

    Raises:
        BadInput: heads for another hidden size or vocabulary. CorruptModel: missing, unexpected,
            mis-shaped or non-finite tensors; an inconsistent token_map.
    """
    vocab, hidden = target_lm_head.shape
    found: Dict[int, set] = {}
    if layout == "vllm":
        for n in tensors:
            m = _VLLM_BLOCK.match(n)
            if m:
                found.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
        num, layers = _counted(found, "blocks.K.layers.J.weight")
        _note_count(config, ("num_heads",), num, "heads", notes)
        _note_count(config, ("num_hidden_layers",), layers, "blocks per head", notes)
    else:
        for n in tensors:
            m = _MEDUSA_NAME.match(n)
            if m and ".linear." in n:
                found.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
        heads_in_names = {int(m.group(1)) for m in map(_MEDUSA_NAME.match, tensors) if m}
        for k in heads_in_names:
            found.setdefault(k, set())
        num, layers = _counted(found, "K.J.linear.weight")
        _note_count(config, ("medusa_num_heads", "num_medusa_heads"), num, "heads", notes)
        _note_count(config, ("medusa_num_layers",), layers, "blocks per head", notes)
    _check_sizes(config, hidden, vocab)
    token_map = tensors.get("token_map")
    draft = int(token_map.shape[0]) if token_map is not None and token_map.dim() == 1 else 0
    shared = layout == "vllm" and bool(config.get("original_lm_head"))
    bias = layout != "vllm" or config.get("medusa_fc_bias", True)
    expected = {}
    for k in range(num):
        for j in range(layers):
            w, b = (f"blocks.{k}.layers.{j}.weight", f"blocks.{k}.layers.{j}.bias") if layout == "vllm" else \
                (f"{k}.{j}.linear.weight", f"{k}.{j}.linear.bias")
            expected[w] = (hidden, hidden)
            if bias:
                expected[b] = (hidden,)
        if layout != "vllm":
            expected[f"{k}.{layers}.weight"] = (vocab, hidden)
        elif not shared or k == 0:
            expected[f"lm_heads.{k}.weight"] = (vocab if shared or not draft else draft, hidden)
    if token_map is not None:
        expected["token_map"] = (draft,)
    _reject_other_model(tensors, expected, hidden, vocab)
    check_tensors(tensors, expected, source=f"{layout} Medusa heads")
    if token_map is not None and (token_map.is_floating_point() or int(token_map.min()) < 0 or
                                  int(token_map.max()) >= vocab or len(set(token_map.tolist())) != draft):
        raise CorruptModel("token_map holds ids outside the vocabulary, repeats one, or is not integer")
    token_map = token_map.long() if token_map is not None else None
    projections = [tensors["lm_heads.0.weight"]] * num if shared else \
        [tensors[f"lm_heads.{k}.weight"] if layout == "vllm" else tensors[f"{k}.{layers}.weight"] for k in range(num)]
    rows = target_lm_head.float() if token_map is None else target_lm_head.float()[token_map]
    own = not all(p.float().shape in (rows.shape, target_lm_head.shape) and
                  torch.equal(p.float(), rows if p.shape == rows.shape else target_lm_head.float()) for p in projections)
    base = mtpctl_entry(config, ("medusa",)) if isinstance(config.get("mtpctl"), dict) else \
        HeadsConfig(kind="medusa", num_heads=num, head_layers=layers, own_lm_head=own, hidden_size=hidden,
                    vocab_size=vocab, tree=[[0] * d for d in range(1, num + 1)])
    cfg = replace(base, num_heads=num, head_layers=layers, hidden_size=hidden, vocab_size=vocab, own_lm_head=own,
                  draft_vocab_size=draft)
    heads = MedusaHeads(cfg, torch.float32, target_lm_head.float(), token_map)
    with torch.no_grad():
        for k in range(num):
            for j in range(layers):
                prefix = f"blocks.{k}.layers.{j}." if layout == "vllm" else f"{k}.{j}.linear."
                heads.blocks[k][j].linear.weight.copy_(tensors[prefix + "weight"])
                heads.blocks[k][j].linear.bias.copy_(tensors[prefix + "bias"] if bias else torch.zeros(hidden))
            if own:
                p = projections[k].float()
                heads.lm_heads[k].copy_(p[token_map] if token_map is not None and p.shape[0] == vocab else p)
    return heads.requires_grad_(False)


def _check_sizes(config: dict, hidden: int, vocab: int) -> None:
    for key, want in (("hidden_size", hidden), ("vocab_size", vocab)):
        if key in config and config[key] != want:
            raise BadInput(f"these heads were made for a model with {key} {config[key]}; the target has {want}")


def _reject_other_model(tensors: Dict[str, torch.Tensor], expected: Dict[str, tuple], hidden: int, vocab: int) -> None:
    """BadInput when the heads' tensors are shaped for another hidden size or vocabulary (heads of
    another model), before the strict check calls them mis-shaped."""
    for name, shape in expected.items():
        t = tensors.get(name)
        if t is None or t.dim() != 2 or tuple(t.shape) == shape:
            continue
        if t.shape[1] != hidden:
            raise BadInput(f"these heads were made for a model with hidden size {t.shape[1]} ({name}); the target "
                           f"has {hidden}")
        if shape[0] == vocab:
            raise BadInput(f"these heads were made for a vocabulary of {t.shape[0]} tokens ({name}); the target "
                           f"has {vocab}")
