"""What the heads read of the target while they train: its config, its token embedding and its
lm_head, and nothing of its layers (those ran once, when the features were extracted), so every rank
holds two ``[vocab, hidden]`` matrices instead of the whole model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

import torch
import torch.nn.functional as F

from mtpctl.errors import CorruptModel
from mtpctl.model.config import DecoderConfig
from mtpctl.model.weights import check_tensors, renamed, safetensors_files

EMBED, LM_HEAD, NORM = "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"


@dataclass
class TargetHead:
    """The target's embedding and lm_head ``[vocab, hidden]`` (the same tensor when tied), on one
    device in one dtype; :meth:`logits` is :meth:`mtpctl.model.decoder.Decoder.logits` of a dense
    lm_head. ``norm``: the body's final norm ``[hidden]`` where the family's native MTP layers use it as
    theirs (ERNIE-4.5's layout: ``final_norm`` ""), held as :class:`~mtpctl.model.decoder.Decoder` holds
    it; else None."""

    cfg: DecoderConfig
    embed: torch.Tensor
    lm_head: torch.Tensor
    norm: Optional[torch.Tensor] = None

    @classmethod
    def from_folder(cls, folder: Path, dtype: torch.dtype, device: torch.device = torch.device("cpu")) -> "TargetHead":
        """Read the embedding and lm_head of the checkpoint in ``folder``, strictly (shapes, finite values).

        Raises:
            CorruptModel: the tensors are missing, mis-shaped, not finite, or a file cannot be read.
        """
        cfg = DecoderConfig.from_folder(Path(folder))
        names = [EMBED] if cfg.tie_word_embeddings else [EMBED, LM_HEAD]
        layout = cfg.family.mtp_layout
        shared_norm = layout is not None and not layout.final_norm and cfg.mtp_layers > 0
        found = _read_named(Path(folder), names + [NORM] * shared_norm, cfg.family.renames)
        shapes = {n: (cfg.vocab_size, cfg.hidden_size) for n in names}
        check_tensors(found, {**shapes, **({NORM: (cfg.hidden_size,)} if shared_norm else {})}, source=str(folder))
        embed = found[EMBED].to(device, dtype)
        norm = found[NORM].to(device, torch.float32 if cfg.norm_offset else dtype) if shared_norm else None
        if norm is not None and cfg.norm_offset:  # held as the Decoder holds it: offset + w in float32
            norm = norm + cfg.norm_offset
        return cls(cfg, embed, embed if cfg.tie_word_embeddings else found[LM_HEAD].to(device, dtype), norm)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` -> float32 logits ``[..., vocab]`` (soft-capped where the config says)."""
        logits = F.linear(hidden_states, self.lm_head).float()
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def dense_lm_head(self) -> torch.Tensor:
        """The lm_head weight ``[vocab, hidden]``."""
        return self.lm_head


def _read_named(folder: Path, names, renames=()) -> Dict[str, torch.Tensor]:
    """Tensors ``names`` from the checkpoint's safetensors files (each file's header read; only these
    tensors' bytes), as the family's ``renames`` name them (a multimodal checkpoint's text body)."""
    from safetensors import SafetensorError, safe_open

    found: Dict[str, torch.Tensor] = {}
    for path in safetensors_files(folder):
        try:
            with safe_open(str(path), framework="pt") as handle:
                for stored in handle.keys():
                    if renamed(stored, renames) in names:
                        found[renamed(stored, renames)] = handle.get_tensor(stored)
        except SafetensorError as err:
            raise CorruptModel(f"{path} is not a readable safetensors file ({err}); re-create or re-download it") \
                from err
        except OSError as err:
            raise CorruptModel(f"cannot read {path}: {err}") from err
    return found
