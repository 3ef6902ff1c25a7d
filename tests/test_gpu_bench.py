"""``mtpctl bench`` on a GPU, checked on the CPU under a virtual CUDA device (tests/virtual_cuda.py):
each timer boundary of a decode step waits for the device (``torch.cuda.synchronize``, a ``barrier``)
so that a phase's GPU time lands in that phase, the waits add no host copy, and the device's memory
peaks reach the JSON and the table; plain generation waits at none of them (tests/test_gpu_path_syncs.py)."""

from __future__ import annotations

import collections
import json

import pytest

from mtpctl.bench.batched import format_batched, summarize_batched
from mtpctl.cli.main import main
from mtpctl.decode import loop
from mtpctl.decode.loop import GenerationResult, GenerationStats
from virtual_cuda import virtual_cuda

#: the timer boundaries of one decode step: its start (``_step``), then the end of draft, verify, accept
#: and commit (``lap``); the lm_head's rows are timed on their own (``_logits``: start and end of a call)
STEP_BARRIERS = {"_step": 1, "lap": 4}


@pytest.fixture
def one_prompt(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"category": "copy", "prompt": "abc abc abc abc"}) + "\n")
    return path


def test_bench_on_a_virtual_gpu_waits_at_every_timer_boundary_and_reports_device_memory(
        tiny_folder, one_prompt, tmp_path, capsys, monkeypatch):
    with virtual_cuda() as mode:
        step = loop._step

        def stepped(*args, **kwargs):
            mode.step += 1  # events from here to the next step belong to this decode step
            return step(*args, **kwargs)

        monkeypatch.setattr(loop, "_step", stepped)
        code = main(["bench", "--model", str(tiny_folder), "--device", "cuda", "--prompts", str(one_prompt),
                     "--methods", "plain,ngram", "--max-new-tokens", "6", "--json", str(tmp_path / "b.json")])
        out, err = capsys.readouterr()
    assert code == 0, err
    barriers = [e for e in mode.events if e.kind == "barrier"]
    assert mode.step >= 2 * 2 * 5  # 2 methods, a warm-up run and a timed one, 5 decode steps each at least
    where = collections.Counter(e.site.rsplit(" ", 1)[1] for e in barriers)
    print(dict(where))
    assert set(where) <= {"(_step)", "(lap)", "(_logits)", "(__init__)", "(run)", "(result)"}
    for n in range(1, mode.step + 1):  # every step waits at its five boundaries, each lm_head call at two
        # (a run's last step also holds the next run's start: its arrival, prefill and first token)
        mine = collections.Counter(e.site.rsplit(" ", 1)[1].strip("()") for e in barriers if e.step == n)
        assert {k: mine[k] for k in STEP_BARRIERS} == STEP_BARRIERS, (n, mine)
        assert mine["_logits"] in (2, 4), (n, mine)
        syncs = [e.detail for e in mode.events if e.kind == "sync" and e.step == n]
        assert syncs == ["int64[1]"] * (mine["_logits"] // 2), syncs  # the waits copy nothing: one pass, its ids
    report = json.loads((tmp_path / "b.json").read_text())
    for m in report["methods"]:
        assert m["device_peak_reserved_bytes"] >= m["device_peak_allocated_bytes"] > 0
    assert "device peak MiB (allocated / reserved)" in out.splitlines()[0]
    plain = next(line for line in out.splitlines() if line.startswith("| plain |"))
    allocated = report["methods"][0]["device_peak_allocated_bytes"] / 2**20
    assert plain.endswith(f"| {allocated:.1f} / {report['methods'][0]['device_peak_reserved_bytes'] / 2**20:.1f} |")


def test_batched_rows_carry_device_peaks_where_measured():
    stats = GenerationStats(new_tokens=4, decode_steps=4, total_ms=8.0, accepted_per_step=[1] * 4, step_ms=[2.0] * 4)
    result = GenerationResult([1, 2, 3, 4], "", "length", stats)
    cuda = {("plain", 1): [{"results": [result], "wall_ms": 8.0, "device_peak_allocated_bytes": 3 << 20,
                            "device_peak_reserved_bytes": 4 << 20},
                           {"results": [result], "wall_ms": 8.0, "device_peak_allocated_bytes": 5 << 20,
                            "device_peak_reserved_bytes": 6 << 20}]}
    rows = summarize_batched(cuda, {"plain": 1000})
    assert (rows[0]["device_peak_allocated_bytes"], rows[0]["device_peak_reserved_bytes"]) == (5 << 20, 6 << 20)
    assert format_batched(rows).splitlines()[2].endswith("| 5.0 / 6.0 |")
    cpu = summarize_batched({key: [{"results": run["results"], "wall_ms": 8.0} for run in runs]
                             for key, runs in cuda.items()}, {"plain": 1000})
    assert "device_peak_allocated_bytes" not in cpu[0] and "device peak" not in format_batched(cpu)
