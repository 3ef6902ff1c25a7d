"""The MTP heads an export takes: Medusa heads made for the exported target."""

from __future__ import annotations

from pathlib import Path

import torch

from mtpctl.drafters.heads.config import HeadsConfig, check_heads_match
from mtpctl.drafters.heads.folder import load_heads
from mtpctl.drafters.heads.medusa import MedusaHeads
from mtpctl.errors import UnsupportedModel
from mtpctl.model.decoder import Decoder


def exportable_heads(heads_dir: Path, model: Decoder, target_hash: str) -> MedusaHeads:
    """Load Medusa heads (float32) and check that they were made for ``model`` (sizes and weight hash).

    Raises:
        BadInput: not a head folder, or heads of another model.
        UnsupportedModel: hydra, eagle or eagle3 heads, which no fused graph runs.
        CorruptModel: see :func:`mtpctl.drafters.heads.folder.load_heads`.
    """
    cfg = HeadsConfig.load(heads_dir)
    check_heads_match(cfg, model.cfg.hidden_size, model.cfg.vocab_size, target_hash)
    if cfg.kind != "medusa":
        serving = " (eagle3 heads go to serving engines: mtpctl export HEADS --format speculators|eagle|vllm|trtllm)" \
            if cfg.kind == "eagle3" else ""
        raise UnsupportedModel(f"{heads_dir}: {cfg.kind} heads draft level by level from the tokens they draft, "
                               f"which one fused graph pass cannot run: decode with them on the torch backend{serving}",
                               option="heads_dir")
    return load_heads(heads_dir, torch.float32, model.dense_lm_head())
