"""gpt-oss (OpenAI 2025, "gpt-oss-120b & gpt-oss-20b Model Card"; transformers' ``GptOssForCausalLM``):
Llama's pre-norm block with q/k/v/o biases, attention sinks (a learned logit per query head,
``self_attn.sinks``, joins the softmax's denominator), sliding-window layers alternating with full ones
(``layer_types``; by default the even layers slide, ``sliding_window`` 128), YaRN rope (factor 32 over
4096 positions, theta 150000). Every layer's MLP is a MoE block (:mod:`mtpctl.model.moe`): a router with a
bias, the top ``num_experts_per_tok`` logits softmaxed, ``num_local_experts`` experts with biases and the
clamped SwiGLU (``swiglu_limit``, ``swiglu_alpha``), stacked as transformers 5 holds them
(``mlp.experts.gate_up_proj [E, H, 2I]``, gate and up columns interleaved; ``down_proj [E, I, H]``).

The native attention kernel takes no sinks: this family runs on the torch kernels (``kernels``), its
decode and verify passes attending with torch's batch-invariant attention. No native layer stack, not
exportable to ONNX. MXFP4 expert weights as published (``*_blocks``/``*_scales``) are refused at load
(:mod:`mtpctl.model.fp8`)."""

from typing import List, Tuple

from mtpctl.model.families.base import (FULL, LLAMA_NORMS, PROJECTIONS, SLIDING, Block, Experts, Family,
                                        Tensor)

#: attention's projections with their biases, then the sinks (the dense MLP's rows are left out: every
#: layer is MoE)
ATTENTION = PROJECTIONS[:4] + (
    Tensor("self_attn.q_proj.bias", ("q",), "qkv_bias", when="attention_bias"),
    Tensor("self_attn.k_proj.bias", ("kv",), "qkv_bias", when="attention_bias"),
    Tensor("self_attn.v_proj.bias", ("kv",), "qkv_bias", when="attention_bias"),
    Tensor("self_attn.o_proj.bias", ("h",), "o_bias", when="attention_bias"),
    Tensor("self_attn.sinks", ("nh",), "sinks"))


class GptOssExperts(Experts):
    """gpt-oss's router and experts: one layout, transformers 5's (stacked, transposed, interleaved)."""

    def per_expert(self, names, layer: int) -> bool:
        return False

    def tensors(self, cfg, per_expert: bool) -> Tuple[Tensor, ...]:
        p = self.fused_prefix
        return (Tensor(p + "router.weight", ("e", "h"), "router"),
                Tensor(p + "router.bias", ("e",), "router_logit_bias"),
                Tensor(p + "experts.gate_up_proj", ("e", "h", "2mi"), "experts_gate_up"),
                Tensor(p + "experts.gate_up_proj_bias", ("e", "2mi"), "experts_gate_up_bias"),
                Tensor(p + "experts.down_proj", ("e", "mi", "h"), "experts_down"),
                Tensor(p + "experts.down_proj_bias", ("e", "h"), "experts_down_bias"))


def layer_types(cfg: dict, layers: int) -> List[str]:
    """No ``layer_types`` in config.json: even layers slide, odd ones attend to everything."""
    return [SLIDING if i % 2 == 0 else FULL for i in range(layers)]


#: YaRN as gpt-oss's config class fills it in where config.json names no rope scaling
YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 4096}

FAMILY = Family(
    model_type="gpt_oss", architecture="GptOssForCausalLM", layer_tensors=LLAMA_NORMS + ATTENTION,
    block=Block(attention_sinks=True, yarn=True), attention_bias=True, layer_types=layer_types,
    exportable=False, kernels=("torch",), native_stack=False, experts=GptOssExperts(), mlp_bias_key="",
    defaults=(("num_hidden_layers", 36), ("num_local_experts", 128), ("vocab_size", 201088),
              ("hidden_size", 2880), ("intermediate_size", 2880), ("head_dim", 64), ("num_attention_heads", 64),
              ("num_key_value_heads", 8), ("sliding_window", 128), ("rms_norm_eps", 1e-5),
              ("max_position_embeddings", 131072), ("num_experts_per_tok", 4), ("rope_theta", 150000.0),
              ("rope_scaling", YARN), ("swiglu_alpha", 1.702), ("swiglu_limit", 7.0)))
