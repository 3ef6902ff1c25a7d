"""On the device path (``device="cuda"`` under the virtual CUDA device, tests/virtual_cuda.py), a verify
pass computes each of its tokens bit for bit as the plain decode step of that token computes it: the
final hidden state of every row, not only the tokens, across the families' layer shapes (attention
biases, sliding windows, QK norm, Gemma's sandwich norms and local rope) in float32 and bfloat16. Plain
steps and verify passes go through the same fixed-shape ops (docs/numerics.md, "The pure-torch path");
what the virtual device runs is the CPU's kernels on those shapes, so this holds the code's structure,
and the GPU's own kernels are gpu_check's to prove."""

from __future__ import annotations

import pytest
import torch

from helpers import ScriptedDrafter, write_tiny_checkpoint
from test_families import MOE
from mtpctl.backends.torch import TorchSession
from virtual_cuda import virtual_cuda

CASES = {"llama, attention biases": dict(attention_bias=True),
         "mistral, sliding window": dict(model_type="mistral", sliding_window=8),
         "qwen3, QK norm": dict(model_type="qwen3"),
         "gemma3, sandwich norms and local rope": dict(model_type="gemma3_text", sliding_window=8)}
NEW_TOKENS = 40


#: bodies whose passes are not padded to the 64-row block (MoE, latent attention): a verify pass of 64
#: rows and a plain step of one reach the fixed-row products through different row counts
UNPADDED = {"qwen3_moe": dict(model_type="qwen3_moe", **MOE["qwen3_moe"]),
            "deepseek_v3, latent attention": dict(model_type="deepseek_v3", **MOE["deepseek_v3"])}


def _recorded_rows(model) -> dict:
    """position -> the final hidden state ``[hidden]`` of the decode or verify pass row at that position
    (prefill, which has no plans, is left out); filled as the model runs."""
    rows, forward = {}, model.forward

    def recording(input_ids, position_ids, cache, masks, plans=None, aux=None):
        out = forward(input_ids, position_ids, cache, masks, plans, aux)
        if plans is not None:
            for j in range(cache.rows):
                rows.setdefault(int(position_ids[0, j]), out[0, j].clone())
        return out

    model.forward = recording
    return rows


def _plain_and_verified_rows(folder, dtype, prompt_text: str, new_tokens: int, budget: int):
    """(plain tokens, speculation's result, plain's rows, the verify passes' rows) on the virtual device,
    every draft right (so every verify row is on plain's path), up to ``budget`` drafts a pass."""
    with virtual_cuda() as mode:
        session = TorchSession(folder, dtype, device="cuda", kernels="torch")
        rows = _recorded_rows(session.model)
        prompt = session.encode(prompt_text)
        plain = session.generate(prompt, new_tokens).token_ids
        plain_rows = dict(rows)
        rows.clear()
        drafter = ScriptedDrafter(len(prompt), plain, session.vocab_size, budget=budget)
        result = session.generate(prompt, new_tokens, drafter=drafter)
    assert not [e for e in mode.events if e.kind == "mixup"]
    return plain, result, plain_rows, rows


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", CASES)
def test_a_verify_pass_computes_each_token_as_its_plain_step(tmp_path, case, dtype):
    folder = write_tiny_checkpoint(tmp_path / "model", seed=1, **CASES[case])
    plain, result, plain_rows, rows = _plain_and_verified_rows(folder, dtype, "count: 1 2 3 1 2 3", NEW_TOKENS, 5)
    assert result.token_ids == plain
    assert len(plain) >= 24 and result.stats.decode_steps < len(plain) // 3  # passes of several rows
    shared = sorted(plain_rows.keys() & rows.keys())
    assert len(shared) >= len(plain) - 2
    differ = [p for p in shared if not torch.equal(plain_rows[p], rows[p])]
    assert not differ, f"rows at positions {differ} differ from their plain steps"


@pytest.mark.parametrize("case", UNPADDED)
def test_a_verify_pass_of_a_whole_block_computes_each_token_as_its_plain_step(tmp_path, case):
    """A body whose passes are not padded (MoE, latent attention) in bfloat16: a verify pass of exactly
    64 rows (one whole block, the residual added in the products) gives each row its plain step's bits,
    as a one-row step (padded inside each product) does. A residual added in the product for whole
    blocks only, and after it for the rest, changed every row and the tokens."""
    folder = write_tiny_checkpoint(tmp_path / "model", seed=1, max_position_embeddings=256, **UNPADDED[case])
    plain, result, plain_rows, rows = _plain_and_verified_rows(folder, "bfloat16", "x", 70, 63)
    assert result.token_ids == plain
    assert len(plain) == 70 and result.stats.decode_steps <= 3  # passes of 64 rows
    shared = sorted(plain_rows.keys() & rows.keys())
    assert len(shared) >= 60
    differ = [p for p in shared if not torch.equal(plain_rows[p], rows[p])]
    assert not differ, f"rows at positions {differ} differ from their plain steps"
