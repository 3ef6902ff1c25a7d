"""``mtpctl generate``: text generation with optional speculative decoding."""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

import click

from mtpctl.backends import open_session
from mtpctl.backends.torch import set_threads
from mtpctl.cli.options import (Command, debug_option, draft_options_from, drafter_options, model_options,
                                sampling_from, sampling_options)
from mtpctl.drafters.build import build, check, parse
from mtpctl.errors import BadInput, OutputClosed


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


@click.command("generate", cls=Command, epilog="""\b
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
@click.option("--speculate", default="none", show_default=True,
              help="Drafter: none (plain decoding), draft (a draft model, --draft), or one or more of heads (MTP "
                   "heads, --heads), ngram (prompt lookup, a chain of --draft-len tokens) and retrieval (a tree of "
                   "--retrieval-nodes continuations from a datastore of the target's own text) joined by '+', "
                   "merged into one draft tree: e.g. heads+ngram+retrieval.")
@drafter_options
@sampling_options
@model_options
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--stop", "stop_strings", multiple=True, help="Stop string (repeatable); not included in the output.")
@click.option("--no-chat", is_flag=True, help="Send the raw prompt, without the chat template.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (text, ids, stats) instead of text.")
@click.option("--stats", is_flag=True, help="Print speculation and speed figures to stderr.")
@debug_option
def generate_cmd(prompt, prompt_file, speculate, max_new_tokens, stop_strings, no_chat, as_json, stats, debug,
                 **options) -> None:
    """Generate text from PROMPT ('-' reads stdin), streaming it to stdout.

    With --speculate, a drafter proposes up to --draft-len tokens that the model verifies in one
    pass. Greedy output (temperature 0) is identical to plain decoding; with sampling the output
    follows the model's distribution (speculative rejection sampling).
    """
    text = read_prompt(prompt, prompt_file)
    parts = parse(speculate)
    opts = draft_options_from(options)
    check(parts, opts)  # before the model loads
    set_threads(options["threads"])
    backend = options["backend"]
    session = open_session(options["model"], backend, options["dtype"], options["weights"], options["threads"])
    prompt_ids = session.encode(text, chat=not no_chat)
    sampling = sampling_from(options)
    drafter = build(session, parts, opts, sampling)
    draft_info = None
    if parts == ("draft",):
        pairing = drafter.pairing
        click.echo(f"draft {pairing.draft.folder}: {pairing.verdict}, drafting in {pairing.mode}", err=True)
        draft_info = {"folder": str(pairing.draft.folder), "verdict": pairing.verdict, "mode": pairing.mode,
                      "draft_len": opts.draft_len or "auto"}
    on_text = None if as_json else _stream
    result = session.generate(prompt_ids, max_new_tokens, sampling, drafter, stop_strings, on_text, options["acceptance"])
    if as_json:
        torch_backend = backend == "torch"
        _stream(json.dumps({
            "text": result.text, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
            "model": str(session.folder), "speculate": "+".join(parts) or "none", "draft": draft_info,
            "draft_len": drafter.budget if drafter else 0, "backend": backend, "dtype": options["dtype"],
            "weights": options["weights"], "attention": session.attention if torch_backend else None,
            "int4_kernel": session.int4_kernel if torch_backend else None, "stats": result.stats.to_dict(),
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
