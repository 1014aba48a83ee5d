"""Where a long prompt's prefill goes: the int8 qwen2.5-coder-1.5b target and the int4 0.5B
draft over the longest prompt of the reference run (Spec-Bench summarization, 969 tokens with
the chat template). Wall time (median of 3), then one prefill under torch's profiler: the time
in oneDNN's int8 GEMM (the target's prefill GEMMs), in causal SDPA, and the rest; and the GEMMs'
rate in int8 operations per second (2 x non-embedding linear weights x tokens). speclm's own
compiled kernels (the int4 GEMM, norms) are not aten ops: the profiler counts them in the rest.

Run: .venv/bin/python benchmarks/prefill_profile.py > benchmarks/epyc/prefill-profile.txt
"""
from __future__ import annotations

import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import speclm
from speclm.bench.dataset import load_prompts
from speclm.kv import StaticKV
from speclm.quant import QuantLinear


def prefill_seconds(model, ids: list[int]) -> float:
    kv = StaticKV(model, 1, len(ids) + 1)
    start = time.perf_counter()
    kv.forward([ids], 1)
    return time.perf_counter() - start


def linear_weights(model) -> int:
    """Weights the prefill multiplies every token by: every quantized linear but the output head
    (the prefill keeps one row's logits)."""
    head = model.get_output_embeddings()
    layers = {id(m.fused.kernel): m.fused.kernel for m in model.modules() if hasattr(m, "fused")}
    layers.update({id(m): m for m in model.modules() if isinstance(m, QuantLinear) and m is not head})
    return sum(m.in_features * m.out_features for m in layers.values())


def main() -> None:
    speclm.set_threads()
    target = speclm.load_model("qwen2.5-coder-1.5b", quantize="int8")
    draft = speclm.load_model("qwen2.5-coder-0.5b", quantize="int4")
    engine = speclm.SpecEngine(target, draft=draft)
    prompts = load_prompts("spec-bench", None, 3)
    ids = max(engine.encode([p.text for p in prompts], True), key=len)
    print(f"prompt: {len(ids)} tokens; torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name, model in (("target int8", target.model), ("draft int4", draft.model)):
        prefill_seconds(model, ids)  # warm-up
        wall = statistics.median(prefill_seconds(model, ids) for _ in range(3))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            prefill_seconds(model, ids)
        events = {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()}
        gemm = events.get("onednn::qlinear_pointwise", 0.0)
        sdpa = sum(t for k, t in events.items() if "scaled_dot_product" in k)
        ops = 2 * linear_weights(model) * len(ids)
        line = f"{name}: prefill {wall:.2f} s (median of 3); profiled: causal SDPA {sdpa:.2f} s"
        if gemm:
            line += f", oneDNN int8 GEMMs {gemm:.2f} s = {ops / gemm / 1e9:.0f} G int8 ops/s"
        print(line + f"; {ops / 1e9:.0f} G int8 ops of linear layers in all")


if __name__ == "__main__":
    main()
