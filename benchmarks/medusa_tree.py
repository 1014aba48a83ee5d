"""A static Medusa tree ("choices": root paths of ranks) tuned on held-out data, as Medusa tunes its
trees: from how often head i's rank-r token is the token i + 1 ahead on the validation split
(sequences whose prompt id the training run held out: speclm.heads.train.is_validation), a
path's expected acceptance is the product of its ranks' rates (heads taken as independent);
the tree keeps the most valuable paths, as many as pay for their verification by this machine's
measured forward costs: N maximising (1 + summed path values) / (target forward over 1 + N tokens).

Run: .venv/bin/python benchmarks/medusa_tree.py --data DATA --heads runs/medusa/heads.safetensors \
         --out speclm/data/heads/qwen2.5-coder-1.5b/medusa-tree.json > medusa-tree.txt
`--smoke --data DIR --heads FILE --target FOLDER`: the same code path on a tiny model's data.
"""
from __future__ import annotations

import argparse
import heapq
import json

import torch

from speclm.engine import SpecEngine
from speclm.heads.data import read_shards
from speclm.heads.modules import labels_in_vocab
from speclm.heads.train import is_validation
from speclm.models.loading import load_model
from speclm.runtime import set_threads

RANKS = 8


def rank_rates(engine: SpecEngine, heads_file: str, data: list[str], fraction: float, limit: int) -> tuple[torch.Tensor, int]:
    """(K, RANKS): the share of validation positions of the data folders (each's in turn) where
    head i's rank-r token is the token i + 1 ahead; and the positions counted."""
    heads = engine.heads("medusa", heads_file)
    module = heads.module
    depth = len(module.blocks)
    hits = torch.zeros(depth, RANKS)
    counted = 0
    for shard in (s for folder in data for s in read_shards(folder)):
        starts = shard["starts"].tolist()
        for s, (a, b) in enumerate(zip(starts, starts[1:])):
            if not is_validation(shard["prompt_ids"][s], fraction):
                continue
            tokens = shard["tokens"][a:b].long()
            first = max(0, int(shard["prompt_lens"][s]) - 1)  # the target generated what follows from here
            feats = shard["hidden"][a:b][first:].float()
            labels = labels_in_vocab(tokens, heads.vocab_ids, engine.target.vocab_size)[first:]
            with torch.inference_mode():
                states = module(feats)  # (K, n, E)
                ranks = [heads.output_head(states[i]).float().topk(RANKS, -1).indices for i in range(depth)]
            n = len(labels) - 1 - depth
            if n <= 0:
                continue
            for i in range(depth):
                want = labels[1 + (i + 1): 1 + (i + 1) + n]  # the token i + 1 past the next, for positions 0..n-1
                got = ranks[i][:n]
                match = got == want[:, None]  # (n, RANKS)
                hits[i] += match.float().sum(0)
            counted += n
            if counted >= limit:
                return hits / counted, counted
    return hits / max(counted, 1), counted


def best_tree(rates: torch.Tensor, costs, most: int = 48) -> list[list[int]]:
    """The most valuable paths (a path's value: the product of its ranks' rates), best first, as
    many as maximise (1 + summed values) per second of verification."""
    depth = rates.shape[0]
    r = rates.tolist()
    heap = [(-r[0][k], (k,)) for k in range(RANKS)]
    heapq.heapify(heap)
    paths, values = [], []
    while heap and len(paths) < most:
        neg, path = heapq.heappop(heap)
        paths.append(list(path))
        values.append(-neg)
        if len(path) < depth:
            for k in range(RANKS):
                heapq.heappush(heap, (neg * r[len(path)][k], path + (k,)))
    best, best_rate, gained = 0, -1.0, 1.0
    for n in range(len(paths) + 1):
        gained += values[n - 1] if n else 0.0
        rate = gained / costs(1 + n)
        if rate > best_rate:
            best, best_rate = n, rate
    return sorted(paths[:max(best, 1)], key=lambda p: (len(p), p))  # a tree holds one node at least


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, action="append", help="a data folder (more than once: several)")
    ap.add_argument("--heads", required=True)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--valid-fraction", type=float, default=0.05)
    ap.add_argument("--positions", type=int, default=200_000, help="validation positions to count at most")
    ap.add_argument("--out", default=None, help="where to write the tree (JSON)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    set_threads(1 if args.smoke else None)
    engine = SpecEngine(load_model(args.target, quantize="none" if args.smoke else "int8", progress=False))
    fraction = 0.5 if args.smoke else args.valid_fraction
    rates, counted = rank_rates(engine, args.heads, args.data, fraction, args.positions)
    tree = best_tree(rates, engine.forward_costs())
    print(f"# Medusa static tree from {counted} validation positions of {' + '.join(args.data)}; heads {args.heads}")
    print()
    print("| head | " + " | ".join(f"rank {k}" for k in range(RANKS)) + " |")
    print("|---" * (RANKS + 1) + "|")
    for i, row in enumerate(rates.tolist()):
        print(f"| {i + 1} | " + " | ".join(f"{v:.3f}" for v in row) + " |")
    print()
    print(f"tree: {len(tree)} nodes, {max(map(len, tree), default=0)} deep: {json.dumps(tree)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(tree, f)
            f.write("\n")


if __name__ == "__main__":
    main()
