"""`speclm serve --replicas N`: the same app as a Ray Serve deployment of N replicas behind Ray's
HTTP router (the optional extra `speclm[ray]`).

Each replica is a process of its own that builds what `speclm serve` builds (models, engine thread,
FastAPI app: speclm.serve.main.build) from the same options, so the routes, the request fields
and the errors are the same. Ray's proxy listens on --host/--port and spreads requests over the
replicas. Each replica runs its own batch, prefix cache and metrics, so `/metrics` answers for
whichever replica the router picks. Ray Serve's graceful shutdown lets running requests finish
for up to --grace seconds.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading

from speclm.errors import UsageError


def _builder(args):
    """What each replica runs once: the app of `speclm serve`, its engine thread started."""

    def build():
        from speclm.runtime import set_threads, usable_cores
        from speclm.serve.main import build as build_server

        set_threads(args.threads or max(1, usable_cores() // args.replicas))  # the cores shared out
        scheduler, _, app = build_server(args)
        scheduler.start()
        return app

    return build


def serve_replicas(args) -> int:
    try:
        import ray
        from ray import serve
    except ImportError:
        raise UsageError("--replicas needs Ray Serve: pip install 'speclm[ray]'") from None
    from speclm.models.loading import check_model_name

    check_model_name(args.target)  # fail here, before Ray starts replicas that would fail alike
    if args.draft:
        check_model_name(args.draft)
    port = args.port or _free_port(args.host)
    env = {k: v for k, v in os.environ.items() if k.startswith(("SPECLM_", "TORCH_", "HF_", "TRANSFORMERS_"))}
    ray.init(include_dashboard=False, logging_level="ERROR", configure_logging=True,
             runtime_env={"env_vars": env})
    try:
        serve.start(http_options={"host": args.host, "port": port})
        deployment = serve.deployment(
            name="speclm", num_replicas=args.replicas, graceful_shutdown_timeout_s=args.grace,
            max_ongoing_requests=args.max_batch + args.max_queue,
            ray_actor_options={"num_cpus": 0},  # the replicas share the cores (their torch threads are set)
        )(serve.ingress(_builder(args))())
        serve.run(deployment.bind(), name="speclm", route_prefix="/")
        states = serve.status().applications["speclm"].deployments["speclm"].replica_states  # Ray's own count
        running = states.get("RUNNING", 0)
        print(f"speclm: serving {args.served_model_name or args.target} with {running} running replicas (Ray Serve) "
              f"on http://{args.host}:{port}", file=sys.stderr, flush=True)
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
        serve.shutdown()
    finally:
        ray.shutdown()
    return 0


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
