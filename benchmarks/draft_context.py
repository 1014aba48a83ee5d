"""Would a draft model that reads only part of a long prompt pay? Replays `draft` (confidence 0.6,
alternatives 0.6, k 6: speclm's int4-draft defaults) over the `none` outputs of a bench run with
the draft's context cut to the prompt's first SINK tokens and its last W, and predicts the end-to-end
speedup over `none` per task kind, the draft's own prefill included.

The draft model's prefill costs in proportion to the prompt (about 1.6 ms a token for the int4
0.5B at 969 tokens, benchmarks/epyc/prefill-profile.txt) and is paid by every `draft` request
on top of the target's; on Spec-Bench's summarization and RAG prompts (700 tokens on average)
it is about a sixth of `draft`'s time there (7.5 of 45.6 s in the 813b3a6 run). A window makes
it cheap; what it costs is acceptance where the output copies from the part of the prompt cut
away. The first tokens are kept because a decoder's attention leans on them (its attention
sinks); positions are renumbered from 0, which rotary embeddings do not see (they encode
offsets).

Per request, in target steps (the run's cost model: one target step, v(k), the draft's c):
  none  = target prefill + (tokens - 1)
  draft = target prefill + draft prefill + replayed rounds (draft_policy.py's replay)
with the target's prefill as the run measured it for `none` and the draft's prefill timed here on
this machine over each cut prompt (median of 3). Acceptance uses the draft's vocabulary built from
the whole prompt, as speclm would.

Run: .venv/bin/python benchmarks/draft_context.py benchmarks/epyc/reference-int8-qwen1.5b-813b3a6/results.json \
         > benchmarks/epyc/draft-context.txt
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from draft_policy import Costs, Replay, replay_draft, teacher_forced
from speclm.bench.dataset import SPEC_BENCH_KINDS, load_prompts
from speclm.engine import DRAFT_VOCAB, SpecEngine
from speclm.kv import StaticKV
from speclm.models.loading import load_model
from speclm.proposers.draft_vocab import restricted_head

SINK = 4
WINDOWS = (None, 1024, 512, 256, 128)  # None: the whole prompt, as speclm runs


def cut(prompt: list[int], window: int | None) -> list[int]:
    if window is None or len(prompt) <= SINK + window:
        return prompt
    return prompt[:SINK] + prompt[-window:]


def prefill_seconds(draft, ids: list[int], head) -> float:
    times = []
    for _ in range(3):
        kv = StaticKV(draft, 1, len(ids) + 1)
        start = time.perf_counter()
        kv.forward([ids], 1, head)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(path: str) -> None:
    torch.set_num_threads(2)
    results = json.load(open(path))
    config, cost_model = results["config"], results["cost_model"]
    target = load_model(config["target"], progress=False)  # tokenizer and chat template only
    draft = load_model(config["draft"], quantize=config["draft_quantize"] or config["quantize"], progress=False)
    engine = SpecEngine(target)
    eos = list(target.eos_token_ids)
    step = cost_model["target_step_seconds"]
    costs = Costs(cost_model, cost_model["c"]["draft"])
    prompts = {p.prompt_id: p for p in load_prompts(config["dataset"], config["categories"], config["per_category"])}
    sums = {w: {} for w in WINDOWS}  # window -> kind -> [none steps, draft steps, decode tokens, decode steps]
    lengths: dict[str, list[int]] = {}
    for run in results["runs"]:
        if run["method"] != "none" or run["repeat"]:
            continue
        ids = engine.encode([prompts[run["prompt_id"]].text], config["chat"])[0]
        lengths.setdefault(run["category"], []).append(len(ids))
        output = run["token_ids"]
        target_prefill = run["stats"]["prefill_seconds"] / step
        head = restricted_head(draft.model, DRAFT_VOCAB, ids + eos)  # from the whole prompt, as speclm builds it
        for w in WINDOWS:
            seen = cut(ids, w)
            top, prob = teacher_forced(draft.model, seen, output, eos, head)
            replay = Replay(run["category"], seen, output, config["max_new_tokens"], top, prob)
            tokens, rounds_cost, _ = replay_draft(replay, costs, 6, lambda probs: probs[-1] < 0.6, 0.6)
            draft_prefill = prefill_seconds(draft.model, seen, head) / step
            cell = sums[w].setdefault(run["category"], [0.0, 0.0, 0, 0.0])
            cell[0] += target_prefill + tokens
            cell[1] += target_prefill + draft_prefill + rounds_cost
            cell[2] += tokens
            cell[3] += rounds_cost
    kinds = [k for k in SPEC_BENCH_KINDS if k in lengths]
    print(f"{path}: {sum(map(len, lengths.values()))} prompts; prompt tokens by kind (mean): "
          + ", ".join(f"{k} {statistics.mean(lengths[k]):.0f}" for k in kinds)
          + f"; target step {step * 1000:.1f} ms, c = {costs.c:.3f}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads\n")
    print("Predicted end-to-end speedup of `draft` over `none` (decode-only in parentheses):\n")
    print("| draft reads | " + " | ".join(kinds) + " | mean of the kinds |")
    print("|---|" + "---|" * (len(kinds) + 1))
    for w in WINDOWS:
        speed = {k: sums[w][k][0] / sums[w][k][1] for k in kinds}
        label = "the whole prompt (speclm)" if w is None else f"first {SINK} + last {w} tokens"
        print(f"| {label} | " + " | ".join(f"{speed[k]:.2f} ({sums[w][k][2] / sums[w][k][3]:.2f})" for k in kinds)
              + f" | {statistics.mean(speed.values()):.3f} |")


if __name__ == "__main__":
    main(sys.argv[1])
