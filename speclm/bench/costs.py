"""The cost model, measured: v(k) = cost of a target forward over k new tokens / over 1 token,
and c = cost of one draft step / one target step, per proposer.

Each forward runs over a cached prompt and is rolled back afterwards, so every sample sees
the same cache length. Medians over `repeats` samples, taken in turns across shapes.
"""

from __future__ import annotations

import statistics
import time

from speclm.forward.cache import StaticKV
from speclm.proposers import lookup
from speclm.proposers.draft_vocab import restricted_head


class _Forward:
    """One timed forward shape: `k` new tokens over a cached prompt, rolled back after each sample,
    so every sample sees the same cache length."""

    def __init__(self, model, prompt_ids: list[int], k: int, head=None):
        self.kv = StaticKV(model, 1, len(prompt_ids) + k + 1, spare=k)  # every sample is rolled back
        self.kv.forward([prompt_ids], 1, head)
        self.base = self.kv.lengths_list()[0]
        self.tokens = (prompt_ids * (k // len(prompt_ids) + 1))[:k]
        self.k, self.head = k, head
        self.times: list[float] = []

    def sample(self) -> None:
        start = time.perf_counter()
        self.kv.forward([self.tokens], self.k, self.head)
        self.times.append(time.perf_counter() - start)
        self.kv.truncate([self.base])

    @property
    def median(self) -> float:
        return statistics.median(self.times[1:])  # the first sample warms up allocations for this shape


def _round_robin(forwards: list[_Forward], repeats: int) -> None:
    """repeats + 1 samples of each shape, taken in turns (1, 2, ..., 16, 1, 2, ...): this VM's speed
    drifts by tens of percent within a minute, and in turns a slow spell slows every shape alike
    instead of one k's samples."""
    for _ in range(repeats + 1):
        for f in forwards:
            f.sample()


def measure_costs(target_model, draft_model, prompt_ids: list[int], ks: range = range(1, 17), repeats: int = 5,
                  pld_labels: list[str] = (), draft_vocabs: dict[str, int] | None = None,
                  always: tuple[int, ...] = ()) -> dict:
    """Returns {"target_step_seconds", "v": {k: ratio}, "c": {method label: ratio}, "draft_step_seconds"}.
    draft_vocabs: each draft method's label -> its draft vocabulary (0: whole; speclm.proposers.draft_vocab),
    measured with this prompt's tokens and `always` (EOS ids) added, as the method would;
    draft_step_seconds is the first draft method's step. Target and draft forwards are sampled
    in turns, so v and c are ratios of samples taken side by side."""
    target = {k: _Forward(target_model, prompt_ids, k) for k in sorted(set(ks) | {1})}
    drafts: dict[int, _Forward] = {}
    if draft_model is not None and draft_vocabs:
        for vocab in dict.fromkeys(draft_vocabs.values()):
            head = restricted_head(draft_model, vocab, list(prompt_ids) + list(always))
            drafts[vocab] = _Forward(draft_model, prompt_ids, 1, head)
    _round_robin([*target.values(), *drafts.values()], repeats)
    one = target[1].median
    v = {k: target[k].median / one if k > 1 else 1.0 for k in ks}
    c: dict[str, float] = {}
    out = {"target_step_seconds": one, "v": v, "c": c, "draft_step_seconds": None}
    if drafts:
        c.update({label: drafts[vocab].median / one for label, vocab in draft_vocabs.items()})
        out["draft_step_seconds"] = next(iter(drafts.values())).median
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
