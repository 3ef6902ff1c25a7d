"""The native decode/verify attention kernel (mtpctl/model/native.py, csrc/tree_attention.c)."""

import pytest
import torch

from mtpctl.model import native
from mtpctl.backends.torch import TorchEngine
from mtpctl.decode.attention import slot_plan
from mtpctl.model.native import SlotPlan, load_kernel, tree_attention

from helpers import random_decoder, tree_positions

pytestmark = pytest.mark.skipif(load_kernel() is None, reason="no C compiler here to build the native attention kernel")

HEADS, KV_HEADS, D = 6, 2, 32


def reference(q, keys, values, scale, plan):
    """Float64 attention of each token over its slot list: [1, heads, N, d]."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // keys.shape[1]
    for i in range(q.shape[2]):
        slots = list(range(int(plan.starts[i]), int(plan.ends[i]))) + [int(s) for s in plan.paths[i] if s >= 0]
        for h in range(q.shape[1]):
            k = keys[0, h // group, slots].double()
            v = values[0, h // group, slots].double()
            p = torch.softmax(k @ q[0, h, i].double() * scale, dim=0)
            out[0, h, i] = p @ v
    return out


def random_inputs(n, slots=80, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, HEADS, n, D, generator=g)
    keys = torch.randn(1, KV_HEADS, slots, D, generator=g)
    values = torch.randn(1, KV_HEADS, slots, D, generator=g)
    return q, keys, values


@pytest.mark.parametrize("window", [None, 20])
def test_kernel_matches_a_float64_reference(window):
    parents = [-1, 0, 0, 1, 2, 2, 4]
    depth, tree_mask = tree_positions(parents)
    q, keys, values = random_inputs(len(parents))
    plan = slot_plan([window], 50, depth, tree_mask)[window]
    got = tree_attention(q, keys, values, 0.3, plan)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert (got.double() - reference(q, keys, values, 0.3, plan)).abs().max() < 1e-5


@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (16, 1, 128), (4, 4, 16)])
def test_kernel_matches_the_reference_at_any_slot_count_group_and_head_dim(heads, kv_heads, d):
    """Slot lists of every length around the kernel's blocks of 16 slots, GQA groups above the four
    heads it sums at once, head dims of one to eight 16-lane loads: each token within float32 rounding
    of float64 attention, and the same bits alone as in the pass."""
    g = torch.Generator().manual_seed(3)
    for committed in (1, 5, 15, 16, 17, 31, 33, 40):
        n = 3
        q = torch.randn(1, heads, n, d, generator=g)
        keys = torch.randn(1, kv_heads, committed + n, d, generator=g).bfloat16()
        values = torch.randn(1, kv_heads, committed + n, d, generator=g).bfloat16()
        plan = slot_plan([None], committed, torch.arange(n), None)[None]
        got = tree_attention(q, keys, values, d ** -0.5, plan)
        assert (got.double() - reference(q, keys.float(), values.float(), d ** -0.5, plan)).abs().max() < 1e-5
        last = tree_attention(q[:, :, n - 1:], keys, values, d ** -0.5,
                              SlotPlan(plan.starts[n - 1:], plan.ends[n - 1:], plan.paths[n - 1:].contiguous()))
        assert torch.equal(last[:, :, 0], got[:, :, n - 1])


def test_a_bfloat16_cache_gives_what_a_float32_cache_of_the_same_values_gives():
    """A bfloat16 model's keys and values are bfloat16 values: the kernel reads a bfloat16 cache of them
    widened, so attention gives the same bits as over a float32 cache holding them, at half the bytes."""
    parents = [-1, 0, 0, 1, 2, 2, 4]
    depth, tree_mask = tree_positions(parents)
    q, keys, values = random_inputs(len(parents), slots=77)  # head_dim 32: two 16-lane loads per row
    keys, values = keys.bfloat16(), values.bfloat16()
    for window in (None, 20):
        plan = slot_plan([window], 50, depth, tree_mask)[window]
        assert torch.equal(tree_attention(q, keys, values, 0.3, plan),
                           tree_attention(q, keys.float(), values.float(), 0.3, plan))


def test_a_bfloat16_engine_keeps_a_bfloat16_cache_and_the_same_bits():
    """A bfloat16 model's engine on the native kernels holds its KV cache in bfloat16 (half the memory
    and the bytes each pass reads) and computes every pass exactly as with a float32 cache."""
    from mtpctl.decode.attention import TAIL
    from mtpctl.decode.tree import DraftTree

    model = random_decoder(seed=2, dtype=torch.bfloat16, blocked=True)
    compact, wide = TorchEngine(model, 64), TorchEngine(model, 64)
    wide.cache = model.new_cache(64, spare=TAIL)  # the float32 cache every engine held before
    assert compact.cache.k.dtype == torch.bfloat16 and wide.cache.k.dtype == torch.float32
    assert compact.kv_cache_bytes * 2 == wide.kv_cache_bytes
    outs = []
    for engine in (compact, wide):
        engine.prefill([5, 17, 42, 99, 3, 250, 7])
        first = engine.verify(DraftTree.from_parents([7, 8, 9, 10], [-1, 0, 0, 1]))
        engine.commit([0, 1, 3])
        outs.append((first.hidden_states, engine.verify(DraftTree(11)).hidden_states))
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_slot_plan_lists_committed_slots_then_the_path():
    depth, tree_mask = tree_positions([-1, 0, 0, 1])  # node 3's path: 0 -> 1 -> 3
    plans = slot_plan([None, 4], 10, depth, tree_mask)
    full, local = plans[None], plans[4]
    assert full.ends.tolist() == [10] * 4 and full.starts.tolist() == [0, 0, 0, 0]
    assert full.paths.tolist() == [[10, -1, -1], [10, 11, -1], [10, 12, -1], [10, 11, 13]]
    # positions 10, 11, 11, 12 with a window of 4: committed slots from position - 3, path nodes within 3
    assert local.starts.tolist() == [7, 8, 8, 9] and local.paths.tolist() == full.paths.tolist()
    chain = slot_plan([None], 5, torch.arange(3), None)[None]
    assert chain.paths.tolist() == [[5, -1, -1], [5, 6, -1], [5, 6, 7]]
    from mtpctl.decode.attention import MAX_DRAFT_DEPTH
    deep = torch.ones(MAX_DRAFT_DEPTH + 2, MAX_DRAFT_DEPTH + 2, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match="deeper"):  # the torch path's limit, so both take the same drafts
        slot_plan([None], 70, torch.arange(MAX_DRAFT_DEPTH + 2), deep)
    assert slot_plan([None], 70, torch.arange(MAX_DRAFT_DEPTH + 2), None)[None].paths.shape[1] == MAX_DRAFT_DEPTH + 2


@pytest.mark.parametrize("build", ["native", "portable"])
def test_a_token_gets_the_same_bits_alone_in_any_pass_and_at_any_thread_count(build):
    """The property speculation rests on: a token's output depends on its query and its slot list only,
    not on the other tokens of the pass, the thread count, or where the list splits between committed
    slots and path (plain decoding has the path committed by then). Checked for the build this machine
    runs (-march=native) and for the plain-C path other CPUs run."""
    lib = load_kernel(portable=build == "portable")
    assert lib is not None
    parents = [-1, 0, 0, 1, 2, 2, 4]
    depth, tree_mask = tree_positions(parents)
    q, keys, values = random_inputs(len(parents))
    length = 50
    plan = slot_plan([None], length, depth, tree_mask)[None]
    together = tree_attention(q, keys, values, 0.3, plan, lib)
    assert (together.double() - reference(q, keys, values, 0.3, plan)).abs().max() < 1e-5
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = tree_attention(q, keys, values, 0.3, plan, lib)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, one_thread)
    for i in range(len(parents)):
        path = [int(s) for s in plan.paths[i] if s >= 0]
        alone = tree_attention(q[:, :, i:i + 1], keys, values, 0.3,
                               SlotPlan(plan.starts[i:i + 1], plan.ends[i:i + 1], plan.paths[i:i + 1, :len(path)].contiguous()), lib)
        assert torch.equal(alone[:, :, 0], together[:, :, i]), f"token {i} alone"
        # plain decoding of the path: its ancestors committed at the next slots, the token last
        k2, v2 = keys.clone(), values.clone()
        k2[:, :, length:length + len(path)] = keys[:, :, path]
        v2[:, :, length:length + len(path)] = values[:, :, path]
        plain = tree_attention(q[:, :, i:i + 1], k2, v2, 0.3, SlotPlan(torch.zeros(1, dtype=torch.long),
                               torch.tensor([length + len(path) - 1]), torch.tensor([[length + len(path) - 1]])), lib)
        assert torch.equal(plain[:, :, 0], together[:, :, i]), f"token {i} as plain decoding"


def test_shapes_the_kernel_does_not_take_fall_back_or_fail_clearly():
    assert native.kernel_takes(9, 3, 64) and native.kernel_takes(4, 1, 256)
    assert not native.kernel_takes(4, 2, 8) and not native.kernel_takes(4, 3, 16) and not native.kernel_takes(32, 1, 64)
    model = random_decoder(head_dim=8)
    assert not TorchEngine(model, 16).native  # torch's attention instead
    with pytest.raises(ValueError, match="head_dim 8"):
        TorchEngine(model, 16, native=True)


def test_no_compiler_means_torch_attention_with_one_warning(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MTPCTL_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler")
    load_kernel.cache_clear()
    try:
        assert load_kernel() is None and load_kernel() is None
        assert capsys.readouterr().err.count("native kernels (attention, RMSNorm, RoPE, int4) unavailable (no C compiler 'no-such-compiler'") == 1
        assert not TorchEngine(random_decoder(), 16).native
        monkeypatch.delenv("CC")
        for off in ("0", "false", "Off", "no"):
            monkeypatch.setenv("MTPCTL_NATIVE_KERNELS", off)
            load_kernel.cache_clear()
            assert load_kernel() is None and not list(tmp_path.iterdir()), off  # off: nothing built
    finally:
        load_kernel.cache_clear()


NORM_CASES = [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),  # Llama: weight in x's dtype
              (torch.bfloat16, torch.float32)]  # Gemma: a float32 (1 + w) weight


@pytest.mark.parametrize("dtype,weight_dtype", NORM_CASES)
def test_rms_norm_matches_the_torch_formula_to_rounding(dtype, weight_dtype):
    from mtpctl.model.decoder import _rms_norm, _rms_norm_float32_scale

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(7, 576, generator=g) * 3).to(dtype)
    w = (torch.rand(576, generator=g) + 0.5).to(weight_dtype)
    torch_norm = _rms_norm_float32_scale if weight_dtype != dtype else _rms_norm
    got, want = native.rms_norm(x, w, 1e-5), torch_norm(x, w, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    h = x.double()
    exact = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -22  # a little above the dtype's rounding
    assert ((got.double() - exact).abs() <= exact.abs() * ulp * 2 + 1e-30).all()
    # only the order of the sum of squares (and 1/sqrt against rsqrt) differs from torch's ops
    assert ((got.double() - want.double()).abs() <= want.double().abs() * ulp * 2 + 1e-30).all()


@pytest.mark.parametrize("dtype,weight_dtype", NORM_CASES)
def test_rms_norm_gives_a_row_the_same_bits_alone_and_in_a_block(dtype, weight_dtype):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 9, 640, generator=g).to(dtype)
    w = torch.randn(640, generator=g).to(weight_dtype)
    block = native.rms_norm(x, w, 1e-6)
    for b in range(2):
        for i in range(9):
            assert torch.equal(native.rms_norm(x[b, i], w, 1e-6), block[b, i])
    strided = x.transpose(0, 1)  # a non-contiguous view is normed as its values
    assert torch.equal(native.rms_norm(strided, w, 1e-6), block.transpose(0, 1))


def test_rms_norm_refuses_what_it_does_not_take():
    with pytest.raises(ValueError, match="multiple of 16"):
        native.rms_norm(torch.randn(2, 24), torch.ones(24), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        native.rms_norm(torch.randn(2, 32).bfloat16(), torch.ones(32, dtype=torch.float64), 1e-6)
    with pytest.raises(ValueError, match="float16"):
        native.rms_norm(torch.randn(2, 32).half(), torch.ones(32).half(), 1e-6)
    assert native.norm_takes(576) and native.norm_takes(16384) and not native.norm_takes(16400)


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                                               (torch.bfloat16, torch.bfloat16)])
def test_rope_write_equals_rotate_then_cache_write_bit_for_bit(dtype, cache_dtype):
    from mtpctl.model.kv_cache import KVCache
    from mtpctl.model.decoder import _rotate

    heads, kv_heads, d, n = 6, 2, 64, 5
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(1, n, (heads + 2 * kv_heads) * d + 8, generator=g).to(dtype)  # a longer row is fine
    angles = torch.rand(n, d, generator=g) * 40
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    want_cache, got_cache = (KVCache(1, 1, kv_heads, d, 16, cache_dtype, spare=3) for _ in range(2))
    for cache in (want_cache, got_cache):
        cache.length = 7
    qk = qkv[..., :(heads + kv_heads) * d].unflatten(-1, (heads + kv_heads, d))
    rotated = _rotate(qk, cos[None, :, None], sin[None, :, None]).transpose(1, 2)
    v = qkv[..., (heads + kv_heads) * d:(heads + 2 * kv_heads) * d].unflatten(-1, (kv_heads, d)).transpose(1, 2)
    want_cache.write(0, rotated[:, heads:], v)
    keys, values = got_cache.layer_for_write(0, n)
    q = native.rope_write(qkv[0], cos, sin, keys, values, got_cache.length, heads, kv_heads)
    assert q.dtype == torch.float32 and q.shape == (n, heads, d)
    assert torch.equal(q, rotated[0, :heads].transpose(0, 1).float())
    assert torch.equal(got_cache.k, want_cache.k) and torch.equal(got_cache.v, want_cache.v)
    with pytest.raises(ValueError, match="overflow"):
        got_cache.layer_for_write(0, 10)
    with pytest.raises(ValueError, match="rope_write does not take"):
        native.rope_write(qkv[0], cos, sin, keys, values, 16, heads, kv_heads)  # past the slots


def test_an_unknown_switch_value_keeps_the_kernels_on_with_a_warning(monkeypatch, capsys):
    monkeypatch.setenv("MTPCTL_NATIVE_KERNELS", "bogus")
    load_kernel.cache_clear()
    try:
        assert load_kernel() is not None and load_kernel() is not None
        err = capsys.readouterr().err
        assert err.count("MTPCTL_NATIVE_KERNELS='bogus' is not one of") == 1 and "stay on" in err
        for on in ("1", "true", "On", "yes", ""):
            monkeypatch.setenv("MTPCTL_NATIVE_KERNELS", on)
            load_kernel.cache_clear()
            assert load_kernel() is not None and capsys.readouterr().err == "", on
    finally:
        load_kernel.cache_clear()
