"""The CPU matrix on one machine: the native matmul's AVX2 and portable paths forced
(``MTPCTL_MATMUL_ISA``), with oneDNN and torch's own kernels held to the same instruction sets
(``ONEDNN_MAX_CPU_ISA``, ``ATEN_CPU_CAPABILITY``), as on a CPU that has only those. In each, greedy
prompt lookup (alone and in a batch) must equal plain greedy decoding token for token, on the tiny
model and the real SmolLM2, with every product on a path that passed its row-invariance check there.
Each case runs tests/speculation_equals_plain.py in a process of its own (the switches are read at
start-up)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import write_gguf_grid_checkpoint
from mtpctl.model.native import load_kernel
from mtpctl.model.native_build import cpu_flags

SCRIPT = Path(__file__).with_name("speculation_equals_plain.py")
FORCED = {"avx2": {"MTPCTL_MATMUL_ISA": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
          "portable": {"MTPCTL_MATMUL_ISA": "portable", "ONEDNN_MAX_CPU_ISA": "SSE41",
                       "ATEN_CPU_CAPABILITY": "default"}}

pytestmark = pytest.mark.skipif(load_kernel() is None, reason="no C compiler here to build the native kernels")


@pytest.fixture(scope="module")
def matrix_home(tmp_path_factory) -> Path:
    """One $MTPCTL_HOME for the matrix: each forced path's kernels are built once."""
    return tmp_path_factory.mktemp("matrix-home")


def run_forced(isa: str, home: Path, folder: Path, dtype: str, weights: str, new_tokens: int = 24) -> dict:
    if isa == "avx2" and not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("this CPU has no AVX2 and FMA: the AVX2 path cannot run here")
    env = {**os.environ, **FORCED[isa], "MTPCTL_HOME": str(home), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(SCRIPT), str(folder), dtype, weights, str(new_tokens)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def assert_exact(result: dict, isa: str, native_matmul: bool) -> None:
    assert result["matmul_isa"] == (isa if native_matmul else None)
    assert result["greedy_exactness"] == "bit-exact"
    assert result["matmul_paths"] and all(v == "row-invariant" for v in result["matmul_paths"].values())
    assert all(result["ngram_equal"]) and all(result["batch_equal"])


@pytest.mark.parametrize("isa", list(FORCED))
def test_tiny_models_decode_exactly_on_the_forced_path(isa, matrix_home, tmp_path, tiny_folder):
    grid = write_gguf_grid_checkpoint(tmp_path / "grid")
    for folder, dtype, weights in ((tiny_folder, "float32", "dense"), (tiny_folder, "bfloat16", "dense"),
                                   (grid, "bfloat16", "int4")):
        result = run_forced(isa, matrix_home, folder, dtype, weights)
        assert_exact(result, isa, native_matmul=dtype == "bfloat16")


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.parametrize("isa, dtype, weights", [("avx2", "bfloat16", "dense"), ("avx2", "bfloat16", "int4"),
                                                 ("avx2", "float32", "dense"), ("portable", "bfloat16", "dense"),
                                                 ("portable", "bfloat16", "int4")])
def test_smollm2_decodes_exactly_on_the_forced_path(isa, dtype, weights, matrix_home, smollm2_folder):
    tokens = 12 if isa == "portable" else 24  # the portable C path is several times slower
    result = run_forced(isa, matrix_home, smollm2_folder, dtype, weights, tokens)
    assert_exact(result, isa, native_matmul=dtype == "bfloat16")
    assert result["ngram_accepted"] > 0  # the drafts were verified, not only proposed
