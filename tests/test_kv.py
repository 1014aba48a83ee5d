"""The preallocated KV cache: rollback is a length, ragged rows equal rows alone."""

import torch

from speclm.forward.cache import StaticKV


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
    import speclm.forward.lean as lean

    assert lean.supports(target.model)
    ids = tok("a lean forward, a lean forward").input_ids
    kv = StaticKV(target.model, 1, 64)
    assert kv.lean is not None
    got = torch.cat([kv.forward([ids[:5]], 5), kv.forward([ids[5:9]], 4), kv.forward([ids[9:]], len(ids) - 9)], dim=1)
    with torch.inference_mode():
        ref = target.model(torch.tensor([ids])).logits.float()
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4)


def test_transformers_path_when_lean_unsupported(target, tok, monkeypatch):
    import speclm.forward.runner as kv_mod

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
    from speclm.quant import kernels
    from speclm.quant.weights import quantize_model
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


# trees as parents per node (-1: a child of the root, the last committed token), in node order
TREES = [
    [-1, 0, 1, 2],  # a chain
    [-1, 0, 1, 2, 1],  # a chain and an alternative for its third token
    [-1, -1, 0, 1, 1, 3, 2],  # two branches from the root, one forked
    [-1, 0, -1, 2, 0, 4, 3, 6, 5],  # interleaved branches, four deep
]


def _depths(parents):
    out = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def _tree_logits(model, prompt, tokens, parents, *, by_level=False, torch_ops=False):
    """Logits (1, 1 + N, V) of a tree after `prompt` (the root, then node n at 1 + n), fed in one
    forward, or level by level as a draft grows one (then the root's and each level's in turn)."""
    kv = StaticKV(model, 1, 96)
    if torch_ops and kv.lean is not None:
        kv.lean.compiled = None
    kv.forward([prompt[:-1]], 1)
    base = kv.lengths_list()[0]  # the root's slot
    if not by_level:
        slots = [base if p < 0 else base + 1 + p for p in parents]
        return kv.forward([[prompt[-1]] + tokens], 1 + len(tokens), parents=[[-1] + slots])
    out = {0: kv.forward([[prompt[-1]]], 1)[0, 0]}
    where = {}
    depths = _depths(parents)
    for level in range(max(depths) + 1):
        nodes = [n for n, d in enumerate(depths) if d == level]
        start = kv.lengths_list()[0]
        ups = [base if parents[n] < 0 else where[parents[n]] for n in nodes]
        logits = kv.forward([[tokens[n] for n in nodes]], len(nodes), parents=[ups])
        for i, n in enumerate(nodes):
            where[n] = start + i
            out[1 + n] = logits[0, i]
    return torch.stack([out[i] for i in range(1 + len(tokens))])[None]


def _plain_logits(model, prompt, tokens, parents, torch_ops=False):
    """The same (1, 1 + N, V), each node's from a plain forward over its root path."""
    rows = []
    for n in [None] + list(range(len(tokens))):
        path = []
        while n is not None and n >= 0:
            path.insert(0, tokens[n])
            n = parents[n] if parents[n] >= 0 else None
        kv = StaticKV(model, 1, 96)
        if torch_ops and kv.lean is not None:
            kv.lean.compiled = None
        kv.forward([prompt[:-1]], 1)
        rows.append(kv.forward([[prompt[-1]] + path], 1)[0, 0])
    return torch.stack(rows)[None]


def test_tree_nodes_get_the_bits_of_a_plain_step(tok, monkeypatch):
    """A tree's node attends the committed prefix, its ancestors and itself, at the position of its
    depth: on int8 weights its logits are bit-identical to a plain forward over its root path, on
    the compiled kernel, the torch ops and the transformers path; fed in one forward or level by
    level (as a draft grows a tree, ancestors in earlier forwards); and after `move_path` the
    cache continues as if the accepted path had been fed plainly."""
    import speclm.forward.runner as kv_mod
    from speclm.quant.weights import quantize_model
    from tiny import require_compiled_kernels, tiny_model

    require_compiled_kernels()
    prompt = tok("a tree of tokens, a tree").input_ids
    for hidden, heads, kv_heads in ((64, 2, 1), (256, 4, 2)):
        model = tiny_model(len(tok), seed=4, hidden=hidden, heads=heads, kv_heads=kv_heads)
        quantize_model(model, "int8")
        for parents in TREES:
            tokens = [5 + n for n in range(len(parents))]
            for torch_ops in (False, True):
                plain = _plain_logits(model, prompt, tokens, parents, torch_ops)
                for by_level in (False, True):
                    tree = _tree_logits(model, prompt, tokens, parents, by_level=by_level, torch_ops=torch_ops)
                    assert torch.equal(tree, plain), (hidden, parents, torch_ops, by_level)
            with monkeypatch.context() as m:
                m.setattr(kv_mod.lean, "supports", lambda m: False)
                plain = _plain_logits(model, prompt, tokens, parents)
                for by_level in (False, True):
                    tree = _tree_logits(model, prompt, tokens, parents, by_level=by_level)
                    assert torch.equal(tree, plain), (hidden, parents, "transformers", by_level)
        # the deepest path of the last tree is accepted: its keys and values move into place
        parents = TREES[-1]
        tokens = [5 + n for n in range(len(parents))]
        path = [8]
        while parents[path[0]] >= 0:
            path.insert(0, parents[path[0]])
        kv = StaticKV(model, 1, 96)
        kv.forward([prompt[:-1]], 1)
        base = kv.lengths_list()[0]
        kv.forward([[prompt[-1]] + tokens], 1, parents=[[-1] + [base if p < 0 else base + 1 + p for p in parents]])
        kv.move_path(0, [base + 1 + n for n in path], base + 1)
        kv.truncate([base + 1 + len(path)])
        after = kv.forward([[40, 41]], 2)
        fresh = StaticKV(model, 1, 96)
        fresh.forward([prompt[:-1]], 1)
        assert torch.equal(fresh.forward([[prompt[-1]] + [tokens[n] for n in path] + [40, 41]], 2), after)


def test_decode_attention_bits_do_not_depend_on_its_query_tiles():
    """The compiled attention takes a kv head's queries in tiles (so a prefill's scores stay in
    cache); each query's arithmetic is its own, so any tiling gives the same bits, for a prefill's
    many queries, a ragged batch and a tree alike."""
    from speclm.quant import kernels
    from tiny import require_compiled_kernels

    require_compiled_kernels()
    compiled = kernels.compiled()
    torch.manual_seed(0)
    heads, kv_heads, dim, capacity = 4, 2, 32, 96
    freqs = torch.arange(capacity, dtype=torch.float32)[:, None] * (1e-2 ** (torch.arange(dim // 2) / (dim // 2)))
    cos = torch.cat((freqs, freqs), -1).cos()
    sin = torch.cat((-freqs.sin(), freqs.sin()), -1)
    cases = [([0, 5], [40, 33], 40, []),  # prefill-like: 2 x 40 tokens, ragged, 80 queries per kv head
             # a chain of three and an alternative at the second's position (common.h's tree vector)
             ([20], [4], 4, [5, 6, 7, 8, 10, 21, 22, 23, 21, 23]),
             # slots 20-24: 20 and 22 children of 19, 21 of 20, 23 of 22, 24 of 21
             ([20], [5], 5, [6, 7, 8, 10, 13, 15, 21, 22, 20, 22, 20, 22, 23, 22, 24])]
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


def test_forward_returns_hidden_states_only_when_asked(tok, monkeypatch):
    """hidden_layers: the forward leaves the asked layers' hidden states of the kept tokens in
    `kv.hidden` ((B, K, E); -1 after the final norm, what the output head reads), on the lean
    forward and on transformers'; nothing is kept when none are asked."""
    import speclm.forward.runner as kv_mod
    from tiny import tiny_model

    model = tiny_model(len(tok), seed=4)
    prompt = tok("hidden states of a tree").input_ids
    kv = StaticKV(model, 1, 64)
    kv.forward([prompt], 1)
    assert kv.hidden is None
    logits = kv.forward([[5, 6, 7]], 2, hidden_layers=(0, 1, -1))
    assert set(kv.hidden) == {0, 1, -1} and kv.hidden[-1].shape == (1, 2, model.config.hidden_size)
    with torch.no_grad():
        assert torch.allclose(model.lm_head(kv.hidden[-1]), logits, atol=1e-5)
        assert torch.allclose(model.model.norm(kv.hidden[1]), kv.hidden[-1], atol=1e-6)
    lean = {k: v.clone() for k, v in kv.hidden.items()}
    with monkeypatch.context() as m:
        m.setattr(kv_mod.lean, "supports", lambda m: False)
        kv = StaticKV(model, 1, 64)
        kv.forward([prompt], 1)
        kv.forward([[5, 6, 7]], 2, hidden_layers=(0, -1))
        for layer in (0, -1):
            assert torch.allclose(kv.hidden[layer], lean[layer], atol=1e-5), layer


def test_a_ragged_feed_runs_its_real_tokens_alone(tok):
    """Rows of different lengths: the projections and MLP run on the real tokens packed (not on
    the padded B x M layout), each row's logits and hidden states are the bits it gets alone, and
    `kept` rows shorter than logits_to_keep get zeros past their own columns, never computed."""
    from speclm.quant.weights import quantize_model
    from tiny import require_compiled_kernels, tiny_model

    require_compiled_kernels()
    model = tiny_model(len(tok), seed=5)
    quantize_model(model, "int8")
    prompts = [tok("a ragged feed").input_ids, tok("rows of their own").input_ids[:4], tok("x").input_ids]
    feeds, kept = [[5, 6, 7], [8], [9, 10]], [3, 1, 2]
    kv = StaticKV(model, 3, 64)
    seen = []
    for layer in kv.lean.layers:
        layer.mlp = (lambda mlp: lambda h: seen.append(h.shape[0]) or mlp(h))(layer.mlp)
    kv.forward(prompts, 1, hidden_layers=(0,), hidden_all=True)
    prefill_hidden = kv.hidden[0].clone()
    assert seen[0] == sum(map(len, prompts)), seen  # not 3 x the longest
    seen.clear()
    logits = kv.forward(feeds, 3, hidden_layers=(0, -1), kept=kept)  # (3, 3, V)
    hidden = {k: v.clone() for k, v in kv.hidden.items()}
    assert seen[0] == 6 and seen[-1] == 6, seen  # 3 + 1 + 2 real tokens, not 3 x 3
    for b, (prompt, feed, n) in enumerate(zip(prompts, feeds, kept)):
        alone = StaticKV(model, 1, 64)
        alone.forward([prompt], 1, hidden_layers=(0,), hidden_all=True)
        assert torch.equal(alone.hidden[0][0], prefill_hidden[b, : len(prompt)])
        assert not prefill_hidden[b, len(prompt):].any()
        own = alone.forward([feed], n, hidden_layers=(0, -1))
        assert torch.equal(own[0], logits[b, :n]) and not logits[b, n:].any(), b
        for layer in (0, -1):
            assert torch.equal(alone.hidden[layer][0], hidden[layer][b, :n]) and not hidden[layer][b, n:].any()
