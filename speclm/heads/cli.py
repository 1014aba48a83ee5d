"""`speclm heads ...` subcommands (speclm.cli adds them): `data` builds the heads' training data, `train`
trains heads on it. Parsers only: torch is imported when a command runs."""

from __future__ import annotations

import argparse
import sys

DEFAULT_TARGET = "qwen2.5-coder-1.5b"  # speclm.heads.data's (not imported here: no torch at parse time)
KINDS = ("medusa", "eagle")


def add_data_parser(sub) -> argparse.ArgumentParser:
    """Add `data` to an argparse subparsers object; returns its parser (run it with `run_data`)."""
    d = sub.add_parser(
        "data", help="build draft-head training data: the target's greedy responses and hidden states",
        description="Collect prompts from this machine's permissively licensed text (the Python standard "
                    "library, installed MIT/BSD/Apache/PSF packages, templates), leave out any that overlap "
                    "Spec-Bench, decode each greedily with the target and store tokens and its hidden states "
                    "in safetensors shards. Run the same command again to continue an interrupted build.")
    d.add_argument("--target", default=DEFAULT_TARGET, help="target model (default %(default)s; int8 weights)")
    d.add_argument("--out", required=True, help="output folder (the same folder continues a build)")
    d.add_argument("--prompts", type=int, default=None, help="most prompts to use (default: all the sources give)")
    d.add_argument("--max-new-tokens", type=int, default=256, help="response tokens per prompt, at most (default %(default)s)")
    d.add_argument("--max-prompt-tokens", type=int, default=512,
                   help="longer prompts (in the chat template) are skipped (default %(default)s)")
    d.add_argument("--batch-size", type=int, default=16, help="prompts decoding at once (default %(default)s)")
    d.add_argument("--shard-size", type=int, default=64, help="sequences per shard file (default %(default)s)")
    d.add_argument("--source", choices=("library", "assistant"), default="library",
                   help="library: prompts made from this machine's permissively licensed text; assistant: "
                        "general-domain requests the target writes itself from speclm's seed requests "
                        "(speclm.heads.assistant) (default %(default)s)")
    d.add_argument("--seed", type=int, default=0, help="which prompts, in which order (default %(default)s)")
    d.add_argument("--minutes", type=float, default=None,
                   help="stop after the shard in progress once this many minutes have passed (run again to continue)")
    d.add_argument("--threads", type=int, default=None, help="torch threads (default: the usable cores)")
    d.set_defaults(heads_command=run_data)
    return d


def run_data(args) -> int:
    """Run `speclm heads data` with parsed arguments; prints where the build stands. Bad input is a
    UsageError (speclm.cli prints it on one line, exit status 2)."""
    from speclm.heads.data import build
    from speclm.runtime import set_threads

    set_threads(args.threads)
    manifest = build(args.target, args.out, prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                     max_prompt_tokens=args.max_prompt_tokens, batch_size=args.batch_size,
                     shard_size=args.shard_size, seed=args.seed, source=args.source, progress=sys.stderr.isatty(), minutes=args.minutes)
    stored = sum(s["sequences"] for s in manifest["shards"])
    tokens = sum(s["tokens"] for s in manifest["shards"])
    print(f"{args.out}: {stored} of {manifest['prompts']} sequences ({tokens} tokens) in {len(manifest['shards'])} "
          f"shard(s); {manifest['excluded_eval_overlap']} prompts left out for overlapping Spec-Bench")
    if stored < manifest["prompts"]:
        print("stopped early: run the same command again to continue")
    return 0


def _layer_list(text: str) -> list[int]:
    try:
        layers = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected decoder layer indices such as 2,14, got {text!r}") from None
    if not layers:
        raise argparse.ArgumentTypeError("expected at least one decoder layer index")
    return layers


def add_layers_parser(sub) -> argparse.ArgumentParser:
    """`speclm heads layers`: more of the target's layers for a built data folder."""
    d = sub.add_parser(
        "layers", help="add the target's hidden states at more layers to a data folder (for --fuse-layers heads)",
        description="Feed each stored sequence through the target again (one teacher-forced prefill, no "
                    "generation) and store its hidden states after the given decoder layers beside the "
                    "shards. EAGLE heads trained with --fuse-layers read them. Run the same command again "
                    "to continue.")
    d.add_argument("--data", required=True, help="a data folder built by `speclm heads data`")
    d.add_argument("--layers", required=True, type=_layer_list,
                   help="decoder layer indices, comma-separated (EAGLE-3 reads a low and a middle one: 2,14 on a "
                        "28-layer target)")
    d.add_argument("--minutes", type=float, default=None,
                   help="stop after the shard in progress once this many minutes have passed (run again to continue)")
    d.add_argument("--threads", type=int, default=None, help="torch threads (default: the usable cores)")
    d.set_defaults(heads_command=run_layers)
    return d


def run_layers(args) -> int:
    from speclm.heads.data import add_layers
    from speclm.runtime import set_threads

    set_threads(args.threads)
    manifest = add_layers(args.data, args.layers, progress=sys.stderr.isatty(), minutes=args.minutes)
    done, total = len(manifest["layers"]["shards"]), len(manifest["shards"])
    print(f"{args.data}: layers {','.join(map(str, manifest['layers']['layers']))} stored for {done} of {total} shard(s)")
    if done < total:
        print("stopped early: run the same command again to continue")
    return 0


def add_train_parser(sub) -> argparse.ArgumentParser:
    """`speclm heads train` on an argparse subparsers object."""
    p = sub.add_parser("train", help="train Medusa or EAGLE heads on a data folder of the target's features")
    p.add_argument("--data", required=True, action="append",
                   help="a data folder (speclm heads data); give it several times to train on several folders together")
    p.add_argument("--kind", required=True, choices=KINDS, help="medusa: K residual heads; eagle: one decoder layer")
    p.add_argument("--out", required=True, help="the run folder: checkpoint, metrics, plots, heads.safetensors")
    p.add_argument("--target", default=None, help="the target model (default: the one named in the data's manifest)")
    p.add_argument("--init", default=None,
                   help="a heads file (.safetensors) of the same kind and shape to start from, such as an earlier "
                        "run's heads.safetensors (default: a fresh initialisation)")
    p.add_argument("--vocab", type=int, default=16384, help="the heads' vocabulary: the most frequent response tokens (default %(default)s)")
    p.add_argument("--heads", type=int, default=4, help="medusa: heads, the deepest draft (default %(default)s)")
    p.add_argument("--intermediate", type=int, default=2048, help="eagle: its MLP's width (default %(default)s)")
    p.add_argument("--unroll", type=int, default=1,
                   help="eagle: levels trained with the head's own predictions fed back, as drafting feeds them "
                        "(training-time test; default %(default)s: the real features alone)")
    p.add_argument("--fuse-layers", type=_layer_list, default=None,
                   help="eagle: decoder layers whose hidden states join the final feature as the head's input "
                        "(EAGLE-3's fused features, e.g. 2,14; the data needs them: speclm heads layers)")
    p.add_argument("--chunk", type=int, default=256, help="tokens per training window (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per step and process (default %(default)s)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: medusa 1e-3, eagle 3e-4)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW's (default %(default)s)")
    p.add_argument("--warmup", type=int, default=50, help="steps of linear warmup (default %(default)s)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (sets the cosine schedule's length)")
    p.add_argument("--epochs", type=float, default=None, help="passes over the training split (sets the schedule's length)")
    p.add_argument("--minutes", type=float, default=None,
                   help="stop after this much wall time, with a checkpoint to resume from")
    p.add_argument("--eval-every", type=int, default=100, help="steps between validations (default %(default)s)")
    p.add_argument("--save-every", type=int, default=200, help="steps between checkpoints (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="initialisation, data order and noise (default %(default)s)")
    p.add_argument("--valid-fraction", type=float, default=0.05,
                   help="the prompts held out for validation (default %(default)s)")
    p.add_argument("--no-resume", dest="resume", action="store_false",
                   help="start over even where --out holds a checkpoint")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the usable cores)")
    p.add_argument("--mixed-precision", choices=("no", "bf16"), default="no",
                   help="bf16 autocast (GPUs; default %(default)s)")
    p.add_argument("--positions", choices=("response", "all"), default=None,
                   help="which positions train: response (those whose next token the target generated) or all "
                        "(prompt tokens too); default all for eagle (its targets are the target's own features), "
                        "response for medusa")
    p.set_defaults(heads_command=run_train)
    return p


def run_train(args) -> int:
    from speclm.heads.train import run

    return run(args)
