"""Synthetic Hugging Face checkpoints: the shapes of a real config, random weights, for tests and
benchmarks at scale.

:func:`write_synthetic_checkpoint` writes ``config.json`` (the dict given), the weights as
safetensors shards with ``model.safetensors.index.json`` (Hugging Face's names:
``model-00001-of-00004.safetensors``; one shard is ``model.safetensors`` without an index) and,
optionally, a tokenizer copied from another checkpoint folder. The weights are generated and written
a chunk at a time (never the whole model, nor a whole shard, in memory), from a seed: linear weights
and embeddings ``normal(0, std)``, norm weights 1 (so activations stay finite and logits are spread
out, as in a freshly initialized model).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from mtpctl.errors import BadInput
from mtpctl.files import output_folder
from mtpctl.model.config import DecoderConfig
from mtpctl.model.decoder import expected_tensors
from mtpctl.model.weights import INDEX

#: files of a checkpoint folder that make its tokenizer and chat template (those present are copied)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")
#: torch dtype -> safetensors dtype name
DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
#: float32 values generated at a time
CHUNK_VALUES = 1 << 24


def write_synthetic_checkpoint(out: Path, config: dict, shards: int = 1, seed: int = 0,
                               tokenizer_from: Optional[Path] = None, dtype: torch.dtype = torch.bfloat16,
                               std: float = 0.02, overwrite: bool = False, per_expert: bool = True) -> Path:
    """Write a checkpoint folder ``out`` for ``config`` (a ``config.json`` dict) with random weights.

    Args:
        shards: safetensors files the weights are split into (by bytes, in the tensors' order).
        seed: each tensor's values depend on the seed and the tensor's name only (not on ``shards``).
        tokenizer_from: a checkpoint folder whose tokenizer files (:data:`TOKENIZER_FILES`) are copied;
            None writes no tokenizer. The config's ``vocab_size`` may exceed the tokenizer's.
        dtype: of the weights (bfloat16, float16 or float32).
        std: standard deviation of linear weights and embeddings.
        overwrite: replace an existing ``out``.
        per_expert: a MoE config's experts one tensor each (released checkpoints' layout), else stacked.

    Returns:
        ``out``, written atomically (a temporary folder renamed when complete).

    Raises:
        BadInput: ``shards`` < 1 or more than tensors, an unsupported dtype, ``out`` exists.
        UnsupportedModel, CorruptModel: ``config`` is not a config mtpctl loads.
    """
    cfg = DecoderConfig.from_dict(config)
    if dtype not in DTYPE_NAMES:
        raise BadInput(f"synthetic weights are bfloat16, float16 or float32, not {dtype}", option="dtype")
    tensors = checkpoint_tensors(cfg, per_expert)
    groups = split_shards(tensors, shards, dtype.itemsize)
    with output_folder(Path(out), overwrite) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        names = shard_names(len(groups))
        for group, name in zip(groups, names):
            write_shard(tmp / name, group, dtype, seed, std)
        if len(groups) > 1:
            write_index(tmp / INDEX, groups, names, dtype.itemsize)
        if tokenizer_from is not None:
            copy_tokenizer(Path(tokenizer_from), tmp)
    return Path(out)


def checkpoint_tensors(cfg: DecoderConfig, per_expert: bool = True) -> List[Tuple[str, Tuple[int, ...]]]:
    """(name, shape) of every tensor of a checkpoint of ``cfg`` (no ``lm_head.weight`` when tied), in
    Hugging Face's order: embeddings, layers, final norm, lm_head. A MoE model's experts one tensor per
    expert and projection (``per_expert``, what ``save_pretrained`` writes) or stacked."""
    shapes = expected_tensors(cfg, expert_layout_names(cfg) if per_expert else None)
    head = [] if cfg.tie_word_embeddings else [("lm_head.weight", shapes.pop("lm_head.weight"))]
    norm = ("model.norm.weight", shapes.pop("model.norm.weight"))
    return list(shapes.items()) + [norm] + head


def expert_layout_names(cfg: DecoderConfig) -> Optional[set]:
    """Names that make the family's tensor map (:func:`~mtpctl.model.decoder.expected_tensors`) give every
    MoE layer of ``cfg`` its experts one tensor each: each layer's first expert's gate projection; None
    for a dense model."""
    experts = cfg.family.experts
    if cfg.moe is None or experts is None:
        return None
    return {f"model.layers.{n}.{experts.prefix}experts.0.{experts.names[0]}.weight"
            for n in range(cfg.num_hidden_layers)}


def split_shards(tensors: List[Tuple[str, Tuple[int, ...]]], shards: int,
                 itemsize: int) -> List[List[Tuple[str, Tuple[int, ...]]]]:
    """``tensors`` cut, in order, into ``shards`` runs of about equal bytes (none empty)."""
    if not 1 <= shards <= len(tensors):
        raise BadInput(f"shards must be between 1 and {len(tensors)} (the tensors), not {shards}", option="shards")
    sizes = [_numel(shape) * itemsize for _, shape in tensors]
    total, groups, done = sum(sizes), [[] for _ in range(shards)], 0
    for i, (item, size) in enumerate(zip(tensors, sizes)):
        index = min(shards - 1, done * shards // total)
        index = max(index, shards - (len(tensors) - i))  # leave a tensor for each later shard
        index = min(index, _first_empty(groups))
        groups[index].append(item)
        done += size
    return groups


def _first_empty(groups: list) -> int:
    return next((i for i, g in enumerate(groups) if not g), len(groups) - 1)


def shard_names(count: int) -> List[str]:
    """Hugging Face's file names for ``count`` shards."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def write_shard(path: Path, tensors: List[Tuple[str, Tuple[int, ...]]], dtype: torch.dtype, seed: int,
                std: float) -> None:
    """Write one safetensors file, its header first, then each tensor generated a chunk at a time."""
    header, offset = {}, 0
    for name, shape in tensors:
        size = _numel(shape) * dtype.itemsize
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # data aligned to 8 bytes, as safetensors writes it
    with open(path, "wb") as handle:
        handle.write(len(raw).to_bytes(8, "little"))
        handle.write(raw)
        for name, shape in tensors:
            for chunk in tensor_chunks(name, shape, dtype, seed, std):
                handle.write(chunk.view(torch.uint8).numpy())


def tensor_chunks(name: str, shape: Tuple[int, ...], dtype: torch.dtype, seed: int, std: float):
    """The values of tensor ``name`` (flattened) as consecutive chunks of ``dtype``: 1 for norm
    weights, ``normal(0, std)`` otherwise, from a generator seeded by ``seed`` and the name."""
    count = _numel(shape)
    if name.endswith("norm.weight"):
        for begin in range(0, count, CHUNK_VALUES):
            yield torch.ones(min(CHUNK_VALUES, count - begin), dtype=dtype)
        return
    generator = torch.Generator().manual_seed(_tensor_seed(seed, name))
    for begin in range(0, count, CHUNK_VALUES):
        yield torch.randn(min(CHUNK_VALUES, count - begin), generator=generator).mul_(std).to(dtype)


def _tensor_seed(seed: int, name: str) -> int:
    """A seed for one tensor from the checkpoint's seed and the tensor's name (stable across runs)."""
    digest = 0
    for byte in name.encode("utf-8"):
        digest = (digest * 131 + byte) % (1 << 61)
    return (seed * 1_000_003 + digest) % (1 << 63)


def write_index(path: Path, groups: list, names: List[str], itemsize: int) -> None:
    """``model.safetensors.index.json``: total bytes and which shard holds each tensor."""
    weight_map: Dict[str, str] = {}
    total = 0
    for group, file in zip(groups, names):
        for name, shape in group:
            weight_map[name] = file
            total += _numel(shape) * itemsize
    path.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n",
                    encoding="utf-8")


def copy_tokenizer(source: Path, folder: Path) -> None:
    """Copy the tokenizer files of checkpoint folder ``source`` into ``folder``.

    Raises:
        BadInput: ``source`` has no tokenizer.json, tokenizer.model or vocab.json.
    """
    found = [source / n for n in TOKENIZER_FILES if (source / n).is_file()]
    if not any(p.name in ("tokenizer.json", "tokenizer.model", "vocab.json") for p in found):
        raise BadInput(f"{source} has no tokenizer files to copy", option="tokenizer_from")
    for path in found:
        shutil.copyfile(path, folder / path.name)


def checkpoint_bytes(cfg: DecoderConfig, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of the weights of a checkpoint of ``cfg`` in ``dtype`` (the same in either expert layout)."""
    return sum(_numel(shape) for _, shape in checkpoint_tensors(cfg)) * dtype.itemsize


def _numel(shape: Tuple[int, ...]) -> int:
    count = 1
    for n in shape:
        count *= int(n)
    return count
