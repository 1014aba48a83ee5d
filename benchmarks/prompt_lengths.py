"""Spec-Bench's prompt lengths in tokens per task kind, with the target's chat template (one user
message, as `bench --chat` encodes them): what draft+pld's prompt-length rule
(`--draft-prompt-ratio`, speclm.proposers.draft_lookup) sees.

Run: .venv/bin/python benchmarks/prompt_lengths.py qwen2.5-coder-1.5b > benchmarks/spec-bench-prompt-lengths.txt
"""
from __future__ import annotations

import sys

import numpy as np

from speclm.bench.dataset import load_prompts
from speclm.engine import SpecEngine
from speclm.methods import DRAFT_PROMPT_RATIO
from speclm.models.loading import load_model


def main(model: str) -> None:
    engine = SpecEngine(load_model(model))  # the tokenizer and chat template; the weights are not run
    prompts = load_prompts("spec-bench", None, None)
    lengths: dict[str, list[int]] = {}
    for p, ids in zip(prompts, engine.encode([p.text for p in prompts], chat=True)):
        lengths.setdefault(p.category, []).append(len(ids))
    cut = DRAFT_PROMPT_RATIO * 128
    print(f"{model}, chat template; draft+pld's cut at 128 new tokens: {cut:g} prompt tokens")
    print("| task kind | prompts | min | 10th pct | median | 90th pct | max | above the cut |")
    print("|---|---|---|---|---|---|---|---|")
    for kind, n in lengths.items():
        a = np.array(n)
        print(f"| {kind} | {len(a)} | {a.min()} | {np.percentile(a, 10):.0f} | {np.median(a):.0f} | "
              f"{np.percentile(a, 90):.0f} | {a.max()} | {(a > cut).sum()} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-1.5b")
