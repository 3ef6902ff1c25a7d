"""``add-heads --kind mtp``: measure and refresh a checkpoint's own MTP layer on the current body.

The layer is the first one ``--speculate mtp`` drafts with (:class:`~mtpctl.drafters.mtp.MtpLayers`, the
same row math; a checkpoint's later layers, which draft depths 2 and on, are not trained here):
:class:`MtpHead` makes its tensors trainable (float32) and unrolls it over whole sequences of the
cached features as the EAGLE layer's training-time test does
(:class:`~mtpctl.train.eagle.EagleTrainer`, :func:`~mtpctl.decode.attention.unrolled_draft_mask`):
depth 1 at row p reads the body's hidden state ``h_p`` (after its final norm) and the token
``x_{p+1}`` and predicts ``x_{p+2}``; depth s reads depth s-1's output at row p-1 (raw or normed,
:attr:`MtpSettings.carry`) and ``x_{p+1}``, attending to the depth-1 rows up to p-s+1 and to its own
chain, exactly as a decode-time draft past the trained depth of one (recursively, as vLLM does).
Labels are the body's own greedy predictions (self-distillation; the body stays frozen); depth s
weighs ``head_decay^(s-1)`` in the loss (the recursive objective).

Acceptance (:meth:`MtpTrainer.acceptance`), teacher-forced on sequences whose features the body gave
(one body pass per sequence): for a sequence ``x`` and the body's greedy predictions ``pred`` (``pred[t]``
is its argmax after ``x_0..x_t``), a *chain* starts at each row q from the sequence's first loss row on
(the last committed position at decode time: the layer reads ``h_q`` and the pending token
``x_{q+1}``); its depth-s draft ``d_s`` is the layer's argmax for position q+s+1 and its label is
``pred[q+s]``; the token depth s reads is ``x_{q+s}``, which is the depth s-1 draft whenever that draft
was accepted and the sequence follows the body's greedy path. A chain counts (at all K depths) when
its labels exist and ``x_{q+i+1} == pred[q+i]`` for i = 1..K-1 (always so on self-distilled responses).

- ``acceptance[j]``: the share of counted chains whose drafts at depths 1..j all equal their labels,
  i.e. the body's greedy decoding accepts at least j drafted tokens: what ``mtpctl bench`` reports while
  decoding (``acceptance_by_position``: steps that accepted a token at depth j / steps drafted that deep)
  and vLLM's per-position acceptance, greedy.
- ``top1[j]``: the share of counted chains whose depth-j draft equals its label given right earlier
  tokens (teacher forcing), whatever the earlier drafts were.

The hidden states come from the feature shards (bfloat16), so a figure can differ from decoding's by
the rare argmax the rounding flips.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

from mtpctl.decode.attention import unrolled_draft_mask
from mtpctl.drafters.mtp import MtpLayers
from mtpctl.model.decoder import checkpoint_tensors
from mtpctl.train.eagle import EagleTrainer

#: block parameters that stay frozen: DeepSeek's routing score bias is balanced, not trained by gradient
FROZEN = ("router_bias",)


class _UnrolledKeys:
    """The block's keys and values of the depths unrolled so far side by side (depth s's T rows after
    depth s-1's): the KV cache of a training-time test, written without in-place ops so that autograd
    keeps every depth's keys."""

    def __init__(self):
        self.length, self.k, self.v = 0, [], []

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        self.k.append(k)
        self.v.append(v)
        return torch.cat(self.k, dim=2), torch.cat(self.v, dim=2)

    def advance(self, n: int) -> None:
        self.length += n


class MtpHead(nn.Module):
    """The checkpoint's MTP layer as a trainable module: the block's parameters (the routing score bias
    excepted) and the layer's own tensors (``enorm``, ``hnorm``, ``eh_proj`` and the final norm where it
    is the layer's: :attr:`MtpLayers.names`) in float32; the embedding and head it reads stay frozen (as a
    final norm that is the body's). ``layers`` computes with these very tensors, so the
    drafter built on it drafts with what was trained.

    Raises:
        ValueError: layers not in float32 (MTP layers train in float32).
    """

    def __init__(self, layers: MtpLayers):
        super().__init__()
        if layers.eh_proj.dtype != torch.float32:
            raise ValueError(f"MTP layers train in float32, not {layers.eh_proj.dtype}")
        self.layers = layers  # not a module: the target's embedding and head are not this module's
        self.block = layers.block.layers[0]
        for name, param in self.block.named_parameters():
            param.requires_grad_(name not in FROZEN)
        for attr in layers.names:
            param = nn.Parameter(getattr(layers, attr).detach().clone())
            setattr(layers, attr, param)
            self.register_parameter(attr, param)

    def forward(self, feats: torch.Tensor, token_embeds: torch.Tensor, valid: torch.Tensor,
                steps: int) -> List[torch.Tensor]:
        """Training-time test over ``steps`` depths (see the module docstring and
        :meth:`mtpctl.drafters.heads.eagle.EagleHead.forward`): ``[g_1, ..., g_steps]``, each ``[B, T, H]``
        the block's raw output at each row.

        Args:
            feats: ``[B, T, H]`` the body's hidden states (after its final norm).
            token_embeds: ``[B, T, H]`` the embeddings of each row's next token.
            valid: ``[B, T]`` False on padding.
        """
        b, t, _ = feats.shape
        slots = torch.arange(t, device=feats.device)[None]
        self.layers.block.reserve_rope(t + 1)  # rows sit at positions 1..t (known here, not on the device)
        cache, outs, current = _UnrolledKeys(), [], feats
        for step in range(1, steps + 1):
            x = self.layers.project(current, token_embeds)
            mask = unrolled_draft_mask(t, step, valid.cpu()).to(feats.device)
            g = self.layers.run_block(x, slots, cache, mask)
            cache.advance(t)
            outs.append(g)
            carried = self.layers.carried(g, self.layers.normed(g))
            current = torch.cat((feats[:, :1], carried[:, :-1]), dim=1)  # row p reads row p-1's output
        return outs

    def logits(self, g: torch.Tensor, lm_head=None) -> torch.Tensor:
        """Float32 logits of the block's outputs (``lm_head`` ignored: the layer's own head, or the
        target's where it has none)."""
        return self.layers.logits(self.layers.normed(g))

    def tensors(self) -> Dict[str, torch.Tensor]:
        """Checkpoint name (after the layer's prefix, :attr:`MtpLayers.prefix`) -> value of every tensor of
        the layer this module holds: the block's and the layer's own (frozen ones as they were read; norms
        held with an offset given back as stored where unchanged)."""
        layers = self.layers
        shapes = {layers.block_name(n): s for n, s in layers.shapes.items() if layers.in_block(n)}
        stored = {layers.block_name(n): t for n, t in layers.stored.items() if layers.in_block(n)}
        block = checkpoint_tensors(layers.block, shapes, stored if layers.offset else None)
        out = {layers.checkpoint_name(name): v for name, v in block.items()}
        out.update({name: layers.stored_value(name, getattr(self, attr).detach()) for attr, name in layers.names.items()})
        return out


class MtpTrainer(EagleTrainer):
    """:class:`~mtpctl.train.eagle.EagleTrainer` for a checkpoint's MTP layer (:class:`MtpHead`): no
    feature regression, the token cross-entropy to the body's argmax at each depth; ``num_heads`` is
    the depth trained and measured.

    Args:
        layers: the layer to train (read by :class:`~mtpctl.drafters.mtp.MtpLayers` beside ``target``,
            in float32); the other arguments as :class:`~mtpctl.train.trainer.Trainer`'s.
    """

    unit = "depth"
    feature_loss_weight = 0.0

    def __init__(self, target, feats, settings, work: Path, layers: MtpLayers, device=None):
        self.mtp_layers = layers
        super().__init__(target, feats, settings, work, device=device)

    def _heads_config(self, token_map):
        return None  # no head folder: the layer goes back into the checkpoint

    def _new_heads(self, token_map) -> nn.Module:
        return MtpHead(self.mtp_layers)

    def _token_embeds(self, tokens: torch.Tensor) -> torch.Tensor:
        slots = torch.arange(tokens.shape[1], device=tokens.device)
        return self.heads.layers.embedding(tokens.to(self.heads.layers.embed.device), slots).float()

    @torch.no_grad()
    def acceptance(self, seqs: Optional[Sequence[int]] = None) -> dict:
        """Per-depth acceptance of the layer over sequences ``seqs`` (default: the held-out ones), as the
        module docstring defines it: ``{"chains", "acceptance": [K], "top1": [K]}`` (rounded to 4 places;
        0s where no chain counts)."""
        k = self.s.num_heads
        through, top1, chains = torch.zeros(k), torch.zeros(k), 0
        for batch, rows, outs in self._unrolled(self.eval_seqs if seqs is None else seqs):
            n = rows.shape[2] - k + 1  # chains q = 0..n-1 (depth s at row q + s - 1)
            if n <= 0:
                continue
            counted = torch.stack([rows[s][:, s:s + n] for s in range(k)]).all(0)  # [B, n]
            hits = torch.stack([self.heads.logits(g[:, s:s + n][counted]).argmax(-1).cpu()
                                == batch["labels"][:, s:s + n][counted].cpu() for s, g in enumerate(outs)])
            chains += int(counted.sum())
            top1 += hits.sum(1).float()
            through += hits.long().cumprod(0).sum(1).float()
        scale = max(chains, 1)
        return {"chains": chains, "acceptance": [round(float(a) / scale, 4) for a in through],
                "top1": [round(float(a) / scale, 4) for a in top1]}
