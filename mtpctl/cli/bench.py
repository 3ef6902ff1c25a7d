"""``mtpctl bench``: latency figures of decoding methods, side by side, with gates for pipelines."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
from pathlib import Path
from typing import Dict, List, Optional

import click

from mtpctl.cli.backends import backend_option, open_session
from mtpctl.model.sources import DEFAULT_MODEL, gguf_source
from mtpctl.errors import BadInput, GateFailed
from mtpctl.runtime.bench import (cpu_model, llamacpp_runner, load_prompts, run_interleaved, summarize,
                                  transformers_runner)
from mtpctl.cli.drafting import (RETRIEVAL_NODES, DraftOptions, build_drafter, check_options, datastore_path,
                                 load_parts, parse_drafters)
from mtpctl.decode.sampling import SamplingParams
from mtpctl.runtime.session import set_threads

def parse_methods(text: str) -> List[str]:
    """``plain,ngram`` -> the list, ``plain`` first (the speedup baseline). A method is ``plain``,
    ``draft``, or a drafter spec of :func:`mtpctl.cli.drafting.parse_drafters` (``heads+ngram``).

    Raises:
        BadInput: an unknown method.
    """
    names = []
    for name in (n.strip() for n in text.split(",") if n.strip()):
        parts = () if name == "plain" else parse_drafters(name)
        if name != "plain" and not parts:
            raise BadInput("unknown method 'none': plain decoding is the method 'plain'")
        names.append("+".join(parts) or name)  # heads+ngram, not ngram+heads
    return ["plain"] + [n for n in dict.fromkeys(names) if n != "plain"]


@click.command("bench", epilog="""\b
Examples:
  mtpctl bench --methods plain,ngram --max-new-tokens 64 --limit 1
  mtpctl bench --dtype bfloat16 --weights int4 --methods plain,ngram --limit 2 --json bench.json --plot bench.png
  mtpctl bench --methods plain,ngram --limit 1 --fail-below-speedup 1.1 --fail-above-p99-ms 80 || echo "exit $?"
  mtpctl bench --baseline transformers --categories code,summarization --limit 3
  mtpctl bench --dtype bfloat16 --weights int4 --methods plain,ngram --baseline llama.cpp --limit 1
  mtpctl bench --backend onnxruntime -m out/smollm2-onnx --methods plain,ngram --limit 2
  mtpctl bench --methods plain,heads --heads heads/smollm2-medusa --dtype bfloat16 --limit 1 --fail-below-speedup 1.1
  mtpctl bench --methods plain,heads,heads+ngram --heads heads/smollm2-medusa --dtype bfloat16 --draft-len 3 --limit 2
  mtpctl bench --methods plain,heads+ngram,heads+ngram+retrieval --heads heads/smollm2-medusa --dtype bfloat16 --limit 1
  mtpctl bench --methods plain,draft --draft smollm2-135m -m gemma3-270m --limit 1
""")
@click.option("-m", "--model", default=DEFAULT_MODEL, show_default=True, help="Alias, folder, .gguf or hub id.")
@click.option("--methods", default="plain,ngram", show_default=True,
              help="Comma-separated: plain, draft (--draft), or drafters as in generate --speculate: ngram, heads "
                   "(--heads), retrieval (--datastore or the heads' datastore) or several joined by '+' "
                   "(heads+ngram merges the heads' tree with a --draft-len prompt-lookup chain).")
@click.option("--heads", "heads_dir", type=click.Path(file_okay=False), default=None,
              help="MTP head folder (mtpctl add-heads) for the heads methods.")
@click.option("--tree-nodes", type=click.IntRange(min=1), default=None,
              help="Draft tree size for the heads methods [default: 4].")
@click.option("--datastore", type=click.Path(dir_okay=False), default=None,
              help="Retrieval datastore for the retrieval methods [default: the one in --heads].")
@click.option("--retrieval-nodes", type=click.IntRange(min=1), default=None,
              help="Nodes of the retrieval drafter's tree [default: 4].")
@click.option("--prompts", "prompts_path", type=click.Path(dir_okay=False), help="JSONL prompt set (default: built-in).")
@click.option("--categories", default=None, help="Only these categories (comma-separated).")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="At most N prompts per category.")
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True, help="Rounds over the prompts.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--draft-len", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--draft", "draft_model", default=None,
              help="Draft model for the draft method (alias, folder, .gguf); see mtpctl pair.")
@backend_option
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True)
@click.option("--weights", type=click.Choice(["dense", "int4"]), default="dense", show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=None, help="CPU threads (default: torch's).")
@click.option("--baseline", type=click.Choice(["none", "transformers", "llama.cpp"]), default="none", show_default=True,
              help="Add peers: HF transformers' generate (plain and prompt lookup) on the checkpoint, or llama.cpp "
                   "(llama-cpp-python, installed separately) on the model's GGUF file.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write every figure to this JSON file.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Draw tokens/s and accept lengths (PNG).")
@click.option("--fail-below-speedup", type=float, default=None, help="Exit 1 if a method's speedup is below X.")
@click.option("--fail-above-p99-ms", type=float, default=None, help="Exit 1 if a method's p99 ITL is above Y ms.")
@click.option("--debug", is_flag=True, help="Show the full traceback of an error.")
def bench_cmd(model, methods, heads_dir, tree_nodes, datastore, retrieval_nodes, prompts_path, categories, limit, repeats, max_new_tokens, temperature, seed,
              draft_len, draft_model, backend, dtype, weights, threads, baseline, json_path, plot_path, fail_below_speedup,
              fail_above_p99_ms, debug) -> None:
    """Run decoding methods on the same prompts in one process and compare them.

    Methods are interleaved over --repeats rounds after a warm-up. The table goes to stdout,
    progress to stderr. Gates exit with code 1 naming the methods that missed them.
    """
    names = parse_methods(methods)
    drafter_parts = {n: parse_drafters(n) for n in names if n not in ("plain", "draft")}
    used = tuple(p for parts in drafter_parts.values() for p in parts)
    opts = DraftOptions(heads_dir, None, tree_nodes, draft_len, datastore=datastore, retrieval_nodes=retrieval_nodes)
    check_options(used, opts, "--methods")
    for target in (json_path, plot_path):
        if target:
            check_writable(Path(target))
    if baseline == "transformers" and backend != "torch":
        raise BadInput("--baseline transformers runs on the checkpoint: use --backend torch")
    if baseline != "none" and temperature > 0:
        raise BadInput(f"--baseline {baseline} compares greedy decoding: use --temperature 0")
    gguf = None
    if baseline == "llama.cpp":
        if backend != "torch":
            raise BadInput("--baseline llama.cpp compares with mtpctl's torch runtime: use --backend torch")
        if importlib.util.find_spec("llama_cpp") is None:
            raise BadInput("--baseline llama.cpp needs llama-cpp-python: pip install llama-cpp-python "
                           "(it compiles llama.cpp from source, several minutes)")
        gguf = gguf_source(model)
    prompts = select_prompts(load_prompts(Path(prompts_path) if prompts_path else None), categories, limit)
    set_threads(threads)
    session = open_session(model, backend, dtype, weights, threads)
    encoded = [session.codec.encode_messages(list(p.messages)) for p in prompts]
    sampling = SamplingParams(temperature, seed=seed)

    def method(drafter, k, with_heads=None):
        return lambda ids: session.generate(ids, max_new_tokens, sampling, drafter, k, heads=with_heads)

    runners = {"plain": method(None, 0)}
    weight_bytes_by_method = {}
    if "draft" in names:
        runners["draft"], weight_bytes_by_method["draft"] = draft_method(session, draft_model, sampling, draft_len,
                                                                         dtype, max_new_tokens)
    elif draft_model:
        raise BadInput("--draft goes with the draft method (--methods plain,draft)")
    heads, store = load_parts(session, used, opts)
    # torch heads hold their own weights; heads fused into an exported graph are in its weights already
    head_bytes = sum(t.numel() * t.element_size() for t in heads.state_dict().values()) \
        if hasattr(heads, "state_dict") else 0
    for name, parts in drafter_parts.items():
        drafter, k = build_drafter(session, parts, opts, heads, store)
        runners[name] = method(drafter, k, heads if "heads" in parts else None)
        weight_bytes_by_method[name] = (head_bytes if "heads" in parts else 0) + \
            (store.tokens.nbytes + store.keys.nbytes if "retrieval" in parts else 0)
    runners = {n: runners[n] for n in names}
    if baseline == "transformers":
        for name, lookup in (("hf", 0), ("hf-prompt-lookup", draft_len)):
            runners[name] = transformers_runner(session.folder, session.codec.eos_ids, max_new_tokens, lookup)
    if gguf is not None:
        import torch

        runners["llama.cpp"] = llamacpp_runner(gguf, session.codec.eos_ids, max_new_tokens, torch.get_num_threads())
    runs = run_interleaved(runners, encoded, repeats, progress=lambda line: click.echo(line, err=True))
    weight_bytes = session.model.weight_bytes if backend == "torch" else session.weight_bytes  # n-gram drafting holds no weights of its own
    report = build_report(runs, prompts, {name: weight_bytes + weight_bytes_by_method.get(name, 0) for name in names}, {
        "model": str(session.folder), "backend": backend, "dtype": dtype, "weights": weights, "max_new_tokens": max_new_tokens,
        "temperature": temperature, "draft_len": draft_len, "draft": draft_model, "repeats": repeats, "prompts": len(prompts),
        "heads": heads_dir, "tree_nodes": tree_nodes, "datastore": str(datastore_path(opts)) if "retrieval" in used else None,
        "retrieval_nodes": (retrieval_nodes or RETRIEVAL_NODES) if "retrieval" in used else None, "seed": seed,
        "attention": session.attention if backend == "torch" else None,
        "int4_kernel": session.int4_kernel if backend == "torch" else None})
    click.echo(format_table(report))
    if json_path:
        write_json(Path(json_path), report)
    if plot_path:
        plot(Path(plot_path), report, runs)
    check_gates(report, fail_below_speedup, fail_above_p99_ms)


def draft_method(session, draft_model: Optional[str], sampling, draft_len: int, dtype: str, max_new_tokens: int):
    """(runner, draft weight bytes) of the draft method: draft-model speculation with --draft
    (ids, id map or cross-tokenizer text, as mtpctl pair decides). BadInput without --draft."""
    from mtpctl.convert.pairing import session_drafter

    if not draft_model:
        raise BadInput("the draft method needs --draft MODEL (a smaller model; check it with mtpctl pair)")
    drafter, pairing = session_drafter(session, draft_model, sampling, draft_len, dtype=dtype)
    click.echo(f"draft {pairing.draft.folder}: {pairing.verdict}, drafting in {pairing.mode}", err=True)
    return (lambda ids: session.generate(ids, max_new_tokens, sampling, drafter, draft_len)), drafter.model.weight_bytes


def select_prompts(prompts, categories: Optional[str], limit: Optional[int]):
    """Keep the listed categories (all when None), at most ``limit`` prompts each."""
    wanted = [c.strip() for c in categories.split(",")] if categories else None
    known = {p.category for p in prompts}
    for c in wanted or []:
        if c not in known:
            raise BadInput(f"no prompt in category {c!r} (have: {', '.join(sorted(known))})")
    kept, counts = [], {}
    for p in prompts:
        if (wanted is None or p.category in wanted) and counts.get(p.category, 0) < (limit or 1 << 30):
            counts[p.category] = counts.get(p.category, 0) + 1
            kept.append(p)
    return kept


def build_report(runs, prompts, weight_bytes: Dict[str, int], settings: dict) -> dict:
    """Every figure: per method overall, per category tokens/s, the settings and the machine.
    ``weight_bytes``: method -> bytes of the weights it runs (peers unknown: omitted)."""
    import torch

    plain = runs["plain"]
    methods = [summarize(r, plain if name != "plain" else None, weight_bytes.get(name)) for name, r in runs.items()]
    categories: Dict[str, Dict[str, float]] = {}
    for name, r in runs.items():
        for result, i in zip(r.results, r.prompt_index):
            cat = categories.setdefault(prompts[i].category, {}).setdefault(name, [0, 0.0])
            cat[0] += result.stats.new_tokens
            cat[1] += result.stats.total_ms
    per_category = {c: {n: t / (ms / 1e3) if ms else 0.0 for n, (t, ms) in m.items()} for c, m in categories.items()}
    machine = {"cpu": cpu_model(), "logical_cpus": os.cpu_count(), "threads": torch.get_num_threads(),
               "torch": torch.__version__, "python": platform.python_version()}
    return {"format_version": 1, "settings": settings, "machine": machine, "methods": methods,
            "tokens_per_s_by_category": per_category}


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(report: dict) -> str:
    """The methods as a markdown table (the same numbers as the JSON, rounded)."""
    lines = ["| method | tokens/s | speedup (p10-p90) | TTFT p50 ms | ITL p50 / p90 / p99 ms | tau | acceptance "
             "| by position | peak memory MiB |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for m in report["methods"]:
        speed = "1.00 (baseline)" if m["method"] == "plain" else (
            f"{_fmt(m.get('speedup'), '.2f')} ({_fmt(m.get('speedup_p10'), '.2f')}-{_fmt(m.get('speedup_p90'), '.2f')})")
        itl = " / ".join(_fmt(m[k], ".1f") for k in ("itl_ms_p50", "itl_ms_p90", "itl_ms_p99"))
        positions = " ".join(f"{a:.2f}" for a in m["acceptance_by_position"]) or "-"
        lines.append(f"| {m['method']} | {m['tokens_per_s']:.1f} | {speed} | {_fmt(m['ttft_ms_p50'], '.1f')} | {itl} "
                     f"| {_fmt(m['tau'], '.2f')} | {_fmt(m['acceptance_rate'], '.2f')} | {positions} "
                     f"| {_fmt(m['peak_memory_bytes'] and m['peak_memory_bytes'] / 2**20, '.1f')} |")
    cats = report["tokens_per_s_by_category"]
    names = [m["method"] for m in report["methods"]]
    lines += ["", "| category | " + " | ".join(f"{n} tokens/s" for n in names) + " |",
              "|---|" + "---:|" * len(names)]
    for c, row in cats.items():
        lines.append(f"| {c} | " + " | ".join(f"{row.get(n, 0.0):.1f}" for n in names) + " |")
    return "\n".join(lines)


def check_writable(path: Path) -> None:
    """BadInput unless ``path`` can be written (its folder exists and is writable; not a folder)."""
    folder = path.parent
    if path.is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK):
        raise BadInput(f"cannot write {path}: its folder does not exist or is not writable")


def write_json(path: Path, report: dict) -> None:
    """Write the report atomically (temporary file, then rename). BadInput if it cannot be written."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(report, indent=2))
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise BadInput(f"cannot write {path}: {err.strerror}") from err


def plot(path: Path, report: dict, runs) -> None:
    """tokens/s per method and the accept-length histogram of the speculative ones (matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise BadInput("--plot needs matplotlib: pip install 'mtpctl[plot]'") from err
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    names = [m["method"] for m in report["methods"]]
    left.barh(names, [m["tokens_per_s"] for m in report["methods"]])  # horizontal: long names stay readable
    left.invert_yaxis()
    left.set_xlabel("tokens/s")
    left.set_title("decoding speed")
    for m in report["methods"]:
        hist = m["accept_length_histogram"]
        if m["method"] != "plain" and hist:
            right.bar([int(k) for k in hist], list(hist.values()), alpha=0.6, label=m["method"])
    right.set_xlabel("accept length per step (bonus counted)")
    right.set_ylabel("decode steps")
    right.set_title("accepted length")
    if right.get_legend_handles_labels()[0]:
        right.legend()
    fig.tight_layout()
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    try:
        fig.savefig(tmp)
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise BadInput(f"cannot write {path}: {err.strerror}") from err
    finally:
        plt.close(fig)


def check_gates(report: dict, min_speedup: Optional[float], max_p99_ms: Optional[float]) -> None:
    """Raise GateFailed (exit 1) naming each method that misses a gate (``plain`` has no speedup gate)."""
    misses = []
    for m in report["methods"]:
        if min_speedup is not None and m["method"] != "plain" and m.get("speedup") is not None \
                and m["speedup"] < min_speedup:
            misses.append(f"{m['method']} speedup {m['speedup']:.4g} < {min_speedup}")
        if max_p99_ms is not None and m["itl_ms_p99"] is not None and m["itl_ms_p99"] > max_p99_ms:
            misses.append(f"{m['method']} p99 ITL {m['itl_ms_p99']:.2f} ms > {max_p99_ms}")
    if misses:
        raise GateFailed("gate missed: " + "; ".join(misses))
