"""`speclm bench-serve`: a load benchmark of a running `speclm serve`, measured as its clients see it.

Cells: for each concurrency c, for each speculation mode (the modes take turns at each concurrency,
so drift of the machine hits them alike), the same prompts are sent by c client workers; a worker
sends its next request as soon as its last one has ended, so exactly c requests are in flight until
the prompts run out (or the cell's time limit passes: no request starts after it). Requests are
streamed chat completions (each prompt one user message; temperature 0, max_tokens, usage on).
Modes: off (`"speculation": "off"`, plain decoding), on (the server's method with its k fixed every
round), adaptive (no speculation field: the server's adaptive policy picks each round's length), and
a method by name, `M` (`"speculation": "M"`: that method under the server's policy, so `auto` beside
`draft+pld` on one server, interleaved) or `M:k=N` (that method with k fixed at N).

Per request, timed on the client (time.perf_counter) as each server-sent event arrives: TTFT (send
to the first chunk with text), the arrival of every text chunk, the end of the stream, and the
server's usage and speculation counts. Inter-token latency (ITL) of a request: (end - first text) /
(completion tokens - 1); a chunk may carry several tokens (a speculation round commits them
together), so the gaps between chunks are kept as well. A cell's throughput: its completion tokens
over its wall time (first send to last end); its percentiles are over its requests.

Before the cells every prompt is sent once for a few tokens, untimed: that checks each prompt fits
and warms the server (first-call allocations, its prefix cache), so the first cell starts as warm
as the others. The client runs on the server's machine (loopback only) and takes a little of its CPU.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import json
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from speclm.errors import UsageError

SCHEMA_VERSION = 1
MODES = ("off", "on", "adaptive")
LOOPBACK = ("127.0.0.1", "::1", "localhost")
WARMUP_TOKENS = 4


@dataclass
class Record:
    """One request of a cell; times in seconds, `sent` from the cell's start, the rest from the send."""

    concurrency: int
    mode: str
    prompt: int  # index in the prompt list
    prompt_id: str
    category: str
    sent: float = 0.0
    ttft: float | None = None
    chunks: list[float] = field(default_factory=list)  # arrival of each chunk with text
    end: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    speculation: dict | None = None
    text_sha1: str | None = None  # greedy: the same in every mode, if speculation is lossless
    error: str | None = None


def _itl(r: dict) -> float | None:
    if r["error"] or not r["chunks"] or (r["completion_tokens"] or 0) < 2:
        return None
    return (r["end"] - r["chunks"][0]) / (r["completion_tokens"] - 1)


def bench_serve(args, argv: list[str], progress: bool = False) -> int:
    from speclm.bench.dataset import load_prompts

    url, headers = _check_url(args.url), _headers(args.api_key)
    concurrency = _ints(args.concurrency, "concurrency")
    for name, value in (("requests", args.requests), ("max-tokens", args.max_tokens)):
        if value < 1:
            raise UsageError(f"--{name} must be >= 1, got {value}")
    if not args.time_limit > 0:
        raise UsageError(f"--time-limit must be > 0 seconds, got {args.time_limit}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} exists and is not a folder")
    categories = [c.strip() for c in args.categories.split(",")] if args.categories else None
    loaded = _round_robin(load_prompts(args.dataset, categories, args.per_category))
    prompts = [loaded[i % len(loaded)] for i in range(args.requests)]  # fewer prompts than requests: again
    model, info = server_info(url, headers)
    modes, skipped = choose_modes(args.modes, info)
    if args.max_tokens > info["max_tokens"]:
        raise UsageError(f"--max-tokens {args.max_tokens}: this server allows at most {info['max_tokens']}")

    from speclm.bench.machine import machine_facts

    results = {
        "schema": SCHEMA_VERSION,
        "command": _command(argv),
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "complete": False,
        "machine": machine_facts(),
        "server": {"url": url, "model": model, "speclm": info},
        "config": {"concurrency": concurrency, "modes": modes, "skipped_modes": skipped, "dataset": args.dataset,
                   "categories": categories, "per_category": args.per_category, "requests": args.requests,
                   "max_tokens": args.max_tokens, "time_limit": args.time_limit, "temperature": 0.0},
        "prompts": [{"id": p.prompt_id, "category": p.category} for p in prompts],
        "cells": [],
        "requests": [],
    }
    bodies = {m: _body(model, m, info, args.max_tokens) for m in modes}
    try:
        asyncio.run(_run(url, headers, prompts, min(len(loaded), len(prompts)), concurrency, modes, bodies,
                         args.time_limit, results, out, progress))
        results["complete"] = True
    finally:  # an interrupted run keeps the cells it finished
        if results["cells"]:
            write_all(results, out)
    print((out / "report.md").read_text(encoding="utf-8"))
    print(f"results in {out}/", file=sys.stderr)
    failed = [r for r in results["requests"] if r["error"]]
    if failed:
        print(f"speclm: WARNING: {len(failed)} request(s) failed, the first: {failed[0]['error']}", file=sys.stderr)
    return 1 if failed else 0


def _check_url(raw: str) -> str:
    """The server's root URL (no /v1, no trailing slash); a server on this machine only: the numbers
    of a remote one would mix the network's latency into the server's."""
    parts = urlsplit(raw)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"--url must be http://HOST:PORT, got '{raw}'")
    if parts.hostname not in LOOPBACK:
        raise UsageError(f"--url: the server must be on this machine ({', '.join(LOOPBACK)}), not {parts.hostname}")
    return f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/').removesuffix('/v1')}"


def _headers(api_key: str | None) -> dict:
    key = api_key if api_key is not None else os.environ.get("SPECLM_API_KEY") or None
    return {"Authorization": f"Bearer {key}"} if key else {}


def _ints(text: str, name: str) -> list[int]:
    try:
        values = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise UsageError(f"--{name} must be a comma list of whole numbers, got '{text}'") from None
    if not values or values[0] < 1:
        raise UsageError(f"--{name} must be whole numbers >= 1, got '{text}'")
    return values


def _round_robin(prompts: list) -> list:
    """The prompts category by category in turn, so the first N span the categories."""
    by_cat: dict[str, list] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    width = max(len(v) for v in by_cat.values())
    return [v[i] for i in range(width) for v in by_cat.values() if i < len(v)]


def _command(argv: list[str]) -> str:
    """The command line, with an --api-key's value hidden (results are shared; keys are not)."""
    shown, hide = [], False
    for a in argv:
        shown.append("***" if hide else "--api-key=***" if a.startswith("--api-key=") else a)
        hide = a == "--api-key"
    return "speclm " + shlex.join(shown)


def server_info(url: str, headers: dict) -> tuple[str, dict]:
    """The served model's id and its speclm section of /v1/models (method, k, speculation, ...)."""
    import httpx

    try:
        r = httpx.get(url + "/v1/models", headers=headers, timeout=30, trust_env=False)
    except httpx.HTTPError as exc:
        raise UsageError(f"cannot reach a server at {url} ({' '.join(str(exc).split()) or type(exc).__name__}); "
                         "start one with `speclm serve`") from None
    if r.status_code == 401:
        raise UsageError(f"{url} wants an API key: --api-key KEY or env SPECLM_API_KEY"
                         + (" (the one given was refused)" if headers else ""))
    try:
        model = r.json()["data"][0]
        info = model["speclm"]
        if not all(key in info for key in ("method", "k", "max_tokens")):
            raise KeyError("speclm")
    except (ValueError, LookupError, TypeError):
        raise UsageError(f"{url}/v1/models (HTTP {r.status_code}) is not a speclm server's answer") from None
    return model["id"], info


def choose_modes(requested: str | None, info: dict) -> tuple[list[str], dict[str, str]]:
    """The modes to run and those left out, with why. A mode the server cannot run is an error when
    asked for by name; left out of the default list with a note in the report."""
    modes = [m.strip() for m in (requested or ",".join(MODES)).split(",") if m.strip()]
    if not modes:
        raise UsageError(f"--modes: choose from {', '.join(MODES)} or a method, got '{requested}'")
    for m in modes:
        if m not in MODES:
            _method_mode(m, info)
    modes = list(dict.fromkeys(modes))
    why = {}
    if info["method"] == "none":
        why["on"] = why["adaptive"] = "the server's method is none (plain decoding): nothing to speculate with"
    elif info.get("speculation") != "adaptive":
        why["adaptive"] = "the server runs fixed speculation (speclm serve --speculation fixed)"
    skipped = {m: why[m] for m in modes if m in why}
    if skipped and requested is not None:
        m = next(iter(skipped))
        raise UsageError(f"--modes {m}: {skipped[m]}")
    return [m for m in modes if m not in skipped], skipped


def _method_mode(mode: str, info: dict) -> str | dict:
    """A mode naming a method, `M` or `M:k=N`, as the request's speculation field."""
    from speclm.methods import DRAFT_MODEL, NAMES, method

    name, colon, rest = mode.partition(":")
    if name not in NAMES:
        raise UsageError(f"--modes: choose from {', '.join(MODES)} or a method ({', '.join(NAMES)}), got '{mode}'")
    if method(name).needs == DRAFT_MODEL and not info.get("draft"):
        raise UsageError(f"--modes {mode}: {name} needs a draft model and the server has none (speclm serve --draft)")
    if not colon:
        return name
    key, _, value = rest.partition("=")
    if key != "k" or not value.isdigit() or int(value) < 1:
        raise UsageError(f"--modes {mode}: write a method's fixed draft length as {name}:k=N, N >= 1")
    return {"method": name, "k": int(value)}


def _body(model: str, mode: str, info: dict, max_tokens: int) -> dict:
    body = {"model": model, "temperature": 0, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    if mode == "off":
        body["speculation"] = "off"
    elif mode == "on":  # a request that sets k keeps it every round
        body["speculation"] = {"method": info["method"], "k": info["k"]}
    elif mode != "adaptive":
        body["speculation"] = _method_mode(mode, info)
    return body  # adaptive: the server's default


async def _run(url, headers, prompts, distinct, concurrency, modes, bodies, time_limit, results, out, progress) -> None:
    import httpx
    from tqdm.auto import tqdm

    most = max(concurrency)
    client = httpx.AsyncClient(base_url=url, headers=headers, trust_env=False,
                               timeout=httpx.Timeout(30, read=600), limits=httpx.Limits(max_connections=most + 1))
    async with client:
        for mode in modes[:-1]:  # a mode the server refuses (a method it cannot run) stops the run here
            await _warm_up(client, prompts[:1], bodies[mode], 1)
        await _warm_up(client, prompts[:distinct], bodies[modes[-1]], most)
        out.mkdir(parents=True, exist_ok=True)
        bar = tqdm(total=len(concurrency) * len(modes) * len(prompts), desc="bench-serve", unit="req",
                   disable=not progress)
        with bar:
            for c in concurrency:
                for mode in modes:
                    bar.set_postfix_str(f"concurrency {c}, {mode}")
                    records, wall, started = await _cell(client, prompts, c, mode, bodies[mode], time_limit, bar.update)
                    results["requests"] += [asdict(r) for r in records]
                    results["cells"].append({"concurrency": c, "mode": mode, "wall_seconds": wall,
                                             "time_limited": started < len(prompts)})
                    write_all(results, out, report=False)  # results.json after every cell


async def _warm_up(client, prompts, body: dict, concurrency: int) -> None:
    """Every prompt once, a few tokens: a prompt the server refuses (too long, no chat template)
    stops the run here, before any cell."""
    body = {**body, "max_tokens": min(WARMUP_TOKENS, body["max_tokens"])}
    todo = iter(range(len(prompts)))

    async def worker():
        for i in todo:
            r = Record(0, "warm-up", i, prompts[i].prompt_id, prompts[i].category)
            await _request(client, body, prompts[i].text, r)
            if r.error:
                raise UsageError(f"prompt {r.prompt_id} ({r.category}): {r.error}")

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _cell(client, prompts, c: int, mode: str, body: dict, time_limit: float, done):
    """(records, wall seconds, requests started) of c workers sending the prompts in order."""
    todo = iter(range(len(prompts)))
    records: list[Record] = []
    start = time.perf_counter()
    deadline = start + time_limit

    async def worker():
        for i in todo:
            r = Record(c, mode, i, prompts[i].prompt_id, prompts[i].category, sent=time.perf_counter() - start)
            records.append(r)
            await _request(client, body, prompts[i].text, r)
            done(1)
            if time.perf_counter() >= deadline:
                return

    await asyncio.gather(*(worker() for _ in range(c)))
    wall = time.perf_counter() - start
    return sorted(records, key=lambda r: r.prompt), wall, len(records)


async def _request(client, body: dict, prompt: str, r: Record) -> None:
    """Streams one chat completion into `r`; a failure is recorded, not raised."""
    import httpx

    text: list[str] = []
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/chat/completions",
                                 json={**body, "messages": [{"role": "user", "content": prompt}]}) as response:
            if response.status_code != 200:
                r.error = f"HTTP {response.status_code}: {_message(await response.aread())}"
            else:
                await _read_events(response, r, text, t0)
    except httpx.HTTPError as exc:
        r.error = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    r.end = round(time.perf_counter() - t0, 6)
    r.ttft = r.chunks[0] if r.chunks else None
    r.text_sha1 = hashlib.sha1("".join(text).encode()).hexdigest()[:16]
    if r.error is None and r.completion_tokens is None:
        r.error = "the stream ended without its usage chunk"


async def _read_events(response, r: Record, text: list[str], t0: float) -> None:
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        now = round(time.perf_counter() - t0, 6)
        if line == "data: [DONE]":
            return
        event = json.loads(line[6:])
        if "error" in event:
            r.error = str(event["error"].get("message"))
            return
        for choice in event.get("choices") or ():
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                r.chunks.append(now)
                text.append(piece)
        if event.get("speculation"):
            r.speculation = event["speculation"]
        if event.get("usage"):
            r.prompt_tokens = event["usage"]["prompt_tokens"]
            r.completion_tokens = event["usage"]["completion_tokens"]


def _message(raw: bytes) -> str:
    try:
        return str(json.loads(raw)["error"]["message"])
    except (ValueError, LookupError, TypeError):
        return " ".join(raw.decode("utf-8", "replace").split())[:200]


# ---- summary, report, plots: computed from results.json alone


def _pct(values: list[float], q: float) -> float | None:
    import numpy as np

    return float(np.percentile(values, q)) if values else None


def summarize(results: dict) -> list[dict]:
    reference = {}  # prompt index -> off's text at the lowest concurrency: greedy, every mode's should equal it
    for r in results["requests"]:
        if r["mode"] == "off" and not r["error"]:
            reference.setdefault(r["prompt"], r["text_sha1"])
    rows = []
    for cell in results["cells"]:
        rs = [r for r in results["requests"] if r["concurrency"] == cell["concurrency"] and r["mode"] == cell["mode"]]
        ok = [r for r in rs if not r["error"]]
        tokens = sum(r["completion_tokens"] for r in ok)
        spec = [r["speculation"] for r in ok if r["speculation"]]
        forwards = sum(s["target_forwards"] for s in spec)
        drafted = sum(s["draft_tokens"] for s in spec)
        prompt_tokens = sum(r["prompt_tokens"] for r in ok)
        itl = [x for x in map(_itl, ok) if x is not None]
        ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
        gaps = [b - a for r in ok for a, b in zip(r["chunks"], r["chunks"][1:])]
        compared = [r for r in ok if r["prompt"] in reference]
        rows.append({
            **cell, "requests": len(ok), "errors": len(rs) - len(ok), "completion_tokens": tokens,
            "tokens_per_second": tokens / cell["wall_seconds"] if cell["wall_seconds"] else 0.0,
            "ttft_p50": _pct(ttft, 50), "ttft_p99": _pct(ttft, 99),
            "itl_p50": _pct(itl, 50), "itl_p99": _pct(itl, 99),
            "chunk_gap_p50": _pct(gaps, 50), "chunk_gap_p99": _pct(gaps, 99),
            # as the server counts forwards: a prompt's prefill chunks too (plain decoding of a long prompt: < 1)
            "tokens_per_forward": sum(r["completion_tokens"] for r in ok if r["speculation"]) / forwards if forwards else None,
            "acceptance_rate": sum(s["accepted_tokens"] for s in spec) / drafted if drafted else None,
            "cached_prompt_share": (sum(s.get("cached_prompt_tokens", 0) for s in spec) / prompt_tokens
                                    if prompt_tokens and spec else None),
            "same_text_as_off": (sum(r["text_sha1"] == reference[r["prompt"]] for r in compared), len(compared)),
        })
    for row in rows:
        off = next((x for x in rows if x["mode"] == "off" and x["concurrency"] == row["concurrency"]), None)
        row["speedup_vs_off"] = (row["tokens_per_second"] / off["tokens_per_second"]
                                 if off and off["tokens_per_second"] else None)
    return rows


def _fmt(x, spec=".2f", scale=1.0) -> str:
    return "–" if x is None else format(x * scale, spec)


def markdown(results: dict, summary: list[dict]) -> str:
    cfg, server, mach = results["config"], results["server"], results["machine"]
    info = server["speclm"]
    lines = ["# speclm serve load benchmark", ""]
    if not results["complete"]:
        lines += [f"**Incomplete run**: interrupted after {len(results['cells'])} cells; the table covers those.", ""]
    lines += [
        f"Command: `{results['command']}`", "",
        f"Created {results['created']}. Server {server['url']}, model `{server['model']}`"
        f"{', draft `' + info['draft'] + '`' if info.get('draft') else ''}; method {info['method']}, k {info['k']}, "
        f"{info.get('speculation')} speculation by default, max batch {info.get('max_batch')}.", "",
        f"Each cell: {cfg['requests']} streamed chat completions (dataset {cfg['dataset']}, each prompt one user "
        f"message), temperature 0, max_tokens {cfg['max_tokens']}, with exactly `concurrency` requests in flight; "
        f"time limit {cfg['time_limit']:g} s per cell. Modes: off = plain decoding; on = the server's method with "
        f"k {info['k']} fixed; adaptive = the server's adaptive draft length; a method's name = that method under the "
        f"server's policy (`M:k=N`: k fixed at N).", "",
        f"Machine: {mach['cpu']}, {mach['cpu_count']} CPUs{', GPU ' + mach['cuda'] if mach.get('cuda') else ''}; "
        f"the client ran on it too.", "",
        "| concurrency | mode | requests | tokens | wall s | tokens/s | speedup vs off | TTFT p50 ms | TTFT p99 ms "
        "| ITL p50 ms | ITL p99 ms | tokens/forward | prompt cached |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        failed = f" ({s['errors']} failed)"
        lines.append(
            f"| {s['concurrency']} | {s['mode']} | {s['requests']}{failed if s['errors'] else ''}"
            f"{' (time limit)' if s['time_limited'] else ''} | {s['completion_tokens']} | {s['wall_seconds']:.2f} | "
            f"{_fmt(s['tokens_per_second'])} | {_fmt(s['speedup_vs_off'])} | {_fmt(s['ttft_p50'], '.1f', 1e3)} | "
            f"{_fmt(s['ttft_p99'], '.1f', 1e3)} | {_fmt(s['itl_p50'], '.1f', 1e3)} | {_fmt(s['itl_p99'], '.1f', 1e3)} | "
            f"{_fmt(s['tokens_per_forward'])} | {_fmt(s['cached_prompt_share'], '.0%')} |")
    lines += ["", "tokens/s: the cell's completion tokens over its wall time (first send to last end). TTFT: send to "
              "the first text. ITL: a request's (end - first text) / (tokens - 1); percentiles over the cell's "
              "requests (chunk gaps, which group a round's tokens, are in results.json). tokens/forward: tokens the "
              "requests returned per target forward, as the server's speculation counts forwards (a long prompt's "
              "prefill chunks count, so plain decoding can show less than 1). prompt cached: the share of the cell's "
              "prompt tokens the server's prefix cache held (read from it, not computed)."]
    shares: dict[int, list[float]] = {}  # concurrency -> its cells' cached shares
    for s in summary:
        if s["cached_prompt_share"] is not None:
            shares.setdefault(s["concurrency"], []).append(s["cached_prompt_share"])
    uneven = sorted(c for c, x in shares.items() if max(x) - min(x) > 0.10)
    if uneven:
        lines += ["", f"**The prefix cache held unequal shares of the prompts across modes** at concurrency "
                  f"{', '.join(map(str, uneven))} (more than 10 points apart): there the modes' TTFT and tokens/s "
                  "differ by what the cache spared them too. For an A/B of speculation alone, serve with "
                  "`--prefix-cache 0`."]
    for mode, why in cfg["skipped_modes"].items():
        lines += ["", f"Mode {mode} was left out: {why}."]
    over = [c for c in cfg["concurrency"] if info.get("max_batch") and c > info["max_batch"]]
    if over:
        lines += ["", f"Concurrency {', '.join(map(str, over))} is above the server's max batch ({info['max_batch']}): "
                  "the extra requests queued, and their TTFT includes the wait."]
    same = [s["same_text_as_off"] for s in summary if s["mode"] != "off" and s["same_text_as_off"][1]]
    if same:
        equal, total = sum(a for a, _ in same), sum(b for _, b in same)
        lines += ["", f"Greedy outputs equal to off's for the same prompt: {equal} of {total} speculative requests."]
    lines += ["", "Plots: `throughput.png`, `itl.png`.", ""]
    return "\n".join(lines)


def plots(summary: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(s["mode"] for s in summary))
    for name, key, scale, label in (("throughput.png", "tokens_per_second", 1.0, "tokens/s (all requests)"),
                                    ("itl.png", "itl_p50", 1e3, "inter-token latency p50 (ms)")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for mode in modes:
            pts = [(s["concurrency"], s[key] * scale) for s in summary if s["mode"] == mode and s[key] is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({s["concurrency"] for s in summary}), [str(c) for c in sorted({s["concurrency"] for s in summary})])
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
        fig.tight_layout()
        tmp = out / (name + ".tmp")
        fig.savefig(tmp, format="png", dpi=110)
        plt.close(fig)
        tmp.replace(out / name)


def write_all(results: dict, out: Path, report: bool = True) -> None:
    """results.json (with the summary), then report.md and the plots; each file replaced whole."""
    from speclm.files import atomic_write

    results["summary"] = summarize(results)
    atomic_write(out / "results.json", json.dumps(results, indent=1))
    if report:
        atomic_write(out / "report.md", markdown(results, results["summary"]))
        plots(results["summary"], out)

