"""CPU weight layouts: exact int4 packing of weights that lie on a Q4_1 or Q8_0 grid, the native
kernels' tiles for dense bfloat16 weights, and oneDNN's blocked layout for dense float32/bfloat16 weights."""

import pytest
import torch
import torch.nn.functional as F
from helpers import BLOCKED_DTYPES

from mtpctl.model.native import load_kernel
from mtpctl.model.linears import BlockedLinear, TiledLinear, blocked_layout_available, pack_exact
from mtpctl.model.row_invariance import dtype_name, row_invariant, verdict

needs_onednn = pytest.mark.skipif(not blocked_layout_available(), reason="this torch build has no oneDNN linear ops")


def q4_1_grid(n=64, k=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15  # ggml's Q4_1 puts each group's min at q = 0 and max at q = 15
    d = torch.rand(n, k // 32, 1, generator=g).half().float() * 0.05
    m = -torch.rand(n, k // 32, 1, generator=g).half().float() * 0.4
    return (q * d + m).reshape(n, k)


def q8_0_grid(n=64, k=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=g).float()
    q[..., 0] = 127  # ggml's Q8_0 puts each group's largest |x| at |q| = 127
    d = torch.rand(n, k // 32, 1, generator=g).half().float() * 0.01
    return (q * d).reshape(n, k)


def test_q4_1_grid_packs_exactly():
    w = q4_1_grid()
    packed = pack_exact(w, torch.float32)  # float32 scales: the file's weights exactly
    assert packed is not None and len(packed.parts) == 1
    x = torch.randn(5, 96)
    torch.testing.assert_close(packed(x), F.linear(x, w), atol=1e-5, rtol=1e-5)
    fast = pack_exact(w)  # bfloat16 scales and activations: the fast path
    torch.testing.assert_close(fast(x.bfloat16()).float(), F.linear(x, w), atol=0.05, rtol=0.02)


def test_q8_0_grid_packs_as_two_int4_parts():
    w = q8_0_grid()
    packed = pack_exact(w, torch.float32)
    assert packed is not None and len(packed.parts) == 2
    x = torch.randn(3, 2, 96)
    torch.testing.assert_close(packed(x), F.linear(x, w), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("native", [None, False])  # the native int4 kernel where it builds; torch's
@pytest.mark.parametrize("grid", [q4_1_grid, q8_0_grid])
def test_packed_rows_do_not_depend_on_the_block(native, grid):
    """The property lossless verification rests on: a row alone equals that row inside a block (13
    rows: the native kernel's register path for up to 4 rows and its buffered path beyond)."""
    packed = pack_exact(grid(n=256, k=512), native=native)
    assert packed.native == (native is None and load_kernel() is not None)
    x = torch.randn(13, 512).bfloat16()
    block = packed(x)
    assert block.dtype == torch.bfloat16 and block.shape == (13, 256)
    for i in range(13):
        assert torch.equal(block[i], packed(x[i:i + 1])[0])
    for rows in (2, 4, 5, 9):
        assert torch.equal(block[:rows], packed(x[:rows]))


@pytest.mark.skipif(load_kernel() is None, reason="no C compiler here to build the native kernels")
@pytest.mark.parametrize("grid", [q4_1_grid, q8_0_grid])
def test_native_int4_kernel_is_as_close_to_the_weights_as_bfloat16_allows(grid):
    w = grid(n=128, k=256)
    packed = pack_exact(w)
    assert packed.native and len(packed.parts) == 1  # Q8_0 as its 8-bit codes, not two 4-bit halves
    x = torch.randn(6, 256).bfloat16()
    exact = x.double() @ w.double().T
    got = packed(x).double()
    # each weight rounded to bfloat16 once (2^-9 relative), the float32 sums, the output's rounding
    assert ((got - exact).abs() <= 2 ** -8 * (x.double().abs() @ w.double().abs().T) + 1e-6).all()
    torch_kernel = pack_exact(w, native=False)(x).double()  # the same product, other roundings
    assert ((got - torch_kernel).abs() <= 2 ** -6 * (x.double().abs() @ w.double().abs().T) + 1e-6).all()


@pytest.mark.skipif(load_kernel() is None, reason="no C compiler here to build the native kernels")
def test_portable_int4_kernel_is_batch_invariant_and_agrees_with_the_simd_one():
    from mtpctl.model.native import int4_matmul, int4_pack
    from mtpctl.model.linears import pack_q4

    (q, scale, zero), = pack_q4(q4_1_grid(n=64, k=128))
    blob = int4_pack(q, scale, zero)
    portable = load_kernel(portable=True)
    x = torch.randn(7, 128).bfloat16()
    block = int4_matmul(x, blob, 64, lib=portable)
    for i in range(7):
        assert torch.equal(int4_matmul(x[i:i + 1], blob, 64, lib=portable)[0], block[i])
    # the same bfloat16 weights; only the float32 sums round in another order
    scale_of_sums = x.double().abs() @ (q * scale.repeat_interleave(32, 1) + zero.repeat_interleave(32, 1)).abs().T.double()
    assert ((block.double() - int4_matmul(x, blob, 64).double()).abs() <= 1e-5 * scale_of_sums).all()
    with pytest.raises(ValueError, match="bfloat16"):
        int4_matmul(x.float(), blob, 64)
    with pytest.raises(ValueError, match="multiple of 4"):
        int4_pack(q[:6], scale[:6], zero[:6])


def test_weights_off_the_grid_are_left_alone():
    assert pack_exact(torch.randn(64, 96)) is None
    nudged = q4_1_grid()
    nudged[3, 7] += 1e-3
    assert pack_exact(nudged) is None
    assert pack_exact(q4_1_grid()[:, :80].contiguous()) is None  # K not a multiple of the group size


@needs_onednn
@pytest.mark.parametrize("dtype", BLOCKED_DTYPES)
def test_blocked_weight_keeps_its_values(dtype):
    w = torch.randn(96, 64).to(dtype)
    blocked = BlockedLinear(w)
    assert torch.equal(blocked.dense(), w) and blocked.nbytes == w.numel() * w.element_size()
    x = torch.randn(3, 5, 64).to(dtype)
    torch.testing.assert_close(blocked(x).float(), F.linear(x, w).float(), atol=0.02, rtol=0.01)
    assert blocked(x).shape == (3, 5, 96)


@needs_onednn
@pytest.mark.parametrize("dtype", BLOCKED_DTYPES)
@pytest.mark.parametrize("shape", [(1536, 576), (576, 1536), (960, 576)])
def test_blocked_rows_do_not_depend_on_the_block(dtype, shape):
    """Each row alone (computed as the row twice), and inside blocks of 2 to 33 rows, comes out the
    same: what lossless verification rests on, in float32 too (torch's default float32 kernel is not
    batch-invariant). Large-magnitude rows too, where a one-row kernel's different rounding would show.
    Asserted where this CPU selects the layout: where its check failed here (oneDNN's bfloat16 kernels on
    an Intel CPU with AMX), the decoder holds no weight in it (tests/test_row_invariance.py)."""
    path = f"onednn-{dtype_name(dtype)}"
    if not row_invariant(path):
        pytest.skip(f"{path} is not row-invariant on this CPU ({verdict(path).detail}): mtpctl never selects it here")
    g = torch.Generator().manual_seed(0)
    blocked = BlockedLinear((torch.randn(*shape, generator=g) * 0.05).to(dtype))
    x = (torch.randn(33, shape[1], generator=g) * torch.logspace(-2, 2, 33)[:, None]).to(dtype)
    full = blocked(x)
    for rows in range(2, 33):
        assert torch.equal(blocked(x[:rows]), full[:rows])
    for i in range(33):
        assert torch.equal(blocked(x[i]), full[i])


@pytest.mark.skipif(load_kernel() is None, reason="no C compiler here to build the native kernels")
def test_tiled_weight_keeps_its_values_and_computes_a_row_alike_in_any_block():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(960, 576, generator=g) * 0.05).bfloat16()
    tiled = TiledLinear(w)
    assert torch.equal(tiled.dense(), w) and tiled.nbytes == w.numel() * w.element_size()
    x = (torch.randn(17, 576, generator=g) * torch.logspace(-2, 2, 17)[:, None]).bfloat16()
    full = tiled(x)
    torch.testing.assert_close(full.float(), F.linear(x.float(), w.float()), atol=0.02, rtol=0.01)
    assert full.dtype == torch.bfloat16 and tiled(x.reshape(17, 1, 576)).shape == (17, 1, 960)
    assert all(torch.equal(tiled(x[:rows]), full[:rows]) for rows in range(1, 17))
    assert all(torch.equal(tiled(x[i]), full[i]) for i in range(17))


def test_blocked_layout_refuses_other_dtypes():
    with pytest.raises(ValueError, match="float32/bfloat16"):
        BlockedLinear(torch.randn(4, 4).half())


@pytest.mark.skipif(load_kernel() is None, reason="no C compiler here to build the native kernels")
def test_native_int4_bfloat16_output_is_the_float32_output_rounded():
    from mtpctl.model.native import int4_matmul, int4_pack
    from mtpctl.model.linears import pack_q4

    (q, scale, zero), = pack_q4(q4_1_grid(n=64, k=128))
    blob = int4_pack(q, scale, zero)
    x = torch.randn(6, 128).bfloat16()
    assert torch.equal(int4_matmul(x, blob, 64, out_dtype=torch.bfloat16), int4_matmul(x, blob, 64).bfloat16())
    with pytest.raises(ValueError, match="float16"):
        int4_matmul(x, blob, 64, out_dtype=torch.float16)


def test_packed_blobs_give_back_their_codes_and_select_rows():
    """blob_codes inverts int4_pack / int8_pack; PackedLinear.select_rows keeps the selected rows' codes,
    so its outputs are those rows of the full weight's outputs, bit for bit."""
    from mtpctl.model.linears import PackedLinear
    from mtpctl.model.native import blob_codes, int4_pack, int8_pack

    g = torch.Generator().manual_seed(0)
    q4 = torch.randint(0, 16, (16, 64), generator=g)
    scale, zero = torch.rand(16, 2, generator=g), torch.randn(16, 2, generator=g)
    codes, scales, zeros = blob_codes(int4_pack(q4, scale, zero))
    assert torch.equal(codes.long(), q4) and torch.equal(scales, scale) and torch.equal(zeros, zero)
    q8 = torch.randint(-127, 128, (16, 64), generator=g)
    codes, scales, zeros = blob_codes(int8_pack(q8, scale))
    assert torch.equal(codes.long(), q8) and torch.equal(scales, scale) and zeros is None
    with pytest.raises(ValueError, match="not an int4/int8 blob"):
        blob_codes(torch.zeros(4, 2, 100, dtype=torch.uint8))
    x = torch.randn(5, 64, generator=g).bfloat16()
    index = torch.tensor([3, 0, 9, 15, 1, 2, 7, 8])
    for parts in ([(q4, scale, zero)], [(q8, scale, None)]):
        full = PackedLinear(parts, 16, native=None)
        rows = full.select_rows(index)
        if not full.native:
            assert rows is None  # torch's kernel keeps no codes to select from
            continue
        assert torch.equal(rows(x), full(x)[:, index])
        assert full.select_rows(index[:6]) is None  # the native layout takes rows in fours
