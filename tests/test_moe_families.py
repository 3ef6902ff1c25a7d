"""The Mixture-of-Experts families (qwen3_moe, mixtral) on tiny random checkpoints written by
transformers' own classes: the layout ``save_pretrained`` writes (one tensor per expert) and
transformers 5's stacked in-memory layout (its ``state_dict``) both load, strictly; greedy decoding and
every prefill logit equal transformers' in float32; speculation (prompt lookup, a scripted drafter) and
batches equal plain decoding in float32 and bfloat16; the CLI runs them."""

import json
import shutil

import pytest
import torch

from helpers import (FAMILY_PROMPTS, MOE_EXTRA, assert_equals_transformers, assert_speculation_equals_plain, cli,
                     moe_reference_model, write_moe_checkpoints, write_tiny_checkpoint)

from mtpctl.decode.cost_table import model_identity
from mtpctl.errors import CorruptModel
from mtpctl.model.config import DecoderConfig
from mtpctl.model.decoder import Decoder

transformers = pytest.importorskip("transformers")

EXTRA = MOE_EXTRA
MODEL_TYPES = tuple(EXTRA)
LAYOUTS = ("per_expert", "stacked")
PROMPTS = FAMILY_PROMPTS
NEW = 32


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """model_type -> (transformers' model, layout -> checkpoint folder with the tiny tokenizer)."""
    root = tmp_path_factory.mktemp("moe")
    tokenizer = write_tiny_checkpoint(root / "tokenizer")
    out = {}
    for model_type in MODEL_TYPES:
        reference = moe_reference_model(model_type)
        out[model_type] = (reference, write_moe_checkpoints(root, model_type, reference, tokenizer))
    return out


def test_save_pretrained_writes_one_tensor_per_expert_and_state_dict_stacks_them(folders):
    from safetensors import safe_open

    for model_type, prefix, gate in (("qwen3_moe", "mlp.", "gate_proj"), ("mixtral", "block_sparse_moe.", "w1")):
        reference, where = folders[model_type]
        with safe_open(str(where["per_expert"] / "model.safetensors"), "pt") as f:
            names = set(f.keys())
        assert f"model.layers.0.{prefix}experts.0.{gate}.weight" in names
        assert "model.layers.0.mlp.experts.gate_up_proj" in reference.state_dict()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_logits_and_greedy_tokens_equal_transformers_in_float32(folders, model_type, layout):
    reference, where = folders[model_type]
    model = Decoder.from_folder(where[layout])
    assert [layer.moe is not None for layer in model.layers] == \
        ([True, False, True] if model_type == "qwen3_moe" else [True] * 3)
    assert_equals_transformers(reference, model, where[layout], PROMPTS, NEW)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_speculation_and_batches_equal_plain_decoding(folders, model_type, dtype):
    assert_speculation_equals_plain(folders[model_type][1]["per_expert"], dtype, PROMPTS, NEW)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_the_cli_generates(folders, model_type, capsys):
    folder = folders[model_type][1]["stacked"]
    code, out, err = cli(capsys, "generate", "-m", folder, "--json", "--max-new-tokens", 8, "--no-chat", "abcabc")
    assert code == 0, err
    result = json.loads(out)
    assert result["token_ids"] and result["greedy_exactness"] == "bit-exact"
    assert result["matmul_paths"]["fixed-rows-float32"] == "row-invariant"  # the experts' products


def test_loading_is_strict_one_line_naming_the_tensor(folders, tmp_path):
    from safetensors.torch import load_file, save_file

    src = folders["mixtral"][1]["per_expert"]
    tensors = load_file(str(src / "model.safetensors"))
    for name, change in (("model.layers.2.block_sparse_moe.experts.3.w2.weight", "missing"),
                         ("model.layers.1.block_sparse_moe.experts.4.w1.weight", "unexpected")):
        folder = tmp_path / change
        folder.mkdir()
        shutil.copy(src / "config.json", folder / "config.json")
        changed = dict(tensors)
        if change == "missing":
            del changed[name]
        else:
            changed[name] = torch.zeros(48, 64)
        save_file(changed, str(folder / "model.safetensors"))
        with pytest.raises(CorruptModel) as caught:
            Decoder.from_folder(folder)
        assert change in str(caught.value) and name in str(caught.value) and "\n" not in str(caught.value)


def test_an_unknown_model_type_still_gives_one_line(tmp_path, capsys):
    folder = write_tiny_checkpoint(tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen2_moe"}))
    code, out, err = cli(capsys, "generate", "-m", folder, "--max-new-tokens", 4, "--no-chat", "abc")
    lines = err.strip().splitlines()
    assert code != 0 and out == "" and "Traceback" not in err and len(lines) == 1, err
    assert "model_type 'qwen2_moe' is not supported" in lines[0]


def test_the_cost_identity_counts_experts_and_the_native_stack_and_export_leave_moe_alone(folders):
    from mtpctl.export.onnx import EXPORTABLE

    for model_type, (experts, intermediate, moe_layers) in (("qwen3_moe", (8, 32, 2)), ("mixtral", (4, 48, 3))):
        cfg = DecoderConfig.from_folder(folders[model_type][1]["per_expert"])
        identity = model_identity(cfg)
        assert identity["experts"] == experts and identity["experts_per_token"] == 2
        assert identity["expert_intermediate_size"] == intermediate and identity["moe_layers"] == moe_layers
        assert model_type not in EXPORTABLE and not cfg.family.native_stack
        model = Decoder.from_folder(folders[model_type][1]["per_expert"], dtype=torch.bfloat16, blocked=True)
        assert model.native_stack() is None
