"""The cost model, measured: v(k) = cost of a target forward over k new tokens / over 1 token,
and c = cost of one draft step / one target step, per proposer.

Each forward runs over a cached prompt and is rolled back afterwards, so every sample sees
the same cache length. Medians over `repeats` samples.
"""

from __future__ import annotations

import statistics
import time

from speclm.kv import StaticKV
from speclm.proposers import lookup


def _median_forward_seconds(model, prompt_ids: list[int], k: int, repeats: int) -> float:
    kv = StaticKV(model, 1, len(prompt_ids) + k + 1)
    kv.forward([prompt_ids], 1)
    base = kv.lengths_list()[0]
    tokens = (prompt_ids * (k // len(prompt_ids) + 1))[:k]
    times = []
    for _ in range(repeats + 1):  # the first sample warms up allocations for this shape
        start = time.perf_counter()
        kv.forward([tokens], k)
        times.append(time.perf_counter() - start)
        kv.truncate([base])
    return statistics.median(times[1:])


def measure_costs(target_model, draft_model, prompt_ids: list[int], ks: range = range(1, 17), repeats: int = 5,
                  pld_labels: list[str] = (), draft_labels: list[str] = ()) -> dict:
    """Returns {"target_step_seconds", "v": {k: ratio}, "c": {method label: ratio}, "draft_step_seconds"}."""
    one = _median_forward_seconds(target_model, prompt_ids, 1, repeats)
    v = {k: (_median_forward_seconds(target_model, prompt_ids, k, repeats) / one if k > 1 else 1.0) for k in ks}
    c: dict[str, float] = {}
    out = {"target_step_seconds": one, "v": v, "c": c, "draft_step_seconds": None}
    if draft_model is not None and draft_labels:
        step = _median_forward_seconds(draft_model, prompt_ids, 1, repeats)
        out["draft_step_seconds"] = step
        c.update({label: step / one for label in draft_labels})
    if pld_labels:
        seq = (prompt_ids * 8)[:1024]
        start = time.perf_counter()
        for _ in range(20):
            lookup(seq, 8)
        c.update({label: (time.perf_counter() - start) / 20 / one for label in pld_labels})
    return out


def predicted_speedup(tau: float, gamma: float, c: float, v: dict[int, float], draft_steps: float | None = None) -> float | None:
    """tau / (draft_steps * c + v(gamma + 1)), draft_steps defaulting to gamma (a chain of
    gamma draft-model steps); v is linearly interpolated between measured k."""
    x = gamma + 1
    lo, hi = int(x), int(x) + 1
    if lo not in v:
        return None
    vx = v[lo] if hi not in v else v[lo] + (v[hi] - v[lo]) * (x - lo)
    steps = gamma if draft_steps is None else draft_steps
    return tau / (steps * c + vx)
