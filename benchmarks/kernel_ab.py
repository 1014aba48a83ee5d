"""Paired A/B of one of speclm's kernels as built against another version of its source: the
int8 kernel (`linear_rows`, `--kernel int8`) over the GEMMs of one decode step of Qwen2.5-1.5B
(the default target, 1.54 GB of int8), the int4 kernel (`linear_rows_w4`, `--kernel int4`) over
those of Qwen2.5-0.5B (the default draft, 0.25 GB of int4), or the attention (`decode_attention`,
`--kernel attention`) of a prefill of `rows` tokens through the 1.5B's 28 layers (or, with
`--context C`, of `rows` queries after C cached slots: a decode step or a verification), timed in pairs,
the two builds back to back in alternating order, and the median of the pairs' ratios reported. On a VM whose memory
bandwidth drifts by tens of percent within minutes, a ratio taken within a pair is steadier than
medians taken minutes apart. The two builds' outputs are checked bit for bit first (odd shapes, 1
to 13 rows, bias and residual; for the attention, 1 to 13 queries after 0 or 37 cached slots at
head sizes 32, 96 and 128, the outputs and the cache written).

The other version is a git revision (`--against REV`: its kernel source and common.h, from `git
show`) or a source file (`--against-source FILE`, its common.h beside it); it is built with the
same flags as the running build (speclm.quant.kernels), for the instruction set this CPU runs.

Run: .venv/bin/python benchmarks/kernel_ab.py --against d30e361 > int8-kernel-ab.txt
`--smoke`: tiny shapes, rows 1 and 3, 3 pairs, one torch thread, every kernel, against the running
build's own source.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from speclm.quant import kernels
from speclm.quant.weights import INT4_GROUP, int4_groups, int4_layout, vnni_layout
from speclm.runtime import keep_freed_memory

from gemm_shapes import DRAFT_HEAD, DRAFT_LAYERS, SMOKE_STEP, TARGET_STEP  # benchmarks/gemm_shapes.py

# (out, in): tails of groups and quads; int4 inputs come in whole groups of INT4_GROUP
CHECK_SHAPES = {"int8": [(200, 100), (64, 1536), (333, 896), (1000, 37)],
                "int4": [(200, 128), (64, 1536), (333, 896), (1000, 4864)]}


@dataclass
class Gemm:
    """One weight in the layout a kernel takes, and the call that multiplies rows by it."""
    in_features: int
    call: Callable  # (module, x (rows, in), bias (out,) or None, residual (rows, out) or None) -> (rows, out)


def gemm(kind: str, weight: torch.Tensor) -> Gemm:
    """`weight` (out, in) int8 in the int8 kernel's layout, or as groups of int4 in the int4 one's."""
    out_f, in_f = weight.shape
    if kind == "int8":
        packed, colsum = vnni_layout(weight.clamp(-127, 127).to(torch.int8))
        scale = torch.rand(out_f)
        return Gemm(in_f, lambda m, x, *extra: m.linear_rows(x, packed, colsum, scale, *extra))
    packed, scales = int4_layout(*int4_groups(weight.float(), INT4_GROUP))
    return Gemm(in_f, lambda m, x, *extra: m.linear_rows_w4(x, packed, scales, out_f, *extra))


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
                              extra_ldflags=kernels.LDFLAGS, build_directory=str(folder), verbose=False)


@dataclass
class AttentionShape:
    """A model's attention as decode_attention takes it."""
    layers: int
    heads: int
    kv_heads: int
    dim: int


TARGET_ATTENTION = AttentionShape(28, 12, 2, 128)  # Qwen2.5-1.5B
SMOKE_ATTENTION = AttentionShape(2, 4, 2, 32)
CHECK_ATTENTION = [AttentionShape(1, 4, 2, 32), AttentionShape(1, 4, 2, 96), AttentionShape(1, 2, 1, 128)]


def attention_call(shape: AttentionShape, rows: int, start: int = 0, fresh: bool = True):
    """(module -> (out, keys, values)): a chain of `rows` queries after `start` cached slots (random
    keys and values), each layer on the same queries and its own cache (as a model's: 28 layers'
    caches at 2000 slots outgrow the L3 cache, where one cache read 28 times would not). fresh: each
    call on a copy of the caches (for comparing them); else in place (a call writes the same keys
    and values each time)."""
    width = (shape.heads + 2 * shape.kv_heads) * shape.dim
    qkv = torch.randn(rows, width)
    cap = start + rows
    angles = torch.arange(cap).float()[:, None] * torch.rand(shape.dim)[None, :]
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
    caches = [(torch.randn(1, shape.kv_heads, cap, shape.dim), torch.randn(1, shape.kv_heads, cap, shape.dim))
              for _ in range(shape.layers)]

    def call(module):
        out = k = v = None
        for keys, values in caches:
            k, v = (keys.clone(), values.clone()) if fresh else (keys, values)
            out = module.decode_attention(qkv, cos, sin, k, v, [start], [rows], shape.heads, shape.kv_heads,
                                          shape.dim ** -0.5)
        return out, k, v
    return call


def check_same_bits(kind: str, a, b) -> None:
    torch.manual_seed(1)
    if kind == "attention":
        for shape, start, rows in itertools.product(CHECK_ATTENTION, (0, 37), range(1, 14)):
            call = attention_call(shape, rows, start)
            if not all(torch.equal(x, y) for x, y in zip(call(a), call(b))):
                sys.exit(f"kernel_ab.py: the builds' attention differs at {rows} queries after {start} slots, "
                         f"head size {shape.dim}")
        return
    for n, k in CHECK_SHAPES[kind]:
        g = gemm(kind, torch.randint(-127, 128, (n, k)))
        bias = torch.randn(n)
        for rows in range(1, 14):
            x, residual = torch.randn(rows, k) * 3, torch.randn(rows, n)
            for extra in ((None, None), (bias, None), (bias, residual)):
                if not torch.equal(g.call(a, x, *extra), g.call(b, x, *extra)):
                    sys.exit(f"kernel_ab.py: the builds differ at {rows} rows of a {n} x {k} {kind} weight")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", help="a git revision whose kernel source is the other build")
    parser.add_argument("--against-source", help="a kernel source file (common.h beside it) for the other build")
    parser.add_argument("--kernel", choices=["int8", "int4", "attention"], default="int8",
                        help="int8: the target's kernel over a 1.5B step; int4: the draft's over a 0.5B step; "
                             "attention: a prefill's attention through the 1.5B's layers")
    parser.add_argument("--rows", default="1,2,3,4,5,6,8", help="row counts, comma-separated")
    parser.add_argument("--context", type=int, default=0,
                        help="attention: cached slots before the rows (0: a prefill; else a decode step or a "
                             "verification of `rows` tokens after them)")
    parser.add_argument("--pairs", type=int, default=11, help="timed pairs per row count")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, rows 1 and 3, 3 pairs, one thread, both kernels")
    args = parser.parse_args()
    if kernels.compiled() is None:
        sys.exit("kernel_ab.py: speclm's compiled kernels do not run here")
    keep_freed_memory()  # as the engine runs: many rows' outputs would otherwise be fresh pages every call
    row_counts, pairs = [int(r) for r in args.rows.split(",")], args.pairs
    kinds = [args.kernel]
    if args.smoke:
        torch.set_num_threads(1)
        row_counts, pairs, kinds = [1, 3], 3, ["int8", "int4", "attention"]
    built = kernels.compiled()
    with tempfile.TemporaryDirectory() as tmp:
        other = other_build(args.against, args.against_source, Path(tmp))
        what = args.against or args.against_source or "the build's own source"
        for kind in kinds:
            check_same_bits(kind, built, other)
            if kind == "attention":
                compare_attention(SMOKE_ATTENTION if args.smoke else TARGET_ATTENTION, row_counts, pairs, built, other,
                                  what, args.context)
                continue
            shapes = SMOKE_STEP if args.smoke else TARGET_STEP if kind == "int8" else DRAFT_LAYERS + DRAFT_HEAD
            compare(kind, shapes, row_counts, pairs, built, other, what)


def paired(step, built, other, pairs: int) -> tuple[float, float, float]:
    """Medians of the other build's times, this build's, and of this / other within each pair."""
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
    return statistics.median(theirs), statistics.median(ours), statistics.median(ratios)


def compare_attention(shape: AttentionShape, row_counts, pairs: int, built, other, what: str, context: int = 0) -> None:
    torch.manual_seed(0)
    after = f"queries after {context} cached slots" if context else "a prefill"
    print(f"threads={torch.get_num_threads()} torch={torch.__version__} kernel={kernels.describe()} attention of "
          f"{after}, {shape.layers} layers x {shape.heads} heads ({shape.kv_heads} kv) x {shape.dim}; other build: "
          f"{what}; outputs bit-identical")
    print(f"| {'queries' if context else 'prompt tokens'} | other ms (median) | this build ms (median) | this / other "
          f"(median of {pairs} paired ratios) |")
    print("|---|---|---|---|")
    for rows in row_counts:
        call = attention_call(shape, rows, context, fresh=False)

        def step(module) -> float:
            t = time.perf_counter()
            call(module)
            return time.perf_counter() - t

        a, b, ratio = paired(step, built, other, pairs)
        print(f"| {rows} | {a * 1e3:.1f} | {b * 1e3:.1f} | {ratio:.2f} |", flush=True)


def compare(kind: str, shapes, row_counts, pairs: int, built, other, what: str) -> None:
    torch.manual_seed(0)
    gemms = [gemm(kind, torch.randint(-127, 128, s)) for s in shapes]
    size = sum(o * i for o, i in shapes) * (1 if kind == "int8" else 0.5)
    print(f"threads={torch.get_num_threads()} torch={torch.__version__} kernel={kernels.describe()} "
          f"{kind} weights={size / 1e9:.2f} GB; other build: {what}; outputs bit-identical")
    print(f"| rows | other ms (median) | this build ms (median) | this / other (median of {pairs} paired ratios) |")
    print("|---|---|---|---|")
    for rows in row_counts:
        xs = {k: torch.randn(rows, k) for k in {s[1] for s in shapes}}

        def step(module) -> float:
            t = time.perf_counter()
            for g in gemms:
                g.call(module, xs[g.in_features], None, None)
            return time.perf_counter() - t

        a, b, ratio = paired(step, built, other, pairs)
        print(f"| {rows} | {a * 1e3:.1f} | {b * 1e3:.1f} | {ratio:.2f} |", flush=True)


if __name__ == "__main__":
    main()
