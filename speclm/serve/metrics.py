"""The server's Prometheus metrics (prometheus-client), named after vLLM's where one exists
(`vllm:` becomes `speclm:`), each in a registry of the server's own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

disable_created_metrics()  # no *_created series: a scrape shows the counters alone, as vLLM's do

# seconds: from a token's few milliseconds on a small model to a long prompt's prefill
_LATENCY = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.http_requests = Counter("speclm:http_requests", "HTTP requests by route and status code",
                                     ["route", "status"], registry=r)
        self.request_success = Counter("speclm:request_success", "Finished generation requests by finish reason",
                                       ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("speclm:prompt_tokens", "Prompt tokens read", registry=r)
        self.generation_tokens = Counter("speclm:generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("speclm:time_to_first_token_seconds", "Time from arrival to the first token",
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("speclm:inter_token_latency_seconds",
                             "Time between a request's successive tokens (a step's tokens share its time)",
                             buckets=_LATENCY, registry=r)
        self.e2e = Histogram("speclm:e2e_request_latency_seconds", "Time from arrival to the last token",
                             buckets=_LATENCY, registry=r)
        self.waiting = Gauge("speclm:num_requests_waiting", "Requests queued, not yet in the batch", registry=r)
        self.running = Gauge("speclm:num_requests_running", "Requests in the running batch (reading or decoding)",
                             registry=r)
        self.cache_rows = Gauge("speclm:kv_cache_rows_used", "Rows of the target's KV cache pool held by requests",
                                registry=r)
        self.sessions = Gauge("speclm:verify_sessions", "Remote verification sessions held (speclm.serve.remote)",
                              registry=r)
        self.failures = Counter("speclm:engine_failures", "Engine steps that raised (their requests failed with "
                                "a 500; the server went on with fresh caches)", registry=r)
        self.steps = Counter("speclm:engine_steps", "Target forwards by kind (prefill or round)", ["kind"], registry=r)
        self.draft_length = Gauge("speclm:spec_decode_draft_length",
                                  "The last round's draft length cap by method (adaptive speculation)", ["method"],
                                  registry=r)
        self.drafts = Counter("speclm:spec_decode_num_drafts", "Rounds in which a request had a draft verified",
                              ["method"], registry=r)
        self.draft_tokens = Counter("speclm:spec_decode_num_draft_tokens", "Draft tokens verified", ["method"],
                                    registry=r)
        self.accepted_tokens = Counter("speclm:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                       ["method"], registry=r)
        self.accepted_per_pos = Counter("speclm:spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each depth of the draft", ["method", "position"],
                                        registry=r)
