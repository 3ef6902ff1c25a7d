"""Qwen3.5's text body (Qwen Team; transformers' ``Qwen3_5ForCausalLM``, config ``qwen3_5_text``): a
hybrid of Gated DeltaNet layers (linear attention with a recurrent state and a short causal convolution,
:mod:`mtpctl.model.gated_deltanet`) and full-attention layers, as ``layer_types`` names them (without it,
every ``full_attention_interval``-th layer, default 4, attends fully). The full-attention layers are
Qwen3's (QK-norm) with an output gate (``q_proj`` gives each head's query then its gate, ``2 * head_dim``
rows a head; attention's output times ``sigmoid(gate)`` before ``o_proj``) and a rotary embedding on the
first ``int(head_dim * partial_rotary_factor)`` values of each head (default 0.25). Every RMSNorm but the
Gated DeltaNet's gated one holds ``1 + w``, scaled in float32 (as Gemma's). Checkpoints may carry the
native MTP layers (``mtp.*``), which the body does not read (the MTP drafter does:
:data:`~.mtp_layouts.QWEN`, for every Qwen3.5 and Qwen3-Next family).

``attention_bias`` adds q/k/v and o_proj biases. The multimodal checkpoint (``qwen3_5``) reads as this
body (:mod:`.qwen3_5`); the MoE variant is :mod:`.qwen3_5_moe_text`. No native layer stack, not
exportable; the KV cache holds the attention layers only (``DecoderLayer.cache_index``)."""

from mtpctl.model.families.base import (BIASES, DELTANET_LAYER, LLAMA_NORMS, PROJECTIONS, QK_NORMS, Block, Family,
                                        Tensor)
from mtpctl.model.families.mtp_layouts import QWEN

#: the full-attention layer's tensors: q_proj with the output gate's rows, then Qwen3's; biases (q's
#: with the gate's rows, o_proj's too) where config.json sets ``attention_bias``
GATED_ATTENTION = (Tensor("self_attn.q_proj.weight", ("q2", "h"), "qkv"),) + PROJECTIONS[1:4] + QK_NORMS + \
    (Tensor("self_attn.q_proj.bias", ("q2",), "qkv_bias", when="attention_bias"),) + BIASES[1:3] + \
    (Tensor("self_attn.o_proj.bias", ("h",), "o_bias", when="attention_bias"),)

FAMILY = Family(model_type="qwen3_5_text", architecture="Qwen3_5ForCausalLM",
                layer_tensors=LLAMA_NORMS + GATED_ATTENTION + PROJECTIONS[4:],
                block=Block(qk_norm=True, norm_offset=1.0, partial_rotary=True, output_gate=True,
                            linear_attention=True),
                defaults=(("partial_rotary_factor", 0.25), ("head_dim", 256)), exportable=False,
                native_stack=False, mlp_bias_key="", linear_tensors=DELTANET_LAYER, ignored=("mtp.",),
                mtp_layout=QWEN)
