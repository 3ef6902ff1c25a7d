"""The native kernels' build (mtpctl/model/native_build.py) and bindings (native.py, read from
csrc/kernels.h). The build cache survives damaged files, a hanging compiler and a missing source, and
CC may carry arguments; without a compiler, torch's ops serve. A load after damage runs in a fresh
process: dlopen hands a process the library it already loaded from a path, and a truncated library
can kill the process that loads it (SIGBUS)."""

import _ctypes
import ctypes
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from mtpctl.model import native, native_build
from mtpctl.decode.attention import slot_plan
from mtpctl.model.native import SlotPlan, load_kernel, tree_attention
from helpers import tree_positions

#: the tests that need the library built here (the others hold where there is no C compiler too)
BUILDS = pytest.mark.skipif(load_kernel() is None, reason="no C compiler here to build the native kernels")

LOAD = ("import sys; from mtpctl.model.native import load_kernel; lib = load_kernel(); "
        "sys.exit(0 if lib is not None and lib.tree_attention else 3)")


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("MTPCTL_HOME", str(tmp_path))
    monkeypatch.delenv("MTPCTL_NATIVE_KERNELS", raising=False)
    load_kernel.cache_clear()
    yield tmp_path
    load_kernel.cache_clear()


def built_library(home):
    (lib,) = (home / "kernels").glob("mtpctl_native-*.so")
    return lib


@BUILDS
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


@BUILDS
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
    monkeypatch.setattr(native_build, "BUILD_TIMEOUT_S", 0.5)
    started = time.monotonic()
    assert load_kernel() is None  # was: waited for the compiler forever
    assert time.monotonic() - started < 30
    assert f"({hang} did not finish in 0.5 s)" in capsys.readouterr().err


def test_a_missing_kernel_source_means_torch_ops_not_a_crash(home, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(native_build, "SOURCES", (tmp_path / "missing.c",))  # a package installed without csrc/
    assert load_kernel() is None
    assert "native kernels (attention, RMSNorm, RoPE, int4) unavailable ([Errno 2] No such file or directory" in capsys.readouterr().err


@BUILDS
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


@BUILDS
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
    assert native_build._first_error(stderr) == "k.c:3:10: fatal error: missing.h: No such file or directory"
    assert native_build._first_error("something odd\nlast words\n") == "last words"
    assert native_build._first_error("") == ""


@BUILDS
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


@BUILDS
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
    monkeypatch.setattr(native_build, "FLAGS", native_build.FLAGS + ("-O1",))  # other flags: no build to reuse
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
        native_build._compiler()
    assert str(e.value) == message


NO_COMPILER = """
from helpers import greedy_reference, random_decoder, run, PROMPT
from mtpctl.model.native import load_kernel, kernel_runs
model = random_decoder()
assert load_kernel() is None and not kernel_runs(4, 2, 16)
tokens = run(model, max_new=12).token_ids
assert tokens == greedy_reference(model, PROMPT, len(tokens)), tokens
print(len(tokens))
"""


def test_a_cpu_without_a_compiler_decodes_on_torchs_ops(tmp_path):
    """No compiler and no library built before (a fresh cache): one warning, then greedy decoding on
    torch's ops, in a fresh process (this one has loaded the library, where it builds)."""
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"), "MTPCTL_HOME": str(tmp_path / "home"),
           "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    env.pop("MTPCTL_NATIVE_KERNELS", None)
    done = subprocess.run([sys.executable, "-c", NO_COMPILER], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == 12
    warning = f"native kernels (attention, RMSNorm, RoPE, int4) unavailable (no C compiler '{tmp_path / 'no-such-cc'}'"
    assert done.stderr.count(warning) == 1 and done.stderr.count("warning") == 1, done.stderr
    assert not (tmp_path / "home" / "kernels").exists() or not list((tmp_path / "home" / "kernels").iterdir())


def test_every_source_includes_the_entry_points_header():
    """So the compiler holds each definition to the declaration the bindings are read from."""
    for source in native_build.SOURCES:
        assert '#include "kernels.h"' in source.read_text(encoding="utf-8"), source.name


HEADER = """/* a comment before */
/* entry points: begin */
int plain(void);

int wrapped(const float *x, int64_t n,
            uint16_t *out, float eps, int flag);
/* entry points: end */
"""


def test_the_header_parser_reads_its_format():
    entries = native.entry_points(HEADER)
    assert list(entries) == ["plain", "wrapped"]
    assert entries["plain"].argtypes == () and entries["plain"].restype is ctypes.c_int
    assert entries["wrapped"].argtypes == (ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float,
                                           ctypes.c_int)
    declared = native.entry_points()  # the package's header parses
    assert {"tree_attention", "rms_norm", "rope_write", "layer_stack", "matmul_isa"} <= set(declared)


@pytest.mark.parametrize("line, message", [
    ("int f(double x);", "parameter 'double x'"),
    ("int f(const char *s);", "parameter 'const char \\*s'"),
    ("int f(unsigned int n);", "parameter 'unsigned int n'"),
    ("int f(int64_t n)", "does not end with ';'"),
    ("static int f(int n);", "is not 'int NAME"),
    ("int f(int n); int g(int n);", "is not 'int NAME"),
    ("int f(int);", "parameter 'int'"),
    ("int plain(void);", "plain is declared twice"),
])
def test_the_header_parser_refuses_what_it_does_not_know(line, message):
    with pytest.raises(ValueError, match=message):
        native.entry_points(HEADER.replace("/* entry points: end */", line + "\n/* entry points: end */"))


def test_the_header_parser_wants_its_markers():
    for text in ("int f(void);\n", HEADER.replace("/* entry points: end */\n", ""), HEADER + HEADER):
        with pytest.raises(ValueError, match="entry points: begin"):
            native.entry_points(text)


@BUILDS
def test_the_library_exports_exactly_the_declared_entry_points():
    lib = load_kernel()
    for name, entry in lib.entries.items():
        function = getattr(lib, name)
        assert function.argtypes == list(entry.argtypes) and function.restype is entry.restype, name
    with pytest.raises(AttributeError, match="not declared in csrc/kernels.h"):
        lib.malloc  # noqa: B018 (dlsym finds it through the library, but it is no entry point)
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm here to list the library's symbols")
    listed = subprocess.run([nm, "-D", "--defined-only", str(lib.path)], capture_output=True, text=True, check=True)
    exported = {line.split()[-1] for line in listed.stdout.splitlines() if line.split()[1:2] == ["T"]}
    assert exported - {"_init", "_fini"} == set(lib.entries)


class Checked:
    """A bound library that checks each call against the header: the function is declared and gets
    as many arguments as its declaration has (ctypes alone lets a cdecl call pass more)."""

    def __init__(self, lib):
        self.lib, self.called = lib, set()

    def __getattr__(self, name):
        entry = self.lib.entries.get(name)
        assert entry is not None, f"the Python side calls {name}, which csrc/kernels.h does not declare"

        def call(*args):
            assert len(args) == len(entry.argtypes), f"{name} gets {len(args)} arguments, declared {len(entry.argtypes)}"
            self.called.add(name)
            return getattr(self.lib, name)(*args)
        return call


@BUILDS
def test_every_call_from_python_is_declared_with_its_argument_count(monkeypatch):
    """Decoding on the native kernels (layer by layer and in one stacked call, int4 and bfloat16 tiles)
    and the matmuls of every weight layout call every entry point, each as kernels.h declares it."""
    from helpers import gguf_grid_decoder, random_decoder, run

    checked = Checked(load_kernel())
    monkeypatch.setattr(native, "load_kernel", lambda portable=False: checked)
    for model in (gguf_grid_decoder(), random_decoder(dtype=torch.bfloat16, blocked=True)):
        for stacked in (True, False):
            model.layer_stack = stacked
            assert len(run(model, max_new=3).token_ids) == 3
    g = torch.Generator().manual_seed(0)
    scale = torch.rand(8, 2, generator=g)
    blobs = (native.int4_pack(torch.randint(0, 16, (8, 64), generator=g), scale, -scale),
             native.int8_pack(torch.randint(-127, 128, (8, 64), generator=g), scale),
             native.bf16_tiles(torch.randn(8, 64, generator=g).bfloat16()))
    x = torch.randn(3, 64, generator=g).bfloat16()
    for blob in blobs:  # the lm_head's kernels, which take each row's argmax too
        native.int4_matmul(x, blob, 8)
        native.int4_matmul_best(x, blob, 8)
    assert native.matmul_isa() in native.MATMUL_ISAS.values()
    assert checked.called == set(checked.lib.entries)
