"""Whole-model int8 GEMM cost by number of rows: oneDNN's packed int8 GEMM against
`torch._int_mm`, over weights of the shapes of one decode step of Qwen2.5-1.5B (q/k/v and
gate/up fused, output head included; 1.54 GB of int8). Only the GEMMs are timed, interleaved,
median of 5; the weights are far larger than the caches, as in a real step. It is why
speclm.quant.Int8Linear takes `_int_mm` for one row and oneDNN for more.

Run: .venv/bin/python benchmarks/int8_gemm_rows.py > benchmarks/int8-gemm-rows-cpu.txt
"""
from __future__ import annotations

import statistics
import time

import torch

SHAPES = [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)] * 28 + [(151936, 1536)]  # (out, in)


def median_ms(fn, reps=5):
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main():
    torch.manual_seed(0)
    weights = [torch.randint(-127, 128, shape, dtype=torch.int8) for shape in SHAPES]
    gigabytes = sum(w.numel() for w in weights) / 1e9
    packed = [torch.ops.onednn.qlinear_prepack(w, None) for w in weights]
    scales = [torch.ones(w.shape[0]) for w in weights]
    zeros = [torch.zeros(w.shape[0], dtype=torch.long) for w in weights]
    print(f"threads={torch.get_num_threads()} torch={torch.__version__} int8 weights={gigabytes:.2f} GB")
    print("| rows | onednn.qlinear_pointwise ms | torch._int_mm ms |")
    print("|---|---|---|")
    for rows in (1, 2, 4, 8):
        xu = {k: torch.randint(1, 255, (rows, k), dtype=torch.uint8) for k in (1536, 8960)}
        xs = {k: torch.randint(-127, 128, (rows, k), dtype=torch.int8) for k in (1536, 8960)}

        def onednn():
            for w, p, s, z in zip(weights, packed, scales, zeros):
                torch.ops.onednn.qlinear_pointwise(xu[w.shape[1]], 1.0, 128, p, s, z, None, 1.0, 0, torch.float32,
                                                   "none", [], "")

        def int_mm():
            for w in weights:
                torch._int_mm(xs[w.shape[1]], w.t())

        a, b = [], []
        for _ in range(2):  # interleaved: the machine's bandwidth drifts
            a.append(median_ms(onednn))
            b.append(median_ms(int_mm))
        print(f"| {rows} | {min(a):.1f} | {min(b):.1f} |")


if __name__ == "__main__":
    main()
