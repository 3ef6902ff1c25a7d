"""A checkpoint folder written again with some tensors' values replaced (:func:`rewrite_checkpoint`, what
``add-heads --kind mtp`` writes back: the refreshed MTP layer in place) or with tensors added in one new
shard (:func:`add_tensors`, what ``add-heads --kind mtp --graft`` writes: a new MTP layer), nothing else
changed."""

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

#: the shard :func:`add_tensors` writes the added tensors to by default
ADDED_SHARD = "model-mtp.safetensors"


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
    _check_not_src(src, out)
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
        for entry in _entries(src):
            dest = tmp / entry.name
            if entry.name == INDEX:
                _write_index(entry, dest, infos)
            elif entry.resolve() in touched:
                _rewrite_shard(entry, dest, values)
            else:
                _copy_entry(entry, dest)
        _write_notes(tmp, notes)
    return out


def add_tensors(src: Path, out: Path, added: Dict[str, torch.Tensor], config: Optional[dict] = None,
                overwrite: bool = False, notes: Optional[Dict[str, dict]] = None, shard: str = ADDED_SHARD) -> Path:
    """Write ``out``: the checkpoint folder ``src`` with the tensors ``added`` (name -> value, stored in
    the value's dtype) in one new shard ``shard``, every shard of ``src`` hard-linked unchanged (as
    :func:`rewrite_checkpoint` links them), ``model.safetensors.index.json`` naming the new tensors'
    shard (created where ``src`` has none: its weight map names every tensor's file), ``config.json``
    replaced by ``config`` where given, every other file and folder copied, ``notes`` written beside
    them. Atomic, as :func:`rewrite_checkpoint`.

    Raises:
        BadInput: ``out`` is ``src``, or exists without ``overwrite``.
        CorruptModel: an added name the checkpoint already has, or ``src`` already has a file ``shard``.
    """
    from safetensors.torch import save_file

    src, out = Path(src), Path(out)
    _check_not_src(src, out)
    infos = read_headers(shard_files(src))
    clash = sorted(set(added) & set(infos))
    if clash:
        raise CorruptModel(f"{src} already has the tensor {clash[0]!r}")
    if (src / shard).exists():
        raise CorruptModel(f"{src} already has a file {shard}")
    tensors = {name: value.detach().to("cpu").clone(memory_format=torch.contiguous_format)  # own storage each
               for name, value in added.items()}
    with output_folder(out, overwrite) as tmp:
        written = {INDEX} | ({"config.json"} if config is not None else set())
        for entry in _entries(src):
            if entry.name not in written:
                _copy_entry(entry, tmp / entry.name)
        save_file(tensors, str(tmp / shard), metadata={"format": "pt"})
        if (src / INDEX).exists():
            index = json.loads((src / INDEX).read_text(encoding="utf-8"))
        else:
            index = {"metadata": {}, "weight_map": {name: Path(info.path).name for name, info in infos.items()}}
        index["weight_map"] = {**index.get("weight_map", {}), **{name: shard for name in tensors}}
        index.setdefault("metadata", {})["total_size"] = \
            sum(info.nbytes for info in infos.values()) + sum(t.numel() * t.element_size() for t in tensors.values())
        (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        if config is not None:
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        _write_notes(tmp, notes)
    return out


def _check_not_src(src: Path, out: Path) -> None:
    if out.resolve() == src.resolve():
        raise BadInput(f"{out} is the checkpoint itself: write the new checkpoint to another folder", option="out")


def _entries(src: Path):
    """The files and folders of ``src`` a new checkpoint folder takes (hidden ones left out), in name order."""
    return [entry for entry in sorted(src.iterdir()) if not entry.name.startswith(".")]


def _copy_entry(entry: Path, dest: Path) -> None:
    """A folder copied, a shard linked (:func:`_link_or_copy`), any other file copied."""
    if entry.is_dir():
        shutil.copytree(entry, dest)
    elif entry.suffix == ".safetensors":
        _link_or_copy(entry, dest)
    else:
        shutil.copy2(entry, dest)


def _write_notes(folder: Path, notes: Optional[Dict[str, dict]]) -> None:
    for name, note in (notes or {}).items():
        (folder / name).write_text(json.dumps(note, indent=2) + "\n", encoding="utf-8")


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
