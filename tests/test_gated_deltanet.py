"""The Gated DeltaNet layer (mtpctl/model/gated_deltanet.py) against transformers' own Qwen3.5 and
Qwen3-Next layers (prefill, its states, cached decoding), and the property speculation needs: a token's
output and the state after it are the same bits decoded alone, inside a chain, or as a tree node."""

from __future__ import annotations

import math
import random

import pytest
import torch

from mtpctl.errors import CorruptModel, UnsupportedModel
from mtpctl.model.gated_deltanet import (GatedDeltaNetConfig, LinearState, deltanet_prefill, deltanet_step,
                                         deltanet_tree, deltanet_weights_from_checkpoint, tree_state_bytes)

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen3_5")

#: a tiny layer: grouped heads (4 value heads over 2 key heads), hidden size not a multiple of 64
TINY = dict(hidden_size=48, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"], num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=64, vocab_size=100)


def _randomise(layer, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "A_log":  # decays exp(g) spread over (0, 1)
                p.copy_(torch.empty_like(p).uniform_(0.01, 4).log())
            elif name == "dt_bias":
                p.copy_(torch.randn_like(p))
            elif name == "norm.weight":
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))


def hf_layer(family="qwen3_5", seed=0, **overrides):
    """(transformers' layer, its config, our config, our weights), float32, seeded random weights;
    ``overrides``: config keys that replace TINY's (qwen3_5 only)."""
    if family == "qwen3_5":
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
        hf_config, cls = Qwen3_5TextConfig(**{**TINY, **overrides}), Qwen3_5GatedDeltaNet
    else:
        from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet
        hf_config, cls = Qwen3NextConfig(**TINY), Qwen3NextGatedDeltaNet
    layer = cls(hf_config, 0).eval()
    _randomise(layer, seed)
    cfg = GatedDeltaNetConfig.from_hf(hf_config.to_dict())
    prefix = "model.layers.0.linear_attn."
    weights = deltanet_weights_from_checkpoint({prefix + n: t for n, t in layer.state_dict().items()}, cfg, prefix)
    return layer, hf_config, cfg, weights


def _hf_states(cache):
    """transformers' (conv state without its oldest column, which its next step does not read;
    recurrent state) of layer 0."""
    return cache.get_conv_state(0)[0, :, 1:], cache.get_recurrent_state(0)[0]


# ------------------------------------------------------------------------------- against transformers


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("length", [1, 3, 17, 40, 70])
@pytest.mark.parametrize("method", ["chunked", "recurrent"])
def test_prefill_and_cached_decoding_match_transformers(family, length, method):
    layer, hf_config, cfg, weights = hf_layer(family)
    torch.manual_seed(length)
    x = torch.randn(1, length, cfg.hidden_size)
    cache = transformers.DynamicCache(config=hf_config)
    with torch.no_grad():
        ref = layer(x, cache=cache)[0]
    got = deltanet_prefill(x[0], weights, cfg, method=method)
    assert got.out.shape == ref.shape and (got.out - ref).abs().max() < 1e-4
    conv, recurrent = _hf_states(cache)
    assert (got.state.conv - conv).abs().max() < 1e-5
    assert (got.state.recurrent - recurrent).abs().max() < 1e-4
    state = got.state
    for _ in range(4):  # decoding continues from the state: against transformers' cached steps
        xi = torch.randn(1, 1, cfg.hidden_size)
        with torch.no_grad():
            ref = layer(xi, cache=cache)[0]
        step = deltanet_step(xi[0], weights, cfg, state)
        state = step.state
        assert (step.out - ref).abs().max() < 1e-4
        conv, recurrent = _hf_states(cache)
        assert (state.conv - conv).abs().max() < 1e-5 and (state.recurrent - recurrent).abs().max() < 1e-4


def test_recurrent_prefill_is_token_by_token_decoding_and_chunked_is_close():
    _, _, cfg, weights = hf_layer()
    torch.manual_seed(5)
    x = torch.randn(70, cfg.hidden_size)
    state, outs = LinearState.zeros(cfg), []
    for t in range(len(x)):
        step = deltanet_step(x[t:t + 1], weights, cfg, state)
        state = step.state
        outs.append(step.out)
    rec = deltanet_prefill(x, weights, cfg, method="recurrent")
    assert torch.equal(rec.out, torch.cat(outs)) and rec.state.equal(state)
    chunked = deltanet_prefill(x, weights, cfg, method="chunked")
    assert torch.equal(chunked.state.conv, state.conv)  # projection rows: the same bits
    assert (chunked.state.recurrent - state.recurrent).abs().max() < 1e-5
    assert (chunked.out - rec.out).abs().max() < 1e-5
    # a prefill that starts from a state (a second prompt part) continues the same recurrence
    two = deltanet_prefill(x[30:], weights, cfg, deltanet_prefill(x[:30], weights, cfg).state)
    assert (two.state.recurrent - state.recurrent).abs().max() < 1e-5


# ------------------------------------------------------------------------------------ bit-exactness


def _cast(weights, dtype):
    return type(weights)(in_proj=weights.in_proj.to(dtype), conv=weights.conv.to(dtype).float(),
                         a_log=weights.a_log, dt_bias=weights.dt_bias, norm=weights.norm.to(dtype),
                         out_proj=weights.out_proj.to(dtype))


def _start_state(cfg, weights, dtype, seed):
    torch.manual_seed(seed)
    return deltanet_prefill(torch.randn(23, cfg.hidden_size).to(dtype), weights, cfg).state


#: Qwen3.5-0.8B's head dims (128 x 128 state per value head; BLAS-sized matrix-vector products in the step)
WIDE_HEADS = dict(linear_key_head_dim=128, linear_value_head_dim=128)


@pytest.mark.parametrize("dtype,overrides", [(torch.float32, {}), (torch.bfloat16, {}),
                                             (torch.float32, WIDE_HEADS)])
def test_a_chain_at_once_equals_one_token_at_a_time(dtype, overrides):
    _, _, cfg, weights = hf_layer(seed=1, **overrides)
    weights = _cast(weights, dtype)
    start = _start_state(cfg, weights, dtype, 2)
    kept = start.clone()
    for k in (1, 2, 3, 4, 5, 7, 9, 16):
        torch.manual_seed(100 + k)
        x = (torch.randn(k, cfg.hidden_size) * torch.tensor([0.01, 1.0, 30.0])[torch.randint(3, (k, 1))]).to(dtype)
        chain = deltanet_step(x, weights, cfg, start, keep_every_position=True)
        assert len(chain.positions) == k and chain.positions[-1] is chain.state
        state = start
        for t in range(k):
            one = deltanet_step(x[t:t + 1], weights, cfg, state)
            state = one.state
            assert torch.equal(one.out[0], chain.out[t]), (k, t)
            assert state.equal(chain.positions[t]), (k, t)
        # the chain's prefix of j tokens, as a verifier that accepted j-1 drafts would commit
        j = (k + 1) // 2
        assert deltanet_step(x[:j], weights, cfg, start).state.equal(chain.positions[j - 1])
    assert start.equal(kept)  # the step updates its own copy of the state in place, never the one given


def _random_tree(n, rng):
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def _path(parents, i):
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_node_states_equal_their_paths_as_chains(dtype):
    _, _, cfg, weights = hf_layer(seed=3)
    weights = _cast(weights, dtype)
    start = _start_state(cfg, weights, dtype, 4)
    rng = random.Random(0)
    for n in (1, 2, 6, 13):
        parents = _random_tree(n, rng)
        torch.manual_seed(n)
        x = torch.randn(n, cfg.hidden_size).to(dtype)
        tree = deltanet_tree(x, parents, weights, cfg, start)
        assert len(tree.states) == n
        for i in range(n):
            path = _path(parents, i)
            chain = deltanet_step(x[path], weights, cfg, start, keep_every_position=True)
            assert torch.equal(tree.out[i], chain.out[-1]), (n, i)
            assert tree.states[i].equal(chain.state), (n, i)
    assert not start.equal(LinearState.zeros(cfg))  # the input state was not written into
    assert start.equal(_start_state(cfg, weights, dtype, 4))


def test_tree_parents_are_checked_and_state_bytes():
    _, _, cfg, weights = hf_layer()
    x = torch.randn(3, cfg.hidden_size)
    for bad in ([0, 0, 1], [-1, 2, 0], [-1, 0]):
        with pytest.raises(ValueError):
            deltanet_tree(x, bad, weights, cfg, LinearState.zeros(cfg))
    one = LinearState.zeros(cfg).nbytes
    assert one == 4 * (cfg.conv_dim * 3 + 4 * 16 * 8) == cfg.state_bytes
    assert tree_state_bytes(cfg, 13) == 13 * one
    real = GatedDeltaNetConfig.from_hf({"model_type": "qwen3_5_text", "hidden_size": 2048})  # the defaults
    assert real.state_bytes == 4 * (8192 * 3 + 32 * 128 * 128)


# ------------------------------------------------------------------------------------ config, weights


def test_config_from_the_multimodal_file_and_layer_types():
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config
    full = Qwen3_5Config(text_config=dict(TINY)).to_dict()
    cfg = GatedDeltaNetConfig.from_hf(full)
    assert (cfg.hidden_size, cfg.num_k_heads, cfg.num_v_heads, cfg.k_head_dim, cfg.v_head_dim) == (48, 2, 4, 16, 8)
    assert cfg.is_linear_layer(0) and not cfg.is_linear_layer(1)
    derived = GatedDeltaNetConfig.from_hf({"model_type": "qwen3_next", "hidden_size": 64, "num_hidden_layers": 8})
    assert [derived.is_linear_layer(i) for i in range(8)] == [True, True, True, False] * 2
    with pytest.raises(UnsupportedModel):
        GatedDeltaNetConfig.from_hf({"model_type": "llama", "hidden_size": 64})
    with pytest.raises(CorruptModel):
        GatedDeltaNetConfig.from_hf({"model_type": "qwen3_5_text", "hidden_size": 64, "linear_num_key_heads": 3,
                                     "linear_num_value_heads": 4})


def test_weights_are_strict_one_line_errors():
    layer, _, cfg, _ = hf_layer()
    prefix = "model.layers.0.linear_attn."
    tensors = {prefix + n: t for n, t in layer.state_dict().items()}
    for broken in ({k: v for k, v in tensors.items() if not k.endswith("A_log")},
                   {**tensors, prefix + "extra.weight": torch.zeros(1)},
                   {**tensors, prefix + "in_proj_z.weight": torch.zeros(3, cfg.hidden_size)}):
        with pytest.raises(CorruptModel) as err:
            deltanet_weights_from_checkpoint(broken, cfg, prefix)
        assert "\n" not in str(err.value) and prefix in str(err.value)
    # other layers' names are not this layer's business
    deltanet_weights_from_checkpoint({**tensors, "model.layers.1.linear_attn.A_log": torch.zeros(4)}, cfg, prefix)


def test_rows_of_the_wrong_dtype_are_refused():
    _, _, cfg, weights = hf_layer()
    with pytest.raises(ValueError):
        deltanet_step(torch.randn(2, cfg.hidden_size, dtype=torch.bfloat16), weights, cfg, LinearState.zeros(cfg))
