"""Paired A/B of speclm's int8 GEMM kernel (`linear_rows`) as built against another version of its
source: whole-model GEMMs of one decode step of Qwen2.5-1.5B (the shapes of int8_gemm_rows.py, 1.54
GB of int8), timed in pairs, the two builds back to back in alternating order, and the median of
the pairs' ratios reported. On a VM whose memory bandwidth drifts by tens of percent within minutes,
a ratio taken within a pair is steadier than medians taken minutes apart. The two builds' outputs
are checked bit for bit first (odd shapes, 1 to 13 rows, bias and residual).

The other version is a git revision (`--against REV`: its kernel source and common.h, from `git
show`) or a source file (`--against-source FILE`, its common.h beside it); it is built with the
same flags as the running build (speclm.quant.kernels), for the instruction set this CPU runs.

Run: .venv/bin/python benchmarks/kernel_ab.py --against d30e361 > benchmarks/avx2/int8-kernel-ab.txt
`--smoke`: tiny shapes, rows 1 and 3, 3 pairs, one torch thread, against the running build's own
source.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from speclm.quant import kernels
from speclm.quant.weights import vnni_layout

SHAPES = [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)] * 28 + [(151936, 1536)]  # (out, in)
SMOKE_SHAPES = [(128, 64), (64, 64), (256, 64), (64, 128)] * 2 + [(320, 64)]
CHECK_SHAPES = [(200, 100), (64, 1536), (333, 896), (1000, 37)]  # (out, in): tails of groups and quads


def other_build(against: str | None, source: str | None, folder: Path):
    """The other version's module, built into `folder`'s sources with the running build's flags."""
    name, files, cflags = kernels.build()
    main, header = files
    if source is not None:
        src = Path(source)
        if not src.is_file() or not src.with_name("common.h").is_file():
            sys.exit(f"kernel_ab.py: {source} and a common.h beside it are needed")
        texts = {main.name: src.read_text(), header.name: src.with_name("common.h").read_text()}
    elif against is not None:
        root = Path(__file__).resolve().parents[1]
        texts = {}
        for path in (main, header):
            rel = path.resolve().relative_to(root).as_posix()
            got = subprocess.run(["git", "-C", str(root), "show", f"{against}:{rel}"], capture_output=True, text=True)
            if got.returncode != 0:
                sys.exit(f"kernel_ab.py: git show {against}:{rel}: {got.stderr.strip()}")
            texts[path.name] = got.stdout
    else:
        texts = {p.name: p.read_text() for p in (main, header)}
    for file_name, text in texts.items():
        (folder / file_name).write_text(text)
    from torch.utils import cpp_extension

    return cpp_extension.load(name=f"{name}_other", sources=[str(folder / main.name)], extra_cflags=cflags,
                              extra_ldflags=["-fopenmp"], build_directory=str(folder), verbose=False)


def check_same_bits(a, b) -> None:
    torch.manual_seed(1)
    for n, k in CHECK_SHAPES:
        w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        packed, colsum = vnni_layout(w)
        scale, bias = torch.rand(n), torch.randn(n)
        for rows in range(1, 14):
            x, residual = torch.randn(rows, k) * 3, torch.randn(rows, n)
            for extra in ((None,), (bias,), (bias, residual)):
                if not torch.equal(a.linear_rows(x, packed, colsum, scale, *extra),
                                   b.linear_rows(x, packed, colsum, scale, *extra)):
                    sys.exit(f"kernel_ab.py: the builds differ at {rows} rows of a {n} x {k} weight")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", help="a git revision whose kernel source is the other build")
    parser.add_argument("--against-source", help="a kernel source file (common.h beside it) for the other build")
    parser.add_argument("--rows", default="1,2,3,4,5,6,8", help="row counts, comma-separated")
    parser.add_argument("--pairs", type=int, default=11, help="timed pairs per row count")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, rows 1 and 3, 3 pairs, one thread")
    args = parser.parse_args()
    if kernels.compiled() is None:
        sys.exit("kernel_ab.py: speclm's compiled kernels do not run here")
    shapes, row_counts, pairs = SHAPES, [int(r) for r in args.rows.split(",")], args.pairs
    if args.smoke:
        torch.set_num_threads(1)
        shapes, row_counts, pairs = SMOKE_SHAPES, [1, 3], 3
    built = kernels.compiled()
    with tempfile.TemporaryDirectory() as tmp:
        other = other_build(args.against, args.against_source, Path(tmp))
        check_same_bits(built, other)
        what = args.against or args.against_source or "the build's own source"
        torch.manual_seed(0)
        weights = [torch.randint(-127, 128, s, dtype=torch.int8) for s in shapes]
        layouts = [vnni_layout(w) for w in weights]
        scales = [torch.ones(w.shape[0]) for w in weights]
        print(f"threads={torch.get_num_threads()} torch={torch.__version__} kernel={kernels.describe()} "
              f"int8 weights={sum(w.numel() for w in weights) / 1e9:.2f} GB; other build: {what}; "
              f"outputs bit-identical")
        print(f"| rows | other ms (median) | this build ms (median) | this / other (median of {pairs} paired ratios) |")
        print("|---|---|---|---|")
        for rows in row_counts:
            xs = {k: torch.randn(rows, k) for k in {s[1] for s in shapes}}

            def step(module) -> float:
                t = time.perf_counter()
                for w, (packed, colsum), scale in zip(weights, layouts, scales):
                    module.linear_rows(xs[w.shape[1]], packed, colsum, scale, None)
                return time.perf_counter() - t

            step(other), step(built)  # warm-up
            theirs, ours, ratios = [], [], []
            for i in range(pairs):  # alternating order: neither build always runs first
                if i % 2:
                    b = step(built)
                    a = step(other)
                else:
                    a = step(other)
                    b = step(built)
                theirs.append(a)
                ours.append(b)
                ratios.append(b / a)
            print(f"| {rows} | {statistics.median(theirs) * 1e3:.1f} | {statistics.median(ours) * 1e3:.1f} | "
                  f"{statistics.median(ratios):.2f} |", flush=True)


if __name__ == "__main__":
    main()
