"""The native layer stack (csrc/layer_stack.c): every layer of an int4 or dense bfloat16 model's decode
or verify pass in one call, against the same layers run one by one from Python."""

import copy

import pytest
import torch

from mtpctl.backends.torch import TorchEngine, verify_packed
from mtpctl.decode.tree import DraftTree
from mtpctl.model.native import layer_stack, load_kernel, stack_part

from helpers import gguf_grid_decoder, random_decoder

pytestmark = pytest.mark.skipif(load_kernel() is None, reason="no C compiler here to build the native kernels")

PROMPTS = ([5, 9, 2, 7, 1, 3], [4, 4, 8, 1], [11, 12, 13, 14, 15, 16, 17, 18, 19])
TREES = (DraftTree.from_parents([7, 8, 9, 10, 11], [-1, 0, 0, 1, 3]), DraftTree.chain([3, 4]), DraftTree(5))


def tiled_decoder(seed=0):
    """A tiny dense bfloat16 decoder held for decoding (its linear weights in the native kernels' tiles)."""
    return random_decoder(seed, dtype=torch.bfloat16, blocked=True)


#: the two kinds of model the stack runs: int4 codes, dense bfloat16 tiles
STACKED = pytest.mark.parametrize("build", [gguf_grid_decoder, tiled_decoder], ids=["int4", "bfloat16"])


def layer_by_layer(model):
    """The same model (sharing its weights) with the stack turned off."""
    twin = copy.copy(model)
    twin.layer_stack = False
    return twin


def verified(model, prompt, tree):
    engine = TorchEngine(model, 48)
    engine.prefill(prompt)
    return engine.verify(tree)


def test_the_stack_covers_int4_and_tiled_bfloat16_llama_blocks_only():
    assert gguf_grid_decoder().stack is not None
    assert tiled_decoder().stack is not None
    assert random_decoder(dtype=torch.bfloat16).stack is None  # plain Parameters: torch's kernels, layer by layer
    assert random_decoder(dtype=torch.float32, blocked=True).stack is None  # float32: oneDNN's layout


@STACKED
def test_a_stacked_pass_matches_the_layers_one_by_one(build):
    """The same kernels in the same order; only SiLU's exponential is the stack's own, so hidden states
    agree to bfloat16 rounding and the greedy choice of every row is the same."""
    model = build()
    for prompt, tree in zip(PROMPTS, TREES):
        stacked, layered = verified(model, prompt, tree), verified(layer_by_layer(model), prompt, tree)
        assert torch.allclose(stacked.hidden_states.float(), layered.hidden_states.float(), rtol=0.02, atol=0.02)
        assert torch.equal(stacked.logits.argmax(-1), layered.logits.argmax(-1))


@STACKED
def test_a_stacked_row_gets_the_same_bits_alone_among_other_sequences_and_at_any_thread_count(build):
    model = build(seed=2)
    threads = torch.get_num_threads()
    engines = []
    for prompt in PROMPTS:
        engine = TorchEngine(model, 48)
        engine.prefill(prompt)
        engines.append(engine)
    together = verify_packed(engines, TREES)
    try:
        torch.set_num_threads(1)
        alone = [verified(model, prompt, tree) for prompt, tree in zip(PROMPTS, TREES)]
    finally:
        torch.set_num_threads(threads)
    for out, solo in zip(together, alone):
        assert torch.equal(out.hidden_states, solo.hidden_states)
        assert torch.equal(out.logits, solo.logits)


def test_a_copy_of_the_model_runs_its_own_layers():
    """The stack addresses the weights it was built from: a deep copy with other weights, and a copy
    holding a subset of the layers (the self-draft's), each run their own."""
    from mtpctl.drafters.self_draft import layer_subset

    model = gguf_grid_decoder()
    assert model.stack is not None
    other = copy.deepcopy(model)
    other.layers[0].input_norm.data.mul_(3)
    assert other.stack.table[0, 0] != model.stack.table[0, 0]
    expected = verified(layer_by_layer(other), PROMPTS[0], TREES[0])
    assert torch.allclose(verified(other, PROMPTS[0], TREES[0]).hidden_states.float(),
                          expected.hidden_states.float(), rtol=0.02, atol=0.02)
    sub = layer_subset(model, [1])
    assert sub.stack.table.shape[0] == 1 and int(sub.stack.shape[0]) == 1
    assert torch.allclose(verified(sub, PROMPTS[0], TREES[0]).hidden_states.float(),
                          verified(layer_by_layer(sub), PROMPTS[0], TREES[0]).hidden_states.float(), rtol=0.02,
                          atol=0.02)


@STACKED
def test_the_portable_build_runs_the_same_stack_to_rounding(monkeypatch, build):
    """The plain-C path (no AVX-512: its own exponential and matmul sums) agrees with the default
    build to rounding, and gives a row the same bits alone and in a pass."""
    from functools import partial

    from mtpctl.model import decoder

    model = build(seed=1)
    fast = [verified(model, prompt, tree) for prompt, tree in zip(PROMPTS, TREES)]
    monkeypatch.setattr(decoder, "layer_stack", partial(layer_stack, lib=load_kernel(portable=True)))
    portable = [verified(model, prompt, tree) for prompt, tree in zip(PROMPTS, TREES)]
    for a, b in zip(fast, portable):
        assert torch.allclose(a.hidden_states.float(), b.hidden_states.float(), rtol=0.02, atol=0.02)
    alone = verified(model, PROMPTS[0], DraftTree(TREES[0].tokens[0]))
    assert torch.equal(alone.hidden_states[0], portable[0].hidden_states[0])


def test_a_nan_stays_in_its_own_row():
    """A NaN embedding reaches that row's hidden states (so the loop's non-finite check sees it) and no
    other row's."""
    model = copy.deepcopy(gguf_grid_decoder())
    model.embed.data[9] = float("nan")
    out = verified(model, PROMPTS[1], DraftTree.chain([3, 9, 4]))
    rows_finite = torch.isfinite(out.hidden_states).all(-1).tolist()
    assert rows_finite[0] is True and rows_finite[1] is False


def test_the_stack_refuses_tensors_that_do_not_fit():
    model = gguf_grid_decoder()
    hidden, d = model.cfg.hidden_size, model.cfg.head_dim
    x = torch.zeros(2, hidden, dtype=torch.bfloat16)
    rot = torch.zeros(2, d, dtype=torch.bfloat16)
    kv, dest = torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, dtype=torch.long)
    plan = type("Plan", (), {"starts": torch.zeros(2, dtype=torch.long)})
    with pytest.raises(ValueError, match="layer_stack takes"):
        layer_stack(x.float(), model.stack, model.norm.detach(), rot, rot, kv, dest, False, plan)
    with pytest.raises(ValueError, match="layer_stack takes"):
        layer_stack(x, model.stack, model.norm.detach(), rot[:1], rot[:1], kv, dest, False, plan)


@STACKED
def test_a_pass_returning_intermediate_layers_runs_the_stack_in_parts_with_the_same_bits(build):
    """EAGLE-3's passes return the residual streams of some layers: the stack runs in parts ending at
    them, each part writing its own layers' KV, so hidden states, caches and the next pass are the
    stack's own bits, and the layers returned agree with the layer-by-layer path to rounding."""
    model = build(seed=3)
    layers = model.cfg.num_hidden_layers
    aux = (0, 1, layers)
    whole, parts, layered = (TorchEngine(m, 48, aux_layers=a) for m, a in
                             ((model, ()), (model, aux), (layer_by_layer(model), aux)))
    for engine in (whole, parts, layered):
        engine.prefill(PROMPTS[2])
    for tree in TREES[:2]:
        outs = [engine.verify(tree) for engine in (whole, parts, layered)]
        assert torch.equal(outs[0].hidden_states, outs[1].hidden_states)
        assert sorted(outs[1].aux_hidden_states) == sorted(aux)
        for layer in aux:
            got, want = outs[1].aux_hidden_states[layer].float(), outs[2].aux_hidden_states[layer].float()
            assert got.shape == (len(tree), model.cfg.hidden_size)
            assert torch.allclose(got, want, rtol=0.02, atol=0.02)
        for engine in (whole, parts, layered):
            engine.commit([0, 1] if len(tree) > 1 else [0])
    assert torch.equal(whole.cache.k, parts.cache.k) and torch.equal(whole.cache.v, parts.cache.v)


def test_a_part_of_the_stack_is_refused_outside_its_layers():
    model = gguf_grid_decoder()
    kv = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="layers"):
        stack_part(model.stack, kv, False, 1, 1)
    with pytest.raises(ValueError, match="layers"):
        stack_part(model.stack, kv, False, 0, model.cfg.num_hidden_layers + 1)
