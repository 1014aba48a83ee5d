"""Requests that join a running decode between rounds and leave when done (speclm.round.batch): each
request's output is its output alone, greedy or sampled (seeded: plain decoding's with its seed;
unseeded: with its generator seeded alike), whatever shares its batch."""

import copy

import pytest
import torch

from speclm import SpecEngine
from speclm.errors import UsageError
from speclm.forward.cache import StaticKV
from speclm.quant.weights import quantize_model
from tiny import loaded, random_heads

N = 24
PROMPTS = ["hello world, hello", "abc", "the quick brown fox jumps over the lazy dog, the quick", "zzz top",
           "def f(x): return x + 1\ndef g(x): return"]


@pytest.fixture(scope="module")
def int8_pair(target, unrelated_draft):
    """int8 weights: a row's bits do not depend on the other rows of a forward (speclm.quant.weights)."""
    t8 = loaded(quantize_model(copy.deepcopy(target.model), "int8"), target.tokenizer, name="tiny-target-int8")
    d8 = loaded(quantize_model(copy.deepcopy(unrelated_draft.model), "int8"), unrelated_draft.tokenizer, name="d8")
    return t8, d8


def run_joined(engine, requests, join_at, rows=2, **batch_options):
    """Each request joins the batch before step join_at[i]; returns their completions."""
    batch = engine.batch(rows=rows, **batch_options)
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


def _generator_seeds(monkeypatch, first: int) -> None:
    """Requests that set no seed get first, first + 1, ... for their generators (the engine's
    random seed fixed), so that rejection sampling, which they are verified by, can be compared."""
    seeds = iter(range(first, first + 100))
    monkeypatch.setattr("speclm.engine.secrets.randbits", lambda bits: next(seeds))


@pytest.mark.parametrize("seeded", [True, False])
def test_sampled_requests_keep_their_draws_in_a_batch_of_others(int8_pair, monkeypatch, seeded):
    """Same options, other seeds and prompts around them: a sampled request samples what it samples
    alone, joining first or last. Seeded: by position (its plain decoding's text, whatever the
    draft); unseeded: by rejection sampling, from its own generator over its own draft vocabulary."""
    t8, d8 = int8_pair
    engine = SpecEngine(t8, draft=t8)  # a draft equal to the target: long accepted runs
    options = dict(method="draft", draft_vocab=64, max_new_tokens=N, temperature=1.0)
    seed = (lambda i: {"seed": 100 + i}) if seeded else (lambda i: {})
    if not seeded:
        _generator_seeds(monkeypatch, 100)
    alone = [engine.generate(p, **seed(i), **options).token_ids for i, p in enumerate(PROMPTS)]
    if not seeded:
        _generator_seeds(monkeypatch, 100)
    requests = [engine.request(p, **seed(i), **options) for i, p in enumerate(PROMPTS)]
    assert [r.seeded for r in requests] == [seeded] * len(PROMPTS)
    got = run_joined(engine, requests, [3, 0, 1, 1, 0], rows=5)
    assert [c.token_ids for c in got] == alone


def test_a_shared_draft_vocabulary_would_couple_requests(int8_pair, monkeypatch):
    """The test above has power: rows drafting over the union of the batch's vocabularies (a row
    then proposes from other prompts' tokens) sample otherwise than alone (unseeded rows: a seeded
    row's text does not depend on its draft at all)."""
    from speclm.proposers.draft_vocab import RowVocabs

    t8, _ = int8_pair
    engine = SpecEngine(t8, draft=t8)
    options = dict(method="draft", draft_vocab=64, max_new_tokens=N, temperature=1.0)
    _generator_seeds(monkeypatch, 100)
    alone = [engine.generate(p, **options).token_ids for i, p in enumerate(PROMPTS)]
    monkeypatch.setattr(RowVocabs, "logits", lambda self, b, logits: logits)
    monkeypatch.setattr(RowVocabs, "token_ids", lambda self, b: self.head.ids if self.head is not None else None)
    _generator_seeds(monkeypatch, 100)
    requests = [engine.request(p, **options) for i, p in enumerate(PROMPTS)]
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
    import speclm.forward.runner as kv_mod

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
    ref = SpecEngine(loaded(copy.deepcopy(model), tok)).generate("abc", method="none", max_new_tokens=12)
    got = load_model(model, tokenizer=tok)
    assert got.model is model and got.tokenizer is tok and got.quantize == "none"
    assert tok.eos_token_id in got.eos_token_ids
    assert SpecEngine(got).generate("abc", method="none", max_new_tokens=12).token_ids == ref.token_ids
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


LONG = "a long prompt that takes several chunks to read: " + "lorem ipsum dolor sit amet " * 3


@pytest.mark.parametrize("join_at", [[0, 0, 0, 0, 0], [0, 1, 3, 4, 9]])
def test_chunked_prefill_gives_the_same_output_and_keeps_others_decoding(int8_pair, join_at):
    """Prompts read 5 tokens per step, steps alternating with rounds: every request's output is
    its output alone (on int8 weights a token's keys and values do not depend on the split)."""
    t8, d8 = int8_pair
    engine = SpecEngine(t8, draft=d8)
    prompts = PROMPTS[:4] + [LONG]
    alone = [engine.generate(p, **o) for p, o in zip(prompts, MIXED)]
    together = run_joined(engine, [engine.request(p, **o) for p, o in zip(prompts, MIXED)], join_at,
                          prefill_chunk=5)
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    assert [c.finish_reason for c in together] == [c.finish_reason for c in alone]


def test_a_long_prompt_is_read_in_chunks_between_rounds(int8_pair):
    t8, _ = int8_pair
    engine = SpecEngine(t8, prefix_cache=0)
    batch = engine.batch(rows=2, prefill_chunk=8)
    short = batch.join(engine.request("abc", method="none", max_new_tokens=40))  # one token a round
    batch.step()  # its prefill: it decodes from now on
    long = batch.join(engine.request(LONG, method="none", max_new_tokens=4))
    steps, made = [], []
    while not long.generated:
        before = len(short.generated)
        batch.step()
        steps.append(batch.last_step)
        made.append(len(short.generated) - before)
    chunks = -(-long.prompt_len // 8)
    assert steps.count("prefill") == chunks and long.stats.target_forwards == chunks
    assert steps == ["round", "prefill"] * chunks  # the running request is never starved
    assert sum(made) == chunks  # one token per round in between
    while batch.active:
        batch.step()
    assert long.generated == engine.generate(LONG, method="none", max_new_tokens=4).token_ids


def test_prompts_are_read_whole_where_chunks_would_change_the_bits(target):
    """fp32 matmuls round by shape: there a prompt is read in one forward, whatever prefill_chunk says."""
    engine = SpecEngine(target, prefix_cache=0)
    batch = engine.batch(prefill_chunk=4)
    r = batch.join(engine.request(LONG, max_new_tokens=3))
    batch.step()
    assert batch.last_step == "prefill" and len(r.generated) == 1 and r.stats.target_forwards == 1


@pytest.mark.parametrize("method", ["pld", "draft", "draft+pld"])
def test_adaptive_speculation_keeps_greedy_output(int8_pair, method):
    t8, d8 = int8_pair
    plain = SpecEngine(t8).generate(PROMPTS, method="none", max_new_tokens=N)
    engine = SpecEngine(t8, draft=d8)
    got = run_joined(engine, [engine.request(p, method=method, max_new_tokens=N) for p in PROMPTS], [0, 0, 1, 3, 3],
                     rows=4, speculation=engine.adaptive())
    assert [c.token_ids for c in got] == [c.token_ids for c in plain]


def test_adaptive_speculation_leaves_seeded_sampling_as_it_is_alone(int8_pair):
    t8, d8 = int8_pair
    engine = SpecEngine(t8, draft=d8)
    options = [dict(MIXED[i], max_new_tokens=N) for i in (1, 2, 3)] + [dict(method="draft", max_new_tokens=N)]
    alone = [engine.generate(p, **o).token_ids for p, o in zip(PROMPTS, options)]
    got = run_joined(engine, [engine.request(p, **o) for p, o in zip(PROMPTS, options)], [0, 1, 1, 2], rows=4,
                     speculation=engine.adaptive())
    assert [c.token_ids for c in got] == alone


class _Group:
    def __init__(self, options, requests, k=6, max_nodes=12):
        self.options, self.requests = options, requests
        from speclm.methods import DRAFT_MODEL
        from speclm.proposers import Proposer

        # a chain proposer of the method, declaring what its real one does (a draft model reads the context)
        declared = {"reads_context": options.spec.needs == DRAFT_MODEL, "runs_model": options.spec.runs_model}
        self.proposer = type("P", (Proposer,), {"k": k, "max_nodes": max_nodes, **declared})()


def _policy_batch(n_rows, options):
    from speclm.requests import Request

    requests = [Request.of(i, [1, 2, 3], options, i, None) for i in range(n_rows)]
    group = _Group(options.proposer_key(), requests)
    return type("B", (), {"requests": requests, "groups": {group.options: group}})(), requests


def test_adaptive_policy_drafts_long_alone_and_stops_when_verification_is_not_free():
    from speclm.round.adaptive import DRAFT_ROW_PREMIUM, Adaptive
    from speclm.forward.costs import ForwardCosts
    from speclm.options import GenerationOptions

    options = GenerationOptions(method="pld")
    key = options.proposer_key()
    # one forward: 0.1 s to read the weights, 0.01 s per token (a CPU's int8 GEMMs)
    policy = Adaptive(ForwardCosts({1: 0.11, 48: 0.58}))
    one, rows = _policy_batch(1, options)
    for _ in range(20):
        policy.observe(rows[0], 6, 5, 0.0, 0)  # accepts 5 of 6: a row that repeats itself
    assert policy.caps(one)[key] == 6
    eight, rows8 = _policy_batch(8, options)
    for r in rows8:
        for _ in range(20):
            policy.observe(r, 6, 0, 0.0, 0)  # rejects everything
    assert policy.caps(eight)[key] == 0
    for r in rows8:
        for _ in range(40):
            policy.observe(r, 6, 6, 0.0, 0)  # accepts everything: worth it again
    assert policy.caps(eight)[key] > 0
    fixed, _ = _policy_batch(8, GenerationOptions(method="pld", k=3))
    assert policy.caps(fixed) == {}  # a request's own k is kept


def test_adaptive_policy_prices_a_draft_forward_by_its_rows():
    """A draft step measured for 8 rows (dear) does not price the drafting of a lone request after
    the burst: that is scaled to 1 row as the forward's cost scales, and drafting comes back."""
    from speclm.round.adaptive import Adaptive
    from speclm.forward.costs import ForwardCosts
    from speclm.options import GenerationOptions

    options = GenerationOptions(method="draft")
    key = options.proposer_key()
    costs = ForwardCosts({1: 0.1, 8: 0.3, 16: 0.6, 48: 1.6})
    policy = Adaptive(costs)
    eight, rows8 = _policy_batch(8, options)
    for r in rows8:
        for _ in range(20):
            policy.observe(r, 6, 5, 6 * 0.06, 6, rows=8)  # 0.06 s a draft forward for 8 rows
    assert policy.caps(eight)[key] == 0
    one, rows1 = _policy_batch(1, options)  # a new request: the prior acceptance
    assert policy._step_seconds(key, 1) == pytest.approx(0.06 * costs(1) / costs(8))
    assert policy.caps(one)[key] > 0  # priced at 0.06 s a step it would stay off
    policy.observe(rows1[0], 6, 4, 6 * 0.01, 6, rows=1)  # measured for one row: that is used
    assert policy._step_seconds(key, 1) == pytest.approx(0.01)


def test_adaptive_policy_prices_what_a_draft_has_not_read():
    """Turning a draft model on for rows it has not read costs their reading, shared over the
    rounds each row has left: worth it for a request with many tokens to go, not for one about to
    end; nothing once read."""
    from speclm.round.adaptive import Adaptive
    from speclm.forward.costs import ForwardCosts
    from speclm.options import GenerationOptions
    from speclm.requests import Request

    options = GenerationOptions(method="draft", max_new_tokens=200)
    key = options.proposer_key()
    policy = Adaptive(ForwardCosts({1: 0.1, 8: 0.11, 64: 0.3, 512: 3.0}))
    request = Request.of(0, list(range(400)), options, 0, None)
    group = _Group(key, [request])
    batch = type("B", (), {"requests": [request], "groups": {key: group}})()
    policy.observe(request, 6, 5, 6 * 0.02, 6, rows=1)  # 0.02 s a draft step: a fifth of the target's
    group.proposer.unread = lambda contexts: [0]  # read: drafting pays
    assert policy.caps(batch)[key] > 0
    group.proposer.unread = lambda contexts: [len(c) for c in contexts]  # the prompt unread, 200 tokens to go: pays
    assert policy._catch_up(key, group, 6, False) > 0
    assert policy.caps(batch)[key] > 0
    request.context += list(range(197))  # 3 tokens to go: reading 597 tokens for them does not pay
    assert request.tokens_left == 3 and policy.caps(batch)[key] == 0


def test_adaptive_policy_prices_a_draft_forward_by_its_forwards_not_by_lookup_rounds():
    """draft+pld rounds drafted by lookup alone ran no draft forward: their time is not a draft
    step's (kept as one, a lookup's milliseconds priced the model's forwards and its reading near
    zero). Those kept before the model first ran are dropped then; a model-free method keeps its
    proposals' time."""
    from speclm.round.adaptive import Adaptive
    from speclm.forward.costs import ForwardCosts
    from speclm.options import GenerationOptions

    options = GenerationOptions(method="draft+pld")
    key = options.proposer_key()
    policy = Adaptive(ForwardCosts({1: 0.1, 8: 0.13}))
    _, rows = _policy_batch(1, options)
    for _ in range(5):
        policy.observe(rows[0], 4, 4, 0.001, 0, rows=1)  # lookup alone, before the model ever ran
    policy.observe(rows[0], 6, 3, 6 * 0.02, 6, rows=1)  # the model: 0.02 s a forward
    assert policy._step_seconds(key, 1) == pytest.approx(0.02)
    for _ in range(20):
        policy.observe(rows[0], 4, 4, 0.001, 0, rows=1)  # lookup alone again
    assert policy._step_seconds(key, 1) == pytest.approx(0.02)
    pld = GenerationOptions(method="pld")
    _, lookup_rows = _policy_batch(1, pld)
    policy.observe(lookup_rows[0], 4, 4, 0.001, 0, rows=1)
    assert policy._step_seconds(pld.proposer_key(), 1) == pytest.approx(0.001)


def test_adaptive_policy_prices_a_draft_model_by_its_cost_line_before_it_runs():
    """A burst of new requests: a draft model that has not run yet is priced by its measured cost
    line (its forward for 8 rows, and its reading of the 8 prompts it has not seen), and stays
    off where the target's verification is dear; without that line it looked free."""
    from speclm.round.adaptive import Adaptive
    from speclm.forward.costs import ForwardCosts
    from speclm.options import GenerationOptions
    from speclm.requests import Request

    costs = ForwardCosts({1: 0.1, 8: 0.13, 16: 0.2, 64: 0.6, 512: 4.0})
    draft_costs = ForwardCosts({1: 0.02, 8: 0.026, 16: 0.04, 64: 0.12, 512: 0.8})
    options = GenerationOptions(method="draft", max_new_tokens=200)
    key = options.proposer_key()
    requests = [Request.of(i, list(range(300)), options, i, None) for i in range(8)]
    group = _Group(key, requests)
    group.proposer.unread = lambda contexts: [len(c) for c in contexts]  # nothing read yet
    batch = type("B", (), {"requests": requests, "groups": {key: group}})()
    def policy(**kw):  # rounds of either kind ran at their table's price: the cost line alone decides
        out = Adaptive(costs, probe=1000, **kw)
        for drafting in (False, True):
            out._ratios[drafting].record(8, 1.0)
        return out

    priced = policy(draft_costs=draft_costs)
    assert priced._step_seconds(key, 8) == pytest.approx(draft_costs(8))
    rounds = 200 / priced._expected(requests[0], 1, False)
    assert priced._catch_up(key, group, 1, False) == pytest.approx(8 * draft_costs(300) / rounds)
    assert priced.caps(batch)[key] == 0
    assert policy().caps(batch)[key] > 0  # a draft never measured: free
    # draft+pld rows the model never drafts (prompts too long for it): lookup's time prices them
    lookup = GenerationOptions(method="draft+pld", max_new_tokens=200)
    lookup_group = _Group(lookup.proposer_key(), [Request.of(0, list(range(300)), lookup, 0, None)])
    lookup_group.proposer.unread = lambda contexts: [0] * len(contexts)  # lookup's alone: never read
    priced.observe(lookup_group.requests[0], 4, 4, 0.001, 0, rows=1)
    assert priced._step_seconds(lookup.proposer_key(), 1, Adaptive._unread(lookup_group)) == pytest.approx(0.001)


def test_adaptive_policy_prices_rounds_as_they_measure():
    """The cost table is one row's: where a batch's drafting rounds take longer than priced and its
    plain rounds less, the measured ratios turn drafting off; a probe round is not timed; sizes not
    yet measured take the nearest measured size's ratio, plain ones 1 before any; a drafting
    round where only plain ones ran, their ratio times the premium a drafting round pays per row
    (measured where both ran, else DRAFT_ROW_PREMIUM)."""
    from speclm.round.adaptive import DRAFT_ROW_PREMIUM, Adaptive
    from speclm.forward.costs import ForwardCosts
    from speclm.options import GenerationOptions

    options = GenerationOptions(method="pld")
    key = options.proposer_key()
    policy = Adaptive(ForwardCosts({1: 0.05, 4: 0.05, 8: 0.065, 16: 0.1, 32: 0.2}), probe=1000)
    four, rows4 = _policy_batch(4, options)
    for r in rows4:
        for _ in range(20):
            policy.observe(r, 1, 1, 0.0, 0, rows=4)  # accepts most of what it drafts
    k = policy.caps(four)[key]
    assert k > 0  # priced by the table and the premium, drafting pays
    assert policy.ratio(4, True) == pytest.approx(1.0 + 3 * DRAFT_ROW_PREMIUM)
    for _ in range(30):  # drafting rounds take twice their price, plain ones 0.9x
        k = policy.caps(four)[key]
        rows, drafting, priced = policy._predicted
        assert (rows, drafting) == (4, k > 0)
        policy.timed(priced * (2.0 if drafting else 0.9))
    assert policy.caps(four)[key] == 0
    assert 1.6 < policy.ratio(4, True) < 2.0  # from its prior, toward what its rounds took until drafting stopped
    assert policy.ratio(4, False) == pytest.approx(0.9, rel=0.05)
    assert policy.ratio(8, True) == policy.ratio(4, True)  # nearest measured size
    assert policy.premium(8) == pytest.approx(policy.ratio(4, True) / policy.ratio(4, False))  # as measured at 4 rows
    fresh = Adaptive(ForwardCosts({1: 0.05, 8: 0.065}))
    fresh._predicted = (2, True, 0.1)
    fresh.timed(0.4)  # a first round at a size, cold (4x its price): a fifth of the way from its prior
    prior = 1.0 + DRAFT_ROW_PREMIUM
    assert fresh.ratio(2, True) == pytest.approx(0.8 * prior + 0.2 * 4.0)
    assert fresh.ratio(5, True) == fresh.ratio(2, True)  # nearest measured size
    assert fresh.ratio(2, False) == 1.0  # no plain round yet: tried at the table's price
    fresh._predicted = (5, False, 0.1)
    fresh.timed(0.12)
    plain = 0.8 * 1.0 + 0.2 * 1.2
    assert fresh.ratio(5, True) == pytest.approx(plain * (1.0 + DRAFT_ROW_PREMIUM * 4))  # plain measured there
    assert fresh._predicted is None
    fresh.timed(10.0)  # no round priced since: nothing kept
    assert fresh.ratio(2, True) == pytest.approx(0.8 * prior + 0.2 * 4.0)
    probing = Adaptive(ForwardCosts({1: 0.05, 8: 0.065}), probe=1)
    eight, rows8 = _policy_batch(8, options)
    for r in rows8:
        for _ in range(20):
            probing.observe(r, 6, 0, 0.0, 0)
    assert probing.caps(eight)[key] == 1 and probing._predicted is None  # a probe, not the round priced


def test_a_draft_reading_tokens_it_missed_counts_them_as_its_prefill(int8_pair):
    """After rounds without drafting (adaptive speculation), the draft reads the tokens it missed:
    that time is its prefill, not its draft step."""
    from speclm.proposers.base import Verified
    from speclm.proposers.draft_lookup import DraftLookupProposer
    from speclm.proposers.draft_model import DraftModelProposer
    from speclm.sampling import SamplingParams

    t8, d8 = int8_pair
    ids = t8.tokenizer("hello world, hello world, hello").input_ids
    proposer = DraftModelProposer(d8.model, k=2)
    proposer.start(1, 256)
    greedy = SamplingParams()
    proposer.propose([ids], [2], greedy, [None])
    read = proposer.prefill_seconds
    assert read > 0
    proposer.accept(Verified([len(ids)], [[]], None))  # nothing accepted: the target's token next
    proposer.propose([ids + [11]], [2], greedy, [None])
    assert proposer.prefill_seconds == read  # one new token: a draft step
    proposer.accept(Verified([len(ids) + 1], [[]], None))
    assert proposer.unread([ids + [11, 12, 13, 14, 15, 16]]) == [5]
    proposer.propose([ids + [11, 12, 13, 14, 15, 16]], [2], greedy, [None])  # five committed while it sat out
    assert proposer.prefill_seconds > read
    lookup = DraftLookupProposer(d8.model, k=2, prompt_ratio=1.0)  # the model drafts prompts up to 1x the budget
    lookup.start(2, 256, prompt_lengths=[len(ids), len(ids)], max_new_tokens=[len(ids), 2])
    assert lookup.unread([ids, ids]) == [len(ids), 0]  # the second row is lookup's alone: never read


def test_a_draft_counts_the_rows_its_forwards_ran_over(int8_pair):
    """draft+pld drafts a row that repeats itself by lookup and the other by the model: the model's
    forwards ran over one row, which is what the adaptive policy's step time is kept for."""
    from speclm.proposers.draft_lookup import DraftLookupProposer
    from speclm.sampling import SamplingParams

    t8, d8 = int8_pair
    repeats = t8.tokenizer("hello world, hello world, hello").input_ids
    other = t8.tokenizer("The quick brown fox jumps").input_ids
    proposer = DraftLookupProposer(d8.model, k=2)
    proposer.start(2, 256)
    draft = proposer.propose([repeats, other], [2, 2], SamplingParams(), [None, None]).trimmed()
    assert proposer.lookups == 1 and draft.forwards > 0 and draft.forward_rows == 1
    both = DraftLookupProposer(d8.model, k=2)
    both.start(2, 256)
    assert both.propose([other, other], [2, 2], SamplingParams(), [None, None]).forward_rows == 0  # all rows


def test_caches_that_grew_during_a_forward_still_take_prefixes(int8_pair):
    """A longer request joins a group whose draft cache was sized for shorter ones, so the draft's
    cache grows inside its forward; a later request still copies a cached prefix into it."""
    t8, d8 = int8_pair
    engine = SpecEngine(t8, draft=d8)
    head = "shared head of every prompt: "
    prompts = [head + "a", head + "b " * 60, head + "c"]
    alone = [engine.generate(p, method="draft", max_new_tokens=N).token_ids for p in prompts]
    engine = SpecEngine(t8, draft=d8)
    got = run_joined(engine, [engine.request(p, method="draft", max_new_tokens=N) for p in prompts], [0, 1, 6],
                     rows=3)
    assert [c.token_ids for c in got] == alone
    assert got[2].stats.cached_tokens > 0


def test_adaptive_policy_probes_prompt_lookup_but_not_a_draft_model():
    from speclm.round.adaptive import Adaptive
    from speclm.forward.costs import ForwardCosts
    from speclm.options import GenerationOptions

    policy = Adaptive(ForwardCosts({1: 0.11, 48: 0.58}), probe=4)
    for method, model in (("pld", None), ("draft", object())):
        options = GenerationOptions(method=method)
        batch, rows = _policy_batch(8, options)
        batch.groups[options.proposer_key()].proposer.kv = model  # a draft model's cache, or none
        for r in rows:
            for _ in range(20):
                policy.observe(r, 6, 0, 0.0, 0)
        caps = [policy.caps(batch)[options.proposer_key()] for _ in range(8)]
        assert caps == ([0, 0, 0, 1] * 2 if model is None else [0] * 8), (method, caps)


def test_with_nothing_else_decoding_a_prompt_is_read_whole(int8_pair):
    t8, _ = int8_pair
    engine = SpecEngine(t8, prefix_cache=0)
    batch = engine.batch(prefill_chunk=8)
    r = batch.join(engine.request(LONG, max_new_tokens=3))
    batch.step()
    assert batch.last_step == "prefill" and len(r.generated) == 1 and r.stats.target_forwards == 1


def test_a_group_waits_for_its_prompts_being_read_and_leaves_with_them(int8_pair):
    """A proposer is made once for a request whose prompt is read in chunks, even when others leave
    meanwhile; a request cancelled while it is read takes its group with it."""
    t8, d8 = int8_pair
    engine = SpecEngine(t8, draft=d8, prefix_cache=0)
    made = []
    make = engine.make_proposer
    engine.make_proposer = lambda options: made.append(options.method) or make(options)
    batch = engine.batch(rows=3, prefill_chunk=4)
    batch.join(engine.request("abc", method="pld", max_new_tokens=2))
    batch.step()
    b = batch.join(engine.request(LONG, method="draft", max_new_tokens=3))
    while not b.generated:  # the pld request finishes while b is read
        batch.step()
    assert made == ["pld", "draft"]
    c = batch.join(engine.request(LONG, method="draft+pld", max_new_tokens=3))
    batch.step()
    batch.step()
    batch.cancel(c)
    assert [key.method for key in batch.groups] == ["draft"]


@pytest.mark.parametrize("method", ["draft", "draft+pld", "pld", "eagle", "medusa"])
def test_a_group_whose_requests_all_left_while_another_is_read_drops_their_rows(int8_pair, method, tmp_path):
    """The group is kept for the requests still being read, and its proposer must drop the finished
    requests' rows too (a draft cache held one row per request that ever decoded there, and two
    late requests then met four rows): the requests read afterwards decode as they do alone."""
    t8, d8 = int8_pair
    engine = SpecEngine(t8, draft=d8, prefix_cache=0)
    options = dict(method=method)
    if method in ("eagle", "medusa"):
        options["heads"] = random_heads(method, t8.model, tmp_path / "heads.safetensors")
    batch = engine.batch(rows=4, prefill_chunk=4)
    first = [batch.join(engine.request(p, max_new_tokens=2, **options)) for p in ("abc", "zzz top")]
    batch.step()  # both prompts read: they decode from now on
    late = [batch.join(engine.request(LONG + tail, max_new_tokens=N, **options)) for tail in ("", " ipsum")]
    while not all(r.generated for r in late):  # the first two finish while the long prompts are read
        batch.step()
    assert all(r.done for r in first)
    (group,) = batch.groups.values()
    if method.startswith("draft"):
        assert len(group.proposer.kv.lengths) == len(group.requests) == 2
    while batch.active:
        batch.step()
    for r, tail in zip(late, ("", " ipsum")):
        assert r.generated == engine.generate(LONG + tail, max_new_tokens=N, **options).token_ids


class _SitOut:
    """A speculation policy that gives every group a cap of 0 (plain decoding) on every other round."""

    def __init__(self):
        self.rounds = 0

    def caps(self, batch) -> dict:
        self.rounds += 1
        return {key: 0 for key in batch.groups} if self.rounds % 2 else {}

    def observe(self, *args, **kwargs) -> None:
        pass

    def timed(self, seconds: float) -> None:
        pass


@pytest.mark.parametrize("method", ["eagle+pld", "lookahead+pld"])
def test_rounds_a_proposer_sits_out_count_nothing(int8_pair, method, tmp_path):
    """A lookup-first group capped at 0 in its first round (a new request, as a server's policy may
    do) and in later ones, with requests joining: no stale per-row counts, output as plain."""
    t8, d8 = int8_pair
    options = {"method": method, "max_new_tokens": N}
    if method == "eagle+pld":
        options["heads"] = random_heads("eagle", t8.model, tmp_path / "heads.safetensors")
    plain = SpecEngine(t8).generate(PROMPTS, method="none", max_new_tokens=N)
    engine = SpecEngine(t8, draft=d8)
    requests = [engine.request(p, **options) for p in PROMPTS]
    got = run_joined(engine, requests, [0, 0, 1, 3, 3], rows=4, speculation=_SitOut())
    assert [c.token_ids for c in got] == [c.token_ids for c in plain]
    for r in requests:  # lookup rounds only among the rounds it drafted in, every other one
        assert r.stats.lookup_rounds <= r.stats.target_forwards // 2 + 1, (r.stats.lookup_rounds, r.stats.target_forwards)
    assert sum(r.stats.lookup_rounds for r in requests) > 0


def test_adaptive_policy_measures_a_tree_before_turning_it_off():
    """A tree (eagle+pld) not measured yet is kept whole until it is: priced before that at its
    most nodes and the prior's tokens, it stayed off, was never measured, and a server's
    eagle+pld ran as plain decoding."""
    from speclm.round.adaptive import Adaptive
    from speclm.forward.costs import ForwardCosts
    from speclm.options import GenerationOptions

    options = GenerationOptions(method="eagle+pld")
    key = options.proposer_key()
    policy = Adaptive(ForwardCosts({1: 0.1, 8: 0.12, 64: 0.6}))  # 64 nodes cost 6 steps
    batch, rows = _policy_batch(1, options)
    group = batch.groups[key]
    group.proposer.shape, group.proposer.max_nodes = "tree", 64
    assert key not in policy.caps(batch)  # not measured: kept whole
    policy.observe(rows[0], 8, 3, 0.004, 1, rows=1)  # measured: 8 nodes, 3 accepted
    assert policy.caps(batch)[key] is None  # 4 tokens for the price of 8 nodes (1.2 steps): kept
    for _ in range(30):
        policy.observe(rows[0], 8, 0, 0.004, 1, rows=1)  # nothing accepted any more
    assert policy.caps(batch)[key] == 0


def test_a_round_feeds_each_row_its_own_draft_without_padding(int8_pair, monkeypatch):
    """A row drafting less than another (here none beside prompt lookup) is fed only its own
    tokens: the target's round forward is ragged, not padded to the widest draft, and output is
    plain decoding's."""
    t8, _ = int8_pair
    fed = []
    forward = StaticKV.forward

    def recording(self, rows, *args, **kwargs):
        if self.model is t8.model and kwargs.get("kept") is not None:  # a round's forward
            fed.append([len(r) for r in rows])
        return forward(self, rows, *args, **kwargs)

    monkeypatch.setattr(StaticKV, "forward", recording)
    repeats = "one two three one two three one two three one two"
    plain = SpecEngine(t8).generate([repeats, PROMPTS[1]], method="none", max_new_tokens=N)
    engine = SpecEngine(t8)
    got = run_joined(engine, [engine.request(repeats, method="pld", max_new_tokens=N),
                              engine.request(PROMPTS[1], method="none", max_new_tokens=N)], [0, 0])
    assert [c.token_ids for c in got] == [c.token_ids for c in plain]
    mixed = [counts for counts in fed if len(counts) == 2 and counts[0] > 1]
    assert mixed and all(counts[1] == 1 for counts in mixed), fed
