"""Prompt lookup (n-gram) drafting: no model, no probabilities.

The last n tokens of prompt + output are searched for earlier in the same sequence; the
tokens that followed the most recent earlier occurrence are proposed. The longest n in
[min_ngram, max_ngram] with a match wins. The draft is one-hot, so the verifier accepts
token d with probability target_probs[d], which keeps sampling lossless.
"""

from __future__ import annotations

import numpy as np

from speclm.proposers.base import Draft, Proposer
from speclm.sampling import SamplingParams


def lookup(sequence: list[int] | np.ndarray, k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to k tokens that followed the most recent earlier match of the longest trailing n-gram."""
    seq = np.asarray(sequence, dtype=np.int64)
    for n in range(max_ngram, min_ngram - 1, -1):
        if len(seq) <= n:
            continue
        pattern = seq[-n:]
        windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)  # windows ending before the last token
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return seq[start : start + k].tolist()
    return []


class PromptLookupProposer(Proposer):
    name = "pld"

    def __init__(self, k: int = 4, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.k, self.max_ngram, self.min_ngram = k, max_ngram, min_ngram
        self.max_nodes = k

    def found(self, contexts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        """Each row's lookup draft (empty: no match, or no budget)."""
        return [lookup(c, min(self.k, m), self.max_ngram, self.min_ngram) if m > 0 else [] for c, m in zip(contexts, max_tokens)]

    def shadow(self, contexts: list[list[int]]) -> list[list[int]]:
        return self.found(contexts, [self.k] * len(contexts))

    def propose(self, contexts, max_tokens, params: SamplingParams, generators) -> Draft:
        return Draft.from_rows(self.found(contexts, max_tokens))
