"""The preallocated KV cache: rollback is a length, ragged rows equal rows alone."""

import torch

from speclm.kv import StaticKV


def test_ragged_rows_equal_rows_alone(target, tok):
    rows = [tok("hello world").input_ids, tok("ab").input_ids, tok("a longer prompt here").input_ids]
    kv = StaticKV(target.model, 3, 64)
    batched = kv.forward(rows, 2)  # (3, 2, V): each row's last 2 tokens
    follow = kv.forward([[5, 6, 7], [8], [9, 10]], 1)
    for b, row in enumerate(rows):
        alone = StaticKV(target.model, 1, 64)
        assert torch.allclose(alone.forward([row], 2), batched[b : b + 1], atol=1e-5)
        nxt = [[5, 6, 7], [8], [9, 10]][b]
        assert torch.allclose(alone.forward([nxt], 1), follow[b : b + 1], atol=1e-5)
    assert kv.lengths_list() == [len(r) + len(n) for r, n in zip(rows, [[5, 6, 7], [8], [9, 10]])]


def test_rollback_moves_a_length_and_copies_nothing(target, tok):
    ids = tok("rollback test").input_ids
    kv = StaticKV(target.model, 1, 64)
    kv.forward([ids], 1)
    buffers = [t.data_ptr() for t in kv.keys + kv.values]
    first = kv.forward([[1, 2, 3, 4]], 4)
    kv.truncate([len(ids)])  # reject all four
    assert kv.lengths_list() == [len(ids)]
    again = kv.forward([[1, 2, 3, 4]], 4)
    assert torch.allclose(first, again, atol=1e-6)
    kv.truncate([len(ids) + 2])  # accept two of the four
    after = kv.forward([[9]], 1)
    fresh = StaticKV(target.model, 1, 64)
    assert torch.allclose(fresh.forward([ids + [1, 2, 9]], 1), after, atol=1e-5)
    assert [t.data_ptr() for t in kv.keys + kv.values] == buffers  # written in place, never reallocated


def test_capacity_grows_when_underestimated(target, tok):
    ids = tok("grow").input_ids
    kv = StaticKV(target.model, 1, len(ids))
    kv.forward([ids], 1)
    out = kv.forward([[1, 2, 3]], 1)
    assert kv.capacity >= len(ids) + 3
    fresh = StaticKV(target.model, 1, 64)
    assert torch.allclose(fresh.forward([ids + [1, 2, 3]], 1), out, atol=1e-5)


def test_select_keeps_rows(target, tok):
    rows = [tok("one").input_ids, tok("two two").input_ids]
    kv = StaticKV(target.model, 2, 32)
    kv.forward(rows, 1)
    kv.select([1])
    out = kv.forward([[3]], 1)
    alone = StaticKV(target.model, 1, 32)
    assert torch.allclose(alone.forward([rows[1] + [3]], 1), out, atol=1e-5)


def test_lean_forward_matches_transformers(target, tok):
    """The lean Llama/Qwen2 forward computes what the transformers forward computes."""
    import speclm.lean as lean

    assert lean.supports(target.model)
    ids = tok("a lean forward, a lean forward").input_ids
    kv = StaticKV(target.model, 1, 64)
    assert kv.lean is not None
    got = torch.cat([kv.forward([ids[:5]], 5), kv.forward([ids[5:9]], 4), kv.forward([ids[9:]], len(ids) - 9)], dim=1)
    with torch.inference_mode():
        ref = target.model(torch.tensor([ids])).logits.float()
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4)


def test_transformers_path_when_lean_unsupported(target, tok, monkeypatch):
    import speclm.kv as kv_mod

    monkeypatch.setattr(kv_mod.lean, "supports", lambda model: False)
    ids = tok("fallback path").input_ids
    kv = StaticKV(target.model, 1, 64)
    assert kv.lean is None and target.model.config._attn_implementation == "speclm"
    got = torch.cat([kv.forward([ids[:4]], 4), kv.forward([ids[4:]], len(ids) - 4)], dim=1)
    with torch.inference_mode():
        ref = target.model(torch.tensor([ids])).logits.float()
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4)


def test_compiled_decode_attention_matches_torch_ops(tok):
    """speclm's compiled decode attention (rotary, cache write, per-query softmax) computes what
    the lean forward's torch ops compute, at head sizes 32 and 128, GQA included; and a token's
    logits do not depend on how many tokens share its forward."""
    from speclm import kernels
    from speclm.quant import quantize_model
    from tiny import require_compiled_kernels, tiny_model

    require_compiled_kernels()
    prompt, feeds = tok("attention check, attention check").input_ids, [[5], [6, 7], [8, 9, 10, 11]]
    for hidden, heads, kv_heads in ((64, 2, 1), (256, 2, 1), (256, 4, 2)):
        model = tiny_model(len(tok), seed=3, hidden=hidden, heads=heads, kv_heads=kv_heads)
        runs = {}
        for compiled in (True, False):
            kv = StaticKV(model, 1, 64)
            assert kv.lean.compiled is not None
            if not compiled:
                kv.lean.compiled = None  # the torch ops instead
            out = [kv.forward([prompt], 1)] + [kv.forward([f], len(f)) for f in feeds]
            runs[compiled] = torch.cat(out, dim=1)
            kv.lean.compiled = kernels.compiled()
        assert torch.allclose(runs[True], runs[False], atol=1e-4, rtol=1e-4), (hidden, heads)
        # on int8 weights (batch-invariant GEMMs) one token at a time gives the very same bits
        quantize_model(model, "int8")
        logits = {}
        for split in (False, True):
            kv = StaticKV(model, 1, 64)
            kv.forward([prompt], 1)
            logits[split] = torch.cat([kv.forward([[t]], 1) for f in feeds for t in f] if split else
                                      [kv.forward([f], len(f)) for f in feeds], dim=1)
        assert torch.equal(logits[True], logits[False])
        # and a ragged batch gives each row the bits it gets alone
        rows = [prompt, prompt[:5], prompt[3:]]
        feeds_b = [[5, 6, 7], [8], [9, 10]]
        kv = StaticKV(model, 3, 64)
        kv.forward(rows, 1)
        batched = kv.forward(feeds_b, 1)  # (3, 1, V): each row's last token
        for b, row in enumerate(rows):
            alone = StaticKV(model, 1, 64)
            alone.forward([row], 1)
            assert torch.equal(alone.forward([feeds_b[b]], 1), batched[b : b + 1]), b


def _alternative_vs_plain(model, prompt, chain, alt_at, alt, *, torch_ops=False, transformers=False, monkeypatch=None):
    """Logits of an alternative token fed after a chain, at the position of chain[alt_at], and of
    the same token fed plainly at that position: (tree's, plain's), each (1, 1, V)."""
    import speclm.kv as kv_mod

    if transformers:
        monkeypatch.setattr(kv_mod.lean, "supports", lambda m: False)
    out = []
    for tree in (True, False):
        kv = StaticKV(model, 1, 64)
        if torch_ops and kv.lean is not None:
            kv.lean.compiled = None
        kv.forward([prompt], 1)
        base = kv.lengths_list()[0]
        if tree:
            positions = [list(range(base, base + len(chain))) + [base + alt_at]]
            out.append(kv.forward([chain + [alt]], 1, positions=positions))
        else:
            out.append(kv.forward([chain[:alt_at] + [alt]], 1))
    return out


def test_alternative_token_gets_the_bits_of_a_plain_step(tok, monkeypatch):
    """A tree's alternative (fed after the chain, at the position of the chain token it replaces)
    attends what a plain step at that position attends, in the same order: on int8 weights its
    logits are bit-identical, on the compiled kernel, the torch ops and the transformers path;
    and after `move` the cache continues as if the alternative had been fed plainly."""
    from speclm.quant import quantize_model
    from tiny import require_compiled_kernels, tiny_model

    require_compiled_kernels()
    prompt = tok("a tree of tokens, a tree").input_ids
    chain = [5, 6, 7, 8]
    for hidden, heads, kv_heads in ((64, 2, 1), (256, 4, 2)):
        model = tiny_model(len(tok), seed=4, hidden=hidden, heads=heads, kv_heads=kv_heads)
        quantize_model(model, "int8")
        for alt_at in (0, 2, 3):
            for mode in ("compiled", "torch_ops"):
                tree, plain = _alternative_vs_plain(model, prompt, chain, alt_at, 9, torch_ops=mode == "torch_ops")
                assert torch.equal(tree, plain), (hidden, alt_at, mode)
        with monkeypatch.context() as m:
            tree, plain = _alternative_vs_plain(model, prompt, chain, 1, 9, transformers=True, monkeypatch=m)
            assert torch.equal(tree, plain), (hidden, "transformers")
        # accepted at position base + 1: move its keys and values there, keep base + 2 slots, go on
        kv = StaticKV(model, 1, 64)
        kv.forward([prompt], 1)
        base = kv.lengths_list()[0]
        kv.forward([chain + [9]], 1, positions=[list(range(base, base + 4)) + [base + 1]])
        kv.move(0, base + 4, base + 1)
        kv.truncate([base + 2])
        after = kv.forward([[10, 11]], 2)
        fresh = StaticKV(model, 1, 64)
        fresh.forward([prompt], 1)
        assert torch.equal(fresh.forward([chain[:1] + [9, 10, 11]], 2), after)


def test_decode_attention_bits_do_not_depend_on_its_query_tiles():
    """The compiled attention takes a kv head's queries in tiles (so a prefill's scores stay in
    cache); each query's arithmetic is its own, so any tiling gives the same bits, for a prefill's
    many queries, a ragged batch and a tree's alternative alike."""
    from speclm import kernels
    from tiny import require_compiled_kernels

    require_compiled_kernels()
    compiled = kernels.compiled()
    torch.manual_seed(0)
    heads, kv_heads, dim, capacity = 4, 2, 32, 96
    freqs = torch.arange(capacity, dtype=torch.float32)[:, None] * (1e-2 ** (torch.arange(dim // 2) / (dim // 2)))
    cos = torch.cat((freqs, freqs), -1).cos()
    sin = torch.cat((-freqs.sin(), freqs.sin()), -1)
    cases = [([0, 5], [40, 33], 40, []),  # prefill-like: 2 x 40 tokens, ragged, 80 queries per kv head
             ([20], [4], 4, [20, 21, 22, 21])]  # a chain of three and an alternative at the second's position
    for starts, counts, width, positions in cases:
        batch = len(starts)
        qkv = torch.randn(batch * width, (heads + 2 * kv_heads) * dim)
        history = torch.randn(batch, kv_heads, capacity, dim)
        outs = []
        for tile in (1, 7, 64, 10**6):
            keys, values = history.clone(), history.clone().neg()
            out = compiled.decode_attention(qkv, cos, sin, keys, values, starts, counts, heads, kv_heads, dim**-0.5,
                                            positions, query_tile=tile)
            outs.append((out, keys, values))
        for out, keys, values in outs[1:]:
            assert torch.equal(out, outs[0][0]) and torch.equal(keys, outs[0][1]) and torch.equal(values, outs[0][2])
        assert outs[0][0].abs().sum() > 0
