"""Heads mtpctl trains and exports, run by a real serving engine: vLLM's CPU build (``make vllm-env``,
its own virtualenv ``.venv-vllm``), on the real SmolLM2-135M-Instruct, ``enforce_eager``.

For EAGLE-3 heads (``--format speculators``, and ``eagle``) and plain Medusa heads with a draft
vocabulary (``--format vllm``), trained here on a few prompts: vLLM loads them (EAGLE-3 with its
weight check on: no tensor missing or left over), its greedy output with speculation equals its own
plain greedy output (and mtpctl's), and its accepted draft tokens per position equal mtpctl's on the
same prompts with the same top-1 chain, within one token per prompt (the last step of a generation:
mtpctl drafts no further than the tokens left, vLLM drafts the full chain). ``mtpctl bench --baseline
vllm`` puts vLLM's plain, n-gram and heads runs in the same table.

Skipped, with the reason, where ``.venv-vllm`` is absent (each vLLM start takes 20-60 s here).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import accepted_by_position
from mtpctl.bench.harness import load_prompts
from mtpctl.bench.vllm_peer import run_worker, vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.real, pytest.mark.slow]
if vllm_python() is None:
    pytest.skip("vLLM's environment (.venv-vllm) is absent: make vllm-env creates it", allow_module_level=True)

REPO = Path(__file__).resolve().parents[1]
NEW_TOKENS = 48
CHAIN = 3  # draft tokens per step, vLLM's num_speculative_tokens


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """EAGLE-3 heads and plain Medusa heads (draft vocabulary 2048) for SmolLM2, self-distilled on 96
    of the recipes' prompts (a few minutes here; weak heads, but they draft and get accepted)."""
    from mtpctl.model.sources import resolve_model
    from mtpctl.train.add_heads import add_heads
    from mtpctl.train.settings import TrainSettings

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("vllm-heads")
    data = root / "prompts.jsonl"
    lines = (REPO / "recipes" / "data" / "distill_prompts.jsonl").read_text().splitlines()
    data.write_text("\n".join(lines[:96]) + "\n")
    folder = resolve_model("smollm2-135m")
    common = dict(self_distill=True, response_tokens=64, distill_batch=32, num_heads=CHAIN, epochs=2, seed=0,
                  measure_prompts=0)
    add_heads(folder, "smollm2-135m", [data], root / "eagle3", TrainSettings(
        kind="eagle3", draft_vocab=2048, lr=3e-3, batch_tokens=1024, **common), root / "home")
    add_heads(folder, "smollm2-135m", [data], root / "medusa", TrainSettings(
        kind="medusa", draft_vocab=2048, lr=1e-2, **common), root / "home")
    return folder, root


@pytest.fixture(scope="module")
def prompts(smollm2):
    return [smollm2.codec.encode_messages(list(p.messages)) for p in load_prompts()[::10][:4]]


def mtpctl_chain(session, heads_dir, prompts):
    """mtpctl's greedy runs with the heads drafting a top-1 chain of CHAIN tokens."""
    from mtpctl.drafters.build import heads_drafter, heads_for
    from mtpctl.drafters.heads.tree import StaticTree

    heads = heads_for(session, heads_dir)
    drafter = heads_drafter(session, heads, StaticTree.from_paths([[0] * d for d in range(1, CHAIN + 1)], CHAIN))
    return [session.generate(p, NEW_TOKENS, drafter=drafter) for p in prompts]


@pytest.fixture(scope="module")
def vllm_plain(trained, prompts):
    folder, _ = trained
    return run_worker({"model": str(folder), "prompts": prompts, "max_new_tokens": NEW_TOKENS, "threads": 1})


def check_against_vllm(session, folder, heads_dir, export, prompts, plain, method, track):
    reply = run_worker({"model": str(folder), "prompts": prompts, "max_new_tokens": NEW_TOKENS, "threads": 1,
                        "speculative_config": {"method": method, "model": str(export), "num_speculative_tokens": CHAIN},
                        "weights_track": track})
    spec_ids = [r["token_ids"] for r in reply["results"]]
    plain_ids = [r["token_ids"] for r in plain["results"]]
    assert spec_ids == plain_ids  # lossless in vLLM too
    ours = mtpctl_chain(session, heads_dir, prompts)
    assert [r.token_ids for r in ours] == [session.generate(p, NEW_TOKENS).token_ids for p in prompts] == plain_ids
    theirs, mine = reply["spec"]["accepted_per_pos"], accepted_by_position(ours, CHAIN)
    assert reply["spec"]["drafts"] > 0 and sum(mine) > 0
    assert all(abs(a - b) <= len(prompts) for a, b in zip(theirs, mine)), (theirs, mine)
    return theirs, mine


@pytest.mark.parametrize("fmt", ["speculators", "eagle"])
def test_eagle3_export_runs_in_vllm_losslessly_with_mtpctls_acceptance(fmt, trained, prompts, smollm2, vllm_plain):
    from mtpctl.export.serving import export_serving_heads

    folder, root = trained
    export_serving_heads(fmt, folder, root / "eagle3", root / f"eagle3-{fmt}", overwrite=True)
    check_against_vllm(smollm2, folder, root / "eagle3", root / f"eagle3-{fmt}", prompts, vllm_plain, "eagle3", True)


def test_plain_medusa_export_runs_in_vllm_losslessly_with_mtpctls_acceptance(trained, prompts, smollm2, vllm_plain):
    from mtpctl.export.serving import export_serving_heads

    folder, root = trained
    export_serving_heads("vllm", folder, root / "medusa", root / "medusa-vllm", overwrite=True)
    # vLLM's Medusa loader loads token_map without reporting it, so its weight check must be off
    check_against_vllm(smollm2, folder, root / "medusa", root / "medusa-vllm", prompts, vllm_plain, "medusa", False)


def test_bench_baseline_vllm_puts_vllms_runs_in_the_table(trained, tmp_path, capsys):
    from mtpctl.cli.main import main

    folder, root = trained
    code = main(["bench", "--methods", "plain,heads", "--heads", str(root / "eagle3"), "--categories", "chat",
                 "--limit", "1", "--max-new-tokens", "24", "--threads", "1", "--baseline", "vllm",
                 "--json", str(tmp_path / "b.json")])
    table = capsys.readouterr().out
    assert code == 0
    rows = {m["method"]: m for m in json.loads((tmp_path / "b.json").read_text())["methods"]}
    assert set(rows) == {"plain", "heads", "vllm", "vllm-ngram", "vllm-heads"}
    assert all(rows[n]["same_as_plain"] == rows[n]["runs"] == 1 for n in ("vllm", "vllm-ngram", "vllm-heads"))
    assert rows["vllm-heads"]["tau"] >= 1.0 and len(rows["vllm-heads"]["acceptance_by_position"]) == CHAIN
    assert "| vllm-heads |" in table


def test_bench_batch_sizes_put_vllm_beside_mtpctl_at_each_size(tmp_path, capsys):
    from mtpctl.cli.main import main

    code = main(["bench", "--methods", "plain,ngram", "--categories", "chat,code", "--limit", "2",
                 "--max-new-tokens", "16", "--threads", "1", "--baseline", "vllm", "--batch-sizes", "1,3",
                 "--json", str(tmp_path / "b.json")])
    table = capsys.readouterr().out
    assert code == 0
    rows = {(r["method"], r["batch_size"]): r for r in json.loads((tmp_path / "b.json").read_text())["rows"]}
    assert set(rows) == {(m, b) for m in ("plain", "ngram", "vllm", "vllm-ngram") for b in (1, 3)}
    # vLLM's greedy tokens are mtpctl's plain decoding's at every batch size (float32, the same checkpoint)
    assert all(r["same_as_plain"] == r["requests"] == 4 for r in rows.values())
    assert "| 3 | vllm |" in table
