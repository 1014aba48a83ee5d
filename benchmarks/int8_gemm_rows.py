"""Whole-model int8 GEMM cost by number of rows: speclm's compiled VNNI kernel
(speclm/csrc/cpu_kernels.cpp, activation quantization and rescale included), oneDNN's packed
int8 GEMM and `torch._int_mm` (GEMM alone), over weights of the shapes of one decode step of
Qwen2.5-1.5B (q/k/v and gate/up fused, output head included; 1.54 GB of int8). Interleaved,
median of 5; the weights are far larger than the caches, as in a real step. It is why
speclm.quant.Int8Linear takes speclm's kernel up to VNNI_MAX_ROWS (16) rows and oneDNN beyond (or, without
the compiled kernel, `_int_mm` for one row and oneDNN for more).

Run: .venv/bin/python benchmarks/int8_gemm_rows.py > benchmarks/int8-gemm-rows-cpu.txt
"""
from __future__ import annotations


import torch

from speclm import kernels
from speclm.quant import _vnni_layout

from timing import median_ms  # benchmarks/timing.py

SHAPES = [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)] * 28 + [(151936, 1536)]  # (out, in)


def main():
    torch.manual_seed(0)
    weights = [torch.randint(-127, 128, shape, dtype=torch.int8) for shape in SHAPES]
    gigabytes = sum(w.numel() for w in weights) / 1e9
    packed = [torch.ops.onednn.qlinear_prepack(w, None) for w in weights]
    scales = [torch.ones(w.shape[0]) for w in weights]
    zeros = [torch.zeros(w.shape[0], dtype=torch.long) for w in weights]
    compiled = kernels.compiled()
    vnni = [_vnni_layout(w) for w in weights] if compiled is not None else []
    print(f"threads={torch.get_num_threads()} torch={torch.__version__} int8 weights={gigabytes:.2f} GB")
    print("| rows | speclm VNNI ms | onednn.qlinear_pointwise ms | torch._int_mm ms |")
    print("|---|---|---|---|")
    for rows in (1, 2, 4, 6, 7, 8, 12, 16, 32, 64):
        xu = {k: torch.randint(1, 255, (rows, k), dtype=torch.uint8) for k in (1536, 8960)}
        xs = {k: torch.randint(-127, 128, (rows, k), dtype=torch.int8) for k in (1536, 8960)}

        def onednn():
            for w, p, s, z in zip(weights, packed, scales, zeros):
                torch.ops.onednn.qlinear_pointwise(xu[w.shape[1]], 1.0, 128, p, s, z, None, 1.0, 0, torch.float32,
                                                   "none", [], "")

        def int_mm():
            for w in weights:
                torch._int_mm(xs[w.shape[1]], w.t())

        xf = {k: torch.randn(rows, k) for k in (1536, 8960)}

        def speclm_vnni():
            for w, (packed_w, colsum), s in zip(weights, vnni, scales):
                compiled.linear_rows(xf[w.shape[1]], packed_w, colsum, s, None)

        a, b, c = [], [], []
        for _ in range(2):  # interleaved: the machine's bandwidth drifts
            if compiled is not None:
                c.append(median_ms(speclm_vnni))
            a.append(median_ms(onednn))
            b.append(median_ms(int_mm) if rows <= 16 else float("nan"))  # _int_mm re-lays out: slow, skipped
        vnni_ms = f"{min(c):.1f}" if c else "n/a"
        print(f"| {rows} | {vnni_ms} | {min(a):.1f} | {min(b):.1f} |", flush=True)


if __name__ == "__main__":
    main()
