"""The pure-torch path (``--kernels torch``, the code a CUDA device runs) on the CPU: its linears give a
row the same result in any pass, the real model's greedy speculation reproduces its plain greedy, a
device that is not there is one clear error, and the native kernels refuse tensors off the host."""

import json

import pytest
import torch

from helpers import assert_one_line_exit_2, cli, first_divergence
from mtpctl.backends.torch import TorchSession
from mtpctl.drafters.lookahead import LookaheadDrafter
from mtpctl.drafters.ngram import NgramDrafter
from mtpctl.errors import BadInput
from mtpctl.model.device import FIXED_ROWS, resolve_device, resolve_placement
from mtpctl.model.linears import FixedRowsLinear
from mtpctl.model.native import int4_matmul, load_kernel, rms_norm

PROMPTS = ["Repeat this sentence exactly, twice: The quick brown fox jumps over the lazy dog.",
           "Write a Python function that returns the n-th Fibonacci number.",
           "Explain in two sentences what a KV cache is."]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 4, 8])
def test_a_row_comes_out_the_same_in_any_pass(dtype, rows):
    gen = torch.Generator().manual_seed(0)
    weight = (0.05 * torch.randn(1728, 576, generator=gen)).to(dtype)
    linear = FixedRowsLinear(weight, rows)
    row = torch.randn(1, 576, generator=gen).to(dtype)
    alone = linear(row)[0]
    for m in (2, 3, rows + 1, 3 * rows + 2):
        for at in (0, m - 1):
            block = torch.randn(m, 576, generator=gen).to(dtype)
            block[at] = row[0]
            assert torch.equal(linear(block)[at], alone), (m, at)
    reference = torch.nn.functional.linear(row.double(), weight.double())[0]
    assert torch.allclose(alone.double(), reference, rtol=0.02, atol=0.02)


def test_placement_resolves_names_and_refuses_what_is_not_there():
    assert resolve_placement("cpu", "auto").kernels == "native"
    placement = resolve_placement("cpu", "torch")
    assert (placement.device.type, placement.native, placement.rows) == ("cpu", False, FIXED_ROWS["cpu"])
    if not torch.cuda.is_available():
        assert resolve_device("auto").type == "cpu"
        with pytest.raises(BadInput, match="cuda") as err:
            resolve_device("cuda:0")
        assert err.value.option == "device"
    with pytest.raises(BadInput, match="unknown device"):
        resolve_device("tpu")
    with pytest.raises(BadInput, match="unknown kernels") as err:
        resolve_placement("cpu", "triton")
    assert err.value.option == "kernels"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
@pytest.mark.parametrize("flags, fragment", [(["--device", "cuda"], "(--device)"),
                                             (["--device", "cuda:3"], "(--device)"),
                                             (["--kernels", "native", "--device", "gpu"], "unknown device")])
def test_a_device_that_is_not_there_is_one_line_and_exit_2(capsys, tiny_folder, flags, fragment):
    code, out, err = cli(capsys, "generate", "-m", tiny_folder, *flags, "--no-chat", "abc")
    assert_one_line_exit_2(code, out, err, fragment)


@pytest.mark.skipif(load_kernel() is None, reason="the native kernels do not build here")
def test_the_native_kernels_refuse_tensors_off_the_host():
    off_host = torch.empty(4, 64, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match="host memory"):
        rms_norm(off_host, torch.ones(64, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="host memory"):
        int4_matmul(off_host, torch.empty(1, 2, 256, dtype=torch.uint8, device="meta"), 4)


def test_json_says_where_and_how_it_ran(capsys, tiny_folder):
    code, out, err = cli(capsys, "generate", "-m", tiny_folder, "--kernels", "torch", "--speculate", "ngram",
                         "--max-new-tokens", 8, "--no-chat", "--json", "abcabcabc")
    assert code == 0, err
    result = json.loads(out)
    assert (result["device"], result["kernels"], result["attention"]) == ("cpu", "torch", "torch")
    # bit-exact exactly when every product the path runs passed its row check on this CPU (torch's float32
    # attention products do not on an Intel AMX host: there it says so)
    held = all(v == "row-invariant" for v in result["matmul_paths"].values())
    assert result["greedy_exactness"] == ("bit-exact" if held else "not-bit-exact") and result["matmul_isa"] is None
    assert set(result["matmul_paths"]) == {"fixed-rows-float32", "torch-attention-float32"}


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def torch_session(request, smollm2_folder):
    return TorchSession(smollm2_folder, request.param, device="cpu", kernels="torch")


@pytest.mark.real
@pytest.mark.parametrize("drafter", ["ngram", "lookahead"])
@pytest.mark.slow
def test_speculation_on_the_torch_path_reproduces_its_plain_greedy(torch_session, drafter):
    for prompt in PROMPTS[:2]:
        ids = torch_session.encode(prompt)
        plain = torch_session.generate(ids, 40).token_ids
        spec = NgramDrafter(3, 1, 4) if drafter == "ngram" else LookaheadDrafter()
        result = torch_session.generate(ids, 40, drafter=spec)
        assert result.token_ids == plain
        assert result.stats.tau > 1.0


@pytest.mark.real
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.slow
def test_the_two_kernel_paths_part_only_at_near_ties(smollm2_folder, dtype):
    """The native kernels and torch's sum in other orders, so greedy output may part where two tokens'
    logits (nearly) tie; nowhere else (docs/numerics.md gives the measured agreement)."""
    native = TorchSession(smollm2_folder, dtype, device="cpu", kernels="native")
    pure = TorchSession(smollm2_folder, dtype, device="cpu", kernels="torch")
    for prompt in PROMPTS:
        ids = native.encode(prompt)
        a, b = native.generate(ids, 48).token_ids, pure.generate(ids, 48).token_ids
        at = first_divergence(a, b)
        if at < 0:
            assert len(a) == len(b)
            continue
        engine = native.new_engine(len(ids) + at + 1)
        logits = engine.prefill(ids + a[:at])[0]
        gap = float(logits[a[at]] - logits[b[at]])
        assert 0 <= gap <= 0.02 * float(logits.abs().max()), (prompt, at, gap)


def test_a_cuda_session_pins_torch_precision_switches():
    """Opening a session on a CUDA device turns off TF32 and reduced-precision reductions, whatever was set
    before (torch's own default lets bfloat16 matmuls reduce in lower precision); on a CPU nothing changes.
    The switches are process-wide: this test puts them back."""
    from mtpctl.model.device import device_numerics, pin_device_numerics

    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = (matmul.fp32_precision, cudnn.fp32_precision, matmul.allow_fp16_reduced_precision_reduction,
             matmul.allow_bf16_reduced_precision_reduction)
    try:
        matmul.fp32_precision, cudnn.fp32_precision = "tf32", "tf32"
        matmul.allow_fp16_reduced_precision_reduction = matmul.allow_bf16_reduced_precision_reduction = True
        assert pin_device_numerics(torch.device("cpu")) == {} and matmul.fp32_precision == "tf32"
        assert device_numerics(torch.device("cuda"))["float32_matmul"] == "tf32"
        assert pin_device_numerics(torch.device("cuda")) == {
            "float32_matmul": "ieee", "float32_conv": "ieee", "float16_reduced_precision_reduction": False,
            "bfloat16_reduced_precision_reduction": False}
    finally:
        (matmul.fp32_precision, cudnn.fp32_precision, matmul.allow_fp16_reduced_precision_reduction,
         matmul.allow_bf16_reduced_precision_reduction) = saved
