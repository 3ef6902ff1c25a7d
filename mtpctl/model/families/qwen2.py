"""Qwen2 (Qwen Team 2024, "Qwen2 Technical Report"): the Llama block with q/k/v projection biases by
default; with ``use_sliding_window``, the layers from ``max_window_layers`` on slide."""

from typing import List

from mtpctl.model.families.base import FULL, SLIDING, Family


def layer_types(cfg: dict, layers: int) -> List[str]:
    """The layers from ``max_window_layers`` on slide, those before it attend fully."""
    start = int(cfg.get("max_window_layers", 0))
    return [SLIDING if i >= start else FULL for i in range(layers)]


FAMILY = Family(model_type="qwen2", architecture="Qwen2ForCausalLM", attention_bias=True, layer_types=layer_types)
