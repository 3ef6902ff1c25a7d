"""Parity with HF transformers' implementations on tiny random checkpoints of each supported family."""

import pytest
import torch

from mtpctl.backends.torch import TorchEngine
from mtpctl.model.decoder import Decoder
from mtpctl.decode.tree import DraftTree

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6)


@pytest.mark.parametrize("model_type, extra", [
    ("llama", {"tie_word_embeddings": True}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
    ("mistral", {"sliding_window": 5}),
    ("qwen2", {"tie_word_embeddings": False}),
    ("qwen3", {"tie_word_embeddings": False}),
    ("gemma3_text", {"sliding_window": 5, "query_pre_attn_scalar": 8,
                     "layer_types": ["sliding_attention", "full_attention"]}),  # more in test_gemma3.py
])
def test_logits_match_transformers(tmp_path, model_type, extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **COMMON, **extra)
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # larger weights than the default init, so logits are not all near zero
        for p in reference.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    reference.save_pretrained(str(tmp_path))
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids).logits[0]
    ours = TorchEngine(Decoder.from_folder(tmp_path), 16).verify(DraftTree.chain(ids[0].tolist())).logits
    assert (ours - expected).abs().max() < 1e-4
