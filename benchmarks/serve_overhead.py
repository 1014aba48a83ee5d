"""The server's own cost at concurrency 1: the same requests through `speclm serve` (chat
completions over loopback HTTP, streamed and as one reply) and through `SpecEngine.generate` in
this process, in turns per prompt (each side going first in turn), with plain decoding and with
the method's fixed k. Tokens/s is total generated tokens over total time, each side's time from
its request to its last token; outputs are compared.
A third side splits the difference: a Batch sized as the server's (its --max-batch rows and
--prefill-chunk, kept from one request to the next as the server keeps it) stepped on this
thread, no HTTP and no engine thread.

The server is started by this script (`speclm serve --port 0`, the same weights as here), so both
sides hold the same models; they never run at the same time.

Run: .venv/bin/python benchmarks/serve_overhead.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
         --per-category 2 > serve-overhead.txt
`--smoke --target FOLDER --draft FOLDER`: the same code path on tiny models, 2 prompts of 8 tokens,
one torch thread.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time

import httpx

from speclm.bench.dataset import load_prompts
from speclm.bench.machine import cpu_name
from speclm.engine import SpecEngine
from speclm.models.loading import load_model
from speclm.runtime import set_threads
from speclm.serve.options import MAX_BATCH, PREFILL_CHUNK


class Server:
    def __init__(self, argv: list[str]):
        self.proc = subprocess.Popen([sys.executable, "-m", "speclm.cli", "serve", "--port", "0", *argv],
                                     stderr=subprocess.PIPE, text=True)
        for line in self.proc.stderr:
            found = re.search(r"on (http://[\d.]+:\d+)", line)
            if found:
                self.url = found.group(1)
                return
        raise SystemExit("the server did not start")

    def chat(self, prompt: str, max_tokens: int, speculation, stream: bool = True) -> tuple[str, int]:
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
                "stream": stream, "speculation": speculation}
        if not stream:
            reply = httpx.post(self.url + "/v1/chat/completions", json=body, timeout=600).json()
            return reply["choices"][0]["message"]["content"], reply["usage"]["completion_tokens"]
        body["stream_options"] = {"include_usage": True}
        text, tokens = [], 0
        with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, timeout=600) as response:
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
                text += [c["delta"].get("content") or "" for c in chunk["choices"]]
        return "".join(text), tokens

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


SIDES = ["generate", "batch", "serve", "serve-whole"]  # serve: streamed; serve-whole: one JSON reply


def server_sized(batch, engine: SpecEngine, text: str, method: str, max_new_tokens: int):
    """One request through `batch` (the server's sizes), on this thread: its Completion."""
    request = batch.join(engine.request(text, method=method, max_new_tokens=max_new_tokens, chat=True))
    while batch.active:
        batch.step()
    return engine.completion(request)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--method", default="draft+pld")
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    if args.smoke:
        set_threads(1)
        args.per_category, args.max_new_tokens = None, 8
    weights = ["--quantize", "int8", "--draft-quantize", "int8" if args.smoke else "int4"]
    server = Server(["--target", args.target, "--draft", args.draft, "--threads", "1" if args.smoke else "2",
                     "--speculation", "fixed", "--prefix-cache", "0", *weights])
    try:
        engine = SpecEngine(load_model(args.target, quantize="int8", progress=False),
                            draft=load_model(args.draft, quantize=weights[3], progress=False), prefix_cache=0)
        prompts = load_prompts("spec-bench", None, args.per_category)[: 2 if args.smoke else None]
        print(f"# speclm serve against SpecEngine.generate in this process, concurrency 1, {len(prompts)} Spec-Bench "
              f"prompts, chat, {args.max_new_tokens} new tokens, int8 target, {weights[3]} draft, {cpu_name()}")
        print("| method | tokens | generate tok/s | server-sized batch tok/s | serve tok/s, streamed | serve tok/s, "
              "one reply | batch / generate | serve / generate, streamed | serve / generate, one reply | "
              "identical outputs |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        batch = engine.batch(rows=MAX_BATCH, prefill_chunk=PREFILL_CHUNK)
        for method in ("none", args.method):
            totals = {side: [0, 0.0] for side in SIDES}
            same = 0
            for i, prompt in enumerate(prompts):
                text, out = prompt.text, {}
                # the sides take turns going first, so that a drift in memory bandwidth favours none
                for side in SIDES[i % len(SIDES):] + SIDES[: i % len(SIDES)]:
                    start = time.perf_counter()
                    if side == "generate":
                        ref = engine.generate(text, method=method, max_new_tokens=args.max_new_tokens, chat=True)
                        out[side], tokens = ref.text, len(ref.token_ids)
                    elif side == "batch":
                        done = server_sized(batch, engine, text, method, args.max_new_tokens)
                        out[side], tokens = done.text, len(done.token_ids)
                    else:
                        out[side], tokens = server.chat(text, args.max_new_tokens, {"method": method},
                                                        stream=side == "serve")
                    totals[side][0] += tokens
                    totals[side][1] += time.perf_counter() - start
                same += all(out[side] == out["generate"] for side in SIDES)
            rate = {side: n / s for side, (n, s) in totals.items()}
            print(f"| {method} | {totals['serve'][0]} | {rate['generate']:.2f} | {rate['batch']:.2f} | "
                  f"{rate['serve']:.2f} | {rate['serve-whole']:.2f} | {rate['batch'] / rate['generate']:.3f} | "
                  f"{rate['serve'] / rate['generate']:.3f} | {rate['serve-whole'] / rate['generate']:.3f} | "
                  f"{same}/{len(prompts)} |", flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
