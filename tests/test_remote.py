"""Remote verification: `speclm generate --verifier URL` drafting here, a real `speclm serve` on
127.0.0.1 verifying, through a TCP proxy that delays every packet (a slow link). The text must be
the server's own plain decoding (greedy, and sampled with a seed: drawn by position); unseeded
sampling follows the target's distribution exactly (a chi-square check on the verify step);
lost sessions resume; bad calls and bad servers get one line."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time

import httpx
import pytest
import torch

import numpy as np

from chisq import ALPHA, chisq_pvalue
from conftest import save
from test_serve import KEY, Server
from tiny import byte_tokenizer, loaded, tiny_model, word_tokenizer

from speclm.cli import main
from speclm.remote import MAX_DRAFT, DelayedLink, DraftLength
from speclm.engine import SpecEngine
from speclm.options import GenerationOptions
from speclm.requests import Given, Request
from speclm.sampling import processed_probs

PROMPTS = ["def fib(n):", "The quick brown fox", "hello hello hello hello"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote-models")
    tok = byte_tokenizer()
    target = save(tiny_model(len(tok), seed=0), tok, root / "target")
    # the draft: the target's own weights in int4 (the server's are int8): it agrees often, not always
    return {"target": target, "draft": target, "other": save(tiny_model(40, seed=2), word_tokenizer(40), root / "other")}


@pytest.fixture(scope="module")
def server(models):
    s = Server("--target", models["target"], "--quantize", "int8", "--api-key", KEY, "--method", "none",
               "--session-ttl", "30")
    yield s
    assert s.stop() == 0, "".join(s.log)


def _plain(server, prompt: str, max_tokens: int, **sampling) -> str:
    """The server's own plain decoding of the prompt."""
    reply = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                       json={"prompt": prompt, "max_tokens": max_tokens, "speculation": "off", "temperature": 0, **sampling})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def _remote(capsys, monkeypatch, url, models, prompt, *args) -> dict:
    monkeypatch.setenv("SPECLM_API_KEY", KEY)
    assert main(["generate", "--verifier", url, "--draft", models["draft"], "--prompt", prompt, "--json",
                 "--draft-quantize", "int4", *args]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("delay", [0.0, 0.02])  # round-trip seconds
def test_greedy_through_a_slow_link_is_the_server_s_own_decoding(server, models, capsys, monkeypatch, delay):
    proxy = DelayedLink(server.url, delay / 2)
    for prompt in PROMPTS:
        out = _remote(capsys, monkeypatch, proxy.url, models, prompt, "--max-new-tokens", "48")
        assert out["text"] == _plain(server, prompt, 48), prompt
        s = out["stats"]
        assert s["new_tokens"] == len(out["token_ids"]) and s["round_trips"] == len(out["draft_lengths"])
        assert s["target_forwards"] == s["round_trips"]  # one forward per round, the prefill's included
        assert s["accepted_tokens"] > 0 and s["target_forwards"] < s["new_tokens"]
        assert s["round_trip_seconds"] >= delay * s["round_trips"]
        assert all(1 <= k <= 16 for k in out["draft_lengths"][:-1])  # chosen per round (the last: what was left)


def test_the_draft_length_follows_the_link_and_the_acceptance():
    """DraftLength picks the k of most expected tokens per second from what it measured: a slower
    link drafts longer chains, a draft that is accepted less drafts shorter ones, --k is kept."""
    def chosen(trip: float, accepted: int, drafted: int = 8) -> int:
        policy = DraftLength()
        for _ in range(30):
            policy.observe(drafted, accepted, 0.004 * drafted, drafted, trip)
        return policy.choose()

    fast, slow = chosen(0.005, 6), chosen(0.08, 6)
    assert 1 <= fast < slow <= MAX_DRAFT
    assert chosen(0.08, 1) < slow
    fixed = DraftLength(5, fixed=True)
    fixed.observe(8, 0, 0.1, 8, 1.0)
    assert fixed.choose() == 5


@pytest.mark.parametrize("method", ["pld", "draft+pld"])
def test_every_chain_method_drafts_for_the_server(server, models, capsys, monkeypatch, method):
    out = _remote(capsys, monkeypatch, server.url, models, PROMPTS[2], "--max-new-tokens", "40", "--method", method)
    assert out["text"] == _plain(server, PROMPTS[2], 40)
    assert out["stats"]["drafted_tokens"] > 0 and out["stats"]["target_forwards"] == out["stats"]["round_trips"]


def test_unseeded_sampling_runs_to_its_length_and_is_counted(server, models, capsys, monkeypatch):
    """Sampled without a seed (the draft's distributions travel with it; their exactness: the
    chi-square test below): it generates, and the server counts the remote rounds."""
    drafts = server.metric("speclm:spec_decode_num_draft_tokens_total", 'method="remote"')
    out = _remote(capsys, monkeypatch, server.url, models, PROMPTS[0], "--max-new-tokens", "30", "--temperature", "1.0")
    s = out["stats"]
    assert s["drafted_tokens"] > 0 and s["new_tokens"] == len(out["token_ids"]) >= 1
    assert server.metric("speclm:spec_decode_num_draft_tokens_total", 'method="remote"') >= drafts + s["drafted_tokens"]
    assert server.metric("speclm:verify_sessions") == 0  # ended with its generation


def test_seeded_sampling_draws_as_the_server_s_seeded_decoding(server, models, capsys, monkeypatch):
    for seed in (3, 11):
        out = _remote(capsys, monkeypatch, server.url, models, PROMPTS[0], "--max-new-tokens", "40",
                      "--temperature", "0.8", "--top-k", "50", "--seed", str(seed))
        assert out["text"] == _plain(server, PROMPTS[0], 40, temperature=0.8, top_k=50, seed=seed)


def test_lost_sessions_resume_from_the_client_s_text(models, capsys, monkeypatch):
    """A server that drops every session at once (ttl 0): each round resumes it, and the text is
    the same; a server restarted mid-generation too (the client's retries reach the new one)."""
    s = Server("--target", models["target"], "--quantize", "int8", "--api-key", KEY, "--method", "none",
               "--session-ttl", "0")
    try:
        out = _remote(capsys, monkeypatch, s.url, models, PROMPTS[1], "--max-new-tokens", "32")
        assert out["text"] == _plain(s, PROMPTS[1], 32)
        assert out["stats"]["resumed_sessions"] == out["stats"]["round_trips"] - 1
    finally:
        assert s.stop() == 0


def test_a_server_restarted_mid_generation_resumes_the_session(models, capsys, monkeypatch):
    """The server is killed mid-generation and started again on its port: the client's round waits
    for it, finds its session gone, resumes it from its text, and the text is the server's own."""
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = str(probe.getsockname()[1])
    args = ("--target", models["target"], "--quantize", "int8", "--api-key", KEY, "--method", "none", "--port", port)
    first = Server(*args)
    url = first.url
    result = {}

    def client():  # a slow link (80 ms round trips): the generation outlasts the first server
        result["out"] = _remote(capsys, monkeypatch, DelayedLink(url, 0.04).url, models, PROMPTS[0],
                                "--max-new-tokens", "200", "--k", "2")

    thread = threading.Thread(target=client)
    thread.start()
    time.sleep(2.0)
    first.proc.kill()
    first.proc.wait()
    second = Server(*args)
    try:
        thread.join(300)
        out = result["out"]
        assert out["stats"]["resumed_sessions"] >= 1
        assert out["text"] == _plain(second, PROMPTS[0], 200)
    finally:
        assert second.stop() == 0


def test_verify_calls_are_checked(server):
    def post(body):
        return httpx.post(server.url + "/v1/speclm/verify", headers={"Authorization": f"Bearer {KEY}"}, json=body,
                          timeout=60)

    start = {"prompt": [72, 101], "max_tokens": 8, "temperature": 0}
    for body, field in ((dict(start, draft=[1], colour="red"), "colour"), (dict(start, draft=[10 ** 6]), "draft"),
                        (dict(start, draft=[5], draft_probs=[[[5, 1.0]]]), "draft_probs"),
                        ({"draft": [1]}, "prompt"), (dict(start, tokenizer="0" * 16), "tokenizer"),
                        (dict(start, max_tokens=10 ** 6), "max_tokens"), ({"session": "nope", "draft": []}, "session")):
        reply = post(body)
        assert 400 <= reply.status_code < 500 and reply.json()["error"]["param"] == field, (body, reply.text)
    first = post(dict(start, draft=[]))
    sid = first.json()["session"]
    assert post({"session": sid, "draft": [], "temperature": 0.5}).json()["error"]["param"] == "temperature"
    held = 2 + len(first.json()["tokens"])
    assert post({"session": sid, "draft": [], "context_length": held + 1}).status_code == 409
    again = {"session": sid, "draft": [101, 102], "context_length": held}
    reply = post(again)
    assert reply.status_code == 200
    assert post(again).json() == reply.json()  # a reply the client lost is given again, nothing committed twice
    assert post({"session": sid, "draft": [], "context_length": held + len(reply.json()["tokens"])}).status_code == 200
    sampled = post({"prompt": [72], "max_tokens": 4, "temperature": 1.0, "draft": [5], "draft_probs": [[[5, 0.5]]]})
    assert sampled.status_code == 400 and sampled.json()["error"]["param"] == "draft_probs"
    # the key and the body limit, as on every route
    assert httpx.post(server.url + "/v1/speclm/verify", json=dict(start, draft=[])).status_code == 401
    huge = post(dict(start, draft=[], prompt=[72] * (1 << 21)))  # 8 MB of JSON, over the 4 MiB limit
    assert huge.status_code == 413


def test_a_server_that_cannot_verify_for_this_draft_is_refused(server, models, capsys, monkeypatch, tmp_path):
    """Another tokenizer, a server that is not speclm's, one that is down: one line, exit 2, nothing on stdout."""
    monkeypatch.setenv("SPECLM_API_KEY", KEY)
    plain = socket.create_server(("127.0.0.1", 0))  # answers every request with a 404 page
    threading.Thread(target=_not_speclm, args=(plain,), daemon=True).start()
    for url, draft, words in ((server.url, models["other"], "another tokenizer"),
                              (f"http://127.0.0.1:{plain.getsockname()[1]}", models["draft"], "not a speclm server"),
                              ("http://127.0.0.1:9", models["draft"], "cannot reach")):
        code = main(["generate", "--verifier", url, "--draft", draft, "--prompt", "hi", "--draft-quantize", "int8"])
        out, err = capsys.readouterr()
        assert code == 2 and out == "" and words in err and len(err.strip().splitlines()) == 1, err
    code = main(["generate", "--prompt", "hi"])  # neither a target nor a verifier
    out, err = capsys.readouterr()
    assert code == 2 and "--target MODEL is required" in err and len(err.strip().splitlines()) == 1
    for args, words in ((["--target", models["target"]], "--target"), (["--tree", "auto"], "--tree"),
                        (["--method", "lookahead"], "target's own states")):
        code = main(["generate", "--verifier", server.url, "--draft", models["draft"], "--prompt", "hi",
                     "--draft-quantize", "int8", *args])
        out, err = capsys.readouterr()
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err


def _not_speclm(sock):
    while True:
        conn, _ = sock.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\nConnection: close\r\n\r\nnot found")
        conn.close()


# ---------------------------------------------------------------- the verify step, in the batch
def test_given_drafts_commit_plain_decoding_in_a_busy_batch(tmp_path):
    """Sessions verified round by round in a running batch (int8: chunked prefills, the prefix cache)
    beside a request decoding on its own: drafts right, wrong and mixed, longer than a prefill
    chunk, each round's tokens are plain greedy decoding's; a planted bug (the draft verified
    against the logits one position late) fails it."""
    from speclm.models.loading import load_model
    from speclm.round import batch as batch_module

    tok = byte_tokenizer()
    target = load_model(save(tiny_model(len(tok), seed=0), tok, tmp_path / "t"), quantize="int8", progress=False)
    engine = SpecEngine(target)
    prompt = tok("the quick brown fox jumps").input_ids
    options = GenerationOptions(method="none", temperature=0, max_new_tokens=60)
    plain = engine.generate(prompt, method="none", max_new_tokens=60).token_ids
    rng = torch.Generator().manual_seed(0)

    def session(batch) -> list[int]:
        generated = []
        while len(generated) < 60:
            n = len(generated)
            width = int(torch.randint(0, 9, (1,), generator=rng))  # up to 8: wider than the chunk of 4
            right = plain[n:n + width]
            wrong = [int(t) for t in torch.randint(0, len(tok), (len(right),), generator=rng)]
            cut = int(torch.randint(0, len(right) + 1, (1,), generator=rng))
            draft = right[:cut] + wrong[cut:]
            left = 60 - n
            draft = draft[: left - 1]
            r = Request(0, prompt + generated + draft, len(prompt) + n + len(draft), left, options, None,
                        given=Given(draft))
            batch.join(r)
            while not r.done:
                batch.step()
            generated += r.generated
            if r.finish_reason == "stop":  # an end of sequence
                break
        return generated

    batch = engine.batch(rows=4, prefill_chunk=4)
    other = batch.join(engine.request("hello there", method="none", max_new_tokens=400))
    assert session(batch) == plain
    assert not other.done  # it decoded beside every round
    saved = batch_module.Batch._verify_given

    def late(self, r, row, logits):  # verified against the logits one position on
        return saved(self, r, row, torch.cat([logits[1:], logits[-1:]]))

    batch_module.Batch._verify_given = late
    try:
        assert session(engine.batch(rows=4, prefill_chunk=4)) != plain
    finally:
        batch_module.Batch._verify_given = saved


# ---------------------------------------------------------------- the verify step's distribution
SAMPLES = 6000


def test_a_given_draft_is_verified_to_the_target_s_distribution():
    """A given one-token draft drawn from an arbitrary q, verified at a request's prefill (what the
    server does per call): the committed first token follows the target's processed distribution
    (chi-square, false-failure probability ALPHA, chisq.py). (A one-hot draft is exact too: a
    point mass on the token drawn is a valid draft.) A planted bug fails it: the distribution sent
    beside the token is not the one it was drawn from (another position's: q drawn, r sent)."""
    tok = byte_tokenizer()
    engine = SpecEngine(loaded(tiny_model(len(tok), seed=0, init=0.5), tok, name="t"))
    prompt = tok("ab").input_ids
    options = GenerationOptions(method="none", temperature=1.0, top_k=12, max_new_tokens=1)
    with torch.no_grad():
        logits = engine.target.model(torch.tensor([prompt])).logits[0, -1:].float()
    p = processed_probs(logits[None], options.sampling)[0, 0]
    gen = torch.Generator().manual_seed(0)
    q = torch.softmax(torch.randn(len(p), generator=gen) * 2, -1)
    q = torch.where(q >= q.topk(20).values[-1], q, torch.zeros_like(q))
    q /= q.sum()
    other = torch.softmax(torch.randn(len(p), generator=gen) * 2, -1) * 0.5 + q * 0.5  # covers q's support

    def firsts(bug: str = "") -> list[int]:
        batch = engine.batch(rows=256)
        out = []
        for start in range(0, SAMPLES, 256):
            requests = []
            for i in range(start, min(SAMPLES, start + 256)):
                g = torch.Generator().manual_seed(1000 + i)
                d = int(torch.multinomial(q, 1, generator=g))
                r = Request(i, prompt + [d], len(prompt) + 1, 1, options, g,
                            given=Given([d], (other if bug == "misplaced" else q)[None].clone()))
                requests.append(r)
                batch.join(r)
            while batch.active:
                batch.step()
            out += [r.generated[0] for r in requests]
        return out

    def p_value(tokens):
        return chisq_pvalue(np.bincount(tokens, minlength=len(p)), p.numpy().astype(np.float64))

    assert p_value(firsts()) > ALPHA
    assert p_value(firsts("misplaced")) < ALPHA


class _BusyVerifier:
    """A verifier whose session answers 409 session_busy `busy` times (its first try of the call still
    running after a dropped connection), then the round."""

    url = "http://verifier.test"

    def __init__(self, busy: int):
        self.busy, self.calls, self.model = busy, 0, {}

    def call(self, body: dict) -> tuple[int, dict]:
        self.calls += 1
        if self.calls <= self.busy:
            return 409, {"error": {"code": "session_busy", "message": "the session's previous call is still running"}}
        return 200, {"tokens": [7], "session": body["session"]}


@pytest.mark.parametrize("busy", [0, 1, 3])
def test_a_busy_session_is_asked_again_until_it_answers(monkeypatch, busy):
    from speclm import remote

    monkeypatch.setattr(remote.time, "sleep", lambda s: None)
    verifier, stats = _BusyVerifier(busy), remote.RemoteStats()
    request = Request.of(0, [72, 101], GenerationOptions(max_new_tokens=4), 0, None)
    reply = remote._verify(verifier, {"draft": []}, "s1", [72, 101], request, None, stats)
    assert reply == {"tokens": [7], "session": "s1"} and verifier.calls == busy + 1 and stats.resumed == 0


def test_a_session_busy_past_patience_fails_in_one_line(monkeypatch):
    from speclm import remote

    monkeypatch.setattr(remote.time, "sleep", lambda s: None)
    monkeypatch.setattr(remote, "PATIENCE", 0.0)
    verifier = _BusyVerifier(10 ** 6)
    request = Request.of(0, [72, 101], GenerationOptions(max_new_tokens=4), 0, None)
    with pytest.raises(remote.RemoteError) as err:
        remote._verify(verifier, {"draft": []}, "s1", [72, 101], request, None, remote.RemoteStats())
    assert "\n" not in str(err.value) and "409" in str(err.value) and "still running" in str(err.value)
    assert verifier.calls >= 1
