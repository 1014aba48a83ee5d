"""The timer and set-up the benchmark scripts share (imported as `timing`: a script's own folder
is on sys.path when it runs as `python benchmarks/NAME.py`)."""
from __future__ import annotations

import statistics
import time

from speclm.quant import kernels
from speclm.runtime import keep_freed_memory, set_threads, usable_cores


def kernel_run(smoke: bool) -> None:
    """A script that times speclm's compiled kernels starts here: it exits where they do not run,
    takes one torch thread for a smoke run (else the usable cores) and keeps freed memory, as the
    engine does (without it a many-row call's output is fresh pages every call)."""
    if kernels.compiled() is None:
        raise SystemExit("speclm's compiled kernels do not run here")
    set_threads(1 if smoke else usable_cores())
    keep_freed_memory()


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
