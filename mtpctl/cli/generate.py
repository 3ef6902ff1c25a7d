"""``mtpctl generate``: text generation with optional speculative decoding."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import click

from mtpctl.cli.batch import BadRecord, BatchRecord, read_records, record_error, result_json
from mtpctl.cli.options import (Command, debug_option, draft_line, drafter_options, model_options, pipeline_spec_from,
                                policy_option, sampling_from, sampling_options)
from mtpctl.decode.session import GenerationRequest
from mtpctl.drafters.build import draft_member
from mtpctl.drafters.pipeline import Pipeline, assemble, check_spec
from mtpctl.drafters.suffix import index_stats, save_cache, stats_line
from mtpctl.errors import BadInput, OutputClosed
from mtpctl.files import check_writable, write_file


def read_prompt(prompt: Optional[str], prompt_file: Optional[str]) -> str:
    """The prompt from the argument, ``-`` (stdin) or ``--prompt-file``.

    Raises:
        BadInput: none or both given, or a prompt that is not UTF-8 text (naming where).
    """
    if prompt is not None and prompt_file is not None:
        raise BadInput("give the prompt either as an argument or with --prompt-file, not both")
    if prompt_file is not None:
        try:
            with open(prompt_file, "rb") as handle:
                return utf8(handle.read(), f"prompt file {prompt_file}")
        except OSError as err:
            raise BadInput(f"cannot read prompt file {prompt_file}: {err.strerror or err}") from err
    if prompt == "-":
        return utf8(sys.stdin.buffer.read(), "the prompt on stdin")
    if prompt is None:
        raise BadInput("no prompt: pass it as an argument, '-' for stdin, or --prompt-file FILE")
    try:
        prompt.encode("utf-8")  # bytes that are not UTF-8 reach argv as lone surrogates (U+DC80-U+DCFF)
    except UnicodeEncodeError as err:
        code = ord(prompt[err.start])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"a lone surrogate U+{code:04X}"
        raise BadInput(f"the prompt argument is not UTF-8 text ({what} at character {err.start + 1})") from err
    return prompt


def utf8(data: bytes, where: str) -> str:
    """``data`` as UTF-8 text; BadInput naming ``where`` and the offending byte otherwise."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise BadInput(f"{where} is not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start})") from err


@click.command("generate", cls=Command, epilog="""\b
Examples:
  mtpctl generate "What is speculative decoding?"
  mtpctl generate --speculate ngram --draft-len 6 --stats --prompt-file article.txt
  echo "Summarize: ..." | mtpctl generate --speculate ngram --json - | jq .stats.tau
  mtpctl generate --temperature 0.8 --top-p 0.95 --seed 1 --stop $'\\n\\n' "Once upon a time"
  mtpctl generate --dtype bfloat16 --weights int4 --speculate ngram "Repeat: a b c"
  mtpctl generate --speculate draft --draft smollm2-135m --draft-len auto -m gemma3-270m "Hi"
  mtpctl generate --speculate draft --draft self:0-9,20-29 --draft-len auto --stats "Name three colors."
  mtpctl generate --speculate lookahead --lookahead 5,4,5 --dtype bfloat16 --stats "List three fruits."
  mtpctl generate --speculate heads+draft --heads heads/smollm2-medusa --draft self --dtype bfloat16 "Hi"
  mtpctl generate --speculate heads --heads heads/smollm2-medusa --stats "Explain KV caches."
  mtpctl generate --speculate heads --heads heads/smollm2-medusa --tree tree.yaml --dtype bfloat16 "Hi"
  mtpctl generate --speculate heads+ngram --heads heads/smollm2-medusa --dtype bfloat16 --stats "Summarize: ..."
  mtpctl generate --speculate heads+ngram+retrieval --heads heads/smollm2-medusa --dtype bfloat16 "Hi"
  mtpctl generate --backend onnxruntime -m out/smollm2-onnx --speculate ngram "Repeat: a b c"
  mtpctl generate --batch-file prompts.jsonl --max-batch 8 --speculate ngram --dtype bfloat16 > results.jsonl
  mtpctl generate --no-chat --parse-special "<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n"
""")
@click.argument("prompt", required=False)
@click.option("--prompt-file", type=click.Path(dir_okay=False), help="Read the prompt from a file.")
@click.option("--batch-file", type=click.Path(dir_okay=False, allow_dash=True),
              help="JSONL requests, one per line ('-': stdin): {\"prompt\": ...} or {\"messages\": [...]}, with optional "
                   "max_new_tokens, temperature, top_k, top_p, seed, stop and id. Prints one JSON result per line in "
                   "input order ({\"line\": N, \"error\": ...} for a line that failed; exit 2 if any did).")
@click.option("--max-batch", type=click.IntRange(min=1), default=8, show_default=True,
              help="With --batch-file: the most requests decoded at once (continuous batching).")
@click.option("--out", "out_path", type=click.Path(dir_okay=False),
              help="With --batch-file: write the results to this file (atomically) instead of stdout.")
@click.option("--overwrite", is_flag=True, help="With --out: replace the file if it exists.")
@click.option("--speculate", default="none", show_default=True,
              help="Drafter: none (plain decoding), or one or more of heads (MTP heads, --heads), draft (a draft "
                   "model or the target's own layers, --draft), mtp (the checkpoint's own MTP layers, a chain of "
                   "--draft-len tokens: GLM-4.5, DeepSeek-V3, Qwen3.5, Qwen3-Next, MiMo, ERNIE-4.5-MoE), ngram "
                   "(prompt lookup, a chain of --draft-len tokens), "
                   "retrieval (a tree of --retrieval-nodes continuations from a datastore of the target's own text), "
                   "suffix (suffix decoding: the most frequent continuations of the context's suffix in this request "
                   "and in the responses served before, --suffix-*) and lookahead (lookahead decoding, --lookahead) "
                   "joined by '+', merged into one draft tree: e.g. heads+ngram+retrieval, heads+draft, "
                   "ngram+lookahead, suffix+ngram.")
@policy_option
@drafter_options
@sampling_options
@model_options
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--stop", "stop_strings", multiple=True, help="Stop string (repeatable); not included in the output.")
@click.option("--no-chat", is_flag=True, help="Send the raw prompt, without the chat template.")
@click.option("--parse-special", is_flag=True,
              help="Turn control-token strings in the prompt (e.g. <|im_end|>) into those tokens; by default the "
                   "prompt's text is text, with or without the chat template.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (text, ids, stats) instead of text.")
@click.option("--stats", is_flag=True, help="Print speculation and speed figures to stderr.")
@debug_option
def generate_cmd(prompt, prompt_file, batch_file, max_batch, out_path, overwrite, speculate, max_new_tokens, stop_strings,
                 no_chat, parse_special, as_json, stats, debug, **options) -> None:
    """Generate text from PROMPT ('-' reads stdin), streaming it to stdout; or every request of
    --batch-file, many at once.

    With --speculate, a drafter proposes up to --draft-len tokens that the model verifies in one
    pass. Greedy output (temperature 0) is identical to plain decoding, in a batch as alone; with
    sampling the output follows the model's distribution (speculative rejection sampling).
    """
    if batch_file is not None:
        _refuse_with_batch(prompt, prompt_file, as_json, stats)
    elif out_path is not None:
        raise BadInput("--out writes the results of --batch-file; a single generation goes to stdout")
    else:
        text = read_prompt(prompt, prompt_file)
    spec = pipeline_spec_from(options, speculate)
    check_spec(spec)  # before the model loads
    if out_path:
        _check_out(Path(out_path), overwrite)
    sampling = sampling_from(options)
    pipeline = assemble(spec, sampling, progress=lambda line: click.echo(f"mtpctl: {line}", err=True))
    session, drafter = pipeline.session, pipeline.drafter
    fields = _settings(pipeline)
    if fields["draft"] is not None:
        click.echo(draft_line(fields["draft"]), err=True)
    if batch_file is not None:
        data = sys.stdin.buffer.read() if batch_file == "-" else _read_bytes(batch_file)
        records = read_records(data, max_new_tokens, sampling, tuple(stop_strings))
        failed = _run_batch(pipeline, records, max_batch, no_chat, parse_special, fields, out_path)
        _finish_suffix(drafter, fields, echo=True)
        if failed:
            raise BadInput(f"{failed} of {len(records)} requests failed (their lines hold the errors)")
        return
    prompt_ids = session.encode(text, chat=not no_chat, parse_special=parse_special)
    on_text = None if as_json else _stream
    result = pipeline.generate(prompt_ids, max_new_tokens, sampling, stop_strings, on_text)
    if not as_json:
        _stream("\n")  # the text's end before any figures reach the terminal
    fields = _finish_suffix(drafter, fields, echo=stats)
    if as_json:
        _stream(json.dumps(_result_fields(result, fields)) + "\n")
    if stats:
        click.echo(format_stats(result.stats.to_dict()), err=True)


def _finish_suffix(drafter, fields: dict, echo: bool) -> dict:
    """After the run, for a suffix drafter: its global index written to its cache file (if named), its
    figures added to ``fields`` (``suffix_index``) and, with ``echo``, printed to stderr."""
    figures = index_stats(drafter)
    if figures is None:
        return fields
    save_cache(drafter)
    if echo:
        click.echo(f"mtpctl: {stats_line(figures)}", err=True)
    return {**fields, "suffix_index": figures}


def _check_out(path: Path, overwrite: bool) -> None:
    """``--out`` can be written, and replaces an existing file only with ``--overwrite``."""
    if path.exists() and not overwrite:
        raise BadInput(f"--out {path} exists: pass --overwrite to replace it")
    check_writable(path)


def _refuse_with_batch(prompt, prompt_file, as_json, stats) -> None:
    if prompt is not None or prompt_file is not None:
        raise BadInput("--batch-file takes the prompts from its records: give no PROMPT or --prompt-file with it")
    if as_json or stats:
        raise BadInput("--batch-file always writes JSON lines, each with its stats: drop --json and --stats")


def _read_bytes(path: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError as err:
        raise BadInput(f"cannot read batch file {path}: {err.strerror or err}") from err


def _run_batch(pipeline, records, max_batch, no_chat, parse_special, fields, out_path) -> int:
    """Generate every usable record, write one line per record in input order; the number that failed.

    Whatever goes wrong with one record (reading it, tokenizing it, a prompt the context cannot hold,
    its decoding) becomes that record's error line; the other records are produced as usual."""
    requests, where = [], []
    outputs = [record if isinstance(record, BadRecord) else _prepare(pipeline.session, record, no_chat, parse_special)
               for record in records]
    for i, prepared in enumerate(outputs):
        if isinstance(prepared, GenerationRequest):
            requests.append(prepared)
            where.append(i)
    done = 0

    def progress(index, outcome) -> None:
        nonlocal done
        done += 1
        click.echo(f"mtpctl: batch: {done}/{len(requests)} done", err=True)

    outcomes = pipeline.generate_batch(requests, max_batch, on_done=progress)
    for i, outcome in zip(where, outcomes):
        outputs[i] = record_error(records[i].line, outcome, records[i].id) if isinstance(outcome, Exception) \
            else result_json(records[i], _result_fields(outcome, fields))
    text = "".join((json.dumps(out.to_json()) if isinstance(out, BadRecord) else out) + "\n" for out in outputs)
    if out_path:
        write_file(Path(out_path), text)
    else:
        _stream(text)
    return sum(isinstance(out, BadRecord) for out in outputs)


def _prepare(session, record: BatchRecord, no_chat: bool, parse_special: bool):
    """One record's :class:`GenerationRequest`, or its :class:`BadRecord` when its prompt cannot be
    tokenized (not valid Unicode, empty, a template that changes it) or anything else fails on it."""
    try:
        ids = (session.encode(record.prompt, not no_chat, parse_special) if isinstance(record.prompt, str)
               else session.codec.encode_messages(record.prompt, parse_special))
        return GenerationRequest(ids, record.max_new_tokens, record.sampling, record.stop)
    except Exception as err:  # the input's error or this record's internal fault: reported in its line alone
        return record_error(record.line, err, record.id)


def _settings(pipeline: Pipeline) -> dict:
    """The fields every JSON result carries about how it was generated."""
    spec, session, drafter = pipeline.spec, pipeline.session, pipeline.drafter
    torch_backend = spec.backend == "torch"
    draft = draft_member(drafter)
    draft_info = None if draft is None else {**draft.describe(), "draft_len": spec.draft.draft_len or "auto"}
    return {"model": str(session.folder), "speculate": pipeline.speculate, "draft": draft_info,
            "draft_len": drafter.budget if drafter else 0, "speculate_policy": spec.speculate_policy,
            "policy_table": pipeline.table.describe() if pipeline.table is not None else None,
            "backend": spec.backend, "dtype": spec.dtype, "weights": spec.weights,
            "attention": session.attention if torch_backend else None,
            "int4_kernel": session.int4_kernel if torch_backend else None,
            "matmul_isa": session.matmul_isa if torch_backend else None,
            "device": session.device if torch_backend else None, "kernels": session.kernels if torch_backend else None,
            "cuda_graphs": spec.cuda_graphs,
            "greedy_exactness": session.greedy_exactness if torch_backend else None,
        "device_numerics": session.device_numerics if torch_backend else None,
            "matmul_paths": session.matmul_paths if torch_backend else None,
            "seeded_sampling": "drafter-dependent" if drafter is not None and drafter.samples_drafts else "reproducible"}


def _result_fields(result, settings: dict) -> dict:
    """``generate --json``'s object for one result."""
    return {"text": result.text, "token_ids": result.token_ids, "finish_reason": result.finish_reason, **settings,
            "stats": result.stats.to_dict()}


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
