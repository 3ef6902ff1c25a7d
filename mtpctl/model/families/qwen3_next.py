"""Qwen3-Next (Qwen Team 2025; transformers' ``Qwen3NextForCausalLM``, config ``qwen3_next``): the hybrid body
of :mod:`.qwen3_5_text` (Gated DeltaNet layers and gated full-attention layers, as ``layer_types`` names
them, else every ``full_attention_interval``-th layer, default 4; every RMSNorm but the gated one as
``1 + w``; partial rotary, default 0.25) with Qwen2-MoE's block (:mod:`mtpctl.model.moe`): in the layers
not in ``mlp_only_layers`` whose ``(index + 1)`` is a multiple of ``decoder_sparse_step``, ``num_experts``
SwiGLU experts of ``moe_intermediate_size``, softmax router, top ``num_experts_per_tok`` renormalised with
``norm_topk_prob``, and one shared expert of ``shared_expert_intermediate_size`` scaled by
``sigmoid(shared_expert_gate(x))``; the other layers a dense MLP of ``intermediate_size``. The Gated
DeltaNet input projections are fused per key head (``in_proj_qkvz``, ``in_proj_ba``), reordered once
loaded (:func:`mtpctl.model.gated_deltanet.grouped_rows`). ``mtp.*`` tensors are the MTP drafter's. No native
layer stack, not exportable."""

import dataclasses

from mtpctl.model.families.base import GROUPED_DELTANET_LAYER, Experts
from mtpctl.model.families.qwen3_5_text import FAMILY as QWEN3_5

FAMILY = dataclasses.replace(QWEN3_5, model_type="qwen3_next", architecture="Qwen3NextForCausalLM",
                             experts=Experts(), linear_tensors=GROUPED_DELTANET_LAYER, grouped_in_proj=True)
