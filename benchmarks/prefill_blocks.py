"""Prefill time of speclm's lean forward on int8 qwen2.5-coder-1.5b by prompt length, with the
row-wise work run in blocks of ROW_BLOCK rows (speclm.lean) or over the whole prompt at once.
Best of 2, variants interleaved.

Run: .venv/bin/python benchmarks/prefill_blocks.py > benchmarks/prefill-cpu.txt
"""
from __future__ import annotations

import time

import torch

import speclm.lean as lean
from speclm.kv import StaticKV
from speclm.models.loading import load_model
from speclm.runtime import set_threads, usable_cores

BLOCKS = (64, 128, 256, None)  # None: the whole prompt as one block


def main():
    set_threads(usable_cores())
    target = load_model("qwen2.5-coder-1.5b", quantize="int8")
    kv = StaticKV(target.model, 1, 1100)
    print(f"model=qwen2.5-coder-1.5b int8 threads={torch.get_num_threads()} torch={torch.__version__}")
    print("| prompt tokens | " + " | ".join(f"block {b} s" if b else "no blocks s" for b in BLOCKS) + " |")
    print("|---" * (len(BLOCKS) + 1) + "|")
    for length in (100, 300, 1000):
        best = {}
        for _ in range(2):
            for block in BLOCKS:
                lean.ROW_BLOCK = block or 1 << 30
                kv.truncate([0])
                t = time.perf_counter()
                kv.forward([list(range(100, 100 + length))], 1)
                best[block] = min(best.get(block, 1e9), time.perf_counter() - t)
        print(f"| {length} | " + " | ".join(f"{best[b]:.2f}" for b in BLOCKS) + " |")


if __name__ == "__main__":
    main()
