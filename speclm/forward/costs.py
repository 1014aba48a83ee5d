"""What a target forward costs on this machine, by the number of tokens it reads.

A tree's node budget trades the tokens it may gain against the time its verification takes;
on a CPU that time grows with every node (each is one more row through every weight matrix),
by how much depends on the machine and the kernels (the output projection included: every
token's logits are kept, as in a verification). The costs are measured once per model,
weights, thread count and build of the compiled kernels, over a cached 256-token context (each
size's median of REPEATS forwards: on a shared VM one forward varies by a third), and kept in
`$SPECLM_HOME/costs/<key>.json`, so the trees a model grows do not depend on a timing taken
during the request. A
table is touched when read; storing one removes the tables of other kernel builds for the same
model and processor that nobody read for STALE_DAYS (an upgrade leaves the old build's behind,
and two installs sharing the folder keep each their own). A
table measured while other work held the cores (the measuring threads got under BUSY of their
CPU time) is used for that process only and measured again by the next: its timings say as
much about the other work as about the model, and every tree sized from the file would
inherit them. On a GPU the forwards are timed to their end (synchronized) and the CPU-share
rule does not apply (the threads wait on the device). Removing the folder has every model
measured again.
"""

from __future__ import annotations

import bisect
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from functools import cached_property
from glob import escape as glob_escape
from typing import Callable

import torch
from tqdm.auto import tqdm

from speclm.files import atomic_write, cpu_name, home as model_home
from speclm.defaults import COST_REPEATS
from speclm.quant import kernels

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48)  # tokens per forward, measured
CONTEXT = 256  # cached tokens each measured forward attends
REPEATS = COST_REPEATS  # forwards timed per size (speclm.defaults): from a few, tables taken minutes apart differ by a third
BUSY = 0.75  # share of the measuring threads' CPU time below which the machine counts as busy
# What a measured forward returns and how many were timed, in the cache's file names: a table
# measured otherwise is measured again. Every token's logits: a verification scores each drafted
# token, so the output projection (151936 x 1536 for Qwen2.5 1.5B) runs for each of them.
FORM = f"all-logits-r{REPEATS}"
STALE_DAYS = 30  # another build's table unread this long is removed when a new table is stored


@dataclass(frozen=True)
class ForwardCosts:
    """Seconds of a target forward over n tokens, from the medians measured at some sizes.

    Between measured sizes: linear interpolation through the medians made non-decreasing (pool
    adjacent violators, so a sample a slow spell hit is averaged with its neighbours instead of
    bending the curve). Not a single line: kernels that tile rows make the cost a staircase (the
    AVX-512 int8 kernel reads 1 to 12 rows for about the price of one, 16 for 1.4), and a line
    through it would price small trees too high and large ones too low. Beyond the largest
    measured size: the least-squares line's slope (each token is one more row through the same
    weights)."""

    seconds: dict[int, float]  # tokens read -> median seconds measured
    # the measuring process's CPU seconds per wall second and thread while it measured (not stored:
    # a table read from its file was kept because this was at least BUSY)
    cpu_share: float = 1.0

    @cached_property
    def line(self) -> tuple[float, float]:
        xs, ys = list(self.seconds), list(self.seconds.values())
        if len(xs) == 1:
            return ys[0], 0.0
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        slope = max(slope, 0.0)
        return my - slope * mx, slope

    @cached_property
    def curve(self) -> tuple[list[int], list[float]]:
        """(sizes ascending, their non-decreasing fitted seconds)."""
        xs = sorted(self.seconds)
        blocks: list[list[float]] = []  # [sum, count] of pooled adjacent sizes
        for x in xs:
            blocks.append([self.seconds[x], 1.0])
            while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
                total, count = blocks.pop()
                blocks[-1][0] += total
                blocks[-1][1] += count
        ys = [s / c for s, c in blocks for _ in range(int(c))]
        return xs, ys

    def __call__(self, tokens: int) -> float:
        xs, ys = self.curve
        if tokens >= xs[-1]:
            return max(ys[-1] + self.line[1] * (tokens - xs[-1]), 1e-6)
        if tokens <= xs[0]:
            return max(ys[0], 1e-6)
        i = bisect.bisect_right(xs, tokens)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(y0 + (y1 - y0) * (tokens - x0) / (x1 - x0), 1e-6)

    def to_dict(self) -> dict:
        return {str(k): v for k, v in self.seconds.items()}


@dataclass
class StepTimes:
    """Seconds of a repeated operation (a draft forward) measured while it runs, by its size (tokens
    or rows fed), each a decayed mean of its measurements."""

    seconds: dict[int, float] = field(default_factory=dict)

    def record(self, size: int, seconds: float) -> None:
        old = self.seconds.get(size)
        self.seconds[size] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def drift(self, toward: Callable[[int], float], keep: float) -> None:
        """Each size's seconds moved toward `toward`'s by 1 - keep: an operation not run for a
        while is priced back toward its prior, not at one stalled measurement for good."""
        self.seconds = {n: keep * s + (1.0 - keep) * toward(n) for n, s in self.seconds.items()}

    def at(self, size: int, costs: Callable[[int], float]) -> float | None:
        """Seconds at `size`: measured, or the nearest measured size's (the smaller on a tie) scaled
        as `costs` (the target's forward) scales, the same kernels; None before any measurement."""
        if size in self.seconds:
            return self.seconds[size]
        if not self.seconds:
            return None
        near = min(self.seconds, key=lambda n: (abs(n - size), n))
        return self.seconds[near] * costs(size) / costs(near)


def sample(model, sizes=SIZES, passes: int = REPEATS + 1, desc: str = "verification cost"
           ) -> tuple[dict[int, list[float]], float]:
    """Seconds of forwards over each size, `passes` times, taken in turns (this machine's speed
    drifts within a minute; in turns a slow spell slows every size alike): ({size: [seconds per
    pass]}, the process's CPU seconds per wall second and thread meanwhile)."""
    from speclm.forward.cache import StaticKV

    cfg = getattr(model.config, "text_config", None) or model.config
    length = min(CONTEXT, max(1, (getattr(cfg, "max_position_embeddings", None) or 1 << 20) - max(sizes) - 1))
    gen = torch.Generator().manual_seed(0)
    context = torch.randint(0, min(cfg.vocab_size, 30000), (length,), generator=gen).tolist()
    context = (context * (max(sizes) // length + 1))[: max(length, max(sizes))]
    kv = StaticKV(model, 1, len(context) + max(sizes) + 1, spare=max(sizes))  # every forward is rolled back
    kv.forward([context[:length]], 1)
    device = _device(model)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    bar = tqdm(total=passes * len(sizes), desc=desc, unit="forward", leave=False, disable=None)  # a bar on a terminal only
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(passes):
        for n in sizes:
            sync()
            start = time.perf_counter()
            kv.forward([context[:n]], n)  # logits of every token read, as verification keeps them
            sync()
            times[n].append(time.perf_counter() - start)
            kv.truncate([length])
            bar.update()
    bar.close()
    share = (time.process_time() - cpu) / max(time.perf_counter() - wall, 1e-9) / torch.get_num_threads()
    return times, share if device.type == "cpu" else 1.0


def measure(model, sizes=SIZES, repeats: int = REPEATS) -> ForwardCosts:
    """The median of `repeats` forwards over each size (`sample`; a first pass warms each shape
    up and is dropped)."""
    times, share = sample(model, sizes, repeats + 1)
    return ForwardCosts({n: statistics.median(t[1:]) for n, t in times.items()}, cpu_share=share)


def _device(model) -> torch.device:
    return getattr(model, "device", None) or torch.device("cpu")


def _processor(model) -> str:
    """What runs the forwards: the CPU's name and thread count, or the GPU's name."""
    device = _device(model)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{torch.get_num_threads()}t-{cpu_name()}"


def verification_costs(model, key: str) -> ForwardCosts:
    """This model's ForwardCosts, measured on first use and read from the cache after. key names
    the model and its weights (the thread count and the CPU, or the GPU, and the compiled kernels'
    fingerprint are added here)."""
    prefix, suffix = _file_name(f"{key}-{_processor(model)}-"), _file_name(f"-{FORM}")
    path = model_home() / "costs" / f"{(prefix + _file_name(kernels.fingerprint()) + suffix)[:200]}.json"
    try:
        data = json.loads(path.read_text())
        costs = ForwardCosts({int(k): float(v) for k, v in data["seconds"].items()})
    except (OSError, ValueError, KeyError, TypeError):
        pass
    else:
        try:
            os.utime(path)  # read: in use by this build, not stale
        except OSError:
            pass  # a read-only home
        return costs
    print("speclm: measuring this machine's verification cost by tree size (once per model, up to a minute "
          "or so)...", file=sys.stderr, flush=True)
    costs = measure(model)
    if costs.cpu_share < BUSY:
        print(f"speclm: the machine was busy while measuring (this process got {costs.cpu_share:.0%} of its "
              f"threads' time); the table is used now and measured again next time", file=sys.stderr, flush=True)
        return costs
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps({"key": key, "seconds": costs.to_dict()}, indent=1))
    except OSError:
        return costs  # an unwritable home: measured again next time
    _remove_stale(path, prefix, suffix)
    return costs


def cache_path(folder: str, key: str, model) -> "os.PathLike":
    """A file in `$SPECLM_HOME/<folder>/` for what was measured of a model (key: the model and its
    weights) on this processor, thread count and kernel build."""
    name = _file_name(f"{key}-{_processor(model)}-{kernels.fingerprint()}")[:200]
    return model_home() / folder / f"{name}.json"


def _file_name(text: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in text)


def _remove_stale(kept, prefix: str, suffix: str) -> None:
    """Remove the tables of other kernel builds for kept's model and processor (the files named
    prefix<fingerprint>suffix.json) that were not read for STALE_DAYS."""
    cutoff = time.time() - STALE_DAYS * 86400
    for other in kept.parent.glob(f"{glob_escape(prefix)}*{glob_escape(suffix)}.json"):
        try:
            if other != kept and other.stat().st_mtime < cutoff:
                other.unlink()
        except OSError:
            pass  # removed by another process meanwhile, or not ours to remove
