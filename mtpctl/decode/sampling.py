"""Sampling as pure functions of logits, settings and an explicit ``torch.Generator``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen from the target's logits.

    Attributes:
        temperature: 0 = greedy (argmax); otherwise logits are divided by it.
        top_k: keep the k most likely tokens (0 = off).
        top_p: keep the smallest set of most likely tokens whose probability reaches top_p (1 = off).
        seed: seed of the generator that drives every random draw (None = nondeterministic).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self) -> torch.Generator:
        """A fresh CPU generator seeded with ``seed`` (or from the OS when None)."""
        g = torch.Generator()
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution tokens are sampled from: ``[..., vocab]`` float32 logits -> probabilities.

    Temperature, then top-k, then top-p (nucleus, Holtzman et al. 2020), as in HF transformers.
    For greedy params this is the one-hot of the argmax.
    """
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(torch.float32)
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly more likely tokens
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token id from ``probs [vocab]``."""
    return int(torch.multinomial(probs, 1, generator=generator))


def greedy_token(logits: torch.Tensor) -> int:
    """The index of the first largest of ``logits [vocab]``, as ``int(logits.argmax())``. A float32 CPU
    row goes through numpy's vectorized argmax: about 6 us for 49k logits, where torch's takes 40-100
    here (it is on every decode step's path)."""
    if logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.dim() == 1 and not logits.requires_grad:
        return int(logits.numpy().argmax())
    return int(logits.argmax())


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """The next token from ``logits [vocab]``: argmax when greedy, else a draw from the processed
    distribution."""
    if params.greedy:
        return greedy_token(logits)
    return sample(probs_from_logits(logits, params), generator)
