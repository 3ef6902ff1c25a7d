"""Adversarial checks of the native RMSNorm, fused RoPE + cache write and int4/bfloat16 matmul kernels
(csrc/rms_norm.c, rope.c, int4_matmul.c) on the shapes and values their own tests leave out: int4
outputs that are a multiple of 4 but not of 16, K = 32, passes of 1 to 40 rows (the direct paths for
up to 4 rows and for 5 to 8, the buffered one above; bfloat16 tiles read in place above 4), NaN/inf activations, the widest norm rows, odd head_dims and
the last slots of a cache, and the build a CPU with AVX-512 but no AVX512-BF16 gets
(``-march=native -mno-avx512bf16``: the matmul's AVX2 path on x86, fused multiply-adds in the other
kernels' plain C, which the portable build, compiled without ``-march``, does not exercise)."""

import platform

import pytest
import torch

from mtpctl.model import native, native_build
from mtpctl.model.kv_cache import KVCache
from mtpctl.model.decoder import _rms_norm, _rotate
from mtpctl.model.native import bf16_tiles, bf16_untile, int4_matmul, int4_pack, load_kernel, rms_norm, rope_write

pytestmark = pytest.mark.skipif(load_kernel() is None, reason="no C compiler here to build the native kernels")


def codes(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g)
    scale = torch.rand(n, k // 32, generator=g) * 0.1
    zero = -torch.rand(n, k // 32, generator=g) * 0.5
    return q, scale, zero


def dequantized(q, scale, zero):
    """The kernel's weights: scale * q + zero per group, rounded once to bfloat16 (float64 then
    bfloat16 equals the float32 fused multiply-add rounded to bfloat16 here: both round once)."""
    s, z = scale.double().repeat_interleave(32, 1), zero.double().repeat_interleave(32, 1)
    return (s * q.double() + z).to(torch.bfloat16)


def assert_rows_invariant(x, blob, n, lib):
    """Every row of every prefix x[:m] (m = 1..len(x)) and every lone row gets the bits of the full pass."""
    for out_dtype in (torch.float32, torch.bfloat16):
        full = int4_matmul(x, blob, n, lib=lib, out_dtype=out_dtype)
        for m in range(1, len(x) + 1):
            assert torch.equal(int4_matmul(x[:m], blob, n, lib=lib, out_dtype=out_dtype), full[:m]), (m, out_dtype)
        for i in range(len(x)):
            assert torch.equal(int4_matmul(x[i:i + 1], blob, n, lib=lib, out_dtype=out_dtype), full[i:i + 1])
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            assert torch.equal(int4_matmul(x, blob, n, lib=lib, out_dtype=out_dtype), full)
        finally:
            torch.set_num_threads(threads)


@pytest.mark.parametrize("n, k", [(4, 32), (20, 32), (36, 96)])
def test_int4_odd_shapes_give_a_row_the_same_bits_in_any_pass_and_match_float64(n, k):
    q, scale, zero = codes(n, k, seed=n + k)
    blob = int4_pack(q, scale, zero)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert_rows_invariant(x, blob, n, load_kernel())
    w = dequantized(q, scale, zero).double()
    exact = x.double() @ w.T
    magnitude = x.double().abs() @ w.abs().T
    got = int4_matmul(x, blob, n).double()
    # products of bfloat16 values are exact in float32; only the float32 sums round (K / 32 groups)
    assert ((got - exact).abs() <= 1e-6 * magnitude).all()
    got16 = int4_matmul(x, blob, n, out_dtype=torch.bfloat16).double()
    assert ((got16 - exact).abs() <= 2 ** -8 * exact.abs() + 1e-6 * magnitude).all()


def assert_float32_sums(got, x, w):
    """Products of bfloat16 values are exact in float32; only the float32 sums round (K / 32 groups)."""
    exact = x.double() @ w.double().T
    assert ((got.double() - exact).abs() <= 1e-6 * (x.double().abs() @ w.double().abs().T)).all()


@pytest.mark.parametrize("n, k", [(4, 32), (20, 32), (36, 96)])
def test_bf16_tiles_give_a_row_the_same_bits_in_any_pass_and_match_float64(n, k):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)).bfloat16()
    blob = bf16_tiles(w)
    assert blob.shape == (n // 4, k // 32, 256) and torch.equal(bf16_untile(blob), w)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert_rows_invariant(x, blob, n, load_kernel())
    assert_float32_sums(int4_matmul(x, blob, n), x, w)


def test_bf16_tiles_refuse_what_they_cannot_lay_out():
    for bad in (torch.randn(6, 32).bfloat16(), torch.randn(4, 48).bfloat16(), torch.randn(4, 32)):
        with pytest.raises(ValueError, match="bf16_tiles takes"):
            bf16_tiles(bad)


def test_int4_propagates_nan_and_inf_like_a_float_product():
    n, k = 8, 64
    q, scale, zero = codes(n, k, seed=3)
    zero.abs_()  # positive weights: an infinite activation gives an infinite output of its sign
    blob = int4_pack(q, scale, zero)
    x = torch.randn(10, k, generator=torch.Generator().manual_seed(2)).bfloat16()
    x[0, 3], x[1, 5], x[2, 7] = float("nan"), float("inf"), -float("inf")
    for rows in (x[:3], x[:6], x):  # the direct paths (3 rows, 6 rows) and the buffered one (10)
        got = int4_matmul(rows.contiguous(), blob, n)
        assert got[0].isnan().all()
        assert (got[1] == float("inf")).all() and (got[2] == -float("inf")).all()
    assert torch.isfinite(int4_matmul(x[3:], blob, n)).all()


def test_rms_norm_of_the_widest_rows_is_batch_invariant_and_matches_torch():
    dim = native.NORM_MAX_DIM
    g = torch.Generator().manual_seed(4)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(5, dim, generator=g) * 3).to(dtype)
        w = torch.randn(dim, generator=g).to(dtype)
        block = rms_norm(x, w, 1e-6)
        for i in range(5):
            assert torch.equal(rms_norm(x[i:i + 1], w, 1e-6), block[i:i + 1])
        want = _rms_norm(x, w, 1e-6).float()
        assert ((block.float() - want).abs() <= 1e-5 * want.abs() + 1e-6).all()  # sum order only
    with pytest.raises(ValueError, match="multiple of 16"):
        rms_norm(torch.randn(1, dim + 16), torch.ones(dim + 16), 1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [2, 6, 18])
def test_rope_write_with_odd_half_head_dims_into_the_last_slots(dtype, d):
    """head_dim / 2 odd (the kernel loops over halves of any even width) and a pass that fills the
    cache's last slots exactly: bit for bit _rotate + KVCache.write; one slot more is refused."""
    heads, kv_heads, n, capacity = 3, 1, 4, 9
    g = torch.Generator().manual_seed(d)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    half = torch.rand(n, d // 2, generator=g) * 100
    angles = torch.cat((half, half), dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    want, got = KVCache(1, 1, kv_heads, d, capacity), KVCache(1, 1, kv_heads, d, capacity)
    want.length = got.length = capacity - n
    qk = qkv[None, :, :(heads + kv_heads) * d].unflatten(-1, (heads + kv_heads, d))
    rotated = _rotate(qk, cos[None, :, None], sin[None, :, None]).transpose(1, 2)
    v = qkv[None, :, (heads + kv_heads) * d:].unflatten(-1, (kv_heads, d)).transpose(1, 2)
    want.write(0, rotated[:, heads:], v)
    keys, values = got.layer_for_write(0, n)
    q = rope_write(qkv, cos, sin, keys, values, got.length, heads, kv_heads)
    assert torch.equal(q, rotated[0, :heads].transpose(0, 1).float())
    assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)
    with pytest.raises(ValueError, match="overflow"):
        got.layer_for_write(0, n + 1)
    with pytest.raises(ValueError, match="does not take"):
        rope_write(qkv, cos, sin, keys, values, got.length + 1, heads, kv_heads)


def test_kernels_built_for_avx512_without_bf16_stay_batch_invariant_and_exact(monkeypatch):
    """The build a CPU with AVX-512 (or AVX2) but no AVX512-BF16 gets: -march=native compiles the
    matmul's AVX2 path (float32 fused multiply-adds of the bfloat16-rounded weights) and the other
    kernels' plain C, where the compiler may fuse multiply-adds; a row must still get the same bits in
    any pass, and RoPE must still equal torch's separately rounded products."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("-mno-avx512bf16 is an x86 flag")
    monkeypatch.setattr(native_build, "FLAGS", ("-O3", "-march=native", "-mno-avx512bf16") + native_build.FLAGS[2:])
    native.load_kernel.cache_clear()
    try:
        lib = native.load_kernel()
    finally:
        native.load_kernel.cache_clear()  # later tests load the default build again (cached on disk)
    if lib is None:
        pytest.skip("this compiler does not build the kernels with -mno-avx512bf16")
    n, k = 20, 96
    q, scale, zero = codes(n, k, seed=9)
    blob = int4_pack(q, scale, zero)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(9)).bfloat16()
    assert_rows_invariant(x, blob, n, lib)
    w = dequantized(q, scale, zero).double()
    assert ((int4_matmul(x, blob, n, lib=lib).double() - x.double() @ w.T).abs()
            <= 1e-6 * (x.double().abs() @ w.abs().T)).all()
    dense = torch.randn(n, k, generator=torch.Generator().manual_seed(10)).bfloat16()
    assert_rows_invariant(x, bf16_tiles(dense), n, lib)
    assert_float32_sums(int4_matmul(x, bf16_tiles(dense), n, lib=lib), x, dense)
    for dtype in (torch.float32, torch.bfloat16):
        d, heads, kv_heads, rows = 64, 3, 1, 5
        qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=torch.Generator().manual_seed(1)).to(dtype)
        angles = torch.rand(rows, d, generator=torch.Generator().manual_seed(2)) * 100
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        cache = KVCache(1, 1, kv_heads, d, rows)
        keys, values = cache.layer_for_write(0, rows)
        got = rope_write(qkv, cos, sin, keys, values, 0, heads, kv_heads, lib=lib)
        want = _rotate(qkv[None, :, :heads * d].unflatten(-1, (heads, d)), cos[None, :, None], sin[None, :, None])
        assert torch.equal(got, want[0].float())
        x16 = torch.randn(7, 576, generator=torch.Generator().manual_seed(3)).to(dtype)
        w16 = torch.randn(576, generator=torch.Generator().manual_seed(4)).to(dtype)
        block = rms_norm(x16, w16, 1e-5, lib=lib)
        assert all(torch.equal(rms_norm(x16[i:i + 1], w16, 1e-5, lib=lib), block[i:i + 1]) for i in range(7))


def blobs_of_every_kind(n, k, seed=0):
    """The same shape as 4-bit codes, 8-bit codes and dense bfloat16 tiles."""
    from mtpctl.model.native import int8_pack

    q, scale, zero = codes(n, k, seed)
    q8 = torch.randint(-127, 128, (n, k), generator=torch.Generator().manual_seed(seed))
    dense = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).bfloat16()
    return {"q4": int4_pack(q, scale, zero), "q8": int8_pack(q8, scale), "bf": bf16_tiles(dense)}


@pytest.mark.parametrize("build", ["native", "portable"])
def test_the_matmuls_argmax_is_the_first_largest_output_of_each_row_and_minus_one_for_nan_or_inf(build):
    """int4_matmul_best: the same outputs as int4_matmul, and best[m] == y[m].argmax() (the first of
    equal largest values, across the threads' spans too), or -1 for a row holding NaN, +inf or -inf
    anywhere, for every kind of weights, 1 to 17 rows and 1 to 3 threads."""
    from mtpctl.model.native import int4_matmul_best

    lib = load_kernel(portable=build == "portable")
    n, k = 1000, 64  # 250 tiles: uneven spans over 3 threads
    threads = torch.get_num_threads()
    try:
        for kind, blob in blobs_of_every_kind(n, k).items():
            for t in (1, 2, 3):
                torch.set_num_threads(t)
                for m in (1, 2, 5, 9, 17):
                    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
                    for out_dtype in (torch.bfloat16, torch.float32):
                        y, best = int4_matmul_best(x, blob, n, lib=lib, out_dtype=out_dtype)
                        assert torch.equal(y, int4_matmul(x, blob, n, lib=lib, out_dtype=out_dtype)), (kind, t, m)
                        assert best.tolist() == y.float().argmax(-1).tolist(), (kind, t, m, out_dtype)
        x = torch.randn(1, k).bfloat16().repeat(4, 1)  # the same row four times
        tied = torch.randn(n, k).bfloat16()
        tied[[3, 400, 700, 999]] = (4 * x[0]).bfloat16()  # four equal largest outputs, in other threads' spans
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            y, best = int4_matmul_best(x, bf16_tiles(tied), n, lib=lib, out_dtype=torch.bfloat16)
            assert best.tolist() == y.float().argmax(-1).tolist() == [3] * 4
        y, best = int4_matmul_best(x[:0], bf16_tiles(tied), n, lib=lib)  # no rows: nothing to do, no failure
        assert y.shape == (0, n) and best.shape == (0,)
        x = torch.randn(4, k).bfloat16()
        x[1, 5], x[2, 9], x[3, 0] = float("nan"), float("inf"), float("-inf")
        for t in (1, 2):
            torch.set_num_threads(t)
            y, best = int4_matmul_best(x, blobs_of_every_kind(n, k)["bf"], n, lib=lib, out_dtype=torch.bfloat16)
            assert best[0] == y[0].float().argmax() and best[1:].tolist() == [-1, -1, -1]
    finally:
        torch.set_num_threads(threads)
