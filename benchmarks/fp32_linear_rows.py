"""Justifies how speclm's fp32 path computes a linear layer over a few rows (speclm.forward.lean: FP32_FEW_ROWS and
FP32_PADDED_ROWS): whole-model fp32 GEMM cost by number of rows, as `F.linear(x, W)` (x W^T, what
transformers runs), as `(W x^T)^T`, and as that over the rows padded with zero rows to a multiple of 4,
over weights of the shapes of one decode step of Qwen2.5-1.5B (q/k/v and gate/up fused, output head
included, the embedding table aside: 6.2 GB of fp32). A speculative round's verification and a draft step
are such forwards of 1 to a few dozen rows. Interleaved, best of 2 medians of 3.

Run: .venv/bin/python benchmarks/fp32_linear_rows.py > fp32-linear-rows.txt
`--smoke`: the same code path over a tiny model's shapes, rows 1, 2 and 16, 1 repeat, one thread.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from gemm_shapes import SMOKE_STEP, TARGET_STEP  # benchmarks/gemm_shapes.py
from timing import median_ms  # benchmarks/timing.py

ROWS = tuple(range(1, 17)) + (32, 64, 128, 256)
SMOKE_ROWS = (1, 2, 16)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, 3 row counts, 1 repeat, 1 thread")
    args = parser.parse_args()
    shapes, row_counts = (SMOKE_STEP, SMOKE_ROWS) if args.smoke else (TARGET_STEP, ROWS)
    rounds, reps = (1, 1) if args.smoke else (2, 3)
    if args.smoke:
        torch.set_num_threads(1)
    torch.manual_seed(0)
    weights = [torch.randn(shape) * 0.02 for shape in shapes]
    gigabytes = sum(w.numel() * 4 for w in weights) / 1e9
    print(f"threads={torch.get_num_threads()} torch={torch.__version__} fp32 weights={gigabytes:.2f} GB "
          f"cpu capability={torch.backends.cpu.get_cpu_capability()}")
    print("| rows | F.linear ms | (W x^T)^T ms | F.linear / (W x^T)^T | (W x^T)^T, rows padded to a multiple of 4 ms |")
    print("|---|---|---|---|---|")
    for rows in row_counts:
        xs = {k: torch.randn(rows, k) for k in sorted({s[1] for s in shapes})}

        def linear():
            for w in weights:
                F.linear(xs[w.shape[1]], w)

        def transposed():
            for w in weights:
                torch.mm(w, xs[w.shape[1]].t()).t().contiguous()

        padded_rows = -(-rows // 4) * 4
        xp = {k: torch.cat([x, x.new_zeros(padded_rows - rows, k)]) for k, x in xs.items()}

        def padded():
            for w in weights:
                torch.mm(w, xp[w.shape[1]].t()).t()[:rows].contiguous()

        a, b, c = [], [], []
        for _ in range(rounds):  # interleaved: the machine's bandwidth drifts
            a.append(median_ms(linear, reps=reps))
            b.append(median_ms(transposed, reps=reps))
            c.append(median_ms(padded, reps=reps) if rows <= 16 else float("nan"))
        print(f"| {rows} | {min(a):.1f} | {min(b):.1f} | {min(a) / min(b):.2f} | {min(c):.1f} |", flush=True)


if __name__ == "__main__":
    main()
