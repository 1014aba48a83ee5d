"""A sliding-window model's KV cache with its sliding layers kept as rings of window + spare slots
(speclm.forward.cache, the default) against every layer keeping every slot: the cache's memory, the
decode speed and the tokens, at long contexts.

The prompt of each context length is the Spec-Bench prompts' text run together (raw, no chat
template) and cut to that many tokens; `none` and `pld` generate --max-new-tokens greedily from it
on the int8 target, the two layouts alternated --repeats times (each layout its own engine, so the
prompt is read once per layout and reused from its prefix cache after). Printed per context and
layout: the target's KV cache in MiB at that context, and at the model's longest (computed from the
same sizes), decode tokens/s per method (tokens after the first over the time after the prefill,
summed over the repeats) and whether every output equals the other layout's.

Run: .venv/bin/python benchmarks/sliding_cache.py --target gemma3-270m > sliding-cache.txt
Committed output: benchmarks/avx2/records.md#sliding-cache (AMD EPYC, AVX2).
`--smoke --target FOLDER`: a 40-token context, 4 new tokens, one repeat, one torch thread.
"""
from __future__ import annotations

import argparse
from contextlib import contextmanager

LAYOUTS = ("every slot", "rings")
METHODS = ("none", "pld")


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="gemma3-270m", help="catalog name or model folder")
    parser.add_argument("--contexts", default="2048,8192", help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="a 40-token context, 4 new tokens, one repeat, 1 thread")
    return parser.parse_args()


@contextmanager
def layout(name: str):
    """Rings (the default) or, with a spare no context reaches, every slot of every layer."""
    import speclm.forward.cache as cache

    saved = cache.RING_SPARE
    cache.RING_SPARE = saved if name == "rings" else 1 << 40
    try:
        yield
    finally:
        cache.RING_SPARE = saved


def main() -> None:
    args = arguments()
    import torch

    import speclm
    from speclm.bench.dataset import load_prompts
    from speclm.forward.cache import StaticKV

    if args.smoke:
        torch.set_num_threads(1)
    contexts = [40] if args.smoke else [int(c) for c in args.contexts.split(",")]
    new_tokens, repeats = (4, 1) if args.smoke else (args.max_new_tokens, args.repeats)
    target = speclm.load_model(args.target, quantize="int8", progress=False)
    text = "\n\n".join(p.text for p in load_prompts("spec-bench", None, None))
    ids = target.tokenizer(text).input_ids
    cfg = getattr(target.model.config, "text_config", None) or target.model.config
    longest = cfg.max_position_embeddings
    print(f"{args.target} (int8), {torch.get_num_threads()} threads, {new_tokens} new tokens, greedy, "
          f"{repeats} repeat(s), layouts alternated\n")
    print(f"| context | layout | KV MiB | KV MiB at {longest} | " + " | ".join(f"{m} tokens/s" for m in METHODS)
          + " | outputs equal |")
    print("|---|---|---|---|" + "---|" * len(METHODS) + "---|")
    for context in contexts:
        assert len(ids) >= context, f"the prompts hold {len(ids)} tokens"
        prompt = target.tokenizer.decode(ids[:context])
        engines = {name: speclm.SpecEngine(target) for name in LAYOUTS}
        spent = {(name, m): [0, 0.0] for name in LAYOUTS for m in METHODS}
        outputs: dict = {}
        for _ in range(repeats):
            for name in LAYOUTS:
                with layout(name):
                    for method in METHODS:
                        out = engines[name].generate(prompt, method=method, max_new_tokens=new_tokens, chat=False)
                        s = out.stats
                        spent[name, method][0] += s.new_tokens - 1
                        spent[name, method][1] += s.wall_seconds - s.prefill_seconds
                        outputs.setdefault((name, method), out.token_ids)
                        assert outputs[name, method] == out.token_ids
        equal = all(outputs[LAYOUTS[0], m] == outputs[n, m] == outputs[n, "none"] for n in LAYOUTS for m in METHODS)
        for name in LAYOUTS:
            with layout(name):
                mib = [StaticKV(target.model, 1, n + new_tokens + 1).nbytes / 2**20 for n in (context, longest - new_tokens - 1)]
            speeds = " | ".join(f"{t / s:.2f}" if s > 0 else "-" for t, s in (spent[name, m] for m in METHODS))
            print(f"| {context} | {name} | {mib[0]:.1f} | {mib[1]:.1f} | {speeds} | {'yes' if equal else 'NO'} |")


if __name__ == "__main__":
    main()
