"""Qwen3.5's MoE text body (qwen3_5_moe_text: the hybrid body with a MoE block, a gated shared expert
included, in every layer) and Qwen3-Next (qwen3_next: the same with Qwen2-MoE's layer rule, a dense layer
through mlp_only_layers, and the fused per-key-head Gated DeltaNet projections) on tiny random checkpoints
written by transformers' own classes: prefill logits and 32 greedy tokens equal transformers' in float32
(one prompt longer than a 64-token prefill chunk); prompt lookup (drafting) and suffix decoding equal plain
decoding, a batch equals each row alone; the per-expert layout (``save_pretrained``) and the stacked one
(transformers 5's ``state_dict``) load to the same logits; the multimodal ``qwen3_5_moe`` checkpoint reads
as its text body."""


import pytest
import torch

from helpers import (FAMILY_PROMPTS, assert_equals_transformers, randomize_hybrid_weights, write_moe_checkpoints,
                     write_multimodal_checkpoint)

from mtpctl.backends.torch import TorchEngine
from mtpctl.decode.tree import DraftTree
from mtpctl.model.config import DecoderConfig
from mtpctl.model.decoder import Decoder

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen3_5_moe")

#: three layers (Gated DeltaNet, gated full attention, Gated DeltaNet), each with 8 experts (2 a token)
#: and a shared expert; no intermediate_size: no layer has a dense MLP
TINY = dict(vocab_size=259, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, max_position_embeddings=256, rms_norm_eps=1e-6,
            layer_types=["linear_attention", "full_attention", "linear_attention"], tie_word_embeddings=False,
            bos_token_id=257, eos_token_id=258)
#: FAMILY_PROMPTS and one prompt longer than one chunk of the chunked prefill (64 tokens)
PROMPTS = FAMILY_PROMPTS + ([(7 * i) % 250 + 3 for i in range(70)],)
NEW = 32


#: Qwen3-Next: four layers (Gated DeltaNet, attention, Gated DeltaNet with a dense MLP, attention)
NEXT = dict(TINY, num_hidden_layers=4, intermediate_size=96, mlp_only_layers=[2], norm_topk_prob=True,
            layer_types=["linear_attention", "full_attention"] * 2)


def reference_model(seed: int = 1, scale: float = 1.5, next_: bool = False):
    """transformers' tiny random Qwen3.5-MoE text model, float32: matrices N(0, 1/sqrt(fan-in)) * 1.5
    (router and shared-expert gate included, so choices and gates stand apart), norm offsets N(0, 0.3),
    decays ``exp(g)`` spread over (0, 1). Seed 1: with seed 0 one position of the 70-token prompt is
    1.1e-4 off transformers' logits (of magnitude 6; the chunked prefill's float32 rounding, carried through
    three layers), just over the helper's 1e-4; seeds 1 and 2 stay within 6.5e-5."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    model = (Qwen3NextForCausalLM(Qwen3NextConfig(**NEXT)) if next_ else
             Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**TINY))).eval()
    return randomize_hybrid_weights(model, scale)  # (these models have no biases but dt_bias)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The Qwen3.5-MoE text checkpoint in both layouts (:func:`helpers.write_moe_checkpoints`)."""
    reference = reference_model()
    return reference, write_moe_checkpoints(tmp_path_factory.mktemp("qwen3_5_moe"), "qwen3_5_moe_text", reference)


@pytest.fixture(scope="module")
def next_checkpoints(tmp_path_factory):
    """The Qwen3-Next checkpoint in both layouts (:func:`helpers.write_moe_checkpoints`)."""
    reference = reference_model(next_=True)
    return reference, write_moe_checkpoints(tmp_path_factory.mktemp("qwen3_next"), "qwen3_next", reference)


def test_the_checkpoint_reads_as_a_hybrid_body_with_moe_layers(checkpoints):
    reference, folders = checkpoints
    cfg = DecoderConfig.from_folder(folders["per_expert"])
    assert cfg.model_type == "qwen3_5_moe_text" and cfg.intermediate_size == 0 and cfg.output_gate
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.norm_topk_prob) == (8, 2, True)
    assert (cfg.moe.shared_intermediate_size, cfg.moe.shared_gate, cfg.moe.weights_float32) == (48, True, False)
    model = Decoder.from_folder(folders["per_expert"])
    assert [(layer.deltanet is not None, layer.moe is not None) for layer in model.layers] == \
        [(True, True), (False, True), (True, True)]
    mlp = reference.model.layers[0].mlp
    assert model.layers[0].gate_up is None and model.layers[1].qkv is not None
    assert torch.equal(model.layers[0].experts_gate_up, mlp.experts.gate_up_proj)
    assert torch.equal(model.layers[0].shared_expert_gate, mlp.shared_expert_gate.weight)
    assert torch.equal(model.layers[0].shared_gate_up, torch.cat((mlp.shared_expert.gate_proj.weight,
                                                                  mlp.shared_expert.up_proj.weight)))


def test_both_expert_layouts_load_to_the_same_logits(checkpoints):
    from safetensors import safe_open

    _, folders = checkpoints
    names = set(safe_open(str(folders["stacked"] / "model.safetensors"), "pt").keys())
    assert "model.layers.0.mlp.experts.gate_up_proj" in names and "model.layers.0.mlp.experts.0.gate_proj.weight" \
        not in names  # the stacked checkpoint really is stacked
    a, b = (Decoder.from_folder(folders[k], blocked=True) for k in ("per_expert", "stacked"))
    for prompt in PROMPTS[:2]:
        la = TorchEngine(a, 32).verify(DraftTree.chain(list(prompt))).logits
        lb = TorchEngine(b, 32).verify(DraftTree.chain(list(prompt))).logits
        assert torch.equal(la, lb)


@pytest.mark.parametrize("layout", ["per_expert", "stacked"])
def test_logits_and_greedy_tokens_equal_transformers_in_float32(checkpoints, layout):
    reference, folders = checkpoints
    prompts = PROMPTS if layout == "per_expert" else PROMPTS[:1]
    assert_equals_transformers(reference, Decoder.from_folder(folders[layout]), folders[layout], prompts, NEW)


def test_the_shared_experts_gate_counts(checkpoints):
    """Without the sigmoid gate (its weight zeroed: a gate of 0.5) the logits move: the gate is read."""
    _, folders = checkpoints
    model = Decoder.from_folder(folders["per_expert"])
    before = TorchEngine(model, 16).verify(DraftTree.chain(list(PROMPTS[0]))).logits
    for layer in model.layers:
        layer.shared_expert_gate.zero_()
    after = TorchEngine(model, 16).verify(DraftTree.chain(list(PROMPTS[0]))).logits
    assert (before - after).abs().max() > 1e-3


def test_prompt_lookup_that_drafts_and_suffix_decoding_equal_plain_decoding_alone_and_in_a_batch(checkpoints):
    import mtpctl
    from mtpctl.decode.session import GenerationRequest

    folder = checkpoints[1]["per_expert"]
    plain = mtpctl.load(str(folder), speculate="none", dtype="float32", threads=1)
    expected = [plain.pipeline.generate(list(p), NEW).token_ids for p in PROMPTS]
    ngram = mtpctl.load(str(folder), speculate="ngram", dtype="float32", speculate_policy="always", threads=1,
                        ngram_min=1, draft_len=4)
    results = [ngram.pipeline.generate(list(p), NEW) for p in PROMPTS]
    assert [r.token_ids for r in results] == expected and sum(r.stats.draft_tokens for r in results) > 20
    batch = ngram.generate_batch([GenerationRequest(list(p), NEW) for p in PROMPTS], max_batch=len(PROMPTS))
    assert [r.token_ids for r in batch] == expected and sum(r.stats.draft_tokens for r in batch) > 20
    plain_batch = plain.generate_batch([GenerationRequest(list(p), NEW) for p in PROMPTS], max_batch=len(PROMPTS))
    assert [r.token_ids for r in plain_batch] == expected
    suffix = mtpctl.load(str(folder), speculate="suffix", dtype="float32", speculate_policy="always", threads=1)
    got = [suffix.pipeline.generate(list(p), NEW) for p in PROMPTS]
    assert [r.token_ids for r in got] == expected and sum(r.stats.draft_tokens for r in got) > 0


def test_bfloat16_prompt_lookup_and_batches_equal_plain_decoding(checkpoints):
    import mtpctl
    from mtpctl.decode.session import GenerationRequest

    folder = checkpoints[1]["stacked"]
    plain = mtpctl.load(str(folder), speculate="none", dtype="bfloat16", threads=1)
    ngram = mtpctl.load(str(folder), speculate="ngram", dtype="bfloat16", speculate_policy="always", threads=1,
                        ngram_min=1, draft_len=4)
    expected = [plain.pipeline.generate(list(p), NEW).token_ids for p in PROMPTS]
    batch = ngram.generate_batch([GenerationRequest(list(p), NEW) for p in PROMPTS], max_batch=len(PROMPTS))
    assert [r.token_ids for r in batch] == expected and sum(r.stats.draft_tokens for r in batch) > 20


@pytest.fixture(scope="module")
def multimodal(checkpoints, tmp_path_factory):
    """The checkpoint's text body inside transformers' multimodal ``Qwen3_5MoeForConditionalGeneration`` (a
    tiny vision tower; config ``qwen3_5_moe`` with ``text_config``), saved by transformers, plus an
    ``mtp.*`` tensor as released checkpoints carry."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    reference, folders = checkpoints
    folder = tmp_path_factory.mktemp("qwen3_5_moe_multimodal")
    tensors = write_multimodal_checkpoint(reference, Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration, folder,
                                          folders["per_expert"])
    assert "model.language_model.layers.0.mlp.experts.0.gate_proj.weight" in tensors  # per expert, renamed
    return folder


def test_the_multimodal_checkpoint_reads_as_its_text_body(checkpoints, multimodal):
    text = Decoder.from_folder(checkpoints[1]["per_expert"], blocked=True)
    ours = Decoder.from_folder(multimodal, blocked=True)
    assert ours.cfg.model_type == "qwen3_5_moe"
    assert ours.cfg.moe == text.cfg.moe and ours.cfg.deltanet == text.cfg.deltanet
    for prompt in PROMPTS[:2]:
        a = TorchEngine(text, 32).verify(DraftTree.chain(list(prompt))).logits
        b = TorchEngine(ours, 32).verify(DraftTree.chain(list(prompt))).logits
        assert torch.equal(a, b)


def test_qwen3_next_reads_its_layer_rule_and_fused_projections(next_checkpoints):
    from mtpctl.model.gated_deltanet import deltanet_weights_from_checkpoint

    reference, folders = next_checkpoints
    model = Decoder.from_folder(folders["per_expert"])
    assert model.cfg.model_type == "qwen3_next" and model.cfg.intermediate_size == 96
    assert [(layer.deltanet is not None, layer.moe is not None) for layer in model.layers] == \
        [(True, True), (False, True), (True, False), (False, True)]  # layer 2: mlp_only_layers, dense
    attn = reference.model.layers[0].linear_attn
    tensors = {f"{n}.weight": getattr(attn, n).weight for n in ("in_proj_qkvz", "in_proj_ba", "out_proj", "norm")}
    tensors.update({"conv1d.weight": attn.conv1d.weight, "A_log": attn.A_log, "dt_bias": attn.dt_bias})
    expected = deltanet_weights_from_checkpoint(tensors, model.cfg.deltanet).in_proj
    assert torch.equal(model.layers[0].in_proj, expected)  # q, k, v, z, b, a order, not the file's
    assert not torch.equal(model.layers[0].in_proj, torch.cat((attn.in_proj_qkvz.weight, attn.in_proj_ba.weight)))
    a, b = (Decoder.from_folder(folders[k], blocked=True) for k in ("per_expert", "stacked"))
    la = TorchEngine(a, 32).verify(DraftTree.chain(list(PROMPTS[1]))).logits
    assert torch.equal(la, TorchEngine(b, 32).verify(DraftTree.chain(list(PROMPTS[1]))).logits)


def test_qwen3_next_equals_transformers_and_speculation_equals_plain(next_checkpoints):
    import mtpctl
    from mtpctl.decode.session import GenerationRequest

    reference, folders = next_checkpoints
    folder = folders["per_expert"]
    assert_equals_transformers(reference, Decoder.from_folder(folder), folder, PROMPTS, NEW)
    plain = mtpctl.load(str(folder), speculate="none", dtype="float32", threads=1)
    expected = [plain.pipeline.generate(list(p), NEW).token_ids for p in PROMPTS]
    ngram = mtpctl.load(str(folder), speculate="ngram", dtype="float32", speculate_policy="always", threads=1,
                        ngram_min=1, draft_len=4)
    batch = ngram.generate_batch([GenerationRequest(list(p), NEW) for p in PROMPTS], max_batch=len(PROMPTS))
    assert [r.token_ids for r in batch] == expected and sum(r.stats.draft_tokens for r in batch) > 20
    suffix = mtpctl.load(str(folder), speculate="suffix", dtype="float32", speculate_policy="always", threads=1)
    got = [suffix.pipeline.generate(list(p), NEW) for p in PROMPTS]
    assert [r.token_ids for r in got] == expected and sum(r.stats.draft_tokens for r in got) > 0


def test_the_pure_torch_path_with_prompt_lookup_equals_its_plain_decoding(checkpoints):
    """kernels="torch": the MoE blocks in the placement's fixed rows, prefill through the masked path."""
    import mtpctl

    folder = checkpoints[1]["per_expert"]
    prompt = list(PROMPTS[3])
    plain = mtpctl.load(str(folder), speculate="none", dtype="float32", threads=1, kernels="torch")
    ngram = mtpctl.load(str(folder), speculate="ngram", dtype="float32", threads=1, kernels="torch",
                        speculate_policy="always", ngram_min=1)
    got = ngram.pipeline.generate(prompt, NEW)
    assert got.token_ids == plain.pipeline.generate(prompt, NEW).token_ids and got.stats.draft_tokens > 0


def test_qwen3_next_holds_its_reordered_input_projection_on_the_dense_path(next_checkpoints):
    """Loaded for decoding (``blocked``), the fused per-key-head input projection is reordered before it
    is held: the held weight is the q, k, v, z, b, a order the unheld model keeps."""
    from mtpctl.model.row_invariance import dense_path, path_of

    _, folders = next_checkpoints
    for dtype in (torch.float32, torch.bfloat16):
        plain = Decoder.from_folder(folders["per_expert"], dtype=dtype)
        held = Decoder.from_folder(folders["per_expert"], dtype=dtype, blocked=True)
        for i in (0, 2):
            for name in ("in_proj", "out_proj"):
                weight, linear = getattr(plain.layers[i], name), getattr(held.layers[i], name)
                assert path_of(linear) == dense_path(dtype, tuple(weight.shape)) and torch.equal(linear.dense(), weight)
