"""The engine thread: one running Batch that requests join between steps and leave when done.

The HTTP handlers (asyncio) never touch the engine. They `submit` a Request and read its
Ticket's events (text as it is committed, then the end); the engine thread admits waiting
requests while the batch has room, runs one step, and hands each request's new text to its
handler's event loop. A client that goes away `cancel`s its request: it leaves the batch at the
next step and its cache rows are free. Everything the engine does happens on this one thread.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field

from speclm.requests import Request
from speclm.runtime import bound_freed_memory
from speclm.serve.metrics import Metrics
from speclm.serve.protocol import ApiError
from speclm.text import IncrementalText


@dataclass(eq=False)
class Ticket:
    """One request as its handler sees it. The engine thread queues a step's events together and
    wakes the handler's loop once for them (`flush`); the handler takes all that is there (`take`).
    Events: ("logprobs", [TokenLogprob]) (where asked: the step's new tokens'), ("text", str, drafted:
    bool) ..., then ("done", None) or ("error", message)."""

    request: Request
    loop: asyncio.AbstractEventLoop
    arrived: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None
    gone: bool = False  # the client disconnected (set on the loop)
    _events: deque = field(default_factory=deque)  # appended on the engine thread, popped on the loop
    _ready: asyncio.Event = field(default_factory=asyncio.Event)
    _unflushed: bool = False
    _text: IncrementalText | None = None
    _count: int = 0  # tokens already handed on
    _seen: tuple[int, int, list] = (0, 0, [])  # drafted, accepted, accepted per position: already counted

    def put(self, event: tuple) -> None:
        """Queue an event (engine thread); the handler sees it at the next `flush`."""
        self._events.append(event)
        self._unflushed = True

    def flush(self) -> None:
        """Wake the handler's loop for what `put` queued: one wake-up per step, whatever it held."""
        if self._unflushed:
            self._unflushed = False
            try:
                self.loop.call_soon_threadsafe(self._ready.set)
            except RuntimeError:  # the loop closed (the server shut down mid-request): no one is waiting
                pass

    def wake(self) -> None:
        """Wake the handler without an event (on the loop: the client went away)."""
        self._ready.set()

    async def take(self) -> list[tuple]:
        """Every event queued so far, waiting for one if there is none (or [] once `gone`)."""
        while True:
            self._ready.clear()  # cleared before looking: a later put's flush sets it again
            if self._events:
                events = []
                while self._events:
                    events.append(self._events.popleft())
                return events
            if self.gone:
                return []
            await self._ready.wait()


class Scheduler:
    def __init__(self, engine, max_batch: int = 8, max_queue: int = 64, prefill_chunk: int | None = 256,
                 speculation=None, metrics: Metrics | None = None):
        self.engine, self.max_batch, self.max_queue = engine, max_batch, max_queue
        self.metrics = metrics or Metrics()
        self.prefill_chunk, self.speculation = prefill_chunk, speculation
        self.batch = self._new_batch()
        self._waiting: deque[Ticket] = deque()
        self._cancels: list[Ticket] = []
        self._tickets: dict[int, Ticket] = {}  # id(request) -> its ticket, for what is in the batch
        self._cv = threading.Condition()
        self._stopping = False
        self.draining = False  # no new requests (shutting down)
        self._thread = threading.Thread(target=self._run, name="speclm-engine", daemon=True)
        self.last_failure: str | None = None  # the last step that raised, for /health

    def _new_batch(self):
        return self.engine.batch(rows=self.max_batch, prefill_chunk=self.prefill_chunk, speculation=self.speculation)

    # ---------------------------------------------------------------- called from the handlers
    def start(self) -> None:
        """Start the engine thread. Call it on the thread that loaded the models: that one's OpenMP
        workers are freed first (speclm.runtime.release_openmp_threads; kept, they cost the engine
        thread about a sixth of its decode speed on 2 cores)."""
        from speclm.runtime import release_openmp_threads

        release_openmp_threads()
        self._thread.start()

    def submit(self, request: Request) -> Ticket:
        """Queue a request; 429 when the queue is full, 503 while shutting down."""
        ticket = Ticket(request, asyncio.get_running_loop())
        with self._cv:
            if self.draining or self._stopping:
                raise ApiError(503, "the server is shutting down", type="service_unavailable")
            if len(self._waiting) >= self.max_queue:
                raise ApiError(429, f"the queue is full ({self.max_queue} requests waiting); retry later",
                               type="rate_limit_error", headers={"Retry-After": "1"})
            self._waiting.append(ticket)
            self.metrics.waiting.set(len(self._waiting))
            self._cv.notify()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """The client went away: the request leaves at the next step (a no-op once it is done)."""
        with self._cv:
            if not ticket.request.done:
                self._cancels.append(ticket)
                self._cv.notify()

    def busy(self) -> bool:
        with self._cv:
            return bool(self._waiting or self._tickets)

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel what is left and end the thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)

    # ---------------------------------------------------------------- the engine thread
    def _run(self) -> None:
        batch = self.batch
        while True:
            with self._cv:
                while not (self._stopping or self._waiting or self._cancels or batch.active):
                    self._cv.wait()
                if self._stopping:
                    leaving = list(self._tickets.values()) + list(self._waiting)
                    self._waiting.clear()
                    break
                cancels, self._cancels = self._cancels, []
                joining = []
                while self._waiting and batch.size + len(joining) < self.max_batch:
                    joining.append(self._waiting.popleft())
                self.metrics.waiting.set(len(self._waiting))
            for t in cancels:
                if not t.request.done:
                    in_batch = id(t.request) in self._tickets
                    if in_batch:
                        batch.cancel(t.request)
                    else:
                        t.request.finish_reason = "cancelled"
                        with self._cv:
                            if t in self._waiting:
                                self._waiting.remove(t)
                    self._finish(t)
                    t.flush()
            for t in joining:
                if t.request.done:  # cancelled while waiting
                    continue
                self._tickets[id(t.request)] = t
                t._text = IncrementalText(self.engine.target.tokenizer, t.request.options.stop)
                batch.join(t.request)
                self.metrics.prompt_tokens.inc(t.request.prompt_len)
            if not batch.active:
                self._gauges()
                continue
            try:
                stepped = batch.step()
            except Exception as exc:  # a bug, or out of memory: the batch's requests fail, the server goes on
                traceback.print_exc(file=sys.stderr)
                self.last_failure = f"{type(exc).__name__}: {exc}"
                self.metrics.failures.inc()
                for t in list(self._tickets.values()):
                    t.request.finish_reason = "error"
                    t.put(("error", f"the engine failed: {self.last_failure}"))
                    t.flush()
                    self.metrics.request_success.labels("error").inc()
                self._tickets.clear()
                batch = self.batch = self._new_batch()  # fresh caches; nothing of the failed step is kept
                self._gauges()
                continue
            self.metrics.steps.labels(batch.last_step).inc()
            now = time.perf_counter()
            for r in stepped:
                t = self._tickets.get(id(r))
                if t is not None:
                    self._emit(t, now)
                    t.flush()
            self._speculation_gauges()
            self._gauges()
        for t in leaving:
            t.request.finish_reason = "cancelled"
            t.put(("error", "the server shut down before the request finished"))
            t.flush()
        self._tickets.clear()
        self._gauges()

    def _emit(self, t: Ticket, now: float) -> None:
        """The request's new text, split into what the draft proposed and the target accepted, and
        the target's own token(s); its speculation counters; its end."""
        r, m = t.request, self.metrics
        s = r.stats
        drafted0, accepted0, per_pos0 = t._seen
        accepted = s.accepted_tokens - accepted0
        method = "remote" if r.given is not None else r.options.method  # a remote client's draft: its own label
        if s.drafted_tokens > drafted0:
            m.drafts.labels(method).inc()
            m.draft_tokens.labels(method).inc(s.drafted_tokens - drafted0)
            m.accepted_tokens.labels(method).inc(accepted)
            for pos, n in enumerate(s.accepted_per_position):
                before = per_pos0[pos] if pos < len(per_pos0) else 0
                if n > before:
                    m.accepted_per_pos.labels(method, str(pos)).inc(n - before)
        t._seen = (s.drafted_tokens, s.accepted_tokens, list(s.accepted_per_position))
        generated = r.generated
        start = t._count
        committed = len(generated) - start
        if committed > 0:
            m.generation_tokens.inc(committed)
            if t.first_token_at is None:
                t.first_token_at = now
                m.ttft.observe(now - t.arrived)
            elif t.last_token_at is not None:
                gap = (now - t.last_token_at) / committed
                for _ in range(committed):
                    m.itl.observe(gap)
            t.last_token_at = now
        t._count = len(generated)
        if r.options.logprobs is not None and committed > 0:
            t.put(("logprobs", r.logprobs[start:len(generated)]))
        # the accepted draft tokens come first in a round's commit, then the target's own token
        from_draft = max(0, min(accepted, committed - 1))
        pieces = [(generated[: start + from_draft], True), (generated, False)] if from_draft else [(generated, False)]
        for ids, drafted in pieces:
            text = t._text.delta(ids, finished=r.done and ids is generated)
            if text:
                t.put(("text", text, drafted))
        if r.done:
            self._finish(t)

    def _finish(self, t: Ticket) -> None:
        r = t.request
        self._tickets.pop(id(r), None)
        reason = r.finish_reason or "length"
        self.metrics.request_success.labels(reason).inc()
        if reason != "cancelled":
            self.metrics.e2e.observe(time.perf_counter() - t.arrived)
        t.put(("done", None))
        if not self._tickets:
            bound_freed_memory()

    def _gauges(self) -> None:
        b = self.batch
        self.metrics.running.set(len(b.requests) + len(b.reading) + len(b.joining))
        self.metrics.cache_rows.set(b.kv.batch_size if b.kv is not None else 0)

    def _speculation_gauges(self) -> None:
        if self.speculation is None:
            return
        for key, cap in self.speculation.last.items():
            if isinstance(cap, list):  # auto: per row, its child's draft length (0: none); their mean
                cap = sum(c.k for c in cap) / len(cap) if cap else 0
            self.metrics.draft_length.labels(key.method).set(-1 if cap is None else cap)
