"""Remote verification (`speclm generate --verifier URL`) against the same server's plain decoding,
at injected round-trip times: the draft here, the target in a `speclm serve` process (method
none) behind a local TCP proxy that holds every byte half the round trip each way
(speclm.remote.DelayedLink). Client and server share this machine's cores.

Per prompt (Spec-Bench, --per-category of each kind, the target's chat template): an untimed
2-token remote run (the prompt into the server's and the draft's prefix caches, so that every
timed run reads it from there alike), then per delay (each delay first in turn): the server's
plain decoding streamed through the link (/v1/completions with the prompt's token ids,
speculation off, greedy), then the remote client. Printed per delay: tokens and
seconds of each (headline: total tokens / total time over all prompts), the server's target
forwards per generated token, the draft length the client chose (mean over rounds), the round
trips' time and how many remote outputs equal the plain ones.

Run: .venv/bin/python benchmarks/remote.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b > remote.txt
`--smoke --target FOLDER --draft FOLDER`: one prompt, 8 new tokens, delays 0 and 20 ms.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import replace


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", help="the server's model: catalog name or folder")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b", help="the client's draft: catalog name or folder")
    parser.add_argument("--delays", default="0,20,80", help="round-trip milliseconds, comma-separated")
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--method", default="draft", help="the client's method (draft, pld, draft+pld)")
    parser.add_argument("--smoke", action="store_true", help="one prompt, 8 new tokens, delays 0 and 20 ms, 1 thread")
    return parser.parse_args()


def start_server(target: str, threads: int) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "speclm.cli", "serve", "--target", target, "--method", "none", "--quantize", "int8", "--port", "0",
           "--threads", str(threads)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    log = []
    while True:
        line = proc.stderr.readline()
        if not line:
            raise SystemExit("the server did not start:\n" + "".join(log))
        log.append(line)
        found = re.search(r"on (http://[\d.]+:\d+)", line)
        if found:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, found.group(1)


def plain(url: str, ids: list[int], max_tokens: int) -> tuple[str, float, int]:
    """The server's plain decoding streamed: (text, seconds to its last token, tokens)."""
    import httpx

    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "speculation": "off", "stream": True,
            "stream_options": {"include_usage": True}}
    pieces, tokens = [], 0
    began = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            pieces += [c["text"] for c in chunk.get("choices", [])]
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return "".join(pieces), time.perf_counter() - began, tokens


def main() -> None:
    args = arguments()
    import torch

    from speclm.bench.dataset import load_prompts
    from speclm.engine import SpecEngine
    from speclm.models.loading import load_model
    from speclm.options import GenerationOptions
    from speclm.remote import DelayedLink, Verifier, remote_stream
    from speclm.runtime import usable_cores, weights_for
    from speclm.text import chat_ids, final_text

    threads = 1 if args.smoke else usable_cores()
    torch.set_num_threads(threads)
    delays = [0, 20] if args.smoke else [int(d) for d in args.delays.split(",")]
    new = 8 if args.smoke else args.max_new_tokens
    prompts = load_prompts("spec-bench", None, 1 if args.smoke else args.per_category)[: 1 if args.smoke else None]
    server, url = start_server(args.target, threads)
    try:
        _, draft_quantize = weights_for("auto")
        draft = load_model(args.draft, quantize=draft_quantize, progress=False)
        engine = SpecEngine(draft, draft=draft)
        tok = draft.tokenizer
        encoded = [chat_ids(tok, p.text) if getattr(tok, "chat_template", None) else tok(p.text).input_ids
                   for p in prompts]
        links = {d: DelayedLink(url, d / 2000) for d in delays}
        verifiers = {d: Verifier(links[d].url) for d in delays}
        for v in verifiers.values():
            v.check(tok)
        opts = GenerationOptions(method=args.method, max_new_tokens=new)
        rows = {d: dict(plain_s=0.0, plain_tokens=0, remote_s=0.0, remote_tokens=0, forwards=0, trips=0, trip_s=0.0,
                        lengths=[], same=0) for d in delays}

        def remote(d, ids, options=opts):
            began = time.perf_counter()
            stream = remote_stream(engine, verifiers[d], ids, options, 0)
            while True:
                try:
                    next(stream)
                except StopIteration as end:
                    request, stats = end.value
                    return request, stats, time.perf_counter() - began

        remote(delays[0], encoded[0])  # warm-up, untimed: kernels, the server's first forwards
        plain(links[delays[0]].url, encoded[0], new)
        for n, ids in enumerate(encoded):
            # untimed: the prompt into both prefix caches (the server's, the draft's), so that every
            # timed run below reads it from there alike
            remote(delays[0], ids, replace(opts, max_new_tokens=2))
            for d in delays[n % len(delays):] + delays[: n % len(delays)]:  # each delay first in turn
                text, seconds, tokens = plain(links[d].url, ids, new)
                request, stats, spent = remote(d, ids)
                row = rows[d]
                row["plain_s"] += seconds
                row["plain_tokens"] += tokens
                row["remote_s"] += spent
                row["remote_tokens"] += len(request.generated)
                row["forwards"] += request.stats.target_forwards
                row["trips"] += stats.round_trips
                row["trip_s"] += stats.round_trip_seconds
                row["lengths"] += list(stats.lengths)
                row["same"] += final_text(tok, request.generated, ()) == text
    finally:
        server.terminate()
        server.wait(60)
    print(f"{len(prompts)} prompts, {new} new tokens, target {args.target} (server, int8), draft {args.draft} "
          f"(client, {draft_quantize}), method {args.method}, {threads} threads each, one machine\n")
    print("| round trip ms | plain tok/s | remote tok/s | remote / plain | target forwards per token "
          "| mean draft length | round trips | mean round trip ms | identical to plain |")
    print("|---|---|---|---|---|---|---|---|---|")
    for d in delays:
        r = rows[d]
        plain_rate, remote_rate = r["plain_tokens"] / r["plain_s"], r["remote_tokens"] / r["remote_s"]
        print(f"| {d} | {plain_rate:.2f} | {remote_rate:.2f} | {remote_rate / plain_rate:.2f} | "
              f"{r['forwards'] / max(1, r['remote_tokens']):.3f} | {sum(r['lengths']) / max(1, len(r['lengths'])):.1f} | "
              f"{r['trips']} | {1000 * r['trip_s'] / max(1, r['trips']):.0f} | {r['same']}/{len(prompts)} |")


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    main()
