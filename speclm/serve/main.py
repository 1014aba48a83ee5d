"""`speclm serve`: load the models, start the engine thread, serve with uvicorn until SIGTERM; or,
with `--replicas N`, the same app as a Ray Serve deployment of N replicas (speclm.serve.ray_app)."""

from __future__ import annotations

import os
import sys
import threading
import time

from speclm.errors import UsageError
from speclm.options import GenerationOptions


def check(args) -> str:
    """The options' own checks, before anything loads; returns the method."""
    from speclm.methods import DRAFT_MODEL, method as spec
    from speclm.runtime import NO_DRAFT

    method = args.method or "auto"
    if spec(method).needs == DRAFT_MODEL and args.draft in (None, NO_DRAFT):
        raise UsageError(f"--method {method} needs --draft MODEL")
    for name, value, low in (("max-batch", args.max_batch, 1), ("max-queue", args.max_queue, 0),
                             ("max-tokens", args.max_tokens, 1), ("prefill-chunk", args.prefill_chunk, 1),
                             ("prefix-cache", args.prefix_cache, 0), ("port", args.port, 0),
                             ("replicas", args.replicas, 1), ("max-body-bytes", args.max_body_bytes, 1),
                             ("max-sessions", args.max_sessions, 0)):
        if value < low:
            raise UsageError(f"--{name} must be >= {low}, got {value}")
    if not args.grace >= 0:
        raise UsageError(f"--grace must be >= 0 seconds, got {args.grace}")
    if not args.session_ttl >= 0:
        raise UsageError(f"--session-ttl must be >= 0 seconds, got {args.session_ttl}")
    return method


def build(args, progress: bool = False):
    """The engine, its scheduler (not started) and the app, from `speclm serve`'s options."""
    from speclm.runtime import weights_for
    from speclm.engine import SpecEngine
    from speclm.models.loading import check_model_name, load_model
    from speclm.serve.app import ServerConfig, create_app
    from speclm.serve.metrics import Metrics
    from speclm.serve.scheduler import Scheduler

    method = check(args)
    options = GenerationOptions(
        method=method, k=args.k, confidence=args.confidence, alternatives=args.alternatives, tree=args.tree, heads=args.heads, acceptance=args.acceptance,
        lookahead=args.lookahead, layers=args.layers, self_weights=args.self_weights,
        draft_vocab=args.draft_vocab, ngram_max=args.ngram_max, ngram_min=args.ngram_min,
        draft_prompt_ratio=args.draft_prompt_ratio)
    api_key = args.api_key if args.api_key is not None else os.environ.get("SPECLM_API_KEY") or None
    check_model_name(args.target)
    from speclm.runtime import family_draft

    args.draft = family_draft(args.target, method, args.draft)
    if args.draft:
        check_model_name(args.draft)
    quantize, draft_quantize = weights_for(args.quantize, args.draft_quantize, args.target, args.draft)
    target = load_model(args.target, quantize=quantize, progress=progress)
    draft = load_model(args.draft, quantize=draft_quantize, progress=progress) if args.draft else None
    engine = SpecEngine(target, draft=draft, prefix_cache=args.prefix_cache)
    engine.prepare(options)  # heads and cost tables: at start (a failure too), not in the first request
    policy = engine.adaptive() if args.speculation == "adaptive" else None
    scheduler = Scheduler(engine, max_batch=args.max_batch, max_queue=args.max_queue,
                          prefill_chunk=args.prefill_chunk, speculation=policy, metrics=Metrics())
    config = ServerConfig(args.served_model_name or args.target, options, api_key, args.max_tokens,
                          args.max_body_bytes, args.max_sessions, args.session_ttl)
    return scheduler, config, create_app(scheduler, config)


def serve(args, progress: bool = False) -> int:
    import uvicorn

    if args.replicas > 1:
        from speclm.serve.ray_app import serve_replicas

        check(args)  # here, before Ray starts: each replica's build checks again
        return serve_replicas(args)
    scheduler, config, app = build(args, progress)
    method = config.options.method

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            """SIGTERM or SIGINT: new requests get 503 (and /health, so a balancer looks elsewhere) while
            running ones finish, for --grace seconds at most; then what is left is cancelled and the
            server exits (status 0). A second signal exits at once."""
            if scheduler.draining:
                return super().handle_exit(sig, frame)
            scheduler.draining = True
            threading.Thread(target=self._drain, name="speclm-drain", daemon=True).start()

        def _drain(self):
            deadline = time.monotonic() + args.grace
            while scheduler.busy() and time.monotonic() < deadline:
                time.sleep(0.05)
            scheduler.stop()  # cancels what is left: their streams end with an error event
            self.should_exit = True

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                for server in self.servers:
                    for sock in server.sockets:
                        host, port = sock.getsockname()[:2]
                        print(f"speclm: serving {config.model_name} ({method}, {args.speculation} speculation) on "
                              f"http://{host}:{port}", file=sys.stderr, flush=True)

    scheduler.start()
    server = Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                   timeout_graceful_shutdown=5, access_log=False))
    try:
        server.run()
    finally:
        scheduler.stop()
    return 0 if server.started else 1
