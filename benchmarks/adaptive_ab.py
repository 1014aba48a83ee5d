"""The adaptive speculation policy (speclm.round.adaptive, what `speclm serve` runs by default)
against another revision's, with plain decoding beside them: Spec-Bench prompts through one Batch
of `--rows` rows (a request joins as one leaves, as the server's batch), `draft+pld` under each
policy and `none`, in turns, in one process, the same models and batch code for all three. Each
policy is one object kept over the repeats, as a server keeps it. `none` runs first and leaves
the prompts in the target's prefix cache; the first repeat is each policy's first traffic (a
burst of `--rows` new requests, nothing measured yet), where a draft model that drafts must read
whole prompts; in later repeats the prompts are in the prefix cache of each model that read
them, so what differs is the policies' rounds. Per run: wall time, tokens/s, rounds, the draft model's seconds in its forwards and of those its seconds
reading what it had not read (prompts; its prefill), and outputs identical to `none`'s.

Run: .venv/bin/python benchmarks/adaptive_ab.py --against HEAD --rows 8 --repeats 5 > adaptive-ab.txt (record: benchmarks/avx2/records.md#adaptive-ab)
`--smoke --target FOLDER --draft FOLDER`: the same code path on tiny models, 2 prompts, 2 rows,
2 repeats, 4 new tokens, one torch thread, against the running source.
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from speclm.bench.dataset import load_prompts
from speclm.bench.machine import cpu_name
from speclm.engine import SpecEngine
from speclm.models.loading import load_model
from speclm.runtime import set_threads, usable_cores

ROOT = Path(__file__).resolve().parents[1]
SOURCE = "speclm/round/adaptive.py"


def other_policy(rev: str | None):
    """The Adaptive class of `rev`'s speclm/round/adaptive.py (None: the running source's file)."""
    text = (subprocess.run(["git", "show", f"{rev}:{SOURCE}"], cwd=ROOT, check=True, capture_output=True,
                           text=True).stdout if rev else (ROOT / SOURCE).read_text())
    path = Path(tempfile.mkdtemp()) / "adaptive_other.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("adaptive_other", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["adaptive_other"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.Adaptive


def run(engine, prompts, rows: int, new_tokens: int, method: str, policy):
    requests = [engine.request(p, method=method, max_new_tokens=new_tokens, chat=True) for p in prompts]
    batch = engine.batch(rows=rows, prefill_chunk=256, speculation=policy)
    waiting, rounds, proposers = collections.deque(requests), 0, {}
    start = time.perf_counter()
    while waiting or batch.active:
        while waiting and batch.size < rows:
            batch.join(waiting.popleft())
        batch.step()
        rounds += batch.last_step == "round"
        proposers.update((id(g.proposer), g.proposer) for g in batch.groups.values() if g.proposer is not None)
    wall = time.perf_counter() - start
    # a proposer's times count from its batch's start; the batch drops it when its last request leaves
    return (wall, sum(len(r.generated) for r in requests), rounds,
            sum(p.forward_seconds for p in proposers.values()), sum(p.prefill_seconds for p in proposers.values()),
            [list(r.generated) for r in requests])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", help="catalog name or model folder (int8)")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b", help="catalog name or model folder (int4)")
    parser.add_argument("--against", default="HEAD", help="git revision of the other policy")
    parser.add_argument("--rows", type=int, default=8, help="requests decoding at once")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--per-category", type=int, default=2, help="Spec-Bench prompts per task kind")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--smoke", action="store_true", help="tiny run: 2 prompts, 2 rows, 2 repeats, 1 thread")
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.repeats, args.max_new_tokens = 2, 2, 4
    set_threads(1 if args.smoke else usable_cores())
    target = load_model(args.target, quantize="int8", progress=False)
    draft = load_model(args.draft, quantize="int4", progress=False)
    engine = SpecEngine(target, draft=draft)
    prompts = [p.text for p in load_prompts("spec-bench", None, 1 if args.smoke else args.per_category)]
    prompts = prompts[:2] if args.smoke else prompts
    Other = other_policy(None if args.smoke else args.against)
    policies = {"none": ("none", None), "draft+pld, other": ("draft+pld", Other(engine.forward_costs())),
                "draft+pld, this": ("draft+pld", engine.adaptive())}
    print(f"# machine: {cpu_name()}; {len(prompts)} prompts, {args.rows} rows, {args.max_new_tokens} new tokens; "
          f"other policy: {'the running source' if args.smoke else args.against}'s {SOURCE}")
    print("| repeat | run | wall s | tokens | tokens/s | rounds | draft model s | of which reading prompts s "
          "| identical to none |")
    print("|---|---|---|---|---|---|---|---|---|")
    totals = collections.defaultdict(lambda: [0.0, 0])
    for repeat in range(args.repeats):
        plain = None
        for name, (method, policy) in policies.items():
            wall, tokens, rounds, drafting, reading, outputs = run(engine, prompts, args.rows, args.max_new_tokens,
                                                                   method, policy)
            plain = outputs if plain is None else plain
            same = sum(a == b for a, b in zip(outputs, plain))
            if repeat > 0:
                totals[name][0] += wall
                totals[name][1] += tokens
            print(f"| {repeat} | {name} | {wall:.1f} | {tokens} | {tokens / wall:.2f} | {rounds} | {drafting:.1f} "
                  f"| {reading:.1f} | {same}/{len(prompts)} |", flush=True)
    if args.repeats > 1:
        rate = {name: tokens / wall for name, (wall, tokens) in totals.items()}
        print(f"repeats 1-{args.repeats - 1} (prompts in the prefix cache), tokens/s: "
              + ", ".join(f"{name} {r:.2f}" for name, r in rate.items())
              + f"; this / none {rate['draft+pld, this'] / rate['none']:.3f}, "
              f"other / none {rate['draft+pld, other'] / rate['none']:.3f}")


if __name__ == "__main__":
    main()
