"""``mtpctl bench``: latency figures of decoding methods, side by side, with gates for pipelines."""

from __future__ import annotations

import importlib.util
import json
import resource
import tempfile
from pathlib import Path
from typing import Optional

import click

from mtpctl.bench.harness import load_prompts, run_interleaved
from mtpctl.bench.rounds import (batched_reports, format_rounds, forgetting, gate_rows, learning, round_reports,
                                 run_batched_rounds, run_rounds)
from mtpctl.bench.methods import build_methods, parse_methods
from mtpctl.bench.peer_process import DEFAULT_TIMEOUT_S, start_peer
from mtpctl.bench.batched import format_batched, plot_batched, run_batch_sizes, stops_paying, summarize_batched
from mtpctl.bench.report import (build_report, check_gates, check_peers, format_profile, format_table, plot,
                                 select_prompts, write_json)
from mtpctl.bench.vllm_peer import apply_figures, require_vllm, vllm_batched, vllm_peers
from mtpctl.cli.options import (Command, check_backend, debug_option, draft_line, drafter_options, model_options,
                                pipeline_spec_from, policy_option, sampling_from, sampling_options)
from mtpctl.decode.session import GenerationRequest
from mtpctl.drafters.build import RETRIEVAL_NODES, datastore_path, draft_member
from mtpctl.drafters.pipeline import check_spec, open_target
from mtpctl.drafters.lookahead import LookaheadSettings
from mtpctl.drafters.suffix import SuffixSettings
from mtpctl.errors import BadInput
from mtpctl.files import check_writable, write_file
from mtpctl.drafters.mtp import check_mtp_layers
from mtpctl.model.config import DecoderConfig
from mtpctl.model.sources import gguf_source, resolve_model


@click.command("bench", cls=Command, aliases={"speculate": "methods"}, epilog="""\b
Examples:
  mtpctl bench --methods plain,ngram --max-new-tokens 64 --limit 1
  mtpctl bench --dtype bfloat16 --weights int4 --methods plain,ngram --limit 2 --json bench.json --plot bench.png
  mtpctl bench --methods plain,ngram --limit 1 --fail-below-speedup 1.1 --fail-above-p99-ms 80 || echo "exit $?"
  mtpctl bench --baseline transformers --categories code,summarization --limit 2
  mtpctl bench --baseline vllm --methods plain,ngram,heads --heads heads/smollm2-eagle3 --limit 1   (make vllm-env)
  mtpctl bench --dtype bfloat16 --weights int4 --methods plain,ngram --baseline llama.cpp --limit 1
  mtpctl bench --backend onnxruntime -m out/smollm2-onnx --methods plain,ngram --limit 2
  mtpctl bench --methods plain,heads --heads heads/smollm2-medusa --dtype bfloat16 --limit 1 --fail-below-speedup 1.1
  mtpctl bench --methods plain,heads,heads+ngram --heads heads/smollm2-medusa --dtype bfloat16 --draft-len 3 --limit 2
  mtpctl bench --methods plain,heads+ngram,heads+ngram+retrieval --heads heads/smollm2-medusa --dtype bfloat16 --limit 1
  mtpctl bench --methods plain,draft --draft smollm2-135m -m gemma3-270m --limit 1
  mtpctl bench --dtype bfloat16 --methods plain,ngram,lookahead,ngram+lookahead --limit 1
  mtpctl bench --dtype bfloat16 --methods plain,ngram,suffix,suffix+ngram --rounds 3 --limit 1 --max-new-tokens 64
  mtpctl bench --dtype bfloat16 --methods plain,draft,heads+draft --draft self --heads heads/smollm2-medusa --limit 1
  mtpctl bench --dtype bfloat16 --methods plain,ngram,heads+ngram --heads heads/smollm2-medusa --batch-sizes 1,2,4,8 --limit 3 --max-new-tokens 64 --plot batch.png
""")
@click.option("--methods", default="plain,ngram", show_default=True,
              help="Comma-separated: plain, or drafters as in generate --speculate: ngram, heads (--heads), draft "
                   "(--draft), retrieval (--datastore or the heads' datastore), suffix (--suffix-*; see --rounds), "
                   "lookahead (--lookahead) or several "
                   "joined by '+' (heads+ngram merges the heads' tree with a --draft-len prompt-lookup chain).")
@click.option("--batch-sizes", default=None,
              help="Comma-separated batch sizes (e.g. 1,2,4,8,16): every method runs the whole prompt set through "
                   "continuous batching at each size; the table gives throughput, speedup over plain at the same "
                   "size, TTFT and ITL per request, and where each method stops paying.")
@policy_option
@drafter_options
@sampling_options
@model_options
@click.option("--prompts", "prompts_path", type=click.Path(dir_okay=False), help="JSONL prompt set (default: built-in).")
@click.option("--categories", default=None, help="Only these categories (comma-separated).")
@click.option("--limit", type=click.IntRange(min=1), default=None, help="At most N prompts per category.")
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True,
              help="Rounds over the prompts (with --batch-sizes: rounds over every size and method, the speedup "
                   "the median of each round's paired ratio, with its range).")
@click.option("--rounds", type=click.IntRange(min=1), default=1, show_default=True,
              help="Run the prompts this many times in a row and report each round in its own table: a suffix "
                   "drafter learns from the responses it served, so round 1 is cold and rounds 2+ warm (its global "
                   "index holds the earlier rounds' responses; the warm-up is forgotten first). With --batch-sizes, "
                   "each round at every size.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--baseline", type=click.Choice(["none", "transformers", "transformers-mtp", "llama.cpp", "vllm"]),
              default="none", show_default=True,
              help="Add peers: HF transformers' generate (plain and prompt lookup; transformers-mtp: plain and "
                   "drafting with the checkpoint's own MTP layers, use_mtp) on the checkpoint, llama.cpp "
                   "(llama-cpp-python, installed separately) on the model's GGUF file, or vLLM (its own virtualenv, "
                   "make vllm-env: plain, its n-gram speculation, and the --heads exported for it). Each peer runs in "
                   "its own process: one that crashes, hangs past --peer-timeout or cannot start gets a row marked "
                   "failed, every other figure is written, and the exit code is 4.")
@click.option("--peer-timeout", type=click.FloatRange(min=1), default=DEFAULT_TIMEOUT_S, show_default=True,
              help="Seconds a peer may take to load or to answer one run before it is stopped and marked failed.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write every figure to this JSON file.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Draw tokens/s and accept lengths (PNG).")
@click.option("--profile", is_flag=True,
              help="Also print where each method's decode steps spend their time (draft, the target's pass, lm_head "
                   "rows, acceptance, commit) and what lies outside the pass. On a CUDA GPU every timed run waits for "
                   "the device at each phase's end, so each phase gets its own GPU time.")
@click.option("--fail-below-speedup", type=float, default=None, help="Exit 1 if a method's speedup is below X.")
@click.option("--fail-above-p99-ms", type=float, default=None, help="Exit 1 if a method's p99 ITL is above Y ms.")
@debug_option
def bench_cmd(methods, batch_sizes, prompts_path, categories, limit, repeats, rounds, max_new_tokens, baseline,
              peer_timeout, json_path, plot_path, profile, fail_below_speedup, fail_above_p99_ms, debug,
              **options) -> None:
    """Run decoding methods on the same prompts in one process and compare them.

    Methods are interleaved over --repeats rounds after a warm-up. The table goes to stdout,
    progress to stderr. Gates exit with code 1 naming the methods that missed them; a peer that
    failed (--baseline) exits 4 once everything else is written.
    """
    names = parse_methods(methods)
    sizes = parse_batch_sizes(batch_sizes) if batch_sizes is not None else None
    if sizes and baseline not in ("none", "vllm"):
        raise BadInput(f"--baseline {baseline} runs one request at a time: only vllm batches with --batch-sizes")
    spec = pipeline_spec_from(options)
    opts = spec.draft
    used = {p for name in names if name != "plain" for p in name.split("+")}
    _check_rounds(rounds, repeats, baseline, "suffix" in used)
    check_spec(spec, used)  # before the model loads
    for target in (json_path, plot_path):
        if target:
            check_writable(Path(target))
    sampling = sampling_from(options)
    gguf = None
    if baseline != "none":
        check_backend(options, f"--baseline {baseline}")
        if not sampling.greedy:
            raise BadInput(f"--baseline {baseline} compares greedy decoding: use --temperature 0")
    if baseline == "vllm":
        require_vllm()
    if baseline == "transformers-mtp":
        folder = resolve_model(spec.model)
        cfg = DecoderConfig.from_folder(folder)
        check_mtp_layers(cfg, folder, option="baseline", instead="compare with the transformers baseline")
        if not cfg.family.mtp_layout.transformers_reads:
            raise BadInput(f"transformers does not read the MTP layers of {cfg.model_type} checkpoints: compare "
                           "with --baseline vllm, or none", option="baseline")
    if baseline == "llama.cpp":
        if importlib.util.find_spec("llama_cpp") is None:
            raise BadInput("--baseline llama.cpp needs llama-cpp-python: pip install llama-cpp-python "
                           "(it compiles llama.cpp from source, several minutes)")
        gguf = gguf_source(spec.model)
    prompts = select_prompts(load_prompts(Path(prompts_path) if prompts_path else None), categories, limit)
    session = open_target(spec)
    loaded_rss = peak_rss_bytes()
    encoded = [session.codec.encode_messages(list(p.messages)) for p in prompts]
    vllm_timeout = peer_timeout * len(encoded) * repeats  # vLLM answers a whole run at once
    built = build_methods(session, names, spec, sampling, max_new_tokens,
                          progress=lambda line: click.echo(f"mtpctl: {line}", err=True))
    draft = next((d for d in map(draft_member, (m.drafter for m in built.values())) if d is not None), None)
    if draft is not None:
        click.echo(draft_line(draft.describe()), err=True)
    weights = {name: session.weight_bytes + m.drafter_bytes for name, m in built.items()}
    if sizes and (rounds > 1 or learning({n: m.drafter for n, m in built.items()})):
        _bench_batched_rounds(session, built, encoded, rounds, sizes,
                              lambda ids: GenerationRequest(ids, max_new_tokens, sampling),
                              lambda name: built[name].pipeline.new_policy(), spec.acceptance, weights, json_path,
                              plot_path, fail_below_speedup, fail_above_p99_ms)
        return
    if sizes:
        peers = {}
        if baseline == "vllm":
            with tempfile.TemporaryDirectory(prefix="mtpctl-vllm-heads-") as tmp:
                configs = vllm_configs(session, opts, Path(tmp) / "heads")
                peers = vllm_batched(session.folder, configs, encoded * repeats, sizes, max_new_tokens,
                                     spec.dtype, torch_threads(), session.codec.eos_ids,
                                     timeout=vllm_timeout, progress=lambda line: click.echo(f"mtpctl: {line}", err=True))
        _bench_batched(session, built, encoded, repeats, sizes, max_new_tokens, sampling, spec.acceptance, weights,
                       peers, json_path, plot_path, fail_below_speedup, fail_above_p99_ms)
        return
    runners = {name: m.run for name, m in built.items()}
    opened = []  # the peers' processes, stopped when the command ends (whatever way it ends)
    click.get_current_context().call_on_close(lambda: [peer.close() for peer in opened])
    peers, builds = _process_peers(baseline, session, gguf, opts, max_new_tokens, peer_timeout, opened)
    runners.update(peers)
    peer_runs, figures = {}, {}
    if baseline == "vllm":
        with tempfile.TemporaryDirectory(prefix="mtpctl-vllm-heads-") as tmp:
            configs = vllm_configs(session, opts, Path(tmp) / "heads")
            peer_runs, figures = vllm_peers(session.folder, configs, encoded, repeats, max_new_tokens, spec.dtype,
                                            torch_threads(), session.codec.eos_ids, timeout=vllm_timeout,
                                            progress=lambda line: click.echo(f"mtpctl: {line}", err=True))
    drafters, per_round = {name: m.drafter for name, m in built.items()}, None
    start = max((m.cache.index.sequences for m in learning(drafters).values()), default=0)
    if rounds > 1 or learning(drafters):  # learning drafters: the warm-up forgotten, each round reported
        per_round = run_rounds(runners, encoded, rounds, forgetting(drafters),
                               progress=lambda line: click.echo(line, err=True))
        runs = dict(per_round[-1])
    else:
        runs = run_interleaved(runners, encoded, repeats, progress=lambda line: click.echo(line, err=True))
    runs.update(peer_runs)
    torch_backend = spec.backend == "torch"
    settings = {
        "model": str(session.folder), "backend": spec.backend, "dtype": spec.dtype,
        "weights": spec.weights, "max_new_tokens": max_new_tokens, "temperature": sampling.temperature,
        "top_k": sampling.top_k, "top_p": sampling.top_p, "seed": sampling.seed, "acceptance": spec.acceptance,
        "draft_len": opts.draft_len or "auto", "draft": opts.draft_model, "repeats": repeats, "prompts": len(prompts),
        "lookahead": _lookahead_field(opts.lookahead) if "lookahead" in used else None,
        "heads": opts.heads_dir, "tree": opts.tree_file, "tree_nodes": opts.tree_nodes, "dynamic_tree": opts.dynamic_tree,
        "ngram_max": opts.ngram_max, "ngram_min": opts.ngram_min, "rounds": rounds,
        "suffix": (opts.suffix or SuffixSettings()).recorded() if "suffix" in used else None,
        "datastore": str(datastore_path(opts)) if "retrieval" in used else None,
        "retrieval_nodes": (opts.retrieval_nodes or RETRIEVAL_NODES) if "retrieval" in used else None,
        "attention": session.attention if torch_backend else None,
        "int4_kernel": session.int4_kernel if torch_backend else None,
        "matmul_isa": session.matmul_isa if torch_backend else None,
        "device": session.device if torch_backend else None, "kernels": session.kernels if torch_backend else None,
        "cuda_graphs": spec.cuda_graphs,
        "greedy_exactness": session.greedy_exactness if torch_backend else None,
        "device_numerics": session.device_numerics if torch_backend else None,
        "matmul_paths": session.matmul_paths if torch_backend else None,
        "policy_table": _policy_tables(built), "peer_builds": builds or None}
    report = build_report(runs, prompts, weights, settings)
    if per_round is not None:  # the report of the last round, and every round's
        report["rounds"] = round_reports(per_round, prompts, weights, settings, drafters, start)
    on_host = session.weight_bytes if spec.backend != "torch" or session.device == "cpu" else 0
    report["host_memory"] = host_memory(session.weight_bytes, on_host, loaded_rss)
    click.echo(host_memory_line(report["host_memory"]), err=True)
    apply_figures(report, figures)
    click.echo(format_rounds(report["rounds"]) if "rounds" in report else format_table(report))
    if profile:
        click.echo("\n" + format_profile(report))
    if json_path:
        write_json(Path(json_path), report)
    if plot_path:
        plot(Path(plot_path), report, runs)
    rows = gate_rows(report["rounds"]) if "rounds" in report else report["methods"]
    check_gates(rows, fail_below_speedup, fail_above_p99_ms)
    check_peers(report["methods"])


def _process_peers(baseline, session, gguf, opts, max_new_tokens, timeout_s, opened) -> tuple:
    """The runners of the transformers or llama.cpp peers, each started in its own process (``opened``),
    and which build of each runs (None for one that could not start)."""
    import torch

    common = {"eos_ids": sorted(session.codec.eos_ids), "max_new_tokens": max_new_tokens,
              "threads": torch.get_num_threads()}
    requests = {}
    if baseline == "transformers":
        for name, lookup in (("hf", 0), ("hf-prompt-lookup", opts.draft_len or 3)):
            requests[name] = {"peer": "transformers", "folder": str(session.folder), "prompt_lookup_num_tokens": lookup}
    if baseline == "transformers-mtp":
        for name, use_mtp in (("hf", False), ("hf-mtp", True)):
            requests[name] = {"peer": "transformers", "folder": str(session.folder), "use_mtp": use_mtp}
    if gguf is not None:
        requests["llama.cpp"] = {"peer": "llama.cpp", "gguf": str(gguf)}
    runners, builds = {}, {}
    for name, request in requests.items():
        click.echo(f"mtpctl: {name}: starting in its own process", err=True)
        runners[name], builds[name] = start_peer(name, {**request, **common}, session.codec.eos_ids, opened, timeout_s)
    return runners, builds


def _check_rounds(rounds: int, repeats: int, baseline: str, learns: bool) -> None:
    """BadInput for --rounds with --repeats or the vLLM peer, and for --repeats with a drafter that learns
    from round to round (whose rounds --repeats would pool)."""
    if rounds > 1 and repeats > 1:
        raise BadInput("--rounds reports each round on its own, --repeats pools its rounds: give one of them")
    if rounds > 1 and baseline == "vllm":
        raise BadInput("--rounds does not run the vllm peer: drop --baseline vllm")
    if repeats > 1 and learns:
        raise BadInput("a suffix drafter learns from round to round, which --repeats would pool: use --rounds")


def _policy_tables(built: dict) -> Optional[dict]:
    """The ``policy_table`` of a report: the pass-cost table the methods share, its ``draft`` the cost
    of each drafting method's drafter by method name (None where no method's policy reads a table)."""
    tables = {name: m.pipeline.table for name, m in built.items() if getattr(m.pipeline, "table", None) is not None}
    if not tables:
        return None
    return {**next(iter(tables.values())).describe(), "draft": {name: t.describe()["draft"] for name, t in tables.items()}}


def _bench_batched_rounds(session, built, encoded, rounds, sizes, make_request, make_policy, acceptance, weights,
                          json_path, plot_path, fail_below_speedup, fail_above_p99_ms) -> None:
    """``--batch-sizes`` with ``--rounds`` (or a learning drafter): each round every method at every
    batch size (:func:`mtpctl.bench.rounds.run_batched_rounds`), each round's table, the gates on all."""
    drafters = {name: m.drafter for name, m in built.items()}
    start = max((m.cache.index.sequences for m in learning(drafters).values()), default=0)
    per_round = run_batched_rounds(session, drafters, encoded, sizes, make_request, make_policy, acceptance, rounds,
                                   forgetting(drafters), progress=lambda line: click.echo(line, err=True))
    reports = batched_reports(per_round, weights, drafters, start)
    click.echo(format_rounds(reports))
    if json_path:
        write_file(Path(json_path), json.dumps({"format_version": 1, "batch_sizes": sizes, "rounds": reports},
                                               indent=2))
    if plot_path:
        plot_batched(Path(plot_path), reports[-1]["rows"])
    check_gates(gate_rows(reports), fail_below_speedup, fail_above_p99_ms)


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far, bytes (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def host_memory(weights: int, on_host: int, loaded_rss: int) -> dict:
    """The target's weight bytes (``on_host`` of them in host memory: 0 on a GPU) beside the process's
    measured peak resident memory after loading and after every run (the whole process: Python, torch
    and the tokenizer included)."""
    return {"weight_bytes": weights, "weights_on_host_bytes": on_host, "peak_rss_after_load_bytes": loaded_rss,
            "peak_rss_bytes": peak_rss_bytes()}


def host_memory_line(memory: dict) -> str:
    """The stderr line of :func:`host_memory`: GiB, and the peaks as multiples of the weights held in host memory."""
    gib = 2 ** 30
    line = f"mtpctl: host memory: peak RSS {memory['peak_rss_after_load_bytes'] / gib:.2f} GiB after loading, " \
           f"{memory['peak_rss_bytes'] / gib:.2f} GiB after the runs"
    if memory["weights_on_host_bytes"]:
        held = memory["weights_on_host_bytes"]
        line += (f"; weights {held / gib:.2f} GiB ({memory['peak_rss_after_load_bytes'] / held:.2f}x and "
                 f"{memory['peak_rss_bytes'] / held:.2f}x of them)")
    return line


def parse_batch_sizes(text: str) -> list:
    """``1,2,4`` -> ``[1, 2, 4]`` (sorted, each once).

    Raises:
        BadInput: not a list of integers >= 1.
    """
    try:
        sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1:
        raise BadInput(f"batch sizes {text!r}: give integers >= 1 separated by commas, e.g. 1,2,4,8", option="batch_sizes")
    return sizes


def _bench_batched(session, built, encoded, rounds, sizes, max_new_tokens, sampling, acceptance, weights,
                   peers, json_path, plot_path, fail_below_speedup, fail_above_p99_ms) -> None:
    """``--batch-sizes``: every method at every batch size over ``rounds`` rounds
    (:mod:`mtpctl.bench.batched`), each run under a fresh policy of its pipeline, beside the peers'
    runs at the same sizes (``peers``: vLLM's, one run each over every round's requests)."""
    drafters = {name: m.drafter for name, m in built.items()}
    runs = run_batch_sizes(session, drafters, encoded, sizes,
                           lambda ids: GenerationRequest(ids, max_new_tokens, sampling),
                           lambda name: built[name].pipeline.new_policy(), acceptance,
                           progress=lambda line: click.echo(line, err=True), rounds=rounds)
    runs.update({key: [run] for key, run in peers.items()})
    rows = summarize_batched(runs, weights)
    click.echo(format_batched(rows))
    if json_path:
        write_file(Path(json_path), json.dumps({"format_version": 1, "batch_sizes": sizes, "rows": rows,
                                                "stops_paying": stops_paying(rows)}, indent=2))
    if plot_path:
        plot_batched(Path(plot_path), rows)
    check_gates(rows, fail_below_speedup, fail_above_p99_ms)
    check_peers(rows)


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def vllm_configs(session, opts, heads_out: Path) -> dict:
    """vLLM peer name -> (speculative_config, weights_track): plain, n-gram with the run's
    --draft-len / --ngram-max / --ngram-min, and with --heads those heads exported to ``heads_out``
    in the layout vLLM reads (skipped, with a note, for heads vLLM cannot run)."""
    from mtpctl.drafters.heads.config import HeadsConfig
    from mtpctl.errors import MtpctlError
    from mtpctl.export.serving import check_exportable, export_serving_heads

    configs = {"vllm": (None, True),
               "vllm-ngram": ({"method": "ngram", "num_speculative_tokens": opts.draft_len or 3,
                               "prompt_lookup_max": opts.ngram_max, "prompt_lookup_min": opts.ngram_min}, True)}
    if opts.heads_dir:
        cfg = HeadsConfig.load(Path(opts.heads_dir))
        try:
            check_exportable("vllm", cfg)
        except MtpctlError as err:
            click.echo(f"mtpctl: note: no vllm-heads peer: {err}", err=True)
            return configs
        export_serving_heads("vllm", session.folder, Path(opts.heads_dir), heads_out)
        method = "eagle3" if cfg.kind == "eagle3" else "medusa"
        # vLLM's Medusa loader loads token_map without reporting it: its weight check must be off
        configs["vllm-heads"] = ({"method": method, "model": str(heads_out), "num_speculative_tokens": cfg.num_heads},
                                 method != "medusa")
    return configs


def _lookahead_field(settings) -> str:
    """The report's ``lookahead`` setting, W,N,G (the defaults where none was given)."""
    s = settings or LookaheadSettings()
    return f"{s.window},{s.ngram},{s.candidates}"
