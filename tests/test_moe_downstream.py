"""Everything after loading, on a Mixture-of-Experts target: a tiny Qwen3-MoE checkpoint (one dense layer
among two MoE ones) written by transformers' own classes (:func:`helpers.write_moe_checkpoints`).

Every drafter (prompt lookup, suffix decoding, retrieval, lookahead, a draft model with the same
tokenizer: the tiny dense Llama, the target's own layers, Medusa and EAGLE-3 heads trained here) gives
plain greedy decoding's tokens, and the deterministic ones seeded sampling's too; add-heads trains on
the MoE target's hidden states (self-distillation's kept features equal a teacher-forced pass);
``export --format`` names the MoE verifier's architecture; the auto policy measures a table for the
MoE target's shape rather than read the dense shipped one; ``bench`` runs on it. vLLM serving EAGLE-3
heads trained on a Qwen3-MoE target: tests/test_vllm_moe_eagle3.py."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import assert_distilled_features_match, cli, write_moe_checkpoints, write_tiny_checkpoint

from mtpctl.decode.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

PROMPTS = ([100, 101, 102, 100, 101, 102, 100, 101, 102, 5, 6], [5, 77, 200, 31, 9, 5, 77, 200])
NEW = 24
SEEDED = SamplingParams(temperature=0.9, seed=5)
#: add-heads on a few prompts, a few steps (tests/test_heads_training.py's SMALL)
SMALL = dict(num_heads=2, self_distill=True, response_tokens=16, epochs=2, batch_tokens=64, tree_nodes=4, lr=3e-3,
             measure_prompts=0)


@pytest.fixture(scope="module", autouse=True)
def own_home(tmp_path_factory):
    """$MTPCTL_HOME of this module's own (the self-draft's layer choice, suffix caches, tables)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MTPCTL_HOME", str(tmp_path_factory.mktemp("moe-home")))
        yield


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """(the Qwen3-MoE checkpoint, the tiny dense Llama of the same tokenizer, a retrieval datastore from the
    target's own greedy answers, a scratch folder)."""
    import mtpctl
    from mtpctl.drafters.retrieval import Datastore

    root = tmp_path_factory.mktemp("moe-downstream")
    dense = write_tiny_checkpoint(root / "dense")
    target = write_moe_checkpoints(root, "qwen3_moe", tokenizer=dense)["per_expert"]
    plain = mtpctl.load(str(target), speculate="none", dtype="float32", threads=1)
    answers = [list(p) + plain.pipeline.generate(list(p), NEW).token_ids for p in PROMPTS]
    datastore = root / "datastore.bin"
    Datastore.from_sequences(answers, key_len=6).save(datastore, 259)
    return target, dense, datastore, root


@pytest.fixture(scope="module")
def plain_runs(moe):
    """dtype -> (greedy tokens, seeded sampled tokens) of each prompt without a drafter."""
    import mtpctl

    out = {}
    for dtype in ("float32", "bfloat16"):
        llm = mtpctl.load(str(moe[0]), speculate="none", dtype=dtype, threads=1)
        out[dtype] = ([llm.pipeline.generate(list(p), NEW).token_ids for p in PROMPTS],
                      [llm.pipeline.generate(list(p), NEW, SEEDED).token_ids for p in PROMPTS])
    return out


def decode(folder, dtype, speculate, **settings):
    """(greedy tokens, seeded sampled tokens, draft tokens accepted in all) of each prompt."""
    import mtpctl

    llm = mtpctl.load(str(folder), speculate=speculate, dtype=dtype, threads=1, speculate_policy="always",
                      sampling=SEEDED, **settings)
    greedy = [llm.pipeline.generate(list(p), NEW) for p in PROMPTS]
    sampled = [llm.pipeline.generate(list(p), NEW, SEEDED) for p in PROMPTS]
    return ([r.token_ids for r in greedy], [r.token_ids for r in sampled],
            sum(r.stats.accepted_tokens for r in greedy + sampled))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("speculate", ["ngram", "suffix", "retrieval", "lookahead", "draft", "self", "ngram+retrieval"])
def test_every_drafter_gives_plain_greedy_and_seeded_tokens(moe, plain_runs, speculate, dtype):
    target, dense, datastore, _ = moe
    settings = {"retrieval": {"datastore": str(datastore)}, "ngram+retrieval": {"datastore": str(datastore)},
                "draft": {"draft_model": str(dense)}, "self": {"draft_model": "self:0,2"}}.get(speculate, {})
    greedy, sampled, accepted = decode(target, dtype, "draft" if speculate == "self" else speculate, **settings)
    assert greedy == plain_runs[dtype][0]
    if speculate not in ("draft", "self"):  # a draft model samples its chain: lossless, its tokens its draws
        assert sampled == plain_runs[dtype][1]
    if speculate in ("retrieval", "ngram+retrieval"):  # the datastore holds these very answers
        assert accepted > 0


@pytest.fixture(scope="module")
def trained(moe):
    """kind -> a head folder add-heads trained on the MoE target (self-distilled, a few steps)."""
    from mtpctl.train.add_heads import add_heads
    from mtpctl.train.settings import TrainSettings

    target, _, _, root = moe
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"count: {i} {i + 1} {i + 2}"}) + "\n" for i in range(24)))
    out = {}
    for kind in ("medusa", "eagle3"):
        summary = add_heads(target, "tiny-moe", [data], root / kind, TrainSettings(kind=kind, **SMALL), root / "home")
        assert all(torch.isfinite(torch.tensor(h["loss"])) for h in summary["history"])
        out[kind] = root / kind
    return out


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["medusa", "eagle3"])
def test_heads_trained_on_the_moe_target_decode_as_plain(moe, trained, plain_runs, kind, dtype):
    from mtpctl.drafters.heads.config import HeadsConfig
    from mtpctl.model.weights import weights_hash

    cfg = HeadsConfig.load(trained[kind])
    assert cfg.kind == kind and cfg.target_hash == weights_hash(moe[0]) and cfg.hidden_size == 64
    if kind == "eagle3":  # the layer's shapes are the target's attention and its dense MLP
        assert cfg.layer.intermediate_size == 96 and len(cfg.layer.aux_layers) == 3
    drafted = 0
    for speculate in ("heads", "heads+ngram"):
        greedy, sampled, accepted = decode(moe[0], dtype, speculate, heads=str(trained[kind]))
        assert greedy == plain_runs[dtype][0] and sampled == plain_runs[dtype][1]
        drafted += accepted
    assert drafted > 0
    if dtype == "float32":  # the same weights stacked are other files: another weight hash, refused
        import mtpctl
        from mtpctl.errors import BadInput

        with pytest.raises(BadInput, match="trained on another model"):
            mtpctl.load(str(moe[0].parent / "stacked"), speculate="heads", heads=str(trained[kind]), threads=1)


@pytest.mark.slow
def test_batches_with_heads_and_draft_models_equal_plain(moe, trained, plain_runs):
    """A batch of every prompt at once: EAGLE-3 heads, Medusa heads with the dense draft model's chain
    grafted, the self-draft's measured layer search; and the MoE model as the draft of the dense one."""
    import mtpctl
    from mtpctl.decode.session import GenerationRequest

    target, dense = moe[0], moe[1]
    requests = [GenerationRequest(list(p), NEW) for p in PROMPTS]
    for speculate, settings in (("heads", {"heads": str(trained["eagle3"])}),
                                ("heads+draft", {"heads": str(trained["medusa"]), "draft_model": str(dense)}),
                                ("draft", {"draft_model": "self"})):
        llm = mtpctl.load(str(target), speculate=speculate, dtype="float32", threads=1, **settings)
        assert [r.token_ids for r in llm.generate_batch(requests, max_batch=len(PROMPTS))] == plain_runs["float32"][0]
    plain = mtpctl.load(str(dense), speculate="none", dtype="float32", threads=1)
    paired = mtpctl.load(str(dense), speculate="draft", draft_model=str(target), dtype="float32", threads=1)
    assert [r.token_ids for r in paired.generate_batch(requests, max_batch=len(PROMPTS))] == \
        [plain.pipeline.generate(list(p), NEW).token_ids for p in PROMPTS]


def test_pair_finds_the_dense_draft_compatible(moe, capsys):
    code, out, err = cli(capsys, "pair", moe[0], moe[1])
    assert code == 0, err
    assert "same tokens at the same ids" in out


def test_self_distillation_features_equal_a_teacher_forced_pass_of_the_moe_target(moe):
    """The hidden states, EAGLE-3 layer streams and argmax tokens add-heads trains on, kept from batched
    self-distillation over MoE layers, equal one teacher-forced pass over each finished sequence, and
    the decoding engine's hidden states."""
    from mtpctl.model.decoder import Decoder

    assert_distilled_features_match(Decoder.from_folder(moe[0]))


@pytest.mark.parametrize("fmt", ["speculators", "eagle", "vllm"])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_export_names_the_moe_verifier(model_type, fmt, moe, tmp_path):
    """EAGLE-3 heads of a MoE target export with the target's own architecture as the verifier (from
    config.json, or its family's where config.json names none); the draft layer stays a dense Llama
    layer of the target's attention shapes."""
    from test_serving_formats import eagle3_heads

    from mtpctl.export.serving import export_serving_heads
    from mtpctl.model.decoder import Decoder
    from mtpctl.model.families import FAMILIES

    target = write_moe_checkpoints(tmp_path, model_type, tokenizer=moe[1])["stacked"]
    architecture = FAMILIES[model_type].architecture
    assert json.loads((target / "config.json").read_text())["architectures"] == [architecture]
    heads = eagle3_heads(tmp_path / "h", target, Decoder.from_folder(target))
    config = export_serving_heads(fmt, target, heads, tmp_path / "out")
    if fmt == "eagle":  # EAGLE's own layout names no verifier
        assert config["architectures"] == ["LlamaForCausalLMEagle3"]
        return
    assert config["speculators_config"]["verifier"]["architectures"] == [architecture]
    assert config["transformer_layer_config"]["architectures"] == ["LlamaForCausalLM"]
    raw = json.loads((target / "config.json").read_text())
    del raw["architectures"]  # a hand-written config.json: the family's causal LM stands in
    (target / "config.json").write_text(json.dumps(raw))
    config = export_serving_heads(fmt, target, heads, tmp_path / "out2")
    assert config["speculators_config"]["verifier"]["architectures"] == [architecture]


def test_the_moe_identity_never_takes_the_dense_shipped_table(moe, monkeypatch, tmp_path):
    """The auto policy's table is keyed by the model's cost identity: the MoE target's counts its
    experts, so a MoE model of the shipped dense model's shape still measures its own table (or, with
    measuring off, borrows the shipped one, saying so), and its cache is its own."""
    from mtpctl.decode import cost_table
    from mtpctl.decode.cost_table import SWITCH, choose_table, model_identity, read_source
    from mtpctl.decode.policy import COSTS_FILE, PassCosts
    from mtpctl.model.config import DecoderConfig

    monkeypatch.setenv("MTPCTL_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(SWITCH, raising=False)
    monkeypatch.setattr(cost_table, "costs_file", lambda: COSTS_FILE)
    shipped = read_source(COSTS_FILE)
    monkeypatch.setattr(cost_table, "cpu_class", lambda: cost_table.class_of(shipped))
    dense = {k: v for k, v in shipped["model"].items() if k != "name"}
    moe_identity = model_identity(DecoderConfig.from_folder(moe[0]))
    assert {"experts", "experts_per_token", "expert_intermediate_size", "moe_layers"} <= set(moe_identity)
    assert not set(moe_identity) - {"experts", "experts_per_token", "expert_intermediate_size", "moe_layers"} \
        - set(dense) - {"model_type"}
    as_dense = {**moe_identity, **dense}  # the shipped model's shape, plus experts
    assert choose_table(dense, "int4", measure=lambda: pytest.fail("measured the shipped model")).source == "shipped"
    costs = PassCosts((1, 2), (1.0, 2.0), (2,), ((0.5,), (0.7,)))
    for identity in (as_dense, moe_identity):
        monkeypatch.setenv(SWITCH, "off")
        borrowed = choose_table(identity, "int4", measure=lambda: pytest.fail("measured with measuring off"))
        assert borrowed.source == "borrowed" and borrowed.model["name"] == shipped["model"]["name"]
        monkeypatch.delenv(SWITCH)
        measured = choose_table(identity, "int4", measure=lambda: costs)
        assert measured.source == "measured-on-first-use" and measured.costs == costs
        assert measured.model["experts"] == moe_identity["experts"] and measured.path.is_file()
    assert choose_table(moe_identity, "int4", measure=lambda: pytest.fail("measured again")).source == "cached"


@pytest.mark.slow
def test_bench_runs_on_the_moe_target_and_measures_its_own_table(moe, tmp_path, capsys, monkeypatch):
    from mtpctl.decode.cost_table import SWITCH

    monkeypatch.setenv("MTPCTL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv(SWITCH, raising=False)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"category": "copy", "prompt": "abc abc abc abc"}) + "\n")
    code, out, err = cli(capsys, "bench", "--model", moe[0], "--prompts", prompts, "--max-new-tokens", 6,
                         "--repeats", 1, "--methods", "plain,ngram", "--json", tmp_path / "b.json")
    assert code == 0, err
    report = json.loads((tmp_path / "b.json").read_text())
    settings = report.get("settings", report)
    assert [m["method"] for m in report["methods"]] == ["plain", "ngram"]
    assert report["methods"][1]["same_as_plain"] == 1
    table = settings["policy_table"]
    if table is not None:  # the torch kernels read no table
        assert table["source"] in ("measured-on-first-use", "cached")
        assert table["model"]["model_type"] == "qwen3_moe" and table["model"]["experts"] == 8
