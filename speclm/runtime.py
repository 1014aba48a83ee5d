"""Process-wide runtime settings."""

from __future__ import annotations

import ctypes
import functools
import os
import sys

from speclm.errors import UsageError
from speclm.memory import resident

# weights: as published, speclm.quant.weights's int8 / int4, or the GGUF's own blocks (speclm.quant.gguf)
QUANTIZE_MODES = ("none", "int8", "int4", "gguf")
QUANTIZE_CHOICES = ("auto",) + QUANTIZE_MODES  # the CLI's --quantize: auto resolves by `weights_for`
QUANTIZE_HELP = ("the target's weights. auto (default): where speclm's compiled CPU kernels run (the fast path, "
                 "and speculative output equals plain output bit for bit there) the mode `speclm tune` measured "
                 "fastest for the target and draft (int8 or gguf), int8 where it measured none; else the weights as loaded; "
                 "none: the weights as loaded (fp32 for the catalog's models); int8, int4: speclm.quant.weights's; "
                 "gguf: the GGUF file's own quantized blocks (Q4_K, Q6_K, Q8_0), not quantized again")


_SAID: set[str] = set()  # the weight choices already said on stderr in this process


def weights_for(quantize: str, draft_quantize: str | None = None, target: str | None = None,
                draft: str | None = None) -> tuple[str, str]:
    """The target's and the draft's weights for --quantize and --draft-quantize (None: the default).

    auto, where speclm's compiled kernels run: the mode `speclm tune` chose for this target and
    draft on this machine (speclm.tune.chosen_weights: the faster of int8 and gguf under `--method
    auto`, said once on stderr), int8 where it chose none (the two tied on the AVX-512 EPYC,
    benchmarks/epyc/records.md#gguf-auto); elsewhere none. The draft defaults to int4 beside an
    int8 or gguf target on those kernels (half a draft step's bytes; what is proposed changes, never
    the output), else to the target's weights.
    """
    from speclm.quant import kernels

    if quantize == "auto":
        quantize = "int8" if kernels.compiled() is not None else "none"
        if quantize == "int8" and target is not None:
            from speclm.tune import chosen_weights

            choice = chosen_weights(target, draft)
            if choice is not None:
                quantize = choice.mode
                if f"{target}+{draft}" not in _SAID:
                    _SAID.add(f"{target}+{draft}")
                    print(f"speclm: --quantize auto: {choice.describe()}", file=sys.stderr, flush=True)
    if draft_quantize in (None, "auto"):  # `none` asks nothing of the kernels (their first build takes a minute)
        draft_quantize = "int4" if quantize in ("int8", "gguf") and kernels.compiled() is not None else quantize
    return quantize, draft_quantize


def release_openmp_threads() -> bool:
    """Free the OpenMP worker threads that torch's operations on the calling thread created
    (libgomp's omp_pause_resource_all), before another thread takes over the model's work.

    Why: a thread that ran torch operations keeps its own pool of OpenMP workers. Once a second
    thread runs them (speclm serve's engine thread, after the main thread loaded the models),
    libgomp counts more threads than cores and stops spin-waiting at its barriers: every parallel
    region then sleeps and wakes its workers, and a decode step on 2 cores took 1.2x as long
    (benchmarks/engine_thread.py). Call it on the thread that is done, and run nothing parallel
    there afterwards. Returns whether it could (False: torch uses another OpenMP, or not Linux).
    """
    try:
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if "libgomp" in line.rsplit("/", 1)[-1]), None)
        if path is None:
            return False
        omp_pause_soft = 1
        return ctypes.CDLL(path).omp_pause_resource_all(omp_pause_soft) == 0
    except (OSError, AttributeError):
        return False


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
# Freed memory a process keeps for reuse between requests (bound_freed_memory): above a prefill
# block's activations (tens of MB), so a request's prefill reuses the last one's pages, and a
# bound on what a long-running process holds beyond what it uses.
KEPT_FREE_BYTES = 256 << 20


@functools.lru_cache(maxsize=None)
def _libc():  # called after every request (bound_freed_memory): loaded once
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return None


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed memory for reuse, up to KEPT_FREE_BYTES, instead of
    handing it back to the system at once.

    A prefill's activations are tens of MB per block. By default glibc returns a freed heap top
    and freed large blocks to the kernel, so the next request's prefill takes page faults (the
    kernel zeroes each page) writing them again, and more so after anything that freed much
    memory, such as transformers' `generate` in a benchmark, whose next method's prefill ran
    slower than the others' (benchmarks/epyc/records.md#allocator, from benchmarks/allocator.py).
    Blocks up to 32 MB (glibc's largest mmap threshold) now come from the heap, and the heap's
    free top is trimmed only beyond KEPT_FREE_BYTES. Freed blocks below other allocations are
    not at the top, so no threshold returns them: the engine calls bound_freed_memory after each
    request, which keeps resident memory bounded in a long-running process
    (benchmarks/avx2/records.md#load-memory's soak).
    Returns whether it applied: not off glibc, nor with SPECLM_MALLOC=system.
    """
    if os.environ.get("SPECLM_MALLOC", "keep") == "system":
        return False
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, KEPT_FREE_BYTES), (_M_TOP_PAD, 64 << 20)))


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def freed_bytes() -> int | None:
    """Bytes glibc's malloc holds free in its arenas (mallinfo2, glibc 2.33+); None elsewhere."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _MallInfo2
    return int(libc.mallinfo2().fordblks)


_resident_after_trim = 0  # anonymous resident bytes right after the last bound_freed_memory trim


def bound_freed_memory() -> None:
    """After a request: if malloc holds more than KEPT_FREE_BYTES free and the process's anonymous
    resident memory grew by more than KEPT_FREE_BYTES since the last trim, hand the free memory
    back (all but the heap's top pad; a walk over the free lists and one madvise per free run of
    pages). Free bytes alone cannot decide: a trim returns the pages of free blocks but leaves
    the blocks on malloc's free lists, so their total stays above the bound, every request would
    trim, and the next one would fault its pages back in. Requests that reuse the same freed memory
    leave resident memory flat and are not trimmed."""
    global _resident_after_trim
    free = freed_bytes()
    if free is None or free <= KEPT_FREE_BYTES:
        return
    now = resident()
    if now is None or now.anonymous > _resident_after_trim + KEPT_FREE_BYTES:
        release_freed_memory()
        after = resident()
        _resident_after_trim = after.anonymous if after is not None else 0


def release_freed_memory() -> None:
    """Hand the heap's free memory back to the system now (glibc's malloc_trim): after loading a
    model, whose build freed a layer's fp32 weights at a time."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


NO_DRAFT = "none"  # --draft none: no draft model, not even the catalog's (auto then plans without one)
DRAFT_NONE_HELP = f"; {NO_DRAFT}: no draft model (with none given, auto drafts with the catalog's for the target where it is in the store)"


def family_draft(target: str, method: str, draft: str | None = None) -> str | None:
    """The draft model to load: --draft as given (`none`: no draft model at all); with no --draft,
    for a method that may use one (auto), the draft the catalog names for the target, where it is
    already in the store (said on stderr; never pulled for this)."""
    from speclm.methods import DRAFT_MODEL, using
    from speclm.models.store import cached_family_draft

    if draft is not None:
        return None if draft == NO_DRAFT else draft
    draft = cached_family_draft(target) if method in using(DRAFT_MODEL) else None
    if draft is not None:
        print(f"speclm: {method} may draft with {draft}, the catalog's draft for {target}, found in the store "
              f"(--draft to choose another)", file=sys.stderr, flush=True)
    return draft
