"""How a head's held-out accuracy grows with its training data (docs/decisions/heads-are-data-limited.md).

Trains head 1 of the recipe's shape (token-conditioned Medusa head: h + W_tok e(t+1), one residual
block x + SiLU(Wx + b) started as the identity, the frozen lm_head rows of the draft vocabulary) on
fractions of the features ``mtpctl add-heads`` cached (``$MTPCTL_HOME/work/features-*/features.safetensors``:
final hidden_states ``[T, hidden]``, token ids ``[T]``, the target's argmax ``[T]``), with AdamW and a
cosine schedule, and reports its top-1/top-4 accuracy on the same held-out sequences each time. Label of
position t: the target's argmax at t + 1 (the token two places on), as in training.

``--soft`` also trains with soft labels (KL to the target's distribution over the draft vocabulary,
from the cached hidden states); ``--text GLOB`` adds teacher-forced plain text (files matching GLOB, cut
into 256-token pieces, labels the target's argmax), alone and added to all the self-distilled data.

    python benchmarks/probe_head_data.py --features ~/.cache/mtpctl/work/features-d4d5a7679b216f46/features.safetensors
    python benchmarks/probe_head_data.py --features F --fractions 1 --soft
    python benchmarks/probe_head_data.py --features F --fractions 1 --text '/usr/lib/python3*/*.py' --text-tokens 150000
"""

from __future__ import annotations

import argparse
import glob
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from mtpctl.decode.attention import attention_masks
from mtpctl.model.decoder import Decoder
from mtpctl.model.sources import resolve_model
from mtpctl.model.tokenizer import TextCodec

PIECE = 256  # tokens of a teacher-forced text piece


class Head(nn.Module):
    """Head 1 of the recipe's shape; see the module docstring. ``[n, hidden]`` -> ``[n, hidden]``."""

    def __init__(self, hidden: int):
        super().__init__()
        self.tok = nn.Linear(hidden, hidden, bias=False)
        self.block = nn.Linear(hidden, hidden)
        for p in self.parameters():
            nn.init.zeros_(p)

    def forward(self, h: torch.Tensor, next_embed: torch.Tensor) -> torch.Tensor:
        x = h + self.tok(next_embed)
        return x + F.silu(self.block(x))


def response_positions(feats: dict, seqs) -> torch.Tensor:
    """Positions t whose label (argmax at t + 1) lies in a response, for the sequences ``seqs``."""
    offs, first = feats["offsets"], feats["loss_from"]
    return torch.cat([torch.arange(int(offs[s]) + max(int(first[s]) - 1, 0), int(offs[s + 1]) - 2) for s in seqs])


def text_features(model: Decoder, folder: Path, pattern: str, tokens: int) -> dict:
    """Teacher-forced features of plain text files (``hidden``, ``ids``, ``pred``, all positions)."""
    codec = TextCodec(folder)
    files = sorted(glob.glob(pattern))
    random.Random(0).shuffle(files)
    pieces = []
    for path in files:
        ids = codec.encode_prompt(Path(path).read_text(encoding="utf-8", errors="replace"), chat=False)
        pieces += [ids[i:i + PIECE] for i in range(0, len(ids) - PIECE, PIECE)]
        if len(pieces) * PIECE >= tokens:
            break
    hidden, preds = [], []
    depth = torch.arange(PIECE)
    with torch.inference_mode():
        for i in range(0, len(pieces), 8):
            x = torch.tensor(pieces[i:i + 8])
            h = model(x, depth[None].expand(len(x), -1), model.new_cache(PIECE, batch=len(x)),
                      attention_masks(model.cfg.layer_windows, 0, depth, None, PIECE))
            hidden.append(h.reshape(-1, h.shape[-1]))
            preds.append(model.logits(h).argmax(-1).reshape(-1))
    return {"hidden": torch.cat(hidden), "ids": torch.tensor(pieces).reshape(-1), "pred": torch.cat(preds)}


def train(name, parts, held_out, model, draft, soft=False, epochs=2, lr=0.01, batch=256):
    """Train a head on ``parts`` (list of (features, positions)) and print its held-out accuracy."""
    torch.manual_seed(0)
    to_draft = torch.full((model.cfg.vocab_size,), -100, dtype=torch.long)
    to_draft[draft] = torch.arange(len(draft))
    lm_head = model.dense_lm_head().float()
    proj, embed = lm_head[draft], model.embed.detach().float()
    h = torch.cat([f["hidden"][p] for f, p in parts])
    nxt = torch.cat([f["hidden"][p + 1] for f, p in parts]) if soft else None
    e_ids = torch.cat([f["ids"][p + 1] for f, p in parts])
    labels = torch.cat([to_draft[f["pred"][p + 1]] for f, p in parts])
    head = Head(h.shape[-1])
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    total, step, started = epochs * (len(labels) // batch), 0, time.perf_counter()
    for epoch in range(epochs):
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(epoch))
        for i in range(0, len(order) - batch + 1, batch):
            o = order[i:i + batch]
            for group in opt.param_groups:
                group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / total))
            step += 1
            logits = F.linear(head(h[o].float(), embed[e_ids[o]]), proj)
            if soft:
                with torch.no_grad():
                    target = F.softmax(F.linear(nxt[o].float(), lm_head)[:, draft], -1)
                loss = F.kl_div(F.log_softmax(logits, -1), target, reduction="batchmean")
            else:
                loss = F.cross_entropy(logits, labels[o], ignore_index=-100)
            opt.zero_grad()
            loss.backward()
            opt.step()
    feats, pos = held_out
    with torch.no_grad():
        logits = F.linear(head(feats["hidden"][pos].float(), embed[feats["ids"][pos + 1]]), proj)
        want = to_draft[feats["pred"][pos + 1]]
        keep = want != -100
        top1 = (logits.argmax(-1)[keep] == want[keep]).float().mean().item()
        top4 = (logits.topk(4, -1).indices[keep] == want[keep, None]).any(-1).float().mean().item()
    print(f"| {name} | {len(labels)} | {top1:.4f} | {top4:.4f} | {time.perf_counter() - started:.0f} |", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--features", type=Path, required=True, help="features.safetensors cached by mtpctl add-heads")
    p.add_argument("--model", default="smollm2-135m", help="the target the features come from")
    p.add_argument("--fractions", default="0.25,0.5,1", help="fractions of the training sequences' positions")
    p.add_argument("--draft-vocab", type=int, default=8192, help="the recipe's draft vocabulary")
    p.add_argument("--holdout", type=float, default=0.05, help="fraction of sequences held out")
    p.add_argument("--soft", action="store_true", help="also train on soft labels (all the data)")
    p.add_argument("--text", default=None, help="glob of plain text files to add, teacher-forced")
    p.add_argument("--text-tokens", type=int, default=150_000, help="tokens of --text to use")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    folder = resolve_model(args.model)
    model = Decoder.from_folder(folder, torch.bfloat16, blocked=True)
    feats = load_file(str(args.features))
    count = len(feats["loss_from"])
    order = torch.randperm(count, generator=torch.Generator().manual_seed(0)).tolist()
    cut = max(1, int(count * args.holdout))
    held_out = (feats, response_positions(feats, order[:cut]))
    train_pos = response_positions(feats, order[cut:])
    shuffled = train_pos[torch.randperm(len(train_pos), generator=torch.Generator().manual_seed(1))]
    draft = torch.bincount(feats["pred"], minlength=model.cfg.vocab_size).topk(args.draft_vocab).indices.sort().values
    print("| training data | positions | held-out top-1 | held-out top-4 | seconds |\n|---|---:|---:|---:|---:|")
    for fraction in (float(x) for x in args.fractions.split(",")):
        part = train_pos if fraction >= 1 else shuffled[:int(len(shuffled) * fraction)]
        train(f"self-distilled x{fraction:g}", [(feats, part)], held_out, model, draft)
    if args.soft:
        train("self-distilled, soft labels", [(feats, train_pos)], held_out, model, draft, soft=True)
    if args.text:
        text = text_features(model, folder, args.text, args.text_tokens)
        starts = torch.arange(len(text["ids"]))
        text_pos = starts[starts % PIECE < PIECE - 2]  # the label (t + 1) stays inside the piece
        train("text only", [(text, text_pos)], held_out, model, draft)
        train("self-distilled + text", [(feats, train_pos), (text, text_pos)], held_out, model, draft)


if __name__ == "__main__":
    main()
