"""The decoder and engine on tiny random models: one pass over a block or a tree gives the same
logits as token-by-token decoding, and committing a tree path leaves the cache as a chain would."""

import pytest
import torch

import mtpctl.backends.torch as torch_backend
from helpers import gguf_grid_decoder, plain_decode_logits, random_decoder
from mtpctl.backends.torch import TorchEngine
from mtpctl.decode.attention import attention_masks, tree_shape
from mtpctl.decode.tree import DraftTree
from mtpctl.model.linears import blocked_layout_available
from mtpctl.model.native import load_kernel

# fp32 results differ by ~1e-6 relative between a block pass and single-token passes
# (matmuls are not batch-invariant); logits here reach ~10, hence atol 1e-4.
PROMPT = [5, 17, 42, 99, 3, 250, 7]


def stepwise_logits(model, tokens):
    """Logits after each token when tokens are fed one per pass."""
    engine = TorchEngine(model, len(tokens) + 1)
    rows = []
    for t in tokens:
        rows.append(engine.verify(DraftTree.chain([t])).logits[-1])
        engine.commit([0])
    return torch.stack(rows)


def test_block_pass_equals_token_by_token():
    model = random_decoder()
    block = TorchEngine(model, 16).verify(DraftTree.chain(PROMPT)).logits
    torch.testing.assert_close(block, stepwise_logits(model, PROMPT), atol=1e-4, rtol=0)


def test_prefill_then_verify_matches_full_pass():
    model = random_decoder()
    full = TorchEngine(model, 16).verify(DraftTree.chain(PROMPT + [11, 12, 13])).logits
    engine = TorchEngine(model, 16)
    last = engine.prefill(PROMPT).logits
    assert engine.length == len(PROMPT)
    torch.testing.assert_close(last[0], full[len(PROMPT) - 1], atol=1e-4, rtol=0)
    torch.testing.assert_close(engine.verify(DraftTree.chain([11, 12, 13])).logits, full[len(PROMPT):], atol=1e-4, rtol=0)


def test_tree_nodes_score_like_their_paths_and_commit_compacts_the_cache():
    model = random_decoder()
    #        0
    #      /   \
    #     1     2
    #    / \     \
    #   3   4     5
    tokens, parents = [10, 20, 30, 40, 50, 60], [-1, 0, 0, 1, 1, 2]
    engine = TorchEngine(model, 32)
    engine.prefill(PROMPT)
    tree = engine.verify(DraftTree.from_parents(tokens, parents)).logits
    paths = {3: [0, 1, 3], 4: [0, 1, 4], 5: [0, 2, 5]}
    for leaf, path in paths.items():
        chain = TorchEngine(model, 32)
        chain.prefill(PROMPT)
        chain_logits = chain.verify(DraftTree.chain([tokens[i] for i in path])).logits
        torch.testing.assert_close(tree[path], chain_logits, atol=1e-4, rtol=0)
    # keep path 0 -> 2 -> 5 (offsets not a prefix: entries are copied into place)
    engine.commit([0, 2, 5])
    after_tree = engine.verify(DraftTree.chain([77])).logits
    chain = TorchEngine(model, 32)
    chain.prefill(PROMPT + [10, 30, 60])
    torch.testing.assert_close(after_tree, chain.verify(DraftTree.chain([77])).logits, atol=1e-4, rtol=0)


def test_draft_tree_depths_mask_paths_and_children():
    tree = DraftTree.from_parents([7, 8, 9, 10], [-1, 0, 0, 1])
    depth, mask = tree_shape(tree)
    assert depth.tolist() == tree.depths == [0, 1, 1, 2] and tree.depth == 2 and tree.drafted == 3
    assert mask.int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    assert tree.path(3) == [0, 1, 3] and tree.children(0) == [1, 2] and tree.child(0, 9) == 2
    assert tree.child(1, 9) is None and not tree.is_chain
    chain = DraftTree.chain([7, 8, 9])
    assert chain.is_chain and tree_shape(chain)[1] is None and chain.parents == [-1, 0, 1]
    with pytest.raises(ValueError):
        DraftTree.from_parents([1, 2, 3], [-1, 2, 0])
    with pytest.raises(ValueError):
        DraftTree.from_parents([1, 2], [0, 0])


def test_attention_masks_full_chain_and_sliding_window():
    masks = attention_masks([None, 2], length=3, depth=torch.arange(2), tree_mask=None, capacity=6)
    assert masks[None].int()[0, 0].tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]]
    # window 2: position 3 sees positions 2 and 3; position 4 sees 3 and 4; slot 5 is unused
    assert masks[2].int()[0, 0].tolist() == [[0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 0]]
    tree = attention_masks([None], length=1, depth=torch.tensor([0, 1, 1]),
                           tree_mask=DraftTree.from_parents([1, 2, 3], [-1, 0, 0]).ancestor_mask(), capacity=4)
    assert tree[None].int()[0, 0].tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 1]]


def test_sliding_window_model_matches_stepwise():
    model = random_decoder(sliding_window=3, model_type="mistral")
    assert model.cfg.layer_windows == (3, 3)
    block = TorchEngine(model, 16).verify(DraftTree.chain(PROMPT)).logits
    torch.testing.assert_close(block, stepwise_logits(model, PROMPT), atol=1e-4, rtol=0)
    full = random_decoder(model_type="mistral")
    assert not torch.allclose(block, TorchEngine(full, 16).verify(DraftTree.chain(PROMPT)).logits, atol=1e-3)


def test_kv_cache_overflow_is_an_error():
    engine = TorchEngine(random_decoder(), 4)
    engine.prefill([1, 2, 3])
    with pytest.raises(ValueError, match="overflow"):
        engine.verify(DraftTree.chain([4, 5]))


def test_bfloat16_runs_close_to_float32():
    f32 = TorchEngine(random_decoder(), 16).verify(DraftTree.chain(PROMPT)).logits
    bf16 = TorchEngine(random_decoder(dtype=torch.bfloat16), 16).verify(DraftTree.chain(PROMPT)).logits
    assert bf16.dtype == torch.float32  # logits are always returned in float32
    assert (bf16.argmax(-1) == f32.argmax(-1)).float().mean() >= 0.7


@pytest.mark.parametrize("native", [False, True], ids=["torch-attention", "native-attention"])
@pytest.mark.parametrize("dtype, blocked", [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, True)])
def test_tree_nodes_equal_plain_decoding_of_their_path_at_any_capacity(dtype, blocked, native):
    """Dense bfloat16 linear layers, and float32 ones in oneDNN's blocked layout, are batch-invariant
    (one-row products run as two) and every token reads its path's slots in the order plain decoding
    reads them (attention_plan for torch's ops, slot_plan for the native kernel), so a
    tree node equals token-by-token decoding of its path bit for bit, whatever the cache capacity."""
    if blocked and not blocked_layout_available():
        pytest.skip("this torch build has no oneDNN linear ops")
    if native and load_kernel() is None:
        pytest.skip("no C compiler here to build the native attention kernel")
    model = random_decoder(dtype=dtype, blocked=blocked)
    parents = [-1, 0, 0, 1, 2, 2, 4]  # node 6's path: 0 -> 2 -> 4 -> 6 (scattered slots)
    tokens = [11, 12, 13, 14, 15, 16, 17]
    tree = TorchEngine(model, 64, native=native)
    assert tree.native == native
    tree.prefill(PROMPT)
    draft = DraftTree.from_parents(tokens, parents)
    out = tree.verify(draft)
    for node in range(len(tokens)):
        path = [tokens[i] for i in draft.path(node)]
        for capacity in (len(PROMPT) + len(path), 40, 100):
            want = plain_decode_logits(model, PROMPT, path, capacity, native)
            assert torch.equal(out[node], want), f"node {node}, capacity {capacity}"


def test_tails_gathered_by_window_and_fixes_hold_the_planned_slots():
    from mtpctl.decode.attention import HEAD_BLOCK, TAIL, attention_plan
    from mtpctl.model.decoder import _gather_tails

    parents = [-1, 0, 0, 1, 2, 2, 4, 0]
    depth, tree_mask = tree_shape(DraftTree.from_parents(list(range(len(parents))), parents))
    for length in (5, 40, 63, 64, 95, 150):
        plan = attention_plan([None], length, depth, tree_mask)[None]
        keys = torch.randn(1, 2, length + len(parents) + TAIL, 3)
        got = _gather_tails(keys, plan, TAIL)  # [1, 2, N, TAIL, 3]
        want = keys.index_select(2, plan.tail_slots.flatten()).unflatten(2, (len(parents), TAIL))
        valid = plan.groups[0].bias[0, 0, :, 0, -TAIL:] == 0 if len(plan.groups) == 1 else None
        if valid is None:  # tokens in several groups: compare every row's planned entries
            valid = torch.zeros(len(parents), TAIL, dtype=torch.bool)
            for g in plan.groups:
                valid[g.rows if g.rows is not None else slice(None)] = g.bias[0, 0, :, 0, -TAIL:] == 0
        assert plan.fixes is not None and int(valid.sum()) >= min(length + 1, HEAD_BLOCK + 1) * len(parents)
        assert torch.equal(got[:, :, valid], want[:, :, valid]), f"length {length}"


def test_attention_heads_depend_on_position_only_and_stay_committed():
    from mtpctl.decode.attention import HEAD_BLOCK, MAX_DRAFT_DEPTH, TAIL, attention_plan, head_length

    b = HEAD_BLOCK
    assert [head_length(p) for p in (0, b, 2 * b - 1, 2 * b, 3 * b + 5)] == [0, 0, 0, b, 2 * b]
    for p in range(300):  # the tail (position - head + 1 slots) always fits, the head leaves room for a deep draft
        assert p - head_length(p) + 1 <= TAIL and (p < b or p - head_length(p) >= MAX_DRAFT_DEPTH)
    plan = attention_plan([None], 70, torch.tensor([0, 1, 1]), torch.tensor(
        [[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool))[None]
    h = head_length(71)  # positions 70, 71, 71 share it
    assert h == head_length(70) and h % b == 0 and 70 - h >= b
    assert [(g.head, g.rows) for g in plan.groups] == [(h, None)]
    # node 2 (depth 1, slot 72) reads committed slots h..69, then the root (slot 70), then itself
    assert plan.tail_slots[2, :72 - h].tolist() == list(range(h, 70)) + [70, 72]
    allowed = plan.groups[0].bias[0, 0, :, 0] == 0  # [3, head + TAIL]: head slots all allowed
    assert allowed[2].sum() == 72 and allowed[0].sum() == 71 and bool(allowed[:, :h].all())
    # tails are read as a window per token plus fixes: node 2's root and itself sit at slots 70, 72,
    # where its window (from slot h) has 70, 71
    assert plan.tail_slots[:, 0].tolist() == [h, h, h] and [t.tolist() for t in plan.fixes] == [[2], [71 - h], [72]]
    chain = attention_plan([None], 0, torch.arange(100), None)[None]  # a long chain: tails in place
    h = head_length(99)
    assert chain.tail_slots[99, :100 - h].tolist() == list(range(h, 100)) and chain.fixes is None
    assert [g.head for g in chain.groups] == sorted({head_length(p) for p in range(100)})
    deep = torch.ones(MAX_DRAFT_DEPTH + 2, MAX_DRAFT_DEPTH + 2, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match="deeper"):
        attention_plan([None], 70, torch.arange(MAX_DRAFT_DEPTH + 2), deep)


def _prefilled(model, prompt, aux_layers=()):
    engine = TorchEngine(model, 32, aux_layers=aux_layers)
    out = engine.prefill(prompt)
    return engine, out


def _cache(engine):
    n = engine.length
    return engine.cache.k[..., :n, :], engine.cache.v[..., :n, :]


@pytest.mark.parametrize("kind", ["int4-stack", "bfloat16-blocked", "float32-blocked", "float32-sliding-window"])
def test_a_native_prefill_gives_each_prompt_token_what_decoding_it_alone_gives(kind):
    """With the native kernels the prompt runs as passes whose token i reads the slots before it, then
    itself: the slots, in the order, that decoding the prompt one token at a time reads, so its last
    logits and every key and value in the cache are those of token-by-token decoding, bit for bit."""
    if load_kernel() is None:
        pytest.skip("no C compiler here to build the native kernels")
    if "blocked" in kind and not blocked_layout_available():
        pytest.skip("this torch build has no oneDNN linear ops")
    model = {"int4-stack": gguf_grid_decoder,
             "bfloat16-blocked": lambda: random_decoder(dtype=torch.bfloat16, blocked=True),
             "float32-blocked": lambda: random_decoder(blocked=True),
             "float32-sliding-window": lambda: random_decoder(blocked=True, sliding_window=3, model_type="mistral")}[kind]()
    engine, out = _prefilled(model, PROMPT)
    assert engine.native and engine.length == len(PROMPT)
    stepwise = TorchEngine(model, 32)
    for token in PROMPT:
        last = stepwise.verify(DraftTree(token))
        stepwise.commit([0])
    assert torch.equal(out[0], last[0])
    for mine, theirs in zip(_cache(engine), _cache(stepwise)):
        assert torch.equal(mine, theirs)


def test_a_prompt_longer_than_one_prefill_pass_runs_in_passes_that_give_the_same(monkeypatch):
    """A long prompt is prefilled PREFILL_CHUNK tokens at a time; the int4 kernels compute a row alike in
    any pass, so the passes give what one pass gives: hidden states of every prompt row, the aux
    layers' rows (EAGLE-3 reads them) and the cache."""
    if load_kernel() is None:
        pytest.skip("no C compiler here to build the native kernels")
    model = gguf_grid_decoder()
    whole, whole_out = _prefilled(model, PROMPT, aux_layers=(0, 1))
    monkeypatch.setattr(torch_backend, "PREFILL_CHUNK", 3)
    parts, parts_out = _prefilled(model, PROMPT, aux_layers=(0, 1))
    assert parts.length == whole.length == len(PROMPT)
    assert parts_out.prompt_hidden_states.shape[0] == len(PROMPT)
    assert torch.equal(parts_out.prompt_hidden_states, whole_out.prompt_hidden_states)
    for layer in (0, 1):
        assert parts_out.aux_hidden_states[layer].shape[0] == len(PROMPT)
        assert torch.equal(parts_out.aux_hidden_states[layer], whole_out.aux_hidden_states[layer])
    for mine, theirs in zip(_cache(parts), _cache(whole)):
        assert torch.equal(mine, theirs)


def test_a_native_prefill_agrees_with_torchs_fused_attention_to_rounding():
    if load_kernel() is None:
        pytest.skip("no C compiler here to build the native kernels")
    model = random_decoder(sliding_window=3, model_type="mistral")
    native, masked = TorchEngine(model, 32), TorchEngine(model, 32, native=False)
    assert native.native and not masked.native
    torch.testing.assert_close(native.prefill(PROMPT).prompt_hidden_states, masked.prefill(PROMPT).prompt_hidden_states,
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ["int4", "bfloat16-tiles"])
def test_a_pass_takes_each_rows_argmax_in_the_lm_head_kernel_and_reads_a_nan_row_instead(kind):
    """Where the lm_head runs on the native kernels, greedy acceptance takes each row's argmax from the
    kernel (the first largest logit, as ``argmax`` gives it); a row holding NaN gives none, so
    acceptance reads the row and refuses it."""
    from mtpctl.backends.torch import PassLogits, TorchStepOutput
    from mtpctl.decode.acceptance import accept_greedy
    from mtpctl.decode.loop import _CheckedRows
    from mtpctl.errors import NonFinite

    if load_kernel() is None:
        pytest.skip("no C compiler here to build the native kernels")
    model = gguf_grid_decoder() if kind == "int4" else random_decoder(dtype=torch.bfloat16, blocked=True, vocab=260)
    assert type(model.lm_head).__name__ == ("PackedLinear" if kind == "int4" else "TiledLinear")
    hidden = torch.randn(5, model.cfg.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    hidden[3, 7] = float("nan")
    logits = PassLogits(model, hidden)
    out = TorchStepOutput(logits, 0, 5)
    out.prefetch(range(5))
    for i in (0, 1, 2, 4):
        alone = TorchStepOutput(logits, i, 1)
        assert out.greedy(i) == int(out[i].argmax()) == accept_greedy(DraftTree(0), alone).next_token
    assert out.greedy(3) is None
    with pytest.raises(NonFinite):
        accept_greedy(DraftTree(0), _CheckedRows(TorchStepOutput(logits, 3, 1), "step 1"))
