"""The head folder on disk: ``mtp_config.json`` (:class:`~mtpctl.drafters.heads.config.HeadsConfig`)
and ``mtp_heads.safetensors``, read strictly into the module of the folder's kind and written back."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional, Tuple

import torch
from torch import nn

from mtpctl.drafters.heads.config import CONFIG_FILE, WEIGHTS_FILE, HeadsConfig
from mtpctl.drafters.heads.eagle import EagleHead
from mtpctl.drafters.heads.eagle3 import Eagle3Head
from mtpctl.drafters.heads.medusa import MedusaHeads
from mtpctl.errors import BadInput, CorruptModel
from mtpctl.model.weights import load_tensors

#: head kind -> the module that runs it
MODULES = {"medusa": MedusaHeads, "hydra": MedusaHeads, "eagle": EagleHead, "eagle3": Eagle3Head}


def load_heads(folder: Path, dtype: torch.dtype = torch.float32, target_lm_head: Optional[torch.Tensor] = None,
               blocked: bool = False, kinds: Tuple[str, ...] = tuple(MODULES),
               target_kernel: Optional[nn.Module] = None) -> nn.Module:
    """Load MTP heads of any kind from a head folder: :class:`MedusaHeads` (medusa, hydra) or
    :class:`EagleHead` (eagle) or :class:`Eagle3Head` (eagle3); strictly (missing, unexpected, mis-shaped, NaN tensors are errors).

    Args:
        target_lm_head: ``[vocab, hidden]`` the target's lm_head weight, needed by heads with a
            truncated draft vocabulary or their own lm_heads (see :class:`MedusaHeads`).
        blocked: for decoding, hold the draft-vocabulary projection in a decoding layout too.
        target_kernel: the target's lm_head module (with ``blocked``: a packed one lends a truncated
            projection its codes, a tiled one its layout, :func:`mtpctl.model.linears.projection_copy`).
        kinds: the head kinds the caller can run (another kind is BadInput).

    Raises:
        BadInput, CorruptModel, UnsupportedModel: see :meth:`HeadsConfig.load` and
            :func:`mtpctl.model.weights.load_tensors`; BadInput also when ``target_lm_head`` is needed
            and missing or mis-shaped, or for a kind outside ``kinds``.
    """
    cfg = HeadsConfig.load(folder)
    if cfg.kind not in kinds:
        raise BadInput(f"{folder} holds {cfg.kind} heads; this takes {', '.join(kinds)} heads", option="heads_dir")
    cls = MODULES[cfg.kind]
    shape = (cfg.vocab_size, cfg.hidden_size)
    if cfg.own_lm_head or cfg.draft_vocab_size:
        if target_lm_head is None or tuple(target_lm_head.shape) != shape:
            raise BadInput(f"heads in {folder} need the target's lm_head {list(shape)}")
    with torch.device("meta"):  # shapes only, no memory
        placeholder = torch.zeros(shape) if cfg.own_lm_head or cfg.draft_vocab_size else None
        token_map = torch.zeros(cfg.draft_vocab_size, dtype=torch.long) if cfg.draft_vocab_size else None
        expected = cls(cfg, dtype, placeholder, token_map).state_dict()
    tensors = read_head_tensors(folder, cfg, expected)
    if token_map is not None:
        token_map = tensors["token_map"]
    heads = cls(cfg, dtype, target_lm_head, token_map, blocked, target_kernel)
    heads.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()})
    heads.requires_grad_(False)
    return heads


def read_head_tensors(folder: Path, cfg: HeadsConfig, expected: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The tensors of the head folder's weights file, each in its stored dtype, checked against
    ``expected`` (a state dict of the heads' module, on the meta device will do): the same names and
    shapes, finite values, floating point or integer as the module holds them, and a token_map of
    distinct ids inside the vocabulary.

    Raises:
        CorruptModel: no weights file, or tensors that fail the checks.
    """
    path = Path(folder) / WEIGHTS_FILE
    if not path.is_file():
        raise CorruptModel(f"{folder} has {CONFIG_FILE} but no {WEIGHTS_FILE}")
    tensors = load_tensors([path], {name: tuple(t.shape) for name, t in expected.items()})
    for name, t in tensors.items():
        if t.is_floating_point() != expected[name].is_floating_point():
            raise CorruptModel(f"{path}: tensor {name!r} is {t.dtype}; expected "
                               f"{'a floating point' if expected[name].is_floating_point() else 'an integer'} dtype")
    token_map = tensors.get("token_map")
    if token_map is not None and len(token_map) and (int(token_map.min()) < 0 or int(token_map.max()) >= cfg.vocab_size
                                                     or len(torch.unique(token_map)) != len(token_map)):
        raise CorruptModel(f"{path}: token_map holds ids outside the vocabulary or repeats one")
    return tensors


def save_heads(heads: nn.Module, folder: Path) -> None:
    """Write ``mtp_config.json`` and ``mtp_heads.safetensors`` (float32) of any head kind into an
    existing ``folder`` (callers write to a temporary folder and rename it, see
    :func:`mtpctl.files.output_folder`)."""
    from safetensors.torch import save_file

    heads.cfg.save(folder)
    save_file({k: (v.detach().float() if v.is_floating_point() else v).contiguous()
               for k, v in heads.state_dict().items()},
              str(Path(folder) / WEIGHTS_FILE), metadata={"format": "pt", "mtpctl_kind": heads.cfg.kind})
