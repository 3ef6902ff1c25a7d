"""The MoE block (mtpctl/model/moe.py) against transformers' own sparse MoE blocks, and its batch
invariance: a row's output is the same bits alone and inside a pass of any rows."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mtpctl.errors import CorruptModel, UnsupportedModel
from mtpctl.model.moe import (MoeConfig, elementwise, _row_sum, is_moe_layer, moe_mlp, moe_weights_from_checkpoint,
                              route, stack_experts)

transformers = pytest.importorskip("transformers")


def _family(model_type):
    """(transformers config, its sparse MoE block class) of a tiny random block of ``model_type``: odd
    intermediate sizes (not multiples of 64) so the element-wise padding is exercised."""
    if model_type == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
        return (transformers.Qwen3MoeConfig(hidden_size=64, num_experts=16, moe_intermediate_size=40,
                                            num_experts_per_tok=4, norm_topk_prob=True), Qwen3MoeSparseMoeBlock)
    if model_type == "qwen3_moe_unnormed":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
        return (transformers.Qwen3MoeConfig(hidden_size=64, num_experts=10, moe_intermediate_size=72,
                                            num_experts_per_tok=3, norm_topk_prob=False), Qwen3MoeSparseMoeBlock)
    if model_type == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
        return (transformers.MixtralConfig(hidden_size=48, num_local_experts=8, intermediate_size=56,
                                           num_experts_per_tok=2), MixtralSparseMoeBlock)
    if model_type == "deepseek_v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
        return (transformers.DeepseekV3Config(hidden_size=64, n_routed_experts=16, moe_intermediate_size=32,
                                              num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=2,
                                              routed_scaling_factor=2.5), DeepseekV3MoE)
    if model_type == "glm4_moe":
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE
        return (transformers.Glm4MoeConfig(hidden_size=64, n_routed_experts=16, moe_intermediate_size=24,
                                           num_experts_per_tok=4, n_shared_experts=1, routed_scaling_factor=1.5,
                                           norm_topk_prob=False), Glm4MoeMoE)
    if model_type == "qwen2_moe":
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
        return (transformers.Qwen2MoeConfig(hidden_size=64, num_experts=12, moe_intermediate_size=32,
                                            shared_expert_intermediate_size=48, num_experts_per_tok=3),
                Qwen2MoeSparseMoeBlock)
    if model_type == "ernie4_5_moe":  # moe_norm_min above some rows' top-4 sums, so the clamp is exercised
        from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeSparseMoeBlock
        return (transformers.Ernie4_5_MoeConfig(hidden_size=64, moe_num_experts=16, moe_intermediate_size=40,
                                                moe_k=4, moe_num_shared_experts=2, moe_norm_min=0.75),
                Ernie4_5_MoeSparseMoeBlock)
    raise AssertionError(model_type)


FAMILIES = ["qwen3_moe", "qwen3_moe_unnormed", "mixtral", "deepseek_v3", "glm4_moe", "qwen2_moe", "ernie4_5_moe"]


def hf_block(name, seed=0):
    """(transformers' block, its config, our MoeConfig parsed from its config.json dict) with random
    weights: router logits spread (std ~4) and a non-zero random e_score_correction_bias, so both the
    grouping and the bias's effect on the choice are exercised."""
    hf_config, cls = _family(name)
    hf_config._experts_implementation = "eager"  # the loop over experts: the reference semantics
    torch.manual_seed(seed)
    block = cls(hf_config).eval()
    with torch.no_grad():
        for pname, p in list(block.named_parameters()) + list(block.named_buffers()):
            if pname.endswith("e_score_correction_bias"):
                p.copy_(torch.rand_like(p) * 0.3)
            else:
                scale = 4.0 if pname.startswith("gate.") else 1.0
                p.copy_(torch.randn_like(p) * scale / math.sqrt(p.shape[-1]))
    model_type = name.replace("_unnormed", "")
    cfg = MoeConfig.from_hf(hf_config.to_dict(), model_type)
    return block, hf_config, cfg


@pytest.mark.parametrize("name", FAMILIES)
def test_matches_transformers_block_in_float32(name):
    block, hf_config, cfg = hf_block(name)
    weights = moe_weights_from_checkpoint(block.state_dict(), cfg)
    torch.manual_seed(1)
    x = torch.randn(41, hf_config.hidden_size)
    with torch.no_grad():
        expected = block(x[None])[0]
        _, hf_weights, hf_experts = block.gate(x)
    routing = route(x, cfg, weights)
    hf_sorted, order = torch.sort(hf_experts, dim=-1)
    assert torch.equal(routing.experts, hf_sorted)  # the same experts for every token
    torch.testing.assert_close(routing.weights, hf_weights.gather(1, order).to(routing.weights.dtype),
                               atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(moe_mlp(x, cfg, weights), expected, atol=1e-5, rtol=1e-5)
    # [batch, seq, H] in, the same shape out
    assert moe_mlp(x.reshape(1, 41, -1), cfg, weights).shape == (1, 41, hf_config.hidden_size)


def test_score_bias_changes_the_choice_not_the_weights():
    """DeepSeek-V3: the correction bias picks the experts; the weights are the unbiased scores."""
    block, hf_config, cfg = hf_block("deepseek_v3")
    weights = moe_weights_from_checkpoint(block.state_dict(), cfg)
    x = torch.randn(64, hf_config.hidden_size)
    unbiased = moe_weights_from_checkpoint({**block.state_dict(), "gate.e_score_correction_bias":
                                            torch.zeros(cfg.num_experts)}, cfg)
    a, b = route(x, cfg, weights), route(x, cfg, unbiased)
    assert not torch.equal(a.experts, b.experts)
    scores = torch.sigmoid(a.logits)
    chosen = scores.gather(1, a.experts)
    torch.testing.assert_close(a.weights, chosen / chosen.sum(-1, keepdim=True) * 2.5, atol=1e-6, rtol=1e-5)


def test_ernie_chooses_on_biased_probabilities_and_renormalises_with_norm_min():
    """ERNIE 4.5: softmax probabilities plus the moe_statics bias pick the experts; the weights are the
    unbiased probabilities over max(their sum, moe_norm_min)."""
    block, hf_config, cfg = hf_block("ernie4_5_moe")
    assert cfg.scoring == "softmax" and cfg.score_bias and cfg.norm_min == 0.75 and cfg.router_float32
    state = block.state_dict()
    weights = moe_weights_from_checkpoint(state, cfg)
    unbiased = moe_weights_from_checkpoint({**state, "gate.moe_statics.e_score_correction_bias":
                                            torch.zeros(1, cfg.num_experts)}, cfg)
    x = torch.randn(64, hf_config.hidden_size)
    a, b = route(x, cfg, weights), route(x, cfg, unbiased)
    assert not torch.equal(a.experts, b.experts)
    chosen = torch.softmax(a.logits, dim=-1).gather(1, a.experts)
    sums = chosen.sum(-1, keepdim=True)
    assert (sums < 0.75).any() and (sums > 0.75).any()  # both sides of the clamp
    torch.testing.assert_close(a.weights, chosen / sums.clamp(min=0.75), atol=1e-6, rtol=1e-5)


def test_grouped_selection_stays_inside_the_best_groups():
    block, hf_config, cfg = hf_block("deepseek_v3")
    weights = moe_weights_from_checkpoint(block.state_dict(), cfg)
    x = torch.randn(64, hf_config.hidden_size)
    routing = route(x, cfg, weights)
    biased = (torch.sigmoid(routing.logits) + weights.score_bias).view(64, cfg.n_group, -1)
    group_scores = biased.topk(2, dim=-1).values.sum(-1)
    best = group_scores.topk(cfg.topk_group, dim=-1).indices
    groups = routing.experts // (cfg.num_experts // cfg.n_group)
    assert all(set(g.tolist()) <= set(b.tolist()) for g, b in zip(groups, best))


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "deepseek_v3", "qwen2_moe"])
def test_bfloat16_close_to_transformers_where_the_routing_agrees(name):
    """In bfloat16 the rounding of each product differs from transformers' (other shapes), so near-tied
    router logits may pick other experts; where both pick the same, the outputs agree to bfloat16."""
    block, hf_config, cfg = hf_block(name)
    block = block.to(torch.bfloat16)
    weights = moe_weights_from_checkpoint(block.state_dict(), cfg, dtype=torch.bfloat16)
    x = torch.randn(41, hf_config.hidden_size).to(torch.bfloat16)
    with torch.no_grad():
        expected = block(x[None])[0]
        _, _, hf_experts = block.gate(x)
    routing = route(x, cfg, weights)
    same = routing.experts.eq(torch.sort(hf_experts, -1).values).all(-1)
    assert same.float().mean() > 0.8
    out = moe_mlp(x, cfg, weights, routing=routing)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out[same].float(), expected[same].float(), atol=3e-2, rtol=3e-2)


# ------------------------------------------------------------------------------------ batch invariance


def _pool(hidden, rows=33, seed=5):
    """Random rows, some of large magnitude (1e3, 1e4) and some tiny (1e-3)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g)
    scales = torch.ones(rows)
    scales[3::7], scales[5::11], scales[1::13] = 1e3, 1e4, 1e-3
    return x * scales[:, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", FAMILIES)
def test_a_row_is_the_same_bits_alone_and_in_any_pass(name, dtype):
    block, hf_config, cfg = hf_block(name)
    weights = moe_weights_from_checkpoint(block.state_dict(), cfg, dtype=dtype)
    pool = _pool(hf_config.hidden_size).to(dtype)
    alone = torch.cat([moe_mlp(pool[i:i + 1], cfg, weights) for i in range(len(pool))])
    alone_experts = torch.cat([route(pool[i:i + 1], cfg, weights).experts for i in range(len(pool))])
    g = torch.Generator().manual_seed(11)
    for n in range(1, 34):
        pick = torch.randint(len(pool), (n,), generator=g)  # any rows, repeats allowed, any order
        assert torch.equal(route(pool[pick], cfg, weights).experts, alone_experts[pick]), n
        assert torch.equal(moe_mlp(pool[pick], cfg, weights), alone[pick]), n
    assert torch.equal(moe_mlp(pool, cfg, weights), alone)
    # one token at every place of a block of rows, beside the same and other rows
    for place in range(5):
        rows = torch.arange(place, place + 6) % len(pool)
        rows[place] = 0
        assert torch.equal(moe_mlp(pool[rows], cfg, weights)[place], alone[0])


@pytest.mark.parametrize("rows", [1, 8])
def test_other_block_rows_are_invariant_too(rows):
    block, hf_config, cfg = hf_block("deepseek_v3")
    weights = moe_weights_from_checkpoint(block.state_dict(), cfg, dtype=torch.bfloat16)
    pool = _pool(hf_config.hidden_size, rows=17).to(torch.bfloat16)
    alone = torch.cat([moe_mlp(pool[i:i + 1], cfg, weights, rows=rows) for i in range(len(pool))])
    for n in (2, 9, 17):
        assert torch.equal(moe_mlp(pool[:n], cfg, weights, rows=rows), alone[:n])


@pytest.mark.parametrize("width", [1, 8, 40, 64, 100, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_elementwise_and_row_sum_compute_a_row_alike_anywhere(width, dtype):
    g = torch.Generator().manual_seed(width)
    x = (torch.randn(40, width, generator=g) * 6).to(dtype)
    for fn in (F.silu, torch.sigmoid, torch.exp):
        alone = torch.cat([elementwise(fn, x[i:i + 1]) for i in range(len(x))])
        assert torch.equal(elementwise(fn, x), alone)
        torch.testing.assert_close(alone, fn(x))
    sums = torch.stack([_row_sum(x[i:i + 1].float())[0] for i in range(len(x))])
    assert torch.equal(_row_sum(x.float()), sums)
    torch.testing.assert_close(sums, x.float().sum(-1), atol=1e-4, rtol=1e-5)


def test_ties_go_to_the_lower_expert_id():
    cfg = MoeConfig(scoring="softmax", num_experts=6, top_k=2, hidden_size=4, intermediate_size=8)
    weights = moe_weights_from_checkpoint({"gate.weight": torch.zeros(6, 4), "experts.gate_up_proj":
                                           torch.zeros(6, 16, 4), "experts.down_proj": torch.zeros(6, 4, 8)}, cfg)
    assert route(torch.ones(3, 4), cfg, weights).experts.tolist() == [[0, 1]] * 3


# ----------------------------------------------------------------------------------- weight layouts


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "deepseek_v3", "qwen2_moe"])
def test_per_expert_checkpoint_names_give_the_fused_layout(name):
    """Released checkpoints hold each expert's projections apart (Mixtral's under block_sparse_moe as
    w1/w3/w2); stacked they are transformers 5's gate_up_proj [E, 2I, H] (gate rows first) and
    down_proj [E, H, I]."""
    block, _, cfg = hf_block(name)
    sd = block.state_dict()
    fused = moe_weights_from_checkpoint(sd, cfg)
    i = cfg.intermediate_size
    gate, up, down = ("w1", "w3", "w2") if name == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    prefix = "model.layers.1.block_sparse_moe." if name == "mixtral" else "model.layers.1.mlp."
    split = {prefix + k: v for k, v in sd.items() if not k.startswith("experts.")}
    for e in range(cfg.num_experts):
        split[f"{prefix}experts.{e}.{gate}.weight"] = sd["experts.gate_up_proj"][e, :i].clone()
        split[f"{prefix}experts.{e}.{up}.weight"] = sd["experts.gate_up_proj"][e, i:].clone()
        split[f"{prefix}experts.{e}.{down}.weight"] = sd["experts.down_proj"][e].clone()
    split["model.layers.2.mlp.gate.weight"] = torch.zeros(1)  # another layer's: not this block's
    per_expert = moe_weights_from_checkpoint(split, cfg, prefix=prefix)
    for field in ("router", "gate_up", "down", "score_bias", "shared_gate_up", "shared_down", "shared_gate"):
        a, b = getattr(fused, field), getattr(per_expert, field)
        assert (a is None and b is None) or torch.equal(a, b), field


def test_stack_experts():
    gates = [torch.full((3, 2), float(e)) for e in range(4)]
    ups = [torch.full((3, 2), 10.0 + e) for e in range(4)]
    downs = [torch.full((2, 3), 20.0 + e) for e in range(4)]
    gate_up, down = stack_experts(gates, ups, downs)
    assert gate_up.shape == (4, 6, 2) and down.shape == (4, 2, 3)
    assert gate_up[2, :3].eq(2).all() and gate_up[2, 3:].eq(12).all() and down[3].eq(23).all()


def test_converter_is_strict():
    block, _, cfg = hf_block("deepseek_v3")
    sd = dict(block.state_dict())
    with pytest.raises(CorruptModel, match="no tensor"):
        moe_weights_from_checkpoint({k: v for k, v in sd.items() if k != "gate.e_score_correction_bias"}, cfg)
    with pytest.raises(CorruptModel, match="shape"):
        moe_weights_from_checkpoint({**sd, "experts.down_proj": sd["experts.down_proj"][:, :, :-1]}, cfg)
    with pytest.raises(CorruptModel, match="does not use"):
        moe_weights_from_checkpoint({**sd, "experts.bias": torch.zeros(1)}, cfg)
    with pytest.raises(ValueError, match="activations in"):
        moe_mlp(torch.zeros(2, cfg.hidden_size, dtype=torch.bfloat16), cfg, moe_weights_from_checkpoint(sd, cfg))


# ------------------------------------------------------------------------------------------- configs


def test_from_hf_reads_released_config_keys():
    """Keys as the released config.json files spell them (Qwen3-30B-A3B, Mixtral-8x7B, DeepSeek-V3,
    GLM-4.5, Qwen1.5-MoE-A2.7B)."""
    qwen3 = MoeConfig.from_hf({"hidden_size": 2048, "num_experts": 128, "num_experts_per_tok": 8,
                               "moe_intermediate_size": 768, "norm_topk_prob": True, "decoder_sparse_step": 1,
                               "mlp_only_layers": [], "hidden_act": "silu"}, "qwen3_moe")
    assert (qwen3.scoring, qwen3.num_experts, qwen3.top_k, qwen3.norm_topk_prob, qwen3.weights_float32) == \
        ("softmax", 128, 8, True, False)
    mixtral = MoeConfig.from_hf({"hidden_size": 4096, "intermediate_size": 14336, "num_local_experts": 8,
                                 "num_experts_per_tok": 2, "router_jitter_noise": 0.0}, "mixtral")
    assert (mixtral.intermediate_size, mixtral.norm_topk_prob, mixtral.weights_float32) == (14336, True, True)
    deepseek = MoeConfig.from_hf({"hidden_size": 7168, "moe_intermediate_size": 2048, "n_routed_experts": 256,
                                  "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
                                  "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
                                  "topk_method": "noaux_tc", "norm_topk_prob": True, "first_k_dense_replace": 3,
                                  "moe_layer_freq": 1}, "deepseek_v3")
    assert (deepseek.scoring, deepseek.n_group, deepseek.topk_group, deepseek.routed_scaling_factor,
            deepseek.score_bias, deepseek.shared_intermediate_size, deepseek.router_float32) == \
        ("sigmoid", 8, 4, 2.5, True, 2048, True)
    assert [deepseek.is_moe_layer(i) for i in range(5)] == [False, False, False, True, True]
    glm = MoeConfig.from_hf({"hidden_size": 5120, "moe_intermediate_size": 1536, "n_routed_experts": 160,
                             "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1,
                             "routed_scaling_factor": 2.5, "norm_topk_prob": True, "first_k_dense_replace": 3},
                            "glm4_moe")
    assert (glm.num_experts, glm.shared_intermediate_size, glm.first_k_dense_replace) == (160, 1536, 3)
    qwen2 = MoeConfig.from_hf({"hidden_size": 2048, "num_experts": 60, "num_experts_per_tok": 4,
                               "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
                               "norm_topk_prob": False}, "qwen2_moe")
    assert (qwen2.shared_intermediate_size, qwen2.shared_gate) == (5632, True)


def test_from_hf_refuses_what_it_does_not_run():
    with pytest.raises(UnsupportedModel, match="model_type"):
        MoeConfig.from_hf({}, "llama")
    with pytest.raises(UnsupportedModel, match="scoring_func"):
        MoeConfig.from_hf({"scoring_func": "softmax"}, "deepseek_v3")
    with pytest.raises(UnsupportedModel, match="moe_layer_freq"):
        MoeConfig.from_hf({"moe_layer_freq": 2}, "deepseek_v3")
    with pytest.raises(CorruptModel, match="given twice"):
        MoeConfig.from_hf({"num_experts": 8, "num_local_experts": 16}, "qwen3_moe")
    with pytest.raises(CorruptModel, match="experts per token"):
        MoeConfig.from_hf({"num_local_experts": 4, "num_experts_per_tok": 5}, "mixtral")
    with pytest.raises(CorruptModel, match="groups"):
        MoeConfig.from_hf({"n_routed_experts": 10, "n_group": 4}, "deepseek_v3")
    with pytest.raises(UnsupportedModel, match="activation"):
        MoeConfig.from_hf({"hidden_act": "relu"}, "mixtral")


def _layer_kinds(decoder_layer, hf_config, moe_class):
    return [isinstance(decoder_layer(hf_config, i).mlp, moe_class) for i in range(hf_config.num_hidden_layers)]


def test_is_moe_layer_follows_transformers_decoder_layers():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3MoE
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer, Qwen3MoeSparseMoeBlock

    qwen = transformers.Qwen3MoeConfig(hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                       num_experts=4, num_experts_per_tok=2, num_hidden_layers=8,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                       decoder_sparse_step=2, mlp_only_layers=[3, 5])
    cfg = MoeConfig.from_hf(qwen.to_dict(), "qwen3_moe")
    assert [cfg.is_moe_layer(i) for i in range(8)] == _layer_kinds(Qwen3MoeDecoderLayer, qwen, Qwen3MoeSparseMoeBlock)
    assert [cfg.is_moe_layer(i) for i in range(8)] == [False, True, False, False, False, False, False, True]
    deepseek = transformers.DeepseekV3Config(hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                             n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                                             num_hidden_layers=5, num_attention_heads=2, num_key_value_heads=2,
                                             q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                                             qk_nope_head_dim=8, v_head_dim=8, first_k_dense_replace=2)
    cfg = MoeConfig.from_hf(deepseek.to_dict(), "deepseek_v3")
    assert [cfg.is_moe_layer(i) for i in range(5)] == _layer_kinds(DeepseekV3DecoderLayer, deepseek, DeepseekV3MoE)
    assert [cfg.is_moe_layer(i) for i in range(5)] == [False, False, True, True, True]
    assert is_moe_layer(0) and not is_moe_layer(0, num_experts=0)


def test_ernie_moe_layers_follow_transformers_decoder_layers():
    """ERNIE 4.5: from moe_layer_start_index to moe_layer_end_index (-1: the last), every
    moe_layer_interval-th."""
    from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import (Ernie4_5_MoeDecoderLayer,
                                                                        Ernie4_5_MoeSparseMoeBlock)

    for keys, want in ((dict(moe_layer_start_index=1, moe_layer_end_index=6, moe_layer_interval=2),
                        [False, True, False, True, False, True, False, False]),
                       (dict(moe_layer_start_index=2, moe_layer_end_index=-1), [False, False] + [True] * 6)):
        ernie = transformers.Ernie4_5_MoeConfig(hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                                moe_num_experts=4, moe_k=2, num_hidden_layers=8, num_attention_heads=2,
                                                num_key_value_heads=1, **keys)
        raw = {**ernie.to_dict(), **keys}  # the -1 end index as config.json may give it
        cfg = MoeConfig.from_hf(raw, "ernie4_5_moe")
        assert [cfg.is_moe_layer(i) for i in range(8)] == want
        assert want == _layer_kinds(Ernie4_5_MoeDecoderLayer, ernie, Ernie4_5_MoeSparseMoeBlock)
