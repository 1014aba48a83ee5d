"""Justifies speclm.keep_freed_memory() (glibc keeps freed memory; the CLI applies it): does what
ran before a prefill change its time? Over 5 long Spec-Bench prompts, twice, in the bench's
order for each prompt: speclm `none`, speclm `pld`, transformers' `generate`
(`hf`), 32 new tokens each, int8 qwen2.5-coder-1.5b. `none` follows `hf` of the previous prompt,
`pld` follows `none`; both prefill the same prompt on the same weights, so their prefill times
should match. Printed: each prompt's two prefill times and the mean ratio none / pld (first
prompt of the first round left out: it follows nothing), with glibc's default malloc settings
(SPECLM_MALLOC=system) and with speclm.keep_freed_memory(), each in its own process.

Run: .venv/bin/python benchmarks/allocator.py > allocator.txt
Committed output: benchmarks/epyc/records.md#allocator (AMD EPYC machine).
`--smoke --target FOLDER`: the same code path on 2 short prompts, 1 round, 8 new tokens, one
torch thread (tests/test_benchmark_scripts.py runs it on a tiny model).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

PROMPTS = ["267", "294", "507", "241", "481"]  # summarization and RAG: 488-969 tokens with the chat template
SMOKE_PROMPTS = ["375", "351"]  # two of the shortest qa prompts: they fit a tiny model's context


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", help="catalog name or model folder")
    parser.add_argument("--smoke", action="store_true", help="2 short prompts, 1 round, 8 new tokens, 1 thread")
    return parser.parse_args()


def child(args: argparse.Namespace) -> None:
    import torch

    import speclm
    from speclm.bench.dataset import load_prompts
    from speclm.bench.methods import parse_methods, run_method

    ids_wanted, rounds, new_tokens = (SMOKE_PROMPTS, 1, 8) if args.smoke else (PROMPTS, 2, 32)
    speclm.set_threads(1 if args.smoke else None)
    kept = speclm.keep_freed_memory()
    target = speclm.load_model(args.target, quantize="int8", progress=False)
    engine = speclm.SpecEngine(target)
    prompts = {p.prompt_id: p for p in load_prompts("spec-bench", None, None)}
    methods = {s.label: s for s in parse_methods("none,pld,hf")}
    print(f"## keep_freed_memory: {kept} (torch {torch.__version__}, {torch.get_num_threads()} threads)\n")
    ratios = []
    for round_ in range(rounds):
        for pid in ids_wanted:
            ids = engine.encode([prompts[pid].text], True)[0]
            after_hf = run_method(methods["none"], engine, ids, new_tokens, 0.0, 0).stats.prefill_seconds
            after_none = run_method(methods["pld"], engine, ids, new_tokens, 0.0, 0).stats.prefill_seconds
            run_method(methods["hf"], engine, ids, new_tokens, 0.0, 0)
            print(f"round {round_ + 1}, prompt {pid} ({len(ids)} tokens): prefill after hf (none) {after_hf:.2f} s, "
                  f"after none (pld) {after_none:.2f} s")
            ratios.append(after_hf / after_none)
    print(f"\nmean ratio none / pld over the {len(ratios) - 1} prompts that follow hf: "
          f"{statistics.mean(ratios[1:]):.3f}\n", flush=True)


def main() -> None:
    arguments()  # --help and argument errors before any child starts
    for setting in ("system", "keep"):
        env = dict(os.environ, SPECLM_MALLOC=setting, SPECLM_ALLOCATOR_CHILD="1")
        subprocess.run([sys.executable, __file__, *sys.argv[1:]], env=env, check=True)


if __name__ == "__main__":
    child(arguments()) if os.environ.get("SPECLM_ALLOCATOR_CHILD") else main()
