"""Sampling parameters and the distribution they define.

The target distribution that speculative sampling reproduces is the *processed* one:
logits / temperature, then top-k, then top-p (the order of transformers' `generate`).
Temperature 0 means greedy: argmax, no randomness drawn.
"""

from __future__ import annotations

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
