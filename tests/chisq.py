"""A chi-square goodness-of-fit check against an exact distribution.

ALPHA is each check's false-failure probability: a correct sampler fails it with
probability ALPHA over the choice of seeds (the tests fix their seeds, so a given run is
deterministic). Cells with small expected counts are pooled so the chi-square
approximation holds (every pooled cell expects >= 5 samples).
"""

from __future__ import annotations

import numpy as np
from scipy import stats

ALPHA = 1e-4


def chisq_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    counts, probs = np.asarray(counts, float).ravel(), np.asarray(probs, float).ravel()
    assert abs(probs.sum() - 1) < 1e-5, probs.sum()
    n = counts.sum()
    expected = probs * n
    order = np.argsort(expected)
    small = order[np.cumsum(expected[order]) < 5]  # pool the rarest cells into one
    big = np.setdiff1d(np.arange(len(probs)), small)
    obs = np.append(counts[big], counts[small].sum())
    exp = np.append(expected[big], expected[small].sum())
    if exp[-1] == 0:
        assert obs[-1] == 0, "samples in cells of probability zero"
        obs, exp = obs[:-1], exp[:-1]
    return float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)
