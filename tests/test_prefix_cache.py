"""The prefix cache: a prompt read partly from other prompts' keys and values gives the same
bits, so the same tokens, as one read whole (on quantized weights), for plain and speculative
decoding; its bookkeeping (longest prefix, a token left to feed, least recently used first)."""

from __future__ import annotations

import pytest
import torch
from tiny import loaded, require_compiled_kernels, tiny_model

from speclm.engine import SpecEngine
from speclm.errors import UsageError
from speclm.forward.cache import StaticKV
from speclm.forward.prefix_cache import PrefixCache
from speclm.quant.weights import quantize_model

HEAD = "<system>You are a careful assistant who answers briefly.<user>"
PROMPTS = [HEAD + "Name three prime numbers.", HEAD + "Name three colours of the rainbow.",
           HEAD + "Name three prime numbers and their sum.", "Unrelated: the quick brown fox"]
N = 24


@pytest.fixture(scope="module")
def int8_pair(tok):
    require_compiled_kernels()
    target = loaded(quantize_model(tiny_model(len(tok), seed=0), "int8"), tok, name="tiny-target-int8")
    draft = loaded(quantize_model(tiny_model(len(tok), seed=1, layers=1), "int8"), tok, name="tiny-draft-int8")
    return target, draft


def ids(tok, text):
    return tok(text).input_ids


def test_cached_prefix_gives_the_bits_of_a_whole_prefill(int8_pair, tok):
    """Keys and values of a prompt whose head came from another prompt's forward, and its last
    token's logits, equal a whole prefill's bit for bit."""
    target, _ = int8_pair
    a, b = ids(tok, PROMPTS[0]), ids(tok, PROMPTS[1])
    cache = PrefixCache(1000)
    first = StaticKV(target.model, 1, 128)
    first.forward([a], 1)
    cache.add(first, 0, a)
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    whole, part = StaticKV(target.model, 1, 128), StaticKV(target.model, 1, 128)
    ref = whole.forward([b], 1)
    assert cache.reuse(part, 0, b, len(b) - 1) == common > 20
    got = part.forward([b[common:]], 1)
    assert torch.equal(got, ref)
    for layer in range(len(whole.keys)):
        assert torch.equal(part.keys[layer][0, :, : len(b)], whole.keys[layer][0, :, : len(b)])
        assert torch.equal(part.values[layer][0, :, : len(b)], whole.values[layer][0, :, : len(b)])


@pytest.mark.parametrize("method", ["none", "draft", "pld", "draft+pld"])
def test_generation_with_the_cache_equals_generation_without(int8_pair, method):
    """Later prompts hit the shared head (and a repeated prompt all but its last token); the
    tokens are those of an engine without a cache, for every method, one row or a batch."""
    target, draft = int8_pair
    cold = SpecEngine(target, prefix_cache=0).generate(PROMPTS, method="none", max_new_tokens=N, batch_size=1)
    engine = SpecEngine(target, draft=draft)
    for batch_size in (1, 2):
        outs = engine.generate(PROMPTS + PROMPTS[:1], method=method, k=4, max_new_tokens=N, batch_size=batch_size)
        assert [o.token_ids for o in outs] == [c.token_ids for c in cold] + [cold[0].token_ids]
        hits = [o.stats.cached_tokens for o in outs]
        whole = [len(ids(target.tokenizer, p)) - 1 for p in PROMPTS + PROMPTS[:1]]  # all but a token to feed
        if batch_size == 1:  # the first pass: the shared head, nothing, then a repeated prompt
            assert hits[0] == 0 and hits[3] == 0 and hits[4] == whole[4]
            assert all(len(ids(target.tokenizer, HEAD)) <= h < w for h, w in zip(hits[1:3], whole[1:3]))
        else:  # every prompt seen: rows of one batch each start from their own
            assert hits == whole
    # one batch whose rows start from different cached lengths (all, the head, nothing)
    ragged = SpecEngine(target, draft=draft)
    ragged.generate(PROMPTS[0], method=method, k=4, max_new_tokens=2)
    outs = ragged.generate(PROMPTS, method=method, k=4, max_new_tokens=N)
    assert [o.token_ids for o in outs] == [c.token_ids for c in cold]
    assert len({o.stats.cached_tokens for o in outs}) == 3
    assert engine.prefix.draft.entries if method in ("draft", "draft+pld") else not engine.prefix.draft.entries
    assert all(o.stats.cached_tokens == 0 for o in cold)


def test_sampling_with_the_cache_draws_what_it_draws_without(int8_pair):
    target, draft = int8_pair
    kw = dict(method="draft", k=3, max_new_tokens=N, temperature=0.8, seed=5)
    cold = [SpecEngine(target, draft=draft, prefix_cache=0).generate(p, **kw).token_ids for p in PROMPTS]
    engine = SpecEngine(target, draft=draft)
    warm = [engine.generate(p, **kw).token_ids for p in PROMPTS]
    assert warm == cold


def test_fp32_models_do_not_use_it(target, tok):
    """fp32 matmuls round by shape: a cached prefix would not give a whole prefill's bits."""
    engine = SpecEngine(target)
    outs = engine.generate(PROMPTS[:2], method="none", max_new_tokens=4, batch_size=1)
    assert [o.stats.cached_tokens for o in outs] == [0, 0] and not engine.prefix.target.entries


def test_longest_prefix_least_recently_used_and_extension(int8_pair):
    target, _ = int8_pair
    kv = StaticKV(target.model, 1, 64)
    kv.forward([list(range(1, 31))], 1)
    cache = PrefixCache(50)
    cache.add(kv, 0, list(range(1, 11)))  # [1..10]
    cache.add(kv, 0, list(range(1, 21)))  # extends it: replaces it
    assert [len(e.tokens) for e in cache.entries] == [20]
    cache.add(kv, 0, list(range(1, 6)))  # inside an entry: nothing new
    assert cache.tokens == 20
    other = StaticKV(target.model, 1, 64)
    other.forward([list(range(100, 130))], 1)
    cache.add(other, 0, list(range(100, 125)))  # 45 tokens held
    cache.add(other, 0, list(range(100, 101)) + [7] * 9)  # 55 > 50: the least recently used (the first) goes
    assert [e.tokens[0] for e in cache.entries] == [100, 100] and cache.tokens == 35
    cache.add(other, 0, list(range(60)))  # longer than the whole cache: not held
    assert cache.tokens == 35
    fresh = StaticKV(target.model, 1, 64)
    assert cache.reuse(fresh, 0, list(range(100, 140)), limit=12) == 12  # capped: a token left to feed
    assert fresh.lengths_list() == [12]
    assert torch.equal(fresh.keys[0][0, :, :12], other.keys[0][0, :, :12])
    assert cache.entries[-1].tokens[:3] == [100, 101, 102]  # the one used is now the most recent
    assert cache.reuse(StaticKV(target.model, 1, 64), 0, [999, 1, 2], limit=2) == 0
    off = PrefixCache(0)
    off.add(kv, 0, [1, 2, 3])
    assert not off.entries


def test_negative_size_is_a_usage_error(int8_pair):
    with pytest.raises(UsageError, match="prefix-cache"):
        SpecEngine(int8_pair[0], prefix_cache=-1)


def test_a_head_reads_a_cached_prompt_as_if_it_had_read_it(int8_pair, tmp_path, monkeypatch):
    """EAGLE's head reads the target's features of every prompt token. A prompt taken from the
    cache hands the head the cached prefix's states (kept with the entry) and the rest: the same
    states, from the same first token, as a cold read; only entries holding those states are
    reused by such a request."""
    from speclm.proposers.eagle import EagleProposer
    from tiny import random_heads

    target, _ = int8_pair
    heads = random_heads("eagle", target.model, tmp_path / "eagle.safetensors", seed=2)
    seen = []  # (start, layer -> states) per prompt read
    real = EagleProposer.read_prompt
    monkeypatch.setattr(EagleProposer, "read_prompt", lambda self, hidden, starts: (
        seen.extend((s, {k: v.clone() for k, v in h.items()}) for h, s in zip(hidden, starts)),
        real(self, hidden, starts))[1])
    kw = dict(method="eagle", heads=heads, max_new_tokens=N)
    cold = SpecEngine(target, prefix_cache=0).generate(PROMPTS[2], **kw)
    engine = SpecEngine(target)
    engine.generate(PROMPTS[0], method="none", max_new_tokens=2)  # an entry without states: not for a head
    first = engine.generate(PROMPTS[0], **kw)
    assert first.stats.cached_tokens == 0
    warm = engine.generate(PROMPTS[2], **kw)  # extends PROMPTS[0]'s entry (with states)
    assert warm.stats.cached_tokens > len(ids(target.tokenizer, HEAD))
    (start_cold, states_cold), (start_warm, states_warm) = seen[0], seen[2]
    assert start_cold == start_warm == 0
    assert states_cold.keys() == states_warm.keys()
    assert all(torch.equal(states_cold[k], states_warm[k]) for k in states_cold)
    assert warm.token_ids == cold.token_ids


def test_entries_with_states_are_kept_for_the_heads(int8_pair):
    target, _ = int8_pair
    kv = StaticKV(target.model, 1, 64)
    kv.forward([list(range(1, 31))], 1)
    states = {3: torch.arange(20 * 4, dtype=torch.float32).reshape(20, 4)}
    cache = PrefixCache(100)
    cache.add(kv, 0, list(range(1, 21)), {3: states[3]})
    cache.add(kv, 0, list(range(1, 26)))  # extends it, without states: both kept
    assert sorted(len(e.tokens) for e in cache.entries) == [20, 25]
    fresh = StaticKV(target.model, 1, 64)
    assert cache.reuse_states(fresh, 0, list(range(1, 31)), 29) == (25, {})  # no states asked: the longest
    n, got = cache.reuse_states(StaticKV(target.model, 1, 64), 0, list(range(1, 31)), 29, (3,))
    assert n == 20 and torch.equal(got[3], states[3])
    assert cache.reuse_states(StaticKV(target.model, 1, 64), 0, list(range(1, 31)), 29, (5,)) == (0, {})
    cache.add(kv, 0, list(range(1, 26)), {3: torch.zeros(25, 4)})  # now with states: replaces both
    assert [len(e.tokens) for e in cache.entries] == [25] and cache.nbytes > 0
