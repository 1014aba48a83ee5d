"""The chat page at GET / of `speclm serve`, driven in a real headless Chromium: its streamed answer
equals the server's own answer to the same chat request, its drafted (green) spans are the stream's
pieces marked `draft_accepted`, its statistics line is written, and a wrong API key shows the 401."""

from __future__ import annotations

import json
import re
import shutil

import httpx
import pytest

import test_serve
from test_serve import KEY, Server

models = test_serve.models  # the fixture (tiny target with a chat template, and a draft)

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]
# a prompt that repeats itself: prompt lookup drafts from it, and the target accepts some of those
# tokens. The tiny byte-level model writes arbitrary bytes, and a drafted token that ends inside a
# multi-byte character is shown with the target's next token (a character is not split), so not
# every repeating prompt gets a green span; this one does.
PROMPT = "abcabcabcabcabc"
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        pytest.fail(f"the page test needs the Python package playwright ({exc}); install it in the venv")
    path = shutil.which(CHROMIUM) or shutil.which("chromium")
    if path is None:
        pytest.fail(f"the page test needs Chromium at {CHROMIUM} (Debian package chromium)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, headless=True, args=ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def page_server(models):
    s = Server("--target", models["target"], "--draft", models["draft"], "--quantize", "int8",
               "--draft-quantize", "int8", "--api-key", KEY,
               # fixed draft lengths: adaptive ones (and auto's plan) depend on earlier requests, and so
               # would what gets drafted
               "--speculation", "fixed", "--method", "draft+pld")
    yield s
    assert s.stop() == 0, "".join(s.log)


def _open(browser, server, key: str, spec: str = "pld"):
    page = browser.new_page()
    page.set_default_timeout(30_000)
    page.goto(server.url + "/")
    if not page.locator("#key").is_visible():
        page.click("details summary")
    page.fill("#key", key)
    page.fill("#max", str(MAX_TOKENS))
    page.fill("#temp", "0")
    page.select_option("#spec", spec)
    return page


def _sse(text: str) -> list[dict]:
    chunks = []
    for block in text.split("\n\n"):
        block = block.strip()
        if block.startswith("data: ") and block != "data: [DONE]":
            chunks.append(json.loads(block[6:]))
    return chunks


def test_chat_page_streams_the_servers_answer(browser, page_server, tmp_path):
    auth = {"Authorization": f"Bearer {KEY}"}
    model = httpx.get(page_server.url + "/v1/models", headers=auth).json()["data"][0]["id"]
    page = _open(browser, page_server, KEY)
    try:
        assert model in page.title()
        page.fill("#prompt", PROMPT)
        with page.expect_response(lambda r: r.url.endswith("/v1/chat/completions")) as caught:
            page.click("#send")
        page.wait_for_function("document.getElementById('stats').textContent.trim().length > 0")
        page.wait_for_function("!document.getElementById('send').disabled")
        response = caught.value
        assert response.status == 200
        sent = response.request.post_data_json
        assert sent["messages"] == [{"role": "user", "content": PROMPT}] and sent["stream"] is True
        assert sent["speculation"] == "pld" and sent["max_tokens"] == MAX_TOKENS and sent["temperature"] == 0
        stream = _sse(response.text())  # what the page read

        shown = page.locator("#log .answer").text_content()
        stats = page.locator("#stats").text_content()
        drafted = page.locator("#log .answer span.drafted").all_text_contents()
        spans = page.locator("#log .answer span").count()
        assert page.locator("#log .user").text_content() == "> " + PROMPT
        page.screenshot(path=str(tmp_path / "page.png"), full_page=True)
    finally:
        page.close()

    direct = httpx.post(page_server.url + "/v1/chat/completions", headers=auth, timeout=60,
                        json={"messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS,
                              "temperature": 0, "speculation": "pld"})
    assert direct.status_code == 200, direct.text
    direct = direct.json()
    assert shown == direct["choices"][0]["message"]["content"] and shown

    # the page's spans are the stream's pieces; green exactly where the choice says draft_accepted
    pieces = [(c["delta"].get("content"), c.get("draft_accepted")) for chunk in stream
              for c in chunk.get("choices", []) if c.get("delta", {}).get("content")]
    assert "".join(p for p, _ in pieces) == shown and spans == len(pieces)
    assert drafted == [p for p, accepted in pieces if accepted]
    spec = next(chunk["speculation"] for chunk in stream if "speculation" in chunk)
    usage = next(chunk["usage"] for chunk in stream if chunk.get("usage"))
    assert spec["method"] == "pld"
    assert direct["speculation"]["accepted_tokens"] > 0 and spec["accepted_tokens"] > 0, (direct, spec)
    assert drafted, (direct["speculation"], spec, pieces)

    assert "tokens per target forward (pld)" in stats, stats
    assert stats.startswith(f"{usage['completion_tokens']} tokens · "), stats
    per_forward = re.search(r"([\d.]+) tokens per target forward", stats)
    assert per_forward and abs(float(per_forward.group(1)) - spec["tokens_per_forward"]) <= 0.0051, (stats, spec)
    assert (tmp_path / "page.png").stat().st_size > 0


def test_chat_page_shows_a_wrong_key(browser, page_server):
    page = _open(browser, page_server, "not-the-key")
    try:
        page.fill("#prompt", PROMPT)
        page.click("#send")
        answer = page.locator("#log .answer")
        answer.filter(has_text="error 401").wait_for()
        assert answer.text_content().startswith("error 401: missing or incorrect API key")
        assert page.locator("#stats").text_content() == ""
        page.wait_for_function("!document.getElementById('send').disabled")
    finally:
        page.close()
