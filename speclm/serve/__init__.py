"""`speclm serve`: an OpenAI-compatible HTTP server over one engine with continuous batching.

- speclm.serve.protocol: the request bodies (OpenAI's fields, checked) and OpenAI-style errors
- speclm.serve.scheduler: the engine thread that runs one Batch; requests join and leave it
- speclm.serve.metrics: the Prometheus metrics
- speclm.serve.app: the routes (FastAPI), streaming by server-sent events
- speclm.serve.main: the command (uvicorn), its options and graceful shutdown
"""
