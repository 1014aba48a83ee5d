"""Sampling parameters and the distribution they define.

The target distribution that speculative sampling reproduces is the *processed* one:
logits / temperature, then top-k, then top-p (the order of transformers' `generate`).
Temperature 0 means greedy: argmax, no randomness drawn.

A request with a seed draws by position (`Coupled`): the token at position t is
argmax_x p_t(x) / E_t(x), where E_t(x) are exponential variables made from (seed, t) alone (the
exponential race, i.e. the Gumbel-max trick: the winner is distributed exactly as p_t). Plain decoding
draws so, and the verifier accepts a drafted token only where it is that token, so a seeded
request's text is its plain decoding's with the same seed, whatever the method, plan or batch. A
draft model draws its own tokens with the same E_t (over its distribution q_t), so where q_t is near
p_t its token is the target's too.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from speclm.errors import UsageError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise UsageError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise UsageError(f"top-k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits (..., V) -> probabilities (..., V), float32, after temperature, top-k, top-p."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p; the first is always kept
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from probs (V,)."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


_MASK64 = (1 << 64) - 1


def _mix(seed: int, position: int) -> int:
    """A 63-bit generator seed from (seed, position): splitmix64's finaliser over seed * golden + position."""
    x = (seed * 0x9E3779B97F4A7C15 + position) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


@functools.lru_cache(maxsize=64)  # a round asks for each position twice (the draft, then the verifier)
def _race(seed: int, position: int, vocab: int) -> torch.Tensor:
    """(vocab,) float32 Exp(1) variables of position `position` of a request seeded `seed`, one per
    token id (kept above 0: a token of probability 0 never wins)."""
    u = torch.rand(vocab, generator=torch.Generator().manual_seed(_mix(seed, position)))  # [0, 1)
    return (-torch.log1p(-u)).clamp_min_(1e-30)


@dataclass(frozen=True)
class Coupled:
    """A seeded sampled request's draws, by position (the module's docstring); vocab: the target's
    token ids (its logits' width), over which every position's variables are made."""

    seed: int
    vocab: int

    def token(self, probs: torch.Tensor, position: int, ids: torch.Tensor | None = None) -> int:
        """The token drawn at `position` from probs (V,) over token ids 0..V-1, or over the token ids
        `ids` (S,) of its columns (a draft's own vocabulary): that column. Exactly a draw from probs."""
        race = _race(self.seed, position, self.vocab)
        race = race[: probs.shape[-1]] if ids is None else race[ids.to(torch.long).cpu()]
        return int((probs.float().cpu() / race).argmax())
