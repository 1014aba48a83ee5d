"""Process-wide runtime settings."""

from __future__ import annotations

import ctypes
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


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed memory for reuse instead of handing it back to the system.

    A prefill's activations are tens of MB per block. By default glibc returns a freed heap top
    and freed large blocks to the kernel, so the next request's prefill takes page faults (the
    kernel zeroes each page) writing them again, and more so after anything that freed much
    memory, such as transformers' `generate` in a benchmark, whose next method's prefill ran
    slower than the others' (benchmarks/epyc/allocator.txt, from benchmarks/allocator.py).
    Blocks up to 32 MB (glibc's largest mmap threshold) now come from the heap, and the heap is
    not trimmed. The process keeps its peak memory.
    Returns whether it applied: not off glibc, nor with SPECLM_MALLOC=system.
    """
    if os.environ.get("SPECLM_MALLOC", "keep") == "system":
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 2**31 - 1), (_M_TOP_PAD, 64 << 20)))
