"""The target's features on disk, in shards, and read back a few rows at a time.

A feature folder holds ``shard-NNNNN.safetensors`` files, each the :class:`~mtpctl.train.features.Features`
of consecutive training sequences (whole sequences, up to ``shard_positions`` positions unless one
sequence is longer): hidden states and EAGLE-3's aux streams in bfloat16, predictions and input ids
as int64, soft labels where asked for. A shard is written under a temporary name and renamed when
complete, so a shard file under its final name is complete; its entry (which sequences, their
lengths and first loss positions) is in its header's metadata. ``manifest.json`` (:class:`Manifest`)
lists every shard's entry once all are written.

Trainers read features through a store: :class:`ShardedFeatures` (the folder, memory-mapped: a batch
reads only its own rows, and at most :data:`OPEN_SHARDS` shards' ids and predictions are held) or
:class:`MemoryFeatures` (one :class:`Features` in memory, cut into the same shards). Both answer the
same questions the same way, so a run over either gives the same batches.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from mtpctl.errors import CorruptModel
from mtpctl.train.features import Features

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
SHARD_META = "mtpctl_shard"
#: shards whose ids and predictions a sharded store holds at once (a step may span two shards)
OPEN_SHARDS = 2
#: the per-row tensors a store reads by rows; the others (pred, ids) it reads whole per shard
ROW_TENSORS = ("hidden", "aux", "soft_ids", "soft_probs")


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


@dataclass
class ShardEntry:
    """One shard: its file, the global index of its first sequence, each sequence's length and first
    position with a loss (``loss_from``), and the rank that wrote it."""

    index: int
    file: str
    first: int
    lengths: List[int]
    loss_from: List[int]
    rank: int = 0

    @property
    def positions(self) -> int:
        return sum(self.lengths)


@dataclass
class Manifest:
    """``manifest.json`` of a feature folder (versioned): the shards in order of their sequences and
    the widths of what they hold (``aux_width`` 0: no aux streams; ``soft_top`` 0: no soft labels)."""

    hidden_size: int
    aux_width: int
    soft_top: int
    shard_positions: int
    shards: List[ShardEntry] = field(default_factory=list)
    version: int = MANIFEST_VERSION

    def save(self, folder: Path) -> None:
        """Write ``folder/manifest.json`` atomically."""
        tmp = Path(folder) / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(asdict(self)), encoding="utf-8")
        os.replace(tmp, Path(folder) / MANIFEST)

    @classmethod
    def load(cls, folder: Path) -> Optional["Manifest"]:
        """The folder's manifest, or None where there is none or it has another version."""
        path = Path(folder) / MANIFEST
        if not path.exists():
            return None
        raw = json.loads(path.read_text(encoding="utf-8"))
        if raw.get("version") != MANIFEST_VERSION:
            return None
        raw["shards"] = [ShardEntry(**e) for e in raw["shards"]]
        return cls(**raw)


def write_shard(feats: Features, folder: Path, entry: ShardEntry) -> Path:
    """Write one shard's features to ``folder/entry.file``: a temporary file renamed when complete."""
    from safetensors.torch import save_file

    path = Path(folder) / entry.file
    tmp = path.with_name(path.name + ".tmp")
    tensors = {k: v.contiguous() for k, v in asdict(feats).items() if v is not None}
    save_file(tensors, str(tmp), metadata={SHARD_META: json.dumps(asdict(entry))})
    os.replace(tmp, path)
    return path


def read_entry(path: Path) -> Optional[ShardEntry]:
    """The entry a complete shard file carries in its header, or None where the file is absent or
    not a readable shard."""
    try:
        header, _ = _header(path)
        return ShardEntry(**json.loads(header["__metadata__"][SHARD_META]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _header(path: Path):
    """(safetensors header, byte where the data starts)."""
    with open(path, "rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        if not 0 < size < 1 << 27:
            raise ValueError(f"{path}: not a safetensors file")
        return json.loads(handle.read(size)), 8 + size


#: safetensors dtypes of shard tensors -> (numpy dtype of their bytes, torch dtype)
_DTYPES = {"BF16": ("<i2", torch.bfloat16), "F32": ("<f4", torch.float32), "I64": ("<i8", torch.int64),
           "I32": ("<i4", torch.int32)}


class ShardFile:
    """One shard file, memory-mapped: tensors read whole or by rows, with the bytes read counted."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            header, start = _header(self.path)
        except (OSError, ValueError) as err:
            raise CorruptModel(f"cannot read feature shard {self.path}: {err}; run add-heads again") from err
        header.pop("__metadata__", None)
        self.maps: Dict[str, np.memmap] = {}
        self.dtypes: Dict[str, torch.dtype] = {}
        for name, info in header.items():
            np_dtype, self.dtypes[name] = _DTYPES[info["dtype"]]
            begin, _ = info["data_offsets"]
            self.maps[name] = np.memmap(self.path, dtype=np_dtype, mode="r", offset=start + begin,
                                        shape=tuple(info["shape"]))
        self.bytes_read = 0

    def _tensor(self, array: np.ndarray, name: str) -> torch.Tensor:
        self.bytes_read += array.nbytes
        return torch.from_numpy(array).view(self.dtypes[name])

    def whole(self, name: str) -> torch.Tensor:
        return self._tensor(np.array(self.maps[name]), name)

    def rows(self, name: str, index: torch.Tensor) -> torch.Tensor:
        return self._tensor(self.maps[name][index.numpy()], name)

    def span(self, name: str, start: int, end: int) -> torch.Tensor:
        return self._tensor(np.array(self.maps[name][start:end]), name)


class FeatureStore:
    """Features by shard, as trainers read them (see the module docstring). Sequences are numbered
    globally; shard ``i`` holds sequences ``[firsts[i], firsts[i + 1])`` back to back.

    Attributes:
        lengths, loss_from: ``[S]`` per sequence.
        firsts: ``[shards + 1]`` the first sequence of each shard, then S.
        starts: ``[S]`` where each sequence starts inside its shard.
        hidden_size, aux_width, soft_top: widths (0: not held).
    """

    def __init__(self, entries: Sequence[ShardEntry], hidden_size: int, aux_width: int, soft_top: int):
        self.entries = list(entries)
        self.hidden_size, self.aux_width, self.soft_top = hidden_size, aux_width, soft_top
        self.lengths = torch.tensor([n for e in self.entries for n in e.lengths], dtype=torch.long)
        self.loss_from = torch.tensor([n for e in self.entries for n in e.loss_from], dtype=torch.long)
        counts = torch.tensor([0] + [len(e.lengths) for e in self.entries], dtype=torch.long)
        self.firsts = counts.cumsum(0)
        self.shard_of = torch.repeat_interleave(torch.arange(len(self.entries)), counts[1:])
        starts = [torch.tensor([0] + e.lengths[:-1], dtype=torch.long).cumsum(0) for e in self.entries]
        self.starts = torch.cat(starts) if starts else torch.zeros(0, dtype=torch.long)

    @property
    def num_shards(self) -> int:
        return len(self.entries)

    @property
    def num_sequences(self) -> int:
        return len(self.lengths)

    def width(self, name: str) -> int:
        return {"hidden": self.hidden_size, "aux": self.aux_width}[name]

    def index(self, shard: int) -> Features:
        """Shard ``shard``'s offsets (local), loss_from, predictions and ids; its per-row tensors empty."""
        raise NotImplementedError

    def rows(self, shard: int, name: str, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` (positions inside the shard) of per-row tensor ``name``."""
        raise NotImplementedError

    def span(self, shard: int, name: str, start: int, end: int) -> torch.Tensor:
        """Rows ``[start, end)`` of per-row tensor ``name`` of a shard."""
        raise NotImplementedError

    def _skeleton(self, shard: int, pred: torch.Tensor, ids: torch.Tensor) -> Features:
        entry = self.entries[shard]
        offsets = torch.tensor([0] + entry.lengths, dtype=torch.long).cumsum(0)
        return Features(torch.zeros(0, self.hidden_size, dtype=torch.bfloat16), pred, offsets,
                        torch.tensor(entry.loss_from, dtype=torch.long), ids)


class MemoryFeatures(FeatureStore):
    """A :class:`Features` in memory as a store, cut into shards of ``shard_sequences`` sequences each
    (default: one shard)."""

    def __init__(self, feats: Features, shard_sequences: Optional[Sequence[int]] = None):
        lengths = (feats.offsets[1:] - feats.offsets[:-1]).tolist()
        loss_from = feats.loss_from.tolist()
        counts = list(shard_sequences) if shard_sequences is not None else [len(lengths)]
        if sum(counts) != len(lengths):
            raise ValueError(f"shards of {counts} sequences do not cover {len(lengths)}")
        entries, first = [], 0
        for i, n in enumerate(counts):
            entries.append(ShardEntry(i, shard_name(i), first, lengths[first:first + n], loss_from[first:first + n]))
            first += n
        super().__init__(entries, feats.hidden.shape[1], 0 if feats.aux is None else feats.aux.shape[1],
                         0 if feats.soft_ids is None else feats.soft_ids.shape[1])
        self.feats = feats

    def _base(self, shard: int) -> int:
        return int(self.feats.offsets[int(self.firsts[shard])])

    def index(self, shard: int) -> Features:
        base, end = self._base(shard), self._base(shard) + self.entries[shard].positions
        return self._skeleton(shard, self.feats.pred[base:end], self.feats.ids[base:end])

    def rows(self, shard: int, name: str, index: torch.Tensor) -> torch.Tensor:
        return getattr(self.feats, name)[index + self._base(shard)]

    def span(self, shard: int, name: str, start: int, end: int) -> torch.Tensor:
        base = self._base(shard)
        return getattr(self.feats, name)[base + start:base + end]


class ShardedFeatures(FeatureStore):
    """A feature folder (its :class:`Manifest`) as a store: rows read from the memory-mapped shard
    files as asked for; at most :data:`OPEN_SHARDS` shards open, their ids and predictions held.

    Attributes:
        bytes_read: bytes copied out of shard files so far.
        most_open: the most shards open at once so far.
    """

    def __init__(self, folder: Path, manifest: Manifest):
        super().__init__(manifest.shards, manifest.hidden_size, manifest.aux_width, manifest.soft_top)
        self.folder = Path(folder)
        self._open: "OrderedDict[int, tuple]" = OrderedDict()  # shard -> (ShardFile, skeleton)
        self._closed_bytes = 0
        self.most_open = 0

    @property
    def bytes_read(self) -> int:
        return self._closed_bytes + sum(f.bytes_read for f, _ in self._open.values())

    def _shard(self, shard: int) -> tuple:
        if shard in self._open:
            self._open.move_to_end(shard)
            return self._open[shard]
        while len(self._open) >= OPEN_SHARDS:
            _, (old, _) = self._open.popitem(last=False)
            self._closed_bytes += old.bytes_read
        handle = ShardFile(self.folder / self.entries[shard].file)
        self._open[shard] = (handle, self._skeleton(shard, handle.whole("pred"), handle.whole("ids")))
        self.most_open = max(self.most_open, len(self._open))
        return self._open[shard]

    def index(self, shard: int) -> Features:
        return self._shard(shard)[1]

    def rows(self, shard: int, name: str, index: torch.Tensor) -> torch.Tensor:
        return self._shard(shard)[0].rows(name, index)

    def span(self, shard: int, name: str, start: int, end: int) -> torch.Tensor:
        return self._shard(shard)[0].span(name, start, end)

    def all_features(self) -> Features:
        """Every shard's features in one :class:`Features` (in memory: for tests and small tools)."""
        parts = [_shard_features(self.folder / e.file) for e in self.entries]
        offsets = torch.tensor([0] + [n for e in self.entries for n in e.lengths], dtype=torch.long).cumsum(0)
        cat = {name: torch.cat([getattr(p, name) for p in parts]) if getattr(parts[0], name) is not None else None
               for name in ("hidden", "pred", "ids", "soft_ids", "soft_probs", "aux")}
        return Features(cat["hidden"], cat["pred"], offsets, self.loss_from.clone(), cat["ids"], cat["soft_ids"],
                        cat["soft_probs"], cat["aux"])


def _shard_features(path: Path) -> Features:
    from safetensors.torch import load_file

    return Features(**load_file(str(path)))


def as_store(feats) -> FeatureStore:
    """A store as it is; a :class:`Features` as a :class:`MemoryFeatures` of one shard."""
    return feats if isinstance(feats, FeatureStore) else MemoryFeatures(feats)
