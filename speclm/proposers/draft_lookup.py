"""A draft model and prompt lookup together: a row whose context repeats itself is drafted by
lookup, for free; the others by the draft model.

Prompt lookup wins where the output copies the prompt (summaries, answers from retrieved text)
and costs nothing, while a draft model wins everywhere else but pays a forward per drafted token.
Each round, per row: when the context's last `ngram_min`..`ngram_max` tokens occur earlier in it,
the tokens that followed are the row's draft (one-hot, as pld's); otherwise the draft model's.
The draft model runs in a round only if some row needs it, and catches up on the tokens committed
meanwhile in one forward the next time it runs (speclm.proposers.draft_model feeds every
committed token its cache lacks).

A batch whose every prompt is longer than `prompt_ratio` times its budget of new tokens never
starts the draft model: its prefill costs in proportion to the prompt and its gain over lookup
in proportion to the tokens generated, and long prompts are where lookup finds most to copy
(Spec-Bench's summarization and RAG prompts: prompt lookup beat the draft model on each of the
six measured; docs/design.md). Lookup then drafts alone with pld's settings.

Every choice depends on the context and the request alone, never on the target, so the
verifier's rejection sampling stays exact.
"""

from __future__ import annotations

import torch

from speclm.proposers.base import Draft
from speclm.proposers.draft_model import DraftModelProposer
from speclm.proposers.prompt_lookup import lookup
from speclm.sampling import SamplingParams


class DraftLookupProposer(DraftModelProposer):
    name = "draft+pld"

    def __init__(self, model, k: int = 4, confidence: float = 0.0, vocab: int = 0, always: tuple[int, ...] = (),
                 ngram_max: int = 3, ngram_min: int = 2, prompt_ratio: float = 3.0, lookup_k: int = 4):
        """k, confidence, vocab, always: the draft model's (DraftModelProposer); ngram_max,
        ngram_min: the lookup's while the draft model runs; prompt_ratio: the draft model stays off
        for a batch whose every prompt is longer than this times its max_new_tokens (0: always
        off, inf: always on); lookup_k: tokens per lookup draft when the model is off."""
        super().__init__(model, k=k, confidence=confidence, vocab=vocab, always=always)
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        self.prompt_ratio, self.lookup_k = prompt_ratio, lookup_k
        self.model_on = True  # this batch runs the draft model
        self.lookups = 0  # rows drafted by lookup since start (statistics)
        # per row, this round: the context length of a row drafted by lookup while the model
        # drafted too (its cache then holds the model's tokens, not the lookup's), else None
        self._cut: list[int | None] = []

    def start(self, batch_size: int, capacity: int, prompt_lengths=None, max_new_tokens=None) -> None:
        super().start(batch_size, capacity)
        self.lookups, self._cut = 0, []
        self.model_on = prompt_lengths is None or max_new_tokens is None or any(
            length <= self.prompt_ratio * budget for length, budget in zip(prompt_lengths, max_new_tokens))

    def propose(self, contexts, max_tokens, params: SamplingParams, generators) -> Draft:
        if not self.model_on:  # prompt lookup alone, as method pld
            found = [lookup(c, min(self.lookup_k, m), self.ngram_max, 1) if m > 0 else [] for c, m in zip(contexts, max_tokens)]
            self.lookups += sum(len(f) > 0 for f in found)
            return _one_hot_draft(found, params, 0, None)
        found = [lookup(c, min(self.k, m), self.ngram_max, self.ngram_min) if m > 0 else []
                 for c, m in zip(contexts, max_tokens)]
        by_lookup = [len(f) > 0 for f in found]
        self._cut = []
        if not any(m > 0 and not hit for m, hit in zip(max_tokens, by_lookup)):  # no row needs the model
            self.lookups += sum(by_lookup)
            return _one_hot_draft(found, params, 0, None)
        draft = super().propose(contexts, max_tokens, params, generators)
        if not any(by_lookup):
            return draft
        # rows with a lookup draft take it in place of the model's (computed alongside, batched)
        self.lookups += sum(by_lookup)
        self._cut = [len(c) if hit else None for c, hit in zip(contexts, by_lookup)]
        rows = [f if hit else t[:n] for f, hit, t, n in
                zip(found, by_lookup, draft.tokens.tolist(), draft.lengths.tolist())]
        return _one_hot_draft(rows, params, draft.forwards, draft.draft_probs, keep=[not h for h in by_lookup])

    def rollback(self, keep: list[int]) -> None:
        if self._cut:  # the model's tokens past a lookup row's context were never committed
            keep = [k if cut is None else min(k, cut) for k, cut in zip(keep, self._cut)]
            self._cut = []
        super().rollback(keep)


def _one_hot_draft(rows: list[list[int]], params: SamplingParams, forwards: int, model_probs: torch.Tensor | None,
                   keep: list[bool] | None = None) -> Draft:
    """A Draft of these token rows. Sampling: rows with keep[b] read their distributions from
    model_probs (B, K', V); the others are one-hot (a lookup draft)."""
    width = max((len(r) for r in rows), default=0)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    for b, r in enumerate(rows):
        tokens[b, : len(r)] = torch.tensor(r, dtype=torch.long)
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    if params.greedy or model_probs is None:
        return Draft(tokens, lengths, None, forwards)  # None: one-hot for every row
    probs = model_probs.new_zeros(len(rows), width, model_probs.shape[-1])  # (B, K, V)
    for b, r in enumerate(rows):
        if keep[b]:
            probs[b, : len(r)] = model_probs[b, : len(r)]
        elif r:
            probs[b, torch.arange(len(r)), tokens[b, : len(r)]] = 1.0
    return Draft(tokens, lengths, probs, forwards)
