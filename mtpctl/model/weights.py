"""Strict safetensors loading: the only way weights enter mtpctl (no pickle, no remote code)."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Mapping, Tuple

import torch

from mtpctl.errors import CorruptModel
from mtpctl.files import sha256_files
from mtpctl.model.config import read_json


def safetensors_files(folder: Path) -> list:
    """The ``*.safetensors`` files of a checkpoint folder, through ``model.safetensors.index.json``
    when there is one. Raises CorruptModel when there are none or the index names a missing file."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(read_json(index).get("weight_map", {}).values()))
        files = [folder / n for n in names]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise CorruptModel(f"{index} names shard(s) that are missing: {', '.join(missing)}")
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CorruptModel(f"no *.safetensors weights in {folder} (mtpctl reads safetensors only)")
    return files


def load_tensors(files, expected: Mapping[str, Tuple[int, ...]], optional=()) -> Dict[str, torch.Tensor]:
    """Read exactly the tensors named in ``expected`` from safetensors ``files``.

    Args:
        files: paths of ``.safetensors`` files.
        expected: tensor name -> shape.
        optional: names that may be absent (e.g. ``lm_head.weight`` of a tied checkpoint).

    Returns:
        name -> tensor, in the file's dtype.

    Raises:
        CorruptModel: a file is truncated or malformed; a tensor is missing, unexpected, mis-shaped,
            or holds NaN or infinite values.
    """
    from safetensors import SafetensorError, safe_open

    tensors: Dict[str, torch.Tensor] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    if name in tensors:
                        raise CorruptModel(f"tensor {name!r} appears twice ({path.name})")
                    tensors[name] = handle.get_tensor(name)
        except SafetensorError as err:
            raise CorruptModel(f"{path} is not a readable safetensors file ({err}); re-create or re-download it") from err
        except OSError as err:
            raise CorruptModel(f"cannot read {path}: {err}") from err
    check_tensors(tensors, expected, optional, source=str(Path(files[0]).parent))
    return tensors


def check_tensors(tensors: Mapping[str, torch.Tensor], expected: Mapping[str, Tuple[int, ...]],
                  optional=(), source: str = "checkpoint") -> None:
    """Raise CorruptModel unless ``tensors`` has exactly the ``expected`` names and shapes, all finite."""
    missing = sorted(set(expected) - set(tensors) - set(optional))
    unexpected = sorted(set(tensors) - set(expected))
    if missing:
        raise CorruptModel(f"{source}: {len(missing)} missing tensor(s), first: {missing[0]!r}")
    if unexpected:
        raise CorruptModel(f"{source}: {len(unexpected)} unexpected tensor(s), first: {unexpected[0]!r}")
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(expected[name]):
            raise CorruptModel(f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(expected[name])}")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise CorruptModel(f"{source}: tensor {name!r} holds NaN or infinite values")


def weights_hash(folder: Path) -> str:
    """sha256 (hex) over the names and bytes of a checkpoint's safetensors files, in name order: the
    identity of a target model that MTP heads and exports refer to. Reads every byte (about 1 s per
    GB here).

    Raises:
        CorruptModel: no safetensors files, or one cannot be read.
    """
    files = safetensors_files(Path(folder))
    try:
        return sha256_files(files)
    except OSError as err:
        raise CorruptModel(f"cannot read the weights of {folder}: {err}") from err
