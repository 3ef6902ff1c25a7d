"""``mtpctl pair``: can these models draft for that one? Verdicts by vocabulary, id maps, and a
measured ranking of the usable drafts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import click

from mtpctl.cli.options import DRAFT_LEN, Command, debug_option, device_options
from mtpctl.drafters.pairing import Pairing, compare, load_vocabulary, write_id_map
from mtpctl.errors import BadInput
from mtpctl.model.sources import resolve_model

MEASURE_PROMPTS = 3


@click.command("pair", cls=Command, epilog="""\b
Examples:
  mtpctl pair smollm2-135m ./SmolLM2-360M-Instruct
  mtpctl pair smollm2-135m gemma3-270m --json | jq '.drafts[].verdict'
  mtpctl pair ./target ./draft-a ./draft-b --out pair-map.json
  mtpctl pair smollm2-135m ./draft-a ./draft-b --measure --max-new-tokens 32
  mtpctl generate --speculate draft --draft ./draft-a --draft-map pair-map.json "Hello"
""")
@click.argument("target")
@click.argument("drafts", nargs=-1, required=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@click.option("--out", "out", type=click.Path(dir_okay=False), default=None,
              help="Write the id maps (JSON) for generate --draft-map.")
@click.option("--overwrite", is_flag=True, help="Replace an existing --out file.")
@click.option("--measure", is_flag=True,
              help="Rank usable drafts by acceptance rate and tokens/s on a few built-in prompts (greedy).")
@click.option("--prompts", "n_prompts", type=click.IntRange(min=1), default=MEASURE_PROMPTS, show_default=True,
              help="Prompts for --measure (one per category of the built-in set, those that fit the context).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=32, show_default=True, help="For --measure.")
@click.option("--draft-len", type=DRAFT_LEN, default="auto", show_default=True, help="For --measure: N or auto.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=None, help="CPU threads (default: torch's).")
@device_options
@debug_option
def pair_cmd(target, drafts, as_json, out, overwrite, measure, n_prompts, max_new_tokens, draft_len, dtype,
             threads, device, kernels, debug) -> int:
    """Compare each DRAFT's vocabulary with TARGET's: identical, mapped or incompatible.

    identical: same token strings at the same ids, same special tokens and tokenization (padding
    rows of the embedding table past the real vocabulary do not count and are never proposed).
    mapped: same tokenization, but ids differ or one side has extra added tokens: an id map
    (--out) lets the draft run in the target's ids. incompatible: different tokenization; only the
    cross-tokenizer mode of generate --speculate draft can use it.

    Exit code 0 when every draft is usable (identical or mapped), 1 otherwise.
    """
    length = draft_len
    if out and Path(out).exists() and not overwrite:
        raise BadInput(f"{out} exists: pass --overwrite to replace it")
    target_folder = resolve_model(target)
    click.echo(f"reading {target_folder}", err=True)
    t = load_vocabulary(target_folder)
    pairings: List[Pairing] = []
    for spec in drafts:
        folder = resolve_model(spec)
        click.echo(f"reading {folder}", err=True)
        pairings.append(compare(t, load_vocabulary(folder)))
    if out:
        write_id_map(Path(out), pairings)
        click.echo(f"wrote id maps to {out}", err=True)
    ranking = measure_drafts(target_folder, pairings, n_prompts, max_new_tokens, length, dtype, threads, device,
                             kernels) \
        if measure else None
    if as_json:
        report = {"target": t.summary(), "drafts": [p.to_dict() for p in pairings]}
        if ranking is not None:
            report["measure"] = ranking
        click.echo(json.dumps(report, indent=2))
    else:
        click.echo(format_pairings(t, pairings))
        if ranking is not None:
            click.echo(format_ranking(ranking))
    return 0 if all(p.usable for p in pairings) else 1


def format_pairings(t, pairings: List[Pairing]) -> str:
    """Human-readable verdicts with their evidence."""
    lines = [f"target {t.folder}: {len(t.strings)} tokens ({len(t.added)} added), logits width {t.logits_width}"]
    for p in pairings:
        d, e = p.draft, p.evidence
        lines.append(f"\n{d.folder}: {p.verdict} ({'usable, ' + p.mode if p.usable else 'not usable by id; generate uses ' + p.mode})")
        lines += [f"  - {r}" for r in p.reasons]
        lines.append(f"  sizes: tokens {len(t.strings)} / {len(d.strings)}, added {len(t.added)} / {len(d.added)}, "
                     f"embedding rows {t.embed_rows} / {d.embed_rows}, logits width {t.logits_width} / "
                     f"{d.logits_width} (target / draft)")
        first = e["first_difference"]
        lines.append("  first differing id: none" if first is None else
                     f"  first differing id {first['id']}: target {first['target']!r}, draft {first['draft']!r}")
        lines.append("  special tokens: " + ", ".join(
            f"{r} {_special(t.specials[r])} / {_special(d.specials[r])}" for r in t.specials))
        lines.append(f"  BOS rule: target adds {t.adds['prefix']} before, {t.adds['suffix']} after; "
                     f"draft {d.adds['prefix']} before, {d.adds['suffix']} after")
    return "\n".join(lines)


def _special(value) -> str:
    return "-" if value is None else f"{value[0]}={value[1]}"


def measure_drafts(target_folder: Path, pairings: List[Pairing], n_prompts: int, max_new_tokens: int,
                   draft_len: Optional[int], dtype: str, threads: Optional[int], device: str = "auto",
                   kernels: str = "auto") -> list:
    """Greedy generation with each usable draft on ``n_prompts`` built-in prompts (one per category)
    and plain decoding on the same prompts: acceptance rate, tau and tokens/s per draft, best first."""
    from mtpctl.backends.torch import TorchSession, set_threads
    from mtpctl.bench.harness import load_prompts
    from mtpctl.decode.sampling import SamplingParams
    from mtpctl.drafters.draft_model import AUTO_MAX
    from mtpctl.drafters.pairing import draft_model_drafter, load_draft

    set_threads(threads)
    session = TorchSession(target_folder, dtype, device=device, kernels=kernels)
    greedy = SamplingParams()
    k = draft_len or AUTO_MAX
    seen, prompts = set(), []
    for p in load_prompts():  # one per category, those that fit the target's context with the output
        ids = session.codec.encode_messages(list(p.messages))
        if p.category not in seen and len(prompts) < n_prompts and \
                len(ids) + max_new_tokens + k + 1 <= session.context_length:
            seen.add(p.category)
            prompts.append(ids)
    if not prompts:
        raise BadInput(f"no built-in prompt fits the target's context ({session.context_length} tokens) "
                       f"with {max_new_tokens} new tokens")

    def run(drafter):
        new, ms, accepted, drafted = 0, 0.0, 0, 0
        for ids in prompts:
            s = session.generate(ids, max_new_tokens, greedy, drafter).stats
            new, ms, accepted, drafted = new + s.new_tokens, ms + s.total_ms, accepted + s.accepted_tokens, \
                drafted + s.draft_tokens
        return new / (ms / 1e3) if ms else 0.0, (accepted / drafted if drafted else None)

    session.generate(prompts[0], 4, greedy)  # warm-up
    plain_speed, _ = run(None)
    click.echo(f"plain: {plain_speed:.1f} tokens/s", err=True)
    rows = []
    for p in pairings:
        if not p.usable:
            continue
        draft = load_draft(p.draft.folder, session)
        drafter = draft_model_drafter(p, draft, session.model.cfg.vocab_size, greedy, draft_len)
        speed, rate = run(drafter)
        click.echo(f"{p.draft.folder}: {speed:.1f} tokens/s, acceptance {rate}", err=True)
        rows.append({"draft": str(p.draft.folder), "verdict": p.verdict, "acceptance_rate": rate,
                     "tokens_per_s": speed, "speedup": speed / plain_speed if plain_speed else None,
                     "plain_tokens_per_s": plain_speed, "prompts": len(prompts), "max_new_tokens": max_new_tokens,
                     "draft_len": draft_len or "auto"})
    rows.sort(key=lambda r: (-r["tokens_per_s"], -(r["acceptance_rate"] or 0)))
    return rows


def format_ranking(rows: list) -> str:
    if not rows:
        return "\nmeasure: no usable draft"
    lines = ["", "| rank | draft | acceptance | tokens/s | speedup vs plain |", "|---:|---|---:|---:|---:|"]
    for i, r in enumerate(rows, 1):
        rate = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        lines.append(f"| {i} | {r['draft']} | {rate} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f} |")
    return "\n".join(lines)
