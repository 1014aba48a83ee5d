"""Whether Medusa-2 (the heads trained together with a LoRA on the target, as the Medusa paper's
second recipe) beats Medusa-1 (heads alone, target frozen: what `speclm heads train --kind medusa`
does and what ships) on this machine. Both arms start from the same Medusa-1 heads and see the
same training sequences of the data folders, in the same order, one sequence a step:

- Medusa-1: the target frozen (its features computed without gradients), the heads trained on them;
- Medusa-2: a LoRA (peft) on every projection of every decoder layer, trained with the heads;
  loss = the heads' loss + `--kl-weight` x KL(original target || tuned target) over the response
  positions (self-distillation: the tuned target is kept near the original one, whose outputs
  the data holds).

Then both are scored on held-out sequences (speclm.heads.train.is_validation), teacher-forced:
each head's top-1 on its own target's features (the tuned target's for Medusa-2), and the tuned
target's greedy agreement with the original's (Medusa-2 would change what the target generates:
a lossy option for a speclm user). Times per arm say what each costs per token here.

Run (DATA, DATA2: the shipped heads' data folders, benchmarks/epyc/heads-train-NOTE.md):
    .venv/bin/python benchmarks/medusa2.py --data DATA --data DATA2 \
        --heads speclm/data/heads/qwen2.5-coder-1.5b/medusa.safetensors --minutes 35 [--sequences 187 --kl-weight 10]
Committed output: benchmarks/epyc/medusa2.txt (AMD EPYC machine; one section per run, its command first).
`--smoke --target FOLDER --heads FILE --data DIR`: the same code path on a tiny model, 2 training
sequences, one torch thread.
"""
from __future__ import annotations

import argparse
import copy
import random
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from speclm.heads import store
from speclm.heads.data import read_shards
from speclm.heads.modules import IGNORE, labels_in_vocab
from speclm.heads.train import is_validation
from speclm.heads.vocab import frozen_parts
from speclm.models.loading import load_model
from speclm.runtime import set_threads

LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def sequences(folders: list[str], fraction: float, max_len: int) -> tuple[list, list]:
    """(train, valid): (tokens (n,), prompt length) of each stored sequence of the folders whose
    prompt ends before max_len - 8, cut to max_len tokens; split by prompt id."""
    train, valid = [], []
    for folder in folders:
        for shard in read_shards(folder):
            starts = shard["starts"].tolist()
            for s, (a, b) in enumerate(zip(starts, starts[1:])):
                prompt = int(shard["prompt_lens"][s])
                if prompt >= max_len - 8 or b - a <= prompt + 2:
                    continue
                item = (shard["tokens"][a:b][:max_len].long(), prompt)
                (valid if is_validation(shard["prompt_ids"][s], fraction) else train).append(item)
    return train, valid


def head_hits(heads, frozen, features: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, sums: list) -> None:
    """Add each head's top-1 hits and counted positions (labels in the vocabulary) to sums[i]."""
    for i, block in enumerate(heads.blocks):
        shift = 2 + i
        if labels.shape[1] <= shift:
            break
        want = labels[:, shift:].masked_fill(~mask[:, :-shift], IGNORE)
        valid = want != IGNORE
        if bool(valid.any()):
            got = frozen.logits(block(features[:, :-shift])).argmax(-1)
            sums[i][0] += int((got[valid] == want[valid]).sum())
            sums[i][1] += int(valid.sum())


def kl(teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(softmax(teacher) || softmax(student)); both (n, V)."""
    return F.kl_div(F.log_softmax(student.float(), -1), F.log_softmax(teacher.float(), -1), log_target=True,
                    reduction="batchmean")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, action="append", help="a data folder (more than once: several)")
    ap.add_argument("--heads", required=True, help="the Medusa-1 heads both arms start from")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--minutes", type=float, default=40.0, help="training time for both arms together")
    ap.add_argument("--sequences", type=int, default=0, help="training sequences at most (0: as many as --minutes allows)")
    ap.add_argument("--valid", type=int, default=40, help="held-out sequences scored")
    ap.add_argument("--max-len", type=int, default=384, help="tokens per sequence at most")
    ap.add_argument("--rank", type=int, default=8, help="LoRA rank")
    ap.add_argument("--lr-heads", type=float, default=3e-4)
    ap.add_argument("--lr-lora", type=float, default=2e-4)
    ap.add_argument("--kl-weight", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    set_threads(1 if args.smoke else None)
    from peft import LoraConfig, get_peft_model

    target = load_model(args.target, quantize="none", progress=False)  # fp32: LoRA trains on float weights
    shipped, _, ids = store.load(args.heads, target)
    frozen = frozen_parts(target, ids)
    vocab_size = target.vocab_size
    train, valid = sequences(args.data, 0.5 if args.smoke else 0.05, args.max_len)
    random.Random(args.seed).shuffle(train)
    valid = valid[: 1 if args.smoke else args.valid]
    if args.smoke or args.sequences:
        train = train[: 2 if args.smoke else args.sequences]

    torch.manual_seed(args.seed)
    model = get_peft_model(target.model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                                                    target_modules=LORA_MODULES))
    one, two = copy.deepcopy(shipped).train(), copy.deepcopy(shipped).train()
    for m in (one, two):
        m.requires_grad_(True)
    opt_one = torch.optim.AdamW(one.parameters(), lr=args.lr_heads, weight_decay=0.0)
    opt_two = torch.optim.AdamW([{"params": two.parameters(), "lr": args.lr_heads},
                                 {"params": [p for p in model.parameters() if p.requires_grad], "lr": args.lr_lora}],
                                weight_decay=0.0)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)

    def batch(tokens: torch.Tensor, prompt: int):
        ids_ = tokens[None]
        labels = labels_in_vocab(ids_, ids, vocab_size)
        mask = torch.zeros_like(ids_, dtype=torch.bool)
        mask[:, prompt - 1:] = True  # positions whose next token the target generated
        return ids_, labels, mask, len(tokens) - prompt + 1  # logits kept: the response positions and the last

    seconds = {"one": 0.0, "two": 0.0}
    seen, steps, began = 0, 0, time.perf_counter()
    bar = tqdm(desc="training both arms", unit="seq", disable=args.smoke)  # stderr; ends on time, not count
    for tokens, prompt in train:
        if time.perf_counter() - began > args.minutes * 60 and steps:
            break
        ids_, labels, mask, keep = batch(tokens, prompt)
        t0 = time.perf_counter()
        with autocast, torch.no_grad(), model.disable_adapter():
            out = model(input_ids=ids_, output_hidden_states=True, logits_to_keep=keep)
        original, teacher = out.hidden_states[-1].float(), out.logits[0, :-1].float()
        with autocast:
            loss_one, _ = one.loss(frozen, labels, original, mask)
        loss_one.backward()
        opt_one.step()
        opt_one.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        with autocast:
            out = model(input_ids=ids_, output_hidden_states=True, logits_to_keep=keep)
            loss_heads, _ = two.loss(frozen, labels, out.hidden_states[-1].float(), mask)
            loss_two = loss_heads + args.kl_weight * kl(teacher, out.logits[0, :-1])
        loss_two.backward()
        opt_two.step()
        opt_two.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        # the original's forward is Medusa-1's feature pass and Medusa-2's teacher: counted in both
        seconds["one"] += t1 - t0
        seconds["two"] += t2 - t0
        seen += len(tokens)
        steps += 1
        bar.update()
    bar.close()

    sums = {name: [[0, 0] for _ in shipped.blocks] for name in ("shipped", "one", "two")}
    agree, positions, divergence = 0, 0, 0.0
    for m in (one, two):
        m.eval()
    with torch.no_grad(), autocast:
        for tokens, prompt in tqdm(valid, desc="scoring", unit="seq", disable=args.smoke):
            ids_, labels, mask, keep = batch(tokens, prompt)
            with model.disable_adapter():
                out = model(input_ids=ids_, output_hidden_states=True, logits_to_keep=keep)
            original, teacher = out.hidden_states[-1].float(), out.logits[0, :-1].float()
            head_hits(shipped, frozen, original, labels, mask, sums["shipped"])
            head_hits(one, frozen, original, labels, mask, sums["one"])
            out = model(input_ids=ids_, output_hidden_states=True, logits_to_keep=keep)
            head_hits(two, frozen, out.hidden_states[-1].float(), labels, mask, sums["two"])
            tuned = out.logits[0, :-1].float()
            agree += int((tuned.argmax(-1) == teacher.argmax(-1)).sum())
            positions += len(teacher)
            divergence += float(kl(teacher, tuned)) * len(teacher)

    heads = len(shipped.blocks)
    print(f"# Medusa-1 against Medusa-2 from {args.heads} on {args.target}: {steps} training sequences "
          f"({seen} tokens) each, {len(valid)} held-out sequences scored; LoRA rank {args.rank} on "
          f"{', '.join(LORA_MODULES)}; lr heads {args.lr_heads}, LoRA {args.lr_lora}; KL weight {args.kl_weight}; "
          f"bf16 autocast, {torch.get_num_threads()} threads")
    print()
    print("| heads | target | " + " | ".join(f"head {i + 1} top-1" for i in range(heads))
          + " | target's greedy token unchanged | training seconds | training tokens/s |")
    print("|---|---|" + "---|" * heads + "---|---|---|")

    def row(name: str, base: str, extra: str, secs: float | None) -> None:
        accs = " | ".join(f"{h / max(n, 1):.3f}" for h, n in sums[name])
        timing = f"{secs:.0f} | {seen / max(secs, 1e-9):.0f}" if secs is not None else "– | –"
        print(f"| {name} | {base} | {accs} | {extra} | {timing} |")

    row("shipped", "original", "1.000", None)
    row("one", "original", "1.000", seconds["one"])
    row("two", "tuned (LoRA)", f"{agree / max(positions, 1):.3f}", seconds["two"])
    print()
    print(f"mean KL(original || tuned) per response position: {divergence / max(positions, 1):.4f}")


if __name__ == "__main__":
    main()
