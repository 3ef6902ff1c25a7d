"""``mtpctl export --format vllm|trtllm``: trained Medusa heads in the checkpoint layouts that serving
engines load, and the way back into :class:`mtpctl.drafters.heads.medusa.MedusaHeads`.

Layouts (facts read from the engines' loaders; the tensors are mtpctl's own, renamed):

vLLM (``vllm/model_executor/models/medusa.py``, ``vllm/transformers_utils/configs/medusa.py``): a
folder with ``config.json`` (``model_type: "medusa"``, ``architectures: ["MedusaModel"]``,
``hidden_size``, ``vocab_size``, ``num_heads``, ``num_hidden_layers`` = residual blocks per head,
``truncated_vocab_size``, ``medusa_fc_bias``, ``original_lm_head``, ``max_paths``, ``topk``) and
``model.safetensors`` with ``blocks.{k}.layers.{j}.weight`` ``[hidden, hidden]`` and ``.bias``
``[hidden]``, ``lm_heads.{k}.weight`` ``[vocab | truncated_vocab, hidden]`` (with ``original_lm_head``
one shared ``lm_heads.0.weight``), and ``token_map`` ``[truncated_vocab]`` for a draft vocabulary.
Served with ``--speculative-config '{"method": "medusa", "model": OUT, ...}'``.

TensorRT-LLM (``tensorrt_llm/models/medusa``: ``load_medusa_hf`` and ``MedusaConfig``; the layout of
the original Medusa repository): a folder with ``config.json`` (``medusa_num_heads`` and
``num_medusa_heads``, ``medusa_num_layers``, ``hidden_size``, ``vocab_size``,
``base_model_name_or_path``) and ``medusa_lm_head.safetensors`` with ``{k}.{j}.linear.weight``
``[hidden, hidden]``, ``{k}.{j}.linear.bias`` ``[hidden]`` and ``{k}.{L}.weight`` ``[vocab, hidden]``
(L = blocks per head: the head's vocabulary projection). Converted with TensorRT-LLM's
``examples/medusa/convert_checkpoint.py --model_dir TARGET --medusa_model_dir OUT``. The layout has
no draft vocabulary: truncated heads are refused.

Both folders also carry ``mtpctl`` in ``config.json`` (target hash, tree, held-out accuracy) so
that :func:`load_serving_heads` restores the exact :class:`HeadsConfig`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Dict, Optional

import torch

from mtpctl.drafters.heads.config import HeadsConfig
from mtpctl.drafters.heads.medusa import MedusaHeads
from mtpctl.errors import BadInput, CorruptModel, UnsupportedModel
from mtpctl.export.heads import exportable_heads
from mtpctl.files import output_folder
from mtpctl.model.decoder import Decoder
from mtpctl.model.weights import weights_hash

FORMATS = ("vllm", "trtllm")
VLLM_WEIGHTS = "model.safetensors"
TRTLLM_WEIGHTS = "medusa_lm_head.safetensors"


def _mtpctl_meta(cfg: HeadsConfig) -> dict:
    return {k: v for k, v in asdict(cfg).items() if k != "training"}


def vllm_tensors(heads: MedusaHeads, target_lm_head: torch.Tensor) -> Dict[str, torch.Tensor]:
    """vLLM tensor name -> tensor (float32, contiguous) for ``heads``; ``target_lm_head`` ``[vocab,
    hidden]`` is written as the shared ``lm_heads.0.weight`` of heads without their own."""
    cfg = heads.cfg
    out: Dict[str, torch.Tensor] = {}
    for k, blocks in enumerate(heads.blocks):
        for j, block in enumerate(blocks):
            out[f"blocks.{k}.layers.{j}.weight"] = block.linear.weight
            out[f"blocks.{k}.layers.{j}.bias"] = block.linear.bias
    if heads.lm_heads is not None:
        for k, w in enumerate(heads.lm_heads):
            out[f"lm_heads.{k}.weight"] = w  # [V_d or vocab, hidden]
    else:  # vLLM slices a full lm_head by token_map itself
        out["lm_heads.0.weight"] = target_lm_head
    if cfg.draft_vocab_size:
        out["token_map"] = heads.token_map
    return {k: (v.detach().float() if v.is_floating_point() else v.detach()).contiguous() for k, v in out.items()}


def vllm_config(cfg: HeadsConfig) -> dict:
    """vLLM's Medusa ``config.json`` for heads of ``cfg``."""
    tree = cfg.tree or [[0]]
    return {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size, "num_heads": cfg.num_heads, "num_hidden_layers": cfg.head_layers,
            "truncated_vocab_size": cfg.draft_vocab_size or cfg.vocab_size, "medusa_fc_bias": True,
            "original_lm_head": not cfg.own_lm_head, "max_paths": len(tree),
            "topk": 1 + max(r for path in tree for r in path), "torch_dtype": "float32", "mtpctl": _mtpctl_meta(cfg)}


def trtllm_tensors(heads: MedusaHeads, target_lm_head: torch.Tensor) -> Dict[str, torch.Tensor]:
    """TensorRT-LLM (original Medusa) tensor name -> tensor for ``heads``; each head's vocabulary
    projection is its own lm_head, or a copy of ``target_lm_head`` for heads that share it.

    Raises:
        BadInput: heads with a truncated draft vocabulary (the layout has no token_map).
    """
    cfg = heads.cfg
    if cfg.draft_vocab_size:
        raise BadInput("TensorRT-LLM's Medusa layout has no draft vocabulary (token_map): export heads "
                       "trained on the full vocabulary, or in vLLM's layout", option="fmt")
    out: Dict[str, torch.Tensor] = {}
    for k, blocks in enumerate(heads.blocks):
        for j, block in enumerate(blocks):
            out[f"{k}.{j}.linear.weight"] = block.linear.weight
            out[f"{k}.{j}.linear.bias"] = block.linear.bias
        out[f"{k}.{cfg.head_layers}.weight"] = heads.lm_heads[k] if heads.lm_heads is not None else target_lm_head
    return {k: v.detach().float().contiguous() for k, v in out.items()}


def trtllm_config(cfg: HeadsConfig) -> dict:
    """The Medusa heads' ``config.json`` that TensorRT-LLM's checkpoint converter reads."""
    return {"medusa_num_heads": cfg.num_heads, "num_medusa_heads": cfg.num_heads,
            "medusa_num_layers": cfg.head_layers, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
            "base_model_name_or_path": cfg.target, "max_draft_len": max(len(cfg.tree or [[0]]), 1),
            "medusa_choices": cfg.tree, "mtpctl": _mtpctl_meta(cfg)}


def write_serving_heads(fmt: str, heads: MedusaHeads, target_lm_head: torch.Tensor, folder: Path) -> None:
    """Write ``heads`` in layout ``fmt`` (vllm | trtllm) into the existing empty ``folder``."""
    from safetensors.torch import save_file

    if heads.cfg.token_conditioned:
        raise UnsupportedModel("token-conditioned heads have no place in vLLM's or TensorRT-LLM's Medusa layout: "
                               "train plain Medusa heads (no token conditioning) to serve them there", option="fmt")
    if fmt == "vllm":
        tensors, config, name = vllm_tensors(heads, target_lm_head), vllm_config(heads.cfg), VLLM_WEIGHTS
    elif fmt == "trtllm":
        tensors, config, name = trtllm_tensors(heads, target_lm_head), trtllm_config(heads.cfg), TRTLLM_WEIGHTS
    else:
        raise BadInput(f"unknown format {fmt!r} (choose from {', '.join(FORMATS)})", option="fmt")
    # a shared tensor is written once per name (safetensors refuses aliases)
    save_file({k: v.clone() for k, v in tensors.items()}, str(Path(folder) / name), metadata={"format": "pt"})
    (Path(folder) / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def export_serving_heads(fmt: str, model_folder: Path, heads_dir: Path, out: Path, overwrite: bool = False) -> dict:
    """Export the heads in ``heads_dir`` (made for the checkpoint in ``model_folder``) to ``out`` in
    layout ``fmt``; written to a temporary folder and renamed. Returns ``config.json``.

    Raises:
        BadInput: ``out`` exists without ``overwrite``; heads of another model; truncated heads for trtllm.
        CorruptModel, UnsupportedModel: unreadable checkpoint or heads.
    """
    with output_folder(Path(out), overwrite) as tmp:
        model = Decoder.from_folder(Path(model_folder), torch.float32)
        heads = exportable_heads(Path(heads_dir), model, weights_hash(Path(model_folder)))
        write_serving_heads(fmt, heads, model.dense_lm_head(), tmp)
        config = json.loads((tmp / "config.json").read_text(encoding="utf-8"))
    return config


def load_serving_heads(folder: Path, target_lm_head: Optional[torch.Tensor] = None) -> MedusaHeads:
    """Read heads written in the vLLM or TensorRT-LLM layout back into :class:`MedusaHeads`.

    Heads whose every vocabulary projection equals ``target_lm_head`` come back sharing it (as
    they were trained); others with their own.

    Raises:
        BadInput: not a vLLM/TensorRT-LLM Medusa folder. CorruptModel: missing or mis-shaped tensors.
    """
    from safetensors.torch import load_file

    folder = Path(folder)
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise BadInput(f"{folder} has no readable config.json: {err}") from err
    meta = config.get("mtpctl")
    if config.get("model_type") == "medusa" and (folder / VLLM_WEIGHTS).is_file():
        t = load_file(str(folder / VLLM_WEIGHTS))
        num_heads, layers = config["num_heads"], config["num_hidden_layers"]
        blocks = [[(t[f"blocks.{k}.layers.{j}.weight"], t[f"blocks.{k}.layers.{j}.bias"]) for j in range(layers)]
                  for k in range(num_heads)]
        projections = [t["lm_heads.0.weight"]] * num_heads if config.get("original_lm_head") else \
            [t[f"lm_heads.{k}.weight"] for k in range(num_heads)]
        token_map = t.get("token_map")
    elif "medusa_num_heads" in config and (folder / TRTLLM_WEIGHTS).is_file():
        t = load_file(str(folder / TRTLLM_WEIGHTS))
        num_heads, layers = config["medusa_num_heads"], config["medusa_num_layers"]
        blocks = [[(t[f"{k}.{j}.linear.weight"], t[f"{k}.{j}.linear.bias"]) for j in range(layers)]
                  for k in range(num_heads)]
        projections = [t[f"{k}.{layers}.weight"] for k in range(num_heads)]
        token_map = None
    else:
        raise BadInput(f"{folder} is not a vLLM or TensorRT-LLM Medusa heads folder")
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    if "original_lm_head" in config:  # vLLM says whether the heads share one projection
        own = not config["original_lm_head"]
    else:  # TensorRT-LLM: every head has one; shared when they all equal the target's
        own = not (target_lm_head is not None and all(
            p.shape == target_lm_head.shape and torch.equal(p, target_lm_head.float()) for p in projections))
    base = HeadsConfig(**meta) if meta else HeadsConfig(kind="medusa", num_heads=num_heads, head_layers=layers,
                                                        own_lm_head=own, hidden_size=hidden, vocab_size=vocab)
    cfg = replace(base, num_heads=num_heads, head_layers=layers, hidden_size=hidden, vocab_size=vocab,
                  own_lm_head=own, draft_vocab_size=0 if token_map is None else int(token_map.shape[0]))
    if own:
        init = torch.zeros(vocab, hidden)  # shape only: each head's projection is copied below
    elif token_map is not None:
        init = projections[0].float()  # the full target lm_head, whose token_map rows the heads use
    else:
        init = None
    heads = MedusaHeads(cfg, torch.float32, init, token_map)
    try:
        with torch.no_grad():
            for k, per_head in enumerate(blocks):
                for j, (w, b) in enumerate(per_head):
                    heads.blocks[k][j].linear.weight.copy_(w)
                    heads.blocks[k][j].linear.bias.copy_(b)
            if own:
                for k, p in enumerate(projections):
                    heads.lm_heads[k].copy_(p[token_map] if token_map is not None and p.shape[0] == vocab else p)
    except RuntimeError as err:
        raise CorruptModel(f"{folder}: a tensor has the wrong shape ({err})") from err
    heads.requires_grad_(False)
    return heads
