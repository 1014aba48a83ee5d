"""logprobs (GenerationOptions.logprobs): each generated token's log-probability under the target's
distribution where it was committed, and the likeliest alternatives, read from the forward that
verified it. With int8 weights they are plain decoding's bit for bit whatever the method drafted;
in fp32 they match an independent forward to rounding. The server's shapes: tests/test_serve.py."""

from __future__ import annotations

import copy

import pytest
import torch

from speclm import SpecEngine
from speclm.errors import UsageError
from speclm.options import GenerationOptions
from speclm.quant.weights import quantize_model
from tiny import loaded, random_heads, require_compiled_kernels

PROMPTS = ["ab ab ab ab", "hello world, hello", "the quick brown fox"]
N = 30


@pytest.fixture(scope="module")
def int8_engine(target):
    t8 = loaded(quantize_model(copy.deepcopy(target.model), "int8"), target.tokenizer, name="tiny-int8")
    return SpecEngine(t8, draft=t8)  # the target drafts for itself: long accepted paths


def test_every_method_gives_plain_decodings_logprobs_bit_for_bit(int8_engine, tmp_path):
    require_compiled_kernels()
    eagle = random_heads("eagle", int8_engine.target.model, tmp_path / "eagle.safetensors", seed=5, std=0.5)
    settings = [("pld", {}), ("draft", {}), ("draft", {"tree": "auto"}), ("draft+pld", {}), ("eagle+pld", {"heads": eagle}),
                ("lookahead", {}), ("auto", {"heads": eagle})]
    for prompt in PROMPTS:
        ref = int8_engine.generate(prompt, method="none", max_new_tokens=N, logprobs=4)
        assert len(ref.logprobs) == len(ref.token_ids) and [e.token for e in ref.logprobs] == ref.token_ids
        for e in ref.logprobs:  # the committed token is the argmax (greedy): first among the alternatives
            assert len(e.top) == 4 and e.top[0] == (e.token, e.logprob)
            assert [v for _, v in e.top] == sorted((v for _, v in e.top), reverse=True)
        accepted = 0
        for method, options in settings:
            out = int8_engine.generate(prompt, method=method, max_new_tokens=N, logprobs=4, **options)
            assert out.token_ids == ref.token_ids and out.logprobs == ref.logprobs, (prompt, method)
            accepted += out.stats.accepted_tokens
        assert accepted > 0
    # in a batch, each row's are its own
    outs = int8_engine.generate(PROMPTS, method="draft+pld", max_new_tokens=N, logprobs=2)
    refs = int8_engine.generate(PROMPTS, method="none", max_new_tokens=N, logprobs=2)
    assert [o.logprobs for o in outs] == [r.logprobs for r in refs]


def test_fp32_logprobs_match_an_independent_forward(target):
    engine = SpecEngine(target, draft=target)
    tok = target.tokenizer
    for prompt in PROMPTS:
        out = engine.generate(prompt, method="draft+pld", max_new_tokens=N, logprobs=0, temperature=0.9, seed=4)
        ids = tok(prompt).input_ids
        with torch.no_grad():
            logits = target.model(torch.tensor([ids + out.token_ids])).logits[0, len(ids) - 1: -1]
        want = torch.log_softmax(logits, -1)[torch.arange(len(out.token_ids)), torch.tensor(out.token_ids)]
        assert torch.allclose(torch.tensor([e.logprob for e in out.logprobs]), want, atol=1e-4)
        assert all(e.top == () for e in out.logprobs)


def test_a_constraint_removes_the_forbidden_tokens(int8_engine):
    out = int8_engine.generate(PROMPTS[0], method="draft+pld", max_new_tokens=12, logprobs=5, regex="[ab ]+")
    allowed = set(int8_engine.target.tokenizer("ab ").input_ids) | set(int8_engine.target.eos_token_ids)
    for e in out.logprobs:
        assert {t for t, _ in e.top} <= allowed and len(e.top) <= len(allowed)
        assert sum(torch.tensor([v for _, v in e.top]).exp()) == pytest.approx(1.0, abs=1e-4)


def test_a_stop_string_cuts_them_with_the_tokens(int8_engine):
    ref = int8_engine.generate(PROMPTS[1], method="none", max_new_tokens=N)
    stop = int8_engine.target.tokenizer.decode(ref.token_ids[5:7])
    out = int8_engine.generate(PROMPTS[1], method="draft+pld", max_new_tokens=N, logprobs=1, stop=(stop,))
    assert out.finish_reason == "stop" and len(out.logprobs) == len(out.token_ids) < len(ref.token_ids)


@pytest.mark.parametrize("bad", [-1, 21, 2.5, True])
def test_bad_logprobs_are_refused(bad):
    with pytest.raises(UsageError, match="logprobs"):
        GenerationOptions(logprobs=bad)


def test_without_logprobs_there_are_none(int8_engine):
    out = int8_engine.generate(PROMPTS[0], method="draft+pld", max_new_tokens=6)
    assert out.logprobs is None and "logprobs" not in out.to_dict()
    assert len(int8_engine.generate(PROMPTS[0], max_new_tokens=6, logprobs=1).to_dict()["logprobs"]) == 6
