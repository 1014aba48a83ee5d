"""What the prefix cache costs and spares, on int8 qwen2.5-coder-1.5b and the int4 0.5B draft.

1. A prefill on quantized weights attends per query (so that a prompt read partly from the
   cache gives the bits of one read whole, speclm.lean): its time against the causal SDPA
   prefill it replaces, by prompt length.
2. A prompt whose first 24 tokens (Qwen2.5's chat head with its default system prompt) come
   from the cache: its prefill time against reading it whole, both per-query.
Median of 3, variants interleaved, on fresh caches.

Run: .venv/bin/python benchmarks/prefix_cache.py > benchmarks/epyc/prefix-cache.txt
"""
from __future__ import annotations

import statistics
import time

import torch

from speclm.kv import StaticKV
from speclm.models.loading import load_model
from speclm.prefix_cache import PrefixCache
from speclm.runtime import keep_freed_memory, set_threads, usable_cores

LENGTHS = (40, 84, 238, 700, 969)  # Spec-Bench chat prompts: qa, math, a long mt_bench, rag, the longest summary
HEAD = 24
IDS = list(range(1000, 2000))


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
    set_threads(usable_cores())
    keep_freed_memory()
    print(f"threads={torch.get_num_threads()} torch={torch.__version__}")
    print("| model | prompt tokens | SDPA prefill s | per-query prefill s | per-query / SDPA "
          f"| first {HEAD} from the cache s | saved by the cache |")
    print("|---|---|---|---|---|---|---|")
    for name, mode in (("qwen2.5-coder-1.5b", "int8"), ("qwen2.5-coder-0.5b", "int4")):
        model = load_model(name, quantize=mode, progress=False).model
        prefill(model, IDS[:64])  # warm-up
        for n in LENGTHS:
            times = {"sdpa": [], "query": [], "cached": []}
            for _ in range(3):
                times["sdpa"].append(prefill(model, IDS[:n], sdpa=True))
                times["query"].append(prefill(model, IDS[:n]))
                times["cached"].append(prefill(model, IDS[:n], cached=HEAD))
            m = {k: statistics.median(v) for k, v in times.items()}
            print(f"| {name} {mode} | {n} | {m['sdpa']:.3f} | {m['query']:.3f} | {m['query'] / m['sdpa']:.3f} "
                  f"| {m['cached']:.3f} | {1 - m['cached'] / m['query']:.0%} |", flush=True)


if __name__ == "__main__":
    main()
