"""The timer the benchmark scripts share (imported as `timing`: a script's own folder is on
sys.path when it runs as `python benchmarks/NAME.py`)."""
from __future__ import annotations

import statistics
import time


def median_ms(fn, reps: int = 5, warmup: int = 1) -> float:
    """Median wall time of `reps` calls of fn(), in milliseconds, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3
