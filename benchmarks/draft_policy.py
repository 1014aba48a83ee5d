"""Justifies the int4 draft's stop rule and alternatives and prompt lookup's n-grams
(speclm.defaults.CONFIDENCE_INT4, ALTERNATIVES_INT4, NGRAM_MAX): drafting policies compared
without wall time. It replays greedy speculation over the outputs of
`none` in bench runs and predicts each policy's decode speedup from the run's measured cost
model (v(k) and the draft's c).

Greedy speculation is fully determined by the target's output: a round that starts after the
first s output tokens accepts draft tokens while they equal the output's next tokens, and a
draft model conditioned on an accepted prefix sees exactly the output's prefix. So one
teacher-forced forward of the draft over prompt + output gives, at every position, the token
the draft proposes there and its probability, and prompt lookup is a pure function of the same
prefix. The one approximation: after a round's first rejected token the draft continues from
its own wrong token, whose later probabilities are not known; the replay uses the
teacher-forced ones there, which only moves where a confidence stop ends the round (draft
steps, verification width), never the accepted tokens.

A round costs (draft steps) x c + v(tokens verified), in target steps; `none` costs 1 per token.
Predicted decode speedup = output tokens after the first / summed round costs. Policies:
- draft, stop after a token below probability P (speclm's `--confidence`), k at most;
- draft, stop once the product of the round's probabilities falls below P ("cumulative");
- draft with alternatives: where the draft's top token has probability below S, its second
  choice is verified beside it (one more token in the verification; accepted when the first
  choice is the one rejected and the second is the target's), a tree whose extra branches are
  leaves (speclm's `--alternatives S`);
- prompt lookup with its k, n-gram range, and k set by the length of the n-gram that matched.

Run (the first and last runs are in git: `git show 44a4c5c:PATH > FILE`):
    .venv/bin/python benchmarks/draft_policy.py 44a4c5c:benchmarks/epyc/reference-int8-qwen1.5b-b82b9b2/results.json \
         benchmarks/epyc/methods-int8-qwen1.5b-d395ee1/other18/results.json \
         benchmarks/epyc/methods-int8-qwen1.5b-d395ee1/results.json \
         44a4c5c:benchmarks/epyc/alternatives-int8-qwen1.5b-73caf26/results.json > draft-policy.txt
Committed output: benchmarks/epyc/records.md#draft-policy (AMD EPYC machine).
`--smoke`: one torch thread; the run's size is that of the results.json files given
(tests/test_benchmark_scripts.py passes a tiny model's `speclm bench` run).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import dataclass

import torch

from speclm.bench.dataset import SPEC_BENCH_KINDS, load_prompts
from speclm.defaults import DRAFT_VOCAB
from speclm.engine import SpecEngine
from speclm.forward.cache import StaticKV
from speclm.models.loading import load_model
from speclm.proposers.draft_vocab import restricted_head
from speclm.proposers.prompt_lookup import lookup


@dataclass
class Replay:
    category: str
    prompt: list[int]
    output: list[int]  # `none`'s greedy tokens
    budget: int  # the run's max_new_tokens: the engine drafts at most (tokens left - 1) per round
    top: list[list[int]]  # (T, 2): the draft's two likeliest tokens before output[t]
    prob: list[list[float]]  # (T, 2): their probabilities


def teacher_forced(draft, prompt: list[int], output: list[int], eos: list[int], head=None) -> tuple[list, list]:
    """The draft's two likeliest tokens and their probabilities before each output token, having
    read `prompt` and the output so far; head: its restricted vocabulary (default: the one the
    `draft` method builds from this prompt)."""
    if head is None:
        head = restricted_head(draft, DRAFT_VOCAB, prompt + eos)  # as the `draft` method scores
    kv = StaticKV(draft, 1, len(prompt) + len(output) + 1)
    logits = kv.forward([prompt + output[:-1]], len(output), head)[0]  # (T, S): row t predicts output[t]
    best = torch.softmax(logits, -1).topk(2, -1)
    ids = best.indices if head is None else head.ids[best.indices]
    return ids.tolist(), best.values.tolist()


class Costs:
    def __init__(self, cost_model: dict, c: float):
        self.v = {int(k): x for k, x in cost_model["v"].items()}
        self.c = c

    def verify(self, tokens: int) -> float:
        top = max(self.v)
        return self.v[tokens] if tokens in self.v else self.v[top] * tokens / top


def room(r: Replay, s: int, k: int) -> int:
    """Draft tokens a round may propose after s committed tokens: the engine's budget, and no
    further than the output's end (what follows an EOS is not known, nor needed)."""
    return max(0, min(k, r.budget - s - 1, len(r.output) - s))


def _draft_round(r: Replay, costs: Costs, k: int, stop, alternative: float, s: int) -> tuple[int, float]:
    """One draft-model round after s committed tokens: (committed tokens after it, its cost)."""
    drafted = accepted = extra = alternatives = 0
    alive = True
    probs: list[float] = []
    for t in range(s, s + room(r, s, k)):
        drafted += 1
        probs.append(r.prob[t][0])
        branch = r.prob[t][0] < alternative
        alternatives += branch
        if alive and r.top[t][0] == r.output[t]:
            accepted += 1
        elif alive:
            alive = False
            extra = int(branch and r.top[t][1] == r.output[t])
        if stop(probs):
            break
    return s + accepted + extra + 1, drafted * costs.c + costs.verify(drafted + 1 + alternatives)


def replay_draft(r: Replay, costs: Costs, k: int, stop, alternative: float = 0.0) -> tuple[int, float, int]:
    """(tokens, cost, rounds); stop(probs of the round so far) -> end the round after this token."""
    n, s, cost, rounds = len(r.output), 1, 0.0, 0  # output[0] comes from the prefill
    while s < n:
        s, c = _draft_round(r, costs, k, stop, alternative, s)
        cost, rounds = cost + c, rounds + 1
    return n - 1, cost, rounds


def replay_lookup(r: Replay, costs: Costs, k: int, ngram_max: int, ngram_min: int, k_by_n: dict | None = None):
    n, s, cost, rounds = len(r.output), 1, 0.0, 0
    while s < n:
        context = r.prompt + r.output[:s]
        draft: list[int] = []
        for size in range(ngram_max, ngram_min - 1, -1):
            draft = lookup(context, room(r, s, k), size, size)
            if draft:
                draft = draft[: (k_by_n or {}).get(size, k)]
                break
        accepted = next((j for j, t in enumerate(draft) if r.output[s + j] != t), len(draft))
        s += accepted + 1
        rounds += 1
        cost += costs.verify(len(draft) + 1)
    return n - 1, cost, rounds


def replay_draft_lookup(r: Replay, costs: Costs, k: int, stop, prompt_ratio: float = 3.0, ngram_min: int = 2,
                        lookup_k: int = 4, alternative: float = 0.0):
    """`draft+pld`: lookup alone (pld's settings) for a prompt longer than prompt_ratio x the
    budget; else, per round, lookup's tokens where the last ngram_min..3 tokens recur, the draft
    model's elsewhere (the model's catch-up over lookup's tokens is one forward, counted as the
    first draft step of its next round)."""
    if len(r.prompt) > prompt_ratio * r.budget:
        return replay_lookup(r, costs, lookup_k, 3, 1)
    n, s, cost, rounds = len(r.output), 1, 0.0, 0
    while s < n:
        draft = lookup(r.prompt + r.output[:s], room(r, s, k), 3, ngram_min)
        if draft:
            accepted = next((j for j, t in enumerate(draft) if r.output[s + j] != t), len(draft))
            s, rounds, cost = s + accepted + 1, rounds + 1, cost + costs.verify(len(draft) + 1)
            continue
        t0, c0 = _draft_round(r, costs, k, stop, alternative, s)
        s, rounds, cost = t0, rounds + 1, cost + c0
    return n - 1, cost, rounds


def table(replays: list[Replay], policies: dict) -> None:
    kinds = [k for k in SPEC_BENCH_KINDS if any(r.category == k for r in replays)]
    print("| policy | " + " | ".join(kinds) + " | mean of the kinds | tokens per target forward |")
    print("|---|" + "---|" * (len(kinds) + 2))
    for name, run in policies.items():
        sums = {k: [0, 0.0] for k in kinds}
        tokens = rounds = 0
        for r in replays:
            t, c, n = run(r)
            sums[r.category][0] += t
            sums[r.category][1] += c
            tokens, rounds = tokens + t, rounds + n
        speed = {k: t / c for k, (t, c) in sums.items()}
        print(f"| {name} | " + " | ".join(f"{speed[k]:.2f}" for k in kinds)
              + f" | {statistics.mean(speed.values()):.3f} | {tokens / rounds:.2f} |")


def main(paths: list[str], threads: int = 2) -> None:
    torch.set_num_threads(threads)
    first = json.load(open(paths[0]))["config"]
    target = load_model(first["target"], progress=False)  # tokenizer and chat template; its weights do not run
    draft = load_model(first["draft"], quantize=first["draft_quantize"] or first["quantize"], progress=False)
    engine = SpecEngine(target)
    eos = list(target.eos_token_ids)
    for path in paths:
        results = json.load(open(path))
        config, cost_model = results["config"], results["cost_model"]
        prompts = {p.prompt_id: p for p in load_prompts(config["dataset"], config["categories"], config["per_category"])}
        replays = []
        for run in results["runs"]:
            if run["method"] == "none" and run["repeat"] == 0:
                ids = engine.encode([prompts[run["prompt_id"]].text], config["chat"])[0]
                top, prob = teacher_forced(draft.model, ids, run["token_ids"], eos)
                replays.append(Replay(run["category"], ids, run["token_ids"], config["max_new_tokens"], top, prob))
        costs = Costs(cost_model, cost_model["c"]["draft"])
        print(f"## {path}\n\n{len(replays)} prompts; the run's cost model: c = {costs.c:.3f}, "
              + ", ".join(f"v({k}) = {costs.v[k]:.2f}" for k in range(2, 9)) + "\n")
        predicted = {m: p["by_category"] for m, p in results["summary"]["predicted"].items() if "by_category" in p}
        if predicted:  # a results.json whose report did not predict by category holds none
            print("The run's own report, predicted speedup by category (same cost model, its counted rounds): "
                  + "; ".join(f"{m}: " + " ".join(f"{k} {x:.2f}" for k, x in predicted[m].items())
                              for m in ("draft", "pld") if m in predicted) + "\n")

        def confidence(p):
            return lambda probs: probs[-1] < p

        def cumulative(p):
            return lambda probs: math.prod(probs) < p

        # Check of the replay: rounds + 1 (the prefill) against the run's target forwards (greedy
        # acceptance does not depend on timing). A label ran with the defaults of the speclm that
        # ran the bench: `draft` with confidence 0.5, or with confidence 0.6 and alternatives 0.6
        # (speclm.defaults: CONFIDENCE_INT4, ALTERNATIVES_INT4); both are replayed.
        measured = {}
        for x in results["runs"]:
            if x["method"] != "none" and not x["method"].startswith("hf"):
                measured[x["method"]] = measured.get(x["method"], 0) + x["stats"]["target_forwards"]
        replayed = {
            "draft, confidence 0.5": sum(replay_draft(r, costs, 6, confidence(0.5))[2] + 1 for r in replays),
            "draft, confidence 0.6, alternatives 0.6": sum(replay_draft(r, costs, 6, confidence(0.6), 0.6)[2] + 1
                                                          for r in replays),
            "pld": sum(replay_lookup(r, costs, 4, 3, 1)[2] + 1 for r in replays),
            "draft+pld, confidence 0.5": sum(replay_draft_lookup(r, costs, 6, confidence(0.5))[2] + 1 for r in replays),
            "draft+pld, confidence 0.6, alternatives 0.6": sum(
                replay_draft_lookup(r, costs, 6, confidence(0.6), alternative=0.6)[2] + 1 for r in replays),
        }
        print("Target forwards measured in the run: " + "; ".join(f"{m} {n}" for m, n in measured.items()) + "\n")
        print("Replayed: " + "; ".join(f"{m} {n}" for m, n in replayed.items()) + "\n")
        print("Draft model (k at most 6 unless named):\n")
        table(replays, {
            "confidence 0.5 (the runs' setting)": lambda r: replay_draft(r, costs, 6, confidence(0.5)),
            "confidence 0.3": lambda r: replay_draft(r, costs, 6, confidence(0.3)),
            "confidence 0.6": lambda r: replay_draft(r, costs, 6, confidence(0.6)),
            "confidence 0.7": lambda r: replay_draft(r, costs, 6, confidence(0.7)),
            "confidence 0.5, k 8": lambda r: replay_draft(r, costs, 8, confidence(0.5)),
            "cumulative 0.3": lambda r: replay_draft(r, costs, 6, cumulative(0.3)),
            "cumulative 0.5": lambda r: replay_draft(r, costs, 6, cumulative(0.5)),
            "cumulative 0.5, k 8": lambda r: replay_draft(r, costs, 8, cumulative(0.5)),
            "confidence 0.5, alternatives below 0.5": lambda r: replay_draft(r, costs, 6, confidence(0.5), 0.5),
            "confidence 0.5, alternatives below 0.6": lambda r: replay_draft(r, costs, 6, confidence(0.5), 0.6),
            "confidence 0.5, alternatives below 0.7": lambda r: replay_draft(r, costs, 6, confidence(0.5), 0.7),
            "confidence 0.6, alternatives below 0.6 (speclm's default since)": lambda r: replay_draft(r, costs, 6, confidence(0.6), 0.6),
            "confidence 0.7, alternatives below 0.7": lambda r: replay_draft(r, costs, 6, confidence(0.7), 0.7),
            "confidence 0.6, alternatives below 0.8": lambda r: replay_draft(r, costs, 6, confidence(0.6), 0.8),
        })
        print("\n`draft+pld` (the draft model with confidence 0.5, k 6; prompts longer than 3 x the budget by lookup alone):\n")
        table(replays, {
            "as the runs ran it (lookup beside the model from 2-grams)": lambda r: replay_draft_lookup(r, costs, 6, confidence(0.5)),
            "model confidence 0.6, alternatives below 0.6 (speclm's default since)":
                lambda r: replay_draft_lookup(r, costs, 6, confidence(0.6), alternative=0.6),
            "lookup beside the model from 3-grams": lambda r: replay_draft_lookup(r, costs, 6, confidence(0.5), ngram_min=3),
            "model confidence 0.6": lambda r: replay_draft_lookup(r, costs, 6, confidence(0.6)),
        })
        print("\nPrompt lookup (n-grams 1-3, k 4 unless named):\n")
        table(replays, {
            "k 4 (speclm's default with int8 weights)": lambda r: replay_lookup(r, costs, 4, 3, 1),
            "k 3": lambda r: replay_lookup(r, costs, 3, 3, 1),
            "k 5": lambda r: replay_lookup(r, costs, 5, 3, 1),
            "n-grams 2-3": lambda r: replay_lookup(r, costs, 4, 3, 2),
            "n-grams 1-5": lambda r: replay_lookup(r, costs, 4, 5, 1),
            "k 2 / 3 / 5 after a 1- / 2- / 3-gram": lambda r: replay_lookup(r, costs, 5, 3, 1, {1: 2, 2: 3, 3: 5}),
            "k 1 / 2 / 4 after a 1- / 2- / 3-gram": lambda r: replay_lookup(r, costs, 4, 3, 1, {1: 1, 2: 2, 3: 4}),
        })
        print()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="results.json of `speclm bench` runs with methods none and draft")
    parser.add_argument("--smoke", action="store_true", help="1 thread (the inputs set the run's size)")
    args = parser.parse_args()
    main(args.results, 1 if args.smoke else 2)
