"""``mtpctl export HEADS --format speculators|eagle|vllm|trtllm``: trained heads in the checkpoint
layouts that serving engines load (:mod:`~mtpctl.export.medusa_layouts`,
:mod:`~mtpctl.export.eagle_layouts`), written atomically. The way back is
:func:`mtpctl.export.imports.read_layout`.

Which layout each format writes for each head kind (:data:`WRITES`); every other pair is refused
with one line naming the kinds the format takes and the recipe that trains them:

========================  =============  ===============  ============================
format                    medusa         eagle3           read by
========================  =============  ===============  ============================
``speculators``           --             speculators      vLLM (and the speculators package)
``eagle``                 --             EAGLE            SGLang, vLLM, TensorRT-LLM (PyTorch backend), EAGLE
``vllm``                  vLLM Medusa    speculators      vLLM
``trtllm``                Medusa         EAGLE            TensorRT-LLM (Medusa converter; PyTorch backend)
========================  =============  ===============  ============================

Medusa heads go only without token conditioning (no layout has the token projection), and to
``trtllm`` only without a draft vocabulary. Hydra and mtpctl's ``eagle`` layer (features after the
final norm, ``fc`` over [feature; embedding], normed input and output) are what no engine runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mtpctl.drafters.heads.config import HeadsConfig, check_heads_match
from mtpctl.drafters.heads.folder import load_heads
from mtpctl.errors import BadInput, UnsupportedModel
from mtpctl.export import eagle_layouts, medusa_layouts
from mtpctl.files import output_folder
from mtpctl.model.decoder import Decoder
from mtpctl.model.weights import weights_hash

FORMATS = ("speculators", "eagle", "vllm", "trtllm")
#: format -> head kind -> the layout written
WRITES = {"speculators": {"eagle3": "speculators"}, "eagle": {"eagle3": "eagle"},
          "vllm": {"medusa": "vllm", "eagle3": "speculators"}, "trtllm": {"medusa": "medusa", "eagle3": "eagle"}}
#: head kind -> how to train heads of that kind for the default model
RECIPES = {"eagle3": "mtpctl add-heads --recipe recipes/smollm2-135m-eagle3.yaml",
           "medusa": "mtpctl add-heads --recipe recipes/smollm2-135m-medusa.yaml --no-condition-on-token"}
FULL_VOCABULARY = RECIPES["medusa"] + " --draft-vocab 0"  # Medusa heads TensorRT-LLM's layout takes


def check_exportable(fmt: str, cfg: HeadsConfig) -> str:
    """The layout ``fmt`` writes for heads of ``cfg``.

    Raises:
        BadInput: an unknown format. UnsupportedModel: a head kind (or Medusa variant) the format
            cannot express, naming the kinds it takes and how to train them.
    """
    if fmt not in WRITES:
        raise BadInput(f"unknown format {fmt!r} (choose from {', '.join(FORMATS)})", option="fmt")
    kinds = WRITES[fmt]
    if cfg.kind not in kinds:
        train = "; ".join(f"{kind}: {RECIPES[kind]}" for kind in kinds)
        raise UnsupportedModel(f"the {fmt} format takes {' or '.join(kinds)} heads, not {cfg.kind} heads "
                               f"(to train them: {train})", option="fmt")
    if cfg.kind == "medusa" and cfg.token_conditioned:
        raise UnsupportedModel(f"token-conditioned Medusa heads have no place in the {fmt} format's Medusa layout: "
                               f"train plain ones ({RECIPES['medusa']}), or eagle3 heads ({RECIPES['eagle3']})",
                               option="fmt")
    if fmt == "trtllm" and cfg.kind == "medusa" and cfg.draft_vocab_size:
        raise BadInput("TensorRT-LLM's Medusa layout has no draft vocabulary (token_map): train the heads on the "
                       f"full vocabulary ({FULL_VOCABULARY}), or export to vllm", option="fmt")
    return kinds[cfg.kind]


def write_layout(layout: str, heads: torch.nn.Module, target: Decoder, verifier: str, folder: Path) -> dict:
    """Write ``heads`` in ``layout`` into the existing empty ``folder``; returns its ``config.json``."""
    from safetensors.torch import save_file

    if layout == "vllm":
        tensors, config, name = medusa_layouts.vllm_tensors(heads, target.dense_lm_head()), \
            medusa_layouts.vllm_config(heads.cfg), medusa_layouts.VLLM_WEIGHTS
    elif layout == "medusa":
        tensors, config, name = medusa_layouts.medusa_tensors(heads, target.dense_lm_head()), \
            medusa_layouts.medusa_config(heads.cfg), medusa_layouts.MEDUSA_WEIGHTS
    elif layout == "speculators":
        tensors, config, name = eagle_layouts.eagle3_tensors(heads, layout), \
            eagle_layouts.speculators_config(heads.cfg, target.cfg, verifier), eagle_layouts.WEIGHTS
    else:
        tensors, config, name = eagle_layouts.eagle3_tensors(heads, layout), \
            eagle_layouts.eagle_config(heads.cfg, target.cfg), eagle_layouts.WEIGHTS
    # a shared tensor is written once per name (safetensors refuses aliases)
    save_file({k: v.clone() for k, v in tensors.items()}, str(Path(folder) / name), metadata={"format": "pt"})
    (Path(folder) / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return config


def export_serving_heads(fmt: str, model_folder: Path, heads_dir: Path, out: Path, overwrite: bool = False) -> dict:
    """Export the heads in ``heads_dir`` (made for the checkpoint in ``model_folder``) to ``out`` in
    the layout ``fmt`` writes for their kind; written to a temporary folder and renamed. Returns
    ``config.json``.

    Raises:
        BadInput: ``out`` exists without ``overwrite``; heads of another model.
        UnsupportedModel: a head kind the format cannot express (see :func:`check_exportable`).
        CorruptModel: unreadable checkpoint or heads.
    """
    cfg = HeadsConfig.load(Path(heads_dir))
    layout = check_exportable(fmt, cfg)
    with output_folder(Path(out), overwrite) as tmp:
        model = Decoder.from_folder(Path(model_folder), torch.float32)
        check_heads_match(cfg, model.cfg.hidden_size, model.cfg.vocab_size, weights_hash(Path(model_folder)))
        heads = load_heads(Path(heads_dir), torch.float32, model.dense_lm_head())
        config = write_layout(layout, heads, model, str(Path(model_folder).resolve()), tmp)
    return config
