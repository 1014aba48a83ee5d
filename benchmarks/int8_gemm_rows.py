"""Justifies where int8 GEMMs switch from speclm's kernel to oneDNN's (speclm.defaults.VNNI_MAX_ROWS;
the kernel as built, with its WEIGHT_PREFETCH_BYTES): whole-model int8 GEMM cost by number of
rows, speclm's compiled kernel (speclm/quant/csrc/cpu_kernels.cpp, or cpu_kernels_avx2.cpp on an AVX2-only
CPU; activation quantization and rescale included), oneDNN's packed int8 GEMM and `torch._int_mm` (GEMM alone), over weights of
the shapes of one decode step of Qwen2.5-1.5B (q/k/v and gate/up fused, output head included;
1.54 GB of int8). Interleaved, best of 2 (`--rounds`) medians of 5; the weights are far larger than
the caches, as in a real step. On a CPU with AMX the kernel is timed twice, on its VNNI loop alone and
on AMX tiles from one row (checked bit for bit against each other first); the median ratio of 21
pairs of calls, back to back in alternating order, sets speclm.defaults.AMX_MIN_ROWS.
speclm.quant.weights.Int8Linear takes speclm's kernel at every row count (with SPECLM_ONEDNN=1, up to
VNNI_MAX_ROWS rows and oneDNN beyond; without the compiled kernel, `_int_mm` for one row and oneDNN for more). Without the compiled
kernels its column reads n/a.

`--int4` (CPUs with AMX): the int4 kernel (`linear_rows_w4`) over the GEMMs of one step of the 0.5B draft
(0.25 GB of int4), its AMX path against its VNNI loop, checked bit for bit and paired the same way
(speclm.defaults.AMX_MIN_ROWS_INT4).

Run: .venv/bin/python benchmarks/int8_gemm_rows.py > int8-gemm-rows.txt
Committed output: benchmarks/epyc/records.md#int8-gemm-rows (AMD EPYC machine), with `--int4`
benchmarks/amx/records.md#int4-gemm-rows (Intel Xeon with AMX). On AVX2-only CPUs oneDNN's int8 GEMM is
inexact: timed only.
`--smoke`: the same code path over a tiny model's shapes (hidden size 64), rows 1, 2, 16 and
32, 1 repeat, one torch thread.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from speclm.quant import kernels
from speclm.quant.weights import INT4_GROUP, int4_groups, int4_layout, vnni_layout

from gemm_shapes import DRAFT_HEAD, DRAFT_LAYERS, SMOKE_STEP, TARGET_STEP  # benchmarks/gemm_shapes.py
from timing import median_ms  # benchmarks/timing.py

ROWS = (1, 2, 3, 4, 6, 7, 8, 10, 12, 14, 16, 20, 24, 32, 48, 64)
SMOKE_ROWS = (1, 2, 16, 32)


def paired_ratio(vnni, amx, compiled, pairs: int) -> float:
    """Median over `pairs` pairs of (AMX call time / VNNI call time), the two calls back to back in
    alternating order: steadier than medians taken seconds apart on a VM whose bandwidth drifts."""
    ratios = []
    for i in range(pairs):
        seconds = {}
        for name in (("vnni", "amx") if i % 2 == 0 else ("amx", "vnni")):
            compiled.set_amx(0)
            start = time.perf_counter()
            (vnni if name == "vnni" else amx)()
            seconds[name] = time.perf_counter() - start
        ratios.append(seconds["amx"] / seconds["vnni"])
    kernels.amx()
    return statistics.median(ratios)


def int4_rows(compiled, shapes, row_counts, pairs: int) -> None:
    """--int4: the int4 kernel (linear_rows_w4) over the draft's GEMMs, its AMX path against its VNNI
    loop, paired as above (CPUs with AMX only)."""
    torch.manual_seed(0)
    layers = [int4_layout(*int4_groups(torch.randn(shape), INT4_GROUP)) + (shape[0],) for shape in shapes]
    gigabytes = sum(p.numel() for p, _, _ in layers) / 1e9
    print(f"threads={torch.get_num_threads()} torch={torch.__version__} int4 weights={gigabytes:.2f} GB "
          f"speclm kernel={kernels.describe() or 'n/a'}")
    print("| rows | AMX / VNNI (int4 kernel), median of paired calls |")
    print("|---|---|")
    for rows in row_counts:
        xf = {k: torch.randn(rows, k) for k in {s[1] for s in shapes}}

        def run():
            return [compiled.linear_rows_w4(xf[p.shape[1] * 8], p, s, n, None) for p, s, n in layers]

        def amx():
            compiled.set_amx(1)
            return run()

        compiled.set_amx(0)
        vnni_out = run()
        assert all(torch.equal(u, v) for u, v in zip(vnni_out, amx())), f"AMX differs from VNNI at {rows} rows"
        print(f"| {rows} | {paired_ratio(run, amx, compiled, pairs):.2f} |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, 4 row counts, 1 repeat, 1 thread")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds per row count (best of them)")
    parser.add_argument("--int4", action="store_true", help="the int4 kernel over the 0.5B draft's GEMMs, AMX "
                        "against VNNI (CPUs with AMX)")
    args = parser.parse_args()
    shapes, row_counts = (SMOKE_STEP, SMOKE_ROWS) if args.smoke else (TARGET_STEP, ROWS)
    rounds, reps, pairs = (1, 1, 2) if args.smoke else (args.rounds, 5, 21)
    if args.smoke:
        torch.set_num_threads(1)
    if args.int4:
        compiled = kernels.compiled()
        if not kernels.amx():
            raise SystemExit("--int4 compares the int4 kernel's AMX path with its VNNI loop: no AMX here")
        return int4_rows(compiled, SMOKE_STEP if args.smoke else DRAFT_LAYERS + DRAFT_HEAD, row_counts, pairs)
    in_features = sorted({s[1] for s in shapes})
    torch.manual_seed(0)
    weights = [torch.randint(-127, 128, shape, dtype=torch.int8) for shape in shapes]
    gigabytes = sum(w.numel() for w in weights) / 1e9
    packed = [torch.ops.onednn.qlinear_prepack(w, None) for w in weights]
    scales = [torch.ones(w.shape[0]) for w in weights]
    zeros = [torch.zeros(w.shape[0], dtype=torch.long) for w in weights]
    compiled = kernels.compiled()
    vnni = [vnni_layout(w) for w in weights] if compiled is not None else []
    print(f"threads={torch.get_num_threads()} torch={torch.__version__} int8 weights={gigabytes:.2f} GB "
          f"speclm kernel={kernels.describe() or 'n/a'}")
    amx = compiled is not None and hasattr(compiled, "set_amx") and kernels.amx()
    print("| rows | speclm kernel ms (VNNI) | speclm kernel ms (AMX) | AMX / VNNI, median of paired calls | "
          "onednn.qlinear_pointwise ms | torch._int_mm ms |")
    print("|---|---|---|---|---|---|")
    for rows in row_counts:
        xu = {k: torch.randint(1, 255, (rows, k), dtype=torch.uint8) for k in in_features}
        xs = {k: torch.randint(-127, 128, (rows, k), dtype=torch.int8) for k in in_features}

        def onednn():
            for w, p, s, z in zip(weights, packed, scales, zeros):
                torch.ops.onednn.qlinear_pointwise(xu[w.shape[1]], 1.0, 128, p, s, z, None, 1.0, 0, torch.float32,
                                                   "none", [], "")

        def int_mm():
            for w in weights:
                torch._int_mm(xs[w.shape[1]], w.t())

        xf = {k: torch.randn(rows, k) for k in in_features}

        def speclm_vnni():
            return [compiled.linear_rows(xf[w.shape[1]], packed_w, colsum, s, None)
                    for w, (packed_w, colsum), s in zip(weights, vnni, scales)]

        def speclm_amx():  # the same kernel with its AMX tiles from 1 row, where the CPU has them
            compiled.set_amx(1)
            try:
                return speclm_vnni()
            finally:
                kernels.amx()

        if amx:  # the same bits either way
            compiled.set_amx(0)
            vnni_out = speclm_vnni()
            assert all(torch.equal(u, v) for u, v in zip(vnni_out, speclm_amx())), f"AMX differs from VNNI at {rows} rows"
        a, b, c, d = [], [], [], []
        for _ in range(rounds):  # interleaved: the machine's bandwidth drifts
            if compiled is not None:
                if amx:
                    compiled.set_amx(0)  # VNNI alone
                c.append(median_ms(speclm_vnni, reps=reps))
                if amx:
                    d.append(median_ms(speclm_amx, reps=reps))
            a.append(median_ms(onednn, reps=reps))
            b.append(median_ms(int_mm, reps=reps) if rows <= 16 else float("nan"))  # _int_mm re-lays out: slow, skipped
        vnni_ms = f"{min(c):.1f}" if c else "n/a"
        amx_ms = f"{min(d):.1f}" if d else "n/a"
        ratio = f"{paired_ratio(speclm_vnni, speclm_amx, compiled, pairs):.2f}" if d else "n/a"
        print(f"| {rows} | {vnni_ms} | {amx_ms} | {ratio} | {min(a):.1f} | {min(b):.1f} |", flush=True)
    if amx:
        kernels.amx()


if __name__ == "__main__":
    main()
