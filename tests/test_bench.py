"""``mtpctl bench`` on the tiny checkpoint: figures, table/JSON agreement, gates, prompt sets."""

import json

import pytest

from mtpctl.cli.main import main
from mtpctl.bench.harness import acceptance_by_position, load_prompts, percentile
from mtpctl.decode.loop import GenerationResult, GenerationStats


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    records = [{"category": "copy", "prompt": "abc abc abc abc"},
               {"category": "copy", "prompt": "xyz xyz xyz"},
               {"category": "chat", "messages": [{"role": "user", "content": "hi"},
                                                 {"role": "assistant", "content": "hello"},
                                                 {"role": "user", "content": "more"}]}]
    path.write_text("\n".join(json.dumps(r) for r in records))
    return path


def bench(capsys, tiny_folder, prompt_file, tmp_path, *extra):
    code = main(["bench", "--model", str(tiny_folder), "--prompts", str(prompt_file), "--max-new-tokens", "12",
                 "--repeats", "2", "--json", str(tmp_path / "b.json"), *extra])
    out, err = capsys.readouterr()
    return code, out, err, json.loads((tmp_path / "b.json").read_text()) if code in (0, 1) else None


def test_table_and_json_agree(capsys, tiny_folder, prompt_file, tmp_path):
    code, out, err, report = bench(capsys, tiny_folder, prompt_file, tmp_path, "--plot", str(tmp_path / "b.png"))
    assert code == 0, err
    assert [m["method"] for m in report["methods"]] == ["plain", "ngram"]
    for m in report["methods"]:
        assert m["runs"] == 2 * 3  # repeats x prompts
        row = next(line for line in out.splitlines() if line.startswith(f"| {m['method']} |"))
        assert f"| {m['tokens_per_s']:.1f} |" in row
        assert f"{m['itl_ms_p99']:.1f}" in row
    plain, ngram = report["methods"]
    assert plain["tau"] == 1.0 and plain["acceptance_rate"] is None
    assert ngram["speedup"] is not None and ngram["speedup_p10"] <= ngram["speedup"] <= ngram["speedup_p90"]
    assert set(report["tokens_per_s_by_category"]) == {"copy", "chat"}
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"
    assert "round 2/2" in err  # progress on stderr
    memory = report["host_memory"]  # measured, not computed: the process holds at least the weights
    assert memory["weight_bytes"] == memory["weights_on_host_bytes"] > 0
    assert memory["peak_rss_bytes"] >= memory["peak_rss_after_load_bytes"] > memory["weight_bytes"]
    assert "host memory: peak RSS" in err
    assert not [k for m in report["methods"] for k in m if k.startswith("device_peak")]  # measured on CUDA only
    assert "device peak" not in out


def test_gates_exit_1_naming_the_method(capsys, tiny_folder, prompt_file, tmp_path):
    code, out, err, report = bench(capsys, tiny_folder, prompt_file, tmp_path, "--fail-below-speedup", "100",
                                   "--fail-above-p99-ms", "0.001")
    assert code == 1
    line = err.strip().splitlines()[-1]
    assert "ngram speedup" in line and "plain p99 ITL" in line
    code, *_ = bench(capsys, tiny_folder, prompt_file, tmp_path, "--fail-below-speedup", "0.0001")
    assert code == 0


@pytest.mark.parametrize("args, fragment", [
    (["--methods", "plain,heads"], "needs a head folder (made by mtpctl add-heads) (--heads)"),
    (["--methods", "plain,heads+ngram"], "needs a head folder (made by mtpctl add-heads) (--heads)"),
    (["--tree-nodes", "4"], "goes with the heads drafter (--tree-nodes)"),
    (["--methods", "plain,bogus"], "unknown drafter"),
    (["--methods", "plain,retrieval"], "needs a datastore file, or a head folder that carries one (--datastore)"),
    (["--categories", "poetry"], "no prompt in category"),
])
def test_bad_bench_arguments(capsys, tiny_folder, prompt_file, args, fragment):
    code = main(["bench", "--model", str(tiny_folder), "--prompts", str(prompt_file), *args])
    err = capsys.readouterr().err
    assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1


def test_builtin_prompt_set_has_seven_categories_of_ten():
    prompts = load_prompts()
    counts = {}
    for p in prompts:
        counts[p.category] = counts.get(p.category, 0) + 1
    assert counts == {c: 10 for c in ("chat", "translation", "summarization", "qa", "math", "rag", "code")}
    assert all(len(p.messages) == 3 for p in prompts if p.category == "chat")  # multi-turn


def test_percentile_and_acceptance_by_position():
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5 and percentile([], 50) is None
    stats = GenerationStats(accepted_per_step=[3, 1, 2], drafted_per_step=[3, 2, 0], depth_per_step=[3, 2, 0])
    result = GenerationResult([], "", "length", stats)
    # step 1: positions 0, 1 accepted, 2 rejected; step 2: position 0 rejected, 1 not reached
    assert acceptance_by_position([result]) == [0.5, 0.5, 0.0]


def test_peak_memory_is_weights_plus_largest_kv_cache(capsys, tiny_folder, prompt_file, tmp_path):
    from mtpctl.model.decoder import Decoder
    from mtpctl.model.linears import blocked_layout_available

    code, out, err, report = bench(capsys, tiny_folder, prompt_file, tmp_path)
    assert code == 0, err
    weights = Decoder.from_folder(tiny_folder, blocked=True).weight_bytes  # as a Session holds them
    assert weights == 259 * 64 * 4 + sum(  # tied embedding once, then per layer: norms, qkv, o, gate_up, down
        (64 + 64 + 128 * 64 + 64 * 64 + 256 * 64 + 64 * 128) * 4 for _ in range(2)) + 64 * 4 \
        + (259 * 64 * 4 if blocked_layout_available() else 0)  # the lm_head's blocked copy of the embedding
    for m in report["methods"]:
        kv = m["peak_memory_bytes"] - weights
        assert kv > 0 and kv % (2 * 2 * 2 * 16 * 4) == 0  # k and v, layers, kv heads, head_dim, float32


@pytest.mark.parametrize("content, fragment", [
    ("[]", "JSON object with 'prompt' or 'messages'"),
    ('{"category": "x"}', "JSON object with 'prompt' or 'messages'"),
    ('{"messages": "hi"}', "'messages' must be a list"),
    ("{not json", "not JSON"),
])
def test_bad_prompt_files(capsys, tiny_folder, tmp_path, content, fragment):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    code = main(["bench", "--model", str(tiny_folder), "--prompts", str(bad)])
    err = capsys.readouterr().err
    assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1


def test_unwritable_outputs_fail_before_any_work(capsys, tiny_folder, prompt_file, tmp_path):
    code = main(["bench", "--model", str(tiny_folder), "--prompts", str(prompt_file),
                 "--json", str(tmp_path / "missing" / "b.json")])
    out, err = capsys.readouterr()
    assert code == 2 and "cannot write" in err and out == "" and "round" not in err


def test_heads_and_heads_plus_ngram_methods(capsys, tiny_folder, prompt_file, tmp_path):
    from helpers import tiny_hydra_folder

    tiny_hydra_folder(tiny_folder, tmp_path / "heads")
    code, out, err, report = bench(capsys, tiny_folder, prompt_file, tmp_path, "--methods", "plain,heads,heads+ngram",
                                   "--heads", str(tmp_path / "heads"), "--draft-len", "3")
    assert code == 0, err
    methods = {m["method"]: m for m in report["methods"]}
    assert list(methods) == ["plain", "heads", "heads+ngram"]
    for name in ("heads", "heads+ngram"):  # both drafted, and (greedy, lossless) wrote plain's tokens
        assert methods[name]["acceptance_rate"] is not None
        assert methods[name]["new_tokens"] == methods["plain"]["new_tokens"]
        assert methods[name]["peak_memory_bytes"] > methods["plain"]["peak_memory_bytes"]  # + the heads' weights


def test_method_names_are_canonical_drafter_specs():
    from mtpctl.bench.methods import parse_methods

    assert parse_methods("ngram+heads,heads+ngram,retrieval+ngram") == ["plain", "heads+ngram", "ngram+retrieval"]


def test_llamacpp_baseline_needs_its_package_and_a_gguf_model(capsys, tiny_folder, prompt_file, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real_find_spec(name, *a))
    code = main(["bench", "--model", str(tiny_folder), "--prompts", str(prompt_file), "--baseline", "llama.cpp"])
    err = capsys.readouterr().err
    assert code == 2 and "pip install llama-cpp-python" in err and len(err.strip().splitlines()) == 1
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "llama_cpp" else real_find_spec(name, *a))
    code = main(["bench", "--model", str(tiny_folder), "--prompts", str(prompt_file), "--baseline", "llama.cpp"])
    err = capsys.readouterr().err  # the tiny checkpoint was never a GGUF file
    assert code == 2 and "no GGUF file behind this model" in err and len(err.strip().splitlines()) == 1


def test_gguf_source_finds_the_file_behind_a_model(tmp_path):
    from mtpctl.model.sources import gguf_source
    from mtpctl.errors import BadInput

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert gguf_source(str(gguf)) == gguf
    folder = tmp_path / "imported"
    folder.mkdir()
    (folder / "mtpctl_import.json").write_text(json.dumps({"format_version": 1, "source": str(gguf)}))
    assert gguf_source(str(folder)) == gguf
    gguf.unlink()  # the file it came from is gone
    with pytest.raises(BadInput, match="no GGUF file"):
        gguf_source(str(folder))


def test_bench_refuses_none_as_a_method(capsys, tiny_folder, tmp_path):
    """'none' parses as a drafter spec (no drafter): it must not run as a second plain method."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"category": "chat", "prompt": "hi"}\n')
    assert main(["bench", "-m", str(tiny_folder), "--prompts", str(prompts), "--methods", "plain,none"]) == 2
    err = capsys.readouterr().err
    assert "unknown method 'none'" in err and len(err.strip().splitlines()) == 1


def test_batch_sizes_run_every_method_at_every_size(capsys, tiny_folder, prompt_file, tmp_path):
    code, out, err, report = bench(capsys, tiny_folder, prompt_file, tmp_path, "--batch-sizes", "2,1",
                                   "--plot", str(tmp_path / "batch.png"), "--speculate-policy", "always")
    assert code == 0, err
    rows = report["rows"]
    assert [(r["batch_size"], r["method"]) for r in rows] == [(1, "plain"), (1, "ngram"), (2, "plain"), (2, "ngram")]
    for r in rows:
        assert r["requests"] == 2 * 3 and r["rounds"] == 2  # repeats x prompts, every one run at every size
        assert r["same_as_plain"] == r["requests"]  # greedy: every request as plain decoding alone
        assert f"| {r['batch_size']} | {r['method']} | {r['tokens_per_s']:.1f} |" in out
    assert rows[0]["speedup"] == 1.0 and set(report["stops_paying"]) == {"ngram"}
    low, high = rows[1]["speedup_range"]  # ngram: the median of two rounds' paired ratios, within their range
    assert low <= rows[1]["speedup"] <= high and f"{rows[1]['speedup']:.2f} ({low:.2f}-{high:.2f})" in out
    assert (tmp_path / "batch.png").stat().st_size > 0


def test_batch_sizes_are_checked_before_any_model_loads(capsys, tiny_folder, prompt_file, tmp_path):
    for sizes in ("0,2", "a", ""):
        code, out, err, _ = bench(capsys, tiny_folder, prompt_file, tmp_path, "--batch-sizes", sizes)
        assert code == 2 and "batch sizes" in err and len(err.strip().splitlines()) == 1


def test_profile_splits_each_step(capsys, tiny_folder, prompt_file, tmp_path):
    code, out, err, report = bench(capsys, tiny_folder, prompt_file, tmp_path, "--profile")
    assert code == 0, err
    for m in report["methods"]:
        p = m["profile_ms_per_step"]
        assert set(p) == {"draft", "verify", "logits", "accept", "commit", "other", "step", "outside_pass"}
        assert p["verify"] > 0 and abs(p["step"] - p["outside_pass"] - p["verify"] - p["logits"]) < 1e-6
    assert "| method | draft | verify (pass) |" in out


def test_batched_summary_pairs_rounds_and_compares_a_peer_over_every_round():
    """Two rounds of plain and ngram, a peer's single run over both rounds' requests, and a batch size
    where plain made no tokens: speedups are per-round ratios (none against no tokens), and the peer's
    requests are each compared with plain's answer to the same prompt."""
    from types import SimpleNamespace

    from mtpctl.bench.batched import summarize_batched

    def result(ids):
        stats = SimpleNamespace(new_tokens=len(ids), decode_steps=len(ids), draft_tokens=0, accepted_per_step=[1] * len(ids),
                                accepted_tokens=0, ttft_ms=1.0, kv_cache_bytes=0, step_ms=[1.0] * len(ids))
        return SimpleNamespace(token_ids=ids, stats=stats)

    answers = [[1, 2], [3, 4, 5]]
    run = lambda wall, ids=answers: {"results": [result(i) for i in ids], "wall_ms": wall}  # noqa: E731
    runs = {("plain", 1): [run(1000.0), run(500.0)], ("ngram", 1): [run(500.0), run(500.0)],
            ("vllm", 1): [run(1000.0, answers + [[1, 2], [3, 4, 9]])],
            ("plain", 2): [run(1000.0, [[], []])], ("ngram", 2): [run(1000.0)]}
    rows = {(r["method"], r["batch_size"]): r for r in summarize_batched(runs, {})}
    ngram = rows["ngram", 1]
    assert ngram["speedup"] == pytest.approx(1.5) and ngram["speedup_range"] == pytest.approx([1.0, 2.0])
    assert rows["vllm", 1]["same_as_plain"] == 3 and rows["vllm", 1]["requests"] == 4  # prompt 2's second answer differs
    assert rows["vllm", 1]["speedup"] == pytest.approx((10 / 1.0) / (10 / 1.5))  # against plain over both rounds
    assert rows["ngram", 2]["speedup"] is None  # plain made no tokens at batch 2
