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

from speclm.forward import lean
from speclm.quant.weights import QuantLinear

ALIGN = 64  # the quantized layouts store output columns in groups of 64


class RestrictedHead:
    """ids (S,): the token ids scored: the `first` lowest (rounded down to whole groups of 64
    columns), then the extra ones, ascending; calling it maps hidden rows (R, E) to logits (R, S)."""

    def __init__(self, head: nn.Module, first: int, extra: list[int]):
        vocab = head.out_features
        first, extra_ids = _split(vocab, first, extra)
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


def _split(vocab_size: int, first: int, extra: list[int]) -> tuple[int, torch.Tensor]:
    """The lowest ids kept (rounded down to whole column groups: views of the weights, no copy)
    and the extra ids past them, ascending."""
    first = min(vocab_size, first) // ALIGN * ALIGN
    return first, torch.tensor(sorted({int(t) for t in extra if first <= t < vocab_size}), dtype=torch.long)


def restricts(model, vocab: int, head: nn.Module | None = None) -> bool:
    """Whether `vocab` restricts this model's head (or `head`, a stand-in for it): not 0 nor at
    least the vocabulary's size, a head of a kind speclm slices, and a model speclm's lean forward
    (the only one that takes a replaced head) runs."""
    head = model.get_output_embeddings() if head is None else head
    return (bool(vocab) and isinstance(head, (QuantLinear, nn.Linear)) and vocab < head.out_features
            and lean.supports(model))


def restricted_head(model, vocab: int, tokens: list[int]) -> RestrictedHead | None:
    """The model's output head over its `vocab` lowest ids and `tokens`; None where nothing is
    restricted (`restricts`)."""
    return RestrictedHead(model.get_output_embeddings(), vocab, tokens) if restricts(model, vocab) else None


def token_of(ids: torch.Tensor | None, column: int) -> int:
    """The token id of a column of logits over token ids `ids` (None: columns are token ids)."""
    return column if ids is None else int(ids[column])


def on_vocabulary(probs: torch.Tensor, ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """probs (S,) over token ids `ids` -> (V,), zero elsewhere: the distribution the verifier reads."""
    if ids is None:
        return probs
    return probs.new_zeros(vocab_size).index_copy_(0, ids.to(probs.device), probs)


class RowVocabs:
    """The rows of a batch each with its own restricted vocabulary (the lowest ids, its own prompt's
    tokens, `always`) under one RestrictedHead over their union: a row's logits are its own
    columns of the union's, in ascending id order, so what it drafts does not depend on the other
    rows of the batch (each column of the head is computed on its own: speclm.quant.weights's kernels).
    The union grows as rows join; rows that left keep their columns until it is rebuilt."""

    def __init__(self, model, vocab: int, always: tuple[int, ...], head: nn.Module | None = None):
        """head: the output head to restrict (None: the model's own; a stand-in such as self's int4 copy)."""
        self.model, self.vocab, self.always = model, vocab, tuple(always)
        self.full = model.get_output_embeddings() if head is None else head  # the head restricted
        self.head: RestrictedHead | None = None
        self.ids: list[torch.Tensor | None] = []  # per row: its own token ids (S_b,), ascending; None: not read yet
        self._at: list[torch.Tensor | None] = []  # per row: its columns of the head (S_b,); None: all of them

    def add(self, count: int) -> None:
        self.ids += [None] * count
        self._at += [None] * count

    def select(self, rows: list[int]) -> None:
        self.ids = [self.ids[r] for r in rows]
        self._at = [self._at[r] for r in rows]

    def read(self, rows: list[int], contexts: list[list[int]]) -> None:
        """Rows `rows` start drafting: their vocabularies from their contexts (prompt + first token)."""
        if not restricts(self.model, self.vocab, self.full):
            return
        size = self.full.out_features
        for b, context in zip(rows, contexts):
            first, extra = _split(size, self.vocab, list(context) + list(self.always))
            self.ids[b] = torch.cat([torch.arange(first), extra])
        first = _split(size, self.vocab, [])[0]
        held = set() if self.head is None else set(self.head.ids[first:].tolist())
        wanted = {t for ids in self.ids if ids is not None for t in ids[first:].tolist()}
        rebuilt = self.head is None or not wanted <= held  # a new row's tokens are not columns yet
        if rebuilt:
            self.head = RestrictedHead(self.full, self.vocab, sorted(wanted))
        for b in range(len(self.ids)) if rebuilt else rows:  # the columns move only where the head is new
            ids = self.ids[b]
            whole = ids is None or len(ids) == len(self.head.ids)
            self._at[b] = None if whole else torch.searchsorted(self.head.ids, ids)

    def logits(self, b: int, logits: torch.Tensor) -> torch.Tensor:
        """Row b's logits (..., S) over the head's columns -> (..., S_b) over its own."""
        at = self._at[b]
        return logits if at is None else logits[..., at.to(logits.device)]

    def token_ids(self, b: int) -> torch.Tensor | None:
        """Row b's column -> token id (S_b,); None: columns are token ids (no restriction)."""
        if self.head is None:
            return None
        return self.head.ids if self._at[b] is None else self.ids[b]

    def mask(self, rows: list[int], width: int) -> torch.Tensor | None:
        """(len(rows), S) True at each row's own columns; None where every row reads them all."""
        if all(self._at[b] is None for b in rows):
            return None
        out = torch.zeros(len(rows), width, dtype=torch.bool)
        for i, b in enumerate(rows):
            if self._at[b] is None:
                out[i] = True
            else:
                out[i, self._at[b]] = True
        return out
