"""``mtpctl export``: a model (and its MTP heads) as an ONNX graph, a TensorRT engine, or heads in a
serving engine's checkpoint layout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import click

from mtpctl.convert.sources import resolve_model
from mtpctl.errors import BadInput


def resolve_target(model: str, heads: Optional[str]):
    """MODEL may be a model (alias, folder, .gguf, repo id) or a head folder, whose config names its
    target. Returns (checkpoint folder, head folder or None).

    Raises:
        BadInput: a head folder given both as MODEL and with --heads.
    """
    from mtpctl.runtime.heads import CONFIG_FILE, HeadsConfig

    path = Path(model).expanduser()
    if path.is_dir() and (path / CONFIG_FILE).is_file():
        if heads is not None:
            raise BadInput(f"{path} is a head folder: give the model as MODEL and the heads with --heads")
        return resolve_model(HeadsConfig.load(path).target), path
    return resolve_model(model), (Path(heads) if heads is not None else None)


@click.command("export", epilog="""\b
Examples:
  mtpctl export smollm2-135m --onnx out/smollm2-onnx
  mtpctl export smollm2-135m --heads heads/smollm2-medusa --onnx out/smollm2-medusa-onnx
  mtpctl generate --backend onnxruntime -m out/smollm2-onnx "Hello"
""")
@click.argument("model")
@click.option("--heads", "heads_dir", type=click.Path(file_okay=False, exists=True),
              help="MTP head folder (mtpctl add-heads output) to fuse into the graph.")
@click.option("--onnx", "onnx_out", type=click.Path(), help="Write the fused draft/verify ONNX graph to this folder.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output folder.")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
@click.option("--debug", is_flag=True, help="Show the full traceback of an error.")
def export_cmd(model, heads_dir, onnx_out, overwrite, as_json, debug) -> None:
    """Export MODEL (or a head folder, whose target is then loaded) for deployment.

    --onnx writes one fused graph (prefill and draft/verify steps, KV cache in and out, Medusa head
    logits when --heads is given), its external weights, the tokenizer and a manifest.json with the
    sha256 of every file. The folder is written under a temporary name and renamed when complete.
    """
    from mtpctl.convert.onnx_export import export_onnx

    if not onnx_out:
        raise BadInput("nothing to export: give --onnx OUT")
    folder, heads = resolve_target(model, heads_dir)
    progress = lambda line: click.echo(line, err=True)  # noqa: E731
    manifest = export_onnx(folder, Path(onnx_out), heads, overwrite, progress)
    if as_json:
        click.echo(json.dumps(manifest))
    else:
        total = sum(f["bytes"] for f in manifest["files"].values())
        click.echo(f"{onnx_out}: {len(manifest['files'])} files, {total / 1e6:.1f} MB, "
                   f"target sha256 {manifest['target_hash'][:12]}..., "
                   f"heads: {manifest['heads']['num_heads'] if manifest['heads'] else 'none'}")
