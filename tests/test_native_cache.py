"""The native kernel's build cache (mtpctl/model/native.py) survives damaged files, a hanging compiler and a
missing source, and CC may carry arguments. A load after damage runs in a fresh process: dlopen hands a
process the library it already loaded from a path, and a truncated library can kill the process that
loads it (SIGBUS)."""

import _ctypes
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from mtpctl.model import native
from mtpctl.decode.attention import slot_plan
from mtpctl.model.native import SlotPlan, load_kernel, tree_attention
from helpers import tree_positions

pytestmark = pytest.mark.skipif(load_kernel() is None, reason="no C compiler here to build the native attention kernel")

LOAD = ("import sys; from mtpctl.model.native import load_kernel; lib = load_kernel(); "
        "sys.exit(0 if lib is not None and lib.tree_attention else 3)")


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MTPCTL_HOME", str(tmp_path))
    monkeypatch.delenv("MTPCTL_NATIVE_ATTENTION", raising=False)
    load_kernel.cache_clear()
    yield tmp_path
    load_kernel.cache_clear()


def built_library(home):
    (lib,) = (home / "kernels").glob("mtpctl_native-*.so")
    return lib


@pytest.mark.parametrize("damage", ["truncated", "empty", "another library"])
def test_a_damaged_cached_library_is_rebuilt_not_loaded(home, damage):
    # built by another process: this one must not map a file it then damages in place (SIGBUS at exit)
    first = subprocess.run([sys.executable, "-c", LOAD], env={**os.environ, "OMP_NUM_THREADS": "1"},
                           capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    lib = built_library(home)
    good = lib.read_bytes()
    if damage == "truncated":
        lib.write_bytes(good[:3000])  # loading this killed the process with SIGBUS
    elif damage == "empty":
        lib.write_bytes(b"")  # this was a warning and torch's ops on every run, never rebuilt
    else:
        shutil.copyfile(_ctypes.__file__, lib)  # a shared library without the kernel: was an AttributeError
    again = subprocess.run([sys.executable, "-c", LOAD], env={**os.environ, "OMP_NUM_THREADS": "1"},
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and again.stderr == "", (again.returncode, again.stderr)
    assert built_library(home).read_bytes() == good  # rebuilt (the compiler's output is deterministic)


def test_cc_may_carry_arguments(home, monkeypatch, capsys):
    monkeypatch.setenv("CC", f"{shutil.which('cc') or shutil.which('gcc')} -O2")
    assert load_kernel() is not None and capsys.readouterr().err == ""
    monkeypatch.setenv("MTPCTL_HOME", str(home / "other"))
    monkeypatch.setenv("CC", "cc 'unbalanced")
    load_kernel.cache_clear()
    assert load_kernel() is None
    assert capsys.readouterr().err.startswith("mtpctl: warning: native kernels (attention, RMSNorm, RoPE, int4) unavailable (CC=\"cc 'unbalanced\"")


def test_a_compiler_that_hangs_costs_the_build_timeout_then_torch_ops(home, monkeypatch, capsys, tmp_path):
    hang = tmp_path / "hanging-cc"
    hang.write_text("#!/bin/sh\nexec sleep 60\n")
    hang.chmod(0o755)
    monkeypatch.setenv("CC", str(hang))
    monkeypatch.setattr(native, "BUILD_TIMEOUT_S", 0.5)
    started = time.monotonic()
    assert load_kernel() is None  # was: waited for the compiler forever
    assert time.monotonic() - started < 30
    assert f"({hang} did not finish in 0.5 s)" in capsys.readouterr().err


def test_a_missing_kernel_source_means_torch_ops_not_a_crash(home, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(native, "SOURCES", (tmp_path / "missing.c",))  # a package installed without csrc/
    assert load_kernel() is None
    assert "native kernels (attention, RMSNorm, RoPE, int4) unavailable ([Errno 2] No such file or directory" in capsys.readouterr().err


def test_a_plan_that_does_not_fit_the_pass_is_refused_not_read_past():
    """The C code trusts the plan's rows and the cache's size: a mismatch read past them."""
    depth, tree_mask = tree_positions([-1, 0, 0])
    q, keys = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 12, 16)
    plan = slot_plan([None], 8, depth, tree_mask)[None]
    assert tree_attention(q, keys, keys, 0.25, plan).shape == q.shape
    for bad in (slot_plan([None], 8, depth[:2], tree_mask[:2, :2])[None],  # rows for 2 tokens, 3 in the pass
                SlotPlan(plan.starts.int(), plan.ends, plan.paths),  # int32 read as int64
                SlotPlan(plan.starts, plan.ends + 2, plan.paths + 2),  # 10 + 3 slots in a cache of 12
                SlotPlan(plan.starts, plan.ends, torch.cat((plan.paths, plan.paths), 1)[:, ::2])):  # strided: read as flat
        with pytest.raises(ValueError, match="slot plan"):
            tree_attention(q, keys, keys, 0.25, bad)


def test_the_result_does_not_depend_on_torchs_default_dtype():
    g = torch.Generator().manual_seed(0)
    q, keys, values = (torch.randn(1, heads, n, 16, generator=g, dtype=torch.float32)
                       for heads, n in ((4, 2), (2, 6), (2, 6)))
    plan = slot_plan([None], 3, torch.arange(2), None)[None]
    rows = []
    for default in (torch.float32, torch.float64):
        before = torch.get_default_dtype()
        torch.set_default_dtype(default)
        try:
            rows.append(tree_attention(q, keys, values, 0.25, plan))  # was garbage under float64
        finally:
            torch.set_default_dtype(before)
    assert rows[1].dtype == torch.float32 and torch.equal(rows[0], rows[1])


def test_a_failed_build_reports_the_compilers_first_error_line():
    stderr = ("k.c:3:10: fatal error: missing.h: No such file or directory\n    3 | #include <missing.h>\n"
              "compilation terminated.\n")
    assert native._first_error(stderr) == "k.c:3:10: fatal error: missing.h: No such file or directory"
    assert native._first_error("something odd\nlast words\n") == "last words"
    assert native._first_error("") == ""


def test_another_compiler_gets_its_own_build(home, monkeypatch):
    # the cache key covers $CC: a build by one compiler is not handed to a process that names another
    cc = shutil.which("cc") or shutil.which("gcc")
    monkeypatch.setenv("CC", cc)
    assert load_kernel() is not None
    first = built_library(home)
    monkeypatch.setenv("CC", f"{cc} -O2")
    load_kernel.cache_clear()
    assert load_kernel() is not None
    names = sorted(p.name for p in (home / "kernels").glob("mtpctl_native-*.so"))
    assert len(names) == 2 and first.name in names


def test_a_built_library_is_reused_once_its_compiler_is_gone(home, monkeypatch, capsys):
    # with $CC in the key, a build made before the compiler was removed (a slim runtime image,
    # a shared MTPCTL_HOME) fell back to torch's ops; the build of these sources for this CPU serves
    monkeypatch.setenv("CC", shutil.which("cc") or shutil.which("gcc"))
    assert load_kernel() is not None
    first = built_library(home)
    for missing in ("no-such-cc-31", "cc 'unbalanced"):
        monkeypatch.setenv("CC", missing)
        load_kernel.cache_clear()
        assert load_kernel() is not None and capsys.readouterr().err == ""
        assert built_library(home) == first  # no other build
    monkeypatch.setattr(native, "FLAGS", native.FLAGS + ("-O1",))  # other flags: no build to reuse
    load_kernel.cache_clear()
    assert load_kernel() is None
    assert "unavailable (CC=\"cc 'unbalanced\" does not parse" in capsys.readouterr().err


@pytest.mark.parametrize("cc, message", [
    ("ccache-31-missing gcc", "no C compiler 'ccache-31-missing' on PATH (CC='ccache-31-missing gcc')"),
    ("/opt/my cc31/gcc", "no C compiler '/opt/my' on PATH (CC='/opt/my cc31/gcc')"),  # unquoted: split at the space
    ("no-such-cc-31", "no C compiler 'no-such-cc-31' on PATH"),
    (" ", "CC=' ' names no compiler"),
])
def test_a_missing_compiler_is_named_as_looked_up(monkeypatch, cc, message):
    # "ccache gcc" without ccache said "no C compiler 'ccache gcc'", and CC=" " "no C compiler ''"
    monkeypatch.setenv("CC", cc)
    with pytest.raises(OSError) as e:
        native._compiler()
    assert str(e.value) == message
