"""Justifies the draft vocabulary's size (speclm.defaults.DRAFT_VOCAB): how much of what the
target writes a restricted draft vocabulary can propose, the share of `none`'s greedy tokens in a
bench run that lie among the N lowest token ids, alone and with the prompt's tokens and EOS
added (what speclm.proposers.draft_vocab scores), for several N.

Run: .venv/bin/python benchmarks/draft_vocab_coverage.py benchmarks/epyc/reference-int8-qwen1.5b/results.json \
         > benchmarks/epyc/draft-vocab-coverage.txt
Committed output: benchmarks/epyc/draft-vocab-coverage.txt (AMD EPYC machine).
`--smoke`: one torch thread; the run's size is that of the results.json given
(tests/test_benchmark_scripts.py passes a tiny model's `speclm bench` run).
"""
from __future__ import annotations

import argparse
import json

import torch

from speclm.bench.dataset import load_prompts
from speclm.engine import SpecEngine
from speclm.models.loading import load_model

SIZES = (8192, 16384, 32768, 65536, 100000)


def main(path: str) -> None:
    results = json.load(open(path))
    config = results["config"]
    target = load_model(config["target"])  # the tokenizer and chat template; the weights are not run
    engine = SpecEngine(target)
    prompts = {p.prompt_id: p for p in load_prompts(config["dataset"], config["categories"], config["per_category"])}
    runs = [r for r in results["runs"] if r["method"] == "none" and r["repeat"] == 0]
    eos = set(target.eos_token_ids)
    print(f"{path}: {len(runs)} prompts, {sum(len(r['token_ids']) for r in runs)} tokens of `none`")
    print("| N lowest ids | share of tokens | with the prompt's tokens and EOS |")
    print("|---|---|---|")
    for n in SIZES:
        alone = with_prompt = total = 0
        for r in runs:
            prompt_ids = set(engine.encode([prompts[r["prompt_id"]].text], config["chat"])[0]) | eos
            for t in r["token_ids"]:
                total += 1
                alone += t < n
                with_prompt += t < n or t in prompt_ids
        print(f"| {n} | {alone / total:.4f} | {with_prompt / total:.4f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="results.json of a `speclm bench` run with method none")
    parser.add_argument("--smoke", action="store_true", help="1 thread (the input sets the run's size)")
    args = parser.parse_args()
    if args.smoke:
        torch.set_num_threads(1)
    main(args.results)
