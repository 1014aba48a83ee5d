"""A draft model's output head restricted to part of the vocabulary (frequency-ranked drafting).

A small draft's output head is a large share of its step: for qwen2.5-coder-0.5b, 136 M of its
494 M weights, read in full to score 151,936 tokens of which a reply uses few. Byte-level BPE
vocabularies (GPT-2's, Llama 3's, Qwen's) number tokens in the order their merges were learnt,
most frequent first, so the first N ids hold most of what a model writes. The draft scores
only those, plus every token of the request's prompt (a reply copies names and rare words from
it) and the end-of-sequence tokens.

This changes only what can be proposed: the target still scores the whole vocabulary and the
verifier decides, so greedy output and the sampled distribution stay exact (a draft
distribution that is zero outside the subset is as valid as any other). The price is a token
outside the subset, which the draft cannot propose: its round ends there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from speclm import lean
from speclm.quant import QuantLinear

ALIGN = 64  # the quantized layouts store output columns in groups of 64


class RestrictedHead:
    """ids (S,): the token ids scored: the `first` lowest (rounded down to whole groups of 64
    columns), then the extra ones, ascending; calling it maps hidden rows (R, E) to logits (R, S)."""

    def __init__(self, head: nn.Module, first: int, extra: list[int]):
        vocab = head.out_features
        first = min(vocab, first) // ALIGN * ALIGN  # whole column groups: views of the weights, no copy
        extra_ids = torch.tensor(sorted({t for t in extra if first <= t < vocab}), dtype=torch.long)
        self.ids = torch.cat([torch.arange(first), extra_ids])  # (S,)
        if not len(self.ids):
            raise ValueError("a restricted draft vocabulary needs at least one token")
        self.vocab_size = vocab
        parts = [_first_outputs(head, first)] if first else []
        parts += [_outputs(head, extra_ids)] if len(extra_ids) else []
        self._parts = parts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # (R, E) -> (R, S)
        if len(self._parts) == 1:
            return self._parts[0](x)
        return torch.cat([part(x) for part in self._parts], dim=-1)


def _first_outputs(head: nn.Module, n: int):
    if isinstance(head, QuantLinear):
        return head.first_outputs(n).rows
    weight = head.weight[:n]
    bias = head.bias[:n] if head.bias is not None else None
    return lambda x: F.linear(x, weight, bias)


def _outputs(head: nn.Module, ids: torch.Tensor):
    if isinstance(head, QuantLinear):
        return head.outputs(ids).rows
    weight = head.weight[ids.to(head.weight.device)]
    bias = head.bias[ids.to(head.weight.device)] if head.bias is not None else None
    return lambda x: F.linear(x, weight, bias)


def restricted_head(model, vocab: int, tokens: list[int]) -> RestrictedHead | None:
    """The model's output head over its `vocab` lowest ids and `tokens`; None where nothing is
    restricted: vocab 0 or not below the vocabulary's size, a head of another kind, or a model
    that speclm's lean forward (the only one that takes a replaced head) does not run."""
    head = model.get_output_embeddings()
    if not vocab or not isinstance(head, (QuantLinear, nn.Linear)) or vocab >= head.out_features:
        return None
    return RestrictedHead(head, vocab, tokens) if lean.supports(model) else None
