"""Drafting here, verifying on a speclm server: `speclm generate --verifier URL --draft D`.

The client holds only the draft model. Each round it drafts a chain locally with any proposer
that needs nothing of the target (a draft model, prompt lookup, both), sends it to the server's
verification route (speclm.serve.remote) and appends what the server committed: the accepted
draft tokens and one token of the target's. The server is authoritative, so the text is the
target's own, lossless as everywhere: greedy output is the server's own plain decoding, sampled
output follows the target's distribution exactly (the client sends, per draft token, the
distribution it was drawn from: the draft samples from at most DRAFT_SUPPORT tokens, so that
distribution is sent whole; a seeded request draws as the server's seeded decoding does).

The draft length each round (`DraftLength`) maximises the expected committed tokens per second
from what the client measured: the round trip (link and the server's forward), a draft step,
and the chain's acceptance. A slow link drafts more per round.

A dropped connection is tried again for PATIENCE seconds (the server answers a call whose reply
was lost again, the same: it keeps each session's last reply); a session the server no longer holds (expired, restarted) is
resumed with the prompt and the tokens already committed; anything else fails with one line.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from dataclasses import dataclass, replace

import httpx
import torch

from speclm.errors import SpeclmError, UsageError
from speclm.proposers.base import Verified
from speclm.requests import Request
from speclm.text import IncrementalText, tokenizer_fingerprint

ROUTE = "/v1/speclm/verify"
MAX_DRAFT = 16  # the longest chain a round drafts
DRAFT_SUPPORT = 64  # sampling: the draft draws from its most likely tokens at most (their distribution is sent)
METHOD = "draft"  # generate --verifier's method unless --method says
PATIENCE = 60.0  # seconds a round waits for a verifier whose connection failed (a restart) before giving up


class RemoteError(SpeclmError):
    """The verifier failed in a way the client cannot repair (one line)."""


class Verifier:
    """The HTTP side: a kept-alive connection to a speclm server and its verification route."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 120.0):
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)
        self.model: dict = {}

    def check(self, tokenizer) -> dict:
        """The server's model, refused unless it is a speclm server whose target shares the draft's tokenizer."""
        try:
            reply = self.http.get("/v1/models")
        except httpx.HTTPError as exc:
            raise UsageError(f"--verifier {self.url}: cannot reach it ({exc})") from None
        if reply.status_code == 401:
            raise UsageError(f"--verifier {self.url}: the server wants an API key (--api-key or SPECLM_API_KEY)")
        try:
            model = reply.json()["data"][0]
            own = model["speclm"]
            own["verify"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise UsageError(f"--verifier {self.url}: not a speclm server with remote verification "
                             f"(GET /v1/models answered {reply.status_code})") from None
        if own.get("tokenizer") != tokenizer_fingerprint(tokenizer):
            raise UsageError(f"--verifier {self.url}: its model '{model['id']}' has another tokenizer than the draft; "
                             "draft with a model of the target's family")
        self.model = {"id": model["id"], **own}
        return self.model

    def call(self, body: dict) -> tuple[int, dict]:
        """POST a round; (status, JSON). A failed connection is tried again, a second apart, for
        PATIENCE seconds (a server restarting), then fails with one line."""
        give_up = time.monotonic() + PATIENCE
        while True:
            try:
                reply = self.http.post(ROUTE, json=body)
                return reply.status_code, reply.json()
            except (httpx.TransportError, ValueError) as exc:
                if time.monotonic() > give_up:
                    raise RemoteError(f"the verifier {self.url} did not answer for {PATIENCE:g} s ({exc})") from None
                time.sleep(1.0)

    def close(self) -> None:
        self.http.close()


@dataclass
class DraftLength:
    """The draft length that maximises expected tokens per second of a round: a chain of k whose
    tokens each pass with probability a commits (1 - a^(k+1)) / (1 - a) tokens in k draft steps
    and one round trip. a: accepted / (accepted + rounds that stopped early), decayed; the times
    measured, decayed. The round trip holds the server's forward, priced as one number whatever k."""

    most: int = MAX_DRAFT
    accepted: float = 2.0  # the prior: a = 2 / 3
    stops: float = 1.0
    step: float | None = None  # seconds per draft step
    trip: float | None = None  # seconds per round trip
    decay: float = 0.9
    fixed: bool = False  # `most` every round

    def choose(self) -> int:
        if self.fixed:
            return self.most
        if self.step is None or self.trip is None:
            return min(4, self.most)
        a = min(self.accepted / (self.accepted + self.stops), 0.99)
        return max(range(1, self.most + 1), key=lambda k: (1 - a ** (k + 1)) / (1 - a) / (self.trip + k * self.step))

    def observe(self, drafted: int, accepted: int, draft_seconds: float, steps: int, trip: float) -> None:
        d = self.decay
        if drafted:
            self.accepted = d * self.accepted + accepted
            self.stops = d * self.stops + (accepted < drafted)
        if drafted:  # a lookup's steps cost next to nothing: its time per drafted token
            per = draft_seconds / max(steps, drafted if not steps else steps)
            self.step = per if self.step is None else d * self.step + (1 - d) * per
        self.trip = trip if self.trip is None else d * self.trip + (1 - d) * trip


@dataclass
class RemoteStats:
    round_trips: int = 0
    round_trip_seconds: float = 0.0
    resumed: int = 0  # sessions resumed (a dropped connection or a restarted server)
    lengths: tuple[int, ...] = ()  # the draft length chosen each round (the draft may stop sooner)


def remote_stream(engine, verifier: Verifier, ids: list[int], opts, seed: int):
    """Text deltas of one prompt (token ids) drafted here and verified by `verifier`; returns (the
    Request, its stats filled: the server's target forwards, round trips; RemoteStats) at the end.
    `engine`: a SpecEngine over the draft (its proposer's builder); opts: GenerationOptions."""
    proposer = engine.make_proposer(replace(opts, k=opts.k or MAX_DRAFT, alternatives=0.0))
    if proposer is None or proposer.shape != "chain" or proposer.plans or proposer.hidden_layers or \
            proposer.needs_logits or proposer.drafts_on_target:
        raise UsageError(f"--method {opts.method}: with --verifier a chain is drafted from the text alone (a draft model, "
                         "prompt lookup or both); this method drafts from the target's own states or a tree")
    request = Request.of(0, ids, opts, seed, verifier.model.get("context"), seeded=opts.seed is not None,
                         vocab=verifier.model.get("vocab_size") or engine.target.vocab_size)
    params = opts.sampling
    draft_params = params if params.greedy else replace(params, top_k=min(params.top_k or DRAFT_SUPPORT, DRAFT_SUPPORT))
    proposer.start(1, len(ids) + request.max_new + MAX_DRAFT + 2)
    if request.coupled is not None:  # the draft draws as the server's seeded verification will
        proposer.draws = (request.coupled,)
    stats, remote = request.stats, RemoteStats()
    lengths = DraftLength(opts.k or MAX_DRAFT, fixed=opts.k is not None)  # --k: that length every round
    text = IncrementalText(engine.target.tokenizer, opts.stop)
    session = None
    began = time.perf_counter()
    while True:
        k = min(lengths.choose(), request.tokens_left - 1)
        t0 = time.perf_counter()
        draft = proposer.propose([request.context], [k], draft_params, [request.generator]) if k > 0 else None
        drafted = int(draft.lengths[0]) if draft is not None else 0
        tokens = draft.tokens[0, :drafted].tolist() if drafted else []
        steps = draft.forwards if draft is not None else 0
        stats.draft_forwards += steps
        spent = time.perf_counter() - t0
        stats.draft_seconds += spent
        body = {"draft": tokens}
        if drafted and not params.greedy:
            body["draft_probs"] = _sparse(draft, drafted)
        t1 = time.perf_counter()
        reply = _verify(verifier, body, session, ids, request, opts, remote)
        trip = time.perf_counter() - t1
        session = reply["session"]
        new, accepted = reply["tokens"], int(reply["accepted"])
        remote.round_trips += 1
        remote.round_trip_seconds += trip
        remote.lengths += (k,)
        lengths.observe(drafted, accepted, spent, steps, trip)
        if drafted:
            stats.drafted_tokens += drafted
            stats.accepted_tokens += accepted
            proposer.accept(Verified(keep=[len(request.context) + accepted], paths=[list(range(accepted))]))
        request.context += new
        stats.target_forwards = int(reply["target_forwards"])
        request.finish_reason = reply["finish_reason"]
        delta = text.delta(request.generated, finished=request.done)
        if delta:
            yield delta
        if request.done:
            break
    stats.wall_seconds = time.perf_counter() - began
    stats.new_tokens = len(request.generated)
    stats.round_trips, stats.round_trip_seconds = remote.round_trips, remote.round_trip_seconds
    stats.resumed_sessions = remote.resumed
    return request, remote


def _verify(verifier: Verifier, body: dict, session: str | None, ids: list[int], request: Request, opts,
            remote: RemoteStats) -> dict:
    """One round at the server; a session it lost is started again from what the client holds."""
    if session is not None:
        give_up = time.monotonic() + PATIENCE
        while True:  # a call sent again after a dropped connection may find its first try still running
            status, reply = verifier.call({**body, "session": session, "context_length": len(request.context)})
            if status != 409 or _code(reply) != "session_busy" or time.monotonic() > give_up:
                break
            time.sleep(0.2)
        if status == 200:
            return reply
        if status != 404:
            raise RemoteError(_message(verifier, status, reply))
        remote.resumed += 1
    params = opts.sampling
    start = {"prompt": ids, "generated": request.generated, "max_tokens": request.max_new,
             "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k, "seed": opts.seed,
             "stop": list(opts.stop), "ignore_eos": opts.ignore_eos,
             "tokenizer": verifier.model.get("tokenizer"), "model": verifier.model.get("id")}
    status, reply = verifier.call({**body, **start})
    if status != 200:
        raise RemoteError(_message(verifier, status, reply))
    return reply


def _code(reply) -> str | None:
    return reply.get("error", {}).get("code") if isinstance(reply, dict) else None


def _message(verifier: Verifier, status: int, reply) -> str:
    error = reply.get("error", {}) if isinstance(reply, dict) else {}
    return f"the verifier {verifier.url} refused a round ({status}): {error.get('message', reply)}"


def _sparse(draft, drafted: int) -> list[list[list[float]]]:
    """Each draft token's distribution as its nonzero [token, probability] entries (at most about
    DRAFT_SUPPORT: the draft drew from its top tokens)."""
    out = []
    for j in range(drafted):
        q = draft.draft_probs[0, j]
        at = torch.nonzero(q > 0).flatten()
        out.append([[int(t), float(q[t])] for t in at])
    return out


class DelayedLink:
    """A TCP proxy on 127.0.0.1 that delivers each byte `one_way` seconds after it arrived, both
    ways: a link whose round trip is 2 * one_way, for measuring and testing remote verification
    on slow links (benchmarks/remote.py, tests/test_remote.py)."""

    def __init__(self, upstream: str, one_way: float):
        host, port = upstream.removeprefix("http://").rstrip("/").rsplit(":", 1)
        self.upstream, self.one_way = (host, int(port)), one_way
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        held: queue.Queue = queue.Queue()  # (deliver at, bytes); None: the sender is done

        def deliver():
            while (item := held.get()) is not None:
                at, data = item
                time.sleep(max(0.0, at - time.monotonic()))
                try:
                    dst.sendall(data)
                except OSError:
                    break
            for s in (dst, src):  # the other way may still be open: only this one ends
                try:
                    s.shutdown(socket.SHUT_WR if s is dst else socket.SHUT_RD)
                except OSError:
                    pass

        threading.Thread(target=deliver, daemon=True).start()
        try:
            while data := src.recv(65536):
                held.put((time.monotonic() + self.one_way, data))
        except OSError:
            pass
        held.put(None)

    def close(self) -> None:
        self.sock.close()
