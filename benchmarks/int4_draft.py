"""Justifies int4 weights for the draft model (speclm.quant.weights.Int4Linear, groups of
speclm.quant.weights.INT4_GROUP inputs: what `--draft-quantize int4` runs): int8 against int4 weights
for the draft. The GEMMs of one 0.5B step (random weights of its shapes, one row, interleaved,
best of 3 medians of 5; beside them torch's own int4 CPU GEMM, `_weight_int4pack_mm_for_cpu`,
groups of 64, with bf16 activations: with fp32 ones it is some 40x slower still), a real
draft step (qwen2.5-coder-0.5b over a 300-token cache, median of 13), the draft's prefill of a
700-token prompt (median of 3; `draft` pays it once per request), and what the draft's
weights do to acceptance: tokens per target forward of `draft` (k = 3, no confidence stop) with the int8
qwen2.5-coder-1.5b target over 2 Spec-Bench prompts per task kind (chat, 64 new tokens),
every output checked against plain decoding. Needs speclm's compiled kernels.

Run: .venv/bin/python benchmarks/int4_draft.py > int4-draft-cpu.txt
Committed output: benchmarks/intel/records.md#int4-draft-cpu (Intel Xeon machine; one section per run).
`--smoke --target FOLDER --draft FOLDER`: the same code path on a tiny model's GEMM shapes,
a 30-token cache, a 40-token prefill and 1 qa prompt with 8 new tokens, 1 repeat each, one torch thread.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

import speclm
from speclm.quant import kernels
from speclm.bench.dataset import load_prompts
from speclm.forward.cache import StaticKV
from speclm.quant.weights import int4_groups, int4_layout, vnni_layout

from gemm_shapes import DRAFT_HEAD, DRAFT_LAYERS, SMOKE_HEAD, SMOKE_LAYERS  # benchmarks/gemm_shapes.py
from timing import median_ms  # benchmarks/timing.py


@dataclass(frozen=True)
class Sizes:
    layers: list  # GEMM shapes of one step's layers
    head: list  # and of its output head
    rounds: int  # interleaved rounds of the GEMM timings (best of them)
    reps: int  # timed calls per GEMM median
    cache: range  # token ids in the cache of a timed draft step
    step_reps: int
    prefill_tokens: int
    prefill_ids: tuple[int, int]  # the prefill's random token ids lie in [low, high)
    prefill_reps: int
    categories: list[str] | None  # Spec-Bench prompts of the acceptance check
    per_category: int
    new_tokens: int


FULL = Sizes(DRAFT_LAYERS, DRAFT_HEAD, 3, 5, range(1000, 1300), 13, 700, (100, 20000), 3, None, 2, 64)
SMOKE = Sizes(SMOKE_LAYERS, SMOKE_HEAD, 1, 1, range(10, 40), 1, 40, (10, 200), 1, ["qa"], 1, 8)


def gemms(shapes, sizes: Sizes):
    compiled = kernels.compiled()
    torch.manual_seed(0)
    int8 = [(vnni_layout(torch.randint(-127, 128, s, dtype=torch.int8)), torch.ones(s[0])) for s in shapes]
    int4 = [int4_layout(*int4_groups(torch.randn(s), 64)) for s in shapes]
    x = {k: torch.randn(1, k) for k in {s[1] for s in shapes}}

    def run8():
        for s, ((packed, colsum), scale) in zip(shapes, int8):
            compiled.linear_rows(x[s[1]], packed, colsum, scale, None)

    def run4():
        for s, (packed, scales) in zip(shapes, int4):
            compiled.linear_rows_w4(x[s[1]], packed, scales, s[0], None)

    torch_int4 = [(torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, s, dtype=torch.int32), 1),
                   torch.randn(s[1] // 64, s[0], 2, dtype=torch.bfloat16)) for s in shapes]
    xb = {k: v.to(torch.bfloat16) for k, v in x.items()}

    def run_torch():
        for s, (packed, scales_zeros) in zip(shapes, torch_int4):
            torch.ops.aten._weight_int4pack_mm_for_cpu(xb[s[1]], packed, 64, scales_zeros)

    a, b, c = [], [], []
    for _ in range(sizes.rounds):  # interleaved: this VM's memory bandwidth drifts by tens of percent
        a.append(median_ms(run8, reps=sizes.reps))
        b.append(median_ms(run4, reps=sizes.reps))
        c.append(median_ms(run_torch, reps=sizes.reps))
    return min(a), min(b), min(c)


def draft_step_ms(model, sizes: Sizes):
    kv = StaticKV(model, 1, len(sizes.cache) + 100)
    kv.forward([list(sizes.cache)], 1)
    base = kv.lengths_list()[0]

    def step():
        kv.forward([[5]], 1)
        kv.truncate([base])

    return median_ms(step, reps=sizes.step_reps)


def prefill_ms(model, sizes: Sizes):
    tokens = sizes.prefill_tokens
    prompt = torch.randint(*sizes.prefill_ids, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()

    def prefill():
        StaticKV(model, 1, tokens + 1).forward([prompt], 1)

    return median_ms(prefill, reps=sizes.prefill_reps)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", help="catalog name or model folder")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b", help="catalog name or model folder")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and prompts, 1 repeat, 1 thread")
    args = parser.parse_args()
    sizes = SMOKE if args.smoke else FULL
    speclm.set_threads(1 if args.smoke else None)
    print(f"threads={torch.get_num_threads()} torch={torch.__version__}")
    print("| GEMMs of one 0.5B step, 1 row | speclm int8 ms | speclm int4 ms | torch int4 (bf16 activations) ms |")
    print("|---|---|---|---|")
    for label, shapes in (("24 layers", sizes.layers), ("output head", sizes.head)):
        a, b, c = gemms(shapes, sizes)
        print(f"| {label} | {a:.1f} | {b:.1f} | {c:.1f} |", flush=True)
    target = speclm.load_model(args.target, quantize="int8", progress=False)
    prompts = load_prompts("spec-bench", sizes.categories, sizes.per_category)
    plain = speclm.SpecEngine(target)
    reference = {p.prompt_id: plain.generate(p.text, max_new_tokens=sizes.new_tokens, chat=True).token_ids
                 for p in prompts}
    print()
    print(f"| draft weights | draft step ms | prefill of {sizes.prefill_tokens} tokens ms "
          "| tokens per target forward (k = 3) | outputs equal to plain |")
    print("|---|---|---|---|---|")
    for mode in ("int8", "int4"):
        draft = speclm.load_model(args.draft, quantize=mode, progress=False)
        step = draft_step_ms(draft.model, sizes)
        prefill = prefill_ms(draft.model, sizes)
        engine = speclm.SpecEngine(target, draft=draft)
        forwards = tokens = same = 0
        for p in prompts:
            out = engine.generate(p.text, method="draft", k=3, confidence=0.0, max_new_tokens=sizes.new_tokens,
                                  chat=True)
            forwards += out.stats.target_forwards
            tokens += out.stats.new_tokens
            same += out.token_ids == reference[p.prompt_id]
        print(f"| {mode} | {step:.1f} | {prefill:.0f} | {tokens / forwards:.3f} | {same}/{len(prompts)} |", flush=True)


if __name__ == "__main__":
    main()
