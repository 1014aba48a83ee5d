"""Where a verification's few rows should go on a CPU with AMX: the int8 target's whole forward over
k new tokens after a cached prompt (what the cost model's v(k) measures: a chain's k drafts and
its root, a tree's nodes), with the int8 GEMMs on AMX tiles from `--amx-rows` rows (default 2)
against speclm.defaults.AMX_MIN_ROWS (the default build's), timed in pairs, back to back in
alternating order; the median of the pairs' ratios is reported beside each one's median time
and its v(k) (time over its own 1-token forward). Two settings: the target's forwards one after
another (as the cost model times them), and each after `--draft-steps` one-token steps of the
int4 draft model (as in a `draft` round, where the draft's weights pass through the caches
between the target's forwards). Each k's logits are checked bit for bit between the two first:
the tiles' integer sums are the VNNI loop's.

Run: .venv/bin/python benchmarks/amx_forward_rows.py > forward-rows.txt
Committed output: benchmarks/amx/records.md#forward-rows (Intel Xeon with AMX).
`--smoke --target FOLDER --draft FOLDER`: tiny models, a 20-token prompt, k 1-3, 2 pairs, one
draft step, one torch thread.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from speclm.defaults import AMX_MIN_ROWS, AMX_MIN_ROWS_INT4
from speclm.forward.cache import StaticKV
from speclm.models.loading import load_model
from speclm.quant import kernels

from timing import kernel_run  # benchmarks/timing.py

KS = (1, 2, 3, 4, 5, 6, 8, 12, 16)
SMOKE_KS = (1, 2, 3)
ARMS = ("AMX from --amx-rows", "AMX from AMX_MIN_ROWS")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", help="catalog name or model folder (loaded int8)")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b", help="draft model (loaded int4) for --draft-steps")
    parser.add_argument("--draft-steps", type=int, default=3, help="draft steps before each target forward, second setting")
    parser.add_argument("--amx-rows", type=int, default=2, help="the other arm's int8 AMX rows (0: the VNNI loop only)")
    parser.add_argument("--context", type=int, default=400, help="cached prompt tokens before the timed forwards")
    parser.add_argument("--pairs", type=int, default=15, help="timed pairs per k")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, 2 pairs, 1 thread")
    return parser.parse_args()


def main():
    args = parse_args()
    kernel_run(args.smoke)
    ks, context, pairs = (SMOKE_KS, 20, 2) if args.smoke else (KS, args.context, args.pairs)
    steps = 1 if args.smoke else args.draft_steps
    compiled = kernels.compiled()
    amx = kernels.amx()
    print(f"threads={torch.get_num_threads()} torch={torch.__version__} kernel={kernels.describe()} "
          f"AMX_MIN_ROWS={AMX_MIN_ROWS} --amx-rows {args.amx_rows} context={context}")
    if not amx:
        print("no AMX on this CPU (or SPECLM_AMX=0): nothing to compare")
        return
    model = load_model(args.target, quantize="int8", progress=False).model
    draft = load_model(args.draft, quantize="int4", progress=False).model
    vocab = model.config.vocab_size
    prompt = [(1000 + 7919 * i) % vocab for i in range(context)]

    def arm(name: str) -> None:
        kernels.amx()  # the defaults, both kernels
        if name == ARMS[0]:
            compiled.set_amx(args.amx_rows, AMX_MIN_ROWS_INT4)

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

    draft_kv = StaticKV(draft, 1, context + 2)
    draft_kv.forward([prompt], 1)
    draft_base = draft_kv.lengths_list()[0]

    def draft_steps(n: int) -> None:
        for _ in range(n):
            draft_kv.forward([prompt[-1:]], 1)
            draft_kv.truncate([draft_base])

    same = {}
    for k in ks:  # also each shape's first call, which warms its allocations
        outs = []
        for name in ARMS:
            arm(name)
            outs.append(forward(k)[1])
        same[k] = torch.equal(*outs)
    for setting, before in (("one after another", 0), (f"each after {steps} draft steps", steps)):
        times = {(k, name): [] for k in ks for name in ARMS}
        ratios = {k: [] for k in ks}
        for i in range(pairs):  # every k in each round: a slow spell slows every shape alike
            for k in ks:
                seconds = {}
                for name in (ARMS if i % 2 == 0 else ARMS[::-1]):
                    arm(name)
                    draft_steps(before)
                    seconds[name] = forward(k)[0]
                    times[(k, name)].append(seconds[name])
                ratios[k].append(seconds[ARMS[0]] / seconds[ARMS[1]])
        kernels.amx()
        one = {name: statistics.median(times[(ks[0], name)]) for name in ARMS}
        print(f"\n## the target's forwards {setting}\n")
        print(f"| new tokens k | {ARMS[0]} ms | its v(k) | {ARMS[1]} ms | its v(k) | ratio, median of {pairs} paired "
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
