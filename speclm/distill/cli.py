"""`speclm draft distill` (speclm.cli adds it). Parser only: torch is imported when it runs."""

from __future__ import annotations

import argparse
import json
import sys

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"


def add_distill_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "distill", help="fine-tune a draft on the target's distributions for your prompts (higher acceptance)",
        description="Answer your prompts with the target (greedy) and with the draft (its own samples), read the "
                    "target's distribution at every response token, and train the draft (LoRA or full) to match "
                    "it. The output folder loads as a draft anywhere (--draft DIR). Prompts that overlap the "
                    "evaluation set (Spec-Bench) are refused. Run the same command again to continue.")
    p.add_argument("--target", default=DEFAULT_TARGET, help="the target, the teacher (default %(default)s)")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="the draft to fine-tune (default %(default)s)")
    p.add_argument("--prompts", required=True,
                   help="a JSON-lines file of your prompts (a \"prompt\" string or a \"turns\" list per line), or "
                        "builtin:KIND for speclm's own prompts of one task kind (code, conversation, qa, "
                        "summarization, math, translation, rag) made from this machine's permissively licensed text")
    p.add_argument("--out", required=True, help="the run folder, and the draft (the same folder continues a run)")
    p.add_argument("--max-prompts", type=int, default=200, help="prompts to use, at most (default %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=128,
                   help="tokens per response and per draft sample, at most (default %(default)s)")
    p.add_argument("--max-prompt-tokens", type=int, default=1024,
                   help="longer prompts (in the chat template) are skipped (default %(default)s)")
    p.add_argument("--samples", choices=("both", "target", "draft"), default="both",
                   help="the sequences trained on: the target's greedy responses, the draft's own samples "
                        "(on-policy), or both (default %(default)s)")
    p.add_argument("--quantize", choices=("auto", "int8", "int4", "none"), default="auto",
                   help="the target's weights, the teacher's distributions (default: int8 where speclm's kernels "
                        "run, as it verifies); the draft samples with its default weights beside it")
    p.add_argument("--adapter", choices=("auto", "lora", "full"), default="auto",
                   help="LoRA (peft) or full fine-tuning; auto: full below 200M parameters, else LoRA")
    p.add_argument("--rank", type=int, default=16, help="LoRA's rank (default %(default)s)")
    p.add_argument("--loss", choices=("kl", "tvd"), default="kl",
                   help="forward KL(target || draft) or total-variation distance (default %(default)s)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: LoRA 2e-4, full 2e-5)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per training step (default %(default)s)")
    p.add_argument("--gen-batch-size", type=int, default=8,
                   help="prompts answered at once while building the data (default %(default)s)")
    p.add_argument("--shard-size", type=int, default=32, help="sequences per data file (default %(default)s)")
    p.add_argument("--warmup", type=int, default=10, help="steps of linear warmup (default %(default)s)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (sets the cosine schedule's length)")
    p.add_argument("--epochs", type=float, default=None,
                   help="passes over the training split (sets the schedule's length; default 1 without --steps "
                        "or --minutes)")
    p.add_argument("--minutes", type=float, default=None,
                   help="stop training after this much wall time, with a checkpoint to resume from")
    p.add_argument("--eval-every", type=int, default=25, help="steps between held-out evaluations (default %(default)s)")
    p.add_argument("--save-every", type=int, default=25, help="steps between checkpoints (default %(default)s)")
    p.add_argument("--valid-fraction", type=float, default=0.1,
                   help="the prompts held out to measure acceptance (default %(default)s)")
    p.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                   help="the draft's matrix products while training (default: bf16 where the CPU has AVX-512 BF16 "
                        "or AMX, else fp32)")
    p.add_argument("--seed", type=int, default=0, help="prompt order, samples, initialisation (default %(default)s)")
    p.add_argument("--no-resume", dest="resume", action="store_false",
                   help="train from the start even where --out holds a checkpoint (the data is kept)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the usable cores)")
    p.set_defaults(draft_command=run_distill)
    return p


def run_distill(args) -> int:
    from speclm.distill.run import distill

    epochs = args.epochs if args.epochs is not None or args.steps is not None or args.minutes is not None else 1.0
    summary = distill(args.target, args.draft, args.prompts, args.out, max_prompts=args.max_prompts,
                      max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
                      samples=args.samples, quantize=args.quantize, gen_batch_size=args.gen_batch_size,
                      shard_size=args.shard_size, seed=args.seed, progress=sys.stderr.isatty(),
                      command=["speclm"] + sys.argv[1:], adapter=args.adapter, rank=args.rank, loss=args.loss,
                      lr=args.lr, batch_size=args.batch_size, warmup=args.warmup, steps=args.steps, epochs=epochs,
                      minutes=args.minutes, eval_every=args.eval_every, save_every=args.save_every,
                      valid_fraction=args.valid_fraction, precision=args.precision, resume=args.resume)
    print(json.dumps(summary, indent=1))
    return 0
