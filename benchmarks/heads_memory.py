"""What trained heads add to memory, against plain decoding and a draft model, each in a fresh
process (memory read from /proc: speclm.memory):

- none: the int8 target alone, then one request (`none`);
- medusa, eagle: the int8 target, its shipped heads (or --medusa / --eagle files), then one request
  with the method;
- draft+pld: the int8 target and the int4 draft model, then one request.
Each line: resident memory after loading, its growth while loading the heads or the draft, and the
peak during the request; the request is Spec-Bench's first mt_bench prompt in the chat template,
128 new tokens, greedy.

Run: .venv/bin/python benchmarks/heads_memory.py > heads-memory.txt
`--smoke --target FOLDER --medusa FILE --eagle FILE`: the same on a tiny model, 8 new tokens, one
thread, without the draft's line.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys


def child(method: str, target: str, draft: str | None, heads: str | None, new: int, threads: int | None) -> dict:
    from speclm import memory
    from speclm.bench.dataset import load_prompts
    from speclm.engine import SpecEngine
    from speclm.models.loading import load_model
    from speclm.runtime import set_threads

    set_threads(threads)
    quantize = "none" if threads == 1 else "int8"
    engine = SpecEngine(load_model(target, quantize=quantize, progress=False))
    loaded = memory.resident().total
    if method == "draft+pld":
        engine.draft = load_model(draft, quantize="int4", progress=False)
    elif method != "none":
        engine.heads(method, heads)
    extra = memory.resident().total - loaded
    prompt = load_prompts("spec-bench", ["mt_bench"], 1)[0].text
    engine.generate("Hi", method=method, heads=heads if method in ("medusa", "eagle") else None, max_new_tokens=4,
                    chat=True)
    memory.reset_peak()
    out = engine.generate(prompt, method=method, heads=heads if method in ("medusa", "eagle") else None,
                          max_new_tokens=new, chat=True)
    return {"method": method, "target_loaded": loaded, "extra_loaded": extra, "peak": memory.peak_bytes(),
            "tokens": len(out.token_ids)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--medusa", default=None)
    ap.add_argument("--eagle", default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    new, threads = (8, 1) if args.smoke else (128, None)
    if args.child:
        heads = {"medusa": args.medusa, "eagle": args.eagle}.get(args.child)
        print(json.dumps(child(args.child, args.target, args.draft, heads, new, threads)))
        return
    methods = ["none", "medusa", "eagle"] + ([] if args.smoke else ["draft+pld"])
    rows = []
    for method in methods:
        argv = [sys.executable, __file__, "--child", method, "--target", args.target, "--draft", args.draft]
        argv += [f"--{k}={v}" for k, v in (("medusa", args.medusa), ("eagle", args.eagle)) if v]
        argv += ["--smoke"] if args.smoke else []
        done = subprocess.run(argv, capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    mib = 2**20
    base = rows[0]["peak"]
    print(f"# memory of trained heads beside the int8 target {args.target}: one fresh process per method, "
          f"{new} new tokens, greedy")
    print()
    print("| method | resident after the target's load MiB | added by heads or draft MiB | peak during the request MiB "
          "| peak over none's MiB |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['target_loaded'] / mib:.0f} | {r['extra_loaded'] / mib:.0f} | {r['peak'] / mib:.0f} "
              f"| {(r['peak'] - base) / mib:+.0f} |")


if __name__ == "__main__":
    main()
