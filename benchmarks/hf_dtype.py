"""transformers' own `generate` on a model's fp32 and bf16 weights: which dtype is its best setting on
this CPU (the bench's `hf:quantize=none` peer runs fp32, the dtype transformers de-quantizes a GGUF
to). The same Spec-Bench prompts (--per-category of each kind, raw, no chat template), greedy,
--max-new-tokens each, the two dtypes interleaved per prompt; printed: tokens, seconds and tokens/s
per dtype.

Run: .venv/bin/python benchmarks/hf_dtype.py --target gemma3-270m > hf-dtype.txt
Committed output: benchmarks/amx/records.md#gemma3-270m (Intel Xeon with AMX).
`--smoke --target FOLDER`: one prompt, 8 new tokens, one torch thread (tests/test_benchmark_scripts.py).
"""
from __future__ import annotations

import argparse
import copy
import time


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="gemma3-270m", help="catalog name or model folder")
    parser.add_argument("--per-category", type=int, default=1, help="prompts of each Spec-Bench kind (default 1)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--smoke", action="store_true", help="1 prompt, 8 new tokens, 1 thread")
    return parser.parse_args()


def main() -> None:
    args = arguments()
    import torch

    import speclm
    from speclm.bench.dataset import load_prompts

    if args.smoke:
        torch.set_num_threads(1)
    prompts = load_prompts("spec-bench", None, args.per_category)[: 1 if args.smoke else None]
    new_tokens = 8 if args.smoke else args.max_new_tokens
    loaded = speclm.load_model(args.target, quantize="none", progress=False)
    models = {"fp32": loaded.model, "bf16": copy.deepcopy(loaded.model).to(torch.bfloat16)}
    eos = list(loaded.eos_token_ids)
    totals = {name: [0, 0.0] for name in models}
    with torch.inference_mode():
        for model in models.values():  # warm-up
            model.generate(loaded.tokenizer("warm up", return_tensors="pt").input_ids, max_new_tokens=4, do_sample=False)
        for prompt in prompts:
            ids = loaded.tokenizer(prompt.text, return_tensors="pt").input_ids
            for name, model in models.items():
                start = time.perf_counter()
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                                     eos_token_id=eos, pad_token_id=eos[0] if eos else None)
                totals[name][1] += time.perf_counter() - start
                totals[name][0] += out.shape[1] - ids.shape[1]
    print(f"transformers' generate, {args.target}, {len(prompts)} prompts, {new_tokens} new tokens, "
          f"{torch.get_num_threads()} threads\n")
    print("| dtype | tokens | seconds | tokens/s |")
    print("|---|---|---|---|")
    for name, (tokens, seconds) in totals.items():
        print(f"| {name} | {tokens} | {seconds:.2f} | {tokens / seconds:.2f} |")


if __name__ == "__main__":
    main()
