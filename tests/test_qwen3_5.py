"""Qwen3.5's hybrid text body (qwen3_5_text: Gated DeltaNet and gated full-attention layers) on tiny random
checkpoints written by transformers' own classes: prefill logits and 32 greedy tokens equal transformers'
in float32 (one prompt longer than a 64-token prefill chunk); speculation (prompt lookup, suffix
decoding, a scripted drafter with corrupted drafts) and batches equal plain decoding; the Gated DeltaNet
state committed after a verified chain or tree is bit for bit plain decoding's; what does not run on it
is refused in one line (hybrid draft models: tests/test_hybrid_draft.py)."""


import pytest
import torch

from helpers import (FAMILY_PROMPTS, ScriptedDrafter, assert_equals_transformers, assert_speculation_equals_plain,
                     copy_tokenizer_files, randomize_hybrid_weights, run, write_multimodal_checkpoint,
                     write_tiny_checkpoint)

from mtpctl.backends.torch import TorchEngine
from mtpctl.decode.tree import DraftTree
from mtpctl.errors import UnsupportedModel
from mtpctl.model.config import DecoderConfig
from mtpctl.model.decoder import Decoder

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen3_5")

#: three layers (Gated DeltaNet, gated full attention, Gated DeltaNet), grouped value heads, a rotary
#: embedding on a quarter of each 32-value head
TINY = dict(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
            layer_types=["linear_attention", "full_attention", "linear_attention"], tie_word_embeddings=False,
            bos_token_id=257, eos_token_id=258)
#: FAMILY_PROMPTS and one prompt longer than one chunk of the chunked prefill (64 tokens)
PROMPTS = FAMILY_PROMPTS + ([(7 * i) % 250 + 3 for i in range(70)],)
NEW = 32


def reference_model(seed: int = 0, scale: float = 1.5, **overrides):
    """transformers' tiny random Qwen3.5 text model, float32: matrices N(0, 1/sqrt(fan-in)) * 1.5, norm
    offsets N(0, 0.3), decays ``exp(g)`` spread over (0, 1)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    return randomize_hybrid_weights(Qwen3_5ForCausalLM(Qwen3_5TextConfig(**{**TINY, **overrides})).eval(), scale)


def _save(reference, folder, tokenizer):
    reference.save_pretrained(str(folder))
    return copy_tokenizer_files(tokenizer, folder)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (transformers' model, its checkpoint folder with the tiny tokenizer): ``plain`` and
    ``biased`` (attention_bias: q/k/v and o_proj biases)."""
    root = tmp_path_factory.mktemp("qwen3_5")
    tokenizer = write_tiny_checkpoint(root / "tokenizer")
    out = {}
    for name, overrides in (("plain", {}), ("biased", {"attention_bias": True})):
        reference = reference_model(**overrides)
        out[name] = (reference, _save(reference, root / name, tokenizer))
    return out


def test_the_checkpoint_reads_as_a_hybrid_body(checkpoints):
    cfg = DecoderConfig.from_folder(checkpoints["plain"][1])
    assert cfg.model_type == "qwen3_5_text" and cfg.rotary_dim == 8 and cfg.norm_offset == 1.0 and cfg.output_gate
    assert [cfg.deltanet.is_linear_layer(i) for i in range(3)] == [True, False, True]
    model = Decoder.from_folder(checkpoints["plain"][1])
    assert [layer.deltanet is not None for layer in model.layers] == [True, False, True]
    assert model.layers[0].qkv is None and model.layers[1].deltanet is None
    ref = checkpoints["plain"][0].model.layers
    assert torch.equal(model.layers[1].input_norm, 1 + ref[1].input_layernorm.weight)  # offset norms hold 1 + w
    assert torch.equal(model.layers[0].gated_norm_weight, ref[0].linear_attn.norm.weight)  # the gated one as it is
    assert model.layers[1].qkv.shape[0] == 2 * 4 * 32 + 2 * 2 * 32  # queries, their gates, keys, values
    cache = model.new_cache(8)  # KV slots for the one attention layer; a state for each Gated DeltaNet layer
    assert cache.k.shape[0] == 1 and model.layers[1].cache_index == 0 and sorted(cache.linear.committed) == [0, 2]
    assert cache.nbytes == 2 * cache.k.numel() * 4 + 2 * cfg.deltanet.state_bytes


@pytest.mark.parametrize("name", ["plain", "biased"])
def test_logits_and_greedy_tokens_equal_transformers_in_float32(checkpoints, name):
    reference, folder = checkpoints[name]
    prompts = PROMPTS if name == "plain" else PROMPTS[:1]
    assert_equals_transformers(reference, Decoder.from_folder(folder), folder, prompts, NEW)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prompt_lookup_scripted_drafts_and_batches_equal_plain_decoding(checkpoints, dtype):
    assert_speculation_equals_plain(checkpoints["plain"][1], dtype, PROMPTS, NEW)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prompt_lookup_that_drafts_alone_and_in_a_batch_equals_plain_decoding(checkpoints, dtype):
    """The random model's text rarely repeats a 2-gram, so prompt lookup matches single tokens here: it
    drafts (mostly rejected chains) at many steps."""
    import mtpctl
    from mtpctl.decode.session import GenerationRequest

    folder = checkpoints["plain"][1]
    plain = mtpctl.load(str(folder), speculate="none", dtype=dtype, threads=1)
    ngram = mtpctl.load(str(folder), speculate="ngram", dtype=dtype, speculate_policy="always", threads=1,
                        ngram_min=1, draft_len=4)
    expected = [plain.pipeline.generate(list(p), NEW).token_ids for p in PROMPTS]
    results = [ngram.pipeline.generate(list(p), NEW) for p in PROMPTS]
    assert [r.token_ids for r in results] == expected
    assert sum(r.stats.draft_tokens for r in results) > 20
    batch = ngram.generate_batch([GenerationRequest(list(p), NEW) for p in PROMPTS], max_batch=len(PROMPTS))
    assert [r.token_ids for r in batch] == expected and sum(r.stats.draft_tokens for r in batch) > 20


def test_suffix_decoding_equals_plain_decoding(checkpoints):
    import mtpctl

    folder = checkpoints["plain"][1]
    plain = mtpctl.load(str(folder), speculate="none", dtype="float32", threads=1)
    suffix = mtpctl.load(str(folder), speculate="suffix", dtype="float32", speculate_policy="always", threads=1)
    drafted = 0
    for prompt in PROMPTS:
        expected = plain.pipeline.generate(list(prompt), NEW).token_ids
        got = suffix.pipeline.generate(list(prompt), NEW)
        assert got.token_ids == expected
        drafted += got.stats.draft_tokens
    assert drafted > 0  # the responses served before give it something to draft


def _plain_engine(model, prompt, tokens):
    engine = TorchEngine(model, len(prompt) + len(tokens) + 8)
    engine.prefill(list(prompt))
    for t in tokens:
        engine.verify(DraftTree(t))
        engine.commit([0])
    return engine


def _same_states(a: TorchEngine, b: TorchEngine) -> bool:
    la, lb = a.cache.linear, b.cache.linear
    return set(la.committed) == set(lb.committed) and all(la.committed[i].equal(lb.committed[i]) for i in la.committed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_committed_chain_or_tree_path_holds_plain_decodings_state_bit_for_bit(checkpoints, dtype):
    model = Decoder.from_folder(checkpoints["plain"][1], dtype=dtype, blocked=True)  # as a session loads it
    prompt = list(PROMPTS[0])
    # a tree: root 11, children 22 (node 1) and 33 (node 2); 44 under 33 (node 3), 55 under 22 (node 4)
    tree = DraftTree.from_parents([11, 22, 33, 44, 55], [-1, 0, 0, 2, 1])
    for path, tokens in (([0, 2, 3], [11, 33, 44]), ([0, 1, 4], [11, 22, 55]), ([0], [11])):
        engine = TorchEngine(model, 64)
        engine.prefill(prompt)
        out = engine.verify(tree)
        engine.commit(path)
        plain = _plain_engine(model, prompt, tokens[:-1])
        expected = plain.verify(DraftTree(tokens[-1]))
        plain.commit([0])
        assert torch.equal(out[path[-1]], expected[0])
        assert _same_states(engine, plain)
        assert not _same_states(engine, _plain_engine(model, prompt, tokens[:-1]))  # the path's last token counts
        after, again = engine.verify(DraftTree(7)), plain.verify(DraftTree(7))
        assert torch.equal(after[0], again[0])
    chain = TorchEngine(model, 64)
    chain.prefill(prompt)
    chain.verify(DraftTree.chain([11, 22, 33, 44]))
    chain.commit([0, 1])  # two of four accepted: the state after the second
    assert _same_states(chain, _plain_engine(model, prompt, [11, 22]))


def test_a_scripted_drafter_on_bfloat16_equals_plain(checkpoints):
    model = Decoder.from_folder(checkpoints["plain"][1], dtype=torch.bfloat16, blocked=True)
    prompt = list(PROMPTS[3])
    alone = run(model, max_new=NEW, prompt=prompt)
    for corrupt in (0, 2):
        drafter = ScriptedDrafter(len(prompt), alone.token_ids, model.cfg.vocab_size, corrupt_every=corrupt)
        assert run(model, drafter, max_new=NEW, prompt=prompt).token_ids == alone.token_ids


def test_what_does_not_run_on_it_is_refused_in_one_line(checkpoints):
    import mtpctl

    folder = checkpoints["plain"][1]
    model = Decoder.from_folder(folder)
    engine = TorchEngine(model, 64)
    engine.prefill(list(PROMPTS[0]))
    engine.verify(DraftTree(5))
    engine.commit([0])
    with pytest.raises(UnsupportedModel) as caught:  # a target's Gated DeltaNet states keep no history
        engine.rollback(engine.length - 1)
    assert "cannot roll a Gated DeltaNet state back" in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(UnsupportedModel) as caught:
        mtpctl.load(str(folder), speculate="lookahead", dtype="float32", threads=1)
    assert "lookahead" in str(caught.value) and "\n" not in str(caught.value)
    cache = model.new_cache(16, batch=2)  # teacher-forced batches of several sequences
    with pytest.raises(UnsupportedModel, match="one sequence a pass"):
        model(torch.zeros(2, 3, dtype=torch.long), torch.arange(3).expand(2, 3), cache,
              {None: torch.ones(2, 1, 3, 16, dtype=torch.bool)})


def test_the_per_node_states_of_draft_trees_are_reported(checkpoints):
    import mtpctl
    from mtpctl.model.gated_deltanet import tree_state_bytes

    folder = checkpoints["plain"][1]
    cfg = DecoderConfig.from_folder(folder)
    ngram = mtpctl.load(str(folder), speculate="ngram", dtype="float32", speculate_policy="always", threads=1,
                        ngram_min=1, draft_len=4)
    stats = ngram.pipeline.generate(list(PROMPTS[3]), NEW).stats
    nodes = 1 + max(stats.drafted_per_step)
    assert max(stats.drafted_per_step) > 0
    assert stats.draft_state_bytes_max == 2 * tree_state_bytes(cfg.deltanet, nodes)  # two Gated DeltaNet layers
    assert stats.to_dict()["draft_state_bytes_max"] == stats.draft_state_bytes_max  # in --json's stats
    plain = mtpctl.load(str(folder), speculate="none", dtype="float32", threads=1)
    assert plain.pipeline.generate(list(PROMPTS[1]), 4).stats.draft_state_bytes_max == 2 * cfg.deltanet.state_bytes


def test_medusa_draft_trees_equal_plain_decoding(checkpoints):
    """Trees through the decoding loop: random Medusa heads fill a tree with branches at several depths;
    each step commits a path that need not be a prefix of the nodes."""
    from helpers import TREES, random_heads

    from mtpctl.drafters.heads.medusa import MedusaDrafter
    from mtpctl.drafters.heads.tree import StaticTree

    model = Decoder.from_folder(checkpoints["plain"][1], blocked=True)
    heads = random_heads(model, num_heads=4)
    prompt = list(PROMPTS[2])
    alone = run(model, max_new=NEW, prompt=prompt)
    for shape in ("mixed", "deep-second"):
        drafter = MedusaDrafter(StaticTree.from_paths(TREES[shape], 4), heads, model)
        got = run(model, drafter, max_new=NEW, prompt=prompt)
        assert got.token_ids == alone.token_ids and got.stats.draft_tokens > 0



def test_an_eagle_layers_draft_trees_equal_plain_decoding(checkpoints):
    """The EAGLE layer reads the target's hidden states of the committed rows: a hybrid body's are as any."""
    from helpers import TREES, random_eagle

    from mtpctl.drafters.heads.eagle import EagleDrafter
    from mtpctl.drafters.heads.tree import StaticTree

    model = Decoder.from_folder(checkpoints["plain"][1], blocked=True)
    head = random_eagle(model)
    prompt = list(PROMPTS[1])
    alone = run(model, max_new=NEW, prompt=prompt)
    drafter = EagleDrafter(head, StaticTree.from_paths(TREES["mixed"], head.cfg.num_heads),
                           lambda ids: model.embed[ids], model.logits)
    got = run(model, drafter, max_new=NEW, prompt=prompt)
    assert got.token_ids == alone.token_ids and got.stats.draft_tokens > 0


def test_the_cli_refuses_lookahead_on_it_in_one_line(checkpoints, capsys):
    from helpers import assert_one_line_exit_2, cli

    folder = checkpoints["plain"][1]
    code, out, err = cli(capsys, "generate", "-m", folder, "--no-chat", "--max-new-tokens", 4, "--speculate", "lookahead",
                         "abc")
    assert_one_line_exit_2(code, out, err, "lookahead")


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
def test_add_heads_trains_on_the_hybrid_body_one_sequence_a_pass(checkpoints, tmp_path, kind):
    """add-heads self-distils and runs teacher-forced passes one sequence at a time on a body with Gated
    DeltaNet layers (a recurrent state per sequence, no padding); the trained heads then decode as
    plain greedy does, alone and with prompt lookup merged in."""
    import json

    import mtpctl
    from mtpctl.train.add_heads import add_heads
    from mtpctl.train.settings import TrainSettings

    folder = checkpoints["plain"][1]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"count: {i} {i + 1} {i + 2}"}) + "\n" for i in range(12)))
    settings = TrainSettings(kind=kind, num_heads=2, self_distill=True, response_tokens=12, epochs=1, batch_tokens=64,
                             tree_nodes=4, lr=3e-3, measure_prompts=0)
    summary = add_heads(folder, "tiny-qwen3_5", [data], tmp_path / "heads", settings, tmp_path / "home")
    assert summary["settings"]["distill_batch"] == 1 and summary["positions"] > 0
    if kind == "eagle3":  # exported for vLLM with the target's own architecture as its verifier
        from mtpctl.export.serving import export_serving_heads

        export_serving_heads("speculators", folder, tmp_path / "heads", tmp_path / "spec")
        verifier = json.loads((tmp_path / "spec" / "config.json").read_text())["speculators_config"]["verifier"]
        assert verifier["architectures"] == ["Qwen3_5ForCausalLM"]
    plain = mtpctl.load(str(folder), speculate="none", threads=1)
    for speculate in ("heads", "heads+ngram"):
        heads = mtpctl.load(str(folder), speculate=speculate, heads=str(tmp_path / "heads"), threads=1,
                            speculate_policy="always")
        for prompt in PROMPTS[:2]:
            assert heads.pipeline.generate(list(prompt), NEW).token_ids == plain.pipeline.generate(list(prompt), NEW).token_ids


@pytest.fixture(scope="module")
def multimodal(checkpoints, tmp_path_factory):
    """The plain checkpoint's text body inside transformers' multimodal ``Qwen3_5ForConditionalGeneration``
    (a tiny vision tower; config ``qwen3_5`` with ``text_config``), saved by transformers, plus an
    ``mtp.*`` tensor as released checkpoints carry."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    reference, text_folder = checkpoints["plain"]
    folder = tmp_path_factory.mktemp("qwen3_5_multimodal")
    write_multimodal_checkpoint(reference, Qwen3_5Config, Qwen3_5ForConditionalGeneration, folder, text_folder)
    return folder


def test_the_multimodal_checkpoint_reads_as_its_text_body(checkpoints, multimodal):
    text = Decoder.from_folder(checkpoints["plain"][1], blocked=True)
    ours = Decoder.from_folder(multimodal, blocked=True)
    assert ours.cfg.model_type == "qwen3_5" and ours.cfg.deltanet == text.cfg.deltanet
    for prompt in PROMPTS[:2]:
        a = TorchEngine(text, 32).verify(DraftTree.chain(list(prompt))).logits
        b = TorchEngine(ours, 32).verify(DraftTree.chain(list(prompt))).logits
        assert torch.equal(a, b)
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(multimodal)).eval()  # Qwen3_5ForCausalLM
    assert_equals_transformers(reference, Decoder.from_folder(multimodal), multimodal, PROMPTS[:1], NEW)


def test_the_pure_torch_path_and_prefill_in_passes_equal_plain_decoding(checkpoints, monkeypatch):
    """kernels="torch": prefill through the masked path (a KVCache, not a pass of slots), passes on
    torch's ops; and native prefill split into passes of 16 tokens (the state carried across them)."""
    import mtpctl
    from mtpctl.backends import torch as torch_backend

    folder = checkpoints["plain"][1]
    prompt = list(PROMPTS[3])
    native = mtpctl.load(str(folder), speculate="none", dtype="float32", threads=1).pipeline.generate(prompt, NEW)
    plain = mtpctl.load(str(folder), speculate="none", dtype="float32", threads=1, kernels="torch")
    ngram = mtpctl.load(str(folder), speculate="ngram", dtype="float32", threads=1, kernels="torch",
                        speculate_policy="always", ngram_min=1)
    expected = plain.pipeline.generate(prompt, NEW).token_ids
    got = ngram.pipeline.generate(prompt, NEW)
    assert got.token_ids == expected == native.token_ids and got.stats.draft_tokens > 0
    model = Decoder.from_folder(folder, blocked=True)
    whole = TorchEngine(model, 128)
    first = whole.prefill(prompt).logits[-1]
    monkeypatch.setattr(torch_backend, "PREFILL_CHUNK", 16)
    parts = TorchEngine(model, 128)
    assert parts.native and (parts.prefill(prompt).logits[-1] - first).abs().max() < 1e-4 and parts.length == 70
    for i in (0, 2):  # 64-token chunks in one pass, or 16-token passes: the same state to float32 rounding
        a, b = whole.cache.linear.state(i), parts.cache.linear.state(i)
        assert torch.equal(a.conv, b.conv) if i == 0 else (a.conv - b.conv).abs().max() < 1e-4 * a.conv.abs().max()
        assert (a.recurrent - b.recurrent).abs().max() < 1e-4 * a.recurrent.abs().max()


def test_the_gated_deltanet_projections_are_held_on_the_dense_linears_path(checkpoints):
    """Loaded for decoding (``blocked``), a Gated DeltaNet layer's in_proj and out_proj are held once, on
    the path the other dense linears take here (bfloat16: the native tiles where they build), with the
    checkpoint's values; a chain through the held weights gives every token the bits it gets alone; the
    pure-torch path holds them in fixed row blocks."""
    from mtpctl.model.gated_deltanet import LinearState, deltanet_step
    from mtpctl.model.linears import FixedRowsLinear
    from mtpctl.model.row_invariance import dense_path, path_of

    folder = checkpoints["plain"][1]
    for dtype in (torch.float32, torch.bfloat16):
        held, plain = Decoder.from_folder(folder, dtype=dtype, blocked=True), Decoder.from_folder(folder, dtype=dtype)
        for i in (0, 2):
            for name in ("in_proj", "out_proj"):
                weight = getattr(plain.layers[i], name)
                linear = getattr(held.layers[i], name)
                assert path_of(linear) == dense_path(dtype, tuple(weight.shape)), (dtype, i, name)
                assert torch.equal(linear.dense(), weight)
        if dtype == torch.bfloat16:
            layer = held.layers[0]
            weights, cfg = layer.deltanet_weights(), layer.deltanet
            torch.manual_seed(5)
            x = (torch.randn(9, cfg.hidden_size) * torch.tensor([0.01, 1.0, 30.0])[torch.randint(3, (9, 1))]).to(dtype)
            start = deltanet_step(x[:3], weights, cfg, LinearState.zeros(cfg)).state
            for k in (2, 4, 6):
                chain = deltanet_step(x[3:3 + k], weights, cfg, start, keep_every_position=True)
                state = start
                for t in range(k):
                    one = deltanet_step(x[3 + t:4 + t], weights, cfg, state)
                    state = one.state
                    assert torch.equal(one.out[0], chain.out[t]) and state.equal(chain.positions[t]), (k, t)
    plain.hold_fixed_rows(64)  # the pure-torch path (a GPU's row blocks)
    assert all(isinstance(getattr(plain.layers[i], n), FixedRowsLinear) and getattr(plain.layers[i], n).rows == 64
               for i in (0, 2) for n in ("in_proj", "out_proj"))


def test_the_hybrid_body_on_a_virtual_gpu_mixes_no_host_tensor_and_syncs_nowhere_in_a_layer(checkpoints):
    """The pure-torch path on a (virtual) CUDA device: Gated DeltaNet projections in the placement's fixed
    row blocks; greedy prompt lookup equals plain decoding."""
    from virtual_cuda import virtual_cuda

    from mtpctl.backends.torch import TorchSession
    from mtpctl.model.linears import FixedRowsLinear

    folder, prompt = checkpoints["plain"][1], list(PROMPTS[3])
    with virtual_cuda() as mode:
        session = TorchSession(folder, "float32", device="cuda", kernels="torch")
        mode.events.clear()
        plain = session.generate(prompt, 8).token_ids
        drafter = ScriptedDrafter(len(prompt), plain, session.vocab_size, corrupt_every=3, budget=4)
        got = session.generate(prompt, 8, drafter=drafter)
    bad = [e for e in mode.events if e.kind == "mixup"
           or (e.kind == "sync" and ("decoder.py" in e.site or "gated_deltanet.py" in e.site))]
    assert not bad, bad
    assert got.token_ids == plain and len(plain) == 8 and got.stats.accepted_tokens > 0
    layer = session.model.layers[0]
    assert isinstance(layer.in_proj, FixedRowsLinear) and layer.in_proj.rows == layer.out_proj.rows == 64
