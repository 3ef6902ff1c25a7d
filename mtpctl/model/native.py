"""The native kernels (``csrc/tree_attention.c``, ``rms_norm.c``, ``rope.c``, ``int4_matmul.c``,
``layer_stack.c``): their bindings and the Python functions that call them.

Decode and verify passes attend over a few hundred cached slots per token; torch runs that as
about twenty small ops per layer (gathers, padded matmuls, softmax), which cost more than the
arithmetic. The C kernel does one fused pass per (token, KV head) over an explicit slot list, in a
fixed order, so it is batch-invariant by construction (see the source's header). The RMSNorm of
those passes (61 a SmolLM2 step) is one C call per norm instead of six to eight torch ops, again
with each row's sum in a fixed order; and one call per layer rotates the queries and keys (RoPE),
writes keys and values to the cache and lays the queries out for the attention kernel. int4 models'
weights run on a 4-bit matmul whose cost grows far less with the rows of a pass than torch's, dense
bfloat16 weights on the same kernel without the dequantization (:func:`bf16_tiles`), and a pass of
such a model runs all its layers in one call (:func:`layer_stack`), without a Python dispatch per op.

:mod:`mtpctl.model.native_build` compiles them into one library the first time it is needed (about
a second; why then, and where it lands, are told there); :func:`load_kernel` loads it with ctypes and
binds every entry point ``csrc/kernels.h`` declares (:func:`entry_points`), which is also the only
way in: the library object it returns has those functions and no others. It uses OpenMP through the
``libgomp`` torch already loaded, so it shares torch's thread count. Where there is no compiler (and
no library built before for these sources and this CPU), or the build fails, :func:`load_kernel`
returns None once, with a warning on stderr, and the engine keeps the pure-torch attention
(:func:`mtpctl.model.decoder._attention`) and norms, which give the same guarantee more slowly.
``MTPCTL_NATIVE_KERNELS=off`` (:data:`SWITCH`) turns the native kernels off.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from mtpctl.model import native_build

#: the environment variable that turns the native kernels off (0, false, off or no): torch's ops instead
SWITCH = "MTPCTL_NATIVE_KERNELS"


#: the dtypes a KV cache the native kernels read and write may have
KV_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class SlotPlan:
    """Which cache slots each token of a decode or verify pass attends to, in order, for one
    attention window (built by :func:`mtpctl.decode.attention.slot_plan`). The tokens of a pass may
    belong to several sequences, each with its own KV cache (:class:`mtpctl.model.kv_cache.PassSlots`);
    slots are those of the token's own cache.

    Attributes:
        starts: ``[N]`` long, first committed slot token i attends to (0, or where its sliding
            window begins); it reads the committed slots ``[starts[i], ends[i])``.
        ends: ``[N]`` long, the committed slots of token i's sequence before the pass.
        paths: ``[N, P]`` long, then the slots of its draft-tree path (ancestors root first, then
            itself), -1 padded. Plain decoding lists ``[length]``.

    All three are contiguous (the kernel reads them as flat arrays; :func:`tree_attention` checks).
    """

    starts: torch.Tensor
    ends: torch.Tensor
    paths: torch.Tensor


def kernel_takes(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel takes this attention shape: head_dim a multiple of 16 up to 512, and at
    most 16 query heads per KV head."""
    return kv_heads > 0 and heads % kv_heads == 0 and heads // kv_heads <= 16 and head_dim % 16 == 0 \
        and head_dim <= 512


def kernel_runs(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether decode and verify passes of this attention shape run on the kernel here: it takes the
    shape (:func:`kernel_takes`) and it could be built and loaded (:func:`load_kernel`)."""
    return kernel_takes(heads, kv_heads, head_dim) and load_kernel() is not None


def native_kernels_on() -> bool:
    """Whether :data:`SWITCH` leaves the native kernels on: unset, empty, 1, true, on or yes (any
    case); 0, false, off or no turn them off. Another value leaves them on, with a warning on stderr."""
    switch = os.environ.get(SWITCH, "1").strip().lower()
    if switch in ("0", "false", "off", "no"):
        return False
    if switch not in ("", "1", "true", "on", "yes"):
        print(f"mtpctl: warning: {SWITCH}={os.environ[SWITCH]!r} is not one of 0/false/off/no or 1/true/on/yes; "
              "the native kernels stay on", file=sys.stderr)
    return True


@dataclass(frozen=True)
class EntryPoint:
    """One function of the native library as ``csrc/kernels.h`` declares it, in ctypes' terms.

    Attributes:
        name: the C function's name.
        restype: the ctypes type of its result.
        argtypes: the ctypes type of each argument, in order (pointers are ``c_void_p``: the
            wrappers pass ``data_ptr()`` addresses).
    """

    name: str
    restype: type
    argtypes: Tuple[type, ...]


#: the header's scalar types (results and arguments)
_SCALARS = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float}
#: what a pointer argument may point to
_POINTEES = ("void", "float", "uint8_t", "uint16_t", "int64_t")
_BEGIN, _END = "/* entry points: begin */", "/* entry points: end */"
_DECLARATION = re.compile(r"(\w+) (\w+)\(([^()]*)\);")
_POINTER = re.compile(r"(?:const )?(\w+) ?\* ?(\w+)")
_SCALAR = re.compile(r"(\w+) (\w+)")


def entry_points(header: Optional[str] = None) -> Dict[str, EntryPoint]:
    """Every entry point ``header`` (the text of ``csrc/kernels.h`` by default) declares between its
    ``/* entry points: begin */`` and ``/* entry points: end */`` lines, by name.

    Raises:
        OSError: the header cannot be read.
        ValueError: no such markers, or a line between them that is not a declaration of the header's
            format (see its first comment): a type the parser does not know, a missing ``;``, a name
            declared twice.
    """
    text = native_build.ENTRY_POINTS_HEADER.read_text(encoding="utf-8") if header is None else header
    lines = text.splitlines()
    if lines.count(_BEGIN) != 1 or lines.count(_END) != 1 or lines.index(_BEGIN) > lines.index(_END):
        raise ValueError(f"kernels.h: expected one {_BEGIN!r} line, then one {_END!r} line")
    found: Dict[str, EntryPoint] = {}
    for declaration in _declarations(lines[lines.index(_BEGIN) + 1:lines.index(_END)]):
        entry = _entry_point(declaration)
        if entry.name in found:
            raise ValueError(f"kernels.h: {entry.name} is declared twice")
        found[entry.name] = entry
    return found


def _declarations(lines: List[str]) -> List[str]:
    """The declarations among ``lines``, each joined into one line with single spaces (they may
    wrap); ValueError for text left without its closing ``;``."""
    declarations, pending = [], []
    for line in lines:
        pending += line.split()
        if pending and pending[-1].endswith(";"):
            declarations.append(" ".join(pending))
            pending = []
    if pending:
        raise ValueError(f"kernels.h: {' '.join(pending)!r} does not end with ';'")
    return declarations


def _entry_point(declaration: str) -> EntryPoint:
    """The :class:`EntryPoint` of one declaration (``int name(int64_t n, const float *x);``)."""
    match = _DECLARATION.fullmatch(declaration)
    if match is None or match.group(1) not in _SCALARS:
        raise ValueError(f"kernels.h: {declaration!r} is not 'int NAME(TYPE NAME, ...);'")
    result, name, params = match.groups()
    params = params.strip()
    argtypes = () if params == "void" else tuple(_argtype(p.strip(), declaration) for p in params.split(","))
    return EntryPoint(name, _SCALARS[result], argtypes)


def _argtype(param: str, declaration: str) -> type:
    """The ctypes type of one parameter of ``declaration``."""
    pointer, scalar = _POINTER.fullmatch(param), _SCALAR.fullmatch(param)
    if pointer is not None and pointer.group(1) in _POINTEES:
        return ctypes.c_void_p
    if pointer is None and scalar is not None and scalar.group(1) in _SCALARS:
        return _SCALARS[scalar.group(1)]
    raise ValueError(f"kernels.h: parameter {param!r} of {declaration!r} is not a type the bindings know "
                     f"({', '.join(_SCALARS)}, or a pointer to {', '.join(_POINTEES)})")


class Kernels:
    """The native library, bound: one attribute per entry point ``csrc/kernels.h`` declares, the
    ctypes function with that declaration's result and argument types; any other name raises
    AttributeError (the Python side reaches only what the header declares)."""

    def __init__(self, path: Path, entries: Dict[str, EntryPoint]):
        """Load the library at ``path`` and bind ``entries``; OSError where it does not load, or
        lacks a declared function (a library built from other sources)."""
        library = ctypes.CDLL(str(path))
        functions = {}
        for entry in entries.values():
            try:
                function = getattr(library, entry.name)
            except AttributeError as e:
                raise OSError(f"{path.name} has no {entry.name}, which kernels.h declares") from e
            function.restype, function.argtypes = entry.restype, list(entry.argtypes)
            functions[entry.name] = function
        self.path, self.library, self.entries = path, library, dict(entries)
        self.__dict__.update(functions)

    def __getattr__(self, name: str):
        """Only reached for a name that is not an entry point (bound names are plain attributes)."""
        raise AttributeError(f"the native library has no entry point {name!r} (not declared in csrc/kernels.h)")


@lru_cache(maxsize=2)
def load_kernel(portable: bool = False) -> Optional[Kernels]:
    """The native library, bound (:class:`Kernels`; built into ``$MTPCTL_HOME/kernels`` if needed by
    :func:`mtpctl.model.native_build.build`), or None where it cannot be built or loaded (a warning on
    stderr, once) or :data:`SWITCH` turns it off (no warning).

    ``portable`` builds without ``-march=native``: the kernels' plain-C path, which the default build
    uses on CPUs without AVX-512 (the tests check it on machines that have AVX-512).

    Raises:
        ValueError: ``csrc/kernels.h`` does not parse (:func:`entry_points`): a fault of the package,
            not of this machine.
    """
    if not native_kernels_on():
        return None
    try:
        return Kernels(native_build.build(portable), entry_points())
    except OSError as e:
        print(f"mtpctl: warning: native kernels (attention, RMSNorm, RoPE, int4) unavailable ({e}); using torch's "
              f"ops (slower; install a C compiler or set $CC, or {SWITCH}=off to silence this)", file=sys.stderr)
        return None


#: what :func:`matmul_isa` calls each path of ``csrc/int4_matmul.c``, by the number the library returns
MATMUL_ISAS = {2: "avx512-bf16", 1: "avx2", 0: "portable"}


def matmul_isa(lib: Optional[Kernels] = None) -> Optional[str]:
    """Which path the native matmuls take in this build: ``"avx512-bf16"`` (AVX512-BF16 dot products),
    ``"avx2"`` (AVX2 and FMA, float32 products: most x86 CPUs before 2022), ``"portable"`` (plain C,
    several times slower), or None where the native library does not load."""
    lib = lib if lib is not None else load_kernel()
    return None if lib is None else MATMUL_ISAS[int(lib.matmul_isa())]


def _on_host(*tensors: torch.Tensor) -> None:
    """ValueError unless every tensor is in host memory: the kernels read raw addresses, and a GPU
    tensor's address would crash the process instead of failing."""
    for t in tensors:
        if t.device.type != "cpu":
            raise ValueError(f"the native kernels read tensors in host memory; got one on {t.device} "
                             "(run with the torch kernels there)")


def _loaded(lib: Optional[Kernels]) -> Kernels:
    """``lib``, else the library :func:`load_kernel` loads; OSError where it cannot be built."""
    lib = lib or load_kernel()
    if lib is None:
        raise OSError("the native kernels are not available")
    return lib


def cache_rows(keys: torch.Tensor, values: torch.Tensor, n: int) -> torch.Tensor:
    """The kernels' table ``[n, 4]`` long for n tokens that all keep their KV in one cache: the
    addresses of ``keys``/``values`` ``[layers, 1, kv_heads, slots, head_dim]`` (or one layer,
    ``[1, kv_heads, slots, head_dim]``) float32 or bfloat16, contiguous, the elements between two
    layers and the slots per KV head (see :class:`mtpctl.model.kv_cache.PassSlots`, which builds it
    for several caches).

    Raises:
        ValueError: a cache that is not contiguous float32 or bfloat16, or keys and values of other
            shapes or dtypes.
    """
    if keys.dtype not in KV_DTYPES or values.dtype != keys.dtype or keys.shape != values.shape \
            or not (keys.is_contiguous() and values.is_contiguous()):
        raise ValueError("the native kernels take a contiguous float32 or bfloat16 KV cache, keys and values alike")
    per_layer = keys[0].numel() if keys.dim() == 5 else 0
    row = torch.tensor([keys.data_ptr(), values.data_ptr(), per_layer, keys.shape[-2]], dtype=torch.long)
    return row.expand(n, 4).contiguous()


def check_plan(plan: SlotPlan, kv: torch.Tensor) -> None:
    """Check once per pass what :func:`attend` trusts (its C code reads whatever the tensors say): N
    rows of contiguous long tensors, and every slot a token reads inside its own cache.

    Raises:
        ValueError: a plan or table that does not fit.
    """
    n = kv.shape[0]
    starts, ends, paths = plan.starts, plan.ends, plan.paths
    tensors = (kv, starts, ends, paths)
    if any(t.dtype != torch.long or not t.is_contiguous() for t in tensors) or kv.shape != (n, 4) \
            or starts.shape != (n,) or ends.shape != (n,) or paths.dim() != 2 or paths.shape[0] != n:
        raise ValueError(f"a slot plan of {tuple(starts.shape)} starts, {tuple(ends.shape)} ends and "
                         f"{tuple(paths.shape)} paths does not fit a cache table of {tuple(kv.shape)} "
                         "(or is not contiguous long tensors)")
    slots = kv[:, 3]
    if bool((starts < 0).any() or (starts > ends).any() or (ends > slots).any() or (paths >= slots[:, None]).any()):
        raise ValueError("a slot plan reads slots outside its token's cache")


def tree_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                   plan: SlotPlan, lib: Optional[Kernels] = None) -> torch.Tensor:
    """Grouped-query attention of N tokens of one sequence over their slot lists
    (:class:`SlotPlan`), in float32: :func:`attend` for one layer of one cache, checked.

    q ``[1, heads, N, head_dim]``; keys/values ``[1, kv_heads, slots, head_dim]`` float32 (one layer
    of the KV cache); ``scale`` multiplies q.k; ``lib`` the compiled kernel (default:
    :func:`load_kernel`). Returns ``[1, heads, N, head_dim]`` in q's dtype.

    Raises:
        OSError: the kernel could not be built (see :func:`load_kernel`).
        ValueError: a batch other than 1, a cache that is not contiguous float32, a plan that does not
            fit (:func:`check_plan`), or see :func:`attend`.
    """
    if q.shape[0] != 1 or keys.dim() != 4 or keys.shape[-1] != q.shape[-1]:
        raise ValueError("the native attention kernel takes batch 1 and one layer of a KV cache")
    table = cache_rows(keys, values, q.shape[2])
    check_plan(plan, table)
    out = attend(q[0].transpose(0, 1).float().contiguous(), table, 0, keys.shape[1], scale, plan, lib,
                 kv_bf16=keys.dtype == torch.bfloat16)
    return out.transpose(0, 1)[None].to(q.dtype)


def attend(q: torch.Tensor, kv: torch.Tensor, layer: int, kv_heads: int, scale: float, plan: SlotPlan,
           lib: Optional[Kernels] = None, kv_bf16: bool = False) -> torch.Tensor:
    """Grouped-query attention of N tokens over their slot lists (:class:`SlotPlan`, checked by
    :func:`check_plan`) in ``layer`` of each token's own KV cache, in float32.

    q ``[N, heads, head_dim]`` float32 contiguous; ``kv`` ``[N, 4]`` long, where each token's cache
    lies (:func:`cache_rows`, :class:`mtpctl.model.kv_cache.PassSlots`), float32 caches, or bfloat16
    ones with ``kv_bf16`` (read as float32: the same result for the same values); ``scale``
    multiplies q.k. Returns ``[N, heads, head_dim]`` float32.

    Raises:
        OSError: the kernel could not be built (see :func:`load_kernel`).
        ValueError: q not contiguous float32, or a shape the kernel does not take (head_dim not a
            multiple of 16 or above 512, a GQA group above 16).
        MemoryError: no scratch memory.
    """
    lib = _loaded(lib)
    n, heads, d = q.shape
    if q.dtype != torch.float32 or not q.is_contiguous():
        raise ValueError("the native attention kernel takes contiguous float32 queries")
    _on_host(q, kv, plan.starts, plan.ends, plan.paths)
    out = torch.empty(n, heads, d, dtype=torch.float32)
    rc = lib.tree_attention(q.data_ptr(), kv.data_ptr(), layer, plan.starts.data_ptr(), plan.ends.data_ptr(),
                            plan.paths.data_ptr(), plan.paths.shape[1], n, heads, kv_heads, d, scale, out.data_ptr(),
                            torch.get_num_threads(), int(kv_bf16))
    if rc == -2:
        raise MemoryError(f"the native attention kernel could not allocate scratch memory for {n} tokens")
    if rc:
        raise ValueError(f"the native attention kernel does not take head_dim {d} with {heads} heads over "
                         f"{kv_heads} KV heads")
    return out


#: widest row :func:`rms_norm` takes (``MAX_DIM`` in csrc/rms_norm.c)
NORM_MAX_DIM = 16384


def norm_takes(dim: int) -> bool:
    """Whether the native RMSNorm takes rows of ``dim`` values: a multiple of 16 up to 16384."""
    return 0 < dim <= NORM_MAX_DIM and dim % 16 == 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, lib: Optional[Kernels] = None) -> torch.Tensor:
    """RMSNorm of every row of ``x`` ``[..., dim]`` (bfloat16 or float32), in x's dtype, one row at a
    time in a fixed order (batch-invariant).

    ``weight`` ``[dim]``: in x's dtype, Llama's convention ``weight * to_dtype(h * r)``; or float32,
    Gemma's ``to_dtype(h * r * weight)`` (it holds ``1 + w``), where h is the row in float32 and
    ``r = 1 / sqrt(mean(h^2) + eps)``. In float32 the two are the same product. These are the
    formulas of :func:`mtpctl.model.decoder._rms_norm` and ``_rms_norm_float32_scale``; only the
    order of the sum of squares differs, so results agree to rounding.

    Raises:
        OSError: the kernel could not be built (see :func:`load_kernel`).
        ValueError: another dtype, a weight that is not ``[dim]`` in x's dtype or float32, or a
            ``dim`` the kernel does not take (:func:`norm_takes`).
    """
    lib = _loaded(lib)
    dim = x.shape[-1]
    if x.dtype not in (torch.bfloat16, torch.float32) or weight.shape != (dim,) \
            or weight.dtype not in (x.dtype, torch.float32) or not norm_takes(dim):
        raise ValueError(f"the native RMSNorm takes bfloat16/float32 rows of a multiple of 16 values up to "
                         f"{NORM_MAX_DIM} and a [{dim}] weight in their dtype or float32; got {x.dtype} rows of "
                         f"{dim} and a {weight.dtype} weight of {tuple(weight.shape)}")
    _on_host(x, weight)
    x = x.contiguous()
    weight = weight.contiguous()
    out = torch.empty_like(x)
    rc = lib.rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // dim, dim, eps,
                      int(x.dtype == torch.bfloat16), int(weight.dtype == torch.float32 and x.dtype != torch.float32))
    if rc:
        raise ValueError(f"the native RMSNorm does not take rows of {dim} values")
    return out


def rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               first: int, heads: int, kv_heads: int, lib: Optional[Kernels] = None) -> torch.Tensor:
    """:func:`rotate_write` for N tokens of one sequence into one layer of its cache, checked:
    keys/values ``[1, kv_heads, slots, head_dim]`` float32 or bfloat16, token i's key and value going to slot
    ``first + i``. Returns the rotated queries ``[N, heads, head_dim]`` in float32.

    Raises:
        OSError: the kernel could not be built (see :func:`load_kernel`).
        ValueError: shapes or dtypes that do not fit (an odd head_dim, a row too short for the heads,
            slots past the cache, a batch other than 1, a cache that is not contiguous float32).
    """
    n, d = qkv.shape[0], cos.shape[-1]
    if keys.dim() != 4 or keys.shape[0] != 1 or keys.shape[1] != kv_heads or keys.shape[-1] != d \
            or first < 0 or first + n > keys.shape[2]:
        raise ValueError(f"rope_write does not take a cache layer {tuple(keys.shape)} from slot {first} for {n} "
                         f"tokens of {kv_heads} KV heads of {d} values")
    dest = torch.arange(first, first + n)
    return rotate_write(qkv, cos, sin, cache_rows(keys, values, n), 0, dest, heads, kv_heads, lib,
                        kv_bf16=keys.dtype == torch.bfloat16)


def rotate_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor, layer: int,
                 dest: torch.Tensor, heads: int, kv_heads: int, lib: Optional[Kernels] = None,
                 kv_bf16: bool = False) -> torch.Tensor:
    """Rotary embedding (RoPE, Su et al. 2021) of a pass's queries and keys, fused with the KV cache
    write: the computation of :func:`mtpctl.model.decoder._rotate` (each product and the sum rounded
    to the model's dtype), bit for bit, followed by what ``KVCache.write`` and :func:`attend` do with
    the result.

    qkv ``[N, stride]`` (bfloat16 or float32; each row holds ``heads`` query, ``kv_heads`` key and
    ``kv_heads`` value heads of head_dim values first); cos/sin ``[N, head_dim]`` in qkv's dtype (each
    token's rotation); ``kv`` ``[N, 4]`` long, where each token's cache lies (:func:`cache_rows`,
    :class:`mtpctl.model.kv_cache.PassSlots`; float32 caches, or bfloat16 ones with ``kv_bf16``: exact
    for a bfloat16 qkv), token i's key and value going to slot ``dest[i]`` of ``layer``. Returns the
    rotated queries ``[N, heads, head_dim]`` in float32.

    Raises:
        OSError: the kernel could not be built (see :func:`load_kernel`).
        ValueError: shapes or dtypes that do not fit (an odd head_dim, a row too short for the heads, a
            slot outside its cache, tables that are not N rows of contiguous long).
    """
    lib = _loaded(lib)
    n, d = qkv.shape[0], cos.shape[-1]
    if qkv.dim() != 2 or qkv.dtype not in (torch.bfloat16, torch.float32) or qkv.stride(-1) != 1 \
            or cos.shape != (n, d) or sin.shape != (n, d) or cos.dtype != qkv.dtype or sin.dtype != qkv.dtype \
            or qkv.shape[1] < (heads + 2 * kv_heads) * d or d % 2 or d > 512 or kv.shape != (n, 4) or dest.shape != (n,) \
            or kv.dtype != torch.long or dest.dtype != torch.long or not (kv.is_contiguous() and dest.is_contiguous()):
        raise ValueError(f"rotate_write does not take qkv {tuple(qkv.shape)} {qkv.dtype}, cos/sin {tuple(cos.shape)}, "
                         f"a cache table {tuple(kv.shape)} and slots {tuple(dest.shape)}, {heads} heads over "
                         f"{kv_heads} KV heads")
    _on_host(qkv, cos, sin, kv, dest)
    cos, sin = cos.contiguous(), sin.contiguous()
    q = torch.empty(n, heads, d, dtype=torch.float32)
    rc = lib.rope_write(qkv.data_ptr(), n, qkv.stride(0), heads, kv_heads, d, cos.data_ptr(), sin.data_ptr(),
                        int(qkv.dtype == torch.bfloat16), q.data_ptr(), kv.data_ptr(), layer, dest.data_ptr(),
                        int(kv_bf16))
    if rc:
        raise ValueError(f"rotate_write refused head_dim {d} or a slot outside its cache")
    return q


#: bytes per tile of 4 output rows and group of 32 inputs in :func:`int4_pack`'s layout
INT4_BLOCK = 96


def int4_pack(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Lay out 4-bit weights for :func:`int4_matmul`: codes q ``[N, K]`` in 0..15 and float32 scale and
    zero ``[N, K/32]`` (output n's weights in group g are ``scale * q + zero``) -> uint8
    ``[N/4, K/32, 96]``: per tile of 4 outputs and group, 64 bytes of codes (byte i of an output's 16 =
    ``q[i] | q[16 + i] << 4``) then the 4 scales and the 4 zeros as float32 (csrc/int4_matmul.c).

    Raises:
        ValueError: N not a multiple of 4, K not of 32, or shapes that do not match.
    """
    n, k = q.shape
    if n % 4 or k % 32 or scale.shape != (n, k // 32) or zero.shape != (n, k // 32):
        raise ValueError(f"int4_pack takes codes [N, K] with N a multiple of 4 and K of 32, and scales and zeros "
                         f"[N, K/32]; got {tuple(q.shape)}, {tuple(scale.shape)}, {tuple(zero.shape)}")
    g = k // 32
    halves = q.to(torch.uint8).reshape(n, g, 2, 16)
    codes = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n // 4, 4, g, 16).transpose(1, 2).reshape(n // 4, g, 64)
    sz = torch.cat((scale.float().reshape(n // 4, 4, g).transpose(1, 2),
                    zero.float().reshape(n // 4, 4, g).transpose(1, 2)), dim=-1).contiguous()  # [N/4, G, 8]
    return torch.cat((codes, sz.view(torch.uint8).reshape(n // 4, g, 32)), dim=-1).contiguous()


def int8_pack(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Lay out 8-bit weights (GGUF Q8_0) for :func:`int4_matmul`: codes q ``[N, K]`` in -127..127 and
    float32 scale ``[N, K/32]`` (output n's weights in group g are ``scale * q``) -> uint8
    ``[N/4, K/32, 144]``: per tile of 4 outputs and group, 128 bytes of int8 codes (output j's 32
    at 32 j), then the 4 scales as float32 (csrc/int4_matmul.c).

    Raises:
        ValueError: N not a multiple of 4, K not of 32, or shapes that do not match.
    """
    n, k = q.shape
    if n % 4 or k % 32 or scale.shape != (n, k // 32):
        raise ValueError(f"int8_pack takes codes [N, K] with N a multiple of 4 and K of 32, and scales [N, K/32]; "
                         f"got {tuple(q.shape)}, {tuple(scale.shape)}")
    g = k // 32
    codes = q.to(torch.int8).reshape(n // 4, 4, g, 32).transpose(1, 2).reshape(n // 4, g, 128).view(torch.uint8)
    scales = scale.float().reshape(n // 4, 4, g).transpose(1, 2).contiguous().view(torch.uint8).reshape(n // 4, g, 16)
    return torch.cat((codes, scales), dim=-1).contiguous()


#: bytes per tile of 4 output rows and group of 32 inputs in :func:`bf16_tiles`' layout
BF16_BLOCK = 256


def bf16_tiles(weight: torch.Tensor) -> torch.Tensor:
    """Lay out a dense bfloat16 weight ``[N, K]`` for :func:`int4_matmul` -> uint8 ``[N/4, K/32, 256]``:
    per tile of 4 outputs and group of 32 inputs, output j's 32 weights at byte 64 j, unchanged.

    Raises:
        ValueError: not a 2-D bfloat16 weight with N a multiple of 4 and K of 32.
    """
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.shape[0] % 4 or weight.shape[1] % 32:
        raise ValueError(f"bf16_tiles takes a bfloat16 weight [N, K] with N a multiple of 4 and K of 32; "
                         f"got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    tiles = weight.reshape(n // 4, 4, k // 32, 32).transpose(1, 2).contiguous()  # [N/4, G, 4, 32]
    return tiles.view(torch.uint8).reshape(n // 4, k // 32, BF16_BLOCK)


def bf16_untile(blob: torch.Tensor) -> torch.Tensor:
    """The weight ``[N, K]`` bfloat16 a blob of :func:`bf16_tiles` holds (the same values)."""
    tiles, g, _ = blob.shape
    return blob.view(torch.bfloat16).reshape(tiles, g, 4, 32).transpose(1, 2).reshape(4 * tiles, 32 * g)


def blob_codes(blob: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The codes a blob of :func:`int4_pack` or :func:`int8_pack` holds, as those functions take them:
    (q ``[N, K]``, scale ``[N, K/32]``, zero ``[N, K/32]`` or None for 8-bit codes); packing them again
    gives the same blob.

    Raises:
        ValueError: not a ``[N/4, K/32, 96 or 144]`` uint8 blob.
    """
    if blob.dtype != torch.uint8 or blob.dim() != 3 or blob.shape[2] not in (INT4_BLOCK, 144):
        raise ValueError(f"not an int4/int8 blob: {blob.dtype} {tuple(blob.shape)}")
    tiles, g, width = blob.shape
    n, k = 4 * tiles, 32 * g
    if width == 144:
        q = blob[..., :128].contiguous().view(torch.int8).reshape(tiles, g, 4, 32).transpose(1, 2).reshape(n, k)
        scale = blob[..., 128:].contiguous().view(torch.float32).reshape(tiles, g, 4).transpose(1, 2).reshape(n, g)
        return q.to(torch.int16), scale.contiguous(), None
    codes = blob[..., :64].reshape(tiles, g, 4, 16).transpose(1, 2)  # [N/4, 4, G, 16]
    q = torch.cat((codes & 15, codes >> 4), dim=-1).reshape(n, k)
    sz = blob[..., 64:].contiguous().view(torch.float32).reshape(tiles, g, 8)
    scale = sz[..., :4].transpose(1, 2).reshape(n, g).contiguous()
    zero = sz[..., 4:].transpose(1, 2).reshape(n, g).contiguous()
    return q.to(torch.int16), scale, zero


#: bytes per tile of 4 outputs and group of 32 inputs -> the kernel that reads that layout
_BLOCK_KERNELS = {INT4_BLOCK: "q4_matmul", 144: "q8_matmul", BF16_BLOCK: "bf_matmul"}


def int4_matmul(x: torch.Tensor, blob: torch.Tensor, out_features: int, lib: Optional[Kernels] = None,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x @ W.T`` for weights laid out by :func:`int4_pack` (4-bit), :func:`int8_pack` (8-bit) or
    :func:`bf16_tiles` (dense bfloat16; the kernel follows the blob's layout): x ``[M, K]`` bfloat16 -> ``[M, N]`` in
    ``out_dtype`` (float32, or bfloat16: the float32 sums rounded to nearest even, as ``.to`` would),
    N = ``out_features``. Each row is computed the same way whatever M (csrc/int4_matmul.c).

    Raises:
        OSError: the kernel could not be built (see :func:`load_kernel`).
        ValueError: x not 2-D bfloat16, or a blob that does not match K and N.
        MemoryError: no memory for the kernel's per-thread buffers.
    """
    return _matmul(x, blob, out_features, lib, out_dtype, None)


def int4_matmul_best(x: torch.Tensor, blob: torch.Tensor, out_features: int, lib: Optional[Kernels] = None,
                     out_dtype: torch.dtype = torch.float32) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`int4_matmul` and each row's argmax, taken by the kernel's threads over the outputs they
    have just written (a greedy step then need not read its logits again): ``(y [M, N], best [M])``,
    ``best[m]`` the first index of the largest value of ``y[m]`` (as ``y[m].argmax()``), or -1 where
    ``y[m]`` holds NaN or inf.

    Raises: as :func:`int4_matmul`.
    """
    best = torch.empty(x.shape[0] if x.dim() == 2 else 0, dtype=torch.int64)
    return _matmul(x, blob, out_features, lib, out_dtype, best), best


def _matmul(x: torch.Tensor, blob: torch.Tensor, out_features: int, lib: Optional[Kernels],
            out_dtype: torch.dtype, best: Optional[torch.Tensor]) -> torch.Tensor:
    """:func:`int4_matmul`, filling ``best`` ``[M]`` int64 with each row's argmax where given."""
    lib = _loaded(lib)
    m, k = x.shape if x.dim() == 2 else (0, 0)
    if x.dim() != 2 or x.dtype != torch.bfloat16 or blob.dtype != torch.uint8 or not blob.is_contiguous() \
            or blob.dim() != 3 or blob.shape[:2] != (out_features // 4, k // 32) or out_features % 4 or k % 32 \
            or blob.shape[2] not in _BLOCK_KERNELS:
        raise ValueError(f"int4_matmul takes bfloat16 [M, K] activations and a [N/4, K/32, {INT4_BLOCK}, 144 or "
                         f"{BF16_BLOCK}] uint8 blob; "
                         f"got {x.dtype} {tuple(x.shape)} and {blob.dtype} {tuple(blob.shape)} for N = {out_features}")
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"int4_matmul writes float32 or bfloat16, not {out_dtype}")
    _on_host(x, blob)
    x = x.contiguous()
    y = torch.empty(m, out_features, dtype=out_dtype)
    args = (x.data_ptr(), m, k, blob.data_ptr(), out_features, y.data_ptr(), int(out_dtype == torch.bfloat16),
            torch.get_num_threads())
    name = _BLOCK_KERNELS[blob.shape[2]]
    rc = getattr(lib, name)(*args) if best is None else getattr(lib, name + "_best")(*args, best.data_ptr())
    if rc == -2:
        raise MemoryError(f"the int4 kernel could not allocate its buffers for {m} rows")
    if rc:
        raise ValueError(f"the int4 kernel does not take K = {k}, N = {out_features}")
    return y


@dataclass(frozen=True)
class StackWeights:
    """What :func:`layer_stack` reads of an int4 or dense bfloat16 Llama-family model's layers (built by
    :meth:`mtpctl.model.decoder.Decoder.native_stack`).

    Attributes:
        table: ``[layers, 10]`` long, per layer the addresses of its two norm weights (bfloat16
            ``[hidden]``) and four weight blobs (:func:`int4_pack` / :func:`int8_pack` / :func:`bf16_tiles`),
            then each blob's bytes per tile (96: 4-bit, 144: 8-bit, 256: bfloat16): input norm, post-attention norm, qkv,
            o_proj, gate_up, down, then their four tile sizes (``struct layer_weights``).
        shape: ``[6]`` long: layers, hidden, intermediate, heads, KV heads, head_dim.
        keep: the tensors the addresses point into (held so they stay alive).
        eps: the norms' epsilon; scale: what multiplies q.k.
    """

    table: torch.Tensor
    shape: torch.Tensor
    keep: tuple
    eps: float
    scale: float


def stack_part(stack: StackWeights, kv: torch.Tensor, kv_bf16: bool, start: int, end: int
               ) -> Tuple[StackWeights, torch.Tensor]:
    """Layers ``[start, end)`` of ``stack`` as a stack of their own, and the cache table ``kv`` ``[N, 4]``
    (:func:`cache_rows`) moved on to layer ``start`` of every token's cache, so that
    :func:`layer_stack` over them computes and writes what those layers of the whole stack do (a pass
    that returns intermediate layers runs the stack in parts, each part's ``x`` out being the residual
    stream after its last layer).

    Raises:
        ValueError: a layer range outside the stack, or an empty one.
    """
    layers = int(stack.shape[0])
    if not 0 <= start < end <= layers:
        raise ValueError(f"layers [{start}, {end}) of a stack of {layers}")
    shape = stack.shape.clone()
    shape[0] = end - start
    moved = kv.clone()
    moved[:, :2] += start * kv[:, 2:3] * (2 if kv_bf16 else 4)  # elements between two layers, in bytes
    return StackWeights(stack.table[start:end], shape, stack.keep, stack.eps, stack.scale), moved


def layer_stack(x: torch.Tensor, stack: StackWeights, final_norm: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, kv: torch.Tensor, dest: torch.Tensor, kv_bf16: bool, plan: SlotPlan,
                lib: Optional[Kernels] = None) -> torch.Tensor:
    """Every layer of an int4 or dense bfloat16 model's decode, verify or prefill pass, then its final norm, in one native call
    (csrc/layer_stack.c): the computation of :class:`mtpctl.model.decoder.DecoderLayer` on the
    native kernels, with SiLU's exponential of its own (results agree to rounding, not bit for bit),
    each token's row computed alike alone or in any pass.

    x ``[N, hidden]`` bfloat16, the embeddings (overwritten with the last layer's residual stream);
    ``final_norm`` ``[hidden]`` bfloat16; cos/sin ``[N, head_dim]`` bfloat16; kv, dest, kv_bf16 as in
    :func:`rotate_write`; ``plan`` as in :func:`attend` (checked by :func:`check_plan`). Returns the
    hidden states ``[N, hidden]`` bfloat16.

    Raises:
        OSError: the kernel could not be built (see :func:`load_kernel`).
        ValueError: tensors that do not fit the stack's shape, or a shape a kernel refuses.
        MemoryError: no memory for the pass's buffers.
    """
    lib = _loaded(lib)
    layers, hidden, _, heads, kv_heads, d = (int(v) for v in stack.shape)
    n = x.shape[0]
    halves = [x, final_norm, cos, sin]
    if any(t.dtype != torch.bfloat16 or not t.is_contiguous() for t in halves) or x.shape != (n, hidden) \
            or final_norm.shape != (hidden,) or cos.shape != (n, d) or sin.shape != (n, d) \
            or kv.shape != (n, 4) or dest.shape != (n,) or plan.starts.shape != (n,) \
            or not (kv.is_contiguous() and dest.is_contiguous()):
        raise ValueError(f"layer_stack takes contiguous bfloat16 x [N, {hidden}], cos/sin [N, {d}] and a "
                         f"[{hidden}] final norm with N-row cache tables; got x {tuple(x.shape)} {x.dtype}, "
                         f"cos {tuple(cos.shape)}, tables {tuple(kv.shape)} and {tuple(dest.shape)}")
    _on_host(x, final_norm, cos, sin, kv, dest, plan.starts, plan.ends, plan.paths)
    out = torch.empty_like(x)
    rc = lib.layer_stack(x.data_ptr(), n, stack.table.data_ptr(), stack.shape.data_ptr(), stack.eps, stack.scale,
                         final_norm.data_ptr(), cos.data_ptr(), sin.data_ptr(), kv.data_ptr(), dest.data_ptr(),
                         int(kv_bf16), plan.starts.data_ptr(), plan.ends.data_ptr(), plan.paths.data_ptr(),
                         plan.paths.shape[1], out.data_ptr(), torch.get_num_threads())
    if rc == -2:
        raise MemoryError(f"the native layer stack could not allocate its buffers for {n} tokens")
    if rc:
        raise ValueError(f"the native layer stack refused {layers} layers of {heads} heads over {kv_heads} KV heads "
                         f"of {d} values (or a slot outside its cache)")
    return out
