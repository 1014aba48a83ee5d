"""`speclm serve --replicas 2`: the same app as a Ray Serve deployment of two replicas behind Ray's
router, on a tiny model: the same routes, and the same outputs as one server alone."""

from __future__ import annotations

import time

import httpx
import pytest

import test_serve
from test_serve import KEY, PROMPTS, Server

models = test_serve.models  # the fixture


def test_two_replicas_behind_rays_router_serve_the_same_app(models):
    pytest.importorskip("ray.serve", reason="the optional extra speclm[ray]")

    s = Server("--target", models["target"], "--quantize", "int8", "--method", "pld", "--api-key", KEY,
               "--replicas", "2", "--threads", "1")
    try:
        headers = {"Authorization": f"Bearer {KEY}"}
        assert httpx.get(s.url + "/health", timeout=60).json() == {"status": "ok"}
        assert httpx.get(s.url + "/v1/models", timeout=60).status_code == 401  # the app's own key check
        models_list = httpx.get(s.url + "/v1/models", headers=headers, timeout=60).json()
        assert models_list["data"][0]["speclm"]["method"] == "pld"
        texts = set()
        for _ in range(4):  # the router spreads these over the replicas; each answers alike
            body = {"prompt": PROMPTS[7], "max_tokens": 24, "temperature": 0}
            out = httpx.post(s.url + "/v1/completions", json=body, headers=headers, timeout=120).json()
            texts.add(out["choices"][0]["text"])
        assert len(texts) == 1
        alone = Server("--target", models["target"], "--quantize", "int8", "--method", "pld", "--threads", "1")
        try:
            body = {"prompt": PROMPTS[7], "max_tokens": 24, "temperature": 0}
            assert httpx.post(alone.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"] \
                in texts
        finally:
            alone.stop()
        assert any("with 2 running replicas (Ray Serve)" in line for line in s.log), s.log  # Ray's count
    finally:
        assert s.stop(timeout=120) == 0, "".join(s.log)
    deadline = time.monotonic() + 30
    while s.proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.1)
