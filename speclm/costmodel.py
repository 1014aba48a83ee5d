"""What a target forward costs on this machine, by the number of tokens it reads.

A tree's node budget trades the tokens it may gain against the time its verification takes;
on a CPU that time grows with every node (each is one more row through every weight matrix),
by how much depends on the machine and the kernels. The costs are measured once per model,
weights and thread count, over a cached 256-token context, and kept in
`$SPECLM_HOME/costs/<key>.json`, so the trees a model grows do not depend on a timing taken
during the request (and a sampled request with a seed stays reproducible on this machine).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from speclm.bench.machine import cpu_name
from speclm.models.store import model_home

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48)  # tokens per forward, measured
CONTEXT = 256  # cached tokens each measured forward attends
REPEATS = 5


@dataclass(frozen=True)
class ForwardCosts:
    """Seconds of a target forward over n tokens: intercept + slope * n, the least-squares line
    through the measured medians (each token is one more row through the same weights, so the
    cost grows by about the same each time; a line also smooths a sample a slow spell hit)."""

    seconds: dict[int, float]  # tokens read -> median seconds measured

    @property
    def line(self) -> tuple[float, float]:
        xs, ys = list(self.seconds), list(self.seconds.values())
        if len(xs) == 1:
            return ys[0], 0.0
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        slope = max(slope, 0.0)
        return my - slope * mx, slope

    def __call__(self, tokens: int) -> float:
        intercept, slope = self.line
        return max(intercept + slope * tokens, 1e-6)

    def to_dict(self) -> dict:
        return {str(k): v for k, v in self.seconds.items()}


def measure(model, sizes=SIZES, repeats: int = REPEATS) -> ForwardCosts:
    """Median seconds of forwards over each size, taken in turns (this machine's speed drifts
    within a minute; in turns a slow spell slows every size alike)."""
    from speclm.kv import StaticKV

    cfg = getattr(model.config, "text_config", None) or model.config
    length = min(CONTEXT, max(1, (getattr(cfg, "max_position_embeddings", None) or 1 << 20) - max(sizes) - 1))
    gen = torch.Generator().manual_seed(0)
    context = torch.randint(0, min(cfg.vocab_size, 30000), (length,), generator=gen).tolist()
    context = (context * (max(sizes) // length + 1))[: max(length, max(sizes))]
    kv = StaticKV(model, 1, len(context) + max(sizes) + 1)
    kv.forward([context[:length]], 1)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(repeats + 1):  # the first pass warms each shape up and is dropped
        for n in sizes:
            start = time.perf_counter()
            kv.forward([context[:n]], 1)
            times[n].append(time.perf_counter() - start)
            kv.truncate([length])
    return ForwardCosts({n: statistics.median(t[1:]) for n, t in times.items()})


def verification_costs(model, key: str) -> ForwardCosts:
    """This model's ForwardCosts, measured on first use and read from the cache after. key names
    the model and its weights (the thread count and the CPU are added here)."""
    name = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in f"{key}-{torch.get_num_threads()}t-{cpu_name()}")
    path = model_home() / "costs" / f"{name[:200]}.json"
    try:
        data = json.loads(path.read_text())
        return ForwardCosts({int(k): float(v) for k, v in data["seconds"].items()})
    except (OSError, ValueError, KeyError, TypeError):
        pass
    print("speclm: measuring this machine's verification cost by tree size (once per model, a few seconds)...",
          file=sys.stderr, flush=True)
    costs = measure(model)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "seconds": costs.to_dict()}, indent=1))
        tmp.replace(path)
    except OSError:
        pass  # an unwritable home: measured again next time
    return costs
