"""`speclm bench-serve` against a real `speclm serve` process on tiny models (test_serve's helpers)."""

from __future__ import annotations

import json
import socket

import pytest

import test_serve
from test_serve import KEY, Server

from speclm.cli import main
from speclm.errors import UsageError
from speclm.serve.bench import _body, choose_modes

models = test_serve.models  # the tiny model folders (a module-scoped fixture)


@pytest.fixture(scope="module")
def server(models):
    s = Server("--target", models["target"], "--draft", models["draft"], "--quantize", "int8",
               "--draft-quantize", "int8", "--api-key", KEY, "--method", "draft+pld")
    yield s
    assert s.stop() == 0, "".join(s.log)


def test_bench_serve_writes_every_cell(server, tmp_path, monkeypatch, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "category": c}) + "\n" for p, c in
                            (("def fib(n):", "code"), ("The quick brown fox", "text"), ("for i in range(10):", "code"))))
    monkeypatch.setenv("SPECLM_API_KEY", KEY)
    out = tmp_path / "out"
    argv = ["bench-serve", "--url", server.url + "/v1", "--concurrency", "2,1", "--requests", "3", "--max-tokens",
            "16", "--dataset", str(data), "--out", str(out)]
    assert main(argv) == 0, capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    assert results["complete"] and results["server"]["speclm"]["speculation"] == "adaptive"
    assert results["config"]["modes"] == ["off", "on", "adaptive"] and results["config"]["concurrency"] == [1, 2]
    cells = [(s["concurrency"], s["mode"]) for s in results["summary"]]
    assert cells == [(c, m) for c in (1, 2) for m in ("off", "on", "adaptive")]  # modes interleaved
    for s in results["summary"]:
        assert s["requests"] == 3 and s["errors"] == 0 and not s["time_limited"]
        assert s["tokens_per_second"] > 0 and s["completion_tokens"] > 0 and s["wall_seconds"] > 0
        assert 0 < s["ttft_p50"] <= s["ttft_p99"] and s["tokens_per_forward"] > 0
        assert s["itl_p50"] is None or 0 < s["itl_p50"] <= s["itl_p99"]
        assert s["speedup_vs_off"] == pytest.approx(1.0) if s["mode"] == "off" else s["speedup_vs_off"] > 0
        assert s["same_text_as_off"] == [3, 3]  # greedy on int8 weights: speculation and batching are lossless
    assert len(results["requests"]) == 18
    methods = {(r["mode"], r["speculation"]["method"]) for r in results["requests"]}
    assert methods == {("off", "none"), ("on", "draft+pld"), ("adaptive", "draft+pld")}
    for r in results["requests"]:
        assert r["chunks"] == sorted(r["chunks"]) and r["ttft"] == r["chunks"][0] <= r["end"]
    assert "--api-key" not in results["command"] and results["command"].startswith("speclm bench-serve")
    report = (out / "report.md").read_text()
    assert "| 2 | adaptive | 3 |" in report and results["command"] in report
    for name in ("throughput.png", "itl.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    assert not list(out.glob("*.tmp"))


def _one_error_line(capsys, argv, words: str) -> None:
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("speclm: error:") and words in lines[0], lines


def test_bad_targets_are_one_line_exit_2(tmp_path, capsys):
    out = str(tmp_path / "out")
    _one_error_line(capsys, ["bench-serve", "--url", "http://example.com:8000", "--out", out], "this machine")
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    _one_error_line(capsys, ["bench-serve", "--url", f"http://127.0.0.1:{port}", "--out", out], "cannot reach")
    (tmp_path / "file").write_text("x")
    _one_error_line(capsys, ["bench-serve", "--url", f"http://127.0.0.1:{port}", "--out", str(tmp_path / "file")],
                    "not a folder")
    _one_error_line(capsys, ["bench-serve", "--url", f"http://127.0.0.1:{port}", "--concurrency", "0", "--out", out],
                    "concurrency")
    assert not (tmp_path / "out").exists()


def test_modes_the_server_cannot_run():
    fixed = {"method": "draft+pld", "k": 4, "speculation": "fixed"}
    assert choose_modes(None, fixed) == (["off", "on"], {"adaptive": choose_modes(None, fixed)[1]["adaptive"]})
    with pytest.raises(Exception, match="fixed speculation"):
        choose_modes("off,adaptive", fixed)
    assert choose_modes(None, {"method": "none", "k": 4, "speculation": "adaptive"})[0] == ["off"]
    with pytest.raises(Exception, match="choose from"):
        choose_modes("off,fast", fixed)


def test_modes_naming_methods():
    served = {"method": "auto", "k": None, "speculation": "adaptive", "draft": "tiny-draft"}
    modes, skipped = choose_modes("off,pld,draft+pld:k=3,auto", served)
    assert modes == ["off", "pld", "draft+pld:k=3", "auto"] and skipped == {}
    assert _body("m", "pld", served, 8)["speculation"] == "pld"
    assert _body("m", "draft+pld:k=3", served, 8)["speculation"] == {"method": "draft+pld", "k": 3}
    assert "speculation" not in _body("m", "adaptive", served, 8)
    for bad, words in (("off,fast", "choose from"), ("pld:k=0", "k=N"), ("pld:n=2", "k=N"), ("pld:k=x", "k=N")):
        with pytest.raises(UsageError, match=words):
            choose_modes(bad, served)
    with pytest.raises(UsageError, match="needs a draft model"):
        choose_modes("off,draft+pld", {**served, "draft": None})
    assert choose_modes("off,pld", {**served, "draft": None})[0] == ["off", "pld"]


def test_method_modes_run_each_method(server, tmp_path, monkeypatch, capsys):
    """Modes named by method send that method: the server runs it (its stats say so), beside off."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "category": "code"}) + "\n" for p in ("def fib(n):", "x = [1, 2,")))
    monkeypatch.setenv("SPECLM_API_KEY", KEY)
    out = tmp_path / "out"
    argv = ["bench-serve", "--url", server.url, "--concurrency", "1", "--requests", "2", "--max-tokens", "12",
            "--modes", "off,pld,draft:k=2", "--dataset", str(data), "--out", str(out)]
    assert main(argv) == 0, capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    methods = {(r["mode"], r["speculation"]["method"]) for r in results["requests"]}
    assert methods == {("off", "none"), ("pld", "pld"), ("draft:k=2", "draft")}
    assert [s["same_text_as_off"] for s in results["summary"] if s["mode"] != "off"] == [[2, 2], [2, 2]]
    assert "| 1 | draft:k=2 | 2 |" in (out / "report.md").read_text()


def test_the_report_shows_what_the_prefix_cache_spared_each_cell():
    """A cell's share of prompt tokens read from the server's prefix cache is in the table, and
    modes of one concurrency whose shares differ by more than 10 points are called out."""
    from speclm.serve.bench import markdown, summarize

    def request(mode, cached):
        return {"concurrency": 1, "mode": mode, "prompt": 0, "error": None, "completion_tokens": 8, "prompt_tokens": 100,
                "ttft": 0.1, "chunks": [0.1, 0.2], "end": 0.3, "text_sha1": "a",
                "speculation": {"target_forwards": 8, "draft_tokens": 0, "accepted_tokens": 0, "cached_prompt_tokens": cached}}

    def results(shares):
        return {"cells": [{"concurrency": 1, "mode": m, "wall_seconds": 1.0, "time_limited": False} for m in shares],
                "requests": [request(m, c) for m, c in shares.items()], "complete": True, "command": "speclm bench-serve",
                "created": "now", "config": {"requests": 1, "dataset": "d", "max_tokens": 8, "time_limit": 10.0,
                                             "skipped_modes": {}, "concurrency": [1]},
                "server": {"url": "u", "model": "m", "speclm": {"method": "auto", "k": None}},
                "machine": {"cpu": "cpu", "cpu_count": 2}}

    for shares, uneven in (({"off": 54, "auto": 45}, False), ({"off": 54, "auto": 22}, True)):
        r = results(shares)
        report = markdown(r, summarize(r))
        assert f"| 1 | auto | 1 | 8 | 1.00 | 8.00 | 1.00 | 100.0 | 100.0 | 28.6 | 28.6 | 1.00 | {shares['auto']}% |" in report
        assert ("unequal shares of the prompts" in report) == uneven, report
