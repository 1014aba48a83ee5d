"""Process-wide runtime settings."""

from __future__ import annotations

import os

from speclm.errors import UsageError

QUANTIZE_MODES = ("none", "int8", "int4")  # weights: as published, or speclm.quant's int8 / int4


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity), which a container may limit below os.cpu_count()."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def set_threads(threads: int | None = None) -> int:
    """Set torch's intra-op threads: `threads`, or one per usable core. Returns the number set.

    Decoding at batch 1 is bound by memory bandwidth; more threads than cores only adds
    contention, and torch's own default can count cores the process may not use.
    """
    import torch

    if threads is not None and threads < 1:
        raise UsageError(f"threads must be >= 1, got {threads}")
    n = threads or usable_cores()
    torch.set_num_threads(n)
    return n
