"""Row-invariance checked on first use: the check finds a product that computes a row differently
alone or in a block, verdicts are kept per CPU, torch and kernels' build, and a model whose fastest
path fails its check here decodes on one that holds, still exactly as plain decoding."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from helpers import PROMPT, ScriptedDrafter, greedy_reference, random_decoder, run, write_gguf_grid_checkpoint
from mtpctl.backends.torch import TorchSession
from mtpctl.errors import UnsupportedModel
from mtpctl.model import row_invariance
from mtpctl.model.linears import FixedRowsLinear, PackedLinear
from mtpctl.model.native import load_kernel
from mtpctl.model.row_invariance import (Verdict, dense_path, dtype_name, first_difference, int4_path, path_of,
                                         row_invariant, verdict)

SMALL = dict(shapes=((64, 96),), block_rows=(1, 2, 3, 8, 16), offsets=(0, 2))


def per_row_product(weight):
    """Each row in its own product of one shape: invariant by construction."""
    return lambda x: torch.cat([F.linear(row[None].expand(4, -1), weight)[:1] for row in x])


def test_a_row_invariant_product_passes():
    assert first_difference(per_row_product, torch.float32, **SMALL) == ""


def test_a_product_that_rounds_one_row_otherwise_is_caught():
    def one_row_differs(weight):
        return lambda x: F.linear(x, weight) + (1e-3 if len(x) == 1 else 0.0)

    assert first_difference(one_row_differs, torch.float32, **SMALL) == "shape (64, 96), 1 rows at offset 0"


def test_a_product_that_changes_past_some_rows_is_caught_at_that_size():
    def large_blocks_differ(weight):
        return lambda x: F.linear(x, weight) * (1.0001 if len(x) > 8 else 1.0)

    assert first_difference(large_blocks_differ, torch.float32, **SMALL) == "shape (64, 96), 1 rows at offset 0"
    assert first_difference(large_blocks_differ, torch.float32, shapes=((64, 96),), block_rows=(2, 8, 9),
                            offsets=(0,)) == "shape (64, 96), 2 rows at offset 0"


def test_a_verdict_is_kept_and_read_back(monkeypatch, tmp_path):
    monkeypatch.setenv("MTPCTL_HOME", str(tmp_path))
    verdict.cache_clear()
    checks = []
    monkeypatch.setattr(row_invariance, "_check", lambda path: checks.append(path) or Verdict(path, False, "row 3"))
    try:
        assert verdict("onednn-bfloat16") == Verdict("onednn-bfloat16", False, "row 3")
        kept = json.loads((tmp_path / "row_invariance.json").read_text())["verdicts"]
        assert [v["path"] for v in kept.values()] == ["onednn-bfloat16"]
        verdict.cache_clear()
        assert not row_invariant("onednn-bfloat16") and checks == ["onednn-bfloat16"]  # read, not checked again
        monkeypatch.setenv("MTPCTL_ROW_CHECK", "recheck")
        verdict.cache_clear()
        verdict("onednn-bfloat16")
        assert checks == ["onednn-bfloat16"] * 2
    finally:
        verdict.cache_clear()


def test_a_damaged_verdict_file_is_checked_again(monkeypatch, tmp_path):
    monkeypatch.setenv("MTPCTL_HOME", str(tmp_path))
    (tmp_path / "row_invariance.json").write_text("{not json")
    verdict.cache_clear()
    monkeypatch.setattr(row_invariance, "_check", lambda path: Verdict(path, True))
    try:
        assert row_invariant("fixed-rows-float32")
        assert json.loads((tmp_path / "row_invariance.json").read_text())["version"] == row_invariance.VERSION
    finally:
        verdict.cache_clear()


def test_an_unknown_path_is_a_programming_error():
    with pytest.raises(ValueError, match="no row-invariance check for path 'blas-float16'"):
        row_invariance._check("blas-float16")


def failing(monkeypatch, *paths):
    """Make ``paths`` fail their check here (the rest keep their real verdicts)."""
    real = row_invariance.row_invariant
    monkeypatch.setattr(row_invariance, "row_invariant", lambda path: path not in paths and real(path))


def test_dense_weights_fall_back_to_a_path_that_holds(monkeypatch):
    failing(monkeypatch, "native-tiles", "onednn-bfloat16", "onednn-float32")
    assert dense_path(torch.bfloat16, (64, 64)) == "fixed-rows-bfloat16"
    assert dense_path(torch.float32, (64, 64)) == "fixed-rows-float32"


@pytest.mark.skipif(load_kernel() is None, reason="no C compiler here to build the native kernels")
def test_int4_codes_fall_back_to_torchs_kernel_then_to_dense(monkeypatch):
    assert int4_path(torch.bfloat16) == "native-int4"
    failing(monkeypatch, "native-int4")
    assert int4_path(torch.bfloat16) == "torch-int4-bfloat16"
    failing(monkeypatch, "native-int4", "torch-int4-bfloat16")
    assert int4_path(torch.bfloat16) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_whose_fast_paths_fail_decodes_exactly_on_fixed_rows(monkeypatch, dtype):
    reference = greedy_reference(random_decoder(seed=3, dtype=dtype, blocked=True), PROMPT, 24)
    failing(monkeypatch, "native-tiles", "onednn-bfloat16", "onednn-float32")
    model = random_decoder(seed=3, dtype=dtype, blocked=True)
    paths = {path_of(m) for m in model.modules()} - {None}
    assert paths == {f"fixed-rows-{dtype_name(dtype)}"}
    assert all(isinstance(model.layers[0].__dict__["_modules"][n], FixedRowsLinear) for n in ("qkv", "down"))
    plain = greedy_reference(model, PROMPT, 24)
    # fixed-rows blocks sum in another order than the native or oneDNN kernels: near-ties may differ from
    # the reference, but speculation on this model reproduces this model's plain decoding exactly
    assert len(plain) == len(reference)
    drafter = ScriptedDrafter(len(PROMPT), plain, model.cfg.vocab_size, corrupt_every=3)
    spec = run(model, drafter, max_new=24)
    assert spec.token_ids == plain and spec.stats.accepted_tokens > 0


@pytest.mark.skipif(load_kernel() is None, reason="no C compiler here to build the native kernels")
def test_the_session_reports_each_path_and_its_verdict(monkeypatch, tmp_path, tiny_folder):
    session = TorchSession(tiny_folder, dtype="bfloat16")
    assert session.greedy_exactness == "bit-exact"
    assert set(session.matmul_paths.values()) == {"row-invariant"}
    grid = TorchSession(write_gguf_grid_checkpoint(tmp_path / "grid"), dtype="bfloat16", weights="int4")
    assert "native-int4" in grid.matmul_paths
    failing(monkeypatch, "native-int4")
    fallback = TorchSession(tmp_path / "grid", dtype="bfloat16", weights="int4")
    assert all(not m.native for m in fallback.model.modules() if isinstance(m, PackedLinear))
    assert "torch-int4-bfloat16" in fallback.matmul_paths and "native-int4" not in fallback.matmul_paths
    monkeypatch.setattr(row_invariance, "verdict", lambda path: Verdict(path, path != "torch-int4-bfloat16", "row 1"))
    assert fallback.greedy_exactness == "not-bit-exact"
    assert fallback.matmul_paths["torch-int4-bfloat16"] == "not row-invariant: row 1"


def test_int4_weights_with_no_row_invariant_kernel_are_refused_with_the_reason(monkeypatch, tmp_path):
    grid = write_gguf_grid_checkpoint(tmp_path / "grid")
    failing(monkeypatch, "native-int4", "torch-int4-bfloat16")
    monkeypatch.setattr(row_invariance, "verdict", lambda path: Verdict(path, False, "row 2 alone"))
    with pytest.raises(UnsupportedModel, match=r"no int4 kernel computes a row alike.*torch-int4-bfloat16 "
                                               r"\(row 2 alone\).*load the dense weights"):
        TorchSession(grid, dtype="bfloat16", weights="int4")
