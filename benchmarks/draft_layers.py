"""Would a shallower draft pay? The int4 0.5B draft with some of its 24 layers removed (a draft
step and the draft's prefill cost about in proportion to its layers): the share of output
positions where its teacher-forced top token equals the target's greedy token, over the outputs
of `none` in a bench run (the same replay as benchmarks/draft_policy.py).

Run: .venv/bin/python benchmarks/draft_layers.py benchmarks/epyc/reference-int8-qwen1.5b-0abaa91/results.json \
         > benchmarks/epyc/draft-layers.txt
"""
from __future__ import annotations

import json
import sys

import torch

from draft_policy import teacher_forced
from speclm.bench.dataset import load_prompts
from speclm.engine import SpecEngine
from speclm.models.loading import load_model
from speclm.runtime import set_threads, usable_cores

DROPS = ([], [20], [12, 13], [18, 19, 20, 21], [4, 8, 12, 16, 20])


def main(path: str) -> None:
    set_threads(usable_cores())
    results = json.load(open(path))
    cfg = results["config"]
    target = load_model(cfg["target"], progress=False)  # its tokenizer and chat template
    engine = SpecEngine(target, prefix_cache=0)
    prompts = {p.prompt_id: p for p in load_prompts(cfg["dataset"], cfg["categories"], cfg["per_category"])}
    runs = [r for r in results["runs"] if r["method"] == "none"]
    encoded = [engine.encode([prompts[r["prompt_id"]].text], cfg["chat"])[0] for r in runs]
    draft = load_model(cfg["draft"], quantize=cfg.get("draft_quantize") or cfg["quantize"], progress=False).model
    layers = draft.model.layers
    print(f"{cfg['draft']} ({cfg.get('draft_quantize') or cfg['quantize']}) on the outputs of {path}")
    print("| layers removed | layers | top token = target's |")
    print("|---|---|---|")
    for drop in DROPS:
        keep = [layer for i, layer in enumerate(layers) if i not in drop]
        draft.model.layers, draft.config.num_hidden_layers = torch.nn.ModuleList(keep), len(keep)
        for i, layer in enumerate(keep):
            layer.self_attn.layer_idx = i
        hits = total = 0
        for r, ids in zip(runs, encoded):
            top, _ = teacher_forced(draft, ids, r["token_ids"], list(target.eos_token_ids))
            hits += sum(t[0] == o for t, o in zip(top, r["token_ids"]))
            total += len(r["token_ids"])
        print(f"| {', '.join(map(str, drop)) or 'none'} | {len(keep)} | {hits / total:.1%} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
