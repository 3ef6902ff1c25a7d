"""The model-family registry (mtpctl.model.families): every supported model_type resolves, an unknown
one is refused in one line, and each family's tensor map is exactly the checkpoint the runtime
expects and fills exactly the parameters its block holds."""

import dataclasses

import pytest
import torch

from helpers import tiny_config_dict

from mtpctl.decode.cost_table import model_identity
from mtpctl.errors import UnsupportedModel
from mtpctl.export.onnx import EXPORTABLE
from mtpctl.export.serving import ARCHITECTURES
from mtpctl.model.config import DecoderConfig
from mtpctl.model.decoder import Decoder, _slots, expected_tensors
from mtpctl.model.families import FAMILIES, Family, family_of

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "qwen3_moe", "mixtral", "glm4_moe", "deepseek_v3",
             "gpt_oss", "qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next", "llama4_text",
             "llama4", "ernie4_5_moe", "mimo")
#: tiny MoE blocks for the MoE families (their config classes' defaults are 128 and 8 large experts)
MOE = {"qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1]),
       "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
       "glm4_moe": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_group=2, topk_group=1,
                        use_qk_norm=True),
       "deepseek_v3": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_group=2,
                           topk_group=1, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16,
                           qk_rope_head_dim=16, v_head_dim=16),
       "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2),
       # layer 0 dense (moe_layer_start_index), two shared experts, the [1, E] moe_statics bias
       "ernie4_5_moe": dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=2,
                            moe_layer_start_index=1),
       # not MoE: a hybrid body's tiny Gated DeltaNet layer, one layer of each type
       "qwen3_5_text": dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8)}
#: the hybrid body with a MoE block in every layer (a shared expert with its sigmoid gate)
MOE["qwen3_5_moe_text"] = dict(MOE["qwen3_5_text"], num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                               shared_expert_intermediate_size=48)
MOE["qwen3_next"] = dict(MOE["qwen3_5_moe_text"], layer_types=["linear_attention", "full_attention"],
                         mlp_only_layers=[1])  # layer 1 dense
#: Llama 4: layer 1 MoE (a shared expert), layer 0 dense (intermediate_size_mlp); layer 1 NoPE
MOE["llama4_text"] = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, intermediate_size_mlp=128,
                          interleave_moe_layer_step=2, no_rope_layers=[1, 0], attention_chunk_size=8)
#: the multimodal configs and the text body each nests under ``text_config``
MULTIMODAL = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text", "llama4": "llama4_text"}
#: families transformers has no class for, and the one whose body they are (MiMo: Qwen2's)
BODY_OF = {"mimo": "qwen2"}


def tiny(model_type, **overrides):
    """The tiny config of ``model_type``, with a tiny MoE block for a MoE family (Qwen3.5's multimodal
    config: the hybrid text body's under ``text_config``)."""
    if model_type in MULTIMODAL:
        text = tiny(MULTIMODAL[model_type], **overrides)
        return {"model_type": model_type, "architectures": text["architectures"],
                "tie_word_embeddings": text["tie_word_embeddings"], "text_config": text}
    return tiny_config_dict(model_type=model_type, **MOE.get(model_type, {}), **overrides)
#: config.json flags that add tensors, each family checked with and without them
FLAGS = ({}, {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": False})


def test_every_supported_model_type_resolves_to_its_own_family():
    assert tuple(FAMILIES) == SUPPORTED
    for model_type in SUPPORTED:
        family = family_of(model_type)
        assert isinstance(family, Family) and family.model_type == model_type
        assert DecoderConfig.from_dict(tiny(model_type)).family is family
        assert set(family.kernels) <= {"native", "torch"} and family.architecture.endswith("ForCausalLM")


@pytest.mark.parametrize("model_type", ["gpt2", None, "", "Llama"])
def test_an_unknown_model_type_is_refused_in_one_line(model_type):
    want = f"model_type {model_type!r} is not supported by the native runtime (supported: " \
           "deepseek_v3, ernie4_5_moe, gemma3_text, glm4_moe, gpt_oss, llama, llama4, llama4_text, mimo, mistral, mixtral, " \
           "qwen2, qwen3, qwen3_5, qwen3_5_moe, qwen3_5_moe_text, qwen3_5_text, qwen3_moe, qwen3_next)"
    with pytest.raises(UnsupportedModel) as caught:
        family_of(model_type)
    assert str(caught.value) == want and "\n" not in str(caught.value)
    with pytest.raises(UnsupportedModel, match="is not supported by the native runtime"):
        DecoderConfig.from_dict(tiny_config_dict(model_type=model_type))


@pytest.mark.parametrize("flags", FLAGS, ids=["defaults", "biases-untied"])
@pytest.mark.parametrize("model_type", SUPPORTED)
def test_tensor_map_is_the_expected_checkpoint_and_fills_every_parameter(model_type, flags):
    cfg = DecoderConfig.from_dict(tiny(model_type, **flags))
    model = Decoder(cfg, lazy=True)
    slots = _slots(model)
    names = [n for slot in slots for n in slot.names]
    expected = set(expected_tensors(cfg)) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    assert len(names) == len(set(names)) and set(names) == expected
    # the slots are exactly the parameters the block holds (a tied lm_head is the embedding itself)
    filled = {(id(slot.owner), slot.attr) for slot in slots}
    held = {(id(owner), name) for owner in (model, *model.layers) for name, p in owner._parameters.items()
            if p is not None and not (name == "lm_head" and cfg.tie_word_embeddings)}
    assert filled == held
    # stacked by rows, the tensors' shapes make the parameter's
    shapes = expected_tensors(cfg)
    for slot in slots:
        param = slot.owner._parameters[slot.attr]
        rows = sum(shapes[n][0] for n in slot.names)
        stacked = (rows, *shapes[slot.names[0]][1:])
        if stacked[0] == 1 and len(stacked) == 2 and param.dim() == 1:  # ERNIE's [1, E] bias fills an [E] one
            stacked = stacked[1:]
        assert stacked == tuple(param.shape), slot.names
        assert slot.norm == (param.dim() == 1 and slot.attr.endswith("norm"))


def test_the_family_describes_what_config_block_export_serving_and_costs_read():
    for model_type, family in FAMILIES.items():
        cfg = DecoderConfig.from_dict(tiny(model_type))
        block = family.block
        assert (cfg.qk_norm, cfg.norm_offset, cfg.sandwich_norms, cfg.scaled_embeddings) == \
               (block.qk_norm or model_type == "glm4_moe", block.norm_offset, block.sandwich_norms,
                block.scaled_embeddings)  # GLM-4.5's QK-norm: its config's use_qk_norm
        assert ARCHITECTURES[model_type] == family.architecture
        assert (model_type in EXPORTABLE) == family.exportable
        moe = {} if family.experts is None else {
            "experts": 4, "experts_per_token": 2, "expert_intermediate_size": cfg.moe.intermediate_size,
            "moe_layers": sum(cfg.moe.is_moe_layer(i) for i in range(2))}
        assert model_identity(cfg) == {"model_type": model_type, "hidden_size": 64, "intermediate_size": 128,
                                       "layers": 2, "heads": 4, "kv_heads": 4 if cfg.mla else 2, "vocab_size": 259,
                                       **moe}
    raw = tiny_config_dict(model_type="gemma3_text")
    del raw["head_dim"]
    gemma = DecoderConfig.from_dict(raw)  # the family's defaults fill what config.json omits
    assert gemma.head_dim == 256 and gemma.hidden_act == "gelu_pytorch_tanh" and gemma.tie_word_embeddings
    assert gemma.layer_windows == (4096, 4096)  # the default window; every 6th layer global, not these two
    six = DecoderConfig.from_dict({**raw, "num_hidden_layers": 6})
    assert six.layer_windows == (4096,) * 5 + (None,)
    qwen2 = DecoderConfig.from_dict(tiny_config_dict(model_type="qwen2", num_hidden_layers=3, sliding_window=4,
                                                     max_window_layers=1))
    assert qwen2.layer_windows == (None, 4, 4)  # the family's rule: layers from max_window_layers on slide


def test_the_native_layer_stack_runs_only_families_that_allow_it(monkeypatch):
    from helpers import random_decoder

    model = random_decoder(dtype=torch.bfloat16, blocked=True)
    if model.native_stack() is None:
        pytest.skip("the native kernels do not build here")
    monkeypatch.setitem(FAMILIES, "llama", dataclasses.replace(FAMILIES["llama"], native_stack=False))
    assert model.native_stack() is None


@pytest.mark.parametrize("model_type", SUPPORTED)
def test_tensor_map_names_what_transformers_saves(model_type):
    """The family's checkpoint is the one Hugging Face's own implementation writes (untied, so the
    lm_head is there; biases as the family's config class sets them)."""
    transformers = pytest.importorskip("transformers")

    raw = tiny(model_type, tie_word_embeddings=False)
    raw.pop("architectures")
    reference = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**{**raw, "model_type": BODY_OF.get(model_type, model_type)}),
        dtype=torch.float32)
    saved = {name: tuple(t.shape) for name, t in reference.state_dict().items() if "rotary" not in name}
    assert saved == expected_tensors(DecoderConfig.from_dict(raw))


@pytest.mark.parametrize("model_type,kind", [("llama", "chunked_attention"), ("qwen3", "linear_attention"),
                                             ("gemma3_text", "mamba")])
def test_a_layer_kind_the_family_does_not_compute_is_refused_naming_it(model_type, kind):
    """A layer read as another kind would give other tokens than the model's: refused in one line."""
    with pytest.raises(UnsupportedModel, match=f"layer_types '{kind}' is not a layer of {model_type}"):
        DecoderConfig.from_dict(tiny(model_type, layer_types=["full_attention", kind], sliding_window=8))
