"""Justifies speclm's int8 kernel (speclm.quant.weights.Int8Linear: W8A8 with per-row activation scales,
batch-invariant, which speculative exactness needs): the CPU int8 linear-layer options measured
on one Qwen2.5-1.5B MLP layer (8960 x 1536).

For each path: median time at k = 1, 4, 8, 16 rows, whether row 0 computed alone is
bit-identical to row 0 inside a batch of 16 (batch invariance), and the relative error against
fp64. torchao's CPU int8 configurations are included when torchao is installed (speclm does not
depend on it).

Run: .venv/bin/python benchmarks/int8_kernels.py > benchmarks/intel/int8-kernels-cpu.txt
Committed output: benchmarks/intel/int8-kernels-cpu.txt (Intel Xeon machine).
`--smoke`: the same code path on a 256 x 128 layer, 1 timed call per point, one torch thread;
torchao's rows are left out where it is not installed.
"""
from __future__ import annotations

import argparse
import copy
import warnings

import torch
import torch.nn.functional as F

from timing import median_ms  # benchmarks/timing.py

warnings.filterwarnings("ignore")
torch.manual_seed(0)
OUT, IN = 8960, 1536
SMOKE_OUT, SMOKE_IN = 256, 128
ROWS = (1, 4, 8, 16)


def timed(fn, x, reps=20, warmup=3):
    return median_ms(lambda: fn(x), reps=reps, warmup=warmup)


def int8pack(weight: torch.Tensor):
    scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
    scale_bf16 = scale.to(torch.bfloat16)

    def fn(x):
        return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), q, scale_bf16).to(x.dtype)
    return fn


def int_mm_per_row(weight: torch.Tensor):
    w_scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    w_q_t = torch.round(weight / w_scale[:, None]).clamp(-127, 127).to(torch.int8).t()  # column-major: the fast layout

    def fn(x):
        x_scale = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
        x_q = torch.round(x / x_scale).clamp(-127, 127).to(torch.int8)
        return torch._int_mm(x_q, w_q_t).to(torch.float32) * x_scale * w_scale
    return fn


def torchao_path(layer: torch.nn.Linear, config, dtype):
    from torchao.quantization import quantize_
    m = torch.nn.Sequential(copy.deepcopy(layer).to(dtype))
    quantize_(m, config)

    def fn(x):
        return m(x.to(dtype)).to(torch.float32)
    return fn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a small layer, 1 timed call per point, 1 thread")
    args = parser.parse_args()
    out_f, in_f = (SMOKE_OUT, SMOKE_IN) if args.smoke else (OUT, IN)
    reps, warmup = (1, 1) if args.smoke else (20, 3)
    torch.set_num_threads(1 if args.smoke else torch.get_num_threads())
    layer = torch.nn.Linear(in_f, out_f, bias=False)
    with torch.no_grad():
        layer.weight.normal_(0, 0.02)
    w = layer.weight.detach()
    paths = {
        "fp32 F.linear": lambda x: F.linear(x, w),
        "aten._weight_int8pack_mm, bf16 activations": int8pack(w),
        "torch._int_mm, per-row int8 activations": int_mm_per_row(w),
    }
    dyn = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(copy.deepcopy(layer)), {torch.nn.Linear}, dtype=torch.qint8)
    paths["torch quantize_dynamic (fbgemm, per-tensor act.)"] = lambda x: dyn(x)
    from speclm.quant.weights import Int8Linear
    speclm_layer = Int8Linear(layer)
    paths["speclm Int8Linear: onednn.qlinear_pointwise, per-row act."] = lambda x: speclm_layer(x)
    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig
        paths["torchao Int8WeightOnly, bf16"] = torchao_path(layer, Int8WeightOnlyConfig(), torch.bfloat16)
        paths["torchao Int8WeightOnly, fp32"] = torchao_path(layer, Int8WeightOnlyConfig(), torch.float32)
        paths["torchao Int8DynActInt8Weight, fp32"] = torchao_path(layer, Int8DynamicActivationInt8WeightConfig(), torch.float32)
    except ModuleNotFoundError as exc:
        if not args.smoke or exc.name != "torchao":  # the smoke run leaves a missing torchao out quietly
            print(f"torchao: {type(exc).__name__}: {exc}")
    except Exception as exc:  # torchao's CPU path unavailable
        print(f"torchao: {type(exc).__name__}: {exc}")

    x16 = torch.randn(16, in_f)
    ref = F.linear(x16.double(), w.double()).float()
    print(f"threads={torch.get_num_threads()} torch={torch.__version__}")
    print("| path | " + " | ".join(f"k={k} ms" for k in ROWS) + " | batch-invariant | rel. error vs fp64 |")
    print("|---|" + "---|" * len(ROWS) + "---|---|")
    with torch.inference_mode():
        for name, fn in paths.items():
            try:
                times = [timed(fn, x16[:k].contiguous(), reps, warmup) for k in ROWS]
                alone = fn(x16[:1].contiguous())[0]
                inside = fn(x16)[0]
                invariant = torch.equal(alone, inside)
                err = ((fn(x16).float() - ref).norm() / ref.norm()).item()
            except Exception as exc:
                print(f"| {name} | failed: {type(exc).__name__}: {str(exc)[:80]} |")
                continue
            print(f"| {name} | " + " | ".join(f"{t:.2f}" for t in times) + f" | {'yes' if invariant else 'no'} | {err:.1e} |")


if __name__ == "__main__":
    main()
