"""Rotary tables sized by the positions a model indexes (``Decoder.reserve_rope`` / ``Decoder.rope``), not by
``max_position_embeddings``: tables grown in steps hold, bit for bit, what a table built at once for every
position holds (default, linear, Llama 3 and YaRN ropes, Gemma 3's local rope, Llama 4's float32 tables);
a config of 10,000,000 positions loads with small tables and decodes the tokens of a short context; a
position at the limit is refused in one line, as a too-long context is."""

import pytest
import torch

from helpers import MOE_COMMON, tiny_config_dict, write_tiny_checkpoint

from mtpctl.backends.torch import TorchSession
from mtpctl.drafters.self_draft import layer_subset
from mtpctl.model.config import DecoderConfig, rope_attention_factor
from mtpctl.model.decoder import ROPE_START, Decoder, rope_inv_freq

PROMPT, NEW = "count: 1 2 3 1 2 3", 12
LIMIT = 20_000  # not a power of two: the last growth stops at the limit, inside a block of ROPE_START
GEMMA = dict(model_type="gemma3_text", sliding_window=4, layer_types=["sliding_attention", "full_attention"],
             query_pre_attn_scalar=16, rope_local_base_freq=100.0)
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=64)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32, beta_fast=32,
            beta_slow=1, mscale=1.0, mscale_all_dim=0.8)
CONFIGS = {
    "llama": tiny_config_dict(),
    "linear": tiny_config_dict(rope_scaling=dict(rope_type="linear", factor=2.0)),
    "llama3": tiny_config_dict(rope_scaling=LLAMA3),
    "gemma3-local": tiny_config_dict(**GEMMA),
    "deepseek-yarn": dict(MOE_COMMON, model_type="deepseek_v3", num_key_value_heads=4, q_lora_rank=24,
                          kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                          n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96,
                          n_group=2, topk_group=1,
                          rope_scaling=dict(YARN, type="yarn")),
    "gpt-oss-yarn": dict(MOE_COMMON, model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2,
                         intermediate_size=24, sliding_window=4),
    "llama4-float32": dict(MOE_COMMON, model_type="llama4_text", num_local_experts=4, num_experts_per_tok=1,
                           intermediate_size=32, intermediate_size_mlp=96, no_rope_layers=[1, 0, 1],
                           rope_parameters=dict(LLAMA3, rope_theta=10000.0)),
}


def built_at_once(rope, cfg, dtype):
    """cos, sin ``[max_position_embeddings, rope_dim]`` as the model built them before it grew them:
    every position in one float32 outer product, YaRN's factor, then the table's dtype."""
    freqs = torch.outer(torch.arange(cfg.max_position_embeddings, dtype=torch.float32), rope_inv_freq(rope, cfg.rope_dim))
    angles = torch.cat((freqs, freqs), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    factor = rope_attention_factor(rope)
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    table = torch.float32 if cfg.pair_rope else dtype
    return cos.to(table), sin.to(table)


@pytest.mark.parametrize("name", CONFIGS)
def test_tables_grown_in_steps_equal_tables_built_at_once(name):
    cfg = DecoderConfig.from_dict(dict(CONFIGS[name], max_position_embeddings=LIMIT))
    model = Decoder(cfg, torch.bfloat16, lazy=True)  # weights on the meta device: only the tables are real
    assert model.rope_positions == ROPE_START
    model.reserve_rope(ROPE_START + 1)  # a KV cache's positions: the next power of two
    assert model.rope_positions == 2 * ROPE_START
    cos, sin = model.rope(torch.tensor([[3, 12_000]]), local=True)  # past the rows: grown on the spot (CPU)
    assert model.rope_positions == 4 * ROPE_START and cos.shape == (1, 2, cfg.rope_dim)
    model.reserve_rope(10 ** 9)  # never past the limit
    assert model.rope_positions == LIMIT
    ropes = {"rope": cfg.rope, "rope_local": cfg.rope_local}
    assert (cfg.rope_local is not None) == (name == "gemma3-local")
    assert (model.rope_cos.dtype == torch.float32) == (name == "llama4-float32")
    for prefix, rope in ropes.items():
        if rope is None:
            assert getattr(model, prefix + "_cos") is None
            continue
        expected_cos, expected_sin = built_at_once(rope, cfg, torch.bfloat16)
        assert torch.equal(getattr(model, prefix + "_cos"), expected_cos)
        assert torch.equal(getattr(model, prefix + "_sin"), expected_sin)
    local_cos = model.rope_local_cos if cfg.rope_local is not None else model.rope_cos
    assert torch.equal(cos[0, 1], local_cos[12_000])


def test_a_kv_cache_reserves_its_positions_and_a_layer_subset_shares_the_tables():
    cfg = DecoderConfig.from_dict(tiny_config_dict(max_pos=LIMIT))
    model = Decoder(cfg, lazy=True)
    sub = layer_subset(model, [1])
    sub.new_cache(5000, spare=4)
    assert model.rope_positions == sub.rope_positions == 2 * ROPE_START


@pytest.fixture(scope="module")
def long_folder(tmp_path_factory):
    """``tiny_folder``'s weights with a context of 10,000,000 positions."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("long") / "long", max_pos=10_000_000)


def test_ten_million_positions_load_small_tables_and_decode(tiny_folder, long_folder):
    """The same weights with 128 (``tiny_folder``) and 10,000,000 positions decode the same tokens; the
    large config's tables hold the first ROPE_START positions, and a position at its limit is refused in
    one line without building them."""
    tokens, sessions = [], []
    for folder in (tiny_folder, long_folder):
        session = TorchSession(folder, "float32")
        tokens.append(session.generate(session.encode(PROMPT), NEW).token_ids)
        sessions.append(session)
    assert tokens[0] == tokens[1] and len(tokens[0]) == NEW
    small, large = (s.model for s in sessions)
    assert small.rope_cos.shape == (128, 16)
    assert large.rope_cos.shape == (ROPE_START, 16) and large.rope_sin.shape == (ROPE_START, 16)
    assert small.rope(torch.tensor([[127]]))[0].shape == (1, 1, 16)
    for model, limit in ((small, 128), (large, 10_000_000)):
        with pytest.raises(ValueError, match=f"^position {limit} is past the model's context of {limit} positions"):
            model.rope(torch.tensor([[0, limit]]))
    assert large.rope_positions == ROPE_START  # refused before any table grew


def test_on_a_virtual_gpu_the_tables_grow_on_the_device_when_a_cache_is_sized(long_folder):
    """The pure-torch path as on a GPU (tests/virtual_cuda.py): sizing a KV cache past the tables grows
    them on the device without a host sync; decoding mixes no host tensor in and gives the CPU's tokens."""
    from virtual_cuda import virtual_cuda

    cpu = TorchSession(long_folder, "float32", kernels="torch")
    with virtual_cuda() as mode:
        session = TorchSession(long_folder, "float32", device="cuda", kernels="torch")
        model = session.model
        assert model.rope_cos.device.type == "cuda" and model.rope_positions == ROPE_START
        mode.events.clear()
        session.new_engine(ROPE_START + 1)
        assert model.rope_positions == 2 * ROPE_START and model.rope_sin.device.type == "cuda"
        assert not [e for e in mode.events if e.kind == "sync"]
        tokens = session.generate(session.encode(PROMPT), NEW).token_ids
    assert not [e for e in mode.events if e.kind == "mixup"]
    assert tokens == cpu.generate(cpu.encode(PROMPT), NEW).token_ids
