"""How well trained heads predict the target on Spec-Bench, teacher-forced: the target decodes each
prompt greedily (chat template), and at every response position the heads read its real features
and guess ahead. Per task kind: the share of response tokens inside the heads' vocabulary,
Medusa's head 1 top-1 and top-3 (the token two ahead) and head 2 top-1, EAGLE's first level top-1
and top-3 (the same token, from the feature and the next token) and its second level's top-1 (the
token three ahead, from its own first prediction, as drafting makes it). With `--data`, the same on the
held-out prompts of training data folders (speclm.heads.train.is_validation), for comparison:
the gap between the two rows is what the training prompts miss. With `--widen 32768,full`, a
second table gives the same Spec-Bench top-1 with each head's vocabulary widened (its own ids,
then the lowest ids it lacks, up to that many; `full`: every id): whether the restricted
vocabulary, not the head, loses the tokens outside it. This only measures; no evaluation prompt
or response is stored or trained on.

Run: .venv/bin/python benchmarks/heads_accuracy.py --per-category 5 --data DATA --data DATA2 \
         --medusa speclm/data/heads/qwen2.5-coder-1.5b/medusa.safetensors \
         --eagle speclm/data/heads/qwen2.5-coder-1.5b/eagle.safetensors [--widen 24576,32768,full]
`--smoke --target FOLDER --medusa FILE --eagle FILE [--data DIR]`: the same code path on a tiny model.
"""
from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from speclm.bench.dataset import load_prompts
from speclm.engine import SpecEngine
from speclm.heads.data import distill, read_shards
from speclm.heads.modules import IGNORE, labels_in_vocab
from speclm.heads.train import is_validation
from speclm.models.loading import load_model
from speclm.runtime import set_threads
from speclm.text import chat_ids

COLUMNS = ("in vocabulary", "medusa h1 top-1", "medusa h1 top-3", "medusa h2 top-1", "eagle top-1", "eagle top-3",
           "eagle level 2 top-1")


def eagle_input(engine: SpecEngine, eagle, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """EAGLE's input at real tokens (n, E): the final feature, or with fuse layers its lift of the
    target's states there (one teacher-forced forward over the sequence for the other layers)."""
    layers = eagle.module.config.feature_layers
    if len(layers) == 1:
        return hidden
    from speclm.forward.cache import StaticKV

    kv = StaticKV(engine.target.model, 1, len(tokens) + 1)
    kv.forward([tokens.tolist()], 1, hidden_layers=layers, hidden_all=True)
    return eagle.module.lift(torch.cat([kv.hidden[layer][0].float() for layer in layers], -1))


def widened(ids: torch.Tensor, size: int, vocab_size: int) -> torch.Tensor:
    """(V,) bool: a head's vocabulary `ids`, then the lowest ids it lacks, `size` ids in all."""
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[ids] = True
    mask[(~mask).nonzero().flatten()[: max(0, size - len(ids))]] = True
    return mask


def top1_widened(engine: SpecEngine, states: torch.Tensor, want: torch.Tensor, response: torch.Tensor, masks: dict,
                 sums: dict, name: str):
    """Add the top-1 hits of states (m, E) against want (m,) over the target's whole output head,
    each widened vocabulary of masks {label: (V,) bool} in turn, and the response's tokens in it."""
    logits = engine.target.model.get_output_embeddings()(states.float().contiguous()).float()  # (m, V)
    for label, mask in masks.items():
        sums[f"{name} {label}"] += int((logits.masked_fill(~mask, float("-inf")).argmax(-1) == want).sum())
        sums[f"{name} in {label}"] += int(mask[response].sum())


@torch.inference_mode()
def score(engine: SpecEngine, medusa, eagle, tokens: torch.Tensor, first: int, hidden: torch.Tensor, sums: dict,
          widen: dict | None = None) -> None:
    """Add one sequence's counts to sums: tokens (n,), the first response token at `first`, the
    target's features hidden (n, E); with widen {"medusa"|"eagle": {label: (V,) bool}}, the
    widened vocabularies' top-1 too."""
    n = len(tokens)
    span = range(first - 1, n - 2)  # position t: the target made token t + 1; the heads guess t + 2
    if len(span) <= 0:
        return
    sums["tokens"] += n - first
    if medusa is not None:
        labels = labels_in_vocab(tokens, medusa.vocab_ids, engine.target.vocab_size)
        sums["in vocabulary"] += int((labels[first:] != IGNORE).sum())
        states = medusa.module(hidden[span.start: span.stop])  # (K, m, E)
        top = medusa.output_head(states[0]).float().topk(3, -1).indices  # (m, 3)
        want = labels[span.start + 2: span.stop + 2]
        sums["medusa h1 top-1"] += int((top[:, 0] == want).sum())
        sums["medusa h1 top-3"] += int((top == want[:, None]).any(-1).sum())
        if widen:
            top1_widened(engine, states[0], tokens[span.start + 2: span.stop + 2], tokens[first:], widen["medusa"],
                         sums, "medusa")
        if len(states) > 1 and span.stop - span.start > 1:
            second = medusa.output_head(states[1][:-1]).float().argmax(-1)
            sums["medusa h2 top-1"] += int((second == labels[span.start + 3: span.stop + 2]).sum())
    if eagle is not None:
        labels = labels_in_vocab(tokens, eagle.vocab_ids, engine.target.vocab_size)
        if medusa is None:
            sums["in vocabulary"] += int((labels[first:] != IGNORE).sum())
        # level 1 over the whole sequence, causally: row t reads (feature t, token t + 1); level 2
        # reads level 1's prediction for t + 1 with token t + 2, as drafting a node below the root does
        first_level, second = eagle.module.unrolled(eagle_input(engine, eagle, tokens, hidden)[None, :-1], tokens[None],
                                                    torch.arange(n)[None], eagle.embed, 2)
        top = eagle.output_head(first_level[0, span.start: span.stop]).float().topk(3, -1).indices
        want = labels[span.start + 2: span.stop + 2]
        sums["eagle top-1"] += int((top[:, 0] == want).sum())
        sums["eagle top-3"] += int((top == want[:, None]).any(-1).sum())
        if widen:
            top1_widened(engine, first_level[0, span.start: span.stop], tokens[span.start + 2: span.stop + 2],
                         tokens[first:], widen["eagle"], sums, "eagle")
        if span.stop - span.start > 1:  # row t of level 2 guesses token t + 3
            guess = eagle.output_head(second[0, span.start: span.stop - 1]).float().argmax(-1)
            sums["eagle level 2 top-1"] += int((guess == labels[span.start + 3: span.stop + 2]).sum())


def row(name: str, prompts: int, sums: dict, medusa, eagle) -> str:
    shown = []
    for c in COLUMNS:
        missing = (c.startswith("medusa") and medusa is None) or (c.startswith("eagle") and eagle is None)
        shown.append("–" if missing else f"{sums[c] / max(sums['tokens'], 1):.3f}")
    return f"| {name} | {prompts} | {sums['tokens']} | " + " | ".join(shown) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--medusa", default=None, help="a Medusa heads file")
    ap.add_argument("--eagle", default=None, help="an EAGLE heads file")
    ap.add_argument("--per-category", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--data", action="append", default=[], help="a training data folder (its held-out prompts)")
    ap.add_argument("--valid-fraction", type=float, default=0.05)
    ap.add_argument("--sequences", type=int, default=60, help="held-out sequences per data folder, at most")
    ap.add_argument("--widen", default="", help="comma-separated vocabulary sizes and/or `full`: the second table")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.medusa is None and args.eagle is None:
        ap.error("give --medusa, --eagle or both")
    if any(w != "full" and not w.isdigit() for w in args.widen.split(",") if w):
        ap.error(f"--widen takes vocabulary sizes and `full`, comma-separated, not '{args.widen}'")
    set_threads(1 if args.smoke else None)
    engine = SpecEngine(load_model(args.target, quantize="none" if args.smoke else "int8", progress=False))
    medusa = engine.heads("medusa", args.medusa) if args.medusa else None
    eagle = engine.heads("eagle", args.eagle) if args.eagle else None
    per, new = (1, 4) if args.smoke else (args.per_category, args.max_new_tokens)
    prompts = load_prompts("spec-bench", ["qa", "translation"] if args.smoke else None, per)
    ids = [chat_ids(engine.target.tokenizer, p.text) for p in prompts]
    vocab_size = engine.target.vocab_size
    sizes = {w: vocab_size if w == "full" else int(w) for w in args.widen.split(",") if w}
    heads = {name: h for name, h in (("eagle", eagle), ("medusa", medusa)) if h is not None}
    widen = {name: {label: widened(h.vocab_ids, n, vocab_size) for label, n in {"own": 0, **sizes}.items()}
             for name, h in heads.items()} if sizes else None
    by_kind: dict[str, dict] = defaultdict(lambda: defaultdict(int))
    counts: dict[str, int] = defaultdict(int)
    total: dict = defaultdict(int)
    for i, response, hidden in distill(engine.target, ids, max_new_tokens=new, batch_size=args.batch_size):
        tokens = torch.tensor(ids[i] + response)
        for sums in (by_kind[prompts[i].category], total):
            score(engine, medusa, eagle, tokens, len(ids[i]), hidden.float(), sums, widen if sums is total else None)
        counts[prompts[i].category] += 1
    print(f"# Heads teacher-forced on the target's greedy responses ({new} new tokens at most, chat template)")
    print(f"target {args.target}; medusa {args.medusa}; eagle {args.eagle}")
    print()
    print("| prompts | count | response tokens | " + " | ".join(COLUMNS) + " |")
    print("|---" * (3 + len(COLUMNS)) + "|")
    for kind in dict.fromkeys(p.category for p in prompts):
        print(row(f"Spec-Bench {kind}", counts[kind], by_kind[kind], medusa, eagle))
    print(row("Spec-Bench, all", len(prompts), total, medusa, eagle))
    fraction = 0.5 if args.smoke else args.valid_fraction
    for folder in args.data:
        sums: dict = defaultdict(int)
        seen = 0
        for shard in read_shards(folder):
            starts = shard["starts"].tolist()
            for s, (a, b) in enumerate(zip(starts, starts[1:])):
                if seen < args.sequences and is_validation(shard["prompt_ids"][s], fraction):
                    score(engine, medusa, eagle, shard["tokens"][a:b].long(), int(shard["prompt_lens"][s]),
                          shard["hidden"][a:b].float(), sums)
                    seen += 1
        print(row(f"held out of {folder}", seen, sums, medusa, eagle))
    print()
    print("Each share is over all response tokens (a token outside the vocabulary counts as a miss).")
    if widen:
        print()
        print("| Spec-Bench, all: vocabulary | ids | eagle: response tokens in it | eagle top-1 | "
              "medusa: response tokens in it | medusa h1 top-1 |")
        print("|---|---|---|---|---|---|")
        for label in ["own", *sizes]:
            cells = []
            for name in ("eagle", "medusa"):
                if name in widen:
                    cells += [f"{total[f'{name} in {label}'] / max(total['tokens'], 1):.3f}",
                              f"{total[f'{name} {label}'] / max(total['tokens'], 1):.3f}"]
                else:
                    cells += ["–", "–"]
            n = int(next(iter(widen.values()))[label].sum())
            print(f"| {label} | {n} | " + " | ".join(cells) + " |")
        print()
        print("Widened: the head's own ids, then the lowest ids it lacks; top-1 over the target's whole output head "
              "restricted to them.")


if __name__ == "__main__":
    main()
