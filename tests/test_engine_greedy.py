"""Greedy exactness of every method, stops, batches and streaming, on tiny random models."""

import pytest
import torch

from speclm import SpecEngine
from speclm.proposers import Draft, Proposer
from speclm.text import IncrementalText
from tiny import loaded

PROMPTS = ["hello world, hello", "abc", "the quick brown fox jumps over the lazy dog, the quick"]
N = 40


def plain(target, prompt, n=N, **kw):
    return SpecEngine(target).generate(prompt, method="none", max_new_tokens=n, **kw)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_draft_equal_to_target_accepts_everything(target, prompt):
    ref = plain(target, prompt)
    out = SpecEngine(target, draft=target).generate(prompt, method="draft", k=4, max_new_tokens=N)
    assert out.token_ids == ref.token_ids
    assert out.stats.acceptance_rate == 1.0
    # the prefill forward commits one token, every later forward k + 1 = 5
    assert out.stats.target_forwards == 1 + -(-(N - 1) // 5)


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("k", [1, 3, 6])
def test_unrelated_draft_and_pld_reproduce_plain(target, unrelated_draft, prompt, k):
    ref = plain(target, prompt)
    for method, draft in (("draft", unrelated_draft), ("pld", None), ("draft+pld", unrelated_draft)):
        out = SpecEngine(target, draft=draft).generate(prompt, method=method, k=k, max_new_tokens=N)
        assert out.token_ids == ref.token_ids, method
        assert out.text == ref.text
    assert ref.stats.target_forwards == N and ref.stats.mean_accepted_tokens == 1.0


class PlantedErrorProposer(Proposer):
    """Proposes the true greedy continuation with a wrong token at draft position `error_at`."""

    name = "planted"

    def __init__(self, reference: list[int], prompt_len: int, k: int, error_at: int, vocab: int):
        self.reference, self.prompt_len, self.k, self.error_at, self.vocab = reference, prompt_len, k, error_at, vocab

    def propose(self, contexts, max_tokens, params, generators):
        (ctx,), (budget,) = contexts, max_tokens
        pos = len(ctx) - self.prompt_len
        tokens = self.reference[pos : pos + min(self.k, budget)]
        if self.error_at < len(tokens):
            tokens[self.error_at] = (tokens[self.error_at] + 1) % self.vocab
        return Draft(torch.tensor([tokens + [0] * (self.k - len(tokens))]), torch.tensor([len(tokens)]), None)


@pytest.mark.parametrize("error_at", range(5))
def test_planted_first_error_at_each_position(target, tok, error_at, monkeypatch):
    prompt, k = PROMPTS[0], 4
    ref = plain(target, prompt)
    prompt_len = len(tok(prompt).input_ids)
    engine = SpecEngine(target)
    planted = PlantedErrorProposer(ref.token_ids, prompt_len, k, error_at, len(tok))
    monkeypatch.setattr(engine, "make_proposer", lambda opts: planted)
    out = engine.generate(prompt, method="pld", k=k, max_new_tokens=N)
    assert out.token_ids == ref.token_ids
    per_pos = out.stats.accepted_per_position
    rounds = out.stats.target_forwards
    # every round accepts exactly the tokens before the planted error (or all k if error_at == k);
    # only the last, budget-limited round may draft fewer
    assert all(0 <= per_pos[0] - per_pos[j] <= 1 for j in range(min(error_at, k)))
    assert all(c == 0 for c in per_pos[error_at:])
    if error_at > 0:
        assert per_pos[0] >= rounds - 3  # all but the prefill and the last, budget-limited rounds
    assert out.stats.new_tokens == N


def test_draft_confidence_shortens_rounds_and_keeps_output(target, unrelated_draft):
    """confidence > 0: a row stops drafting after a token its draft was unsure of; rows of a
    batch then draft different lengths. Output is unchanged; a draft equal to the target
    still has every token accepted."""
    for prompt in PROMPTS:
        ref = plain(target, prompt)
        full = SpecEngine(target, draft=unrelated_draft).generate(prompt, method="draft", k=6, max_new_tokens=N)
        cut = SpecEngine(target, draft=unrelated_draft).generate(prompt, method="draft", k=6, max_new_tokens=N,
                                                                 confidence=0.9)
        assert cut.token_ids == ref.token_ids
        assert cut.stats.drafted_tokens < full.stats.drafted_tokens
        same = SpecEngine(target, draft=target).generate(prompt, method="draft", k=6, max_new_tokens=N, confidence=0.5)
        assert same.token_ids == ref.token_ids and same.stats.acceptance_rate == 1.0
    batch = SpecEngine(target, draft=unrelated_draft).generate(PROMPTS, method="draft", k=6, max_new_tokens=N,
                                                               confidence=0.3)
    assert [b.token_ids for b in batch] == [plain(target, p).token_ids for p in PROMPTS]


def test_batch_equals_single(target, unrelated_draft):
    for method, draft in (("none", None), ("draft", unrelated_draft), ("draft", target), ("pld", None),
                          ("draft+pld", unrelated_draft), ("draft+pld", target)):
        engine = SpecEngine(target, draft=draft)
        batch = engine.generate(PROMPTS, method=method, k=3, max_new_tokens=N)
        for prompt, got in zip(PROMPTS, batch):
            assert got.token_ids == plain(target, prompt).token_ids, method


def test_batch_rows_finish_at_different_times(target, unrelated_draft):
    """Row 0 stops at an EOS early; the others continue and still match their single runs."""
    ref0 = plain(target, PROMPTS[0])
    eos_id = ref0.token_ids[5]
    stop_target = loaded(target.model, target.tokenizer)
    stop_target.eos_token_ids = (eos_id,)
    engine = SpecEngine(stop_target, draft=unrelated_draft)
    batch = engine.generate(PROMPTS, method="draft", k=3, max_new_tokens=N, batch_size=3)
    for prompt, got in zip(PROMPTS, batch):
        alone = SpecEngine(stop_target).generate(prompt, method="none", max_new_tokens=N)
        assert got.token_ids == alone.token_ids and got.finish_reason == alone.finish_reason
    assert batch[0].token_ids[-1] == eos_id and batch[0].finish_reason == "stop"


@pytest.mark.parametrize("method", ["none", "draft", "pld", "draft+pld"])
def test_eos_ends_generation(target, method):
    ref = plain(target, PROMPTS[2])
    pos = next(i for i in range(3, N) if ref.token_ids[i] not in ref.token_ids[:i])
    eos_target = loaded(target.model, target.tokenizer)
    eos_target.eos_token_ids = (12345, ref.token_ids[pos])  # any of several EOS ids stops
    out = SpecEngine(eos_target, draft=target).generate(PROMPTS[2], method=method, k=4, max_new_tokens=N)
    assert out.token_ids == ref.token_ids[: pos + 1]
    assert out.finish_reason == "stop"


@pytest.mark.parametrize("n", [1, 2, 5, 7, 13])
@pytest.mark.parametrize("method", ["none", "draft", "pld", "draft+pld"])
def test_max_new_tokens_exact(target, method, n):
    out = SpecEngine(target, draft=target).generate(PROMPTS[0], method=method, k=4, max_new_tokens=n)
    assert len(out.token_ids) == n and out.finish_reason == "length"
    assert out.token_ids == plain(target, PROMPTS[0], n=n).token_ids


@pytest.mark.parametrize("method", ["none", "draft", "pld", "draft+pld"])
def test_stop_string(target, tok, method):
    ref = plain(target, PROMPTS[1])
    text = ref.text
    start = next(i for i in range(6, len(text) - 3) if text[i : i + 2].isprintable() and text.find(text[i : i + 2]) == i)
    stop = text[start : start + 2]
    out = SpecEngine(target, draft=target).generate(PROMPTS[1], method=method, k=4, max_new_tokens=N, stop=(stop,))
    assert out.text == text[:start]
    assert out.finish_reason == "stop"
    assert out.token_ids == ref.token_ids[: len(out.token_ids)]
    assert stop in tok.decode(out.token_ids) and stop not in tok.decode(out.token_ids[:-1])


def test_stream_deltas_join_to_text(target, unrelated_draft):
    engine = SpecEngine(target, draft=unrelated_draft)
    stream = engine.stream(PROMPTS[0], method="draft", k=3, max_new_tokens=N)
    deltas = list(stream)
    assert len(deltas) > 1
    assert "".join(deltas) == stream.completion.text == plain(target, PROMPTS[0]).text


def test_incremental_text_across_multibyte_characters(tok):
    text = "héllo wörld € 😀 done"
    ids = tok(text).input_ids
    assert len(ids) > len(text)  # some characters span several byte tokens
    inc = IncrementalText(tok)
    deltas = [inc.delta(ids[: i + 1], finished=i == len(ids) - 1) for i in range(len(ids))]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_incremental_text_holds_back_possible_stop(tok):
    ids = tok("abc STOP def").input_ids
    inc = IncrementalText(tok, stops=("STOP",))
    deltas = [inc.delta(ids[: i + 1], finished=False) for i in range(len(ids))]
    assert "".join(deltas) == "abc "
    assert not any("S" in d for d in deltas)
