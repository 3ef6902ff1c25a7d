"""``mtpctl generate``: text generation with optional speculative decoding."""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

import click

from mtpctl.model.sources import DEFAULT_MODEL
from mtpctl.cli.pair import DRAFT_LEN, generate_drafter
from mtpctl.errors import BadInput, OutputClosed
from mtpctl.cli.drafting import DraftOptions, build_drafter, check_options, load_parts, parse_drafters
from mtpctl.decode.sampling import SamplingParams
from mtpctl.cli.backends import backend_option, open_session
from mtpctl.runtime.session import set_threads

def read_prompt(prompt: Optional[str], prompt_file: Optional[str]) -> str:
    """The prompt from the argument, ``-`` (stdin) or ``--prompt-file``; BadInput if none or both."""
    if prompt is not None and prompt_file is not None:
        raise BadInput("give the prompt either as an argument or with --prompt-file, not both")
    if prompt_file is not None:
        try:
            with open(prompt_file, encoding="utf-8") as handle:
                return handle.read()
        except (OSError, UnicodeDecodeError) as err:
            raise BadInput(f"cannot read prompt file {prompt_file}: {err}") from err
    if prompt == "-":
        return sys.stdin.read()
    if prompt is None:
        raise BadInput("no prompt: pass it as an argument, '-' for stdin, or --prompt-file FILE")
    return prompt


@click.command("generate", epilog="""\b
Examples:
  mtpctl generate "What is speculative decoding?"
  mtpctl generate --speculate ngram --draft-len 6 --stats --prompt-file article.txt
  echo "Summarize: ..." | mtpctl generate --speculate ngram --json - | jq .stats.tau
  mtpctl generate --temperature 0.8 --top-p 0.95 --seed 1 --stop $'\\n\\n' "Once upon a time"
  mtpctl generate --dtype bfloat16 --weights int4 --speculate ngram "Repeat: a b c"
  mtpctl generate --speculate draft --draft smollm2-135m --draft-len auto -m gemma3-270m "Hi"
  mtpctl generate --speculate heads --heads heads/smollm2-medusa --stats "Explain KV caches."
  mtpctl generate --speculate heads --heads heads/smollm2-medusa --tree tree.yaml --dtype bfloat16 "Hi"
  mtpctl generate --speculate heads+ngram --heads heads/smollm2-medusa --dtype bfloat16 --stats "Summarize: ..."
  mtpctl generate --speculate heads+ngram+retrieval --heads heads/smollm2-medusa --dtype bfloat16 "Hi"
  mtpctl generate --backend onnxruntime -m out/smollm2-onnx --speculate ngram "Repeat: a b c"
""")
@click.argument("prompt", required=False)
@click.option("--prompt-file", type=click.Path(dir_okay=False), help="Read the prompt from a file.")
@click.option("-m", "--model", default=DEFAULT_MODEL, show_default=True,
              help="Alias, checkpoint folder, .gguf file or hub repo id.")
@click.option("--speculate", default="none", show_default=True,
              help="Drafter: none (plain decoding), draft (a draft model, --draft), or one or more of heads (MTP "
                   "heads, --heads), ngram (prompt lookup, a chain of --draft-len tokens) and retrieval (a tree of "
                   "--retrieval-nodes continuations from a datastore of the target's own text) joined by '+', "
                   "merged into one draft tree: e.g. heads+ngram+retrieval.")
@click.option("--heads", "heads_dir", type=click.Path(file_okay=False), default=None,
              help="MTP head folder (mtpctl add-heads) for --speculate heads.")
@click.option("--tree", "tree_file", type=click.Path(dir_okay=False), default=None,
              help="Draft tree for --speculate heads: YAML/JSON list of paths of top-k ranks, e.g. [[0],[1],[0,0]].")
@click.option("--tree-nodes", type=click.IntRange(min=1), default=None,
              help="Size of the draft tree grown from the heads' accuracy [default: 4; 2 with --weights int4].")
@click.option("--acceptance", type=click.Choice(["exact", "typical"]), default="exact", show_default=True,
              help="exact: lossless; typical: Medusa's typical acceptance when sampling (lossy).")
@click.option("--draft-len", type=DRAFT_LEN, default=3, show_default=True,
              help="Most draft tokens verified per step; auto (--speculate draft): longer after a fully "
                   "accepted draft, shorter after a rejection.")
@click.option("--draft", "draft_model", default=None,
              help="Draft model for --speculate draft (alias, folder, .gguf); check it with mtpctl pair.")
@click.option("--draft-map", type=click.Path(dir_okay=False), default=None,
              help="Id map from mtpctl pair --out (else computed from the tokenizers).")
@click.option("--datastore", type=click.Path(dir_okay=False), default=None,
              help="Retrieval datastore (mtp_datastore.safetensors) [default: the one in --heads].")
@click.option("--retrieval-nodes", type=click.IntRange(min=1), default=None,
              help="Nodes of the retrieval drafter's tree [default: 4].")
@click.option("--ngram-max", type=click.IntRange(min=1), default=3, show_default=True,
              help="Longest n-gram the prompt-lookup drafter matches.")
@click.option("--ngram-min", type=click.IntRange(min=1), default=2, show_default=True,
              help="Shortest n-gram the prompt-lookup drafter matches.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="0 = greedy.")
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0 = off.")
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0, show_default=True)
@click.option("--seed", type=int, default=None, help="Seed for sampling (same seed, same output).")
@click.option("--stop", "stop_strings", multiple=True, help="Stop string (repeatable); not included in the output.")
@click.option("--no-chat", is_flag=True, help="Send the raw prompt, without the chat template.")
@backend_option
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True)
@click.option("--weights", type=click.Choice(["dense", "int4"]), default="dense", show_default=True,
              help="int4: keep GGUF Q4_1/Q8_0 weights packed for the int4 kernels (needs --dtype bfloat16).")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="CPU threads (default: torch's).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (text, ids, stats) instead of text.")
@click.option("--stats", is_flag=True, help="Print speculation and speed figures to stderr.")
@click.option("--debug", is_flag=True, help="Show the full traceback of an error.")
def generate_cmd(prompt, prompt_file, model, speculate, heads_dir, tree_file, tree_nodes, acceptance, draft_len, draft_model, draft_map,
                 datastore, retrieval_nodes, ngram_max, ngram_min, max_new_tokens,
                 temperature, top_k, top_p, seed, stop_strings, no_chat, backend, dtype, weights, threads, as_json,
                 stats, debug) -> None:
    """Generate text from PROMPT ('-' reads stdin), streaming it to stdout.

    With --speculate, a drafter proposes up to --draft-len tokens that the model verifies in one
    pass. Greedy output (temperature 0) is identical to plain decoding; with sampling the output
    follows the model's distribution (speculative rejection sampling).
    """
    text = read_prompt(prompt, prompt_file)
    if ngram_min > ngram_max:
        raise BadInput(f"--ngram-min ({ngram_min}) is larger than --ngram-max ({ngram_max})")
    parts = parse_drafters(speculate)
    opts = DraftOptions(heads_dir, tree_file, tree_nodes, draft_len, ngram_max, ngram_min, datastore, retrieval_nodes)
    if parts != ("draft",):  # checks that need no model come before loading it
        if draft_model or draft_map or draft_len is None:
            raise BadInput("--draft, --draft-map and --draft-len auto go with --speculate draft")
        check_options(parts, opts)
    elif heads_dir or tree_file or tree_nodes or datastore:
        raise BadInput("--heads, --tree, --tree-nodes and --datastore do not go with --speculate draft")
    set_threads(threads)
    session = open_session(model, backend, dtype, weights, threads)
    prompt_ids = session.encode(text, chat=not no_chat)
    heads, drafter = None, None
    if parts and parts != ("draft",):
        heads, store = load_parts(session, parts, opts)
        drafter, draft_len = build_drafter(session, parts, opts, heads, store)
    sampling = SamplingParams(temperature, top_k, top_p, seed)
    draft_info = None
    if parts == ("draft",):
        drafter, draft_len, draft_info = generate_drafter(session, draft_model, draft_map, sampling, draft_len, dtype)
    on_text = None if as_json else _stream
    result = session.generate(prompt_ids, max_new_tokens, sampling, drafter,
                              draft_len if drafter else 0, stop_strings, on_text, heads, acceptance)
    if as_json:
        _stream(json.dumps({
            "text": result.text, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
            "model": str(session.folder), "speculate": "+".join(parts) or "none", "draft": draft_info, "draft_len": draft_len if drafter else 0,
            "backend": backend, "dtype": dtype, "weights": weights,
            "attention": session.attention if backend == "torch" else None,
            "int4_kernel": session.int4_kernel if backend == "torch" else None, "stats": result.stats.to_dict(),
        }) + "\n")
    else:
        _stream("\n")
    if stats:
        click.echo(format_stats(result.stats.to_dict()), err=True)


def _stream(piece: str) -> None:
    """Write a piece of the product to stdout now; OutputClosed when the reader has gone."""
    try:
        sys.stdout.write(piece)
        sys.stdout.flush()
    except BrokenPipeError as err:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # later flushes go nowhere
        raise OutputClosed() from err


def format_stats(s: dict) -> str:
    """One human-readable line of generation figures."""
    tau = f"{s['tau']:.2f}" if s["tau"] is not None else "-"
    rate = f"{s['acceptance_rate']:.1%}" if s["acceptance_rate"] is not None else "-"
    return (f"new_tokens={s['new_tokens']} decode_steps={s['decode_steps']} "
            f"tau={tau} (accepted drafts + bonus per step) acceptance_rate={rate} "
            f"ttft={s['ttft_ms']:.1f}ms tokens/s={s['tokens_per_s']:.1f}")


