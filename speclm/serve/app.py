"""The HTTP routes: OpenAI's chat and text completions (streaming by server-sent events or not),
models, health, Prometheus metrics and a page to try it. Handlers check and encode a request,
hand it to the engine thread (speclm.serve.scheduler) and relay its events."""

from __future__ import annotations

import asyncio
import hmac
import json
import sys
import traceback
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from speclm.methods import DRAFT_MODEL, method
from speclm.errors import UsageError
from speclm.options import GenerationOptions
from speclm.text import token_pieces
from speclm.serve.protocol import ApiError, ChatRequest, CompletionRequest, parse
from speclm.serve.remote import ROUTE as VERIFY_ROUTE, Sessions, add_routes
from speclm.serve.scheduler import Scheduler, Ticket
from speclm.text import tokenizer_fingerprint

PAGE = Path(__file__).parent / "static" / "index.html"
OPEN_ROUTES = ("/health", "/")  # no API key: the page is static (it asks for the key to call the API)


@dataclass
class ServerConfig:
    model_name: str  # the id clients pass as "model" and /v1/models lists
    options: GenerationOptions  # the server's defaults for every request (method, k, draft options)
    api_key: str | None = None
    max_tokens_cap: int = 4096  # a request's max_tokens at most (400 beyond it)
    max_body_bytes: int = 4 << 20  # a request body at most (413 beyond it)
    max_sessions: int = 64  # remote verification sessions at most (speclm.serve.remote; 429 beyond it)
    session_ttl: float = 600.0  # seconds a verification session waits for its next call before it is dropped


def create_app(scheduler: Scheduler, config: ServerConfig) -> FastAPI:
    app = FastAPI(title="speclm", docs_url=None, redoc_url=None, openapi_url=None)
    engine, metrics = scheduler.engine, scheduler.metrics
    key = config.api_key.encode() if config.api_key else None
    app.state.scheduler = scheduler
    app.state.sessions = sessions = Sessions(config.max_sessions, config.session_ttl)

    app.add_middleware(_Guard, key=key, metrics=metrics)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return _error(exc)

    @app.exception_handler(Exception)
    async def bug(request: Request, exc: Exception):  # logged with its traceback; the client gets one line
        traceback.print_exception(exc, file=sys.stderr)
        return _error(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"))

    @app.exception_handler(404)
    async def not_found(request: Request, exc):
        return _error(ApiError(404, f"no route {request.method} {request.url.path}", code="not_found"))

    @app.exception_handler(405)
    async def wrong_method(request: Request, exc):
        return _error(ApiError(405, f"{request.method} is not allowed on {request.url.path}"))

    @app.get("/health")
    async def health():
        if scheduler.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        if scheduler.last_failure:  # up, but a step failed since it started: say which
            return {"status": "ok", "last_failure": scheduler.last_failure}
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        o = config.options
        k = o.draft_length(engine.target.quantize, engine.draft.quantize if engine.draft is not None else None)
        own = {"method": o.method, "k": None if o.spec.plans else k, "speculation": "adaptive" if scheduler.speculation is not None else "fixed",
               "max_batch": scheduler.max_batch, "max_tokens": config.max_tokens_cap,
               "context": engine.target.max_context, "draft": engine.draft.name if engine.draft is not None else None,
               "tokenizer": tokenizer_fingerprint(engine.target.tokenizer), "vocab_size": engine.target.vocab_size,
               "verify": VERIFY_ROUTE,
               "sessions": len(sessions)}
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "speclm", "speclm": own}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/")
    async def page():
        return HTMLResponse(PAGE.read_text(encoding="utf-8").replace("{{MODEL}}", config.model_name))

    add_routes(app, scheduler, config, sessions, lambda request: _json(request, config.max_body_bytes))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = parse(ChatRequest, await _json(request, config.max_body_bytes))
        tok = engine.target.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ApiError(400, f"model '{config.model_name}' has no chat template; use /v1/completions")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # a template that rejects this conversation (roles out of order, ...)
            raise ApiError(400, f"messages: the chat template rejected them ({exc})", param="messages") from None
        ids = tok(text, add_special_tokens=False).input_ids
        limit = body.max_completion_tokens or body.max_tokens
        return await _generate(request, body, ids, limit, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = parse(CompletionRequest, await _json(request, config.max_body_bytes))
        prompt = body.prompt
        if isinstance(prompt, list):
            vocab = engine.target.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise ApiError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt")
            ids = list(prompt)
        else:
            ids = engine.target.tokenizer(prompt).input_ids
        return await _generate(request, body, ids, body.max_tokens or 16, chat=False)

    async def _generate(request: Request, body, ids: list[int], max_tokens: int | None, chat: bool):
        if body.model is not None and body.model != config.model_name:
            raise ApiError(404, f"the model '{body.model}' does not exist; this server serves '{config.model_name}'",
                           param="model", code="model_not_found")
        if not ids:
            raise ApiError(400, "empty prompt", param="prompt")
        context = engine.target.max_context
        if context and len(ids) >= context:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; this model's context is {context} tokens",
                           param="messages" if chat else "prompt", code="context_length_exceeded")
        if max_tokens is not None and max_tokens > config.max_tokens_cap:
            raise ApiError(400, f"max_tokens is {max_tokens}; this server allows at most {config.max_tokens_cap}",
                           param="max_tokens")
        options = _options(config.options, body, max_tokens or config.max_tokens_cap)
        if options.spec.needs == DRAFT_MODEL and engine.draft is None:
            raise ApiError(400, f"speculation: method '{options.method}' needs a draft model; this server has none",
                           param="speculation")
        # n choices: sampled, each its own request (seed + i where a seed is set: each the same as its
        # single run); greedy, one run whose output every choice shows
        runs = body.n if not options.sampling.greedy else 1
        try:
            reqs = [engine.request(ids, options if options.seed is None else replace(options, seed=options.seed + i))
                    for i in range(runs)]
        except UsageError as exc:
            raise ApiError(400, str(exc)) from None
        choices = _Choices(scheduler, reqs, body.n)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        shape = _Shape(rid, int(time.time()), config.model_name, chat, engine.target.tokenizer)
        if body.stream:
            return StreamingResponse(_stream(choices, shape, body.include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        watch = asyncio.ensure_future(_watch_disconnect(request, choices))
        try:
            texts: dict[int, list[str]] = {i: [] for i in range(runs)}
            async for i, events in choices.events():
                if not events:  # the client went away
                    choices.cancel()
                    return Response(status_code=499)
                for event in events:
                    if event[0] == "text":
                        texts[i].append(event[1])
                    elif event[0] == "error":
                        raise ApiError(500, event[1], type="server_error")
            return JSONResponse(shape.whole({i: "".join(t) for i, t in texts.items()}, choices))
        finally:
            watch.cancel()

    async def _stream(choices: "_Choices", shape: "_Shape", include_usage: bool):
        # a step's events go out as one write: one wake-up of the loop and of the client per step
        try:
            yield "".join(_sse(shape.chunk(j, {"role": "assistant", "content": ""} if shape.chat else {"text": ""}))
                          for j in range(choices.n))
            logprobs: dict[int, list | None] = {}  # per run: its steps' tokens' log-probabilities, with its next text
            async for i, events in choices.events():
                out = []
                for event in events:
                    if event[0] == "logprobs":  # several steps' may wait here: kept in order until a text goes out
                        logprobs[i] = (logprobs.get(i) or []) + list(event[1])
                    elif event[0] == "text":
                        delta, given = {"content": event[1]} if shape.chat else {"text": event[1]}, logprobs.pop(i, None)
                        out += [_sse(shape.chunk(j, delta, event[2], given)) for j in choices.shown(i)]
                    elif event[0] == "error":
                        yield "".join(out) + _sse(ApiError(500, event[1], type="server_error").body())
                        return
                    else:
                        out += _rest(shape, choices, i, logprobs.pop(i, None))
                        out += [_sse(shape.last(j, choices.tickets[i])) for j in choices.shown(i)]
                out += _rest(shape, choices, i, logprobs.pop(i, None))
                yield "".join(out)
            if include_usage:
                yield _sse(shape.usage_chunk(choices))
            yield "data: [DONE]\n\n"
        finally:  # the client disconnected (or the stream ended): running requests leave the batch
            choices.cancel()

    return app


ROUTES = ("/", "/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions", VERIFY_ROUTE)


class _Guard:
    """The API key (every route but OPEN_ROUTES) and the count of requests by route and status.
    Plain ASGI, not Starlette's BaseHTTPMiddleware: that one wraps `receive`, and a streaming
    response then sees a client disconnect that did not happen once the body has been read."""

    def __init__(self, app, key: bytes | None, metrics):
        self.app, self.key, self.metrics = app, key, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route = path if path in ROUTES else "other"
        if self.key is not None and path not in OPEN_ROUTES:
            given = dict(scope["headers"]).get(b"authorization", b"")
            token = given[7:] if given[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.key):  # constant time
                self.metrics.http_requests.labels(route, "401").inc()
                response = _error(ApiError(401, "missing or incorrect API key (Authorization: Bearer KEY)",
                                           code="invalid_api_key"))
                return await response(scope, receive, send)

        async def counted(message):
            if message["type"] == "http.response.start":
                self.metrics.http_requests.labels(route, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)


def _options(defaults: GenerationOptions, body, max_tokens: int) -> GenerationOptions:
    spec = body.speculation_spec()
    changes = dict(max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                   seed=body.seed, stop=tuple(body.stop or ()), chat=False, ignore_eos=body.ignore_eos,
                   constraint=body.constraint(), logprobs=body.logprobs_count())
    if spec is not None:
        if spec.method is not None and spec.method != defaults.method:
            takes = method(spec.method).options  # the server's heads and acceptance, where the method takes them
            changes.update(method=spec.method, k=None, tree=None, lookahead=None, layers=None, self_weights=None,
                           heads=defaults.heads if "heads" in takes else None,
                           acceptance=defaults.acceptance if "acceptance" in takes else "exact")
        if spec.k is not None:
            changes["k"] = spec.k
        if spec.tree is not None:
            changes["tree"] = spec.tree
    try:
        return replace(defaults, **changes)
    except UsageError as exc:
        raise ApiError(400, str(exc)) from None


async def _json(request: Request, limit: int):
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > limit:
        raise ApiError(413, f"the request body is {int(size)} bytes; this server accepts at most {limit}")
    raw = b""
    async for part in request.stream():
        raw += part
        if len(raw) > limit:
            raise ApiError(413, f"the request body is over {limit} bytes, the most this server accepts")
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise ApiError(400, f"the request body is not valid JSON ({exc})") from None


async def _watch_disconnect(request: Request, choices: "_Choices") -> None:
    """Wait (the body read) for the client to go away, and wake the handler when it does."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    choices.gone()


class _Choices:
    """A request's n choices: its runs' tickets (one run per choice when sampling, one for all when
    greedy). The first run is submitted at once, the others when it has read the prompt, so that
    they start from its keys and values in the prefix cache (where the weights keep one)."""

    def __init__(self, scheduler, requests: list, n: int):
        self.scheduler, self.n, self.runs = scheduler, n, len(requests)  # runs: n, or 1 (greedy)
        self.tickets: list[Ticket] = [scheduler.submit(requests[0])]
        self._later = requests[1:]
        self._queue: asyncio.Queue = asyncio.Queue()
        self._pumps: list[asyncio.Task] = []
        self._left = self.runs

    def shown(self, run: int) -> range:
        """The choice indices that show a run's output."""
        return range(self.n) if self.runs == 1 else range(run, run + 1)

    def _pump(self, i: int) -> None:
        async def pump():
            ticket = self.tickets[i]
            while True:
                events = await ticket.take()
                if i == 0 and self._later and events:  # the prompt is read: the other runs join now
                    later, self._later = self._later, []
                    for r in later:
                        try:
                            self.tickets.append(self.scheduler.submit(r))
                        except ApiError as exc:
                            self.cancel()
                            await self._queue.put((i, [("error", exc.message)]))
                            return
                        self._pump(len(self.tickets) - 1)
                await self._queue.put((i, events))
                if not events or any(e[0] in ("done", "error") for e in events):
                    return

        self._pumps.append(asyncio.ensure_future(pump()))

    async def events(self):
        """(run, events) as they come, until every run is done (or the client went away: events [])."""
        if not self._pumps:
            self._pump(0)
        while self._left:
            i, events = await self._queue.get()
            yield i, events
            if not events:
                return
            if any(e[0] in ("done", "error") for e in events):
                self._left -= 1

    def gone(self) -> None:
        for t in self.tickets:
            t.gone = True
            t.wake()

    def cancel(self) -> None:
        self._later = []
        for t in self.tickets:
            self.scheduler.cancel(t)


def _rest(shape: "_Shape", choices: _Choices, run: int, logprobs) -> list[str]:
    """A run's log-probabilities that no text has carried yet, in chunks of their own."""
    if not logprobs:
        return []
    return [_sse(shape.chunk(j, {"content": ""} if shape.chat else {"text": ""}, logprobs=logprobs))
            for j in choices.shown(run)]


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


@dataclass
class _Shape:
    """A response's id, time and model, and OpenAI's object shapes for chat or text completions."""

    id: str
    created: int
    model: str
    chat: bool
    tokenizer: object
    _offsets: dict = field(default_factory=dict)  # completions' text_offset, per choice: characters already given

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def logprobs(self, entries, index: int = 0) -> dict | None:
        """TokenLogprobs in OpenAI's shape: chat's `content` list, or completions' parallel lists."""
        if entries is None:
            return None
        ids = sorted({e.token for e in entries} | {t for e in entries for t, _ in e.top})
        piece = dict(zip(ids, token_pieces(self.tokenizer, ids)))
        if self.chat:
            return {"content": [{"token": piece[e.token][0], "logprob": e.logprob, "bytes": list(piece[e.token][1]),
                                 "top_logprobs": [{"token": piece[t][0], "logprob": v, "bytes": list(piece[t][1])}
                                                  for t, v in e.top]} for e in entries], "refusal": None}
        offsets = []
        for e in entries:
            offsets.append(self._offsets.get(index, 0))
            self._offsets[index] = offsets[-1] + len(piece[e.token][0])
        return {"tokens": [piece[e.token][0] for e in entries], "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{piece[t][0]: v for t, v in e.top} for e in entries], "text_offset": offsets}

    def chunk(self, index: int, delta: dict, draft_accepted: bool | None = None, logprobs=None) -> dict:
        if self.chat:
            choice = {"index": index, "delta": delta, "finish_reason": None}
            if logprobs is not None:
                choice["logprobs"] = self.logprobs(logprobs, index)
        else:
            choice = {"index": index, "text": delta["text"], "finish_reason": None,
                      "logprobs": self.logprobs(logprobs, index)}
        if draft_accepted is not None:  # speclm's: the text came from draft tokens the target accepted
            choice["draft_accepted"] = draft_accepted
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}

    def last(self, index: int, ticket: Ticket) -> dict:
        reason = _reason(ticket)
        choice = ({"index": index, "delta": {}, "finish_reason": reason} if self.chat
                  else {"index": index, "text": "", "finish_reason": reason, "logprobs": None})
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice],
                "speculation": speculation(ticket)}

    def usage_chunk(self, choices: "_Choices") -> dict:
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": usage(choices)}

    def whole(self, texts: dict[int, str], choices: "_Choices") -> dict:
        out = []
        for j in range(choices.n):
            run = j if choices.runs > 1 else 0
            ticket = choices.tickets[run]
            r = ticket.request
            logprobs = self.logprobs(r.logprobs if r.options.logprobs is not None else None, j)
            choice = ({"index": j, "message": {"role": "assistant", "content": texts[run]}, "finish_reason": _reason(ticket),
                       "logprobs": logprobs} if self.chat else {"index": j, "text": texts[run],
                                                                 "finish_reason": _reason(ticket), "logprobs": logprobs})
            if choices.n > 1:
                choice["speculation"] = speculation(ticket)
            out.append(choice)
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": out,
                "usage": usage(choices), "speculation": speculation(choices.tickets[0])}


def _reason(ticket: Ticket) -> str:
    return "length" if ticket.request.finish_reason == "length" else "stop"


def usage(choices: "_Choices") -> dict:
    """Tokens of the prompt (read once) and of every choice."""
    prompt = choices.tickets[0].request.prompt_len
    copies = choices.n if choices.runs == 1 else 1
    completion = copies * sum(len(t.request.generated) for t in choices.tickets)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def speculation(ticket: Ticket) -> dict:
    """The request's own speculation statistics."""
    r, s = ticket.request, ticket.request.stats
    return {"method": r.options.method, "draft_tokens": s.drafted_tokens, "accepted_tokens": s.accepted_tokens,
            "target_forwards": s.target_forwards, "tokens_per_forward": round(s.mean_accepted_tokens, 4),
            "acceptance_rate": round(s.acceptance_rate, 4), "cached_prompt_tokens": s.cached_tokens,
            **({"planned": dict(s.planned), "plan_switches": list(s.plan_switches)} if s.planned else {})}
