"""A checkpoint folder written again with some tensors' values replaced and nothing else changed: what
``add-heads --kind mtp`` writes back (the refreshed MTP layer in place in the checkpoint)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Dict, Optional

import torch

from mtpctl.errors import BadInput, CorruptModel
from mtpctl.files import output_folder
from mtpctl.model.weights import INDEX, read_headers, shard_files


def rewrite_checkpoint(src: Path, out: Path, values: Dict[str, torch.Tensor], overwrite: bool = False,
                       notes: Optional[Dict[str, dict]] = None) -> Path:
    """Write ``out``: the checkpoint folder ``src`` with the tensors named in ``values`` holding those
    values (each cast to its tensor's dtype), the same names, dtypes, shapes and shard layout.

    A shard that holds none of them is hard-linked (copied where the file system cannot link: a linked
    shard shares its bytes with ``src``, so neither may be edited in place; mtpctl's writers replace
    files instead); a shard that holds some is written again with its other tensors and its metadata as
    they were; ``model.safetensors.index.json`` is written again (the same weight map, its total size
    from the headers); every other file and folder is copied. ``notes`` (file name -> JSON object) are
    written beside them. The folder is written into a temporary sibling renamed when complete.

    Raises:
        BadInput: ``out`` is ``src``, or exists without ``overwrite``.
        CorruptModel: a name the checkpoint does not have, or a value of another shape.
    """
    src, out = Path(src), Path(out)
    if out.resolve() == src.resolve():
        raise BadInput(f"{out} is the checkpoint itself: write the new checkpoint to another folder", option="out")
    files = shard_files(src)
    infos = read_headers(files)
    for name, value in values.items():
        if name not in infos:
            raise CorruptModel(f"{src} has no tensor {name!r} to replace")
        if tuple(value.shape) != tuple(infos[name].shape):
            raise CorruptModel(f"{name}: new value of shape {tuple(value.shape)}, the checkpoint's is "
                               f"{tuple(infos[name].shape)}")
    touched = {Path(infos[name].path).resolve() for name in values}
    with output_folder(out, overwrite) as tmp:
        for entry in sorted(src.iterdir()):
            dest = tmp / entry.name
            if entry.name.startswith("."):
                continue
            if entry.is_dir():
                shutil.copytree(entry, dest)
            elif entry.name == INDEX:
                _write_index(entry, dest, infos)
            elif entry.resolve() in touched:
                _rewrite_shard(entry, dest, values)
            elif entry.suffix == ".safetensors":
                _link_or_copy(entry, dest)
            else:
                shutil.copy2(entry, dest)
        for name, note in (notes or {}).items():
            (tmp / name).write_text(json.dumps(note, indent=2) + "\n", encoding="utf-8")
    return out


def _rewrite_shard(path: Path, dest: Path, values: Dict[str, torch.Tensor]) -> None:
    """Shard ``path`` written to ``dest`` with the values of ``values`` it holds, its metadata kept."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
        tensors = {}
        for name in handle.keys():
            old = handle.get_tensor(name)
            tensors[name] = values[name].detach().to("cpu", old.dtype).contiguous() if name in values else old
    save_file(tensors, str(dest), metadata=metadata)


def _write_index(path: Path, dest: Path, infos) -> None:
    """The index with its weight map as it was and ``metadata.total_size`` from the shards' headers."""
    index = json.loads(path.read_text(encoding="utf-8"))
    index.setdefault("metadata", {})["total_size"] = sum(info.nbytes for info in infos.values())
    dest.write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


def _link_or_copy(path: Path, dest: Path) -> None:
    """Hard-link the file ``path`` (a symlink's target, as in a hub cache) at ``dest``, else copy it."""
    target = Path(os.path.realpath(path))
    try:
        os.link(target, dest)
    except OSError:
        shutil.copy2(target, dest)
