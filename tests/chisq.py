"""A chi-square goodness-of-fit check against an exact distribution.

ALPHA is each check's nominal false-failure probability: a correct sampler fails it with
probability about ALPHA over the choice of seeds (the tests fix their seeds, so a given run is
deterministic). So that the chi-square approximation holds, cells are pooled until every
cell expects at least MIN_EXPECTED samples (`pool`); cells of probability zero are checked
apart: a sample in one fails the check outright. The approximation is close, not exact:
simulated under the null (400,000 multinomial draws of 6000 samples from the exact joint of
each of test_sampling_distribution.py's four sampling settings, 1296 cells) the check failed
at rates from 1.2e-4 to 1.8e-4 for ALPHA = 1e-4 (the earlier pooling, which left cells
expecting < 5, failed 15 times too often at ALPHA = 1e-3 on the joint at temperature 1).

The sampling test files as a whole: a correct sampler passes a check (asserts p > ALPHA) in
    tests/test_sampling_distribution.py  33 checks
    tests/test_verify.py                  3 checks
    tests/test_draft_vocab.py             2 checks
    tests/test_tree_verify.py             6 checks
    tests/test_constraint.py             10 checks
54 checks in all, so by the union (Bonferroni) bound the false-failure probability of the
five files together is at most 54 * ALPHA = 5.4e-3 nominally (of test_sampling_distribution.py
alone 33 * ALPHA = 3.3e-3), and below 54 * 2e-4 = 1.08e-2 with the approximation's error as
measured, whatever the dependence between the checks. The mutation tests (a deliberately broken
sampler must fail, p < ALPHA) are the other direction: their failure rates are measured, and
stated, in test_sampling_distribution.py and test_tree_verify.py.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
from scipy import stats

from speclm.sampling import processed_probs

ALPHA = 1e-4
MIN_EXPECTED = 5.0


def pool(expected: np.ndarray, least: float = MIN_EXPECTED) -> list[np.ndarray]:
    """Groups of cell indices, every cell in exactly one, each expecting >= `least` in all (where
    the total does; else a single group). In order of increasing expectation, cells fill a group
    until it expects `least` (a cell expecting that much alone is its own group), and a remainder
    below `least` joins the last group."""
    expected = np.asarray(expected, float)
    groups: list[list[int]] = []
    current: list[int] = []
    total = 0.0
    for i in np.argsort(expected, kind="stable"):
        current.append(int(i))
        total += expected[i]
        if total >= least:
            groups.append(current)
            current, total = [], 0.0
    if current:  # the largest cells, together expecting less than `least`
        if groups:
            groups[-1].extend(current)
        else:
            groups.append(current)
    return [np.array(g) for g in groups]


def chisq_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """The chi-square test's p-value for `counts` drawn from `probs` (any shape, the same cells),
    over pooled cells each expecting >= MIN_EXPECTED; 0.0 if a cell of probability zero was hit."""
    counts, probs = np.asarray(counts, float).ravel(), np.asarray(probs, float).ravel()
    assert abs(probs.sum() - 1) < 1e-5, probs.sum()
    assert counts.shape == probs.shape
    zero = probs == 0
    if counts[zero].sum() > 0:
        return 0.0  # samples in cells of probability zero
    counts, probs = counts[~zero], probs[~zero]
    n = counts.sum()
    expected = probs / probs.sum() * n
    groups = pool(expected)
    if len(groups) < 2:
        return 1.0  # nothing to compare
    obs = np.array([counts[g].sum() for g in groups])
    exp = np.array([expected[g].sum() for g in groups])
    return float(stats.chisquare(obs, exp).pvalue)


def joint(model, prompt_ids: list[int], params, allowed: list) -> np.ndarray:
    """The exact P(first len(allowed) tokens after the prompt), shape (V,) * depth, under the
    model's processed distribution with the tokens not in allowed[j] at -inf at position j (every
    token allowed: the plain distribution), from one forward over every allowed prefix of depth - 1
    tokens (the last token is read off its logits)."""
    vocab, depth = model.config.vocab_size, len(allowed)
    prefixes = list(itertools.product(*allowed[: depth - 1]))
    ids = torch.tensor([prompt_ids + list(p) for p in prefixes])
    with torch.no_grad():
        logits = model(ids).logits[:, len(prompt_ids) - 1 :].clone()  # (P, depth, V)
    for j, tokens in enumerate(allowed):
        logits[:, j, [t for t in range(vocab) if t not in set(tokens)]] = float("-inf")
    probs = processed_probs(logits, params).double().numpy()
    out = np.zeros((vocab,) * depth)
    for i, prefix in enumerate(prefixes):
        out[prefix] = np.prod([probs[i, j, t] for j, t in enumerate(prefix)]) * probs[i, depth - 1]
    return out
