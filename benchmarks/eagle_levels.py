"""EAGLE's level rule tuned: drafting grows a level only while its likeliest candidate's cumulative
probability reaches MIN_PROB (speclm.proposers.eagle). Each value runs the same Spec-Bench
prompts (greedy, chat template, 128 new tokens) beside plain decoding, prompt by prompt in turns
(this machine's memory bandwidth drifts within minutes), each method with its own engine and no
prefix cache (a prompt's prefill is paid by each), under one forward-cost table measured at the
start; every output must equal plain decoding's. Overall: total tokens / total time.

Run: .venv/bin/python benchmarks/eagle_levels.py --per-category 2 --min-prob 0.02,0.1,0.2,0.35
`--smoke --target FOLDER --eagle FILE`: the same code path on a tiny model.
"""
from __future__ import annotations

import argparse
import time
from collections import Counter

import speclm.proposers.eagle as eagle
from speclm.bench.dataset import load_prompts
from speclm.engine import SpecEngine
from speclm.forward.costs import measure
from speclm.models.loading import load_model
from speclm.runtime import keep_freed_memory, set_threads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--eagle", default=None, help="heads file (default: those shipped for the target)")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--min-prob", default="0.02,0.1,0.2,0.35", help="comma-separated values to run")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    set_threads(1 if args.smoke else None)
    keep_freed_memory()  # as the CLI does: a forward over more rows does not page-fault its buffers again
    target = load_model(args.target, quantize="none" if args.smoke else "int8", progress=False)
    costs = measure(target.model, sizes=(1, 2, 4, 8) if args.smoke else (1, 2, 3, 4, 6, 8, 12, 16))
    values = [float(v) for v in args.min_prob.split(",")]
    runs = ["none"] + [f"eagle, MIN_PROB {v}" for v in values]
    engines = {}
    for run in runs:
        engines[run] = SpecEngine(target, prefix_cache=0)
        engines[run].forward_costs = lambda: costs
    prompts = load_prompts("spec-bench", None, args.per_category)
    tokens, seconds, forwards, drafting = Counter(), Counter(), Counter(), Counter()
    for p in prompts:
        plain = None
        for run, value in zip(runs, [None] + values):
            if value is not None:
                eagle.MIN_PROB = value
            start = time.perf_counter()
            method = dict(method="none") if value is None else dict(method="eagle", heads=args.eagle)
            out = engines[run].generate(p.text, **method, max_new_tokens=2 if args.smoke else args.max_new_tokens,
                                        chat=True)
            seconds[run] += time.perf_counter() - start
            tokens[run] += len(out.token_ids)
            forwards[run] += out.stats.target_forwards
            drafting[run] += out.stats.draft_seconds
            plain = out.token_ids if plain is None else plain
            if out.token_ids != plain:
                raise SystemExit(f"{run}: output differs from plain decoding on {p.prompt_id}")
    unit = costs.seconds[1]
    print(f"# EAGLE's MIN_PROB on {len(prompts)} Spec-Bench prompts ({args.per_category} per kind), "
          f"{args.max_new_tokens} new tokens, greedy, chat; every output identical to plain decoding")
    print()
    print("Forward costs (relative to 1 token): " + ", ".join(f"{n}: {s / unit:.2f}" for n, s in costs.seconds.items()))
    print()
    print("| run | tokens/s | speedup vs none | tokens / target forward | drafting share of wall |")
    print("|---|---|---|---|---|")
    base = tokens["none"] / seconds["none"]
    for run in runs:
        rate = tokens[run] / seconds[run]
        print(f"| {run} | {rate:.2f} | {rate / base:.3f} | {tokens[run] / forwards[run]:.3f} | "
              f"{drafting[run] / seconds[run]:.3f} |")


if __name__ == "__main__":
    main()
