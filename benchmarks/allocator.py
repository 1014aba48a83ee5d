"""Does what ran before a prefill change its time? Over 5 long Spec-Bench prompts, twice, in
the bench's order for each prompt: speclm `none`, speclm `pld`, transformers' `generate`
(`hf`), 32 new tokens each, int8 qwen2.5-coder-1.5b. `none` follows `hf` of the previous prompt,
`pld` follows `none`; both prefill the same prompt on the same weights, so their prefill times
should match. Printed: each prompt's two prefill times and the mean ratio none / pld (first
prompt of the first round left out: it follows nothing), with glibc's default malloc settings
(SPECLM_MALLOC=system) and with speclm.keep_freed_memory(), each in its own process.

Run: .venv/bin/python benchmarks/allocator.py > benchmarks/epyc/allocator.txt
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys

PROMPTS = ["267", "294", "507", "241", "481"]  # summarization and RAG: 488-969 tokens with the chat template


def child() -> None:
    import torch

    import speclm
    from speclm.bench.dataset import load_prompts
    from speclm.bench.methods import parse_methods, run_method

    speclm.set_threads()
    kept = speclm.keep_freed_memory()
    target = speclm.load_model("qwen2.5-coder-1.5b", quantize="int8", progress=False)
    engine = speclm.SpecEngine(target)
    prompts = {p.prompt_id: p for p in load_prompts("spec-bench", None, 3)}
    methods = {s.label: s for s in parse_methods("none,pld,hf")}
    print(f"## keep_freed_memory: {kept} (torch {torch.__version__}, {torch.get_num_threads()} threads)\n")
    ratios = []
    for round_ in range(2):
        for pid in PROMPTS:
            ids = engine.encode([prompts[pid].text], True)[0]
            after_hf = run_method(methods["none"], engine, ids, 32, 0.0, 0).stats.prefill_seconds
            after_none = run_method(methods["pld"], engine, ids, 32, 0.0, 0).stats.prefill_seconds
            run_method(methods["hf"], engine, ids, 32, 0.0, 0)
            print(f"round {round_ + 1}, prompt {pid} ({len(ids)} tokens): prefill after hf (none) {after_hf:.2f} s, "
                  f"after none (pld) {after_none:.2f} s")
            ratios.append(after_hf / after_none)
    print(f"\nmean ratio none / pld over the 9 prompts that follow hf: {statistics.mean(ratios[1:]):.3f}\n", flush=True)


def main() -> None:
    for setting in ("system", "keep"):
        env = dict(os.environ, SPECLM_MALLOC=setting, SPECLM_ALLOCATOR_CHILD="1")
        subprocess.run([sys.executable, __file__], env=env, check=True)


if __name__ == "__main__":
    child() if os.environ.get("SPECLM_ALLOCATOR_CHILD") else main()
