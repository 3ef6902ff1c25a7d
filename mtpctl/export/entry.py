"""The ``mtpctl`` entry every serving layout's ``config.json`` carries: the head folder's config
(target hash, tree, held-out accuracy), so heads read back into mtpctl unchanged. Engines ignore it."""

from __future__ import annotations

from dataclasses import asdict

from mtpctl.drafters.heads.config import HeadsConfig
from mtpctl.errors import CorruptModel


def meta(cfg: HeadsConfig) -> dict:
    """The head folder's config as the layouts carry it, without the training record."""
    return {k: v for k, v in asdict(cfg).items() if k != "training"}


def mtpctl_entry(config: dict, kinds) -> HeadsConfig:
    """The head folder's config that mtpctl wrote into a layout's ``config.json`` (``mtpctl``).

    Raises:
        CorruptModel: not a valid head config, or one of a kind other than ``kinds``.
    """
    try:
        cfg = HeadsConfig(**config["mtpctl"])
    except (TypeError, ValueError) as err:
        raise CorruptModel(f"config.json's mtpctl entry is not a valid head config: {err}") from err
    if cfg.kind not in kinds:
        raise CorruptModel(f"config.json's mtpctl entry describes {cfg.kind} heads, not the {' or '.join(kinds)} "
                           "heads its tensors hold")
    return cfg
