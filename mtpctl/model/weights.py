"""Strict safetensors loading: the only way weights enter mtpctl (no pickle, no remote code).

A checkpoint is checked by name and shape from its files' headers before any tensor is read; tensors
are then read one at a time (:class:`CheckpointReader`), in chunks, each checked for NaN and
infinite values, so loading holds the weights plus one chunk rather than a second copy of them.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from mtpctl.errors import CorruptModel, UnsupportedModel
from mtpctl.files import sha256_files
from mtpctl.model import fp8, mxfp4
from mtpctl.model.config import DecoderConfig, read_json

INDEX = "model.safetensors.index.json"
EMBEDDING, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
#: safetensors dtype names -> torch dtypes
ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
             "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
             "BOOL": torch.bool}
#: bytes of a tensor read, converted and checked at a time
CHUNK_BYTES = 16 << 20


def safetensors_files(folder: Path) -> list:
    """The ``*.safetensors`` files of a checkpoint folder in name order, through
    ``model.safetensors.index.json`` when there is one. Raises CorruptModel when there are none or the
    index names a missing file."""
    return sorted(shard_files(folder))


def shard_files(folder: Path) -> list:
    """The ``*.safetensors`` files of a checkpoint folder in the order the index's ``weight_map``
    first names them (without an index: in name order).

    Raises:
        CorruptModel: there are none, or the index names a missing file.
    """
    folder = Path(folder)
    index = folder / INDEX
    if index.exists():
        weight_map = read_json(index).get("weight_map", {})
        if not isinstance(weight_map, dict):
            raise CorruptModel(f"{index}: weight_map is not a JSON object")
        files = [folder / n for n in dict.fromkeys(weight_map.values())]
        missing = sorted(f.name for f in files if not f.exists())
        if missing:
            raise CorruptModel(f"{index} names shard(s) that are missing: {', '.join(missing)}")
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CorruptModel(f"no *.safetensors weights in {folder} (mtpctl reads safetensors only)")
    return files


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are: ``nbytes`` bytes from byte ``offset`` of ``path``."""

    path: Path
    dtype: torch.dtype
    shape: Tuple[int, ...]
    offset: int
    nbytes: int


def read_headers(files: Sequence[Path]) -> Dict[str, TensorInfo]:
    """Name -> :class:`TensorInfo` of every tensor of safetensors ``files``, file by file, each file's
    tensors in the order of their bytes. Reads the headers only (safetensors validates them: offsets
    inside the file, sizes that match the shapes).

    Raises:
        CorruptModel: a file is truncated or malformed, or a tensor appears twice.
        UnsupportedModel: a tensor's dtype is one torch cannot hold here.
    """
    infos: Dict[str, TensorInfo] = {}
    for path in map(Path, files):
        for name, info in _file_tensors(path).items():
            if name in infos:
                raise CorruptModel(f"tensor {name!r} appears twice ({infos[name].path.name}, {path.name})")
            infos[name] = info
    return infos


def _file_tensors(path: Path) -> Dict[str, TensorInfo]:
    """The tensors of one safetensors file, in the order of their bytes."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
        header, start = _raw_header(path)
    except SafetensorError as err:
        raise CorruptModel(f"{path} is not a readable safetensors file ({err}); re-create or re-download it") from err
    except (OSError, ValueError) as err:
        raise CorruptModel(f"cannot read {path}: {err}") from err
    infos = {}
    for name in sorted(shapes, key=lambda n: header[n]["data_offsets"][0]):
        begin, end = header[name]["data_offsets"]
        infos[name] = TensorInfo(path, _torch_dtype(path, name, header[name]["dtype"]), shapes[name],
                                 start + begin, end - begin)
    return infos


def _raw_header(path: Path) -> Tuple[dict, int]:
    """(the JSON header of a safetensors file, the byte where its data starts); the file was
    validated by safetensors first."""
    with open(path, "rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(size))
    header.pop("__metadata__", None)
    return header, 8 + size


def _torch_dtype(path: Path, name: str, dtype: str) -> torch.dtype:
    extra = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
    found = ST_DTYPES.get(dtype) or getattr(torch, extra.get(dtype, ""), None)
    if found is None:
        raise UnsupportedModel(f"{path}: tensor {name!r} has dtype {dtype}, which mtpctl cannot load")
    return found


def check_shapes(shapes: Mapping[str, Tuple[int, ...]], expected: Mapping[str, Tuple[int, ...]],
                 optional=(), source: str = "checkpoint") -> None:
    """Raise CorruptModel unless ``shapes`` (name -> shape) has exactly the ``expected`` names and
    shapes (``optional`` names may be absent)."""
    missing = sorted(set(expected) - set(shapes) - set(optional))
    unexpected = sorted(set(shapes) - set(expected))
    if missing:
        raise CorruptModel(f"{source}: {len(missing)} missing tensor(s), first: {missing[0]!r}")
    if unexpected:
        raise CorruptModel(f"{source}: {len(unexpected)} unexpected tensor(s), first: {unexpected[0]!r}")
    for name, shape in shapes.items():
        if tuple(shape) != tuple(expected[name]):
            raise CorruptModel(f"{source}: tensor {name!r} has shape {tuple(shape)}, expected {tuple(expected[name])}")


def check_finite(name: str, tensor: torch.Tensor, source: str = "checkpoint") -> None:
    """Raise CorruptModel when floating-point ``tensor`` holds NaN or infinite values (read from its
    smallest and largest value: NaN propagates into both; no temporary the size of the tensor)."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return
    low, high = torch.aminmax(tensor)
    if not bool(torch.isfinite(low) & torch.isfinite(high)):
        raise CorruptModel(f"{source}: tensor {name!r} holds NaN or infinite values")


def check_tensors(tensors: Mapping[str, torch.Tensor], expected: Mapping[str, Tuple[int, ...]],
                  optional=(), source: str = "checkpoint") -> None:
    """Raise CorruptModel unless ``tensors`` has exactly the ``expected`` names and shapes, all finite."""
    check_shapes({name: tuple(t.shape) for name, t in tensors.items()}, expected, optional, source)
    for name, tensor in tensors.items():
        check_finite(name, tensor, source)


class CheckpointReader:
    """The tensors of safetensors ``files``, checked by name and shape from the headers when opened and
    read one at a time, in chunks of :data:`CHUNK_BYTES`, each chunk checked for NaN and infinite
    values as it is read.

    Block-scaled FP8 weights (:mod:`mtpctl.model.fp8`, with ``fp8_block``) are dequantized as they are
    read, a chunk of rows at a time: such a weight reads as float32 under its own name, and its
    ``_scale_inv`` tensor is consumed (not among :attr:`names`).

    Args:
        files: paths of ``.safetensors`` files; :attr:`names` follows their order.
        expected: tensor name -> shape.
        optional: names that may be absent (e.g. ``lm_head.weight`` of a tied checkpoint).
        source: how messages name the checkpoint (default: the first file's folder).
        ignored: name prefixes of tensors the checkpoint may hold that are not read, left out of
            :attr:`names` (a checkpoint's MTP layers, ``model.layers.{L}.`` past the body's layers).
        renames: (prefix in the files, prefix in ``expected``) pairs, applied after ``ignored``: a
            multimodal checkpoint's text body (``model.language_model.`` read as ``model.``); every name
            here and in messages is the renamed one.
        fp8_block: the weight block of a block-scaled FP8 checkpoint (``DecoderConfig.fp8_block``), None
            for any other.
        mxfp4: the checkpoint's config.json names MXFP4 quantization (``DecoderConfig.mxfp4``): each
            ``W_blocks``/``W_scales`` pair reads as float32 ``W`` (:mod:`mtpctl.model.mxfp4`), an expert at
            a time.

    Raises:
        CorruptModel: see :func:`read_headers`, :func:`check_shapes` and :func:`mtpctl.model.fp8.pair_scales`;
            reads raise it too (a file that ends early, a tensor with NaN or infinite values).
        UnsupportedModel: quantized tensors other than block-scaled FP8 (:func:`mtpctl.model.fp8.pair_scales`).
    """

    def __init__(self, files: Sequence[Path], expected: Mapping[str, Tuple[int, ...]], optional=(),
                 source: Optional[str] = None, ignored: Tuple[str, ...] = (),
                 renames: Tuple[Tuple[str, str], ...] = (), fp8_block: Optional[Tuple[int, int]] = None,
                 mxfp4: bool = False):
        self.source = source or str(Path(files[0]).parent)
        self.infos = read_headers(files)
        if ignored:
            self.infos = {name: info for name, info in self.infos.items() if not name.startswith(tuple(ignored))}
        if renames:
            self.infos = {renamed(name, renames): info for name, info in self.infos.items()}
        self.mx = self._pair_mxfp4(mxfp4)
        pairs = fp8.pair_scales({n: i.shape for n, i in self.infos.items()},
                                {n: i.dtype for n, i in self.infos.items()}, fp8_block, self.source)
        #: FP8 weight name -> its scale's TensorInfo
        self.scales = {weight: self.infos.pop(scale) for weight, scale in pairs.items()}
        self.block = fp8_block
        check_shapes({name: info.shape for name, info in self.infos.items()}, expected, optional, self.source)
        self._maps: Dict[Path, torch.UntypedStorage] = {}

    def _pair_mxfp4(self, enabled: bool) -> Dict[str, Tuple[TensorInfo, TensorInfo]]:
        """MXFP4 stacks (:func:`mtpctl.model.mxfp4.pair_blocks`) -> (blocks, scales), each pair replaced in
        :attr:`infos` by one float32 entry of the model's shape under the name it reads as."""
        pairs = mxfp4.pair_blocks({n: i.shape for n, i in self.infos.items()},
                                  {n: i.dtype for n, i in self.infos.items()}, enabled, self.source)
        out = {}
        for name, (blocks, scales) in pairs.items():
            b, sc = self.infos.pop(blocks), self.infos.pop(scales)
            shape = mxfp4.value_shape(b.shape)
            self.infos[name] = TensorInfo(b.path, torch.float32, shape, b.offset, 4 * math.prod(shape))
            out[name] = (b, sc)
        return out

    @property
    def names(self) -> List[str]:
        """Every tensor's name, file by file, each file's in the order of its bytes."""
        return list(self.infos)

    def __contains__(self, name: str) -> bool:
        return name in self.infos

    def shape(self, name: str) -> Tuple[int, ...]:
        return self.infos[name].shape

    def dtype(self, name: str) -> torch.dtype:
        """The dtype ``name`` has in its file (float32 for a block-scaled FP8 weight: its values)."""
        return torch.float32 if name in self.scales or name in self.mx else self.infos[name].dtype

    def read(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as a new CPU tensor in its file's dtype (see :meth:`dtype`)."""
        out = torch.empty(self.infos[name].shape, dtype=self.dtype(name))
        self.read_into(name, out)
        return out

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Copy tensor ``name`` into ``out``, a contiguous tensor of its shape on any device and of any
        dtype (converted chunk by chunk; a CPU tensor of the file's dtype is read into directly; a
        block-scaled FP8 weight dequantized a chunk of block rows at a time)."""
        info = self.infos[name]
        if tuple(out.shape) != info.shape or not out.is_contiguous():
            raise ValueError(f"read_into {name!r}: out has shape {tuple(out.shape)}, expected a contiguous {info.shape}")
        if name in self.scales:
            self._read_fp8_into(name, out)
            return
        if name in self.mx:
            self._read_mxfp4_into(name, out)
            return
        self._read_plain_into(name, info, out)

    def _read_mxfp4_into(self, name: str, out: torch.Tensor) -> None:
        """Dequantize MXFP4 stack ``name`` into ``out [E, C, R]``, one expert's blocks and scales at a time
        (:func:`mtpctl.model.mxfp4.dequantize`, then transposed)."""
        blocks, scales = self.mx[name]
        codes = torch.empty(blocks.shape[1:], dtype=torch.uint8)
        exps = torch.empty(scales.shape[1:], dtype=torch.uint8)
        with _open(blocks.path) as b_handle, _open(scales.path) as s_handle:
            for e in range(blocks.shape[0]):
                _read_exact(b_handle, blocks.offset + e * codes.numel(), codes, blocks.path)
                _read_exact(s_handle, scales.offset + e * exps.numel(), exps, scales.path)
                values = mxfp4.dequantize(codes, exps)
                check_finite(name, values, self.source)
                out[e].copy_(values.t())

    def _read_plain_into(self, name: str, info: TensorInfo, out: torch.Tensor) -> None:
        flat = out.view(-1)
        direct = out.device.type == "cpu" and out.dtype == info.dtype
        step = max(1, CHUNK_BYTES // info.dtype.itemsize)
        buffer = None if direct else torch.empty(min(step, flat.numel()), dtype=info.dtype)
        with _open(info.path) as handle:
            for begin in range(0, flat.numel(), step):
                part = flat[begin:begin + step]
                target = part if direct else buffer[:part.numel()]
                _read_exact(handle, info.offset + begin * info.dtype.itemsize, target, info.path)
                check_finite(name, target, self.source)
                if not direct:
                    part.copy_(target)

    def _read_fp8_into(self, name: str, out: torch.Tensor) -> None:
        """Dequantize FP8 weight ``name`` (``[..., R, C]``) into ``out``: each matrix read a whole number
        of block rows at a time, about :data:`CHUNK_BYTES` of codes, with the rows of its scale."""
        info, block = self.infos[name], self.block
        scale = torch.empty(self.scales[name].shape, dtype=torch.float32)
        self._read_plain_into(name + fp8.SCALE_SUFFIX, self.scales[name], scale)
        rows, cols = info.shape[-2:]
        step = min(rows, max(1, CHUNK_BYTES // (block[0] * cols)) * block[0])
        mats, scales = out.view(-1, rows, cols), scale.view(-1, *scale.shape[-2:])
        buffer = torch.empty(step, cols, dtype=fp8.FP8)
        with _open(info.path) as handle:
            for m in range(mats.shape[0]):
                for begin in range(0, rows, step):
                    codes = buffer[:min(step, rows - begin)]
                    _read_exact(handle, info.offset + (m * rows + begin) * cols, codes, info.path)
                    first = begin // block[0]  # step is a whole number of block rows
                    values = fp8.dequantize(codes, scales[m, first:first + -(-codes.shape[0] // block[0])], block)
                    check_finite(name, values, self.source)
                    mats[m, begin:begin + codes.shape[0]].copy_(values)

    def mapped(self, name: str) -> Optional[torch.Tensor]:
        """Tensor ``name`` memory-mapped from its file (copy-on-write: nothing is read until used, and
        the pages are the page cache's, not a copy), after checking its values through a read of
        one chunk at a time; None where its bytes are not aligned for its dtype, or for a
        block-scaled FP8 weight (its values are computed)."""
        info = self.infos[name]
        if info.offset % info.dtype.itemsize or name in self.scales or name in self.mx:
            return None
        self._check_values(name)
        storage = self._maps.get(info.path)
        if storage is None:
            storage = torch.UntypedStorage.from_file(str(info.path), shared=False, nbytes=os.path.getsize(info.path))
            self._maps[info.path] = storage
        flat = torch.empty(0, dtype=torch.uint8).set_(storage, info.offset, (info.nbytes,))
        return flat.view(info.dtype).view(info.shape)

    def _check_values(self, name: str) -> None:
        """Read tensor ``name`` a chunk at a time to check it is finite, keeping nothing."""
        info = self.infos[name]
        step = max(1, CHUNK_BYTES // info.dtype.itemsize)
        count = info.nbytes // info.dtype.itemsize
        buffer = torch.empty(min(step, count), dtype=info.dtype)
        with _open(info.path) as handle:
            for begin in range(0, count, step):
                target = buffer[:min(step, count - begin)]
                _read_exact(handle, info.offset + begin * info.dtype.itemsize, target, info.path)
                check_finite(name, target, self.source)


def renamed(name: str, renames: Tuple[Tuple[str, str], ...]) -> str:
    """``name`` with the first of ``renames``' prefixes it starts with replaced."""
    for old, new in renames:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _open(path: Path):
    try:
        return open(path, "rb", buffering=0)
    except OSError as err:
        raise CorruptModel(f"cannot read {path}: {err}") from err


def _read_exact(handle, offset: int, out: torch.Tensor, path: Path) -> None:
    """Fill contiguous CPU tensor ``out`` with the bytes of ``handle`` from ``offset``."""
    view = memoryview(out.view(-1).view(torch.uint8).numpy())
    try:
        handle.seek(offset)
        got = 0
        while got < len(view):
            count = handle.readinto(view[got:])
            if not count:
                raise CorruptModel(f"{path} ends inside a tensor's data (truncated?); re-create or re-download it")
            got += count
    except OSError as err:
        raise CorruptModel(f"cannot read {path}: {err}") from err


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
    reader = CheckpointReader([Path(f) for f in files], expected, optional)
    return {name: reader.read(name) for name in reader.names}


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


def read_checkpoint_tensor(folder: Path, name: str) -> torch.Tensor:
    """Tensor ``name`` of the checkpoint in ``folder``, in its stored dtype, read alone (safetensors'
    ``safe_open``) from the shard ``model.safetensors.index.json`` names for it, else from whichever
    ``*.safetensors`` file holds it.

    Raises:
        CorruptModel: no file holds it; an unreadable file or index.
    """
    from safetensors import SafetensorError, safe_open

    folder = Path(folder)
    files = safetensors_files(folder)
    if (folder / INDEX).exists():
        weight_map = read_json(folder / INDEX).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CorruptModel(f"{folder / INDEX}: weight_map is not a JSON object")
        files = [folder / weight_map[name]] if name in weight_map else []
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                if name in handle.keys():
                    return handle.get_tensor(name)
        except (SafetensorError, OSError) as err:
            raise CorruptModel(f"{path} is not a readable safetensors file ({err}); re-create or re-download "
                               "it") from err
    raise CorruptModel(f"{folder}: no safetensors file holds {name!r}")


def read_vocab_tensor(folder: Path, cfg: DecoderConfig, name: str) -> torch.Tensor:
    """Tensor ``name`` ``[vocab, hidden]`` of the checkpoint in ``folder`` (``cfg`` its config), read
    alone in its stored dtype (a block-scaled FP8 one dequantized to float32), checked for shape and
    finite values.

    Raises:
        CorruptModel: see :func:`read_checkpoint_tensor`; a mis-shaped or non-finite tensor.
        UnsupportedModel: a quantized tensor other than block-scaled FP8 (:func:`mtpctl.model.fp8.pair_scales`).
    """
    tensor = read_checkpoint_tensor(folder, name)
    if tensor.dtype == fp8.FP8 and cfg.fp8_block is not None:
        scale_name = name + fp8.SCALE_SUFFIX
        scale = read_checkpoint_tensor(folder, scale_name)
        fp8.pair_scales({name: tuple(tensor.shape), scale_name: tuple(scale.shape)},
                        {name: tensor.dtype, scale_name: scale.dtype}, cfg.fp8_block, str(folder))
        tensor = fp8.dequantize_stack(tensor, scale, cfg.fp8_block)
    else:
        fp8.pair_scales({name: tuple(tensor.shape)}, {name: tensor.dtype}, None, str(folder))
    check_tensors({name: tensor}, {name: (cfg.vocab_size, cfg.hidden_size)}, source=str(folder))
    return tensor


def read_lm_head(folder: Path, cfg: DecoderConfig) -> torch.Tensor:
    """The lm_head ``[vocab, hidden]`` of the checkpoint in ``folder`` (the embedding of a tied one, as
    the runtime reads it), read alone in its stored dtype; see :func:`read_vocab_tensor`."""
    return read_vocab_tensor(folder, cfg, EMBEDDING if cfg.tie_word_embeddings else LM_HEAD)


class MemoryTensors:
    """Tensors already in memory (name -> tensor) behind :class:`CheckpointReader`'s reading methods;
    taken as they are (not checked)."""

    source = "tensors"

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.tensors = tensors

    @property
    def names(self) -> List[str]:
        return list(self.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> Tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        return self.tensors[name].dtype

    def read(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def read_into(self, name: str, out: torch.Tensor) -> None:
        out.copy_(self.tensors[name])

    def mapped(self, name: str) -> Optional[torch.Tensor]:
        """None: in-memory tensors are never mapped."""
        return None
