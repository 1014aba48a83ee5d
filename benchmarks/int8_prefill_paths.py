"""Which int8 GEMM a prefill's many rows should take: speclm's compiled kernel at every row count
(the default wherever it runs: speclm.quant.weights.onednn_used) against oneDNN's past
VNNI_MAX_ROWS rows (SPECLM_ONEDNN=1). For prompts of 238, 700 and 969 tokens (256-row blocks:
PREFILL_ROW_BLOCK), the int8 target's prefill seconds on each path, the two interleaved (median of
5 rounds, and the median of each round's ratio: the machine's bandwidth drifts between rounds); the
logits of both, compared bit for bit; and what oneDNN's packed copies of the weights add to the
process's resident memory.

Run: .venv/bin/python benchmarks/int8_prefill_paths.py > int8-prefill-paths.txt
Committed output: benchmarks/amx/records.md#int8-prefill-paths (Intel Xeon with AMX), and
benchmarks/amx/records.md#int8-prefill-paths-vnni: the same machine as a VNNI CPU without AMX, run with
`SPECLM_AMX=0 ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI` (speclm's VNNI loop, oneDNN without its AMX code).
`--smoke --target FOLDER`: a tiny model, prompts of 20 and 90 tokens, 1 round, one torch thread.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from speclm.forward.cache import StaticKV
from speclm.memory import gib, resident
from speclm.models.loading import load_model
from speclm.quant import kernels
from speclm.quant.weights import Int8Linear, Int8Slice, onednn_used

from prefill_kernels import LENGTHS, SMOKE_LENGTHS  # benchmarks/prefill_kernels.py: the same prompt lengths
from timing import kernel_run  # benchmarks/timing.py

PATHS = ("speclm kernel", "onednn past VNNI_MAX_ROWS")


def int8_layers(model) -> list[Int8Linear]:
    """Every int8 layer of the model, the fused ones (q|k|v, gate|up: held by their slices) included."""
    found = {}
    for m in model.modules():
        kernel = m.fused.kernel if isinstance(m, Int8Slice) else m
        if isinstance(kernel, Int8Linear):
            found[id(kernel)] = kernel
    return list(found.values())


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", help="catalog name or model folder (int8)")
    parser.add_argument("--smoke", action="store_true", help="short prompts, 1 round, 1 thread")
    return parser.parse_args()


def main():
    args = parse_args()
    kernel_run(args.smoke)
    lengths = SMOKE_LENGTHS if args.smoke else LENGTHS
    rounds, first_id = (1, 100) if args.smoke else (5, 1000)
    model = load_model(args.target, quantize="int8", progress=False).model
    layers = int8_layers(model)
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA")
    print(f"threads={torch.get_num_threads()} torch={torch.__version__} kernel={kernels.describe()} "
          f"default path past the VNNI rows: {'onednn' if onednn_used(True) else 'speclm kernel'}"
          + (f" ONEDNN_MAX_CPU_ISA={isa}" if isa else ""))
    if not onednn_used(compiled=False):  # without speclm's kernel oneDNN runs wherever it is exact
        print("oneDNN's int8 GEMM does not sum exactly on this CPU: speclm's kernel runs every row count, "
              "nothing to compare")
        return
    before = resident()
    for layer in layers:
        layer.with_onednn()  # as SPECLM_ONEDNN=1 loads it
    after = resident()
    if before and after:
        print(f"oneDNN's packed copies of {len(layers)} int8 layers: resident memory {gib(before.total)} -> "
              f"{gib(after.total)} (+{(after.total - before.total) / 2**20:.0f} MiB)")
    StaticKV(model, 1, 1100).forward([list(range(100, 164))], 1)  # warm-up
    print("| prompt tokens | " + " | ".join(f"{p} s" for p in PATHS) + " | speclm / onednn, median of the rounds' ratios | same logits |")
    print("|---|---|---|---|---|")
    for n in lengths:
        seconds = {p: [] for p in PATHS}
        logits = {}
        for r in range(rounds):
            for path in PATHS if r % 2 == 0 else reversed(PATHS):  # interleaved: bandwidth drifts
                for layer in layers:
                    layer.onednn = path != PATHS[0]
                kv = StaticKV(model, 1, 1100)
                start = time.perf_counter()
                logits[path] = kv.forward([list(range(first_id, first_id + n))], 1)
                seconds[path].append(time.perf_counter() - start)
        s = [statistics.median(seconds[p]) for p in PATHS]
        ratio = statistics.median(a / b for a, b in zip(*seconds.values()))
        same = torch.equal(*logits.values())
        print(f"| {n} | {s[0]:.3f} | {s[1]:.3f} | {ratio:.2f} | {'yes' if same else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
