"""Justifies speclm.forward.costs.REPEATS (speclm.defaults.COST_REPEATS): how far apart the
verification-cost tables come out that this machine would measure with R forwards per size.
Trees, EAGLE's and Medusa's node budgets and the server's adaptive draft length are all sized
from one such table, measured once per model and kernel build and then kept, so a table that
happened to catch a noisy spell steers every later request.

One long run of the table's own sampler (speclm.forward.costs.sample: every size in turns, a
pass after another, the first pass dropped) is cut into consecutive blocks of R passes; each
block gives the table R would have measured, v(n) = T(n) / T(1) from its medians. The report
gives, for each R, the lowest and highest v(n) over the blocks, and beside them the table of
all passes together.

Run: .venv/bin/python benchmarks/cost_table_noise.py > cost-table-noise.txt
`--smoke --target FOLDER`: the same code path on a tiny model, 4 sizes, 7 passes.
"""
from __future__ import annotations

import argparse
import statistics

from speclm.forward.costs import REPEATS, SIZES, sample
from speclm.models.loading import load_model

from timing import kernel_run  # benchmarks/timing.py


def table(times: dict[int, list[float]], first: int, last: int) -> dict[int, float]:
    """v(n) from passes first .. last - 1: each size's median over T(1)'s."""
    one = statistics.median(times[1][first:last])
    return {n: statistics.median(t[first:last]) / one for n, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b", help="catalog name or model folder")
    ap.add_argument("--quantize", default="int8")
    ap.add_argument("--passes", type=int, default=120, help="passes over every size after the dropped first")
    ap.add_argument("--repeats", default="5,10,20", help="forwards per size of the tables compared, comma-separated")
    ap.add_argument("--smoke", action="store_true", help="tiny model, 4 sizes, 6 passes, 1 thread")
    args = ap.parse_args()
    kernel_run(args.smoke)
    sizes = (1, 2, 4, 8) if args.smoke else SIZES
    passes = 6 if args.smoke else args.passes
    repeats = [2, 3] if args.smoke else [int(r) for r in args.repeats.split(",")]
    model = load_model(args.target, quantize=args.quantize, progress=False)
    times, share = sample(model.model, sizes, passes + 1, desc="passes")
    print(f"{args.target} {args.quantize}: {passes} passes over sizes {', '.join(map(str, sizes))} (a pass before "
          f"them dropped); the process got {share:.0%} of its threads' time; speclm's REPEATS = {REPEATS}")
    print(f"T(1): median {statistics.median(times[1][1:]) * 1e3:.1f} ms, lowest {min(times[1][1:]) * 1e3:.1f}, "
          f"highest {max(times[1][1:]) * 1e3:.1f}")
    print()
    print("| forwards per size | tables | " + " | ".join(f"v({n})" for n in sizes[1:]) + " | widest range |")
    print("|---|---|" + "---|" * len(sizes))
    pooled = table(times, 1, passes + 1)
    print(f"| all {passes} | 1 | " + " | ".join(f"{pooled[n]:.2f}" for n in sizes[1:]) + " | – |")
    for r in repeats:
        blocks = [table(times, s, s + r) for s in range(1, passes + 2 - r, r)]
        ranges = {n: (min(b[n] for b in blocks), max(b[n] for b in blocks)) for n in sizes[1:]}
        widest = max(hi - lo for lo, hi in ranges.values())
        print(f"| {r} | {len(blocks)} | " + " | ".join(f"{lo:.2f}-{hi:.2f}" for lo, hi in ranges.values())
              + f" | {widest:.2f} |")
    seconds = sum(statistics.median(t[1:]) for t in times.values())
    print()
    print(f"One pass over the sizes takes about {seconds:.2f} s here: a table of R forwards per size, about "
          f"(R + 1) x that.")


if __name__ == "__main__":
    main()
