"""`speclm serve`'s options (argparse only: the command line is parsed before anything heavy loads)."""

from __future__ import annotations

from speclm.methods import DRAFT_MODEL, NAMES as METHODS, using
from speclm.runtime import DRAFT_NONE_HELP, QUANTIZE_CHOICES, QUANTIZE_HELP, QUANTIZE_MODES

MAX_BATCH = 8  # requests decoding at once: the concurrency the load benchmark measures up to
MAX_QUEUE = 64
PREFILL_CHUNK = 256  # prompt tokens per step: a 2k-token prompt delays running streams by 8 short steps, not one long one
MAX_TOKENS_CAP = 4096
MAX_BODY_BYTES = 4 << 20  # a 32k-token prompt is about 128 KB of text: room for long contexts, not for abuse
GRACE_SECONDS = 30.0
MAX_SESSIONS = 64  # remote verification sessions: one per remote client's generation, each a prefix-cache entry
SESSION_TTL = 600.0


def add_serve_parser(sub, add_draft_options, prefix_cache_help: str, draft_quantize_help: str) -> None:
    from speclm.defaults import PREFIX_CACHE_TOKENS

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching")
    s.add_argument("--target", required=True, help="catalog name, hub id, model folder or .gguf file")
    s.add_argument("--draft", help=f"draft model (same tokenizer as the target) for methods {', '.join(using(DRAFT_MODEL))}"
                   + DRAFT_NONE_HELP)
    s.add_argument("--method", choices=list(METHODS), default=None,
                   help="each request's method unless it asks for another (its \"speculation\" field); default "
                        "auto: per request and round, the planner picks among the methods the loaded models allow")
    s.add_argument("--speculation", choices=("adaptive", "fixed"), default="adaptive",
                   help="adaptive (default): each round's draft length chosen from the batch's size, this machine's "
                        "measured forward costs and the requests' acceptance (0: plain decoding); fixed: every round "
                        "drafts k (a request that sets k keeps it either way)")
    add_draft_options(s)
    s.add_argument("--quantize", choices=QUANTIZE_CHOICES, default="auto", help=QUANTIZE_HELP)
    s.add_argument("--draft-quantize", choices=QUANTIZE_MODES, default=None, help=draft_quantize_help)
    s.add_argument("--prefix-cache", type=int, default=PREFIX_CACHE_TOKENS, metavar="TOKENS", help=prefix_cache_help
                   + "; shared by all requests")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s: this machine only)")
    s.add_argument("--port", type=int, default=8000, help="port (default %(default)s; 0: any free one, printed)")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health "
                   "and the page (default: env SPECLM_API_KEY; none: open)")
    s.add_argument("--served-model-name", default=None, help="the model id clients send and /v1/models lists "
                   "(default: --target)")
    s.add_argument("--max-batch", type=int, default=MAX_BATCH, help="requests decoding at once (default %(default)s)")
    s.add_argument("--max-queue", type=int, default=MAX_QUEUE,
                   help="requests waiting for a place in the batch; more get 429 (default %(default)s)")
    s.add_argument("--max-tokens", type=int, default=MAX_TOKENS_CAP,
                   help="a request's max_tokens at most, and its default in chat (default %(default)s)")
    s.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES,
                   help="a request body at most; larger ones get 413 (default %(default)s)")
    s.add_argument("--max-sessions", type=int, default=MAX_SESSIONS,
                   help="remote verification sessions (`generate --verifier`) at once; more get 429 (default %(default)s)")
    s.add_argument("--session-ttl", type=float, default=SESSION_TTL,
                   help="seconds a verification session waits for its next round before it is dropped (the client "
                        "then resumes it from its text; default %(default)g)")
    s.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK,
                   help="prompt tokens read per step while other requests decode (default %(default)s; on int8/int4 "
                        "CPU weights, where chunks give the same bits; elsewhere a prompt is read whole)")
    s.add_argument("--grace", type=float, default=GRACE_SECONDS,
                   help="on SIGTERM: seconds to let running requests finish before they are cancelled "
                        "(default %(default)g)")
    s.add_argument("--replicas", type=int, default=1,
                   help="above 1: run that many copies of the server as a Ray Serve deployment behind Ray's router, "
                        "each with its own models and batch (pip install 'speclm[ray]'; default 1: this process)")
    s.add_argument("--threads", type=int, default=None, help="torch threads (default: the usable cores; with "
                   "--replicas, each replica's)")
