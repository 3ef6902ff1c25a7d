"""Whether a matmul path computes a row the same alone and inside a pass of any number of rows, checked
on the running CPU on first use instead of assumed.

Lossless speculation rests on one property of every product on the decoding path: a token's row comes
out bit for bit the same whether plain decoding computes it alone or a verify pass computes it beside
other rows (docs/numerics.md). The native kernels have it by construction (a fixed reduction order),
but the libraries under torch pick kernels by shape and by CPU: oneDNN's bfloat16 blocked layout has it
on an AMD EPYC with AVX512-BF16 and loses it on an Intel Xeon with AMX. So each path the decoder may
hold its weights in is checked here before it is chosen (:func:`row_invariant`):

- ``native-tiles``: dense bfloat16 weights in the native matmul's tiles (:class:`TiledLinear`);
- ``native-int4``: 4-/8-bit codes on the native matmul (:class:`PackedLinear`, native);
- ``torch-int4-bfloat16`` / ``torch-int4-float32``: the codes on torch's int4 CPU kernel;
- ``onednn-bfloat16`` / ``onednn-float32``: oneDNN's blocked layout (:class:`BlockedLinear`);
- ``fixed-rows-bfloat16`` / ``fixed-rows-float32``: torch's matmul in fixed blocks of rows
  (:class:`FixedRowsLinear`), the fallback of the dense paths;
- ``torch-attention-float32``: the float32 batched products of attention on torch's ops (at least
  :data:`~mtpctl.model.decoder.MIN_ROWS` rows each), where the native attention kernel does not run.

A check multiplies rows of mixed magnitudes (1e-2 to 1e2) by weights of the shapes a small model's
layers have, in blocks of the sizes a decoding loop uses (:data:`BLOCK_ROWS`) at several offsets and
rows alone, and passes when every row equals its row of the largest block (about a second a path,
once). The verdict is kept per
path, CPU (model name and feature flags), torch version and, for the native paths, the kernels' build
(``$MTPCTL_HOME/row_invariance.json``, written atomically), so each check runs once per machine.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from mtpctl.errors import BadInput
from mtpctl.files import mtpctl_home, write_file
from mtpctl.model import native_build
from mtpctl.model.device import FIXED_ROWS
from mtpctl.model.linears import (BlockedLinear, FixedRowsLinear, PackedLinear, TiledLinear, blocked_layout_available,
                                  pack_q4, tiles_take)
from mtpctl.model.native import load_kernel, matmul_isa

#: the format of the verdict file's JSON
VERSION = 1
#: weight shapes ``(out, in)`` a check multiplies by: a small model's projections (SmolLM2's MLP both
#: ways, its fused q/k/v), where oneDNN's bfloat16 kernels on an AMX CPU differ by row count
SHAPES = ((1536, 576), (576, 1536), (960, 576))
#: row counts a check computes together: a request's verify passes (one root and up to 32 draft nodes)
#: and packed passes of several requests; each at :data:`OFFSETS` up to 33 rows, from the start above
BLOCK_ROWS = tuple(range(1, 10)) + (12, 16, 17, 24, 32, 33, 64, 128)
#: where in the largest block a block of up to 33 rows starts (a row's place in the pass may matter too)
OFFSETS = (0, 5)
#: rows checked alone (the first ones of the largest block, magnitudes 1e-2 to 1e2)
ALONE = 16
#: rows a fixed-rows block holds on the CPU
CPU_FIXED_ROWS = FIXED_ROWS["cpu"]

#: a product under check: ``fn(x [M, K]) -> [M, N]`` for one weight shape
Product = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Verdict:
    """The outcome of checking one path on this CPU.

    Attributes:
        path: the path's name (see the module's docstring).
        invariant: every row came out the same alone and in every block.
        detail: where the first difference was (``shape (1536, 576), 7 rows at offset 3, row 2``), or
            why the path was not checked (``oneDNN lacks bfloat16 here``); "" when it held.
        runs_here: the path runs on this machine at all (a path that does not is never selected).
    """

    path: str
    invariant: bool
    detail: str = ""
    runs_here: bool = True


def first_difference(product_for: Callable[[torch.Tensor], Product], dtype: torch.dtype,
                     shapes: Sequence[Tuple[int, int]] = SHAPES, block_rows: Sequence[int] = BLOCK_ROWS,
                     offsets: Sequence[int] = OFFSETS, weights: Optional[Callable[[int, int], torch.Tensor]] = None
                     ) -> str:
    """Where ``product_for(weight)`` first computes a row differently in a smaller block than in the
    largest one ("" when nowhere): for each shape, a seeded weight (``weights(n, k)``, else Gaussian x
    0.05) and rows of magnitudes 1e-2 to 1e2 in ``dtype``; blocks of each size (up to 33 rows at each
    offset, larger ones from the start; ``block_rows`` ascending, its last the largest), and each of
    the first :data:`ALONE` rows alone."""
    generator = torch.Generator().manual_seed(0)
    largest = max(block_rows)
    for n, k in shapes:
        weight = weights(n, k) if weights is not None else torch.randn(n, k, generator=generator) * 0.05
        fn = product_for(weight)
        scale = torch.logspace(-2, 2, largest)[torch.randperm(largest, generator=generator)][:, None]
        x = (torch.randn(largest, k, generator=generator) * scale).to(dtype)
        full = fn(x)
        for rows in block_rows[:-1]:
            for start in (offsets if rows <= 33 else (0,)):
                if not torch.equal(fn(x[start:start + rows]), full[start:start + rows]):
                    return f"shape ({n}, {k}), {rows} rows at offset {start}"
        for i in range(ALONE):
            if not torch.equal(fn(x[i:i + 1]), full[i:i + 1]):
                return f"shape ({n}, {k}), row {i} alone"
    return ""


def _grid_weight(n: int, k: int) -> torch.Tensor:
    """A weight on a Q4_1 grid (each group of 32: d * q + m, q in 0..15, both ends used), as a GGUF
    import holds it: what the int4 paths pack."""
    g = torch.Generator().manual_seed(n * 7 + k)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    d = torch.rand(n, k // 32, 1, generator=g) * 0.01 + 1e-3
    m = -8 * d
    return (q * d + m).reshape(n, k)


def _attention_product(weight: torch.Tensor) -> Product:
    """Attention's shape of product on torch's ops: rows padded to at least 4, times a [K, N] matrix in
    float32 batched over two heads (``torch.matmul`` of 3-D tensors)."""
    keys = torch.stack((weight.float(), weight.float().flip(0)))  # [2, N, K]: two KV heads

    def product(x: torch.Tensor) -> torch.Tensor:
        m = len(x)
        rows = x.float()[None].expand(2, -1, -1)
        if m < 4:
            rows = F.pad(rows, (0, 0, 0, 4 - m))
        return torch.matmul(rows, keys.transpose(-1, -2))[:, :m].transpose(0, 1).reshape(m, -1)
    return product


def _check(path: str) -> Verdict:
    """Run ``path``'s check now (see the module's docstring)."""
    kind, _, dtype_name = path.rpartition("-")
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(dtype_name)
    if path == "native-tiles":
        if load_kernel() is None:
            return Verdict(path, False, "the native kernels do not load here", runs_here=False)
        detail = first_difference(lambda w: TiledLinear(w.bfloat16()), torch.bfloat16)
    elif path == "native-int4":
        if load_kernel() is None:
            return Verdict(path, False, "the native kernels do not load here", runs_here=False)
        detail = first_difference(lambda w: PackedLinear(pack_q4(w), w.shape[0], torch.bfloat16, native=True),
                                  torch.bfloat16, weights=_grid_weight)
    elif kind == "torch-int4" and dtype is not None:
        detail = first_difference(lambda w: PackedLinear(pack_q4(w), w.shape[0], dtype, native=False), dtype,
                                  weights=_grid_weight)
    elif kind == "onednn" and dtype is not None:
        if not blocked_layout_available(dtype):
            return Verdict(path, False, f"oneDNN's {dtype_name} blocked layout does not run here", runs_here=False)
        detail = first_difference(lambda w: BlockedLinear(w.to(dtype)), dtype)
    elif kind == "fixed-rows" and dtype is not None:
        detail = first_difference(lambda w: FixedRowsLinear(w.to(dtype), CPU_FIXED_ROWS), dtype)
    elif path == "torch-attention-float32":
        detail = first_difference(_attention_product, torch.float32)
    else:
        raise ValueError(f"no row-invariance check for path {path!r} (choose from {', '.join(PATHS)})")
    return Verdict(path, not detail, detail)


#: every path :func:`row_invariant` checks
PATHS = ("native-tiles", "native-int4", "torch-int4-bfloat16", "torch-int4-float32", "onednn-bfloat16",
         "onednn-float32", "fixed-rows-bfloat16", "fixed-rows-float32", "torch-attention-float32")
#: environment variable: ``recheck`` ignores the verdicts kept on disk (checks again, keeps the new ones)
SWITCH = "MTPCTL_ROW_CHECK"


def verdict_key(path: str) -> str:
    """What a verdict depends on: the path, this CPU (model name and feature flags), torch's version and,
    for the native paths, the kernels' build (sources, flags and the forced matmul path)."""
    parts = [path, native_build.cpu_signature().decode(errors="replace"), torch.__version__]
    if path.startswith("native-"):
        parts.append(native_build.build_key(native_build.build_flags()))
        parts.append(str(matmul_isa()))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _verdict_file():
    return mtpctl_home() / "row_invariance.json"


def _read_kept() -> dict:
    """The verdicts kept on disk ({} where there is no file or it does not read: they are checked again)."""
    try:
        document = json.loads(_verdict_file().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    kept = document.get("verdicts") if isinstance(document, dict) and document.get("version") == VERSION else None
    return kept if isinstance(kept, dict) else {}


@lru_cache(maxsize=None)
def verdict(path: str) -> Verdict:
    """``path``'s verdict on this machine: kept from an earlier check (same CPU, torch and kernels'
    build), else checked now (a fraction of a second) and kept."""
    key = verdict_key(path)
    recheck = os.environ.get(SWITCH, "").strip().lower() == "recheck"
    kept = None if recheck else _read_kept().get(key)
    if isinstance(kept, dict) and kept.get("path") == path and isinstance(kept.get("invariant"), bool):
        return Verdict(path, kept["invariant"], str(kept.get("detail", "")), bool(kept.get("runs_here", True)))
    found = _check(path)
    _store(key, found)
    return found


def _store(key: str, found: Verdict) -> None:
    entries = _read_kept()
    entries[key] = {"path": found.path, "invariant": found.invariant, "detail": found.detail,
                    "runs_here": found.runs_here, "torch": torch.__version__, "matmul_isa": matmul_isa(),
                    "date": datetime.date.today().isoformat()}
    try:
        _verdict_file().parent.mkdir(parents=True, exist_ok=True)
        write_file(_verdict_file(), json.dumps({"version": VERSION, "verdicts": entries}, indent=1) + "\n")
    except (OSError, BadInput) as err:
        print(f"mtpctl: warning: the row-invariance verdict of {found.path} was not kept ({err}); it will be "
              "checked again next time", file=sys.stderr)


def row_invariant(path: str) -> bool:
    """Whether ``path`` runs here and computes every row alike in any block (:func:`verdict`)."""
    return verdict(path).invariant


def verdicts(paths: Sequence[str]) -> Dict[str, Verdict]:
    """The verdicts of ``paths``, by name."""
    return {path: verdict(path) for path in paths}


def dtype_name(dtype: torch.dtype) -> str:
    """``float32``, ``bfloat16``: a dtype as the paths' names spell it."""
    return str(dtype).removeprefix("torch.")


def int4_paths(dtype: torch.dtype, native: Optional[bool] = None) -> List[str]:
    """The paths 4-/8-bit codes may decode on here with activations in ``dtype``, fastest first:
    ``native-int4`` (bfloat16 activations, native kernels that load, ``native`` not False), then
    ``torch-int4-DTYPE``."""
    fast = ["native-int4"] if native is not False and dtype == torch.bfloat16 and load_kernel() is not None else []
    return fast + [f"torch-int4-{dtype_name(dtype)}"]


def int4_path(dtype: torch.dtype, native: Optional[bool] = None) -> Optional[str]:
    """The first of :func:`int4_paths` that holds here; None where none does (the weights are then held
    dense)."""
    return next((path for path in int4_paths(dtype, native) if path in PATHS and row_invariant(path)), None)


def dense_path(dtype: torch.dtype, shape: Tuple[int, ...]) -> str:
    """The path a dense linear weight of ``dtype`` and ``shape`` decodes on here, the fastest that holds:
    ``native-tiles`` (bfloat16, a shape the tiles take), ``onednn-DTYPE`` (where torch has oneDNN's
    blocked layout for it), else ``fixed-rows-DTYPE`` (torch's matmul in fixed blocks of rows)."""
    if tiles_take(dtype, shape) and row_invariant("native-tiles"):
        return "native-tiles"
    name = dtype_name(dtype)
    if blocked_layout_available(dtype) and row_invariant(f"onednn-{name}"):
        return f"onednn-{name}"
    return f"fixed-rows-{name}"


def dense_linear(weight: torch.Tensor, dtype: torch.dtype):
    """A dense linear weight ``[N, K]`` held, in ``dtype``, on :func:`dense_path`'s path for it here: a
    :class:`TiledLinear`, a :class:`BlockedLinear` or a :class:`FixedRowsLinear` of
    :data:`CPU_FIXED_ROWS` rows (each computes ``x [..., K] -> [..., N]``, a row alike in any pass)."""
    path = dense_path(dtype, tuple(weight.shape))
    if path == "native-tiles":
        return TiledLinear(weight.to(dtype))
    if path.startswith("onednn-"):
        return BlockedLinear(weight.to(dtype))
    return FixedRowsLinear(weight.to(dtype), CPU_FIXED_ROWS)


def path_of(linear) -> Optional[str]:
    """The checked path a linear module computes on (None for a plain weight tensor: not a decoding
    layout)."""
    if isinstance(linear, TiledLinear):
        return "native-tiles"
    if isinstance(linear, PackedLinear):
        return "native-int4" if linear.native else f"torch-int4-{dtype_name(linear.dtype)}"
    if isinstance(linear, BlockedLinear):
        return f"onednn-{dtype_name(linear.dtype)}"
    if isinstance(linear, FixedRowsLinear):
        return f"fixed-rows-{dtype_name(linear.weight.dtype)}"
    return None
