"""Building the native kernels' library (``csrc/*.c``) with the system C compiler, cached by what it
was built from; :mod:`mtpctl.model.native` loads it and binds its entry points.

:func:`build` compiles every source into one shared library with ``$CC`` (else ``cc``) into
``$MTPCTL_HOME/kernels/mtpctl_native-KEY-COMPILER.so``, KEY the sha256 of the sources and headers,
the flags and the CPU, COMPILER that of the compiler's command and resolved path; a sidecar
``.so.sha256`` lets a damaged file be rebuilt instead of loaded. Where there is no compiler, an
intact library built before for the same sources, flags and CPU by any compiler serves.

Why on first use, not at install or in a build step: the library is compiled with ``-march=native``
for the CPU that runs it (its AVX-512 BF16 or AVX2 paths), so it cannot be built ahead of knowing
that CPU, and a cache shared by several machines keeps one build per CPU (the key covers it). The
package itself stays pure Python: installing it needs no compiler, and a CPU without one keeps
working on torch's ops (:func:`mtpctl.model.native.load_kernel` returns None, with one warning). A
build takes about a second, once per source change, CPU and compiler. Where a runtime image should
carry no compiler, loading the kernels once before removing it leaves a build that keeps serving.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import List, Optional, Tuple

from mtpctl.files import mtpctl_home

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(CSRC / name for name in ("tree_attention.c", "rms_norm.c", "rope.c", "int4_matmul.c", "layer_stack.c"))
#: declares every entry point the library exports; each source includes it, and the bindings are read from it
ENTRY_POINTS_HEADER = CSRC / "kernels.h"
HEADERS = (CSRC / "bf16.h", ENTRY_POINTS_HEADER)  # included by the sources: part of the build's key
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
#: seconds a build may take (it takes about one): a compiler that hangs costs this, then torch's ops
BUILD_TIMEOUT_S = 120.0


#: environment variable forcing the kernels' matmul path below the CPU's best, to run what another CPU
#: runs: ``avx2`` (built without AVX-512: the path of a CPU with AVX2 and FMA only), ``portable`` (plain
#: C, no -march=native); unset, empty or ``auto``: the best this CPU has
ISA_SWITCH = "MTPCTL_MATMUL_ISA"
FORCED_ISAS = ("auto", "avx2", "portable")


def forced_isa() -> str:
    """The matmul path :data:`ISA_SWITCH` forces (``avx2``, ``portable``), or ``auto``.

    Raises:
        OSError: a value that is not one of :data:`FORCED_ISAS`, or ``avx2`` on a CPU without AVX2 and
            FMA (a library built for them would stop the process on its first instruction).
    """
    forced = os.environ.get(ISA_SWITCH, "").strip().lower() or "auto"
    if forced not in FORCED_ISAS:
        raise OSError(f"{ISA_SWITCH}={os.environ[ISA_SWITCH]!r} is not one of {', '.join(FORCED_ISAS)}")
    if forced == "avx2" and not {"avx2", "fma"} <= cpu_flags():
        raise OSError(f"{ISA_SWITCH}=avx2 asked for, but this CPU lacks AVX2 or FMA")
    return forced


def build_flags(portable: bool = False) -> Tuple[str, ...]:
    """The compiler flags of a build: :data:`FLAGS`, without ``-march=native`` for ``portable`` (or
    :data:`ISA_SWITCH` ``portable``), with AVX-512 turned off for :data:`ISA_SWITCH` ``avx2``.

    Raises:
        OSError: see :func:`forced_isa`.
    """
    forced = forced_isa()
    if portable or forced == "portable":
        return tuple(f for f in FLAGS if not f.startswith("-march"))
    return FLAGS + (("-mno-avx512f",) if forced == "avx2" else ())


def build(portable: bool = False) -> Path:
    """The path of the library built from :data:`SOURCES` for this CPU, compiled into
    ``$MTPCTL_HOME/kernels`` if no intact build is there yet.

    ``portable`` builds without ``-march=native``: the kernels' plain-C path, which the default
    build takes on CPUs without AVX-512 (:func:`build_flags`; :data:`ISA_SWITCH` forces a path too).

    Raises:
        OSError: a source is missing, there is no compiler (and no build by another), the compiler
            fails or does not finish in :data:`BUILD_TIMEOUT_S`; a bad :data:`ISA_SWITCH`.
    """
    flags = build_flags(portable)
    key = build_key(flags)
    kernels = mtpctl_home() / "kernels"
    try:
        command, identity = _compiler()
    except OSError:  # no compiler (any more): a build of these sources for this CPU by any compiler serves
        path = _any_build(kernels, key)
        if path is None:
            raise
        return path
    path = kernels / f"mtpctl_native-{key}-{hashlib.sha256(identity.encode()).hexdigest()[:8]}.so"
    if not _intact(path):
        _build(path, flags, command)
    return path


def build_key(flags: Tuple[str, ...]) -> str:
    """What a build depends on besides its compiler: the sources and headers, ``flags`` and the CPU
    (a change to any of them builds anew). Raises OSError where a source cannot be read."""
    source = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    return hashlib.sha256(source + " ".join(flags).encode() + cpu_signature()).hexdigest()[:12]


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
    """Compile :data:`SOURCES` with ``command`` and ``flags`` into ``out`` and its sha256 sidecar,
    each moved into place whole (a reader never maps a half-written library).

    Raises:
        OSError: the compiler fails or does not finish in :data:`BUILD_TIMEOUT_S`.
    """
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


def cpu_flags() -> set:
    """The CPU's feature flags (/proc/cpuinfo's ``flags``; empty where it cannot be read)."""
    for line in cpu_signature().decode(errors="replace").splitlines():
        if line.split(":")[0].strip() in ("flags", "Features"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_signature() -> bytes:
    """What -march=native compiles for: the CPU's model and feature flags (a cache shared by different
    machines must not hand one a kernel built for another's instructions)."""
    try:
        lines = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return platform.machine().encode() + platform.processor().encode()
    keep = [line for line in lines if line.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part")]
    return "\n".join(sorted(set(keep))).encode()
