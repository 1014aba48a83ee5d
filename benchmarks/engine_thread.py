"""Plain decoding on the main thread against the same on a second thread (as `speclm serve`'s
engine thread), before and after the main thread's OpenMP workers are freed
(speclm.runtime.release_openmp_threads).

Run: .venv/bin/python benchmarks/engine_thread.py --model qwen2.5-coder-1.5b > engine-thread.txt
`--smoke --model FOLDER`: the same code path on a tiny model, 8 tokens.
"""
from __future__ import annotations

import argparse
import threading
import time

import torch

from speclm.bench.machine import cpu_name
from speclm.engine import SpecEngine
from speclm.models.loading import load_model
from speclm.runtime import release_openmp_threads, set_threads

PROMPT = "Write a long story about a robot who learns to paint, in detail."


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    tokens = 8 if args.smoke else args.tokens
    threads = set_threads(1 if args.smoke else None)
    engine = SpecEngine(load_model(args.model, quantize="int8", progress=False), prefix_cache=0)
    rates: dict[str, list[float]] = {}

    def decode(where: str) -> None:
        start = time.perf_counter()
        out = engine.generate(PROMPT, method="none", max_new_tokens=tokens, chat=True)
        rates.setdefault(where, []).append(len(out.token_ids) / (time.perf_counter() - start))

    def on_thread(where: str) -> None:
        thread = threading.Thread(target=decode, args=(where,))
        thread.start()
        thread.join()

    decode("warm-up")
    for _ in range(args.repeats):  # in turns: this machine's speed drifts
        decode("main thread")
        on_thread("second thread, main thread's OpenMP workers kept")
    released = release_openmp_threads()
    for _ in range(args.repeats):
        on_thread("second thread, main thread's OpenMP workers freed")
    print(f"# {cpu_name()}, torch {torch.__version__}, {threads} threads, int8 {args.model}, plain decoding of "
          f"{tokens} tokens, {args.repeats} runs each; release_openmp_threads: {released}")
    print("| where | tokens/s (each run) | vs main thread |")
    print("|---|---|---|")
    base = sum(rates["main thread"]) / len(rates["main thread"])
    for where, values in rates.items():
        if where != "warm-up":
            mean = sum(values) / len(values)
            print(f"| {where} | {', '.join(f'{v:.2f}' for v in values)} | {mean / base:.2f} |")


if __name__ == "__main__":
    main()
