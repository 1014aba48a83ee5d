"""A sliding-window layer keeps only its window (+ spare) of keys: a ring per cache row
(speclm.forward.cache), on tests/tiny.py's architectures whose windows are 6 keys.

- the lean forward over rings equals transformers' within 1e-4 on a prompt eight windows long, fed
  as a wide prefill (a flat copy), a wide decode forward and single tokens (the ring wrapping at
  every step), on the compiled kernels and on torch's ops; planted bugs (a wide decode forward
  written straight into its ring, a ring holding less than the
  window before a query) move the logits by more than 1;
- the compiled attention over a ring gives the bits it gives over the same keys laid out flat,
  chains and trees, blocks of slots wrapping past the ring's end;
- every method's greedy and seeded output over rings is token for token plain decoding's
  without them (rounds rolled back, trees moved into place, prefixes reused from the prefix cache);
- a ring grows when a caller announces a wider forward, and the prefix cache reuses a ring's
  keys only for prefixes they reach back for.
"""

from __future__ import annotations

import pytest
import torch

import speclm.forward.cache as cache_mod
from speclm import SpecEngine
from speclm.forward.cache import StaticKV
from speclm.forward.prefix_cache import PrefixCache
from speclm.quant.weights import quantize_model
from test_architectures import _reference
from tiny import WINDOW, loaded, random_heads, require_compiled_kernels, tiny_arch

SLIDING = ("mistral", "qwen2-sliding", "gemma2", "gemma3")
TEXT = "a ring of keys holds a window of a prompt that runs on and on past it"  # 69 byte tokens


def _pieces(kv: StaticKV, ids: list[int]) -> torch.Tensor:
    """Every token's logits: a prefill of 30 (wider than any ring here), a forward of 9, then one at a time."""
    parts = [kv.forward([ids[:30]], 30), kv.forward([ids[30:39]], 9)] + [kv.forward([[t]], 1) for t in ids[39:]]
    return torch.cat(parts, dim=1)


def _ringed(model, spare: int, compiled: bool) -> StaticKV:
    kv = StaticKV(model, 1, 128, spare=spare)
    if not compiled:
        kv.lean.compiled = None
    return kv


@pytest.mark.parametrize("arch", SLIDING)
def test_rings_give_transformers_logits(tok, arch):
    model = tiny_arch(arch, len(tok), seed=1)
    ids = tok(TEXT).input_ids
    assert len(ids) > 8 * WINDOW
    ref = _reference(model, ids)
    for spare in (2, 12):  # a ring of 8 (the 9-token forward goes flat) and of 18 (it fits)
        for compiled in (True, False):
            kv = _ringed(model, spare, compiled)
            sizes = [k.shape[2] for k in kv.keys]
            assert any(kv.windows) and sizes == [WINDOW + spare if w else 128 for w in kv.windows], (arch, sizes)
            got = _pieces(kv, ids)
            assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), (arch, spare, compiled, (got - ref).abs().max().item())


@pytest.mark.parametrize("bug", ["wide decode forward into the ring", "ring holding less than the window"])
def test_each_planted_ring_bug_fails(tok, monkeypatch, bug):
    if bug == "wide decode forward into the ring":  # only a prefill from slot 0 goes flat
        flat = StaticKV.flat
        monkeypatch.setattr(StaticKV, "flat", lambda self, layer, starts, width: flat(self, layer, starts, width)
                            and not any(starts))
    else:
        real = StaticKV.ring
        monkeypatch.setattr(StaticKV, "ring", lambda self, layer: real(self, layer) and self.windows[layer] - 2)
    ids = tok(TEXT).input_ids
    for arch in ("mistral", "gemma3"):
        model = tiny_arch(arch, len(tok), seed=1)
        for compiled in (True, False):
            try:
                error = (_pieces(_ringed(model, 2, compiled), ids) - _reference(model, ids)).abs().max()
            except RuntimeError as e:  # the compiled attention refuses a forward wider than its ring
                assert "cache too short" in str(e) and compiled, (bug, arch, e)
                continue
            assert error > 1.0, (bug, arch, compiled)


def test_compiled_attention_over_a_ring_is_the_flat_layouts_bits():
    from speclm.quant import kernels

    require_compiled_kernels()
    compiled = kernels.compiled()
    torch.manual_seed(0)
    heads, kv_heads, dim, window, ring, capacity = 4, 2, 32, 37, 45, 160
    freqs = torch.arange(capacity, dtype=torch.float32)[:, None] * (1e-2 ** (torch.arange(dim // 2) / (dim // 2)))
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((-freqs.sin(), freqs.sin()), -1)
    # a chain of 8 at slot 130 (its window wraps past the ring's end inside a block of 16), and a
    # tree of 5 at slot 101 (slots 101, 103 children of 100; 102 of 101; 104 of 103; 105 of 102)
    cases = [([130], [8], 8, []),
             ([101], [5], 5, [6, 7, 8, 10, 13, 15, 102, 103, 101, 103, 101, 103, 104, 103, 105])]
    for starts, counts, width, tree in cases:
        qkv = torch.randn(width, (heads + 2 * kv_heads) * dim)
        flat_keys, flat_values = torch.randn(1, kv_heads, capacity, dim), torch.randn(1, kv_heads, capacity, dim)
        ring_keys, ring_values = torch.zeros(1, kv_heads, ring, dim), torch.zeros(1, kv_heads, ring, dim)
        held = torch.arange(starts[0] - window, starts[0])
        ring_keys[:, :, held % ring], ring_values[:, :, held % ring] = flat_keys[:, :, held], flat_values[:, :, held]
        args = (starts, counts, heads, kv_heads, dim**-0.5, tree)
        want = compiled.decode_attention(qkv, cos, sin, flat_keys, flat_values, *args, window=window)
        got = compiled.decode_attention(qkv, cos, sin, ring_keys, ring_values, *args, window=window, ring=True)
        assert torch.equal(got, want)
        written = torch.arange(starts[0], starts[0] + width)
        assert torch.equal(ring_keys[:, :, written % ring], flat_keys[:, :, written])


def _methods(heads):
    return [("pld", {}), ("draft", {}), ("draft", {"tree": "auto"}), ("draft+pld", {}),
            ("eagle+pld", {"heads": heads}), ("lookahead", {"lookahead": (2, 3, 2)}),
            ("self", {"layers": "1", "self_weights": "target"}), ("auto", {"heads": heads})]


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_every_method_over_rings_is_plain_decoding_without_them(tok, tmp_path, monkeypatch, arch):
    require_compiled_kernels()
    prompts = ["ab ab ba aab x ab ab ba aab x", "[1,2,3] [4,5", "a ring, a ring, a ring"]
    target = tiny_arch(arch, len(tok), seed=1)
    quantize_model(target, "int8")
    heads = random_heads("eagle", target, tmp_path / "eagle.safetensors", seed=5, std=0.5)

    def engine():
        return SpecEngine(loaded(target, tok, name=arch), draft=loaded(target, tok, name=f"{arch}-draft"))

    refs = [engine().generate(p, method="none", max_new_tokens=60) for p in prompts]  # capacity < 6 + 256: no ring
    monkeypatch.setattr(cache_mod, "RING_SPARE", 1)  # rings as small as each round's width allows
    ringed = engine()
    seen = []
    real = StaticKV.__init__

    def spy(self, *args, **kwargs):
        real(self, *args, **kwargs)
        seen.append(self)
    monkeypatch.setattr(StaticKV, "__init__", spy)
    outs = [ringed.generate(p, method="none", max_new_tokens=60) for p in prompts]
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
    assert any(kv.ring(i) for kv in seen for i in range(len(kv.keys))), "rings in use"
    accepted = 0.0
    for method, options in _methods(heads):
        for p, ref in zip(prompts, refs):
            out = ringed.generate(p, method=method, max_new_tokens=60, **options)
            assert out.token_ids == ref.token_ids, (arch, method, options, p)
            accepted = max(accepted, out.stats.mean_accepted_tokens)
    assert accepted > 2.0
    assert ringed.prefix.target.entries, "prompts went through the prefix cache"
    seeded = dict(temperature=0.8, seed=3, max_new_tokens=60)
    for method, options in [("none", {})] + _methods(heads)[::2]:
        got = [engine().generate(p, method=method, **seeded, **options).token_ids for p in prompts]
        monkeypatch.setattr(cache_mod, "RING_SPARE", 256)
        want = [engine().generate(p, method="none", **seeded).token_ids for p in prompts]
        monkeypatch.setattr(cache_mod, "RING_SPARE", 1)
        assert got == want, (arch, method)


def test_a_ring_grows_for_a_wider_forward_and_keeps_its_keys(tok):
    model = tiny_arch("mistral", len(tok), seed=1)
    ids = tok(TEXT).input_ids
    kv = StaticKV(model, 1, 128, spare=2)
    kv.forward([ids[:40]], 1)
    kv.reserve(128, width=9)  # a round of 9 tokens may now be rolled back
    assert kv.spare == 9 and {k.shape[2] for k, w in zip(kv.keys, kv.windows) if w} == {WINDOW + 9}
    assert {k.shape[1] for k in kv.export(0, 40)[0]} == {WINDOW + 2}  # what was moved, not the larger ring
    logits = [kv.forward([ids[40:49]], 9)]  # fits the grown ring: written straight into it
    assert not kv.flat(0, [40], 9)
    kv.truncate([43])  # a round rolled back into
    logits.append(kv.forward([ids[43:60]], 17))
    ref = _reference(model, ids[:60])
    assert torch.allclose(logits[0], ref[:, 40:49], atol=1e-4)
    assert torch.allclose(logits[1], ref[:, 43:60], atol=1e-4)


def test_the_prefix_cache_reuses_a_rings_keys_only_as_far_back_as_they_reach(tok):
    require_compiled_kernels()
    model = tiny_arch("gemma3", len(tok), seed=1)
    quantize_model(model, "int8")
    ids = tok(TEXT).input_ids
    cache = PrefixCache()
    kv = StaticKV(model, 1, 128, spare=4)  # sliding layers: rings of 10 slots
    kv.forward([ids[:50]], 1)
    cache.add(kv, 0, ids[:50])
    entry = cache.entries[0]
    assert [k.shape[1] for k in entry.keys] == [WINDOW + 4 if w else 50 for w in kv.windows]
    for n, reused in ((48, 48), (46, 46), (45, 0), (30, 0)):  # a ring of 10 holds slots 40-49: windows from 46 on
        fresh = StaticKV(model, 1, 128, spare=4)
        assert cache.reuse(fresh, 0, ids[:n] + [7, 7], n) == reused, n
        if reused:
            want = StaticKV(model, 1, 128, spare=4)
            want.forward([ids[:n]], 1)
            assert torch.equal(fresh.forward([ids[n:60]], 1), want.forward([ids[n:60]], 1)), n
