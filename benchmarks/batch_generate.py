"""`speclm generate --batch-size B`: `auto` against `none` (and fixed methods) at the same batch size.

What `generate --batch-size B` runs (SpecEngine.completions: up to B prompts decode together, the
next joins as one finishes), on Spec-Bench prompts as chat, the CLI's default weights
(speclm.runtime.weights_for: int8 target, int4 draft on speclm's kernels). Each run is a fresh
engine over the same loaded models: empty prefix caches and a new planner, as a new `speclm
generate` process has; auto's profile (`speclm tune`) is read from disk as generate reads it.
Methods take turns at each batch size (drift hits them alike). Per run: wall time, tokens,
tokens/s, x `none` at that batch size, outputs identical to `none`'s, auto's plan (rounds
per child, summed over requests) and its measured ratios of a round's seconds past its proposals to
its forward's table price, plain and drafting rounds, by rows (speclm.round.adaptive).

Run: .venv/bin/python benchmarks/batch_generate.py --batch-sizes 4,8 --per-category 4 > batch.txt
(record: benchmarks/avx2/records.md#batch-generate)
`--smoke --target FOLDER --draft FOLDER`: the same code path on tiny models, 2 prompts, batch size
2, 4 new tokens, one torch thread.
"""
from __future__ import annotations

import argparse
import collections
import time

from speclm.bench.dataset import load_prompts
from speclm.bench.machine import cpu_name
from speclm.engine import SpecEngine
from speclm.models.loading import load_model
from speclm.runtime import set_threads, usable_cores, weights_for


def run(target, draft, prompts, batch_size: int, method: str, new_tokens: int):
    engine = SpecEngine(target, draft=draft)
    start = time.perf_counter()
    done = list(engine.completions(prompts, batch_size, method=method, max_new_tokens=new_tokens, chat=True))
    wall = time.perf_counter() - start
    planned = collections.Counter()
    for c in done:
        planned.update(c.stats.planned)
    ratios = engine.planner().measured_ratios() if method == "auto" else {}
    return wall, [c.token_ids for c in done], planned, ratios


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", help="catalog name or model folder")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b", help="catalog name or model folder")
    parser.add_argument("--methods", default="none,draft+pld,auto", help="comma list; none first")
    parser.add_argument("--batch-sizes", default="4,8", help="comma list of generate's --batch-size")
    parser.add_argument("--per-category", type=int, default=4, help="Spec-Bench prompts per task kind")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--smoke", action="store_true", help="tiny run: 2 prompts, batch size 2, 1 thread")
    args = parser.parse_args()
    methods = [m.strip() for m in args.methods.split(",")]
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    if methods[0] != "none":
        parser.error("--methods must start with none (the reference)")
    if args.smoke:
        sizes, args.max_new_tokens = [2], 4
    set_threads(1 if args.smoke else usable_cores())
    quantize, draft_quantize = weights_for("auto")
    target = load_model(args.target, quantize=quantize, progress=False)
    draft = load_model(args.draft, quantize=draft_quantize, progress=False)
    prompts = [p.text for p in load_prompts("spec-bench", None, 1 if args.smoke else args.per_category)]
    prompts = prompts[:2] if args.smoke else prompts
    print(f"# machine: {cpu_name()}; {len(prompts)} prompts, {args.max_new_tokens} new tokens, chat; "
          f"target {quantize}, draft {draft_quantize}")
    print("| batch size | method | wall s | tokens | tokens/s | x none | identical to none | auto's plan "
          "| auto's rounds' seconds / table, plain and drafting, by rows |")
    print("|---|---|---|---|---|---|---|---|---|")
    run(target, draft, prompts[:1], 1, methods[-1], 2)  # warm-up: first-call allocations, kernels
    for b in sizes:
        plain = rate = None
        for method in methods:
            wall, outputs, planned, ratios = run(target, draft, prompts, b, method, args.max_new_tokens)
            tokens = sum(map(len, outputs))
            plain = outputs if plain is None else plain
            rate = tokens / wall if rate is None else rate
            same = sum(a == c for a, c in zip(outputs, plain))
            total = sum(planned.values())
            plan = ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in planned.most_common()) if total else "–"
            measured = ", ".join(f"{n}: {_two(p)}/{_two(d)}" for n, (p, d) in ratios.items()) or "–"
            print(f"| {b} | {method} | {wall:.1f} | {tokens} | {tokens / wall:.2f} | {tokens / wall / rate:.3f} "
                  f"| {same}/{len(prompts)} | {plan} | {measured} |", flush=True)


def _two(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


if __name__ == "__main__":
    main()
