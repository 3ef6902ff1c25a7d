"""recipes/pipeline.sh end to end on the tiny test model: add-heads from a recipe, export, bench with
gates; its exit code is that of the step that failed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "recipes" / "pipeline.sh"


@pytest.fixture(scope="module")
def setup(tiny_folder, tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    (root / "data.jsonl").write_text("".join(json.dumps({"prompt": f"count: {i} {i + 1}"}) + "\n" for i in range(16)))
    (root / "prompts.jsonl").write_text(json.dumps({"category": "chat", "prompt": "count: 1 2"}) + "\n")
    (root / "recipe.yaml").write_text(f"""version: 1
model: {tiny_folder}
data: [data.jsonl]
settings: {{num_heads: 2, self_distill: true, response_tokens: 12, epochs: 1, tree_nodes: 3}}
""")
    return root


def run(setup, **env):
    bin_dir = Path(sys.executable).parent
    full = {**os.environ, "RECIPE": str(setup / "recipe.yaml"), "WORK": str(setup / "work"),
            "MTPCTL": str(bin_dir / "mtpctl"), "MTPCTL_HOME": str(setup / "home"),
            "BENCH_ARGS": f"--prompts {setup / 'prompts.jsonl'} --max-new-tokens 16", **env}
    return subprocess.run(["bash", str(SCRIPT)], env=full, capture_output=True, text=True, timeout=900, cwd=REPO)


@pytest.mark.slow
def test_pipeline_runs_end_to_end_and_passes_gates(setup):
    done = run(setup, MIN_SPEEDUP="0.001", MAX_P99_MS="100000")
    assert done.returncode == 0, done.stderr[-3000:]
    work = setup / "work"
    assert (work / "heads" / "mtp_config.json").exists() and (work / "onnx" / "manifest.json").exists()
    report = json.loads((work / "bench.json").read_text())
    assert [m["method"] for m in report["methods"]] == ["plain", "heads"]
    assert "pipeline: passed" in done.stderr


@pytest.mark.slow
def test_a_missed_gate_fails_the_pipeline_with_exit_1(setup):
    done = run(setup, MIN_SPEEDUP="1000")
    assert done.returncode == 1, done.stderr[-3000:]
    assert "heads speedup" in done.stderr and "pipeline: passed" not in done.stderr


def test_bad_input_stops_the_pipeline_with_exit_2(setup):
    done = run(setup, RECIPE=str(setup / "missing.yaml"))
    assert done.returncode == 2 and "cannot read recipe" in done.stderr
    assert "2/3" not in done.stderr
