"""The cost of one decode step's GEMMs by number of rows on each CPU weight mode of a GGUF target:
`gguf` (the file's own blocks, speclm.quant.gguf's linear_rows_kq), `int8` and `int4`
(speclm.quant.weights), each model's own layers as loaded (q/k/v and gate/up fused where they
are, output head included), activation quantization and rescale included. What verification
costs against a one-token step is the ratio of the rows' time to one row's. Modes interleaved
per row count, best of `--rounds` medians of 5.

Run: .venv/bin/python benchmarks/gguf_rows.py [--target NAME] > gguf-rows.txt
Committed output: benchmarks/epyc/records.md#gguf-rows.
`--smoke --target FILE.gguf`: the same code path on a tiny GGUF, rows 1 and 4, 1 repeat.
"""
from __future__ import annotations

import argparse

import torch

from speclm.models.loading import load_model
from speclm.quant import gguf
from speclm.quant.weights import Int8Slice, QuantLinear

from timing import median_ms  # benchmarks/timing.py

ROWS = (1, 2, 3, 4, 5, 6, 8, 12, 16)


def step_layers(model) -> list[QuantLinear]:
    """Every quantized GEMM of one forward once (a fused layer once, not per slice)."""
    seen, out = set(), []
    for module in model.modules():
        kernel = module.fused.kernel if isinstance(module, Int8Slice) else module
        if isinstance(kernel, QuantLinear) and id(kernel) not in seen:
            seen.add(id(kernel))
            out.append(kernel)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", help="catalog name or .gguf file")
    parser.add_argument("--modes", default="gguf,int8,int4")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds per row count (best of them)")
    parser.add_argument("--rows", help=f"comma list of row counts (default {','.join(map(str, ROWS))})")
    parser.add_argument("--smoke", action="store_true", help="rows 1 and 4, 1 repeat")
    args = parser.parse_args()
    rows, repeats = ((1, 4), 1) if args.smoke else (ROWS, 5)
    if args.rows:
        rows = tuple(int(r) for r in args.rows.split(","))
    modes = args.modes.split(",")
    if "gguf" in modes and not gguf.available():
        print("gguf: not measured (speclm's compiled kernels do not run here)")
        modes.remove("gguf")
    layers = {mode: step_layers(load_model(args.target, quantize=mode, progress=False).model) for mode in modes}
    for mode, ls in layers.items():
        size = sum(t.numel() * t.element_size() for layer in ls for t in layer.state().values())
        print(f"{mode}: {len(ls)} GEMMs a step, {size / 2**20:.0f} MiB of weights and scales "
              f"({', '.join(sorted({layer.extra_repr().split(', ', 2)[2] for layer in ls}))})")
    print(f"model={args.target} threads={torch.get_num_threads()} torch={torch.__version__}")
    gen = torch.Generator().manual_seed(0)
    inputs = {r: {k: torch.randn(r, k, generator=gen) for k in {layer.in_features for ls in layers.values() for layer in ls}}
              for r in rows}
    best: dict[tuple[str, int], float] = {}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for r in rows:
                for mode in modes:
                    def step(ls=layers[mode], xs=inputs[r]):
                        for layer in ls:
                            layer.rows(xs[layer.in_features])
                    ms = median_ms(step, repeats)
                    best[mode, r] = min(best.get((mode, r), float("inf")), ms)
    print("rows | " + " | ".join(f"{m} ms (x its 1 row)" for m in modes))
    for r in rows:
        print(f"{r} | " + " | ".join(f"{best[m, r]:.1f} ({best[m, r] / best[m, 1]:.2f}x)" for m in modes))


if __name__ == "__main__":
    main()
