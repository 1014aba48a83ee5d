"""Memory and load time of the default pair (int8 qwen2.5-coder-1.5b target, int4 qwen2.5-coder-0.5b
draft), each phase in a fresh process, memory read from /proc (speclm.memory):

1. first: no quantized-weights cache; both models quantized from the store's GGUF files (layer by
   layer) and cached: seconds and the process's peak resident memory.
2. cached: both loaded from the quantized-weights cache: seconds (the two `load_model` calls, and
   the process from its start), peak during the load; then one request (`draft+pld`, 128 new
   tokens, Spec-Bench's first mt_bench prompt): resident memory split into anonymous and file-backed, and
   the peak.
3. soak: a long-running process serving requests of mixed prompt and output lengths (every method,
   Spec-Bench prompts of every task kind, 8 to 64 new tokens): resident memory after each group of
   requests, beside what the prefix caches hold (they fill up to their token budget); the rest
   must plateau (the engine keeps at most speclm.runtime.KEPT_FREE_BYTES of freed memory).
4. disk: the store's folders and quantized files of the pair.
5. identity (with --reference-home, a store converted by an earlier speclm as fp32 safetensors):
   every quantized tensor, the embedding table and the norms of the new load against the earlier
   path's (fp32 model quantized in memory), bit for bit, and greedy outputs on one prompt per task
   kind.

Run: .venv/bin/python benchmarks/load_memory.py [--reference-home ~/.cache/speclm] > load-memory.txt
`--smoke --target FOLDER --draft FOLDER`: the same phases on tiny models, 8 new tokens, one thread
(tests/test_benchmark_scripts.py).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

START = time.monotonic()


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", help="catalog name or model folder")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b", help="catalog name or model folder")
    parser.add_argument("--soak", type=int, default=60, help="requests in the soak phase")
    parser.add_argument("--reference-home", help="a SPECLM_HOME whose store holds the pair as fp32 safetensors")
    parser.add_argument("--smoke", action="store_true", help="tiny models: 8 new tokens, 6 soak requests, 1 thread")
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    return parser.parse_args()


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def load_pair(args):
    import speclm

    t0 = time.monotonic()
    target = speclm.load_model(args.target, quantize="int8", progress=False)
    t1 = time.monotonic()
    draft = speclm.load_model(args.draft, quantize="int4", progress=False)
    t2 = time.monotonic()
    return target, draft, (t1 - t0, t2 - t1)


def prompts(args, n: int):
    from speclm.bench.dataset import load_prompts

    every = load_prompts("spec-bench", None, None)
    if args.smoke:
        every = [p for p in every if len(p.text) < 200]
    by_kind: dict[str, list] = {}
    for p in every:
        by_kind.setdefault(p.category, []).append(p)
    kinds = sorted(by_kind)
    return [by_kind[kinds[i % len(kinds)]][i // len(kinds)] for i in range(n)]


def phase_first(args) -> dict:
    from speclm import memory
    from speclm.models import qcache
    from speclm.models.loading import resolve_model

    for name in (args.target, args.draft):
        for path in qcache.files_for(Path(resolve_model(name, progress=False))):
            path.unlink()
    _, _, seconds = load_pair(args)
    return {"seconds": seconds, "peak": memory.resident().peak}


def phase_cached(args) -> dict:
    import speclm
    from speclm import memory

    imported = time.monotonic() - START
    target, draft, seconds = load_pair(args)
    at_load = memory.resident()
    engine = speclm.SpecEngine(target, draft=draft)
    prompt = next(p for p in prompts(args, 6) if p.category == "mt_bench")
    out = engine.generate(prompt.text, method="draft+pld", max_new_tokens=8 if args.smoke else 128, chat=True)
    after = memory.resident()
    return {"imported": imported, "seconds": seconds, "process": time.monotonic() - START, "load": at_load.__dict__,
            "after": after.__dict__, "tokens": len(out.token_ids)}


def phase_soak(args) -> dict:
    import speclm
    from speclm import memory

    target, draft, _ = load_pair(args)
    engine = speclm.SpecEngine(target, draft=draft)
    methods = ["draft+pld", "none", "draft", "pld"]
    lengths = [8] if args.smoke else [16, 64, 8, 32]
    group = max(1, args.soak // 12)
    rows = []
    for i, p in enumerate(prompts(args, args.soak)):
        engine.generate(p.text, method=methods[i % len(methods)], max_new_tokens=lengths[i % len(lengths)], chat=True)
        if (i + 1) % group == 0:
            r = memory.resident()
            rows.append([i + 1, r.total, r.anonymous, r.peak, engine.prefix.target.nbytes + engine.prefix.draft.nbytes])
    return {"rows": rows}


def phase_identity(args) -> dict:
    """The new load against the earlier path on the reference store, bit for bit."""
    import torch
    from transformers import AutoModelForCausalLM

    import speclm
    from speclm.forward.embedding import PackedEmbedding
    from speclm.quant.weights import QuantLinear, quantize_model

    rows = []
    for name, mode in ((args.target, "int8"), (args.draft, "int4")):
        new = speclm.load_model(name, quantize=mode, progress=False)
        folder = Path(args.reference_home).expanduser() / "models" / name
        old = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        table = old.get_input_embeddings().weight.detach().clone()
        quantize_model(old, mode)
        new_mods, old_mods = dict(new.model.named_modules()), dict(old.named_modules())
        checked = differ = 0
        for path, module in new_mods.items():
            if isinstance(module, QuantLinear):
                a, b = module.state(), old_mods[path].state()
                checked += len(a)
                differ += sum(not torch.equal(a[k], b[k]) for k in a)
        for path, param in new.model.named_parameters():
            checked += 1
            differ += not torch.equal(param, dict(old.named_parameters())[path])
        embed = new.model.get_input_embeddings()
        same_table = torch.equal(embed.full() if isinstance(embed, PackedEmbedding) else embed.weight, table)
        form = embed.extra_repr() if isinstance(embed, PackedEmbedding) else "fp32"
        same = 0
        kinds = prompts(args, 6)
        old_loaded = speclm.LoadedModel(name, old, new.tokenizer, new.eos_token_ids, mode)
        for p in kinds:
            a = speclm.SpecEngine(new).generate(p.text, max_new_tokens=8 if args.smoke else 64, chat=True)
            b = speclm.SpecEngine(old_loaded).generate(p.text, max_new_tokens=8 if args.smoke else 64, chat=True)
            same += a.token_ids == b.token_ids
        rows.append([name, mode, checked, differ, same_table, form, same, len(kinds)])
        del new, old
    return {"rows": rows}


def child(args) -> None:
    import speclm

    speclm.set_threads(1 if args.smoke else None)
    result = globals()[f"phase_{args.phase}"](args)
    print(json.dumps(result))


def run_phase(args, phase: str, env: dict) -> dict:
    argv = [sys.executable, __file__, "--phase", phase, "--target", args.target, "--draft", args.draft,
            "--soak", str(args.soak)]
    argv += ["--smoke"] if args.smoke else []
    argv += ["--reference-home", args.reference_home] if args.reference_home else []
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"phase {phase} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    args = arguments()
    if args.smoke:
        args.soak = min(args.soak, 6)
    if args.phase:
        return child(args)
    import torch

    from speclm.quant import kernels
    from speclm.models import qcache, store
    from speclm.models.loading import resolve_model
    from speclm.runtime import KEPT_FREE_BYTES

    env = dict(os.environ)
    home = None
    if args.smoke and "SPECLM_HOME" not in env:
        home = tempfile.TemporaryDirectory()
        env["SPECLM_HOME"] = os.environ["SPECLM_HOME"] = home.name
    print(f"# Memory and load time: target {args.target} (int8), draft {args.draft} (int4)\n")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, kernels: {kernels.describe()}, "
          f"glibc keeps at most {KEPT_FREE_BYTES >> 20} MiB freed\n")

    first = run_phase(args, "first", env)
    print("## First load: quantized from the store's files, then cached\n")
    print(f"target {first['seconds'][0]:.1f} s, draft {first['seconds'][1]:.1f} s; "
          f"peak resident memory {gib(first['peak'])}\n")

    cached = run_phase(args, "cached", env)
    load, after = cached["load"], cached["after"]
    print("## Later loads: from the quantized-weights cache, then one request\n")
    print(f"load_model: target {cached['seconds'][0]:.2f} s, draft {cached['seconds'][1]:.2f} s, "
          f"together {sum(cached['seconds']):.2f} s (Python and library imports before them: {cached['imported']:.1f} s)\n")
    print("| moment | resident | anonymous | file-backed | peak so far |")
    print("|---|---|---|---|---|")
    print(f"| both loaded | {gib(load['total'])} | {gib(load['anonymous'])} | {gib(load['file'])} | {gib(load['peak'])} |")
    print(f"| after one request ({cached['tokens']} tokens, draft+pld) | {gib(after['total'])} | "
          f"{gib(after['anonymous'])} | {gib(after['file'])} | {gib(after['peak'])} |\n")

    soak = run_phase(args, "soak", env)
    print(f"## Soak: {args.soak} requests of mixed methods, prompts and lengths in one process\n")
    print("| requests served | resident | anonymous | peak so far | prefix caches' keys and values | "
          "resident less the prefix caches |")
    print("|---|---|---|---|---|---|")
    for n, total, anon, peak, prefix in soak["rows"]:
        print(f"| {n} | {gib(total)} | {gib(anon)} | {gib(peak)} | {gib(prefix)} | {gib(total - prefix)} |")
    half = soak["rows"][len(soak["rows"]) // 2:]
    print(f"\nover the second half of the run: resident {gib(min(r[1] for r in half))} to {gib(max(r[1] for r in half))}; "
          f"less the prefix caches (bounded by their token budget, speclm.forward.prefix_cache) "
          f"{gib(min(r[1] - r[4] for r in half))} to {gib(max(r[1] - r[4] for r in half))}\n")

    print("## On disk\n")
    print("| model | store folder | quantized files |")
    print("|---|---|---|")
    total = 0
    for name in (args.target, args.draft):
        folder = resolve_model(name, progress=False)
        files = qcache.files_for(Path(folder))
        size, qsize = store.disk_bytes(Path(folder)), sum(store.disk_bytes(p) for p in files)
        total += size + qsize
        print(f"| {name} | {size / 1e9:.2f} GB | {qsize / 1e9:.2f} GB ({', '.join(p.name for p in files)}) |")
    print(f"\ntogether {total / 1e9:.2f} GB\n")

    if args.reference_home:
        identity = run_phase(args, "identity", env)
        print("## Against the earlier load path (fp32 safetensors store, quantized in memory)\n")
        print("| model | weights | tensors compared | differing | embedding table equal | kept as | "
              "greedy outputs equal |")
        print("|---|---|---|---|---|---|---|")
        for name, mode, checked, differ, same_table, form, same, n in identity["rows"]:
            print(f"| {name} | {mode} | {checked} | {differ} | {'yes' if same_table else 'NO'} | {form} | {same}/{n} |")
    if home is not None:
        home.cleanup()


if __name__ == "__main__":
    main()
