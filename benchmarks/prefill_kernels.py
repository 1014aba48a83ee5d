"""Where a prefill's time goes on int8 qwen2.5-coder-1.5b and the int4 0.5B draft (each call of the
quantized GEMMs, oneDNN's or speclm's, and of speclm's compiled kernels timed from Python), and what tiling the attention's queries saves:
decode_attention with its default query tile (64 queries, the scores in cache) against one tile
of all a kv head's queries (the earlier behaviour: the scores of a 700-token prompt, tens of MB,
went to memory and back). Median of 3, variants interleaved.

Run: .venv/bin/python benchmarks/prefill_kernels.py > benchmarks/epyc/prefill-kernels.txt
"""
from __future__ import annotations

import collections
import statistics
import time

import torch

from speclm import kernels
from speclm.runtime import keep_freed_memory, set_threads, usable_cores

LENGTHS = (238, 700, 969)
TILES = (64, 10**6)


class Timed:
    """speclm's compiled module with every call timed; decode_attention gets `query_tile`."""

    def __init__(self, module):
        self.module, self.seconds, self.query_tile = module, collections.defaultdict(float), 64

    def __getattr__(self, name):
        fn = getattr(self.module, name)

        def timed(*args, **kw):
            if name == "decode_attention":
                kw["query_tile"] = self.query_tile
            start = time.perf_counter()
            out = fn(*args, **kw)
            self.seconds[name] += time.perf_counter() - start
            return out
        return timed


def main():
    set_threads(usable_cores())
    keep_freed_memory()
    timed = Timed(kernels.compiled())
    kernels.compiled = lambda: timed  # before the models are built: their layers bind it
    from speclm import quant
    from speclm.kv import StaticKV
    from speclm.models.loading import load_model

    for cls in (quant.Int8Linear, quant.Int4Linear):  # a GEMM call, whichever kernel runs it
        def rows(self, x, residual=None, _rows=cls.rows):
            start = time.perf_counter()
            out = _rows(self, x, residual)
            timed.seconds["gemm"] += time.perf_counter() - start
            return out
        cls.rows = rows

    print(f"threads={torch.get_num_threads()} torch={torch.__version__}")
    print("| model | prompt tokens | query tile | prefill s | GEMMs s | attention s | norms, silu s | rest s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, mode in (("qwen2.5-coder-1.5b", "int8"), ("qwen2.5-coder-0.5b", "int4")):
        model = load_model(name, quantize=mode, progress=False).model
        StaticKV(model, 1, 1100).forward([list(range(100, 164))], 1)  # warm-up
        for n in LENGTHS:
            rows = {tile: [] for tile in TILES}
            for _ in range(3):
                for tile in TILES:
                    timed.query_tile = tile
                    timed.seconds.clear()
                    kv = StaticKV(model, 1, 1100)
                    start = time.perf_counter()
                    kv.forward([list(range(1000, 1000 + n))], 1)
                    total = time.perf_counter() - start
                    s = timed.seconds
                    gemm = s["gemm"]
                    other = s["rms_norm"] + s["silu_mul"]
                    rows[tile].append((total, gemm, s["decode_attention"], other, total - gemm - s["decode_attention"] - other))
            for tile in TILES:
                m = [statistics.median(r[i] for r in rows[tile]) for i in range(5)]
                label = "all queries" if tile == 10**6 else str(tile)
                print(f"| {name} {mode} | {n} | {label} | " + " | ".join(f"{x:.3f}" for x in m) + " |", flush=True)


if __name__ == "__main__":
    main()
