"""Justifies the int8 kernel on whole models (speclm.quant.weights.Int8Linear, W8A8 per-row, against
int8 weight-only with bf16 activations): the CPU int8 paths on a real target, all through
transformers' forward and DynamicCache (the kernels compare on equal terms; speclm's own forward
is leaner): cost of a forward over k new tokens (v(k)), and agreement of the next-token argmax
with fp32 (teacher-forced on Spec-Bench prompts). A
single layer fits in the L3 cache and flatters the kernels, so the choice is made on whole-model
numbers.

Run: .venv/bin/python benchmarks/int8_model.py [--target NAME_OR_FOLDER] [--modes fp32,w8a8,int8pack] \
         > int8-model-cpu.txt
Committed output: benchmarks/intel/records.md#int8-model-cpu (Intel Xeon machine).
`--smoke --target FOLDER`: the same code path on a tiny model, 2 short prompts, 1 timed
forward per k, one torch thread.
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from torch import nn

from speclm.bench.dataset import load_prompts
from speclm.models.loading import load_model
from speclm.quant.weights import Int8Linear, int8_per_channel

warnings.filterwarnings("ignore")


class Int8WeightOnlyBf16(nn.Module):
    """The alternative measured here: int8 weights, bf16 activations, aten._weight_int8pack_mm."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        q, scale = int8_per_channel(linear.weight)
        self.q, self.scale, self.out_features = q, scale.to(torch.bfloat16), linear.out_features
        self.bias = None if linear.bias is None else linear.bias.detach().float()

    def forward(self, x):
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]).to(torch.bfloat16), self.q, self.scale)
        y = y.float() if self.bias is None else y.float() + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def swap(model, cls):
    for name, mod in [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, cls(mod))
    return model


@torch.inference_mode()
def step_costs(model, context_ids, ks=(1, 2, 3, 4, 5, 6, 8), reps=5, token_ids=(100, 1000)):
    from transformers import DynamicCache

    from speclm.forward.runner import cache_argument
    cache = DynamicCache(config=model.config)
    kv = {cache_argument(model): cache}
    model(input_ids=context_ids, use_cache=True, logits_to_keep=1, **kv)
    out = {}
    for k in ks:
        ts = []
        for _ in range(reps + 1):
            ids = torch.randint(*token_ids, (1, k))  # random draft tokens
            t = time.perf_counter()
            model(input_ids=ids, use_cache=True, logits_to_keep=k, **kv)
            ts.append(time.perf_counter() - t)
            cache.crop(-k)
        out[k] = statistics.median(ts[1:]) * 1e3
    return out


@torch.inference_mode()
def argmaxes(model, prompts_ids):
    return [model(input_ids=ids).logits[0].argmax(-1) for ids in prompts_ids]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", help="catalog name or model folder")
    parser.add_argument("--modes", help="comma list of fp32, w8a8, int8pack (default: all; fp32 always runs)")
    parser.add_argument("--smoke", action="store_true", help="2 short prompts, 1 timed forward per k, 1 thread")
    args = parser.parse_args()
    name = args.target
    only = args.modes.split(",") if args.modes else None  # e.g. fp32,w8a8
    categories, reps, token_ids = (["qa", "translation"], 1, (10, 200)) if args.smoke else (None, 5, (100, 1000))
    torch.set_num_threads(1 if args.smoke else torch.get_num_threads())
    prompts = [p.text for p in load_prompts("spec-bench", categories, 1)]
    print(f"model={name} threads={torch.get_num_threads()} torch={torch.__version__} prompts={len(prompts)}")
    ref = None
    modes = {"fp32": "fp32", "w8a8": "int8 W8A8 per-row (speclm.quant.weights.Int8Linear, oneDNN)",
             "int8pack": "int8 weight-only, bf16 act. (_weight_int8pack_mm)"}
    for key, mode in modes.items():
        if only and key not in only and key != "fp32":
            continue
        t0 = time.perf_counter()
        loaded = load_model(name, progress=False)
        model, tok = loaded.model, loaded.tokenizer
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        if mode.startswith("int8 W8A8"):
            swap(model, Int8Linear)
        elif mode.startswith("int8 weight-only"):
            swap(model, Int8WeightOnlyBf16)
        quant_s = time.perf_counter() - t0
        ids = [tok(p, return_tensors="pt").input_ids for p in prompts]
        tops = argmaxes(model, ids)
        if ref is None:
            ref = tops
        agree = sum(int((a == b).sum()) for a, b in zip(tops, ref)) / sum(len(a) for a in ref)
        costs = step_costs(model, ids[0], reps=reps, token_ids=token_ids)
        v = " ".join(f"v({k})={ms / costs[1]:.2f}" for k, ms in costs.items())
        print(f"{mode}: load {load_s:.1f} s, quantize {quant_s:.1f} s; 1-token step {costs[1]:.0f} ms; {v}; "
              f"argmax agreement with fp32 {agree:.2%} over {sum(len(a) for a in ref)} positions", flush=True)
        del model, loaded


if __name__ == "__main__":
    main()
