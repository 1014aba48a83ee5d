"""Justifies the prefill's row block (speclm.defaults.PREFILL_ROW_BLOCK): prefill time of
speclm's lean forward on int8 qwen2.5-coder-1.5b by prompt length, with the row-wise work run
in blocks of 64, 128 or 256 rows (speclm.forward.lean.ROW_BLOCK) or over the whole prompt at once.
Best of 2, variants interleaved.

Run: .venv/bin/python benchmarks/prefill_blocks.py > prefill-cpu.txt
Committed output: benchmarks/intel/records.md#prefill-cpu (Intel Xeon machine).
`--smoke --target FOLDER`: the same code path on a tiny model, prompts of 100 and 150 tokens, 1 round,
one torch thread.
"""
from __future__ import annotations

import argparse
import time

import torch

import speclm.forward.lean as lean
from speclm.forward.cache import StaticKV
from speclm.models.loading import load_model
from speclm.runtime import set_threads, usable_cores

BLOCKS = (64, 128, 256, None)  # None: the whole prompt as one block
LENGTHS = (100, 300, 1000)
SMOKE_LENGTHS = (100, 150)  # token ids 100 .. 249: within a tiny byte-level vocabulary


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", help="catalog name or model folder")
    parser.add_argument("--smoke", action="store_true", help="short prompts, 1 round, 1 thread")
    args = parser.parse_args()
    lengths, rounds = (SMOKE_LENGTHS, 1) if args.smoke else (LENGTHS, 2)
    set_threads(1 if args.smoke else usable_cores())
    target = load_model(args.target, quantize="int8")
    kv = StaticKV(target.model, 1, 1100)
    print(f"model={args.target} int8 threads={torch.get_num_threads()} torch={torch.__version__}")
    print("| prompt tokens | " + " | ".join(f"block {b} s" if b else "no blocks s" for b in BLOCKS) + " |")
    print("|---" * (len(BLOCKS) + 1) + "|")
    for length in lengths:
        best = {}
        for _ in range(rounds):
            for block in BLOCKS:
                lean.ROW_BLOCK = block or 1 << 30
                kv.truncate([0])
                t = time.perf_counter()
                kv.forward([list(range(100, 100 + length))], 1)
                best[block] = min(best.get(block, 1e9), time.perf_counter() - t)
        print(f"| {length} | " + " | ".join(f"{best[b]:.2f}" for b in BLOCKS) + " |")


if __name__ == "__main__":
    main()
