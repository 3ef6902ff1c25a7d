"""Which pass-cost table the auto policy reads: the shipped tables' sources, a table measured on first
use for a model without one (cached under $MTPCTL_HOME), borrowing with measuring off, a damaged
cache refused, --json's policy_table, and greedy tokens whatever the table; the drafter's own cost
measured on first use beside a table measured here, or read from a shipped one."""

import dataclasses
import json

import pytest

from mtpctl.cli.main import main
from mtpctl.decode import cost_table
from mtpctl.decode.cost_table import SWITCH, cache_path, choose_table, read_source, with_draft_cost
from mtpctl.decode.policy import COSTS_FILE, DraftCost, PassCosts, load_costs, load_draft_cost
from mtpctl.drafters.pipeline import PipelineSpec, assemble
from mtpctl.errors import BadInput

SHIPPED = sorted(COSTS_FILE.parent.glob("pass_costs*.json"))
IDENTITY_KEYS = {"model_type", "hidden_size", "intermediate_size", "layers", "heads", "kv_heads", "vocab_size"}
FAKE = {"model_type": "fake", "hidden_size": 8, "intermediate_size": 16, "layers": 1, "heads": 1, "kv_heads": 1,
        "vocab_size": 10}


@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("MTPCTL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv(SWITCH, raising=False)


def _spec(folder, **kw) -> PipelineSpec:
    return PipelineSpec(model=str(folder), speculate="ngram", **kw)


def _native(folder) -> None:
    """Skip where the native kernels do not load (the torch kernels read no table)."""
    if assemble(_spec(folder, speculate_policy="always")).session.policy_mode is None:
        pytest.skip("native kernels unavailable: the auto policy reads no table")


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_table_says_where_it_was_measured(path):
    doc = json.loads(path.read_text(encoding="utf-8"))
    source = doc["source"]
    assert doc["version"] == 4 and IDENTITY_KEYS <= set(source["model"])
    assert source["cpu"] and source["threads"] >= 1 and source["commit"] and source["date"]
    assert source["matmul_isa"] == (path.stem.split("-", 1)[1] if "-" in path.stem else "avx512-bf16")
    assert cost_table.class_of(source) == source["cpu_class"]
    assert {"float32", "bfloat16", "int4"} <= set(doc["modes"])


def test_a_model_of_the_shipped_tables_shape_uses_the_shipped_table(monkeypatch):
    monkeypatch.setattr(cost_table, "cpu_class", lambda: "amd avx512-bf16")
    monkeypatch.setattr(cost_table, "costs_file", lambda: COSTS_FILE)
    identity = {k: v for k, v in read_source(COSTS_FILE)["model"].items() if k != "name"}
    choice = choose_table(identity, "int4", measure=lambda: pytest.fail("measured a shipped model"))
    assert choice.source == "shipped" and choice.path == COSTS_FILE
    assert choice.costs == load_costs("int4", COSTS_FILE) and choice.describe()["model"]["name"] == "smollm2-135m"
    assert choice.describe()["cpu_class"] == choice.describe()["running_cpu_class"] == "amd avx512-bf16"


@pytest.mark.parametrize("running", ["intel avx512-bf16 amx", "intel avx512-bf16", "portable", "torch"])
def test_the_shipped_table_does_not_price_another_class_of_cpu(monkeypatch, running):
    """On an Intel CPU (AMX or not), or another matmul path, the AMD table of the same model is not used:
    a table is measured on first use, or (measuring off) the shipped one is borrowed and says so."""
    monkeypatch.setattr(cost_table, "cpu_class", lambda: running)
    monkeypatch.setattr(cost_table, "costs_file", lambda: COSTS_FILE)
    identity = {k: v for k, v in read_source(COSTS_FILE)["model"].items() if k != "name"}
    costs = PassCosts((1, 2), (1.0, 2.0), (2,), ((0.5,), (0.7,)))
    measured = choose_table(identity, "bfloat16", measure=lambda: costs)
    assert measured.source == "measured-on-first-use" and measured.costs == costs
    assert measured.describe()["cpu_class"] == running and read_source(measured.path)["cpu_class"] == running
    monkeypatch.setenv(SWITCH, "off")
    borrowed = choose_table(identity, "int4", measure=lambda: pytest.fail("measured with measuring off"))
    assert borrowed.source == "borrowed" and borrowed.path == COSTS_FILE
    assert borrowed.describe()["cpu_class"] == "amd avx512-bf16" and borrowed.describe()["running_cpu_class"] == running


@pytest.mark.parametrize("source, expected", [
    ({"cpu": "AMD EPYC", "matmul_isa": "avx512-bf16"}, "amd avx512-bf16"),
    ({"cpu": "Intel(R) Xeon(R) Platinum 8480+", "matmul_isa": "avx512-bf16"}, "intel avx512-bf16"),
    ({"cpu": "Intel(R) Xeon(R) Platinum 8480+", "matmul_isa": "avx512-bf16", "cpu_class": "intel avx512-bf16 amx"},
     "intel avx512-bf16 amx"),
    ({"cpu": "AMD EPYC", "matmul_isa": "avx2"}, "avx2"), ({"cpu": "?", "matmul_isa": None}, "torch")])
def test_a_tables_cpu_class_is_read_from_its_source(source, expected):
    assert cost_table.class_of(source) == expected


def test_this_cpus_class_names_its_vendor_and_amx_on_avx512_bf16(monkeypatch):
    monkeypatch.setattr(cost_table, "matmul_isa", lambda: "avx512-bf16")
    monkeypatch.setattr(cost_table, "_cpuinfo", lambda field: {"vendor_id": "GenuineIntel"}.get(field))
    monkeypatch.setattr(cost_table, "cpu_flags", lambda: {"avx512_bf16", "amx_bf16", "amx_tile"})
    assert cost_table.cpu_class() == "intel avx512-bf16 amx"
    monkeypatch.setattr(cost_table, "cpu_flags", lambda: {"avx512_bf16"})
    monkeypatch.setattr(cost_table, "_cpuinfo", lambda field: {"vendor_id": "AuthenticAMD"}.get(field))
    assert cost_table.cpu_class() == "amd avx512-bf16"
    monkeypatch.setattr(cost_table, "matmul_isa", lambda: "avx2")
    assert cost_table.cpu_class() == "avx2"


def test_another_model_is_measured_once_then_read_from_the_cache():
    costs = PassCosts((1, 2), (1.0, 2.0), (2,), ((0.5,), (0.7,)))
    first = choose_table(FAKE, "float32", measure=lambda: costs)
    assert first.source == "measured-on-first-use" and first.costs == costs and first.path.is_file()
    assert first.path == cache_path(FAKE, "float32", cost_table.torch.get_num_threads())
    second = choose_table(FAKE, "float32", measure=lambda: pytest.fail("measured again"))
    assert second.source == "cached" and second.costs == costs and second.model == first.model
    assert choose_table(FAKE, "bfloat16", measure=lambda: costs).path != first.path  # another mode: its own table


def test_measuring_off_borrows_the_shipped_table(monkeypatch):
    monkeypatch.setenv(SWITCH, "off")
    choice = choose_table(FAKE, "float32", measure=lambda: pytest.fail("measured with measuring off"))
    assert choice.source == "borrowed" and choice.path == cost_table.costs_file()
    assert choice.model["name"] == "smollm2-135m"
    assert not cache_path(FAKE, "float32", cost_table.torch.get_num_threads()).exists()


def test_a_damaged_cached_table_is_refused_and_left_as_it_was():
    path = cache_path(FAKE, "float32", cost_table.torch.get_num_threads())
    path.parent.mkdir(parents=True)
    path.write_text('{"modes": {"float32": {"rows": [2, 1], "ms": [1, 2]}}}')
    before = path.read_bytes()
    with pytest.raises(BadInput, match="damaged.*delete it"):
        choose_table(FAKE, "float32", measure=lambda: pytest.fail("measured over a damaged table"))
    assert path.read_bytes() == before


def test_the_tiny_model_measures_a_table_on_first_use_and_reads_it_after(tiny_folder, tmp_path):
    _native(tiny_folder)
    first = assemble(_spec(tiny_folder))
    assert first.table.source == "measured-on-first-use" and first.table.model["hidden_size"] == 64
    assert first.table.path.is_relative_to(tmp_path / "home" / "pass_costs") and first.table.path.is_file()
    assert len(first.table.costs.rows) >= 2 and first.table.costs.nodes
    second = assemble(_spec(tiny_folder))
    assert second.table.source == "cached" and second.table.costs == first.table.costs
    assert assemble(_spec(tiny_folder, speculate_policy="always")).table is None


def test_greedy_tokens_are_the_same_whatever_the_table(tiny_folder):
    _native(tiny_folder)
    plain = assemble(PipelineSpec(model=str(tiny_folder)))
    ids = plain.session.encode("abcabcabcabc abcabc", chat=False)
    expected = plain.generate(ids, 24).token_ids
    pipeline = assemble(_spec(tiny_folder))
    assert pipeline.generate(ids, 24).token_ids == expected
    dear = PassCosts((1, 2), (1.0, 2.0), (1, 8), ((50.0, 400.0), (50.0, 400.0)))  # drafting never pays
    cheap = PassCosts((1, 2), (10.0, 10.0), (1, 8), ((0.0, 0.0), (0.0, 0.0)))  # drafting always pays
    for costs in (dear, cheap):
        pipeline.table = dataclasses.replace(pipeline.table, costs=costs)
        assert pipeline.generate(ids, 24).token_ids == expected


def test_generate_json_says_which_table_decided(capsys, tiny_folder):
    _native(tiny_folder)
    capsys.readouterr()
    replies = []
    for extra in ([], [], ["--speculate-policy", "always"]):
        code = main(["generate", "--model", str(tiny_folder), "--json", "--max-new-tokens", "8", "--speculate", "ngram",
                     "abcabc", *extra])
        out, err = capsys.readouterr()
        assert code == 0, err
        replies.append(json.loads(out)["policy_table"])
    assert replies[0]["source"] == "measured-on-first-use" and replies[1]["source"] == "cached"
    assert replies[0]["mode"] == "float32" and replies[0]["model"]["layers"] == 2 and replies[0]["cpu"]
    assert replies[1]["path"] == replies[0]["path"] and replies[2] is None


def test_a_damaged_cache_is_one_line_error_in_the_cli(capsys, tiny_folder):
    _native(tiny_folder)
    pipeline = assemble(_spec(tiny_folder))
    pipeline.table.path.write_text("{not json")
    capsys.readouterr()
    code = main(["generate", "--model", str(tiny_folder), "--json", "--max-new-tokens", "4", "abc"])
    out, err = capsys.readouterr()
    assert code == 0 and json.loads(out)["policy_table"] is None  # plain decoding decides no draft sizes: no table
    code = main(["generate", "--model", str(tiny_folder), "--json", "--max-new-tokens", "4", "--speculate", "ngram",
                 "abc"])
    out, err = capsys.readouterr()
    assert code == 2 and "damaged" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert pipeline.table.path.read_text() == "{not json"


def test_bench_json_says_which_table_decided(capsys, tiny_folder, tmp_path):
    _native(tiny_folder)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"category": "copy", "prompt": "abc abc abc abc"}))
    capsys.readouterr()
    code = main(["bench", "--model", str(tiny_folder), "--prompts", str(prompts), "--max-new-tokens", "6",
                 "--repeats", "1", "--methods", "plain,ngram,lookahead", "--json", str(tmp_path / "b.json")])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads((tmp_path / "b.json").read_text())
    settings = report.get("settings", report)
    assert settings["policy_table"]["source"] in ("measured-on-first-use", "cached")
    assert settings["policy_table"]["mode"] == "float32"
    drafts = settings["policy_table"]["draft"]  # each drafting method's drafter cost, by method
    assert set(drafts) == {m["method"] for m in report["methods"]} - {"plain"} and drafts
    assert all(d["source"] in ("measured-on-first-use", "cached") for d in drafts.values())


def test_a_table_measured_here_measures_the_drafters_cost_once_per_setting(tiny_folder):
    _native(tiny_folder)
    first = assemble(_spec(tiny_folder))
    assert first.table.draft_source == "measured-on-first-use"
    assert first.table.draft.call_ms + first.table.draft.row_ms > 0 and first.table.draft.row_ms >= 0
    stored = json.loads(first.table.path.read_text())["modes"]["float32"]["draft_ms"]
    assert [k.split()[0] for k in stored] == ["ngram"]
    assert first.new_policy().draft == first.table.draft  # the policy is priced by it
    second = assemble(_spec(tiny_folder))
    assert second.table.draft_source == "cached" and second.table.draft == first.table.draft
    assert second.table.describe()["draft"] == {"source": "cached", "call_ms": first.table.draft.call_ms,
                                                "row_ms": first.table.draft.row_ms}
    longer = assemble(_spec(tiny_folder, draft=dataclasses.replace(first.spec.draft, draft_len=5)))
    assert longer.table.draft_source == "measured-on-first-use"  # other settings: their own cost
    assert len(json.loads(first.table.path.read_text())["modes"]["float32"]["draft_ms"]) == 2
    assert first.table.costs == longer.table.costs  # the pass costs kept as they were


def test_measuring_off_prices_an_unmeasured_drafter_by_the_shipped_table(tiny_folder, monkeypatch):
    _native(tiny_folder)
    measured = assemble(_spec(tiny_folder))
    monkeypatch.setenv(SWITCH, "off")
    other = assemble(_spec(tiny_folder, draft=dataclasses.replace(measured.spec.draft, draft_len=5)))
    assert other.table.source == "cached" and other.table.draft_source == "shipped"
    assert other.table.draft == load_draft_cost("float32", "ngram", cost_table.costs_file())
    assert len(json.loads(measured.table.path.read_text())["modes"]["float32"]["draft_ms"]) == 1


def test_a_shipped_table_prices_the_drafter_by_its_draft_ms(monkeypatch):
    monkeypatch.setattr(cost_table, "matmul_isa", lambda: "avx512-bf16")
    monkeypatch.setattr(cost_table, "costs_file", lambda: COSTS_FILE)
    identity = {k: v for k, v in read_source(COSTS_FILE)["model"].items() if k != "name"}
    choice = choose_table(identity, "bfloat16")
    priced = with_draft_cost(choice, "heads+ngram", "heads+ngram 0", measure=lambda: pytest.fail("measured"),
                             heads_kind="medusa")
    shipped = json.loads(COSTS_FILE.read_text())["modes"]["bfloat16"]["draft_ms"]["heads+ngram"]
    assert priced.draft_source == "shipped" and [priced.draft.call_ms, priced.draft.row_ms] == shipped
    lookup = with_draft_cost(choice, "ngram", "ngram 0", measure=lambda: pytest.fail("measured"))
    assert lookup.draft_source == "shipped"  # prompt lookup's cost does not depend on heads


def test_heads_of_another_kind_than_the_shipped_tables_are_measured_once_beside_it(monkeypatch):
    monkeypatch.setattr(cost_table, "matmul_isa", lambda: "avx512-bf16")
    monkeypatch.setattr(cost_table, "costs_file", lambda: COSTS_FILE)
    identity = {k: v for k, v in read_source(COSTS_FILE)["model"].items() if k != "name"}
    choice = choose_table(identity, "bfloat16")
    eagle3 = DraftCost(3.5, 2.4)
    first = with_draft_cost(choice, "heads+ngram", "heads+ngram abc", measure=lambda: eagle3, heads_kind="eagle3")
    assert first.draft_source == "measured-on-first-use" and first.draft == eagle3
    assert first.costs == choice.costs and first.path == COSTS_FILE  # the shipped pass costs still decide
    again = with_draft_cost(choice, "heads+ngram", "heads+ngram abc", measure=lambda: pytest.fail("measured again"),
                            heads_kind="eagle3")
    assert again.draft_source == "cached" and again.draft == eagle3
    kept = cost_table.draft_cache_path(choice.model, "bfloat16", cost_table.torch.get_num_threads())
    assert json.loads(kept.read_text())["modes"]["bfloat16"]["draft_ms"] == {"heads+ngram abc": [3.5, 2.4]}
    monkeypatch.setenv(SWITCH, "off")
    unmeasured = with_draft_cost(choice, "heads+ngram", "heads+ngram other", measure=lambda: pytest.fail("measured"),
                                 heads_kind="eagle3")
    assert unmeasured.draft_source == "shipped"  # measuring off: the shipped cost, whatever it was measured with
