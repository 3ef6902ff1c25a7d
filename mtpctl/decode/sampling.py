"""Sampling as pure functions of logits, settings and explicit randomness.

A sampled request draws the token at each position of its sequence from its own uniform,
:func:`position_uniform` of (seed, position): a counter-based generator (SplitMix64's output
function over the seed's stream, counted by position), so the token chosen at a position depends
on the target's distribution there and on nothing else: not on the drafter, the draft sizes, the
batch or the order in which rows were drawn. :func:`sample_at` turns that uniform into a token by
inverse CDF. Drafters that sample from their own distribution (draft models) still draw from a
``torch.Generator`` (:meth:`SamplingParams.generator`).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import Optional

import torch

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # SplitMix64's increment: 2^64 / the golden ratio


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
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not -(1 << 63) <= self.seed < (1 << 64):
            raise ValueError(f"seed must be an integer from -2**63 to 2**64 - 1, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def stream_seed(self) -> int:
        """The seed of a request's per-position uniforms: ``seed``, or a fresh one from the OS when None."""
        return self.seed if self.seed is not None else secrets.randbits(63)

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
    # shifted so the max is 0 and divided in float64: a tiny temperature (1e-45, 1e-300) sends the others
    # to -inf, where float32 would turn every logit into +-inf or 0/0 (NaN after softmax)
    logits = logits.double()
    logits = ((logits - logits.max(-1, keepdim=True).values) / params.temperature).float()
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


def _mix64(z: int) -> int:
    """SplitMix64's output function (Steele, Lea and Flood 2014): 64 well-mixed bits of ``z``."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def position_uniform(seed: int, position: int) -> float:
    """A uniform in [0, 1) for ``position`` (a token's index in its sequence) of the stream ``seed``:
    the ``position + 1``-th output of SplitMix64 started at a state mixed from the seed, computed
    directly from the counter. 53 bits, as ``random.random()``."""
    state = (_mix64(seed & _MASK) + (position + 1) * _GOLDEN) & _MASK
    return (_mix64(state) >> 11) * (1.0 / (1 << 53))


def sample_at(probs: torch.Tensor, u: float) -> int:
    """The token whose cumulative probability interval holds ``u`` (inverse CDF): ``probs [vocab]``,
    not necessarily normalised, summed in float64; a token of probability zero is never chosen."""
    cdf = probs.double().cumsum(-1)
    index = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True))
    return min(index, probs.shape[-1] - 1)


def greedy_token(logits: torch.Tensor) -> int:
    """The index of the first largest of ``logits [vocab]``, as ``int(logits.argmax())``. A float32 CPU
    row goes through numpy's vectorized argmax: about 6 us for 49k logits, where torch's takes 40-100
    here (it is on every decode step's path)."""
    if logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.dim() == 1 and not logits.requires_grad:
        return int(logits.numpy().argmax())
    return int(logits.argmax())


def next_token(logits: torch.Tensor, params: SamplingParams, u: float) -> int:
    """The token at a position from ``logits [vocab]``: argmax when greedy, else the processed
    distribution's token at the position's uniform ``u`` (:func:`sample_at`)."""
    if params.greedy:
        return greedy_token(logits)
    return sample_at(probs_from_logits(logits, params), u)
