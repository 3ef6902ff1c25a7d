"""``add-heads --kind mtp --graft``: a new native MTP layer for a checkpoint whose family has an MTP layout
(:mod:`mtpctl.model.families.mtp_layouts`) but whose MTP tensors are gone (fine-tuning tools that save
only the body drop them; some also set the count to 0).

The layer is built in the family's layout, in the body's dtypes, initialised from the body
(:func:`fresh_layer`), then trained by :func:`mtpctl.train.mtp_refresh.refresh_mtp` as a refresh is
(self-distillation on the frozen body) and written into a new shard (:func:`mtpctl.model.rewrite.add_tensors`).

Initialisation. No author's code that grafts an MTP layer onto a trained body is public: DeepSeek-V3's
training code is not released, and Megatron-LM's ``MultiTokenPredictionLayer`` (the DeepSeek-V3-style
pretraining recipe) draws ``eh_proj`` and its block with the model's random ``init_method``, because it
trains them with the body from step 0. On a trained body a random layer only costs training, so the
layer starts as close to the body as its shape allows:

- the block: a copy of the body's last layer of the block's kind, the last one whose tensors have the
  block's names and shapes (:func:`source_layer`: DeepSeek's and GLM's last MoE layer, Qwen3.5's last
  full-attention layer with its MLP or MoE block, MiMo's and ERNIE's last layer of the block's kind);
- ``embedding_norm``, ``hidden_norm``: ones (stored 0 where the layout stores ``1 + w``);
- the final norm (where the layer has its own): a copy of the body's ``model.norm``, which the lm_head
  was trained behind;
- the projection ``[H, 2H]``: passes the normed hidden state through, ``[0 ; I]`` over
  ``[norm_e(e) ; norm_h(h)]`` (``[I ; 0]`` in MiMo's hidden-first order), as Medusa's residual heads start
  at the identity: at step 0 the layer is the body's last layer run once more on the body's output,
  and the embedding half, zero, gets its gradient from the first step on;
- the layout's copies of the target's lm_head and embedding (DeepSeek/GLM: ``shared_head.head``,
  ``embed_tokens``, which their released checkpoints carry): the target's own, which they stay.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Dict, List

import torch

from mtpctl.drafters.mtp import block_config
from mtpctl.errors import UnsupportedModel
from mtpctl.model.config import DecoderConfig, read_json
from mtpctl.model.decoder import expected_tensors
from mtpctl.model.weights import TensorInfo, read_headers, renamed, shard_files

BLOCK = "model.layers.0."


def present_tensors(folder: Path, cfg: DecoderConfig) -> List[str]:
    """The names of ``folder``'s tensors that belong to its first MTP layer (none where it was dropped)."""
    layout = cfg.family.mtp_layout
    prefixes = layout.tensor_prefixes(cfg.num_hidden_layers, 1)
    return [name for name in read_headers(shard_files(folder)) if name.startswith(prefixes)]


def count_key(cfg: DecoderConfig, raw: dict) -> str:
    """The config key that counts the MTP layers in ``raw`` (config.json's text part): the first of the
    layout's keys present, else its first."""
    keys = cfg.family.mtp_layout.count_keys
    return next((key for key in keys if raw.get(key) is not None), keys[0])


def grafted_config(cfg: DecoderConfig, folder: Path) -> dict:
    """``folder``'s config.json declaring one MTP layer (under ``text_config`` in a multimodal config)."""
    raw = copy.deepcopy(read_json(Path(folder) / "config.json"))
    text = raw["text_config"] if cfg.family.text_config and isinstance(raw.get("text_config"), dict) else raw
    text[count_key(cfg, text)] = 1
    return raw


def source_layer(cfg: DecoderConfig, block: DecoderConfig, infos: Dict[str, TensorInfo]) -> int:
    """The last body layer whose tensors (``infos``: name as the family reads it -> info) are those of the
    one-layer decoder ``block`` (the MTP block's config), by names and shapes.

    Raises:
        UnsupportedModel: no body layer is of the block's kind.
    """
    for i in reversed(range(cfg.num_hidden_layers)):
        stem = f"model.layers.{i}."
        found = {BLOCK + n[len(stem):]: tuple(info.shape) for n, info in infos.items() if n.startswith(stem)}
        wanted = {n: tuple(s) for n, s in expected_tensors(block, set(found)).items() if n.startswith(BLOCK)}
        if found == wanted:
            return i
    raise UnsupportedModel(f"no layer of the {cfg.family.model_type} body has the MTP block's tensors to start "
                           "a grafted layer from", option="graft")


def fresh_layer(folder: Path, cfg: DecoderConfig) -> Dict[str, torch.Tensor]:
    """A new MTP layer 0 for the checkpoint in ``folder`` (config ``cfg``), initialised as the module
    docstring says: checkpoint name after the layer's prefix -> value, in the layout's names and the
    body's dtypes (the block's tensors in their source tensors' dtypes, the others in the embedding's,
    the norms in the body's final norm's).

    Raises:
        UnsupportedModel: the family has no MTP layout, or no body layer of the block's kind.
    """
    from safetensors import safe_open

    layout = cfg.family.mtp_layout
    if layout is None:
        raise UnsupportedModel(f"{cfg.family.model_type} checkpoints have no MTP layout to graft a layer in",
                               option="graft")
    raw = cfg.family.text_part(read_json(Path(folder) / "config.json"))
    block = block_config(layout, raw)
    headers = read_headers(shard_files(folder))
    stored = {renamed(n, cfg.family.renames): n for n in headers}  # the name the family reads -> the file's
    infos = {name: headers[file_name] for name, file_name in stored.items()}
    src = source_layer(cfg, block, infos)
    n = layout.number(cfg.num_hidden_layers)
    stem, block_prefix = f"model.layers.{src}.", layout.block.format(n=n)
    wanted = {name: info for name, info in infos.items() if name.startswith(stem)}
    wanted.update({name: infos[name] for name in ("model.norm.weight", "model.embed_tokens.weight", "lm_head.weight")
                   if name in infos})
    values = {}
    for path in dict.fromkeys(info.path for info in wanted.values()):
        with safe_open(str(path), framework="pt") as handle:
            for name, info in wanted.items():
                if info.path == path:
                    values[name] = handle.get_tensor(stored[name])
    out = {block_prefix + name[len(stem):]: value.clone() for name, value in values.items() if name.startswith(stem)}
    embed, norm = values["model.embed_tokens.weight"], values["model.norm.weight"]
    h = embed.shape[1]
    roles = layout.names(n)
    norm_one = 0.0 if layout.offset_norms else 1.0
    out[roles["embedding_norm"]] = torch.full((h,), norm_one, dtype=norm.dtype)
    out[roles["hidden_norm"]] = torch.full((h,), norm_one, dtype=norm.dtype)
    if "final_norm" in roles:
        out[roles["final_norm"]] = norm.clone()
    proj = torch.zeros(h, 2 * h, dtype=embed.dtype)
    (proj[:, :h] if layout.hidden_first else proj[:, h:]).copy_(torch.eye(h, dtype=embed.dtype))
    out[roles["projection"]] = proj
    if "head_copy" in roles:
        out[roles["head_copy"]] = values.get("lm_head.weight", embed).clone()
    if "embedding_copy" in roles:
        out[roles["embedding_copy"]] = embed.clone()
    return out

