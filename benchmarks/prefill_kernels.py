"""Justifies the compiled attention's query tile (speclm.defaults.ATTENTION_QUERY_TILE): where a
prefill's time goes on int8 qwen2.5-coder-1.5b and the int4 0.5B draft (each call of the
quantized GEMMs, oneDNN's or speclm's, and of speclm's compiled kernels timed from Python), and
what tiling the attention's queries saves: decode_attention with its default query tile (64
queries, the scores in cache) against one tile of all a kv head's queries (whose scores, tens of
MB for a 700-token prompt, go to memory and back). Median of 3, variants interleaved. Needs
speclm's compiled kernels.

Run: .venv/bin/python benchmarks/prefill_kernels.py > prefill-kernels.txt
Committed output: benchmarks/epyc/records.md#prefill-kernels (AMD EPYC machine).
`--smoke --target FOLDER --draft FOLDER`: the same code path on tiny models, prompts of 20 and
90 tokens, 1 round, one torch thread.
"""
from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

from speclm.quant import kernels
from speclm.runtime import keep_freed_memory, set_threads, usable_cores

LENGTHS = (238, 700, 969)
SMOKE_LENGTHS = (20, 90)  # 90 > 64: the query tile splits it
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", help="catalog name or model folder (int8)")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b", help="catalog name or model folder (int4)")
    parser.add_argument("--smoke", action="store_true", help="short prompts, 1 round, 1 thread")
    args = parser.parse_args()
    lengths, rounds, first_id = (SMOKE_LENGTHS, 1, 100) if args.smoke else (LENGTHS, 3, 1000)
    set_threads(1 if args.smoke else usable_cores())
    keep_freed_memory()
    compiled = kernels.compiled()
    if compiled is None:
        raise SystemExit("the compiled kernels do not run here")
    timed = Timed(compiled)
    kernels.compiled = lambda: timed  # before the models are built: their layers bind it
    from speclm.quant import weights as quant
    from speclm.forward.cache import StaticKV
    from speclm.models.loading import load_model

    for cls in (quant.Int8Linear, quant.Int4Linear):  # a GEMM call, whichever kernel runs it
        def rows(self, x, residual=None, gemm=cls.rows):
            start = time.perf_counter()
            out = gemm(self, x, residual)
            timed.seconds["gemm"] += time.perf_counter() - start
            return out
        cls.rows = rows

    print(f"threads={torch.get_num_threads()} torch={torch.__version__}")
    print("| model | prompt tokens | query tile | prefill s | GEMMs s | attention s | norms, silu s | rest s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, mode in ((args.target, "int8"), (args.draft, "int4")):
        model = load_model(name, quantize=mode, progress=False).model
        StaticKV(model, 1, 1100).forward([list(range(100, 164))], 1)  # warm-up
        for n in lengths:
            rows = {tile: [] for tile in TILES}
            for _ in range(rounds):
                for tile in TILES:
                    timed.query_tile = tile
                    timed.seconds.clear()
                    kv = StaticKV(model, 1, 1100)
                    start = time.perf_counter()
                    kv.forward([list(range(first_id, first_id + n))], 1)
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
