"""`speclm serve` as a client sees it: a real server process on tiny models, driven by the official
`openai` client and by raw HTTP. Outputs are compared with the same requests run alone in this
process (int8 weights: the server's batch computes each row's bits as a run alone does)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from conftest import save
from tiny import byte_tokenizer, tiny_model

from speclm.engine import SpecEngine
from speclm.models.loading import load_model

KEY = "test-key-123"
PROMPTS = ["def fib(n):", "The quick brown fox", "import numpy as np\n", "for i in range(10):", "Once upon a time",
           "SELECT * FROM", "class Stack:", "hello hello hello hello"]


class Server:
    """A `speclm serve` process; stopped (SIGTERM) when the test module is done."""

    def __init__(self, *args: str, env: dict | None = None):
        cmd = [sys.executable, "-m", "speclm.cli", "serve", "--port", "0", *args]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                     env={**os.environ, **(env or {})})
        self.log: list[str] = []
        deadline = time.monotonic() + 300
        while True:
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError("server exited: " + "".join(self.log))
            self.log.append(line)
            found = re.search(r"on (http://[\d.]+:\d+)", line)
            if found:
                self.url = found.group(1)
                break
            assert time.monotonic() < deadline, "server did not start"
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        for line in self.proc.stderr:
            self.log.append(line)

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", KEY), max_retries=0, **kw)

    def metric(self, name: str, labels: str = "") -> float:
        text = httpx.get(self.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + ("{" if labels or "{" in line.split(" ")[0] else " ")) and labels in line:
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A target whose context is long enough for a stream that outlives a disconnect, and a draft."""
    root = tmp_path_factory.mktemp("serve-models")
    tok = byte_tokenizer()
    target = tiny_model(len(tok), seed=0)
    target.config.max_position_embeddings = 4096
    return {"target": save(target, tok, root / "target"),
            "draft": save(tiny_model(len(tok), seed=1, layers=1), tok, root / "draft")}


@pytest.fixture(scope="module")
def server(models):
    s = Server("--target", models["target"], "--draft", models["draft"], "--quantize", "int8",
               "--draft-quantize", "int8", "--api-key", KEY, "--max-tokens", "3000", "--prefill-chunk", "16",
               "--max-body-bytes", str(1 << 20), "--method", "draft+pld")  # the default, auto: test_auto_is_served
    yield s
    assert s.stop() == 0, "".join(s.log)


@pytest.fixture(scope="module")
def engine(models):
    target = load_model(models["target"], quantize="int8", progress=False)
    return SpecEngine(target, draft=load_model(models["draft"], quantize="int8", progress=False))


def alone(engine, prompt: str, chat: bool = False, **opts):
    """The request run alone in this process (what the server must return)."""
    opts.setdefault("method", "draft+pld")
    return engine.generate(prompt, chat=chat, **opts)


def test_completions_and_chat_with_the_openai_client(server, engine):
    client = server.client()
    assert [m.id for m in client.models.list().data] == [server_model(server)]
    out = client.completions.create(model=server_model(server), prompt=PROMPTS[0], max_tokens=40, temperature=0)
    ref = alone(engine, PROMPTS[0], max_new_tokens=40)
    assert out.choices[0].text == ref.text
    assert out.choices[0].finish_reason == ("length" if ref.finish_reason == "length" else "stop")
    assert out.usage.completion_tokens == len(ref.token_ids)
    spec = out.model_extra["speculation"]
    assert spec["method"] == "draft+pld" and spec["target_forwards"] >= 1

    chat = client.chat.completions.create(model=server_model(server), temperature=0, max_tokens=30,
                                          messages=[{"role": "user", "content": PROMPTS[1]}])
    ref = alone(engine, PROMPTS[1], chat=True, max_new_tokens=30)
    assert chat.choices[0].message.content == ref.text
    assert chat.usage.prompt_tokens == len(engine.encode([PROMPTS[1]], True)[0])

    pieces, usage = [], None
    stream = client.chat.completions.create(model=server_model(server), temperature=0, max_tokens=30, stream=True,
                                            messages=[{"role": "user", "content": PROMPTS[1]}],
                                            stream_options={"include_usage": True})
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
    assert "".join(pieces) == ref.text
    assert usage.completion_tokens == len(ref.token_ids)


def server_model(server) -> str:
    return server.client().models.list().data[0].id


def test_per_request_speculation_and_stop(server, engine):
    client = server.client()
    for spec, method in (("off", "none"), ("pld", "pld"), ({"method": "draft", "k": 3}, "draft")):
        out = client.completions.create(model=server_model(server), prompt=PROMPTS[7], max_tokens=48, temperature=0,
                                        extra_body={"speculation": spec})
        assert out.model_extra["speculation"]["method"] == method
        kw = {"k": 3} if isinstance(spec, dict) else {}
        assert out.choices[0].text == alone(engine, PROMPTS[7], method=method, max_new_tokens=48, **kw).text
    ref = alone(engine, PROMPTS[2], max_new_tokens=60)
    stop = ref.text[10:13]
    out = client.completions.create(model=server_model(server), prompt=PROMPTS[2], max_tokens=60, temperature=0,
                                    stop=[stop])
    assert out.choices[0].text == alone(engine, PROMPTS[2], max_new_tokens=60, stop=(stop,)).text
    assert out.choices[0].finish_reason == "stop" and stop not in out.choices[0].text


def test_32_concurrent_streams_equal_their_single_runs(server, engine):
    """32 streams at once through a batch of 8 (the rest queue and join as others leave), mixed
    methods, greedy and seeded sampling: each one's text equals its run alone."""
    cases = []
    for i in range(32):
        prompt = PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS))
        method = ("draft+pld", "draft", "pld", "none")[i % 4]
        sampled = i % 3 == 0
        opts = dict(method=method, max_new_tokens=20 + i, temperature=0.8 if sampled else 0.0,
                    seed=1000 + i if sampled else None)
        cases.append((prompt, opts))

    async def one(client, prompt, opts):
        body = dict(model=server_model(server), prompt=prompt, max_tokens=opts["max_new_tokens"], stream=True,
                    temperature=opts["temperature"], extra_body={"speculation": opts["method"]})
        if opts["seed"] is not None:
            body["seed"] = opts["seed"]
        text = []
        async for chunk in await client.completions.create(**body):
            text += [c.text for c in chunk.choices]
        return "".join(text)

    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        return await asyncio.gather(*(one(client, p, o) for p, o in cases))

    texts = asyncio.run(run())
    for (prompt, opts), text in zip(cases, texts):
        assert text == alone(engine, prompt, **opts).text, (prompt, opts)
    assert server.metric("speclm:kv_cache_rows_used") == 0
    assert server.metric("speclm:num_requests_running") == 0


def _send_and_leave(server, body: dict) -> bool:
    """A plain (not streamed) request on a raw socket, closed once the server runs it, the answer
    unread: True when the server had answered before the client left (nothing cancelled then)."""
    host, port = server.url.split("//")[1].split(":")
    payload = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head + payload)
        deadline = time.monotonic() + 30
        while not server.metric("speclm:num_requests_running"):
            if select.select([sock], [], [], 0)[0]:
                return True
            assert time.monotonic() < deadline, "the request never ran"
            time.sleep(0.002)
        return bool(select.select([sock], [], [], 0)[0])


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_mid_stream_frees_its_rows(server, stream):
    """A client that goes away mid-answer (a stream it closes, or a plain request it stops waiting
    for) cancels its request."""
    before = server.metric("speclm:request_success_total", 'finished_reason="cancelled"')
    body = {"prompt": PROMPTS[4], "max_tokens": 3000, "temperature": 0, "stream": stream, "speculation": "off",
            "ignore_eos": True}
    if stream:
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                             json=body) as response:
                lines = response.iter_lines()
                assert next(lines).startswith("data: ")
    else:  # the client leaves while the request runs; a machine that answered 3000 tokens first tries again
        assert not all(_send_and_leave(server, body) for _ in range(5)), "every answer came before the client left"
    # the client is gone: the request leaves the batch at the next step
    deadline = time.monotonic() + 30
    while server.metric("speclm:request_success_total", 'finished_reason="cancelled"') == before:
        assert time.monotonic() < deadline, "the request was not cancelled"
        time.sleep(0.1)
    while server.metric("speclm:kv_cache_rows_used") or server.metric("speclm:num_requests_running"):
        assert time.monotonic() < deadline, "rows left behind"
        time.sleep(0.1)


def raw(server, method: str, path: str, key: str | None = KEY, **kw) -> httpx.Response:
    headers = kw.pop("headers", {})
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.request(method, server.url + path, headers=headers, timeout=60, **kw)


@pytest.mark.parametrize("case", ["no key", "wrong key", "malformed json", "wrong type", "n=17", "bad speculation",
                                  "prompt too long", "max_tokens over cap", "body too large", "unknown model",
                                  "not an object", "empty messages", "tools", "unknown field", "bad regex",
                                  "bad schema", "two constraints", "logit_bias",
                                  "message field"])
def test_errors_are_openai_shaped(server, case):
    chat = "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    expect = {"no key": (401, dict(key=None, json={"messages": msgs})),
              "wrong key": (401, dict(key="nope", json={"messages": msgs})),
              "malformed json": (400, dict(content=b'{"messages": [', headers={"Content-Type": "application/json"})),
              "wrong type": (400, dict(json={"messages": msgs, "temperature": "hot"})),
              "n=17": (400, dict(json={"messages": msgs, "n": 17})),
              "bad speculation": (400, dict(json={"messages": msgs, "speculation": {"method": "magic"}})),
              "prompt too long": (400, dict(json={"messages": [{"role": "user", "content": "x" * 5000}]})),
              "max_tokens over cap": (400, dict(json={"messages": msgs, "max_tokens": 3001})),
              "body too large": (413, dict(content=b"{" + b" " * (1 << 20) + b"}")),
              "unknown model": (404, dict(json={"messages": msgs, "model": "gpt-9"})),
              "not an object": (400, dict(json=[1, 2])),
              "empty messages": (400, dict(json={"messages": []})),
              # a field the server does not honour is refused, never ignored; the 400 names it
              "tools": (400, dict(json={"messages": msgs, "tools": [{"type": "function", "function": {"name": "f"}}]})),
              "unknown field": (400, dict(json={"messages": msgs, "repetition_penalty": 1.2})),
              "bad regex": (400, dict(json={"messages": msgs, "regex": "(ab"})),
              "bad schema": (400, dict(json={"messages": msgs, "response_format": {"type": "json_schema",
                                                                                   "json_schema": {"schema": 3}}})),
              "two constraints": (400, dict(json={"messages": msgs, "regex": "a+", "grammar": 'start: "a"'})),
              "logit_bias": (400, dict(json={"messages": msgs, "logit_bias": {"5": 10}})),
              "message field": (400, dict(json={"messages": [{"role": "user", "content": "hi", "name": "ann"}]}))}
    named = {"tools": "tools", "unknown field": "repetition_penalty", "bad regex": "regex", "bad schema": "json schema",
             "two constraints": "one constraint", "logit_bias": "logit_bias", "message field": "messages.0.name"}
    status, kw = expect[case]
    response = raw(server, "POST", chat, **kw)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    assert named.get(case, "") in error["message"], error
    assert raw(server, "GET", "/health", key=None).status_code == 200  # open without a key


def test_structured_output_with_the_openai_client(server, engine):
    """The official client's structured outputs (a pydantic model: a strict JSON schema), JSON mode,
    and speclm's regex: each the same as the request run alone, and each parses."""
    from typing import Literal

    from pydantic import BaseModel

    class Item(BaseModel):
        tag: Literal["ab", "ba", "c"]
        ok: bool

    client = server.client()
    msgs = [{"role": "user", "content": "Reply in JSON: tag and ok."}]
    parsed = client.chat.completions.parse(model=server_model(server), messages=msgs, response_format=Item,
                                           max_tokens=400, temperature=0)
    item = parsed.choices[0].message.parsed
    assert isinstance(item, Item) and parsed.choices[0].finish_reason == "stop"
    schema = {"type": "json_schema", "json_schema": {"name": "Item", "schema": Item.model_json_schema()}}
    for fmt in ({"type": "json_object"}, schema):
        out = client.chat.completions.create(model=server_model(server), messages=msgs, max_tokens=120, temperature=0,
                                             response_format=fmt)
        ref = alone(engine, msgs[0]["content"], chat=True, max_new_tokens=120, response_format=fmt)
        assert out.choices[0].message.content == ref.text
        if out.choices[0].finish_reason == "stop":
            json.loads(ref.text)
    out = client.completions.create(model=server_model(server), prompt=PROMPTS[1], max_tokens=30, temperature=0,
                                    extra_body={"regex": "(ab|ba)+c", "user": "someone"})  # user: harmless, taken
    ref = alone(engine, PROMPTS[1], max_new_tokens=30, regex="(ab|ba)+c")
    assert out.choices[0].text == ref.text and re.fullmatch("(ab|ba)+c?", ref.text), ref.text


def test_logprobs_with_the_openai_client(server, engine):
    """Chat's logprobs/top_logprobs and completions' logprobs, whole and streamed: the target's own
    log-probabilities of the tokens plain decoding commits (int8: the same bits), with speculation."""
    client = server.client()
    msgs = [{"role": "user", "content": PROMPTS[7]}]
    ref = alone(engine, PROMPTS[7], chat=True, max_new_tokens=24, logprobs=3)
    assert ref.logprobs == alone(engine, PROMPTS[7], chat=True, max_new_tokens=24, logprobs=3, method="none").logprobs
    out = client.chat.completions.create(model=server_model(server), messages=msgs, max_tokens=24, temperature=0,
                                         logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert [c.logprob for c in content] == [e.logprob for e in ref.logprobs]
    assert [[t.logprob for t in c.top_logprobs] for c in content] == [[v for _, v in e.top] for e in ref.logprobs]
    assert all(len(c.bytes) == 1 for c in content)  # the byte tokenizer: one byte per token (no EOS in 24)
    joined = b"".join(bytes(c.bytes) for c in content).decode("utf-8", "replace")
    assert "\ufffd" in joined or joined == out.choices[0].message.content
    streamed = []
    for chunk in client.chat.completions.create(model=server_model(server), messages=msgs, max_tokens=24,
                                                temperature=0, logprobs=True, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [c.logprob for c in streamed] == [e.logprob for e in ref.logprobs]
    assert all(c.top_logprobs == [] for c in streamed)
    text = client.completions.create(model=server_model(server), prompt=PROMPTS[7], max_tokens=16, temperature=0,
                                     logprobs=2)
    ref = alone(engine, PROMPTS[7], max_new_tokens=16, logprobs=2)
    lp = text.choices[0].logprobs
    assert lp.token_logprobs == [e.logprob for e in ref.logprobs] and len(lp.tokens) == len(ref.token_ids)
    # the legacy shape keys alternatives by their text: two byte pieces both shown as U+FFFD are one key
    assert all(set(t.values()) <= {v for _, v in e.top} for t, e in zip(lp.top_logprobs, ref.logprobs))
    assert lp.text_offset[0] == 0
    bad = raw(server, "POST", "/v1/chat/completions", json={"messages": msgs, "top_logprobs": 2})
    assert bad.status_code == 400 and "top_logprobs" in bad.json()["error"]["message"]


def test_n_choices(server, engine):
    """n sampled choices, each its single run with seed + i, the later ones reading the prompt from
    the first's keys and values; greedy choices all the one output; streamed as whole."""
    client = server.client()
    msgs = [{"role": "user", "content": PROMPTS[3]}]
    out = client.chat.completions.create(model=server_model(server), messages=msgs, max_tokens=20, temperature=0.9,
                                         seed=7, n=3)
    runs = [alone(engine, PROMPTS[3], chat=True, max_new_tokens=20, temperature=0.9, seed=7 + i) for i in range(3)]
    refs = [r.text for r in runs]
    assert [c.message.content for c in sorted(out.choices, key=lambda c: c.index)] == refs
    assert out.usage.completion_tokens == sum(len(r.token_ids) for r in runs)
    assert all(c.model_extra["speculation"]["cached_prompt_tokens"] > 0 for c in out.choices[1:])  # the shared prefill
    text = client.completions.create(model=server_model(server), prompt=PROMPTS[2], max_tokens=16, temperature=0, n=2)
    assert len(text.choices) == 2 and text.choices[0].text == text.choices[1].text == alone(
        engine, PROMPTS[2], max_new_tokens=16).text
    streamed: dict[int, str] = {}
    finished = set()
    for chunk in client.chat.completions.create(model=server_model(server), messages=msgs, max_tokens=20,
                                                temperature=0.9, seed=7, n=3, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finished.add(c.index)
    assert [streamed[i] for i in range(3)] == refs and finished == {0, 1, 2}


def test_queue_full_is_429_with_retry_after(models):
    s = Server("--target", models["target"], "--quantize", "int8", "--max-batch", "1", "--max-queue", "1",
               "--method", "none")
    try:
        body = {"prompt": PROMPTS[4], "max_tokens": 3000, "temperature": 0, "stream": True, "ignore_eos": True}
        with httpx.Client(timeout=60) as a, httpx.Client(timeout=60) as b:
            with a.stream("POST", s.url + "/v1/completions", json=body) as first:
                first_lines = first.iter_lines()  # kept: an iterator dropped closes its stream
                next(first_lines)  # running: the batch's one row
                with b.stream("POST", s.url + "/v1/completions", json=body) as second:  # queued
                    assert second.status_code == 200
                    deadline = time.monotonic() + 30
                    while s.metric("speclm:num_requests_waiting") < 1:
                        assert time.monotonic() < deadline
                        time.sleep(0.02)
                    third = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
                    assert third.status_code == 429 and third.headers["retry-after"] == "1"
                    assert third.json()["error"]["type"] == "rate_limit_error"
    finally:
        assert s.stop() == 0


def test_sigterm_lets_streams_finish_and_refuses_new_requests(models, engine):
    s = Server("--target", models["target"], "--draft", models["draft"], "--quantize", "int8", "--draft-quantize",
               "int8", "--grace", "60")
    results = {}

    def stream(i):
        body = {"prompt": PROMPTS[i], "max_tokens": 1500, "temperature": 0, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=120) as response:
            lines = [line for line in response.iter_lines() if line]
        results[i] = lines

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while s.metric("speclm:num_requests_running") < 3:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    s.proc.send_signal(signal.SIGTERM)
    refused = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=30)
    assert refused.status_code == 503, refused.text
    assert httpx.get(s.url + "/health", timeout=30).status_code == 503
    for t in threads:
        t.join(120)
    assert s.proc.wait(120) == 0
    for i in range(3):
        assert results[i][-1] == "data: [DONE]"
        text = "".join(c["text"] for line in results[i][:-1] for c in json.loads(line[6:])["choices"])
        assert text == alone(engine, PROMPTS[i], max_new_tokens=1500, ignore_eos=True).text


def test_bad_command_line_is_one_line_exit_2(models, tmp_path):
    for args, message in ((["--target", models["target"], "--method", "draft"], "needs --draft"),
                          (["--target", models["target"], "--max-batch", "0"], "max-batch"),
                          (["--target", str(tmp_path / "missing")], "")):
        done = subprocess.run([sys.executable, "-m", "speclm.cli", "serve", *args], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("speclm: error:") and message in lines[0]


def test_page_is_served_with_the_model_name(server):
    page = raw(server, "GET", "/", key=None)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert Path(server_model(server)).name in page.text


def test_a_failing_step_fails_its_requests_and_the_server_goes_on(engine):
    """In process: a step that raises (a planted bug) ends its requests with an error event; the
    engine thread goes on with a fresh batch, and the next request gets its normal output."""
    from speclm.serve.scheduler import Scheduler

    scheduler = Scheduler(engine, max_batch=2)

    def broken():
        raise RuntimeError("planted failure")

    scheduler.batch.step = broken
    scheduler.start()

    async def run():
        failed = scheduler.submit(engine.request(PROMPTS[0], method="none", max_new_tokens=8))
        events = await asyncio.wait_for(failed.take(), 60)
        assert events[0][0] == "error" and "planted failure" in events[0][1]
        ok = scheduler.submit(engine.request(PROMPTS[0], method="pld", max_new_tokens=8))
        events = []
        while not events or events[-1][0] == "text":
            events += await asyncio.wait_for(ok.take(), 60)
        assert events[-1][0] == "done" and all(e[0] == "text" for e in events[:-1])
        return "".join(e[1] for e in events[:-1])

    try:
        assert asyncio.run(run()) == alone(engine, PROMPTS[0], method="none", max_new_tokens=8).text
        assert "planted failure" in scheduler.last_failure
    finally:
        scheduler.stop()


def test_a_ticket_whose_loop_has_closed_is_flushed_without_error(engine):
    """A request's text committed after its handler's event loop closed (the server shutting down
    mid-request) is dropped: flushing it must not raise on the engine thread."""
    from speclm.serve.scheduler import Ticket

    loop = asyncio.new_event_loop()
    ticket = Ticket(engine.request(PROMPTS[0], method="none", max_new_tokens=4), loop)
    loop.close()
    ticket.put(("text", "x", False))
    ticket.flush()
    assert list(ticket._events) == [("text", "x", False)]


def test_auto_is_served(server, engine):
    """A request asking for auto: planned per round by the server's policy, its output plain decoding's,
    and its plan in the speculation object."""
    client = server.client()
    for prompt in PROMPTS[:3]:
        out = client.completions.create(model=server_model(server), prompt=prompt, max_tokens=30, temperature=0,
                                        extra_body={"speculation": "auto"})
        assert out.choices[0].text == alone(engine, prompt, max_new_tokens=30).text
        spec = out.model_extra["speculation"]
        assert spec["method"] == "auto" and sum(spec["planned"].values()) == spec["target_forwards"] - 1
