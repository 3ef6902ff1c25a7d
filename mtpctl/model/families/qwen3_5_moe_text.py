"""Qwen3.5's MoE text body (Qwen Team; transformers' ``Qwen3_5MoeForCausalLM``, config ``qwen3_5_moe_text``):
the hybrid body of :mod:`.qwen3_5_text` (Gated DeltaNet layers and gated full-attention layers, as
``layer_types`` names them; every RMSNorm but the gated one as ``1 + w``; partial rotary, default 0.25)
with a MoE block in every layer instead of the dense MLP (:mod:`mtpctl.model.moe`): ``num_experts`` SwiGLU
experts of ``moe_intermediate_size``, softmax router, top ``num_experts_per_tok`` always renormalised, the
weights rounded to the model's dtype; and one shared expert of ``shared_expert_intermediate_size``
(``mlp.shared_expert.*``) scaled by ``sigmoid(mlp.shared_expert_gate(x))``. Experts load per expert (what
``save_pretrained`` writes) or stacked (transformers 5's ``state_dict``). The config names no
``intermediate_size``: no layer has a dense MLP (0 here). ``mtp.*`` tensors are the MTP drafter's.

The multimodal checkpoint (``qwen3_5_moe``) reads as this body (:mod:`.qwen3_5_moe`). No native layer
stack, not exportable."""

import dataclasses

from mtpctl.model.families.base import Experts
from mtpctl.model.families.qwen3_5_text import FAMILY as DENSE

FAMILY = dataclasses.replace(DENSE, model_type="qwen3_5_moe_text", architecture="Qwen3_5MoeForCausalLM",
                             experts=Experts(), defaults=DENSE.defaults + (("intermediate_size", 0),))
