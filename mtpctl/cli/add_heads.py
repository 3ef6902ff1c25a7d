"""``mtpctl add-heads``: graft MTP heads onto a checkpoint and train them by self-distillation."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

import click

from mtpctl.backends.torch import set_threads
from mtpctl.cli.options import Command, debug_option
from mtpctl.errors import BadInput
from mtpctl.files import mtpctl_home
from mtpctl.model.sources import DEFAULT_MODEL, resolve_model
from mtpctl.train.add_heads import add_heads
from mtpctl.train.distill import resolve_data
from mtpctl.train.distributed import init_distributed, is_main_process
from mtpctl.train.settings import TrainSettings

RECIPE_VERSION = 1
# CLI option -> TrainSettings field, for the settings a recipe may also give
SETTINGS = {f.name for f in dataclasses.fields(TrainSettings)}


def read_recipe(path: str) -> dict:
    """A YAML recipe: ``{version: 1, model, data: [files relative to the recipe], settings: {...}}``.

    Raises:
        BadInput: unreadable, malformed, a newer version, or unknown keys/settings.
    """
    import yaml

    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise BadInput(f"cannot read recipe {path}: {err}") from err
    if not isinstance(raw, dict) or raw.get("version") != RECIPE_VERSION:
        raise BadInput(f"recipe {path}: expected a mapping with 'version: {RECIPE_VERSION}'")
    unknown = set(raw) - {"version", "model", "data", "settings", "description"}
    bad = set(raw.get("settings") or {}) - SETTINGS
    if unknown or bad:
        raise BadInput(f"recipe {path}: unknown key(s) {sorted(unknown | bad)}")
    base = Path(path).resolve().parent
    raw["data"] = [str(base / d) for d in raw.get("data") or []]
    raw.setdefault("settings", {})
    return raw


def magpie_settings(recipe: object, count: Optional[int], seed: Optional[int]) -> object:
    """The Magpie settings: the recipe's ``magpie`` mapping with ``--magpie-prompts`` and
    ``--magpie-seed`` over it (None when neither gives any)."""
    if recipe is not None and not isinstance(recipe, dict):
        return recipe  # TrainSettings refuses it with its own message
    given = {k: v for k, v in (("count", count), ("seed", seed)) if v is not None}
    if recipe is None and not given:
        return None
    return {**(recipe or {}), **given}


#: below this expected tau (tokens a verify step commits on held-out text, bonus counted) speculation
#: with the heads does not pay for itself here: a verify pass of the default tree costs about 0.9-1.1x
#: a plain step with dense weights and ~1.2x with int4's 2-node tree, and heads at tau 1.21 were
#: slower than plain decoding (BENCHMARKS.md)
WORTHWHILE_TAU = 1.2


@click.command("add-heads", cls=Command, epilog="""\b
Examples:
  mtpctl add-heads --recipe recipes/smollm2-135m-medusa.yaml --out heads/smollm2-medusa
  mtpctl add-heads --recipe recipes/smollm2-135m-medusa.yaml --kind hydra --out heads/smollm2-hydra
  mtpctl add-heads --recipe recipes/smollm2-135m-eagle.yaml --out heads/smollm2-eagle
  mtpctl add-heads --recipe recipes/smollm2-135m-eagle3.yaml --out heads/smollm2-eagle3
  mtpctl add-heads -m smollm2-135m --kind medusa --num-heads 3 --self-distill \\
      --data prompts.jsonl --data notes.txt --out heads/mine --epochs 3 --seed 1
  mtpctl add-heads --recipe recipes/smollm2-135m-medusa-magpie.yaml --out heads/smollm2-magpie
  mtpctl add-heads -m smollm2-135m --self-distill --magpie-prompts 200 --magpie-seed 7 --out heads/own
  mtpctl add-heads -m zai-org/GLM-4.5-Air --kind mtp --measure-only --data prompts.jsonl --self-distill --num-heads 3
  mtpctl add-heads -m zai-org/GLM-4.5-Air --kind mtp --data prompts.jsonl --self-distill --steps 2000 --out glm-sft-mtp
  mtpctl add-heads -m glm-sft --kind mtp --graft --data prompts.jsonl --self-distill --steps 4000 --out glm-sft-mtp
  torchrun --nproc-per-node 2 -m mtpctl add-heads --recipe R.yaml --out heads/ddp
  torchrun --nproc-per-node 8 -m mtpctl add-heads --recipe R.yaml --device cuda --out heads/ddp
  mtpctl generate --speculate heads --heads heads/smollm2-medusa --dtype bfloat16 "Explain KV caches."
""")
@click.option("--recipe", type=click.Path(dir_okay=False), help="YAML recipe (model, data, settings); options override it.")
@click.option("-m", "--model", default=None, help=f"Target: alias, folder, .gguf or hub id [default: {DEFAULT_MODEL}].")
@click.option("--kind", type=click.Choice(["medusa", "hydra", "eagle", "eagle3", "mtp"]), default=None,
              help="medusa: independent heads; hydra: head k reads head k-1 and the token drafted before "
                   "it (always token-conditioned); eagle: one transformer layer drafting from the target's "
                   "features, --num-heads steps deep (hydra and eagle: torch backend only); eagle3: EAGLE-3, "
                   "the layer reading a low, a middle and a high target layer, with its own lm_head (what "
                   "vLLM, SGLang and TensorRT-LLM run: mtpctl export --format); mtp: the checkpoint's own MTP "
                   "layer (GLM-4.5, DeepSeek-V3, Qwen3.5, Qwen3-Next, MiMo, ERNIE-4.5-MoE): measure its "
                   "acceptance, refresh it on the current body and write a new checkpoint folder to --out where only its tensors change "
                   "(a checkpoint with several MTP layers: all of them, chained as --speculate mtp drafts with "
                   "them) [default: medusa].")
@click.option("--num-heads", type=int, default=None,
              help="K heads; head k predicts k+1 tokens past the next; eagle: draft steps; mtp: depths measured and "
                   "trained, at least the checkpoint's MTP layers (its i-th layer drafts depth i, the last one also the "
                   "depths past them, recursively) [default: 4; mtp: the checkpoint's MTP layers, 1 with --graft].")
@click.option("--head-decay", type=float, default=None,
              help="Loss weight of head (draft step) k is DECAY^(k-1); mtp: depth k past the checkpoint's L MTP "
                   "layers weighs DECAY^(k-L), the layers' own depths 1 [default: 0.8].")
@click.option("--steps", type=click.IntRange(min=0), default=None,
              help="Optimizer steps (0: from --epochs) [default: 0].")
@click.option("--measure-only", is_flag=True,
              help="mtp: only report the MTP layer's per-depth acceptance on the data (teacher-forced); writes nothing.")
@click.option("--graft", is_flag=True,
              help="mtp: the checkpoint's MTP layer is missing (dropped by fine-tuning tools; its count may be 0): "
                   "build a new one in the family's layout, initialised from the body's last layer of its kind, "
                   "train it on the current body and write --out with its tensors added in a new shard "
                   "(model-mtp.safetensors) and config.json declaring one MTP layer.")
@click.option("--head-layers", type=int, default=None, help="Residual blocks per head [default: 1].")
@click.option("--own-lm-head/--no-own-lm-head", default=None, help="A trainable vocabulary projection per head.")
@click.option("--draft-vocab", type=int, default=None, help="Heads score only the N most frequent tokens (0 = all).")
@click.option("--condition-on-token/--no-condition-on-token", default=None,
              help="Heads also read the pending token's embedding (more accurate; torch and ONNX only).")
@click.option("--data", "data", multiple=True, type=click.Path(),
              help="Training data: .txt, .jsonl (text/prompt/messages records) or hf://datasets/OWNER/NAME "
                   "(repeatable; replaces the recipe's data).")
@click.option("--self-distill/--no-self-distill", default=None, help="The target answers prompt records itself.")
@click.option("--magpie-prompts", type=click.IntRange(min=0), default=None, metavar="N",
              help="Also let the target write N prompts itself (Magpie: sampled from its chat template's opening "
                   "of a user turn, screened for empty, unfinished, degenerate and duplicate ones), then answer "
                   "them; needs --self-distill and a chat template; --data becomes optional [default: the "
                   "recipe's magpie count, else 0].")
@click.option("--magpie-seed", type=int, default=None,
              help="Seed of the Magpie prompts: same seed, target and settings, same prompts [default: 0].")
@click.option("--response-tokens", type=int, default=None, help="Longest self-distilled response [default: 128].")
@click.option("--soft-labels/--no-soft-labels", default=None,
              help="Cross-entropy to the target's top-16 distribution instead of its argmax.")
@click.option("--epochs", type=float, default=None, help="Passes over the training positions [default: 2].")
@click.option("--lr", type=float, default=None, help="Peak AdamW learning rate [default: 1e-3].")
@click.option("--batch-tokens", type=int, default=None, help="Positions per micro-batch [default: 256].")
@click.option("--grad-accum", type=int, default=None, help="Micro-batches per optimizer step [default: 1].")
@click.option("--tree-nodes", type=int, default=None,
              help="Nodes of the draft tree stored in the head folder and used for its expected tau "
                   "[default: 4, what generate grows by default in float32 and bfloat16; 2 with int4].")
@click.option("--measure-prompts", type=click.IntRange(min=0), default=None, metavar="N",
              help="At the end, decode N held-out prompts plainly, with heads and with heads+ngram (greedy, "
                   "every step drafting) and record their tau and whether each output equals plain decoding in "
                   "mtp_config.json (training.measured); 0 skips it [default: 16].")
@click.option("--seed", type=int, default=None, help="Same seed and data, same heads [default: 0].")
@click.option("--out", default=None, type=click.Path(file_okay=False),
              help="Head folder to write (mtp: the new checkpoint folder); required, except with --measure-only.")
@click.option("--resume", is_flag=True,
              help="Continue this run from its last checkpoint, keeping the feature shards it finished.")
@click.option("--overwrite", is_flag=True, help="Replace an existing --out folder.")
@click.option("--bundle", is_flag=True, help="Copy the target's files into --out (default: referenced by hash).")
@click.option("--device", default="auto", show_default=True, metavar="auto|cpu|cuda[:N]",
              help="Where the target self-distills and gives its features, and the heads train: auto takes a CUDA "
                   "GPU when torch sees one (there the target runs in bfloat16 and heads train under bfloat16 "
                   "autocast), else the CPU. Under torchrun each rank takes cuda:LOCAL_RANK.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="CPU threads (default: torch's).")
@click.option("--json", "as_json", is_flag=True, help="Print the training summary as JSON on stdout.")
@debug_option
def add_heads_cmd(recipe, model, data, out, resume, overwrite, bundle, device, threads, as_json, debug,
                  measure_only, graft, **options) -> None:
    """Graft MTP heads onto a model and train them by self-distillation (the base stays frozen).

    The target computes hidden states and its own predictions once (written in shards under
    $MTPCTL_HOME/work; --resume keeps the shards an interrupted run finished); the heads then train on
    them, streamed shard by shard. Writes mtp_config.json, mtp_heads.safetensors and mtp_datastore.safetensors (the training
    sequences, for --speculate retrieval) to --out. With --kind mtp, the checkpoint's own MTP layer is
    measured, refreshed and written back instead: acceptance by depth before and after on stdout; with
    --graft, a layer the checkpoint lost is built anew, trained and added.
    """
    spec = read_recipe(recipe) if recipe else {"settings": {}, "data": []}
    magpie = magpie_settings(spec["settings"].get("magpie"), options.pop("magpie_prompts"), options.pop("magpie_seed"))
    given = {k: v for k, v in options.items() if v is not None}
    # the CLI's options override the recipe's
    merged = {**spec["settings"], **given, "magpie": magpie}
    depth_given = "num_heads" in merged
    if merged.get("kind") == "mtp":
        merged.setdefault("num_heads", 1)  # the checkpoint's layer count, once it is resolved (_refresh_mtp)
    settings = TrainSettings(**merged)
    model_name = model or spec.get("model") or DEFAULT_MODEL
    files = list(data) or spec["data"]
    set_threads(threads)
    if settings.kind == "mtp":
        _refresh_mtp(model_name, files, out, settings, measure_only, overwrite, resume, device, as_json, graft,
                     depth_given)
        return
    if measure_only:
        raise BadInput("--measure-only measures a checkpoint's own MTP layer: use it with --kind mtp")
    if graft:
        raise BadInput("--graft builds a checkpoint's missing MTP layer: use it with --kind mtp")
    if out is None:
        raise BadInput("give --out: the head folder to write")
    init_distributed(device)
    data_files = resolve_data(files, mtpctl_home() / "hub")
    summary = add_heads(resolve_model(model_name), model_name, data_files, Path(out), settings,
                        mtpctl_home(), resume=resume, overwrite=overwrite, bundle=bundle, device=device)
    if not is_main_process():  # under torchrun, rank 0 reports
        return
    measured = bool(summary.get("held_out"))  # figures exist only for held-out sequences
    if not measured:
        click.echo("mtpctl: warning: no sequence was held out, so the heads' accuracy and expected tau were not "
                   "measured (the config stores 0s, and its default tree is a guess); give more data, or a "
                   "larger `holdout` in a recipe", err=True)
    elif summary["expected_tau"] < WORTHWHILE_TAU:
        click.echo(f"mtpctl: warning: these heads predict little on held-out text (expected tau "
                   f"{summary['expected_tau']} < {WORTHWHILE_TAU}): --speculate heads will likely be slower than "
                   "plain decoding; train on more data or for more epochs", err=True)
    if as_json:
        click.echo(json.dumps(summary))
    elif not measured:
        click.echo(f"mtpctl: wrote {out} (no held-out figures)", err=True)
    else:
        unit = "draft step" if settings.kind in ("eagle", "eagle3") else "head"
        click.echo(f"mtpctl: wrote {out}: held-out top-1 per {unit} {summary['held_out_top1']}, expected tau "
                   f"of the default tree {summary['expected_tau']} (on held-out prompts of the training set)", err=True)
        if "tau" in summary.get("measured", {}):
            taus = ", ".join(f"{m} {t}" for m, t in summary["measured"]["tau"].items())
            click.echo(f"mtpctl: measured tau on {summary['measured']['prompts']} held-out prompts: {taus}", err=True)


def _refresh_mtp(model_name: str, files, out, settings: TrainSettings, measure_only: bool, overwrite: bool,
                 resume: bool, device: str, as_json: bool, graft: bool, depth_given: bool) -> None:
    """``add-heads --kind mtp`` (``--graft``: a new layer): progress on stderr, acceptance by depth on stdout
    (or the summary as JSON); without ``depth_given`` the depth is the checkpoint's layer count."""
    from mtpctl.train.mtp_refresh import layer_count, refresh_mtp

    folder = resolve_model(model_name)
    if not depth_given:
        settings = dataclasses.replace(settings, num_heads=layer_count(folder, graft))
    summary = refresh_mtp(folder, resolve_data(files, mtpctl_home() / "hub"),
                          Path(out) if out else None, settings, mtpctl_home(), measure_only=measure_only,
                          overwrite=overwrite, resume=resume, device=device, graft=graft)
    if as_json:
        click.echo(json.dumps(summary))
        return
    after = summary.get("after")
    click.echo(f"MTP acceptance by depth on {summary['before']['chains']} chains of {summary['measured_on']} sequences"
               + (f" (wrote {out})" if after else ""))
    layers = summary["layers"]
    for j, before in enumerate(summary["before"]["acceptance"]):
        which = "" if layers == 1 else f" (MTP layer {min(j + 1, layers)}{', recursively' if j >= layers else ''})"
        click.echo(f"depth {j + 1}: acceptance {before:.4f}" + (f" -> {after['acceptance'][j]:.4f}" if after else "")
                   + which)
