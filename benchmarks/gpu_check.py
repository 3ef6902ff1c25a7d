"""The GPU check: mtpctl's pipeline on a CUDA device in a few minutes, one table at the end.

On a machine whose torch sees a CUDA GPU it
1. writes a synthetic checkpoint (``--shape``, random bfloat16 weights, a real tokenizer) unless
   ``--model`` names one;
2. decodes plain, with prompt lookup and with lookahead on the device, alone and as one batch, and
   checks every greedy output against plain greedy (token for token);
3. trains EAGLE-3 heads on the device, self-distilled on one prompt file (``mtpctl add-heads``), and
   decodes with them (heads, heads+ngram), again checked against plain;
4. runs ``mtpctl bench`` on the device;
5. builds and runs a TensorRT engine where the tensorrt package is installed (else says why not).
Without a GPU it says so, checks the same decoding on the CPU's pure-torch path (``--kernels
torch``, the code CUDA runs) on a small synthetic checkpoint, and exits 0.

    benchmarks/gpu_check.sh --tokenizer-from smollm2-135m --out /tmp/gpu_check.md

Exit code 0 when every check that ran passed, 1 when a greedy output differed or a step failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from mtpctl.backends.torch import TorchSession  # noqa: E402
from mtpctl.decode.policy import AlwaysDraft  # noqa: E402
from mtpctl.decode.session import GenerationRequest  # noqa: E402
from mtpctl.drafters.build import DraftOptions, build, parse  # noqa: E402
from mtpctl.model.sources import resolve_model  # noqa: E402
from mtpctl.model.synthetic import write_synthetic_checkpoint  # noqa: E402

PROMPTS = ["Repeat this sentence exactly, twice: The quick brown fox jumps over the lazy dog.",
           "Write a Python function that returns the n-th Fibonacci number.",
           "List three planets, one per line.",
           "Summarize in one sentence: speculative decoding verifies several drafted tokens in one pass."]
CPU_SHAPE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 256,
             "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
             "head_dim": 32, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
             "tie_word_embeddings": False}


class Table:
    """The check's rows: what ran, its figures, and whether it passed."""

    def __init__(self):
        self.rows: List[dict] = []

    def add(self, check: str, passed: Optional[bool], **figures) -> None:
        self.rows.append({"check": check, "passed": passed, **figures})
        status = "skipped" if passed is None else ("ok" if passed else "FAILED")
        print(f"gpu_check: {check}: {status} {json.dumps(figures)}", file=sys.stderr, flush=True)

    @property
    def failed(self) -> bool:
        return any(r["passed"] is False for r in self.rows)

    def markdown(self, header: str) -> str:
        lines = [header, "", "| check | result | figures |", "|---|---|---|"]
        for r in self.rows:
            status = "skipped" if r["passed"] is None else ("ok" if r["passed"] else "**FAILED**")
            figures = ", ".join(f"{k}: {v}" for k, v in r.items() if k not in ("check", "passed"))
            lines.append(f"| {r['check']} | {status} | {figures} |")
        return "\n".join(lines) + "\n"


def machine() -> str:
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return f"{props.name}, {props.total_memory / 2**30:.0f} GiB, torch {torch.__version__}"
    return f"no CUDA GPU (torch {torch.__version__}); the CPU's pure-torch path"


def checkpoint(args, work: Path, on_gpu: bool) -> Path:
    """The model folder to check: ``--model``, else a synthetic one written under ``work`` (``--shape``
    on a GPU, a small one on the CPU)."""
    if args.model:
        return resolve_model(args.model)
    config = json.loads(Path(args.shape).read_text(encoding="utf-8")) if on_gpu and args.shape else CPU_SHAPE
    out = work / "model"
    if not (out / "config.json").exists():
        start = time.perf_counter()
        write_synthetic_checkpoint(out, config, shards=2, seed=0, tokenizer_from=resolve_model(args.tokenizer_from))
        print(f"gpu_check: wrote {out} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return out


def decode_checks(session: TorchSession, table: Table, heads: Optional[Path], new: int) -> None:
    """Plain greedy per prompt, then each drafter alone and as one batch of every prompt: the same tokens."""
    ids = [session.encode(p) for p in PROMPTS]
    session.generate(ids[0], 4)  # warm-up: kernels chosen, caches allocated
    start = time.perf_counter()
    plain = [session.generate(i, new) for i in ids]
    plain_speed = sum(len(r.token_ids) for r in plain) / (time.perf_counter() - start)
    table.add("plain greedy", True, tokens_per_s=round(plain_speed, 1), prompts=len(ids))
    specs = ["ngram", "lookahead"] + (["heads", "heads+ngram"] if heads else [])
    for spec in specs:
        drafter = build(session, parse(spec), DraftOptions(heads_dir=str(heads) if heads else None))
        start = time.perf_counter()
        alone = [session.generate(i, new, drafter=drafter) for i in ids]
        speed = sum(len(r.token_ids) for r in alone) / (time.perf_counter() - start)
        same = sum(a.token_ids == p.token_ids for a, p in zip(alone, plain))
        tau = sum(r.stats.tau for r in alone) / len(alone)
        table.add(f"{spec}, one request at a time", same == len(ids), same_as_plain=f"{same}/{len(ids)}",
                  tau=round(tau, 2), tokens_per_s=round(speed, 1), speedup=round(speed / plain_speed, 2))
        batch = session.generate_batch([GenerationRequest(i, new) for i in ids], drafter, len(ids), AlwaysDraft())
        same = sum(o.token_ids == p.token_ids for o, p in zip(batch, plain))
        table.add(f"{spec}, batch of {len(ids)}", same == len(ids), same_as_plain=f"{same}/{len(ids)}")


def run(table: Table, check: str, command: List[str], timeout: int) -> Optional[subprocess.CompletedProcess]:
    """Run an mtpctl command; a failure or a time-out is a failed row."""
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    except subprocess.TimeoutExpired:
        table.add(check, False, why=f"did not finish in {timeout} s")
        return None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        table.add(check, False, exit_code=done.returncode, why=last[:200])
        return None
    table.add(check, True, seconds=round(time.perf_counter() - start, 1))
    return done


def train_heads(model: Path, work: Path, device: str, table: Table, data: str, timeout: int) -> Optional[Path]:
    """EAGLE-3 heads self-distilled on ``data``'s prompts, on the device; None where training failed."""
    out = work / "heads-eagle3"
    command = [sys.executable, "-m", "mtpctl.cli.main", "add-heads", "--model", str(model), "--kind", "eagle3",
               "--num-heads", "3", "--draft-vocab", "8192", "--data", data, "--self-distill", "--response-tokens", "64",
               "--epochs", "1", "--device", device, "--out", str(out), "--overwrite"]
    return out if run(table, f"add-heads eagle3 on {device} ({Path(data).name})", command, timeout) else None


def bench(model: Path, heads: Optional[Path], device: str, table: Table, timeout: int) -> None:
    methods = "plain,ngram" + (",heads+ngram" if heads else "")
    command = [sys.executable, "-m", "mtpctl.cli.main", "bench", "-m", str(model), "--device", device,
               "--dtype", "bfloat16", "--methods", methods, "--limit", "1", "--max-new-tokens", "64"]
    if heads:
        command += ["--heads", str(heads)]
    done = run(table, f"bench on {device} ({methods})", command, timeout)
    if done is not None:
        print(done.stdout)


def tensorrt(model: Path, work: Path, table: Table, timeout: int) -> None:
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        table.add("TensorRT engine", None, why="the tensorrt package is not installed on this machine")
        return
    export = work / "export"
    main = [sys.executable, "-m", "mtpctl.cli.main"]
    if run(table, "export --onnx --trt", main + ["export", str(model), "--onnx", str(export), "--trt", "--overwrite"],
           timeout):
        run(table, "generate --backend tensorrt", main + ["generate", "--backend", "tensorrt", "-m", str(export),
                                                           "--max-new-tokens", "16", "--no-chat", "Hello"], timeout)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a checkpoint to check (default: a synthetic one of --shape)")
    p.add_argument("--shape", default=str(REPO / "benchmarks/shapes/llama-3.2-1b-like.json"),
                   help="config of the synthetic checkpoint on a GPU")
    p.add_argument("--full-on-cpu", action="store_true",
                   help="without a GPU, run every step on the CPU's pure-torch path too (slow: checks the script)")
    p.add_argument("--tokenizer-from", default="smollm2-135m",
                   help="model (alias or folder) whose tokenizer the synthetic checkpoint takes [default: smollm2-135m]")
    p.add_argument("--work", default="/tmp/mtpctl-gpu-check", help="folder for the checkpoint, heads and export")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--data", default=str(REPO / "recipes/data/distill_prompts.jsonl"),
                   help="prompts the heads are self-distilled on")
    p.add_argument("--out", default=None, help="also write the table (markdown) to this file")
    args = p.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    full = on_gpu or args.full_on_cpu
    table = Table()
    header = f"GPU check on {machine()}"
    print(f"gpu_check: {header}", file=sys.stderr)
    model = checkpoint(args, work, on_gpu)
    session = TorchSession(model, "bfloat16", device=device, kernels="torch")
    table.add("load", True, weights_gib=round(session.weight_bytes / 2**30, 2), device=session.device,
              greedy_exactness=session.greedy_exactness)
    heads = None
    if full:
        heads = train_heads(model, work, device, table, args.data, timeout=240 if on_gpu else 1200)
    decode_checks(session, table, heads, args.max_new_tokens if on_gpu else 24)
    if full:
        bench(model, heads, device, table, timeout=180 if on_gpu else 600)
        tensorrt(model, work, table, timeout=240)
    if not on_gpu:
        table.add("CUDA checks", None, why="no CUDA GPU here: run this script where torch sees one")
    text = table.markdown(f"### {header}\n\n`benchmarks/gpu_check.sh {' '.join(argv or sys.argv[1:])}`".rstrip())
    print(text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    return 1 if table.failed else 0


if __name__ == "__main__":
    sys.exit(main())
