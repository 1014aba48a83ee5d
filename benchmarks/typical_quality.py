"""What Medusa's typical acceptance (lossy) costs and buys, against lossless sampling at the same
temperature: the target's mean log-likelihood per generated token under its own processed
distribution at that temperature (what lossless sampling follows exactly), and tokens/s.

Each prompt is sampled with `acceptance=exact` and `acceptance=typical` in turns, with the same
seeds, for each method given; the log-likelihood is read from one target forward over prompt +
output. Identical-output rate is not the measure here: sampled outputs differ run to run.

Run: .venv/bin/python benchmarks/typical_quality.py --target qwen2.5-coder-1.5b --per-category 2 \
         --temperature 0.7 > typical-quality.txt
`--smoke --target FOLDER --heads FILE`: the same code path on a tiny model, 2 prompts of 8 tokens,
one torch thread.
"""
from __future__ import annotations

import argparse
import time

import torch

from speclm.bench.dataset import load_prompts
from speclm.bench.machine import cpu_name
from speclm.engine import SpecEngine
from speclm.forward.cache import StaticKV
from speclm.models.loading import load_model
from speclm.runtime import set_threads
from speclm.sampling import SamplingParams, processed_probs


def log_likelihood(engine: SpecEngine, prompt: list[int], output: list[int], params: SamplingParams) -> float:
    """Sum over output tokens of log p(token | before) under the target's processed distribution."""
    if not output:
        return 0.0
    kv = StaticKV(engine.target.model, 1, len(prompt) + len(output) + 1)
    logits = kv.forward([prompt + output[:-1]], len(output))  # (1, n, V): the distribution of each output token
    probs = processed_probs(logits[0], params)
    picked = probs[torch.arange(len(output)), torch.tensor(output)]
    return float(picked.clamp_min(1e-30).log().sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--methods", default="medusa,eagle")
    ap.add_argument("--heads", default=None, help="a heads file (default: the shipped ones)")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--seeds", type=int, default=2, help="samples per prompt and acceptance")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    set_threads(1 if args.smoke else None)
    quantize = "none" if args.smoke else "int8"
    engine = SpecEngine(load_model(args.target, quantize=quantize, progress=False))
    prompts = load_prompts("spec-bench", None, 1 if args.smoke else args.per_category)
    prompts = prompts[:2] if args.smoke else prompts
    new = 8 if args.smoke else args.max_new_tokens
    params = SamplingParams(temperature=args.temperature)
    methods = args.methods.split(",")
    encoded = engine.encode([p.text for p in prompts], chat=True)
    for method in methods:  # warm-up: loads the heads
        engine.generate(encoded[0][:16], method=method, heads=args.heads, max_new_tokens=4, temperature=args.temperature)
    totals = {(m, a): [0.0, 0, 0.0] for m in methods for a in ("exact", "typical")}  # log-likelihood, tokens, seconds
    for ids in encoded:
        for seed in range(args.seeds):
            for method in methods:
                for acceptance in ("exact", "typical"):
                    engine.prefix.clear()
                    start = time.perf_counter()
                    out = engine.generate(ids, method=method, heads=args.heads, acceptance=acceptance,
                                          max_new_tokens=new, temperature=args.temperature, seed=seed)
                    seconds = time.perf_counter() - start
                    cell = totals[(method, acceptance)]
                    cell[0] += log_likelihood(engine, ids, out.token_ids, params)
                    cell[1] += len(out.token_ids)
                    cell[2] += seconds
    print(f"# typical acceptance against exact sampling: {args.target} ({quantize}), temperature {args.temperature}, "
          f"{len(prompts)} Spec-Bench prompts x {args.seeds} seeds, {new} new tokens, chat; {cpu_name()}")
    print()
    print("| method | acceptance | tokens | target log-likelihood per token | tokens/s | speed vs exact |")
    print("|---|---|---|---|---|---|")
    for method in methods:
        exact_rate = totals[(method, "exact")][1] / max(totals[(method, "exact")][2], 1e-9)
        for acceptance in ("exact", "typical"):
            ll, tokens, seconds = totals[(method, acceptance)]
            rate = tokens / max(seconds, 1e-9)
            print(f"| {method} | {acceptance} | {tokens} | {ll / max(tokens, 1):.4f} | {rate:.2f} | "
                  f"{rate / exact_rate:.2f} |")


if __name__ == "__main__":
    main()
