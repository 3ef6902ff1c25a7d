"""``mtpctl export``: a model (and its MTP heads) as an ONNX graph, a TensorRT engine, or heads in a
serving engine's checkpoint layout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import click

from mtpctl.cli.options import Command, debug_option
from mtpctl.errors import BadInput
from mtpctl.model.sources import resolve_model


def resolve_target(model: str, heads: Optional[str]):
    """MODEL may be a model (alias, folder, .gguf, repo id) or a head folder, whose config names its
    target. Returns (checkpoint folder, head folder or None).

    Raises:
        BadInput: a head folder given both as MODEL and with --heads.
    """
    from mtpctl.drafters.heads.config import CONFIG_FILE, HeadsConfig

    path = Path(model).expanduser()
    if path.is_dir() and (path / CONFIG_FILE).is_file():
        if heads is not None:
            raise BadInput(f"{path} is a head folder: give the model as MODEL and the heads with --heads")
        return resolve_model(HeadsConfig.load(path).target), path
    return resolve_model(model), (Path(heads) if heads is not None else None)


@click.command("export", cls=Command, epilog="""\b
Examples:
  mtpctl export smollm2-135m --onnx out/smollm2-onnx
  mtpctl export smollm2-135m --heads heads/smollm2-medusa --onnx out/smollm2-medusa-onnx
  mtpctl generate --backend onnxruntime -m out/smollm2-onnx "Hello"
  mtpctl export smollm2-135m --onnx out/smollm2-trt --trt --trt-precision fp16   (NVIDIA GPU only)
  mtpctl export heads/smollm2-eagle3 --format speculators --out out/smollm2-eagle3-speculators
  mtpctl export heads/smollm2-eagle3 --format eagle --out out/smollm2-eagle3-eagle
  mtpctl export smollm2-135m --heads heads/smollm2-medusa-plain --format vllm --out out/smollm2-medusa-vllm
  mtpctl export heads/smollm2-medusa-plain --format trtllm --out out/smollm2-medusa-trtllm
  mtpctl export heads/my-eagle3 --format speculators --out out/eagle3 --verifier meta-llama/Llama-3.1-8B-Instruct
""")
@click.argument("model")
@click.option("--heads", "heads_dir", type=click.Path(file_okay=False, exists=True),
              help="MTP head folder (mtpctl add-heads output) to fuse into the graph.")
@click.option("--onnx", "onnx_out", type=click.Path(), help="Write the fused draft/verify ONNX graph to this folder.")
@click.option("--format", "fmt", type=click.Choice(["speculators", "eagle", "vllm", "trtllm"]), default=None,
              help="Write the --heads in a serving engine's checkpoint layout to --out: speculators (eagle3 heads, "
                   "vLLM), eagle (eagle3 heads: EAGLE/SpecForge layout, SGLang, vLLM, TensorRT-LLM), vllm (Medusa "
                   "heads in vLLM's layout; eagle3 heads as speculators), trtllm (Medusa heads in the original "
                   "Medusa layout; eagle3 heads as eagle).")
@click.option("-o", "--out", "out", type=click.Path(), help="Output folder of --format.")
@click.option("--verifier", "verifier", metavar="NAME", default=None,
              help="With --format: the target's name on the serving machine, which the layout records (a hub id "
                   "or a folder there). Default: the hub id the target was downloaded from, else its folder's name.")
@click.option("--dtype", "dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
              help="With --format: write the heads in this dtype. Default: the dtype they are stored in (a copy of "
                   "the target's lm_head: the target's).")
@click.option("--trt", is_flag=True,
              help="Also build a TensorRT engine (model.plan) into the --onnx folder (needs tensorrt and a CUDA GPU).")
@click.option("--trt-precision", type=click.Choice(["fp32", "fp16", "bf16"]), default="fp16", show_default=True,
              help="TensorRT builder precision flag.")
@click.option("--trt-max-new-tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="Most tokens per pass the engine accepts (draft tree nodes + 1; longer prompts prefill in chunks).")
@click.option("--trt-max-past", type=click.IntRange(min=1), default=2048, show_default=True,
              help="Most committed tokens before a pass.")
@click.option("--trt-max-batch", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--overwrite", is_flag=True, help="Replace an existing output folder.")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
@debug_option
def export_cmd(model, heads_dir, onnx_out, fmt, out, verifier, dtype, trt, trt_precision, trt_max_new_tokens,
               trt_max_past, trt_max_batch, overwrite, as_json, debug) -> None:
    """Export MODEL (or a head folder, whose config names its target) for deployment.

    --onnx writes one fused graph (prefill and draft/verify steps, KV cache in and out, Medusa head
    logits when --heads is given), its external weights, the tokenizer and a manifest.json with the
    sha256 of every file. The folder is written under a temporary name and renamed when complete.
    The graph is float32: the whole target is loaded in float32 to trace it (about twice its float32
    weights in memory at the peak), and its weights go to model.onnx.data beside the graph at any size.

    --trt also builds a TensorRT engine from the graph (one optimization profile from the
    --trt-max-* limits, saved with it and checked before decoding). TensorRT needs an NVIDIA GPU:
    without tensorrt or CUDA it fails at once with exit code 2.

    --format writes the heads alone (config.json and safetensors) in the layout a serving engine
    loads: EAGLE-3 heads to every format, plain Medusa heads to vllm and trtllm. The engine loads the
    target itself, by the name the layout records (--verifier). The target is not loaded here: its
    config.json is read, its weights hashed (the heads must be made for them), and only Medusa heads
    that share its lm_head read that tensor, for the copy their layout holds. A head kind a format
    cannot express is refused with one line naming the kinds it takes and how to train them.
    """
    from mtpctl.export.onnx import export_onnx

    if fmt:
        return export_serving(model, heads_dir, fmt, out, onnx_out, trt, overwrite, as_json, verifier, dtype)
    if verifier is not None or dtype is not None:
        raise BadInput("--verifier and --dtype set what --format writes; the ONNX graph is float32 and names no "
                       "verifier", option="fmt")
    if not onnx_out:
        raise BadInput("nothing to export: give --onnx OUT (or --format speculators|eagle|vllm|trtllm --out OUT)")
    finish = None
    if trt:
        from mtpctl.backends.tensorrt import TrtLimits, require_tensorrt
        from mtpctl.export.tensorrt import build_engine

        require_tensorrt()  # before the export: fail at once where TensorRT cannot run
        limits = TrtLimits(max_batch=trt_max_batch, max_new_tokens=trt_max_new_tokens, max_past=trt_max_past,
                           opt_new_tokens=min(8, trt_max_new_tokens), opt_past=min(512, trt_max_past),
                           precision=trt_precision)
        limits.check()
        finish = lambda tmp: build_engine(tmp, limits, progress)  # noqa: E731
    folder, heads = resolve_target(model, heads_dir)
    progress = lambda line: click.echo(line, err=True)  # noqa: E731
    manifest = export_onnx(folder, Path(onnx_out), heads, overwrite, progress, finish)
    if as_json:
        click.echo(json.dumps(manifest))
    else:
        total = sum(f["bytes"] for f in manifest["files"].values())
        click.echo(f"{onnx_out}: {len(manifest['files'])} files + manifest.json, {total / 1e6:.1f} MB, "
                   f"target sha256 {manifest['target_hash'][:12]}..., "
                   f"heads: {manifest['heads']['num_heads'] if manifest['heads'] else 'none'}")


def export_serving(model, heads_dir, fmt, out, onnx_out, trt, overwrite, as_json, verifier=None, dtype=None) -> None:
    """--format: the heads in a serving engine's layout (config.json + safetensors), the target not among them."""
    from mtpctl.export.serving import export_serving_heads, verifier_name

    if onnx_out or trt:
        raise BadInput("--format writes MTP heads only: run --onnx/--trt as a separate export")
    if not out:
        raise BadInput(f"--format {fmt} needs --out OUT (the folder to write)")
    folder, heads = resolve_target(model, heads_dir)
    if heads is None:
        raise BadInput(f"--format {fmt} exports MTP heads: give --heads DIR (or the head folder as MODEL)")
    config = export_serving_heads(fmt, folder, heads, Path(out), overwrite, verifier, dtype)
    files = list(Path(out).iterdir())
    click.echo(f"mtpctl: {out} holds the heads only, not the target: the engine loads the target itself, as "
               f"{verifier.strip() if verifier is not None else verifier_name(folder)}", err=True)
    if as_json:
        click.echo(json.dumps(config))
    else:
        meta = config["mtpctl"]
        size = sum(f.stat().st_size for f in files)
        click.echo(f"{out}: {meta['kind']} heads ({meta['num_heads']} deep) in the {fmt} format "
                   f"({len(files)} files, {size / 1e6:.1f} MB)")
