"""Justifies the prefix cache (speclm.defaults.PREFIX_CACHE_TOKENS) and its per-query prefill:
what the prefix cache costs and spares, on int8 qwen2.5-coder-1.5b and the int4 0.5B draft.

1. A prefill on quantized weights attends per query (so that a prompt read partly from the
   cache gives the bits of one read whole, speclm.forward.lean): its time against the causal SDPA
   prefill it replaces, by prompt length.
2. A prompt whose first 24 tokens (Qwen2.5's chat head with its default system prompt) come
   from the cache: its prefill time against reading it whole, both per-query.
Median of 3, variants interleaved, on fresh caches. Needs speclm's compiled kernels (int4 draft).

Run: .venv/bin/python benchmarks/prefix_cache.py > prefix-cache.txt
Committed output: benchmarks/epyc/records.md#prefix-cache (AMD EPYC machine).
`--smoke --target FOLDER --draft FOLDER`: the same code path on tiny models, prompts of 30 and
90 tokens, 1 round, one torch thread.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from speclm.forward.cache import StaticKV
from speclm.models.loading import load_model
from speclm.forward.prefix_cache import PrefixCache
from speclm.runtime import keep_freed_memory, set_threads, usable_cores

LENGTHS = (40, 84, 238, 700, 969)  # Spec-Bench chat prompts: qa, math, a long mt_bench, rag, the longest summary
SMOKE_LENGTHS = (30, 90)
HEAD = 24
IDS = list(range(1000, 2000))
SMOKE_IDS = list(range(100, 200))  # within a tiny byte-level vocabulary


def prefill(model, ids, sdpa: bool = False, cached: int = 0) -> float:
    kv = StaticKV(model, 1, 1100)
    if sdpa:  # the batched causal SDPA prefill, as on unquantized weights
        kv.lean.chunk_invariant = False
    if cached:
        cache = PrefixCache(2048)
        kv.forward([ids[:cached]], 1)
        cache.add(kv, 0, ids[:cached])
        kv = StaticKV(model, 1, 1100)
        cache.reuse(kv, 0, ids, cached)
    start = time.perf_counter()
    kv.forward([ids[cached:]], 1)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", help="catalog name or model folder (int8)")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b", help="catalog name or model folder (int4)")
    parser.add_argument("--smoke", action="store_true", help="short prompts, 1 round, 1 thread")
    args = parser.parse_args()
    lengths, ids, rounds = (SMOKE_LENGTHS, SMOKE_IDS, 1) if args.smoke else (LENGTHS, IDS, 3)
    set_threads(1 if args.smoke else usable_cores())
    keep_freed_memory()
    print(f"threads={torch.get_num_threads()} torch={torch.__version__}")
    print("| model | prompt tokens | SDPA prefill s | per-query prefill s | per-query / SDPA "
          f"| first {HEAD} from the cache s | saved by the cache |")
    print("|---|---|---|---|---|---|---|")
    for name, mode in ((args.target, "int8"), (args.draft, "int4")):
        model = load_model(name, quantize=mode, progress=False).model
        prefill(model, ids[:64])  # warm-up
        for n in lengths:
            times = {"sdpa": [], "query": [], "cached": []}
            for _ in range(rounds):
                times["sdpa"].append(prefill(model, ids[:n], sdpa=True))
                times["query"].append(prefill(model, ids[:n]))
                times["cached"].append(prefill(model, ids[:n], cached=HEAD))
            m = {k: statistics.median(v) for k, v in times.items()}
            print(f"| {name} {mode} | {n} | {m['sdpa']:.3f} | {m['query']:.3f} | {m['query'] / m['sdpa']:.3f} "
                  f"| {m['cached']:.3f} | {1 - m['cached'] / m['query']:.0%} |", flush=True)


if __name__ == "__main__":
    main()
