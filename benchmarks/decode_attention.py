"""Justifies the compiled decode attention and its slot block (speclm.defaults.ATTENTION_SLOT_BLOCK):
decode attention cost by context length, speclm's compiled `decode_attention` (rotary, cache
write and attention of one decode forward, speclm/quant/csrc/cpu_kernels.cpp) against torch's ops
on the same cache (speclm.forward.attention.attend_each_query, what runs without the compiled
kernels), at the attention shapes of Qwen2.5-1.5B (12 heads, 2 kv heads, head size 128,
28 layers) and Qwen2.5-0.5B (14, 2, 64, 24 layers), for 1 query row (a plain step) and 5
(a verification of 4 drafted tokens). Times are per layer (median of 20) and per step (times
the layers). `--source FILE` builds that version of the kernel file instead (for instance
another revision's: `git show REV:speclm/quant/csrc/cpu_kernels.cpp > /tmp/k.cpp`); its output is
checked bit for bit against the installed kernel's. Needs speclm's compiled kernels.

Run: .venv/bin/python benchmarks/decode_attention.py [--source FILE] >> decode-attention-cpu.txt
Committed output: benchmarks/intel/records.md#decode-attention-cpu (Intel Xeon machine; one table per kernel version).
`--smoke`: the same code path at one tiny shape (2 heads, 1 kv head, head size 32), contexts 10
and 40, 1 repeat, one torch thread.
"""
from __future__ import annotations

import argparse

import torch

from speclm.quant import kernels
from speclm.forward.attention import attend_each_query

from timing import median_ms  # benchmarks/timing.py

SHAPES = {"qwen2.5-1.5b": (12, 2, 128, 28), "qwen2.5-0.5b": (14, 2, 64, 24)}  # heads, kv heads, D, layers
CONTEXTS = (100, 500, 1000, 2000, 4000)
SMOKE_SHAPES = {"tiny": (2, 1, 32, 2)}  # head size 32: the smallest the kernel takes
SMOKE_CONTEXTS = (10, 40)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", help="another cpu_kernels.cpp to build and time instead")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and contexts, 1 repeat, 1 thread")
    args = parser.parse_args()
    shapes, contexts = (SMOKE_SHAPES, SMOKE_CONTEXTS) if args.smoke else (SHAPES, CONTEXTS)
    reps, torch_reps = (1, 1) if args.smoke else (20, 5)
    if args.smoke:
        torch.set_num_threads(1)
    installed = kernels.compiled()
    if installed is None:
        raise SystemExit("the compiled kernels do not run here")
    module = installed
    if args.source:
        from torch.utils import cpp_extension

        module = cpp_extension.load(name="speclm_cpu_kernels_other", sources=[args.source], extra_cflags=kernels.FLAGS,
                                    extra_ldflags=kernels.LDFLAGS, verbose=False)
    torch.manual_seed(0)
    print(f"threads={torch.get_num_threads()} torch={torch.__version__} kernel source={args.source or kernels.SOURCE.name}")
    print("| model | context | rows | compiled us/layer | compiled ms/step | torch ops ms/step |")
    print("|---|---|---|---|---|---|")
    for name, (heads, kv_heads, dim, layers) in shapes.items():
        for context in contexts:
            for rows in (1, 5):
                cap = context + rows
                keys, values = torch.randn(1, kv_heads, cap, dim), torch.randn(1, kv_heads, cap, dim)
                cos, sin = torch.randn(cap, dim), torch.randn(cap, dim)
                qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim)

                def run(mod):
                    return mod.decode_attention(qkv, cos, sin, keys, values, [context], [rows], heads, kv_heads, dim**-0.5)

                if module is not installed and not torch.equal(run(module), run(installed)):
                    raise SystemExit("the other kernel's output differs from the installed one's")
                us = median_ms(lambda: run(module), reps=reps) * 1e3
                q = torch.randn(1, rows, heads, dim)
                torch_us = median_ms(lambda: attend_each_query(q, keys, values, [context], [rows], dim**-0.5),
                                     reps=torch_reps) * 1e3
                print(f"| {name} | {context} | {rows} | {us:.0f} | {us * layers / 1e3:.1f} | {torch_us * layers / 1e3:.1f} |",
                      flush=True)


if __name__ == "__main__":
    main()
