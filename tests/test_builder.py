"""One way in: the library (mtpctl.load), ``mtpctl generate``, ``mtpctl bench`` and the benchmark's
methods assemble their pipeline with one builder (mtpctl.drafters.pipeline) and one set of defaults,
so the same settings give the same tokens and the same speculation policy's decisions."""

import inspect
import json

import pytest

import mtpctl
from helpers import cli
from mtpctl.api import LLM
from mtpctl.bench.methods import build_methods
from mtpctl.cli.bench import bench_cmd
from mtpctl.cli.generate import generate_cmd
from mtpctl.cli.options import SPEC_OPTIONS
from mtpctl.decode.policy import AlwaysDraft, CostModelPolicy
from mtpctl.decode.sampling import SamplingParams
from mtpctl.decode.session import GenerationRequest
from mtpctl.drafters.build import DraftOptions
from mtpctl.drafters.pipeline import DEFAULTS, PipelineSpec, assemble
from mtpctl.errors import BadInput

PROMPT = "Repeat this twice: the cat sat on the mat, the cat sat on the mat."
SAMPLING = ("temperature", "top_k", "top_p", "seed")


def library_and_cli(capsys, *args, **settings):
    """The library's result and ``generate --json``'s for the same settings (``args``: the CLI's flags,
    ``settings``: the same for :func:`mtpctl.load`), 24 new tokens after :data:`PROMPT`."""
    llm = mtpctl.load(**settings)
    result = llm.generate(PROMPT, max_new_tokens=24)
    code, out, err = cli(capsys, "generate", *args, "--max-new-tokens", 24, "--json", PROMPT)
    assert code == 0, err
    return llm, result, json.loads(out)


def assert_same_run(result, reply):
    """Same tokens, same draft size every step (the policy's decisions), same accepted lengths."""
    assert result.token_ids == reply["token_ids"]
    assert result.stats.drafted_per_step == reply["stats"]["drafted_per_step"]
    assert result.stats.accepted_per_step == reply["stats"]["accepted_per_step"]


def test_the_library_and_the_cli_decode_alike_with_their_defaults(capsys, tiny_folder):
    folder = str(tiny_folder)
    llm, result, reply = library_and_cli(capsys, "-m", folder, "--speculate", "ngram", model=folder,
                                         speculate="ngram")
    assert_same_run(result, reply)
    assert reply["speculate_policy"] == llm.pipeline.spec.speculate_policy == "auto"
    expected = CostModelPolicy if llm.session.policy_mode is not None else AlwaysDraft
    assert isinstance(llm.pipeline.new_policy(), expected)
    assert reply["speculate"] == llm.speculate == "ngram"


def test_the_library_and_the_cli_decode_alike_with_the_always_policy(capsys, tiny_folder):
    folder = str(tiny_folder)
    llm, result, reply = library_and_cli(capsys, "-m", folder, "--speculate", "ngram", "--speculate-policy", "always",
                                         "--draft-len", 4, model=folder, speculate="ngram", speculate_policy="always",
                                         draft_len=4)
    assert_same_run(result, reply)
    assert isinstance(llm.pipeline.new_policy(), AlwaysDraft) and reply["speculate_policy"] == "always"


def test_the_librarys_batch_decodes_as_generate_batch_file(capsys, tiny_folder, tmp_path):
    folder, prompts = str(tiny_folder), ["abcabcabc abcabc", "one two one two one", PROMPT]
    batch = tmp_path / "requests.jsonl"
    batch.write_text("".join(json.dumps({"prompt": p, "max_new_tokens": 16}) + "\n" for p in prompts))
    llm = mtpctl.load(folder, speculate="ngram")
    outcomes = llm.generate_batch([GenerationRequest(llm.encode(p), 16) for p in prompts], max_batch=2)
    code, out, err = cli(capsys, "generate", "-m", folder, "--speculate", "ngram", "--batch-file", batch,
                         "--max-batch", 2)
    assert code == 0, err
    replies = [json.loads(line) for line in out.splitlines()]
    assert len(replies) == len(outcomes) == 3
    for outcome, reply in zip(outcomes, replies):
        assert_same_run(outcome, reply)


def test_a_benchmark_method_decodes_as_the_library(tiny_folder):
    llm = mtpctl.load(str(tiny_folder), speculate="ngram")
    ids = llm.encode(PROMPT)
    methods = build_methods(llm.session, ["plain", "ngram"], PipelineSpec(model=str(tiny_folder)), SamplingParams(), 24)
    assert methods["ngram"].pipeline.spec == llm.pipeline.spec
    bench, alone = methods["ngram"].run(ids), llm.generate(ids, max_new_tokens=24)
    assert bench.token_ids == alone.token_ids
    assert bench.stats.drafted_per_step == alone.stats.drafted_per_step
    assert methods["plain"].drafter is None and methods["plain"].pipeline.speculate == "none"


@pytest.mark.real
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("policy", ["auto", "always"])
def test_the_library_and_the_cli_decode_alike_on_the_real_smollm2(capsys, smollm2_folder, dtype, policy):
    llm, result, reply = library_and_cli(capsys, "--speculate", "ngram", "--dtype", dtype, "--speculate-policy", policy,
                                         speculate="ngram", dtype=dtype, speculate_policy=policy)
    assert_same_run(result, reply)
    assert reply["speculate_policy"] == llm.pipeline.spec.speculate_policy == policy
    if policy == "always":  # auto may not draft at all where this CPU's pass costs price rows dear (the AVX2 path)
        assert sum(result.stats.drafted_per_step) > 0


def test_the_cli_options_default_to_the_builders_defaults():
    draft = {name: getattr(DEFAULTS.draft, name) for name in DraftOptions.__dataclass_fields__}
    sampling = {name: getattr(SamplingParams(), name) for name in SAMPLING}
    for command in (generate_cmd, bench_cmd):
        params = {p.name: p for p in command.params}
        assert set(SPEC_OPTIONS) <= set(params) and "speculate_policy" in params
        for name in SPEC_OPTIONS:
            assert params[name].default == getattr(DEFAULTS, name), (command.name, name)
        for name, value in draft.items():
            if name in params:
                assert params[name].default == value, (command.name, name)
        for name, value in sampling.items():
            assert params[name].default == value, (command.name, name)
    assert {p.name: p for p in generate_cmd.params}["speculate"].default == DEFAULTS.speculate


def test_the_librarys_signatures_default_to_the_builders_defaults():
    load = inspect.signature(mtpctl.load).parameters
    for name in SPEC_OPTIONS + ("speculate",):
        assert load[name].default == getattr(DEFAULTS, name), name
    assert load["heads"].default == DEFAULTS.draft.heads_dir
    generate = inspect.signature(LLM.generate).parameters
    for name in SAMPLING:
        assert generate[name].default == getattr(SamplingParams(), name), name
    assert DEFAULTS.speculate_policy == "auto" and DEFAULTS.acceptance == "exact"


@pytest.mark.parametrize("setting, value", [("speculate_policy", "sometimes"), ("acceptance", "lossy"),
                                            ("backend", "abacus"), ("speculate", "ngram+mystery")])
def test_bad_settings_are_refused_before_any_model_loads(setting, value):
    spec = PipelineSpec(**{"model": "/no/such/model", setting: value})
    with pytest.raises(BadInput) as err:
        assemble(spec)
    assert err.value.option == setting
