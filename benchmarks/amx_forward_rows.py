"""Where a verification's few rows should go on a CPU with AMX: the int8 target's whole forward over
k new tokens after a cached prompt (what the cost model's v(k) measures: a chain's k drafts and
its root, a tree's nodes), with the int8 GEMMs on AMX tiles from speclm.defaults.AMX_MIN_ROWS rows
(the default) against the VNNI loop at every row count (`set_amx(0)`, what SPECLM_AMX=0 runs).
The two are timed in pairs, back to back in alternating order, and the median of the pairs'
ratios reported beside each one's median time and its v(k) (time over its own 1-token forward).
Each k's logits are checked bit for bit between the two first: the tiles' integer sums are the
VNNI loop's.

Run: .venv/bin/python benchmarks/amx_forward_rows.py > benchmarks/amx/forward-rows.txt
Committed output: benchmarks/amx/forward-rows.txt (Intel Xeon with AMX).
`--smoke --target FOLDER`: a tiny int8 model, a 20-token prompt, k 1-3, 2 pairs, one torch thread.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from speclm.defaults import AMX_MIN_ROWS
from speclm.forward.cache import StaticKV
from speclm.models.loading import load_model
from speclm.quant import kernels
from speclm.runtime import keep_freed_memory, set_threads, usable_cores

KS = (1, 2, 3, 4, 5, 6, 8, 12, 16)
SMOKE_KS = (1, 2, 3)
ARMS = ("AMX from AMX_MIN_ROWS", "VNNI loop only")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", help="catalog name or model folder (loaded int8)")
    parser.add_argument("--context", type=int, default=400, help="cached prompt tokens before the timed forwards")
    parser.add_argument("--pairs", type=int, default=15, help="timed pairs per k")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, 2 pairs, 1 thread")
    return parser.parse_args()


def main():
    args = parse_args()
    if kernels.compiled() is None:
        raise SystemExit("speclm's compiled kernels do not run here")
    set_threads(1 if args.smoke else usable_cores())
    keep_freed_memory()  # as the engine runs
    ks, context, pairs = (SMOKE_KS, 20, 2) if args.smoke else (KS, args.context, args.pairs)
    compiled = kernels.compiled()
    amx = kernels.amx()
    print(f"threads={torch.get_num_threads()} torch={torch.__version__} kernel={kernels.describe()} "
          f"AMX_MIN_ROWS={AMX_MIN_ROWS} context={context}")
    if not amx:
        print("no AMX on this CPU (or SPECLM_AMX=0): nothing to compare")
        return
    model = load_model(args.target, quantize="int8", progress=False).model
    vocab = model.config.vocab_size
    prompt = [(1000 + 7919 * i) % vocab for i in range(context)]

    def arm(name: str) -> None:
        kernels.amx() if name == ARMS[0] else compiled.set_amx(0)

    caches = {}
    for k in ks:
        kv = StaticKV(model, 1, context + k + 1)
        kv.forward([prompt], 1)
        caches[k] = (kv, kv.lengths_list()[0], prompt[-k:])

    def forward(k: int) -> tuple[float, torch.Tensor]:
        kv, base, tokens = caches[k]
        start = time.perf_counter()
        logits = kv.forward([tokens], k)
        seconds = time.perf_counter() - start
        kv.truncate([base])
        return seconds, logits

    same = {}
    for k in ks:  # also each shape's first call, which warms its allocations
        outs = []
        for name in ARMS:
            arm(name)
            outs.append(forward(k)[1])
        same[k] = torch.equal(*outs)
    times = {(k, name): [] for k in ks for name in ARMS}
    ratios = {k: [] for k in ks}
    for i in range(pairs):  # every k in each round: a slow spell slows every shape alike
        for k in ks:
            seconds = {}
            for name in (ARMS if i % 2 == 0 else ARMS[::-1]):
                arm(name)
                seconds[name] = forward(k)[0]
                times[(k, name)].append(seconds[name])
            ratios[k].append(seconds[ARMS[0]] / seconds[ARMS[1]])
    kernels.amx()
    one = {name: statistics.median(times[(ks[0], name)]) for name in ARMS}
    print(f"| new tokens k | {ARMS[0]} ms | its v(k) | {ARMS[1]} ms | its v(k) | AMX / VNNI, median of {pairs} paired "
          "ratios | same logits |")
    print("|---|---|---|---|---|---|---|")
    for k in ks:
        cells = []
        for name in ARMS:
            ms = statistics.median(times[(k, name)])
            cells += [f"{ms * 1e3:.1f}", f"{ms / one[name]:.2f}"]
        print(f"| {k} | {' | '.join(cells)} | {statistics.median(ratios[k]):.2f} | {'yes' if same[k] else 'NO'} |",
              flush=True)


if __name__ == "__main__":
    main()
