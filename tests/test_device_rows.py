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
from mtpctl.backends.torch import TorchSession
from virtual_cuda import virtual_cuda

CASES = {"llama, attention biases": dict(attention_bias=True),
         "mistral, sliding window": dict(model_type="mistral", sliding_window=8),
         "qwen3, QK norm": dict(model_type="qwen3"),
         "gemma3, sandwich norms and local rope": dict(model_type="gemma3_text", sliding_window=8)}
NEW_TOKENS = 40


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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", CASES)
def test_a_verify_pass_computes_each_token_as_its_plain_step(tmp_path, case, dtype):
    folder = write_tiny_checkpoint(tmp_path / "model", seed=1, **CASES[case])
    with virtual_cuda() as mode:
        session = TorchSession(folder, dtype, device="cuda", kernels="torch")
        rows = _recorded_rows(session.model)
        prompt = session.encode("count: 1 2 3 1 2 3")
        plain = session.generate(prompt, NEW_TOKENS).token_ids
        plain_rows = dict(rows)
        rows.clear()
        drafter = ScriptedDrafter(len(prompt), plain, session.vocab_size, budget=5)  # every draft right
        result = session.generate(prompt, NEW_TOKENS, drafter=drafter)
    assert result.token_ids == plain
    assert len(plain) >= 24 and result.stats.decode_steps < len(plain) // 3  # passes of several rows
    shared = sorted(plain_rows.keys() & rows.keys())
    assert len(shared) >= len(plain) - 2
    differ = [p for p in shared if not torch.equal(plain_rows[p], rows[p])]
    assert not differ, f"rows at positions {differ} differ from their plain steps"
    assert not [e for e in mode.events if e.kind == "mixup"]
