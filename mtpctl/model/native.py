"""The native kernels (``csrc/tree_attention.c``, ``rms_norm.c``, ``rope.c``, ``int4_matmul.c``,
``layer_stack.c``), built on first use.

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

Both are compiled into one library with the system C compiler (``$CC``, else ``cc``) into
``$MTPCTL_HOME/kernels/`` the first time it is needed (about a second) and loaded with ctypes; it
uses OpenMP through the ``libgomp`` torch already loaded, so it shares torch's thread count. Where
there is no compiler (and no library built before for these sources and this CPU), or the build
fails, :func:`load_kernel` returns None once, with a warning on
stderr, and the engine keeps the pure-torch attention (:func:`mtpctl.model.decoder._attention`)
and norms, which give the same guarantee more slowly.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import List, Optional, Tuple

import torch

from mtpctl.files import mtpctl_home

SOURCES = tuple(Path(__file__).with_name("csrc") / name
                for name in ("tree_attention.c", "rms_norm.c", "rope.c", "int4_matmul.c", "layer_stack.c"))
HEADERS = tuple(Path(__file__).with_name("csrc") / name for name in ("bf16.h", "kernels.h"))  # included by the sources: part of the build's key
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
#: seconds a build may take (it takes about one): a compiler that hangs costs this, then torch's ops
BUILD_TIMEOUT_S = 120.0


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


def _first_error(stderr: str) -> str:
    """The compiler's first line that names an error (the cause, not "compilation terminated."), else
    its last line; "" for no output."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return errors[0] if errors else (lines[-1] if lines else "")


def _digest_file(out: Path) -> Path:
    """The sidecar holding the sha256 of the library a build wrote at ``out``."""
    return out.with_name(out.name + ".sha256")


def _intact(out: Path) -> bool:
    """Whether ``out`` holds the library a build wrote there (its sha256 matches the sidecar): a
    truncated or otherwise damaged file, which dlopen may crash the process on (SIGBUS), is rebuilt
    instead of loaded."""
    try:
        return _digest_file(out).read_text(encoding="ascii").strip() == hashlib.sha256(out.read_bytes()).hexdigest()
    except (OSError, UnicodeDecodeError):
        return False


def _compiler() -> Tuple[List[str], str]:
    """The C compiler's command (``$CC``, which may carry arguments such as "ccache gcc", else ``cc``)
    and what identifies it in the build's key: the command and the resolved path of its program.

    Raises:
        OSError: ``$CC`` does not parse, or its program is not on PATH.
    """
    try:
        command = shlex.split(os.environ.get("CC") or "cc")
    except ValueError as e:
        raise OSError(f"CC={os.environ['CC']!r} does not parse ({e})") from e
    if not command:
        raise OSError(f"CC={os.environ['CC']!r} names no compiler")
    found = shutil.which(command[0])
    if found is None:  # the program looked up: "ccache" of "ccache gcc", "/opt/my" of an unquoted "/opt/my cc"
        given = f" (CC={os.environ['CC']!r})" if len(command) > 1 else ""
        raise OSError(f"no C compiler {command[0]!r} on PATH{given}")
    return command, " ".join(command) + "\n" + os.path.realpath(found)


def _any_build(kernels: Path, key: str) -> Optional[Path]:
    """The newest intact build ``kernels/mtpctl_native-{key}-*.so`` (same sources, flags and CPU, any
    compiler), else None: where ``$CC`` is gone, a library built before still serves."""
    builds = sorted(kernels.glob(f"mtpctl_native-{key}-*.so"), key=lambda p: p.stat().st_mtime, reverse=True)
    return next((p for p in builds if _intact(p)), None)


def _build(out: Path, flags: Tuple[str, ...], command: List[str]) -> None:
    compiler = " ".join(command)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        part = Path(tmp) / out.name
        try:
            done = subprocess.run([*command, *flags, *map(str, SOURCES), "-o", str(part), "-lm"], capture_output=True,
                                  text=True, timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            raise OSError(f"{compiler} did not finish in {BUILD_TIMEOUT_S:g} s") from e
        if done.returncode:
            raise OSError(f"{compiler} failed: {_first_error(done.stderr) or f'exit status {done.returncode}'}")
        digest = Path(tmp) / _digest_file(out).name
        digest.write_text(hashlib.sha256(part.read_bytes()).hexdigest() + "\n", encoding="ascii")
        # each rename is atomic; a reader between the two sees a mismatch and rebuilds (harmless)
        os.replace(part, out)
        os.replace(digest, _digest_file(out))


def _cpu_signature() -> bytes:
    """What -march=native compiles for: the CPU's model and feature flags (a cache shared by different
    machines must not hand one a kernel built for another's instructions)."""
    try:
        lines = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return platform.machine().encode() + platform.processor().encode()
    keep = [line for line in lines if line.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part")]
    return "\n".join(sorted(set(keep))).encode()


@lru_cache(maxsize=2)
def load_kernel(portable: bool = False) -> Optional[ctypes.CDLL]:
    """The compiled kernel (built into ``$MTPCTL_HOME/kernels`` if needed), or None where it cannot
    be built (a warning on stderr, once); ``MTPCTL_NATIVE_ATTENTION=0`` (or false/off/no) turns it off.

    ``portable`` builds without ``-march=native``: the kernel's plain-C path, which the default build
    uses on CPUs without AVX-512 (the tests check it on machines that have AVX-512)."""
    switch = os.environ.get("MTPCTL_NATIVE_ATTENTION", "1").strip().lower()
    if switch in ("0", "false", "off", "no"):
        return None
    if switch not in ("", "1", "true", "on", "yes"):
        print(f"mtpctl: warning: MTPCTL_NATIVE_ATTENTION={os.environ['MTPCTL_NATIVE_ATTENTION']!r} is not one of "
              "0/false/off/no or 1/true/on/yes; the native kernels stay on", file=sys.stderr)
    flags = tuple(f for f in FLAGS if not (portable and f.startswith("-march")))
    try:
        source = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
        # the key covers the sources, flags and CPU, then the compiler: a change to any of them builds anew
        key = hashlib.sha256(source + " ".join(flags).encode() + _cpu_signature()).hexdigest()[:12]
        try:
            command, identity = _compiler()
        except OSError:  # no compiler (any more): a build of these sources for this CPU by any compiler serves
            path = _any_build(mtpctl_home() / "kernels", key)
            if path is None:
                raise
        else:
            compiler = hashlib.sha256(identity.encode()).hexdigest()[:8]
            path = mtpctl_home() / "kernels" / f"mtpctl_native-{key}-{compiler}.so"
            if not _intact(path):
                _build(path, flags, command)
        lib = ctypes.CDLL(str(path))
        lib.tree_attention, lib.rms_norm, lib.rope_write, lib.q4_matmul, lib.q8_matmul, lib.bf_matmul  # noqa: B018
        lib.q4_matmul_best, lib.q8_matmul_best, lib.bf_matmul_best, lib.layer_stack, lib.matmul_isa  # noqa: B018
    except (OSError, AttributeError) as e:
        print(f"mtpctl: warning: native kernels (attention, RMSNorm, RoPE, int4) unavailable ({e}); using torch's "
              "ops (slower; install a C compiler or set $CC, or MTPCTL_NATIVE_ATTENTION=0 to silence this)",
              file=sys.stderr)
        return None
    lib.rms_norm.restype = ctypes.c_int
    lib.rms_norm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_int,
                                                     ctypes.c_int]
    for matmul in (lib.q4_matmul, lib.q8_matmul, lib.bf_matmul):
        matmul.restype = ctypes.c_int
        matmul.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                           ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    for matmul in (lib.q4_matmul_best, lib.q8_matmul_best, lib.bf_matmul_best):
        matmul.restype = ctypes.c_int
        matmul.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                           ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lib.rope_write.restype = ctypes.c_int
    lib.rope_write.argtypes = ([ctypes.c_void_p] + [ctypes.c_int64] * 5 + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                                                          ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                                                          ctypes.c_void_p, ctypes.c_int])
    lib.tree_attention.restype = ctypes.c_int
    lib.tree_attention.argtypes = ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3
                                   + [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_int])
    lib.layer_stack.restype = ctypes.c_int
    lib.layer_stack.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float,
                                 ctypes.c_float] + [ctypes.c_void_p] * 5 + [ctypes.c_int] + [ctypes.c_void_p] * 3
                                + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int])
    return lib


#: what :func:`matmul_isa` calls each path of ``csrc/int4_matmul.c``, by the number the library returns
MATMUL_ISAS = {2: "avx512-bf16", 1: "avx2", 0: "portable"}


def matmul_isa(lib: Optional[ctypes.CDLL] = None) -> Optional[str]:
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


def _loaded(lib: Optional[ctypes.CDLL]) -> ctypes.CDLL:
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
                   plan: SlotPlan, lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
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
           lib: Optional[ctypes.CDLL] = None, kv_bf16: bool = False) -> torch.Tensor:
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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
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
               first: int, heads: int, kv_heads: int, lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
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
                 dest: torch.Tensor, heads: int, kv_heads: int, lib: Optional[ctypes.CDLL] = None,
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


def int4_matmul(x: torch.Tensor, blob: torch.Tensor, out_features: int, lib: Optional[ctypes.CDLL] = None,
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


def int4_matmul_best(x: torch.Tensor, blob: torch.Tensor, out_features: int, lib: Optional[ctypes.CDLL] = None,
                     out_dtype: torch.dtype = torch.float32) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`int4_matmul` and each row's argmax, taken by the kernel's threads over the outputs they
    have just written (a greedy step then need not read its logits again): ``(y [M, N], best [M])``,
    ``best[m]`` the first index of the largest value of ``y[m]`` (as ``y[m].argmax()``), or -1 where
    ``y[m]`` holds NaN or inf.

    Raises: as :func:`int4_matmul`.
    """
    best = torch.empty(x.shape[0] if x.dim() == 2 else 0, dtype=torch.int64)
    return _matmul(x, blob, out_features, lib, out_dtype, best), best


def _matmul(x: torch.Tensor, blob: torch.Tensor, out_features: int, lib: Optional[ctypes.CDLL],
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


def layer_stack(x: torch.Tensor, stack: StackWeights, final_norm: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, kv: torch.Tensor, dest: torch.Tensor, kv_bf16: bool, plan: SlotPlan,
                lib: Optional[ctypes.CDLL] = None) -> torch.Tensor:
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
