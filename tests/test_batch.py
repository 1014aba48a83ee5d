"""Requests that join a running decode between rounds and leave when done (speclm.batch): each
request's output is its output alone, greedy or sampled with its seed, whatever shares its batch."""

import copy

import pytest
import torch

from speclm import SpecEngine
from speclm.errors import UsageError
from speclm.kv import StaticKV
from speclm.quant import quantize_model
from tiny import loaded

N = 24
PROMPTS = ["hello world, hello", "abc", "the quick brown fox jumps over the lazy dog, the quick", "zzz top",
           "def f(x): return x + 1\ndef g(x): return"]


@pytest.fixture(scope="module")
def int8_pair(target, unrelated_draft):
    """int8 weights: a row's bits do not depend on the other rows of a forward (speclm.quant)."""
    t8 = loaded(quantize_model(copy.deepcopy(target.model), "int8"), target.tokenizer, name="tiny-target-int8")
    d8 = loaded(quantize_model(copy.deepcopy(unrelated_draft.model), "int8"), unrelated_draft.tokenizer, name="d8")
    return t8, d8


def run_joined(engine, requests, join_at, rows=2):
    """Each request joins the batch before step join_at[i]; returns their completions."""
    batch = engine.batch(rows=rows)
    waiting = sorted(zip(join_at, range(len(requests))))
    step = 0
    while waiting or batch.active:
        while waiting and waiting[0][0] <= step:
            batch.join(requests[waiting.pop(0)[1]])
        batch.step()
        step += 1
    return [engine.completion(r) for r in requests]


# one request per prompt, each its own options: methods, trees, sampling, seeds, stops side by side
MIXED = [
    dict(method="draft", max_new_tokens=N),
    dict(method="pld", max_new_tokens=N, temperature=0.8, top_k=20, seed=11),
    dict(method="draft", draft_vocab=64, max_new_tokens=N, temperature=1.0, seed=3),
    dict(method="draft+pld", tree="auto", draft_vocab=64, max_new_tokens=N - 5, temperature=0.9, seed=5),
    dict(method="none", max_new_tokens=N, temperature=1.0, top_p=0.9, seed=7, stop=("x",)),
]


@pytest.mark.parametrize("join_at", [[0, 0, 0, 0, 0], [0, 1, 3, 4, 9], [6, 0, 2, 2, 0]])
def test_a_request_decodes_as_it_does_alone_whoever_joins_when(int8_pair, join_at):
    t8, d8 = int8_pair
    engine = SpecEngine(t8, draft=d8)
    alone = [engine.generate(p, **o) for p, o in zip(PROMPTS, MIXED)]
    together = run_joined(engine, [engine.request(p, **o) for p, o in zip(PROMPTS, MIXED)], join_at)
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    assert [c.finish_reason for c in together] == [c.finish_reason for c in alone]
    assert all(c.stats.new_tokens == len(c.token_ids) for c in together)


@pytest.mark.parametrize("method, tree", [("none", None), ("pld", None), ("draft", None), ("draft+pld", None),
                                          ("draft", "auto"), ("draft+pld", "auto")])
def test_greedy_requests_joining_late_equal_plain_decoding(int8_pair, method, tree):
    t8, d8 = int8_pair
    plain = SpecEngine(t8).generate(PROMPTS, method="none", max_new_tokens=N)
    engine = SpecEngine(t8, draft=d8 if method != "none" else None)
    options = dict(method=method, max_new_tokens=N, **({"tree": tree} if tree else {}))
    got = run_joined(engine, [engine.request(p, **options) for p in PROMPTS], [0, 2, 2, 5, 7], rows=3)
    assert [c.token_ids for c in got] == [c.token_ids for c in plain]


def test_sampled_requests_keep_their_seeds_in_a_batch_of_others(int8_pair):
    """Same options, other seeds and prompts around them: a seeded request samples what it samples
    alone (its own generator, its own draft vocabulary), joining first or last."""
    t8, d8 = int8_pair
    engine = SpecEngine(t8, draft=t8)  # a draft equal to the target: long accepted runs
    options = dict(method="draft", draft_vocab=64, max_new_tokens=N, temperature=1.0)
    alone = [engine.generate(p, seed=100 + i, **options).token_ids for i, p in enumerate(PROMPTS)]
    requests = [engine.request(p, seed=100 + i, **options) for i, p in enumerate(PROMPTS)]
    got = run_joined(engine, requests, [3, 0, 1, 1, 0], rows=5)
    assert [c.token_ids for c in got] == alone


def test_a_shared_draft_vocabulary_would_couple_requests(int8_pair, monkeypatch):
    """The test above has power: rows drafting over the union of the batch's vocabularies (a row
    then proposes from other prompts' tokens) sample otherwise than alone."""
    from speclm.proposers.draft_vocab import RowVocabs

    t8, _ = int8_pair
    engine = SpecEngine(t8, draft=t8)
    options = dict(method="draft", draft_vocab=64, max_new_tokens=N, temperature=1.0)
    alone = [engine.generate(p, seed=100 + i, **options).token_ids for i, p in enumerate(PROMPTS)]
    monkeypatch.setattr(RowVocabs, "logits", lambda self, b, logits: logits)
    monkeypatch.setattr(RowVocabs, "token_ids", lambda self, b: self.head.ids if self.head is not None else None)
    requests = [engine.request(p, seed=100 + i, **options) for i, p in enumerate(PROMPTS)]
    got = run_joined(engine, requests, [0, 0, 0, 0, 0], rows=5)
    assert [c.token_ids for c in got] != alone


def test_generate_refills_the_batch_as_requests_finish(int8_pair):
    t8, d8 = int8_pair
    engine = SpecEngine(t8, draft=d8)
    plain = SpecEngine(t8).generate(PROMPTS, method="none", max_new_tokens=N)
    got = engine.generate(PROMPTS, method="draft", max_new_tokens=N, batch_size=2)
    assert [c.token_ids for c in got] == [c.token_ids for c in plain]
    assert [c.prompt_index for c in got] == list(range(len(PROMPTS)))


def test_cache_rows_join_and_leave_without_moving_the_others(int8_pair):
    t8, _ = int8_pair
    tok = t8.tokenizer
    a, b, c = (tok(p).input_ids for p in PROMPTS[:3])
    kv = StaticKV(t8.model, 1, 64, pool=2)
    buffers = [t.data_ptr() for t in kv.keys + kv.values]
    kv.forward([a], 1)
    assert kv.add(1) == [1]
    kv.forward([b], 1, only=[1])  # a prefill of the new row alone
    both = kv.forward([[5], [6, 7]], 1)
    kv.select([1])  # row 0 leaves; its cache row is free
    assert kv.add(1) == [1]
    kv.forward([c], 1, only=[1])
    last = kv.forward([[8], [9]], 1)
    assert [t.data_ptr() for t in kv.keys + kv.values] == buffers  # nothing reallocated or moved

    def alone(ids):
        one = StaticKV(t8.model, 1, 64)
        return one.forward([ids], 1)

    assert torch.equal(both[0], alone(a + [5])[0]) and torch.equal(both[1], alone(b + [6, 7])[0])
    assert torch.equal(last[0], alone(b + [6, 7, 8])[0]) and torch.equal(last[1], alone(c + [9])[0])
    kv.add(2)  # past the pool: it grows (a copy), the rows keep their keys and values
    assert kv.pool_size >= 3
    after = kv.forward([[10], [11], [1], [2]], 1)
    assert torch.equal(after[1], alone(c + [9, 11])[0])


def test_transformers_forward_reads_its_own_rows_of_the_pool(target, monkeypatch):
    import speclm.runner as kv_mod

    monkeypatch.setattr(kv_mod.lean, "supports", lambda model: False)
    model = copy.deepcopy(target.model)
    tok = target.tokenizer
    a, b = tok(PROMPTS[0]).input_ids, tok(PROMPTS[1]).input_ids
    kv = StaticKV(model, 2, 64, pool=3)
    kv.forward([a, b], 1)
    kv.select([1])
    kv.add(1)
    kv.forward([a], 1, only=[1])
    got = kv.forward([[5], [6]], 1)
    one = StaticKV(model, 1, 64)
    one.forward([b], 1)
    assert torch.allclose(got[0], one.forward([[5]], 1)[0], atol=1e-5)


def test_requests_need_their_models(target):
    engine = SpecEngine(target)
    with pytest.raises(UsageError, match="needs a draft model"):
        engine.request("abc", method="draft")
    with pytest.raises(UsageError, match="empty prompt"):
        engine.request([], method="none")


def test_load_model_takes_a_loaded_transformers_model_and_tokenizer(tok):
    from speclm import load_model
    from tiny import tiny_model

    model = tiny_model(len(tok), seed=0)
    model.generation_config.eos_token_id = tok.eos_token_id
    ref = SpecEngine(loaded(copy.deepcopy(model), tok)).generate("abc", max_new_tokens=12)
    got = load_model(model, tokenizer=tok)
    assert got.model is model and got.tokenizer is tok and got.quantize == "none"
    assert tok.eos_token_id in got.eos_token_ids
    assert SpecEngine(got).generate("abc", max_new_tokens=12).token_ids == ref.token_ids
    int8 = load_model(copy.deepcopy(model), tokenizer=tok, quantize="int8")
    assert int8.quantize == "int8"
    with pytest.raises(UsageError, match="needs its tokenizer"):
        load_model(model)
    with pytest.raises(UsageError, match="not 42|not int"):
        load_model(42)
    with pytest.raises(UsageError, match="goes with a loaded model"):
        load_model("qwen2.5-coder-0.5b", tokenizer=tok)


def test_a_cancelled_request_leaves_and_the_others_go_on(int8_pair):
    t8, d8 = int8_pair
    engine = SpecEngine(t8, draft=d8)
    alone = [engine.generate(p, method="draft", max_new_tokens=N) for p in PROMPTS[:3]]
    batch = engine.batch(rows=3)
    requests = [batch.join(engine.request(p, method="draft", max_new_tokens=N)) for p in PROMPTS[:3]]
    batch.step()
    batch.step()
    batch.cancel(requests[1])
    assert requests[1].finish_reason == "cancelled" and batch.kv.batch_size == 2
    assert len(batch.kv._free) == batch.kv.pool_size - 2  # its cache row is free
    waiting = batch.join(engine.request(PROMPTS[3], method="draft", max_new_tokens=N))
    batch.cancel(waiting)  # before its prefill: it never takes a row
    while batch.active:
        batch.step()
    assert [requests[0].generated, requests[2].generated] == [alone[0].token_ids, alone[2].token_ids]
    assert waiting.generated == [] and engine.completion(waiting).finish_reason == "cancelled"
    with pytest.raises(UsageError, match="joins one batch once"):
        batch.join(requests[0])
