"""Decode attention cost by context length: speclm's compiled `decode_attention` (rotary, cache
write and attention of one decode forward, speclm/csrc/cpu_kernels.cpp) against torch's ops
on the same cache (speclm.attention.attend_each_query, what runs without the compiled
kernels), at the attention shapes of Qwen2.5-1.5B (12 heads, 2 kv heads, head size 128,
28 layers) and Qwen2.5-0.5B (14, 2, 64, 24 layers), for 1 query row (a plain step) and 5
(a verification of 4 drafted tokens). Times are per layer (median of 20) and per step (times
the layers). `--source FILE` builds that version of the kernel file instead (to compare
with an earlier commit's: `git show REV:speclm/csrc/cpu_kernels.cpp > /tmp/k.cpp`); its output
is checked bit for bit against the installed kernel's.

Run: .venv/bin/python benchmarks/decode_attention.py [--source FILE] >> benchmarks/decode-attention-cpu.txt
"""
from __future__ import annotations

import argparse

import torch

from speclm import kernels
from speclm.attention import attend_each_query

from timing import median_ms  # benchmarks/timing.py

SHAPES = {"qwen2.5-1.5b": (12, 2, 128, 28), "qwen2.5-0.5b": (14, 2, 64, 24)}  # heads, kv heads, D, layers


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--source", help="another cpu_kernels.cpp to build and time instead")
    args = parser.parse_args()
    installed = kernels.compiled()
    if installed is None:
        raise SystemExit("the compiled kernels do not run here")
    module = installed
    if args.source:
        from torch.utils import cpp_extension

        module = cpp_extension.load(name="speclm_cpu_kernels_other", sources=[args.source], extra_cflags=kernels.FLAGS,
                                    extra_ldflags=["-fopenmp"], verbose=False)
    torch.manual_seed(0)
    print(f"threads={torch.get_num_threads()} torch={torch.__version__} kernel source={args.source or kernels.SOURCE.name}")
    print("| model | context | rows | compiled us/layer | compiled ms/step | torch ops ms/step |")
    print("|---|---|---|---|---|---|")
    for name, (heads, kv_heads, dim, layers) in SHAPES.items():
        for context in (100, 500, 1000, 2000, 4000):
            for rows in (1, 5):
                cap = context + rows
                keys, values = torch.randn(1, kv_heads, cap, dim), torch.randn(1, kv_heads, cap, dim)
                cos, sin = torch.randn(cap, dim), torch.randn(cap, dim)
                qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim)

                def run(mod):
                    return mod.decode_attention(qkv, cos, sin, keys, values, [context], [rows], heads, kv_heads, dim**-0.5)

                if module is not installed and not torch.equal(run(module), run(installed)):
                    raise SystemExit("the other kernel's output differs from the installed one's")
                us = median_ms(lambda: run(module), reps=20) * 1e3
                q = torch.randn(1, rows, heads, dim)
                torch_us = median_ms(lambda: attend_each_query(q, keys, values, [context], [rows], dim**-0.5), reps=5) * 1e3
                print(f"| {name} | {context} | {rows} | {us:.0f} | {us * layers / 1e3:.1f} | {torch_us * layers / 1e3:.1f} |",
                      flush=True)


if __name__ == "__main__":
    main()
