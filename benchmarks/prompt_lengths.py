"""Justifies draft+pld's prompt-length rule (speclm.defaults.DRAFT_PROMPT_RATIO,
`--draft-prompt-ratio`, speclm.proposers.draft_lookup) by what it sees: Spec-Bench's prompt
lengths in tokens per task kind, with the target's chat template (one user message, as
`bench --chat` encodes them), and how many lie above the cut at 128 new tokens.

Run: .venv/bin/python benchmarks/prompt_lengths.py --target qwen2.5-coder-1.5b > benchmarks/spec-bench-prompt-lengths.txt
Committed output: benchmarks/spec-bench-prompt-lengths.txt.
`--smoke --target FOLDER`: the same code path over 2 prompts per task kind, one torch thread.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

from speclm.bench.dataset import load_prompts
from speclm.defaults import DRAFT_PROMPT_RATIO
from speclm.engine import SpecEngine
from speclm.models.loading import load_model


def main(model: str, per_category: int | None) -> None:
    engine = SpecEngine(load_model(model))  # the tokenizer and chat template; the weights are not run
    prompts = load_prompts("spec-bench", None, per_category)
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", help="catalog name or model folder")
    parser.add_argument("--smoke", action="store_true", help="2 prompts per task kind, 1 thread")
    args = parser.parse_args()
    if args.smoke:
        torch.set_num_threads(1)
    main(args.target, 2 if args.smoke else None)
