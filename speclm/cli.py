"""The `speclm` command line. Bad input: one line on stderr, exit status 2, no traceback."""

from __future__ import annotations

import argparse
import json
import os
import sys

from speclm.errors import PullError, SpeclmError, StoreError, UsageError
from speclm import defaults
from speclm.defaults import PREFIX_CACHE_TOKENS
from speclm.methods import DRAFT_MODEL, HEADS, NAMES as METHODS, REGISTRY, help_text, needing, taking, using
from speclm.runtime import (DRAFT_NONE_HELP, NO_DRAFT, QUANTIZE_CHOICES, QUANTIZE_HELP, QUANTIZE_MODES, family_draft, keep_freed_memory, set_threads,
                            weights_for)

DEMO_PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a short docstring and an example."


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of usage + message
        raise UsageError(f"{self.prog}: {message}")


DRAFT_QUANTIZE_HELP = ("the draft model's weights (default: int4 beside an int8 target where speclm's kernels run, "
                       "else the target's): int4 halves a draft step's bytes on CPU (what is proposed changes, never "
                       "the output)")


PREFIX_CACHE_HELP = ("keys and values of recent prompts each model keeps, so a prompt that begins like one of them "
                     "(a chat template's system turn, shared examples) skips that part of its prefill; on int8/int4 "
                     "CPU weights, where the output stays bit-identical (default %(default)s tokens; 0: off)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="speclm", description="Lossless speculative decoding for transformers models.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text for one prompt or a file of prompts")
    g.add_argument("--target", help="catalog name, hub id, model folder or .gguf file (required unless --verifier)")
    g.add_argument("--verifier", metavar="URL", help="a `speclm serve` whose model is the target: drafts here with "
                   "--draft (and --method draft, pld or draft+pld; default draft), the server verifies each round")
    g.add_argument("--api-key", default=None, help="--verifier's key (default: env SPECLM_API_KEY)")
    g.add_argument("--method", choices=list(METHODS), default=None, help="default auto (with --verifier: draft); " + help_text())
    g.add_argument("--draft", help=f"draft model for --method {', '.join(using(DRAFT_MODEL))} (same tokenizer as the target)"
                   + DRAFT_NONE_HELP)
    _add_decoding_options(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", help='JSON lines with a "prompt" string (or Spec-Bench "turns")')
    g.add_argument("--batch-size", type=int, default=1, help="prompts decoded together (default 1)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt per line on stdout")
    g.add_argument("--quantize", choices=QUANTIZE_CHOICES, default="auto", help=QUANTIZE_HELP)
    g.add_argument("--draft-quantize", choices=QUANTIZE_MODES, default=None, help=DRAFT_QUANTIZE_HELP)
    g.add_argument("--prefix-cache", type=int, default=PREFIX_CACHE_TOKENS, metavar="TOKENS", help=PREFIX_CACHE_HELP)
    shape = g.add_mutually_exclusive_group()  # the output's constraint (speclm.constraint; docs/constraints.md)
    shape.add_argument("--json-schema", metavar="FILE", help="the output is JSON valid under this JSON schema (every method)")
    shape.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    shape.add_argument("--regex", metavar="RE", help="the whole output matches this regular expression")
    shape.add_argument("--grammar", metavar="FILE", help="the output follows this grammar (Lark, llguidance's dialect, "
                       "or llama.cpp's GBNF)")

    b = sub.add_parser("bench", help="benchmark methods side by side (speclm and transformers) and write a report")
    b.add_argument("--target", help="catalog name, hub id, model folder or .gguf file")
    b.add_argument("--draft", help="draft model for draft, draft+pld, hf-assisted, openvino-draft and auto; "
                   f"{NO_DRAFT}: none, as when not given (bench never takes the catalog's draft by itself)")
    b.add_argument("--methods", default="none,draft,pld,hf",
                   help="comma list: none, draft[:k=N,confidence=P,alternatives=P,vocab=N,tree=chain|auto|FILE], pld[:k=N,ngram_max=N,ngram_min=N], draft+pld[:draft's and pld's options], medusa[:k=N,tree=auto|FILE,heads=FILE], eagle[:k=N,heads=FILE], eagle+pld[:eagle's and pld's options], lookahead[:w=N,n=N,g=N], lookahead+pld[:lookahead's and pld's options], self[:k=N,layers=auto|all|N|skip:I-J+K,self_weights=target|int4,tree=chain|auto|FILE,vocab=N], hf, hf-assisted[:k=N], hf-pld[:k=N]; other engines (pip install 'speclm[peers]'): "
                        "llama.cpp, llama.cpp-pld[:k=N,ngram_max=N], openvino, openvino-draft[:k=N], openvino-pld[:k=N,ngram_max=N]")
    b.add_argument("--dataset", default="spec-bench", help="'spec-bench' (shipped) or a JSON-lines file")
    b.add_argument("--categories", help="comma list of categories (default: all)")
    b.add_argument("--per-category", type=int, default=None, help="prompts per category (default: all)")
    b.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt (default %(default)s)")
    b.add_argument("--temperature", type=float, default=0.0,
                   help="0 (default): greedy, every output checked against none's; > 0: sampling")
    b.add_argument("--seed", type=int, default=0, help="sampling seed; repeat r of every prompt samples with seed + r (default %(default)s)")
    b.add_argument("--repeats", type=int, default=1, help="runs of each method on each prompt (default %(default)s)")
    b.add_argument("--chat", action="store_true", help="apply the target's chat template")
    b.add_argument("--cost-repeats", type=int, default=defaults.COST_REPEATS,
                   help="samples per point of the cost model (default %(default)s; 0: skip it)")
    b.add_argument("--quantize", choices=QUANTIZE_CHOICES, default="auto",
                   help="weights of every method without its own quantize= option: " + QUANTIZE_HELP.removeprefix("the target's weights. "))
    b.add_argument("--draft-quantize", choices=QUANTIZE_MODES, default=None, help=DRAFT_QUANTIZE_HELP)
    b.add_argument("--prefix-cache", type=int, default=PREFIX_CACHE_TOKENS, metavar="TOKENS",
                   help=PREFIX_CACHE_HELP + "; each method its own, empty at the first prompt")
    b.add_argument("--threads", type=int, default=None, help="torch threads (default: the usable cores)")
    b.add_argument("--out", help="output folder: results.json, report.md, plots")
    b.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), help="print two runs side by side and exit")

    d = sub.add_parser("demo", help="speculative vs plain decoding with the default Qwen pair, one prompt")
    d.add_argument("--target", default="qwen2.5-coder-1.5b", help="target model (default %(default)s)")
    d.add_argument("--draft", default="qwen2.5-coder-0.5b", help="draft model (default %(default)s)")
    d.add_argument("--prompt", default=DEMO_PROMPT, help="the prompt (default: a short Python task)")
    d.add_argument("--k", type=int, default=None, help=defaults.k_help(draft_model_only=True))
    d.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated (default %(default)s)")
    d.add_argument("--quantize", choices=QUANTIZE_CHOICES, default="auto", help=QUANTIZE_HELP)
    d.add_argument("--draft-quantize", choices=QUANTIZE_MODES, default=None, help=DRAFT_QUANTIZE_HELP)
    d.add_argument("--threads", type=int, default=None, help="torch threads (default: the usable cores)")

    from speclm.serve.options import add_serve_parser

    add_serve_parser(sub, _add_draft_options, PREFIX_CACHE_HELP, DRAFT_QUANTIZE_HELP)

    bs = sub.add_parser("bench-serve", help="load benchmark of a running `speclm serve`: throughput, TTFT and "
                        "inter-token latency by concurrency and speculation mode")
    bs.add_argument("--url", required=True, help="the server, on this machine (e.g. http://127.0.0.1:8000)")
    bs.add_argument("--api-key", default=None, help="the server's key (default: env SPECLM_API_KEY)")
    bs.add_argument("--concurrency", default="1,2,4,8", help="comma list of requests in flight at once "
                    "(default %(default)s)")
    bs.add_argument("--modes", default=None, help="comma list of off (plain decoding), on (the server's method, its "
                    "k fixed), adaptive (the server's default), a method M (that method under the server's "
                    "policy; M:k=N: k fixed at N); default off,on,adaptive, those the server can run")
    bs.add_argument("--dataset", default="spec-bench", help="'spec-bench' (shipped) or a JSON-lines file")
    bs.add_argument("--categories", help="comma list of categories (default: all)")
    bs.add_argument("--per-category", type=int, default=None, help="prompts per category (default: all)")
    bs.add_argument("--requests", type=int, default=16, help="requests per cell, the same prompts in every cell, "
                    "the categories in turn (default %(default)s)")
    bs.add_argument("--max-tokens", type=int, default=128, help="max_tokens of each request (default %(default)s)")
    bs.add_argument("--time-limit", type=float, default=300.0, help="seconds per cell after which no request "
                    "starts (default %(default)g)")
    bs.add_argument("--out", required=True, help="output folder: results.json, report.md, plots")

    t = sub.add_parser("tune", help="measure what --method auto plans by on this machine, for a target (and draft), "
                       "once: kept under the cache folder and read by generate, bench and serve")
    t.add_argument("--target", required=True, help="catalog name, hub id, model folder or .gguf file")
    t.add_argument("--draft", help="the draft model auto may draft with (same tokenizer as the target)" + DRAFT_NONE_HELP)
    t.add_argument("--heads", help="heads file for the head methods (default: those shipped for the target)")
    t.add_argument("--quantize", choices=QUANTIZE_CHOICES, default="auto", help=QUANTIZE_HELP)
    t.add_argument("--draft-quantize", choices=QUANTIZE_MODES, default=None, help=DRAFT_QUANTIZE_HELP)
    t.add_argument("--show", action="store_true", help="print the stored profile and the predicted speedup of each "
                   "method for short and long prompts at batch sizes 1, 2, 4 and 8 (measures nothing)")
    t.add_argument("--threads", type=int, default=None, help="torch threads (default: the usable cores)")

    h = sub.add_parser("heads", help="Medusa and EAGLE heads for a target: build their training data, train them")
    hsub = h.add_subparsers(dest="heads_name", required=True, parser_class=_Parser)
    from speclm.heads.cli import add_data_parser, add_layers_parser, add_train_parser

    add_data_parser(hsub)
    add_layers_parser(hsub)
    add_train_parser(hsub)

    dr = sub.add_parser("draft", help="draft models: distill one on the target for your prompts")
    dsub = dr.add_subparsers(dest="draft_name", required=True, parser_class=_Parser)
    from speclm.distill.cli import add_distill_parser

    add_distill_parser(dsub)

    m = sub.add_parser("models", help="the model catalog and cache")
    msub = m.add_subparsers(dest="models_command", required=True, parser_class=_Parser)
    msub.add_parser("list", help="catalog models and what is cached")
    pull = msub.add_parser("pull", help="download, verify and convert a catalog model")
    pull.add_argument("name", help="a catalog name (speclm models list)")
    pull.add_argument("--force", action="store_true", help="pull again even if cached")
    rm = msub.add_parser("rm", help="delete a cached model and its quantized weights")
    rm.add_argument("name", help="a cached model's name (speclm models list)")
    verify = msub.add_parser("verify", help="check a cached model's weights against the sha256 recorded at conversion")
    verify.add_argument("name", help="a cached model's name (speclm models list)")
    return p


def _add_decoding_options(g: argparse.ArgumentParser) -> None:
    _add_draft_options(g)
    g.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the smallest set of tokens "
                   "whose probability reaches this (default 1: all)")
    g.add_argument("--top-k", type=int, default=0, help="0 (default): no top-k filter")
    g.add_argument("--seed", type=int, default=None, help="row i samples with seed + i")
    g.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt at most (default %(default)s)")
    g.add_argument("--chat", action="store_true", help="apply the target's chat template (one user message)")
    g.add_argument("--threads", type=int, default=None, help="torch threads (default: the usable cores)")


def _add_draft_options(g: argparse.ArgumentParser) -> None:
    """How each method proposes (generate's and serve's)."""
    g.add_argument("--k", type=int, default=None, help=defaults.k_help())
    g.add_argument("--confidence", type=float, default=None,
                   help="draft: stop a round's drafting after a token the draft gave less probability than this "
                        f"(0: never; default {defaults.CONFIDENCE_INT4:g} with an int4 draft, else 0)")
    g.add_argument("--alternatives", type=float, default=None,
                   help="draft: verify the draft's second choice beside each drafted token it gave less probability "
                        f"than this (a tree whose extra branches are leaves; 0: never; default {defaults.ALTERNATIVES_INT4:g} "
                        "with an int4 draft, else 0)")
    g.add_argument("--tree", default=None, metavar="{chain,auto,FILE}",
                   help=f"{', '.join(n for n in taking('tree') if REGISTRY[n].needs != HEADS)}: the draft's shape each round: chain (one candidate per position), auto (a "
                        "tree grown from the draft's probabilities, its size chosen from this machine's measured "
                        "verification cost) or a JSON file of root paths of ranks such as [[0],[1],[0,0]] "
                        f"(default {defaults.TREE}); {', '.join(n for n in taking('tree') if REGISTRY[n].needs == HEADS)}: auto, static (the tuned tree shipped beside its heads, cut each "
                        "round to what pays on this machine; the default where there is one, else auto) or a FILE "
                        "(verified whole)")
    g.add_argument("--heads", default=None, metavar="FILE",
                   help=f"{', '.join(taking('heads'))}: a trained heads file (speclm heads train); default: the heads shipped "
                        "for the target")
    g.add_argument("--acceptance", choices=("exact", "typical"), default="exact",
                   help=f"{', '.join(taking('acceptance'))}: exact (default: lossless) or typical, Medusa's typical acceptance: LOSSY at "
                        "temperature > 0, its output no longer follows the target's distribution")
    g.add_argument("--draft-vocab", type=int, default=None,
                   help=f"{', '.join(taking('draft_vocab'))}: score only this many lowest token ids, plus the prompt's "
                        f"tokens and EOS (0: the whole vocabulary; default {defaults.DRAFT_VOCAB}, self's "
                        f"{defaults.SELF_VOCAB})")
    g.add_argument("--ngram-max", type=int, default=defaults.NGRAM_MAX,
                   help=f"{', '.join(taking('ngram_max'))}: longest n-gram matched (default %(default)s)")
    g.add_argument("--ngram-min", type=int, default=None,
                   help=f"{', '.join(taking('ngram_min'))}: shortest n-gram matched (default "
                        f"{', '.join(f'{n} {REGISTRY[n].ngram_min}' for n in taking('ngram_min'))})")
    g.add_argument("--lookahead", type=_lookahead_shape, default=None, metavar="W,N,G",
                   help=f"{', '.join(taking('lookahead'))}: the lookahead window W, n-gram size N and n-grams verified "
                        f"per round G (default {defaults.LOOKAHEAD_WINDOW},{defaults.LOOKAHEAD_NGRAM},"
                        f"{defaults.LOOKAHEAD_GUESSES}); a target forward reads up to 1 + W (N - 1) + G (N - 1) tokens")
    g.add_argument("--layers", default=None, metavar="auto|all|N|skip:I,J-K",
                   help=f"{', '.join(taking('layers'))}: the target's layers that draft: auto (default: chosen by a "
                        "calibration on this machine, cached), N (the first N layers, then the final norm and head), "
                        "skip:I,J-K (every layer but these) or all (with --self-weights int4)")
    g.add_argument("--self-weights", choices=("target", "int4"), default=None,
                   help=f"{', '.join(taking('self_weights'))}: the weights the drafting layers run on: target (its own) or "
                        f"int4 (a copy of those layers and the head, made once; its size is printed) (default "
                        f"{defaults.SELF_WEIGHTS})")
    g.add_argument("--draft-prompt-ratio", type=float, default=defaults.DRAFT_PROMPT_RATIO,
                   help="draft+pld: prompt lookup alone (no draft model) for prompts longer than this times "
                        "--max-new-tokens (default %(default)g; 0: never the model, inf: always)")


def _lookahead_shape(text: str) -> tuple[int, int, int]:
    """--lookahead's W,N,G (GenerationOptions checks their ranges)."""
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().lstrip("-").isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"expected three integers W,N,G, got '{text}'")
    return tuple(int(p) for p in parts)  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.command == "models":
            return _models(args)
        _quiet_transformers()
        if hasattr(args, "threads"):
            set_threads(args.threads)
            keep_freed_memory()
        if args.command == "generate":
            return _generate(args)
        if args.command == "bench":
            return _bench(args)
        if args.command == "serve":
            from speclm.serve.main import serve

            return serve(args, progress=_progress())
        if args.command == "heads":
            return args.heads_command(args)
        if hasattr(args, "draft_command"):  # speclm draft ...
            return args.draft_command(args)
        if args.command == "tune":
            return _tune(args)
        if args.command == "bench-serve":
            from speclm.serve.bench import bench_serve

            return bench_serve(args, sys.argv[1:] if argv is None else list(argv), progress=_progress())
        return _demo(args)
    except UsageError as exc:
        print(f"speclm: error: {exc}", file=sys.stderr)
        return 2
    except SpeclmError as exc:
        print(f"speclm: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("speclm: interrupted", file=sys.stderr)
        return 130


def _tune(args) -> int:
    from speclm import tune
    from speclm.engine import GenerationOptions, SpecEngine
    from speclm.models.loading import check_model_name, load_model

    opts = GenerationOptions(method="auto", heads=args.heads)
    check_model_name(args.target)
    args.draft = family_draft(args.target, "auto", args.draft)
    if args.draft:
        check_model_name(args.draft)
    from speclm.quant import kernels

    race = args.quantize == "auto" and kernels.compiled() is not None  # auto's weights are chosen here
    modes = tune.WEIGHT_MODES if race else (weights_for(args.quantize, args.draft_quantize)[0],)
    engines, drafts = {}, {}
    for mode in modes:
        try:
            target = load_model(args.target, quantize=mode, progress=_progress())
        except UsageError as exc:
            if mode == modes[0]:
                raise
            print(f"speclm: --quantize auto cannot choose {mode} for {args.target}: {exc}", file=sys.stderr)
            continue
        draft_mode = weights_for(mode, args.draft_quantize)[1]
        if args.draft and draft_mode not in drafts:
            drafts[draft_mode] = load_model(args.draft, quantize=draft_mode, progress=_progress())
        engines[mode] = SpecEngine(target, draft=drafts.get(draft_mode))
    for mode, engine in engines.items():
        if not args.show:
            profile = tune.measure(engine, opts, progress=_progress())
            print(f"speclm: profile of {profile.key} measured in {profile.seconds:.0f} s: {tune.path_of(engine, opts)}",
                  file=sys.stderr)
        if args.show and len(engines) > 1 and tune.load(engine, opts) is None:
            continue  # a mode tune never measured here
        print(tune.show(engine, opts))
    if race and len(engines) > 1:
        if args.show:
            choice = tune.chosen_weights(args.target, args.draft)
        else:
            choice = tune.choose_weights(args.target, args.draft, tune.race(engines, opts, progress=_progress()))
        print(f"\n--quantize auto: {choice.describe() if choice else 'int8 weights (no race measured here)'}")
    elif race:
        print(f"\n--quantize auto: {modes[0]} weights (the target has no GGUF blocks speclm's kernels read)")
    return 0


def _progress() -> bool:
    """Progress bars (a pull's, a conversion's, bench's) on a terminal only: in a log or a pipe
    they are noise around the one line an error prints."""
    return sys.stderr.isatty()


def _quiet_transformers() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import huggingface_hub
    import transformers

    transformers.logging.set_verbosity_error()
    huggingface_hub.utils.logging.set_verbosity_error()  # no retry chatter before our one-line error


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def _models(args) -> int:
    from speclm.catalog import CATALOG
    from speclm.models import store

    if args.models_command == "list":
        from speclm.models import qcache

        def on_disk(folder) -> str:  # the folder and its quantized weights
            return _gb(store.disk_bytes(folder) + sum(store.disk_bytes(p) for p in qcache.files_for(folder)))

        cached = store.cached_models()
        print(f"{'name':<22} {'on disk':<9} description")
        for name, entry in CATALOG.items():
            print(f"{name:<22} {on_disk(cached[name]) if name in cached else 'no':<9} {entry.description}")
        for name, folder in cached.items():
            if name not in CATALOG:
                print(f"{name:<22} {on_disk(folder):<9} converted from a .gguf file")
        from speclm.models import adapters

        for folder, record in adapters.registered().items():
            print(f"{str(folder):<22} {on_disk(folder):<9} {record.get('adapter', '?')} draft distilled from "
                  f"{record['base']} for {record.get('target', '?')} (`speclm draft distill`)")
        print(f"cache: {store.models_dir()} (sizes include quantized weights, {qcache.cache_dir()})")
        return 0
    if args.models_command == "rm":
        for path in store.remove(args.name):
            print(f"removed {path}")
        return 0
    if args.models_command == "verify":
        if args.name not in CATALOG and args.name not in store.cached_models():
            raise UsageError(f"'{args.name}' is neither in the catalog nor in the cache ({store.models_dir()})")
        try:
            print(store.verify(args.name))
        except StoreError as exc:
            print(f"speclm: verify failed: {exc}", file=sys.stderr)
            return 1
        return 0
    if args.name not in CATALOG:
        raise UsageError(f"'{args.name}' is not in the catalog ({', '.join(CATALOG)})")
    try:
        path = store.pull(args.name, force=args.force, progress=_progress())
    except PullError as exc:
        print(f"speclm: pull failed: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def _generate(args) -> int:
    from speclm.engine import GenerationOptions, SpecEngine
    from speclm.models.loading import check_model_name, load_model
    from speclm.prompts import read_prompt_file

    if args.method is None:
        from speclm.remote import METHOD

        args.method = METHOD if args.verifier else "auto"
    opts = GenerationOptions(
        method=args.method, k=args.k, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=tuple(args.stop), chat=args.chat,
        ngram_max=args.ngram_max, ngram_min=args.ngram_min, confidence=args.confidence,
        alternatives=args.alternatives, draft_vocab=args.draft_vocab, draft_prompt_ratio=args.draft_prompt_ratio,
        tree=args.tree, heads=args.heads, acceptance=args.acceptance, lookahead=args.lookahead, layers=args.layers,
        self_weights=args.self_weights, constraint=_constraint(args),
    )
    if args.batch_size < 1:
        raise UsageError(f"batch-size must be >= 1, got {args.batch_size}")
    if args.prefix_cache < 0:
        raise UsageError(f"prefix-cache must be >= 0 tokens, got {args.prefix_cache}")
    if opts.spec.needs == DRAFT_MODEL and args.draft in (None, NO_DRAFT):  # never the catalog's: only auto takes it
        raise UsageError(f"--method {args.method} needs --draft MODEL")
    if args.verifier:
        return _generate_remote(args, opts)
    if args.target is None:
        raise UsageError("--target MODEL is required (or --verifier URL: a server's model verifies)")
    args.draft = family_draft(args.target, args.method, args.draft)
    uses_draft = bool(args.draft) and args.method in using(DRAFT_MODEL)
    prompts = [args.prompt] if args.prompt is not None else read_prompt_file(args.prompt_file)
    check_model_name(args.target)  # fail fast, before minutes of loading
    if uses_draft:
        check_model_name(args.draft)
    quantize, draft_quantize = weights_for(args.quantize, args.draft_quantize, args.target, args.draft)
    target = load_model(args.target, quantize=quantize, progress=_progress())
    draft = load_model(args.draft, quantize=draft_quantize, progress=_progress()) if uses_draft else None
    engine = SpecEngine(target, draft=draft, prefix_cache=args.prefix_cache)
    encoded = engine.encode(prompts, opts.chat)  # every prompt is checked before any output is written
    weights = _weights_note(target, draft)

    if not args.json and args.batch_size == 1:
        for i, ids in enumerate(encoded):
            stream = engine.stream(ids, **_as_kwargs(opts, seed_offset=i))
            for delta in stream:
                print(delta, end="", flush=True)
            print()
            _print_stats(stream.completion.stats, weights, sys.stderr)
        return 0
    # up to batch-size prompts decode together; as one finishes the next joins; printed in order
    for r in engine.completions(encoded, args.batch_size, **_as_kwargs(opts, seed_offset=0)):
        if args.json:
            print(json.dumps(r.to_dict(), ensure_ascii=False), flush=True)
        else:
            print(r.text)
            _print_stats(r.stats, weights, sys.stderr)
    return 0


def _generate_remote(args, opts) -> int:
    """`generate --verifier URL`: the draft (and the proposer) here, the target on the server."""
    import secrets
    from dataclasses import replace

    from speclm.engine import SpecEngine
    from speclm.models.loading import check_model_name, load_model
    from speclm.prompts import read_prompt_file
    from speclm.remote import Verifier, remote_stream
    from speclm.text import final_text

    for flag, given in (("--target", args.target is not None), ("--batch-size", args.batch_size != 1),
                        ("--quantize", args.quantize != "auto"), ("--tree", args.tree is not None),
                        ("--alternatives", args.alternatives is not None),
                        ("--acceptance", args.acceptance not in (None, "exact")),
                        ("a constraint", opts.constraint is not None)):
        if given:
            raise UsageError(f"{flag}: not with --verifier (the server's model is the target; a round verifies "
                             "one prompt's chain, exactly)")
    if args.draft in (None, NO_DRAFT):  # _generate refused a method that needs one; pld needs it too here
        raise UsageError("--verifier needs --draft MODEL (its tokenizer reads the prompts; it drafts with "
                         "--method draft or draft+pld)")
    prompts = [args.prompt] if args.prompt is not None else read_prompt_file(args.prompt_file)
    check_model_name(args.draft)
    verifier = Verifier(args.verifier, args.api_key if args.api_key is not None else os.environ.get("SPECLM_API_KEY"))
    _, draft_quantize = weights_for("auto", args.draft_quantize)
    draft = load_model(args.draft, quantize=draft_quantize, progress=_progress())
    model = verifier.check(draft.tokenizer)  # the first call: a speclm server, the draft's tokenizer
    engine = SpecEngine(draft, draft=draft, prefix_cache=args.prefix_cache)  # the draft's proposer builder
    encoded = engine.encode(prompts, opts.chat)
    seed = opts.seed if opts.seed is not None else secrets.randbits(62)
    for i, ids in enumerate(encoded):
        stream = remote_stream(engine, verifier, ids, opts if opts.seed is None else replace(opts, seed=opts.seed + i),
                               seed + i)
        while True:
            try:
                delta = next(stream)
            except StopIteration as end:
                request, remote = end.value
                break
            if not args.json:
                print(delta, end="", flush=True)
        s = request.stats
        if args.json:
            tok = draft.tokenizer
            out = {"prompt_index": i, "text": final_text(tok, request.generated, opts.stop), "token_ids": request.generated,
                   "finish_reason": request.finish_reason, "stats": s.to_dict(), "verifier": model["id"],
                   "draft_lengths": list(remote.lengths)}
            print(json.dumps(out, ensure_ascii=False), flush=True)
        else:
            print()
            print(f"[{s.new_tokens} tokens, {s.tokens_per_second:.2f} tok/s, verified by {model['id']} at {args.verifier}: "
                  f"{s.round_trips} round trips ({s.round_trip_seconds:.2f}s), {s.target_forwards} target forwards, "
                  f"mean draft length {sum(remote.lengths) / max(1, len(remote.lengths)):.1f}, acceptance "
                  f"{s.acceptance_rate:.2f}" + (f", {s.resumed_sessions} sessions resumed" if s.resumed_sessions else "")
                  + "]", file=sys.stderr)
    verifier.close()
    return 0


def _constraint(args):
    """--json-schema, --json-object, --regex or --grammar as a Constraint (None: none given)."""
    from speclm.constraint import Constraint

    if args.json_object:
        return Constraint("json_object")
    if args.regex is not None:
        return Constraint.of(regex=args.regex)
    for flag, kind in (("json_schema", "json_schema"), ("grammar", "grammar")):
        path = getattr(args, flag)
        if path is not None:
            try:
                with open(path, encoding="utf-8") as f:
                    return Constraint(kind, f.read())
            except OSError as e:
                raise UsageError(f"--{flag.replace('_', '-')} {path}: {e.strerror}") from None
    return None


def _as_kwargs(opts, seed_offset: int) -> dict:
    from dataclasses import fields

    kw = {f.name: getattr(opts, f.name) for f in fields(opts)}  # fields as they are (the constraint stays one)
    if kw["seed"] is not None:
        kw["seed"] += seed_offset  # row i of the whole prompt list samples with seed + i
    return kw


def _weights_note(target, draft) -> str:
    """Which weights and int8 kernels ran, for the statistics line: they decide the speed."""
    from speclm.quant.weights import int8_kernels

    def one(model) -> str:
        if model.quantize == "none":
            return f"{str(next(model.model.parameters()).dtype).replace('torch.', '')} weights"
        return f"{model.quantize} weights" + (f" on {int8_kernels()}" if model.quantize == "int8" else "")

    return f"target {one(target)}" + (f", draft {one(draft)}" if draft is not None else "")


def _peak_memory() -> str:
    """The process's peak resident memory so far (models, caches, activations)."""
    from speclm.memory import gib, peak_bytes

    return gib(peak_bytes())


def _print_stats(stats, weights: str, file) -> None:
    d = stats.to_dict()
    print(
        f"[{d['new_tokens']} tokens, {d['tokens_per_second']:.2f} tok/s, {d['target_forwards']} target forwards, "
        f"mean accepted {d['mean_accepted_tokens']:.2f}, acceptance {d['acceptance_rate']:.2f}, "
        + (f"{d['verified_nodes'] / max(1, d['target_forwards'] - 1):.1f} draft tokens verified per forward, "
           if d.get("verified_nodes") else "")
        + f"draft {d['draft_seconds']:.2f}s"
        + (f" (its prefill {d['draft_prefill_seconds']:.2f}s)" if d["draft_prefill_seconds"] else "")
        + f", verify {d['verify_seconds']:.2f}s"
        + (f", {d['cached_tokens']} prompt tokens from the prefix cache" if d.get("cached_tokens") else "")
        + ("; planned rounds: " + ", ".join(f"{name} {n}" for name, n in sorted(d["planned"].items(), key=lambda kv: -kv[1]))
           if d.get("planned") else "")
        + f"; {weights}; peak memory {_peak_memory()}]",
        file=file,
    )


def _bench(args) -> int:
    from pathlib import Path

    from speclm.bench import report
    from speclm.bench.dataset import load_prompts
    from speclm.bench.methods import parse_methods
    from speclm.bench.runner import BenchConfig, load_results, run_bench
    from speclm.engine import GenerationOptions, SpecEngine
    from speclm.models.loading import check_model_name, load_model
    from speclm.sampling import SamplingParams

    if args.compare:
        runs = []
        for path in args.compare:
            try:
                runs.append(load_results(path))
            except (OSError, ValueError) as exc:
                raise UsageError(f"cannot read results {path}: {exc}") from exc
        print(report.compare(runs[0], runs[1], Path(args.compare[0]).parent.name or "A", Path(args.compare[1]).parent.name or "B"))
        return 0
    if not args.target or not args.out:
        raise UsageError("bench needs --target and --out (or --compare A.json B.json)")
    if args.draft == NO_DRAFT:
        args.draft = None
    specs = parse_methods(args.methods)
    for s in specs:  # every method's options, before anything is loaded
        if not s.is_hf and not s.is_peer:
            GenerationOptions(method=s.name, **s.decoding_options)
    if any(s.needs_draft and not s.draft_model for s in specs) and not args.draft:
        raise UsageError("methods draft, draft+pld, hf-assisted and openvino-draft need --draft MODEL")
    for name, value, low in (("max-new-tokens", args.max_new_tokens, 1), ("repeats", args.repeats, 1),
                             ("cost-repeats", args.cost_repeats, 0), ("prefix-cache", args.prefix_cache, 0)):
        if value < low:
            raise UsageError(f"{name} must be >= {low}")
    SamplingParams(temperature=args.temperature)  # validates
    check_model_name(args.target)
    if args.draft:
        check_model_name(args.draft)
    categories = [c.strip() for c in args.categories.split(",")] if args.categories else None
    prompts = load_prompts(args.dataset, categories, args.per_category)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} exists and is not a folder")
    args.quantize, draft_quantize = weights_for(args.quantize, args.draft_quantize, args.target, args.draft)
    for s in specs:
        if s.draft_model:
            check_model_name(s.draft_model)
    engines = {}  # (quantize mode, a method's own draft or None) -> engine over those weights; the default's first
    for mode in dict.fromkeys([args.quantize] + [s.quantize for s in specs if s.quantize]):
        needs_draft = args.draft and any(s.uses_draft and not s.is_peer and not s.draft_model
                                         and (s.quantize or args.quantize) == mode for s in specs)
        engines[mode, None] = SpecEngine(
            load_model(args.target, quantize=mode, progress=_progress()),
            draft=load_model(args.draft, quantize=weights_for(mode, args.draft_quantize)[1], progress=_progress())
            if needs_draft else None)
    for mode, own in dict.fromkeys((s.quantize or args.quantize, s.draft_model) for s in specs if s.draft_model):
        engines[mode, own] = SpecEngine(engines[mode, None].target, draft=load_model(
            own, quantize=weights_for(mode, args.draft_quantize)[1], progress=_progress()))
    engine = engines[args.quantize, None]
    engine.encode([p.text for p in prompts], args.chat)  # every prompt fits and templates, before --out is made
    target, draft = engine.target, engine.draft
    config = BenchConfig(
        target=args.target, draft=args.draft if draft or any(s.uses_draft for s in specs) else None, methods=[s.label for s in specs], dataset=args.dataset,
        categories=categories, per_category=args.per_category, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, seed=args.seed, repeats=args.repeats, chat=args.chat,
        dtype=str(next(target.model.parameters()).dtype).replace("torch.", ""), cost_repeats=args.cost_repeats,
        quantize=args.quantize, draft_quantize=draft_quantize if draft else None, prefix_cache=args.prefix_cache,
    )
    created = not out.exists()
    try:
        results = run_bench(engine, specs, prompts, config, out, measure_cost_model=args.cost_repeats > 0, engines=engines,
                            progress=_progress())
    except SpeclmError:
        if created and not _finished_runs(out):  # e.g. a KV cache that does not fit: no half-written folder
            import shutil

            shutil.rmtree(out, ignore_errors=True)
        raise
    print((out / "report.md").read_text() if (out / "report.md").exists() else "no run finished")
    print(f"results in {out}/", file=sys.stderr)
    bad = [r for r in results["runs"] if r["lossless"] is False]
    if bad:
        print(f"speclm: WARNING: {len(bad)} output(s) differ from none; see report.md", file=sys.stderr)
    return 0 if results["complete"] else 130


def _finished_runs(out) -> int:
    try:
        return len(json.loads((out / "results.json").read_text())["runs"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def _demo(args) -> int:
    from speclm.engine import GenerationOptions, SpecEngine
    from speclm.models.loading import load_model

    if args.k is not None:
        GenerationOptions(method="draft", k=args.k)  # validates k before minutes of loading
    quantize, draft_mode = weights_for(args.quantize, args.draft_quantize, args.target, args.draft)
    print(f"loading {args.target} (target, weights {quantize}) and {args.draft} (draft, weights {draft_mode})...",
          file=sys.stderr)
    engine = SpecEngine(load_model(args.target, quantize=quantize, progress=_progress()),
                        draft=load_model(args.draft, quantize=draft_mode, progress=_progress()))
    # the target's chat template where it has one; a base model's (gemma3-270m) reads the prompt raw
    common = dict(max_new_tokens=args.max_new_tokens, chat=bool(getattr(engine.target.tokenizer, "chat_template", None)))
    k = args.k or GenerationOptions(method="draft").draft_length(quantize, draft_mode)
    for method in ("none", "draft"):  # warm-up of both runs' paths: first-call allocations
        engine.generate("Hi", method=method, k=k, max_new_tokens=4, chat=common["chat"])
    print(f"\n== prompt\n{args.prompt}\n\n== speculative (draft model {args.draft}, k={k}), streamed")
    engine.prefix.clear()  # both runs read the prompt whole: neither inherits the other's (or the warm-up's) prefill
    stream = engine.stream(args.prompt, method="draft", k=k, **common)
    for delta in stream:
        print(delta, end="", flush=True)
    spec = stream.completion
    print("\n\n== plain decoding (method none), same engine")
    engine.prefix.clear()
    plain = engine.generate(args.prompt, method="none", **common)
    print(f"(generated {len(plain.token_ids)} tokens)")
    print("\n== statistics (speculative)")
    for key, value in spec.stats.to_dict().items():
        print(f"  {key}: {round(value, 4) if isinstance(value, float) else value}")
    same = spec.token_ids == plain.token_ids
    print(f"\n== result\n  plain:       {plain.stats.tokens_per_second:.2f} tok/s")
    print(f"  speculative: {spec.stats.tokens_per_second:.2f} tok/s")
    print(f"  speedup:     {spec.stats.tokens_per_second / plain.stats.tokens_per_second:.2f}x")
    print(f"  identical output: {'yes' if same else 'NO'}")
    return 0 if same and _demo_heads(engine, args, common, plain) else 1


def _demo_heads(engine, args, common: dict, plain) -> bool:
    """The trained heads shipped for the target (medusa, eagle) on the same prompt: their speed
    beside plain decoding's, and whether their output is identical. True where every one is."""
    from speclm.heads import store

    methods = [n for n in needing(HEADS) if store.shipped(args.target, REGISTRY[n].heads) is not None]
    if not methods:
        return True
    print("\n== trained heads on the target itself (no draft model)")
    same = True
    for kind in methods:
        engine.generate("Hi", method=kind, max_new_tokens=4, chat=common["chat"])  # loads the heads; warm-up
        engine.prefix.clear()
        out = engine.generate(args.prompt, method=kind, **common)
        ok = out.token_ids == plain.token_ids
        same = same and ok
        print(f"  {kind + ':':10} {out.stats.tokens_per_second:.2f} tok/s, "
              f"{out.stats.tokens_per_second / plain.stats.tokens_per_second:.2f}x plain, "
              f"{out.stats.mean_accepted_tokens:.2f} tokens per target forward, identical output: {'yes' if ok else 'NO'}")
    return same


if __name__ == "__main__":
    sys.exit(main())
