import pytest
import torch

from speclm.proposers import PromptLookupProposer, lookup
from speclm.sampling import SamplingParams


@pytest.mark.parametrize(
    "seq, k, max_n, min_n, expected",
    [
        ([1, 2, 3, 4, 1, 2], 2, 3, 1, [3, 4]),  # trailing bigram 1 2 matched at the start
        ([1, 2, 3, 4, 1, 2], 5, 3, 1, [3, 4, 1, 2]),  # continuation stops at the end of the sequence
        ([5, 1, 2, 9, 7, 1, 2, 8, 3, 1, 2], 1, 2, 1, [8]),  # the most recent earlier match wins
        ([7, 1, 2, 3, 9, 2, 3, 4, 1, 2, 3], 2, 3, 1, [9, 2]),  # the longest n-gram (3) beats a later 2-gram
        ([7, 1, 2, 3, 9, 2, 3, 4, 1, 2, 3], 2, 2, 1, [4, 1]),  # with max 2: bigram 2 3 last seen at 5..6, then 4 1
        ([1, 2, 3], 3, 3, 1, []),  # no earlier occurrence of anything
        ([4, 4, 4], 3, 3, 1, [4]),  # overlapping match: 4 4 at 0..1 is followed by one 4
        ([1, 2, 3, 1], 2, 3, 2, []),  # min n-gram 2: the unigram match does not count
        ([1, 2, 3, 1], 2, 3, 1, [2, 3]),
        ([9], 3, 3, 1, []),
    ],
)
def test_lookup_table(seq, k, max_n, min_n, expected):
    assert lookup(seq, k, max_n, min_n) == expected


def test_proposer_respects_row_budgets():
    prop = PromptLookupProposer(k=4, max_ngram=2)
    contexts = [[1, 2, 3, 4, 5, 1, 2], [1, 2, 3, 4, 5, 1, 2], [6, 7]]
    draft = prop.propose(contexts, [4, 2, 4], SamplingParams(), [None] * 3)
    assert draft.lengths.tolist() == [4, 2, 0]
    assert draft.tokens[0].tolist() == [3, 4, 5, 1]
    assert draft.tokens[1, :2].tolist() == [3, 4]
    assert draft.draft_probs is None and draft.forwards == 0
    assert prop.propose([[1, 2, 1]], [0], SamplingParams(), [None]).lengths.tolist() == [0]
