"""``add-heads --kind mtp``: measure and refresh a checkpoint's own MTP layers on the current body.

The layers are those ``--speculate mtp`` drafts with (:func:`~mtpctl.drafters.mtp.read_mtp_layers`, the
same row math): :class:`MtpHead` makes one layer's tensors trainable (float32) and :class:`MtpChain`
unrolls the k layers a checkpoint declares over whole sequences of the cached features, chained as the
drafter chains them, then the last layer recursively past them, as the EAGLE layer's training-time test
does (:class:`~mtpctl.train.eagle.EagleTrainer`, :func:`~mtpctl.decode.attention.unrolled_draft_mask`).

Rows are counted in one frame for every depth: depth s's output at row p predicts ``x_{p+2}`` and reads
the token ``x_{p+1}``; it is the draft s steps after the committed row q = p - s + 1 (the chain q, whose
pending token is ``x_{q+1}``):

- depth 1 at row p: layer 0 reads the body's hidden state ``h_p`` (after its final norm) and ``x_{p+1}``;
- depth s <= k: layer s-1's row p - s + 1 (its slot; position p + 1), reading depth s-1's output at row
  p-1 (raw or normed, :attr:`MtpSettings.carry`: layer s-2's output at the same slot) and ``x_{p+1}``,
  attending to its own rows up to p (each layer its own cache, its rows before s-1 holding nothing):
  teacher-forced, the DeepSeek-V3 report's sequential MTP modules (section 2.2), as transformers'
  ``MtpModel`` chains them;
- depth s > k: the last layer again, reading depth s-1's output at row p-1 and ``x_{p+1}``, attending to
  the depth-k rows up to p-s+k and to its own chain, exactly as a decode-time draft past the last layer
  (recursively, as vLLM does).

Labels are the body's own greedy predictions (self-distillation; the body stays frozen). The loss is a
sum over depths of each depth's mean cross-entropy: depths 1..k weigh 1 each (the report's objective
averages them, a constant factor AdamW ignores), a recursive depth s > k weighs ``head_decay^(s-k)``.

Acceptance (:meth:`MtpTrainer.acceptance`), teacher-forced on sequences whose features the body gave
(one body pass per sequence): for a sequence ``x`` and the body's greedy predictions ``pred`` (``pred[t]``
is its argmax after ``x_0..x_t``), a *chain* starts at each row q from the sequence's first loss row on
(the last committed position at decode time: layer 0 reads ``h_q`` and the pending token ``x_{q+1}``);
its depth-s draft ``d_s`` is the argmax for position q+s+1 and its label is ``pred[q+s]``; the token
depth s reads is ``x_{q+s}``, which is the depth s-1 draft whenever that draft was accepted and the
sequence follows the body's greedy path. A chain counts (at all K depths) when its labels exist and
``x_{q+i+1} == pred[q+i]`` for i = 1..K-1 (always so on self-distilled responses).

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
from typing import Dict, List, Optional, Sequence, Union

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
    """One MTP layer of the checkpoint as a trainable module: the block's parameters (the routing score
    bias excepted) and the layer's own tensors (``enorm``, ``hnorm``, ``eh_proj`` and the final norm where
    it is the layer's: :attr:`MtpLayers.names`) in float32; the embedding and head it reads stay frozen
    (as a final norm that is the body's). ``layers`` computes with these very tensors, so the drafter
    built on it drafts with what was trained.

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


class MtpChain(nn.Module):
    """The checkpoint's k MTP layers (:class:`MtpHead` each, in order) unrolled as the drafter runs them
    (see the module docstring): depth s <= k from layer s-1, deeper depths from the last layer again.

    Args:
        layers: one :class:`MtpLayers`, or every layer of the checkpoint in order (their
            :attr:`~MtpLayers.index` 0..k-1).

    Raises:
        ValueError: layers not in float32, or not the checkpoint's layers 0..k-1 in order.
    """

    def __init__(self, layers: Union[MtpLayers, Sequence[MtpLayers]]):
        super().__init__()
        layers = [layers] if isinstance(layers, MtpLayers) else list(layers)
        if [layer.index for layer in layers] != list(range(len(layers))):
            raise ValueError(f"MTP layers chain in order from the first, not {[layer.index for layer in layers]}")
        self.heads = nn.ModuleList(MtpHead(layer) for layer in layers)
        self.layers = layers

    @property
    def count(self) -> int:
        """k: the layers chained."""
        return len(self.layers)

    def layer_of(self, depth: int) -> MtpLayers:
        """The layer drafting depth ``depth`` (1-based): layer depth-1, the last one past them."""
        return self.layers[min(depth, self.count) - 1]

    def forward(self, feats: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor,
                steps: int) -> List[torch.Tensor]:
        """Training-time test over ``steps`` depths (see the module docstring):
        ``[g_1, ..., g_steps]``, each ``[B, T, H]`` the raw output of the block drafting that depth at
        each row (row p of depth s: the chain q = p - s + 1; rows before s - 1 hold nothing).

        Args:
            feats: ``[B, T, H]`` the body's hidden states (after its final norm).
            tokens: ``[B, T]`` each row's next token (row p: ``x_{p+1}``).
            valid: ``[B, T]`` False on padding.
        """
        b, t, _ = feats.shape
        rows = torch.arange(t, device=feats.device)
        outs, current, cache, embeds = [], feats, None, None
        for depth in range(1, steps + 1):
            index = min(depth, self.count) - 1
            layer = self.layers[index]
            if depth <= self.count:  # a layer of its own: its cache, its slots (row p is slot p - index)
                cache, embeds = _UnrolledKeys(), layer.embedding(tokens.to(layer.embed.device), rows - index).float()
                layer.block.reserve_rope(t + 1)  # row p sits at position p + 1 (known here, not on the device)
            owned = valid.cpu() & (torch.arange(t) >= index)[None]  # the layer's rows: from slot 0 on
            mask = unrolled_draft_mask(t, depth - index, owned).to(feats.device)
            g = layer.run_block(layer.project(current, embeds), (rows - index)[None], cache, mask)
            cache.advance(t)
            outs.append(g)
            carried = layer.carried(g, layer.normed(g))
            current = torch.cat((feats[:, :1], carried[:, :-1]), dim=1)  # row p reads row p-1's output
        return outs

    def logits(self, g: torch.Tensor, depth: int) -> torch.Tensor:
        """Float32 logits of depth ``depth``'s outputs ``g`` (its layer's final norm, then its own head or
        the target's lm_head)."""
        layer = self.layer_of(depth)
        return layer.logits(layer.normed(g))

    def values(self) -> Dict[str, torch.Tensor]:
        """Full checkpoint name -> value of every tensor the layers hold (:meth:`MtpHead.tensors`)."""
        out: Dict[str, torch.Tensor] = {}
        for head in self.heads:
            out.update({head.layers.prefix + name: value for name, value in head.tensors().items()})
        return out


class MtpTrainer(EagleTrainer):
    """:class:`~mtpctl.train.eagle.EagleTrainer` for a checkpoint's MTP layers (:class:`MtpChain`): no
    feature regression, the token cross-entropy to the body's argmax at each depth; ``num_heads`` is
    the depth trained and measured (at least the layers' count).

    Args:
        layers: the layers to train (read by :class:`~mtpctl.drafters.mtp.MtpLayers` beside ``target``,
            in float32): one, or the checkpoint's in order; the other arguments as
            :class:`~mtpctl.train.trainer.Trainer`'s.

    Raises:
        ValueError: fewer depths than layers.
    """

    unit = "depth"
    feature_loss_weight = 0.0

    def __init__(self, target, feats, settings, work: Path, layers: Union[MtpLayers, Sequence[MtpLayers]],
                 device=None):
        self.mtp_layers = [layers] if isinstance(layers, MtpLayers) else list(layers)
        if settings.num_heads < len(self.mtp_layers):
            raise ValueError(f"{len(self.mtp_layers)} MTP layers train at least as many depths, not {settings.num_heads}")
        super().__init__(target, feats, settings, work, device=device)

    def _heads_config(self, token_map):
        return None  # no head folder: the layers go back into the checkpoint

    def _new_heads(self, token_map) -> nn.Module:
        return MtpChain(self.mtp_layers)

    def _outputs(self, module: nn.Module, batch: dict) -> List[torch.Tensor]:
        return module(batch["feats"], batch["tokens"], batch["valid"], self.s.num_heads)

    def _logits(self, step: int, g: torch.Tensor) -> torch.Tensor:
        return self.heads.logits(g, step + 1)

    def _depth_weights(self) -> torch.Tensor:
        """Depths 1..k weigh 1, a recursive depth s > k ``head_decay^(s-k)``."""
        k = len(self.mtp_layers)
        past = (torch.arange(self.s.num_heads, dtype=torch.float32) - (k - 1)).clamp(min=0)
        return (self.s.head_decay ** past).to(self.device)

    @torch.no_grad()
    def acceptance(self, seqs: Optional[Sequence[int]] = None) -> dict:
        """Per-depth acceptance of the layers over sequences ``seqs`` (default: the held-out ones), as the
        module docstring defines it: ``{"chains", "acceptance": [K], "top1": [K]}`` (rounded to 4 places;
        0s where no chain counts)."""
        k = self.s.num_heads
        through, top1, chains = torch.zeros(k), torch.zeros(k), 0
        for batch, rows, outs in self._unrolled(self.eval_seqs if seqs is None else seqs):
            n = rows.shape[2] - k + 1  # chains q = 0..n-1 (depth s at row q + s - 1)
            if n <= 0:
                continue
            counted = torch.stack([rows[s][:, s:s + n] for s in range(k)]).all(0)  # [B, n]
            hits = torch.stack([self._logits(s, g[:, s:s + n][counted]).argmax(-1).cpu()
                                == batch["labels"][:, s:s + n][counted].cpu() for s, g in enumerate(outs)])
            chains += int(counted.sum())
            top1 += hits.sum(1).float()
            through += hits.long().cumprod(0).sum(1).float()
        scale = max(chains, 1)
        return {"chains": chains, "acceptance": [round(float(a) / scale, 4) for a in through],
                "top1": [round(float(a) / scale, 4) for a in top1]}
