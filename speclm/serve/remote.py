"""Remote verification: a client drafts on its own machine (speclm.remote), this server verifies.

A session is one generation. Its first call sends the prompt's token ids, the sampling options
and a draft; each later call sends the session's id and the next draft. The server holds the
session's committed tokens (it is authoritative: the client appends what each reply commits),
reads the tokens new since the last call together with the draft in one target forward (the
prefix cache holds the session's keys and values between calls, so only those are read), lets
the one verifier decide (speclm.round.verify, with the session's sampling options and its own
generator; a seeded session draws by position, so a resumed one draws as it would have) and
replies with the accepted count, the tokens committed (the accepted draft tokens, then the
target's own) and whether the session ended. The verify request is an ordinary request of the
running batch (speclm.requests.Given): it shares the batch's forwards and limits with every
other request.

Sessions end when generation does, expire after `ttl` idle seconds, and are at most `limit`
(429 beyond it). A client whose session the server no longer holds (expired, or a restart)
resumes by sending its prompt and the tokens it was given (`generated`) again.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field, replace

import torch
from fastapi import Request as HttpRequest
from pydantic import BaseModel, ConfigDict, Field, field_validator

from speclm.options import GenerationOptions
from speclm.requests import Given, Request
from speclm.sampling import Coupled
from speclm.serve.protocol import ApiError, parse
from speclm.text import stop_cut, tokenizer_fingerprint

ROUTE = "/v1/speclm/verify"
MAX_DRAFT = 64  # draft tokens per call at most
OPTION_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos")


class VerifyRequest(BaseModel):
    """One call: a session's next draft. Any other field is refused (400)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    session: str | None = None  # a running session's id; else `prompt` starts one
    prompt: list[int] | None = Field(default=None, min_length=1)  # token ids: a new session (or a resumed one)
    generated: list[int] = Field(default_factory=list)  # with prompt: the tokens a resumed session had committed
    context_length: int | None = Field(default=None, ge=1)  # with session: the tokens the client holds (checked)
    tokenizer: str | None = None  # the client's tokenizer fingerprint (speclm.text.tokenizer_fingerprint), checked
    draft: list[int] = Field(default_factory=list, max_length=MAX_DRAFT)
    # per draft token: the nonzero entries [token, probability] of the distribution it was drawn from (sampling)
    draft_probs: list[list[tuple[int, float]]] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list, max_length=4)
    ignore_eos: bool = False

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v):
        return [v] if isinstance(v, str) else v


@dataclass(eq=False)
class Session:
    id: str
    context: list[int]  # prompt + committed
    prompt_len: int
    options: GenerationOptions  # method none: the session's sampling, max_new_tokens and stops
    max_new: int
    generator: torch.Generator | None
    coupled: Coupled | None
    used: float = field(default_factory=time.monotonic)
    busy: bool = False  # a call is being verified (one at a time)
    target_forwards: int = 0
    # (the context's length before the last call, its reply): a client that lost the reply (a
    # connection dropped after the server committed) sends that call again and gets the same reply
    last: tuple[int, dict] | None = None

    @property
    def generated(self) -> list[int]:
        return self.context[self.prompt_len:]


class Sessions:
    """The running sessions, by id: at most `limit`, each dropped after `ttl` idle seconds."""

    def __init__(self, limit: int = 64, ttl: float = 600.0):
        self.limit, self.ttl = limit, ttl
        self._by_id: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def _expire(self) -> None:
        now = time.monotonic()
        for sid in [s.id for s in self._by_id.values() if not s.busy and now - s.used > self.ttl]:
            del self._by_id[sid]

    def get(self, sid: str) -> Session:
        self._expire()
        session = self._by_id.get(sid)
        if session is None:
            raise ApiError(404, f"session '{sid}' is not running here (ended, expired or the server restarted): "
                                "resume it with its prompt and generated tokens", param="session",
                           code="session_not_found")
        return session

    def start(self, session: Session) -> Session:
        self._expire()
        if len(self._by_id) >= self.limit:
            raise ApiError(429, f"the server runs {self.limit} verification sessions; retry later",
                           type="rate_limit_error", headers={"Retry-After": "1"})
        self._by_id[session.id] = session
        return session

    def end(self, session: Session) -> None:
        self._by_id.pop(session.id, None)


def add_routes(app, scheduler, config, sessions: Sessions, read_json) -> None:
    """The verification route on `app` (speclm.serve.app.create_app)."""
    engine = scheduler.engine
    target = engine.target
    fingerprint = tokenizer_fingerprint(target.tokenizer)

    @app.post(ROUTE)
    async def verify(request: HttpRequest):
        body = parse(VerifyRequest, await read_json(request))
        if body.model is not None and body.model != config.model_name:
            raise ApiError(404, f"the model '{body.model}' does not exist; this server serves '{config.model_name}'",
                           param="model", code="model_not_found")
        if body.tokenizer is not None and body.tokenizer != fingerprint:
            raise ApiError(400, f"tokenizer: the draft's tokenizer is not this server's ('{config.model_name}'): "
                                "draft with a model of the target's family", param="tokenizer",
                           code="tokenizer_mismatch")
        vocab = target.vocab_size
        for name, ids in (("prompt", body.prompt or ()), ("generated", body.generated), ("draft", body.draft)):
            if any(not 0 <= t < vocab for t in ids):
                raise ApiError(400, f"{name}: token ids must be in [0, {vocab})", param=name)
        session = _start(body) if body.session is None else _resume(body)
        if session.last is not None and body.context_length == session.last[0]:
            return session.last[1]  # the call whose reply the client lost, answered again
        if session.busy:
            raise ApiError(409, f"session '{session.id}' is verifying another draft", param="session",
                           code="session_busy")
        probs = _draft_probs(body, session, vocab)
        draft = body.draft[: max(0, session.max_new - len(session.generated) - 1)]  # no draft past its length
        session.busy = True
        try:
            # the session cuts at its stops over its whole text (a stop may span calls), not the call's request
            r = Request(0, session.context + draft, len(session.context) + len(draft),
                        session.max_new - len(session.generated), replace(session.options, stop=()), session.generator,
                        coupled=session.coupled, given=Given(draft, probs[: len(draft)] if probs is not None else None))
            ticket = scheduler.submit(r)
            while not r.done:
                for event in await ticket.take():
                    if event[0] == "error":
                        raise ApiError(500, event[1], type="server_error")
        finally:
            session.busy, session.used = False, time.monotonic()
        new, first, before = r.generated, len(session.generated), len(session.context)
        session.context += new
        session.target_forwards += r.stats.target_forwards
        reason = None if r.finish_reason == "verified" else r.finish_reason
        cut = stop_cut(target.tokenizer, session.generated, first, session.options.stop)
        if cut is not None:
            del session.context[session.prompt_len + cut:]
            reason = "stop"
        if reason is None and len(session.generated) >= session.max_new:
            reason = "length"
        if reason is not None:
            sessions.end(session)
        scheduler.metrics.sessions.set(len(sessions))
        accepted = min(r.stats.accepted_tokens, len(session.generated) - first)
        reply = {"object": "speclm.verification", "session": session.id, "accepted": accepted,
                 "tokens": session.generated[first:], "finish_reason": reason,
                 "generated": len(session.generated), "target_forwards": session.target_forwards,
                 "cached_tokens": r.stats.cached_tokens}
        session.last = before, reply
        return reply

    def _start(body: VerifyRequest) -> Session:
        if body.prompt is None:
            raise ApiError(400, "prompt: a new session needs its prompt's token ids (or a session id)", param="prompt")
        if body.context_length is not None:
            raise ApiError(400, "context_length: only with a session id", param="context_length")
        ids = list(body.prompt)
        context = target.max_context
        if context and len(ids) + len(body.generated) >= context:
            raise ApiError(400, f"the prompt has {len(ids) + len(body.generated)} tokens; this model's context is "
                                f"{context} tokens", param="prompt", code="context_length_exceeded")
        cap = config.max_tokens_cap
        if body.max_tokens is not None and body.max_tokens > cap:
            raise ApiError(400, f"max_tokens is {body.max_tokens}; this server allows at most {cap}", param="max_tokens")
        try:
            options = GenerationOptions(method="none", max_new_tokens=body.max_tokens or cap, temperature=body.temperature,
                                        top_p=body.top_p, top_k=body.top_k, seed=body.seed, stop=tuple(body.stop),
                                        ignore_eos=body.ignore_eos)
        except Exception as exc:
            raise ApiError(400, str(exc)) from None
        seed = body.seed if body.seed is not None else secrets.randbits(62)
        made = Request.of(0, ids, options, seed, context, seeded=body.seed is not None, vocab=target.vocab_size)
        if len(body.generated) >= made.max_new:
            raise ApiError(400, f"generated: {len(body.generated)} tokens, the session's whole length", param="generated")
        session = Session(secrets.token_hex(12), ids + list(body.generated), len(ids), options, made.max_new,
                          made.generator, made.coupled)
        return sessions.start(session)

    def _resume(body: VerifyRequest) -> Session:
        given = sorted(f for f in OPTION_FIELDS + ("prompt", "generated") if f in body.model_fields_set)
        if given:
            raise ApiError(400, f"{given[0]}: set when the session starts (with prompt), not per call", param=given[0])
        session = sessions.get(body.session)
        if session.last is not None and body.context_length == session.last[0]:
            return session
        if body.context_length is not None and body.context_length != len(session.context):
            raise ApiError(409, f"context_length: the client holds {body.context_length} tokens, the session "
                                f"{len(session.context)}", param="context_length", code="session_out_of_sync")
        return session

    def _draft_probs(body: VerifyRequest, session: Session, vocab: int) -> torch.Tensor | None:
        """The draft's distributions as (K, V) rows, checked; None: one-hot (or greedy)."""
        if body.draft_probs is None:
            return None
        if session.options.sampling.greedy:
            raise ApiError(400, "draft_probs: greedy verification reads none (send them only when sampling)",
                           param="draft_probs")
        if len(body.draft_probs) != len(body.draft):
            raise ApiError(400, f"draft_probs: {len(body.draft_probs)} distributions for {len(body.draft)} draft tokens",
                           param="draft_probs")
        probs = torch.zeros(len(body.draft), vocab)
        for j, (token, entries) in enumerate(zip(body.draft, body.draft_probs)):
            for t, p in entries:
                if not 0 <= t < vocab or not 0.0 <= p <= 1.0:
                    raise ApiError(400, f"draft_probs.{j}: entries are [token in [0, {vocab}), probability in [0, 1]]",
                                   param="draft_probs")
                probs[j, t] = p
            total = float(probs[j].sum())
            if abs(total - 1.0) > 1e-3 or probs[j, token] <= 0:
                raise ApiError(400, f"draft_probs.{j}: must sum to 1 and give the drafted token {token} a probability > 0",
                               param="draft_probs")
            probs[j] /= total
        return probs
