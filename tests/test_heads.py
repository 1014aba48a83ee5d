"""Medusa and EAGLE heads drafting for the engine: greedy output equals plain decoding for every
tree, the EAGLE head's incremental cache equals a full forward over the real features, and heads
that do not fit a target are refused with one line."""

import copy
from types import SimpleNamespace

import pytest
import torch

from speclm import SpecEngine
from speclm.errors import UsageError
from speclm.forward.costs import ForwardCosts
from speclm.heads import store
from speclm.models.loading import load_model
from speclm.sampling import SamplingParams
from tiny import byte_tokenizer, loaded, random_heads, require_compiled_kernels, tiny_model

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(", "hello hello hello", "x = 1\ny = 2\nz = x +",
           "The quick brown fox jumps over"]


@pytest.fixture(scope="module")
def heads_files(tmp_path_factory, target):
    root = tmp_path_factory.mktemp("heads")
    files = {kind: random_heads(kind, target.model, root / f"{kind}.safetensors", seed=i, std=0.3)
             for i, kind in enumerate(("medusa", "eagle"))}
    # EAGLE-3's fused input: layer 0's states beside the final feature
    files["eagle-fused"] = random_heads("eagle", target.model, root / "eagle-fused.safetensors", seed=2, std=0.3,
                                        fuse_layers=(0,))
    (root / "medusa-tree.json").write_text("[[0], [1], [0, 0], [0, 0, 0]]")  # `--tree static` reads it
    return files


@pytest.fixture(scope="module")
def static_tree(tmp_path_factory):
    path = tmp_path_factory.mktemp("tree") / "choices.json"
    path.write_text("[[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 1]]")
    return str(path)


@pytest.fixture(scope="module")
def int8_target(tok):
    return load_model(copy.deepcopy(tiny_model(len(tok), seed=0)), tokenizer=tok, quantize="int8")


def _cases(heads_files, static_tree):
    return [dict(method="medusa", heads=heads_files["medusa"]),
            dict(method="medusa", heads=heads_files["medusa"], tree=static_tree),
            dict(method="medusa", heads=heads_files["medusa"], k=1),
            dict(method="medusa", heads=heads_files["medusa"], tree="static"),
            dict(method="eagle", heads=heads_files["eagle"]),
            dict(method="eagle", heads=heads_files["eagle"], k=2),
            dict(method="eagle+pld", heads=heads_files["eagle"]),
            dict(method="eagle+pld", heads=heads_files["eagle"], k=1, ngram_min=1),
            dict(method="eagle", heads=heads_files["eagle-fused"]),
            dict(method="eagle+pld", heads=heads_files["eagle-fused"])]


@pytest.mark.parametrize("weights", ["fp32", "int8"])
def test_greedy_equals_plain_for_every_tree(target, int8_target, heads_files, static_tree, weights):
    model = target if weights == "fp32" else int8_target
    engine = SpecEngine(model)
    # a flat cost line (every tree size costs one forward): trees of every size get drafted whatever
    # the cores were doing while the line would be measured
    engine.forward_costs = lambda: ForwardCosts({n: 1.0 for n in (1, 2, 4, 8, 16, 32, 48)})
    plain = engine.generate(PROMPTS, method="none", max_new_tokens=40)
    for options in _cases(heads_files, static_tree):
        outs = engine.generate(PROMPTS, max_new_tokens=40, batch_size=3, **options)
        assert [o.token_ids for o in outs] == [p.token_ids for p in plain], options
        stats = [o.stats for o in outs]
        assert sum(s.verified_nodes for s in stats) > 0  # it drafted trees
        assert sum(s.target_forwards for s in stats) <= sum(len(o.token_ids) for o in outs)


def test_the_shipped_tree_is_cut_by_the_costs_and_a_file_tree_is_not(target, heads_files, static_tree):
    """`--tree static` (the tuned tree beside the heads, sized on another machine) verifies only the
    nodes that pay for their verification on this machine's cost line; a `--tree FILE` is verified
    whole, whatever the line says. Output stays plain decoding's either way."""
    engine = SpecEngine(target)
    engine.forward_costs = lambda: ForwardCosts({n: float(n) for n in (1, 2, 4, 8, 16, 32, 48)})  # no node pays
    plain = engine.generate(PROMPTS, method="none", max_new_tokens=20)
    cut = engine.generate(PROMPTS, max_new_tokens=20, method="medusa", heads=heads_files["medusa"], tree="static")
    whole = engine.generate(PROMPTS, max_new_tokens=20, method="medusa", heads=heads_files["medusa"], tree=static_tree)
    for outs in (cut, whole):
        assert [o.token_ids for o in outs] == [p.token_ids for p in plain]
    assert sum(o.stats.verified_nodes for o in cut) == 0
    rounds = sum(o.stats.target_forwards - 1 for o in whole)
    assert sum(o.stats.verified_nodes for o in whole) > 4 * rounds  # the file's 8 nodes, but near the end


def test_trees_are_trees_and_some_are_accepted(target, heads_files, monkeypatch):
    """Random heads still get some nodes accepted (the verifier reads their trees), and each
    round verifies a tree of several nodes (not one token); EAGLE's reach below its first level."""
    import speclm.proposers.eagle as eagle

    depths = []
    real = eagle.to_draft

    def to_draft(rows, chosen, forwards):
        depths.extend(rows[b][i].depth for b, c in enumerate(chosen) for i in c)
        return real(rows, chosen, forwards)

    monkeypatch.setattr(eagle, "to_draft", to_draft)
    engine = SpecEngine(target)
    # a flat cost line: random heads' low probabilities pay for no node on a measured one, and the
    # shipped-style static tree is cut to what pays
    engine.forward_costs = lambda: ForwardCosts({n: 1.0 for n in (1, 2, 4, 8, 16, 32, 48)})
    for kind in ("medusa", "eagle"):
        outs = engine.generate(PROMPTS, max_new_tokens=60, method=kind, heads=heads_files[kind])
        assert sum(o.stats.accepted_tokens for o in outs) > 0, kind
        rounds = sum(o.stats.target_forwards - 1 for o in outs)
        assert sum(o.stats.verified_nodes for o in outs) > 2 * rounds, kind
    assert max(depths) >= 2


def test_lookup_rows_take_chains_and_the_others_keep_the_heads_tree():
    """eagle+pld's draft: a row with a chain is drafted by that chain (node i's parent i - 1); a
    row without one keeps the heads' tree as it was; point masses throughout."""
    from speclm.proposers.base import Draft, mixed_draft
    from speclm.sampling import SamplingParams
    from speclm.tree import PAD, ROOT

    # row 0: root -> 5 -> 6, root -> 7; row 1: nothing (the heads gave it no budget)
    heads = Draft(torch.tensor([[5, 6, 7], [0, 0, 0]]), torch.tensor([3, 0]), None,
                  parents=torch.tensor([[ROOT, 0, ROOT], [PAD, PAD, PAD]]))
    draft = mixed_draft([[5, 6, 7], [8, 1, 2, 4]], [False, True], heads, SamplingParams(temperature=1.0))
    tree = draft.tree()
    tree.check()
    assert draft.draft_probs is None and tree.sizes == [3, 4]
    assert tree.tokens[0, :3].tolist() == [5, 6, 7] and tree.parents[0].tolist() == [ROOT, 0, ROOT, PAD]
    assert tree.tokens[1].tolist() == [8, 1, 2, 4] and tree.parents[1].tolist() == [ROOT, 0, 1, 2]
    # rows drafted by lookup alone, beside an empty draft
    alone = mixed_draft([[3, 4], [9]], [True, True], Draft.empty(2), SamplingParams()).tree()
    assert alone.sizes == [2, 1] and alone.parents[0].tolist() == [ROOT, 0]


def test_eagle_with_lookup_accepts_more(target, heads_files):
    """On prompts that repeat themselves, the lookup branch gets random heads' trees accepted more
    tokens per target forward than the heads alone, with the same output."""
    engine = SpecEngine(target)
    repeat = ["ab ab ab ab ab ab ab", "def f(x):\n    return x\n\ndef f(x):\n    return x\n\ndef f("]
    alone = engine.generate(repeat, max_new_tokens=40, method="eagle", heads=heads_files["eagle"])
    both = engine.generate(repeat, max_new_tokens=40, method="eagle+pld", heads=heads_files["eagle"], ngram_min=1)
    assert [o.token_ids for o in both] == [o.token_ids for o in alone]
    per_forward = [sum(len(o.token_ids) for o in outs) / sum(o.stats.target_forwards for o in outs)
                   for outs in (alone, both)]
    assert per_forward[1] > per_forward[0], per_forward


@pytest.mark.parametrize("which", ["eagle", "eagle-fused"])
def test_eagle_cache_equals_full_forward(target, heads_files, which):
    """After a few rounds, the head's cache (keys fed incrementally: the prompt's features after
    the prefill, then the old root and the accepted path after each round) equals the keys of one
    forward of the head over every committed token's real feature (fused: the head's lift of
    layer 0's states and the final feature)."""
    from speclm.forward.cache import StaticKV

    engine = SpecEngine(target)
    heads = engine.heads("eagle", heads_files[which])
    request = engine.request(PROMPTS[0], method="eagle", heads=heads_files[which], max_new_tokens=30)
    batch = engine.batch(capacity=200)
    batch.join(request)
    while batch.active:
        batch.step()
        proposer = next(iter(batch.groups.values())).proposer if batch.groups else None
        if proposer is not None and len(request.generated) >= 12:
            break
    assert proposer is not None
    context = request.context
    keys = proposer.keys[0]  # (H_kv, P, D): one per committed token but the root
    kv = StaticKV(target.model, 1, len(context) + 1)
    layers = heads.module.config.feature_layers
    kv.forward([context], 1, hidden_layers=layers, hidden_all=True)
    with torch.no_grad():
        real = heads.module.lift(torch.cat([kv.hidden[layer][0] for layer in layers], -1))  # (T, E)
    pending = proposer.pending[0].count
    fed = keys.shape[1]
    n = fed  # pairs (feature j, token j + 1) for j < fed
    with torch.no_grad():
        _, full_k, _ = heads.module(real[None, :n], heads.embed(torch.tensor([context[1 : n + 1]])),
                                    torch.arange(1, n + 1)[None])
    assert fed + pending == len(context) - 1
    assert torch.allclose(keys, full_k[0], atol=1e-4), (keys - full_k[0]).abs().max()


def _full_keys(target, heads, context, n):
    """The head's keys of one forward over the real features of context[:n] (pairs (feature j, token j + 1))."""
    from speclm.forward.cache import StaticKV

    kv = StaticKV(target.model, 1, len(context) + 1)
    layers = heads.module.config.feature_layers
    kv.forward([context], 1, hidden_layers=layers, hidden_all=True)
    with torch.no_grad():
        real = heads.module.lift(torch.cat([kv.hidden[layer][0] for layer in layers], -1))  # (T, E)
        _, full_k, _ = heads.module(real[None, :n], heads.embed(torch.tensor([context[1 : n + 1]])),
                                    torch.arange(1, n + 1)[None])
    return full_k[0]


def test_eagle_feeds_only_the_rows_it_drafts_and_a_row_that_sat_out_catches_up(target, heads_files):
    """eagle+pld: a row prompt lookup drafts keeps its features pending while the heads draft
    another row (feeding it too would make one row's switch to the heads pay every row's backlog);
    `unread` counts them, and the next time the heads draft the row they read them all: its cache
    then equals one forward over every committed token."""
    engine = SpecEngine(target)
    heads = engine.heads("eagle", heads_files["eagle"])
    batch = engine.batch(capacity=200)
    repeat, other = "ab ab ab ab ab ab ab ab", PROMPTS[3]
    requests = [engine.request(p, method="eagle+pld", heads=heads_files["eagle"], ngram_min=1, max_new_tokens=30)
                for p in (repeat, other)]
    for r in requests:
        batch.join(r)
    waited = None
    while batch.active and waited is None:
        batch.step()
        proposer = next(iter(batch.groups.values())).proposer.heads
        contexts = [r.context for r in requests]
        unread = proposer.unread(contexts)
        if len(requests[0].generated) >= 8 and unread[0] > 0 and proposer.keys[1].shape[1] > 0:
            waited = unread[0]
    assert waited is not None and waited == proposer.pending[0].count  # the heads drafted row 1, not row 0
    assert proposer.unread(contexts)[1] == 0  # row 1's pending: its last round's alone
    before = proposer.prefill_seconds
    proposer.propose(contexts, [2, 0], SamplingParams(), [None, None])
    assert proposer.prefill_seconds > before and proposer.unread(contexts)[0] == 0
    assert proposer.pending[1].count > 0  # row 1 did not draft: its features still wait
    fed = proposer.keys[0].shape[1]
    assert fed == len(contexts[0]) - 1
    full = _full_keys(target, heads, contexts[0], fed)
    assert torch.allclose(proposer.keys[0], full, atol=1e-4), (proposer.keys[0] - full).abs().max()
    assert proposer.reading_seconds(10) is not None  # a feed of 32 features or more measured its reading


def test_rows_of_like_counts_are_fed_together():
    from speclm.proposers.eagle import _packed

    counts = {0: 3, 1: 4, 2: 3, 3: 300, 4: 5}
    assert _packed(sorted(counts, key=counts.get), counts) == [[0, 2, 1, 4], [3]]
    assert _packed([0, 1], {0: 100, 1: 150}) == [[0, 1]]


def test_int8_eagle_keeps_the_token_embedding(int8_target, tmp_path):
    """EAGLE's fused input joins a feature of large entries (about 60 on Qwen2.5) with a token's
    embedding (about 0.05). On int8 kernels each part gets its own activation scale, so the
    embedding's contribution survives; under one shared per-row scale (the mutation) it rounds to
    zero. And heads loaded for an int8 target compute their fused input that way."""
    from speclm.engine import LoadedHeads
    from speclm.heads.modules import PartsLinear
    from speclm.quant.weights import quantize_linears

    torch.manual_seed(0)
    size = 64
    linear = torch.nn.Linear(2 * size, size, bias=False)
    feature, embedding = torch.randn(3, size) * 60, torch.randn(3, size) * 0.05
    with torch.no_grad():
        wanted = embedding @ linear.weight[:, size:].t()  # the embedding's contribution, fp32

        def contribution(module):
            return module(torch.cat([feature, embedding], -1)) - module(torch.cat([feature, 0 * embedding], -1))

        parts = torch.nn.Sequential(PartsLinear(linear, (size, size)))
        torch.testing.assert_close(parts(torch.cat([feature, embedding], -1)),
                                   linear(torch.cat([feature, embedding], -1)), rtol=1e-5, atol=1e-4)
        quantize_linears(parts, "int8")
        assert (contribution(parts) - wanted).norm() < 0.05 * wanted.norm()
        shared = torch.nn.Sequential(torch.nn.Linear(2 * size, size, bias=False))
        shared[0].weight.copy_(linear.weight)
        quantize_linears(shared, "int8")
        assert (contribution(shared) - wanted).norm() > 0.5 * wanted.norm()
    path = random_heads("eagle", int8_target.model, tmp_path / "eagle.safetensors")
    module = LoadedHeads.load(path, "eagle", int8_target).module
    assert isinstance(module.fuse, PartsLinear) and not any(isinstance(p, torch.nn.Linear) for p in module.fuse.parts)


def test_int8_heads_hold_one_copy_of_their_weights(int8_target, tmp_path, monkeypatch):
    """Heads on an int8 target keep only the compiled kernel's copy of each weight (no second,
    oneDNN-packed one, even where SPECLM_ONEDNN=1 gives the target's layers one), and their weights
    come straight from the file (no randomly initialised module first): what keeps EAGLE within the
    issue's memory bound (benchmarks/heads_memory.py). Their drafts are unchanged: the greedy test
    above runs them."""
    from speclm.engine import LoadedHeads
    from speclm.quant import weights as quant
    from speclm.quant.weights import Int8Linear, Int8Slice

    require_compiled_kernels()
    monkeypatch.setenv("SPECLM_ONEDNN", "1")
    monkeypatch.setattr(quant, "_onednn_available", lambda: True)  # layers built here would pack oneDNN's copy
    assert Int8Linear(torch.nn.Linear(64, 64)).onednn
    for kind in ("medusa", "eagle"):
        path = random_heads(kind, int8_target.model, tmp_path / f"{kind}.safetensors")
        module = LoadedHeads.load(path, kind, int8_target).module
        layers = [m.fused.kernel if isinstance(m, Int8Slice) else m for m in module.modules()]
        layers = [m for m in layers if isinstance(m, Int8Linear)]
        assert layers and all(not m.onednn and "packed" not in m.__dict__ for m in layers), kind
        assert all(not p.is_meta for p in module.parameters())
        stored, _, _ = store.load(path)
        assert all(not p.is_meta for p in stored.parameters())


def test_eagle_reads_a_chunked_prompt_whole(int8_target, tmp_path):
    """A prompt read in chunks while another request decodes (int8 weights: chunk-invariant)
    reaches EAGLE's head whole: its cache equals one forward of the head over the real features,
    and both requests' outputs equal their plain ones."""
    from speclm.forward.cache import StaticKV

    heads_file = random_heads("eagle", int8_target.model, tmp_path / "eagle.safetensors", seed=3)
    engine = SpecEngine(int8_target)
    heads = engine.heads("eagle", heads_file)
    options = dict(method="eagle", heads=heads_file, max_new_tokens=24)
    first = engine.request(PROMPTS[1], **options)
    long_prompt = PROMPTS[0] * 2
    second = engine.request(long_prompt, **options)
    batch = engine.batch(rows=2, capacity=300, prefill_chunk=7)
    batch.join(first)
    batch.step()
    batch.join(second)
    reads = 0
    while batch.active:
        batch.step()
        reads += batch.last_step == "prefill"
        group = next(iter(batch.groups.values()))
        if second in group.requests and len(second.generated) >= 3:
            break
    assert reads > 2  # the second prompt was read in several chunks
    row = group.requests.index(second)
    proposer = group.proposer
    keys = proposer.keys[row]
    context = second.context
    kv = StaticKV(int8_target.model, 1, len(context) + 1)
    kv.forward([context], 1, hidden_layers=(-1,), hidden_all=True)
    n = keys.shape[1]
    with torch.no_grad():
        _, full_k, _ = heads.module(kv.hidden[-1][:, :n], heads.embed(torch.tensor([context[1 : n + 1]])),
                                    torch.arange(1, n + 1)[None])
    assert torch.allclose(keys, full_k[0], atol=1e-4)
    while batch.active:
        batch.step()
    plain = engine.generate([PROMPTS[1], long_prompt], method="none", max_new_tokens=24)
    assert [first.generated, second.generated] == [p.token_ids for p in plain]


def test_heads_that_do_not_fit_are_refused(tmp_path, target, heads_files):
    tok = byte_tokenizer()
    other = loaded(tiny_model(len(tok), seed=5, hidden=96, heads=3), tok, name="wide")
    with pytest.raises(UsageError, match="do not fit target 'wide'"):
        SpecEngine(other).generate("x", method="eagle", heads=heads_files["eagle"], max_new_tokens=4)
    deep = random_heads("eagle", target.model, tmp_path / "deep.safetensors", fuse_layers=(5,))  # the tiny target has 2 layers
    with pytest.raises(UsageError, match="read layer 5 of their target; 'tiny-target' has 2 layers"):
        SpecEngine(target).generate("x", method="eagle", heads=deep, max_new_tokens=4)
    with pytest.raises(UsageError, match="are medusa heads, not eagle"):
        SpecEngine(target).generate("x", method="eagle", heads=heads_files["medusa"], max_new_tokens=4)
    with pytest.raises(UsageError, match="none ship for"):
        SpecEngine(target).generate("x", method="medusa", max_new_tokens=4)
    with pytest.raises(UsageError, match="heads file not found"):
        SpecEngine(target).generate("x", method="medusa", heads=str(tmp_path / "nope.safetensors"), max_new_tokens=4)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(UsageError, match="cannot read heads file"):
        store.load(bad)
    alone = tmp_path / "medusa.safetensors"  # no medusa-tree.json beside it
    alone.write_bytes(open(heads_files["medusa"], "rb").read())
    with pytest.raises(UsageError, match="no tuned tree beside"):
        SpecEngine(target).generate("x", method="medusa", heads=str(alone), tree="static", max_new_tokens=4)
    with pytest.raises(UsageError, match="static is medusa's"):
        SpecEngine(target).generate("x", method="eagle", heads=heads_files["eagle"], tree="static", max_new_tokens=4)
    with pytest.raises(UsageError, match="--heads applies to"):
        SpecEngine(target).generate("x", method="pld", heads=heads_files["medusa"], max_new_tokens=4)


def test_export_is_int8_and_load_round_trips(tmp_path, target):
    from speclm.heads.modules import HeadsConfig, make
    from speclm.heads.store import export, load

    config = HeadsConfig("medusa", 64, 10, 257, heads=2)
    torch.manual_seed(0)
    module = make(config)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.1)
    manifest = export(tmp_path / "m.safetensors", module, config, torch.arange(10), {"steps": 3})
    back, config2, ids = load(tmp_path / "m.safetensors", target)
    assert config2 == config and torch.equal(ids, torch.arange(10)) and manifest["steps"] == 3
    for (name, a), (_, b) in zip(module.state_dict().items(), back.state_dict().items()):
        scale = a.abs().amax(-1, keepdim=True) / 127 if a.dim() == 2 else 0
        assert torch.all((a - b).abs() <= scale / 2 + 1e-7), name  # int8 per channel: within half a step


def test_typical_acceptance_rule_on_hand_made_logits():
    """Medusa's rule: a node is acceptable where the target gives its token more than
    min(0.09, 0.3 exp(-H)) at its parent; the longest acceptable root path is committed, then one
    token sampled after it. Lossy, so never the default."""
    import math

    from speclm.options import GenerationOptions
    from speclm.sampling import SamplingParams
    from speclm.tree import ROOT, DraftTree
    from speclm.round.verify import typical_paths, verify_tree

    root = torch.tensor([0.6, 0.3, 0.07, 0.03])  # H = 0.98: bar = min(0.09, 0.3 e^-0.98 = 0.113) = 0.09
    flat = torch.full((4,), 0.25)  # H = ln 4: bar = min(0.09, 0.075) = 0.075
    sharp = torch.tensor([0.97, 0.01, 0.01, 0.01])  # bar = min(0.09, 0.3 e^-0.17 = 0.25) = 0.09
    # nodes: 0 token 2 (root: 0.07 < 0.09, rejected), 1 token 1 (root: 0.3, accepted),
    # 2 child of 0 (unreachable), 3 child of 1 token 3 (node 1 flat: 0.25 > 0.075), 4 child of 3 token 1 (sharp: 0.01)
    tree = DraftTree(torch.tensor([[2, 1, 0, 3, 1]]), torch.tensor([[ROOT, ROOT, 0, 1, 3]]), None)
    probs = torch.stack([root, sharp, flat, sharp, sharp, sharp])[None]  # (1, 1 + 5, 4): root, then nodes 0..4
    bar_flat = min(0.09, 0.3 * math.exp(-math.log(4)))
    assert bar_flat < 0.25
    assert typical_paths(probs, tree) == [[1, 3]]
    # every node acceptable: the longest path wins, the first in node order among equals
    chain = DraftTree(torch.tensor([[0, 1, 0]]), torch.tensor([[ROOT, ROOT, 0]]), None)
    assert typical_paths(torch.stack([root, sharp, sharp, sharp])[None], chain) == [[0, 2]]
    # through verify_tree: the path's tokens, then one sampled token; at temperature 0 it is greedy
    logits = probs.log()
    g = torch.Generator().manual_seed(0)
    verdict = verify_tree(logits, tree, SamplingParams(temperature=1.0), [g], acceptance="typical")
    assert verdict.paths == [[1, 3]] and verdict.committed(0)[:2] == [1, 3]
    greedy = verify_tree(logits, tree, SamplingParams(temperature=0.0), [None], acceptance="typical")
    assert greedy.paths == verify_tree(logits, tree, SamplingParams(temperature=0.0), [None]).paths
    assert GenerationOptions(method="medusa").acceptance == "exact"
    with pytest.raises(UsageError, match="lossy"):
        GenerationOptions(method="draft", acceptance="typical")


def test_trained_heads_end_to_end(tmp_path, target, monkeypatch):
    """The whole path on the tiny target: `speclm heads data` builds self-distilled data, a few
    training steps make Medusa and EAGLE heads, and decoding with them stays equal to plain
    decoding and accepts drafted tokens. Verification is priced free here, so the heads' trees
    are verified whatever this machine's cost line for the tiny model (its 1-token forward is
    30% cheaper than its 2-token one, which prices a few-step head's nodes out)."""
    from speclm.forward.costs import ForwardCosts
    from speclm.heads.data import add_layers, build
    from speclm.heads.sources import Prompt
    from speclm.heads.train import train

    words = ["alpha", "beta", "gamma", "delta", "omega", "kappa"]
    prompts = [Prompt.of("code", "test", "Apache-2.0", f"{words[i % 6]} {words[(i * 5) % 6]} {i}") for i in range(24)]
    build(target, tmp_path / "data", candidates=prompts, max_new_tokens=24, max_prompt_tokens=64, batch_size=8,
          shard_size=8, progress=False)
    monkeypatch.setattr(SpecEngine, "forward_costs", lambda self: ForwardCosts({1: 1.0, 64: 1.0}))
    engine = SpecEngine(target)
    plain = engine.generate(PROMPTS, method="none", max_new_tokens=32)
    for kind, steps in (("medusa", 60), ("eagle", 60)):
        summary = train(tmp_path / "data", tmp_path / kind, kind, target, vocab=200, heads=3, intermediate=128,
                        chunk=64, batch_size=4, steps=steps, eval_every=steps, save_every=steps, progress=False,
                        valid_fraction=0.2)
        outs = engine.generate(PROMPTS, max_new_tokens=32, method=kind, heads=summary["heads"])
        assert [o.token_ids for o in outs] == [p.token_ids for p in plain], kind
        assert sum(o.stats.accepted_tokens for o in outs) > 0, kind
    eagle = summary["heads"]

    # EAGLE-3's fused input: layer 0's states added to the data, a head trained from the one
    # above, which it starts as exactly (its reduce passes the final feature through)
    with pytest.raises(UsageError, match="speclm heads layers"):
        train(tmp_path / "data", tmp_path / "fused", "eagle", target, vocab=200, intermediate=128, chunk=64,
              batch_size=4, steps=1, progress=False, valid_fraction=0.2, fuse_layers=(0,))
    add_layers(tmp_path / "data", [0], target)
    from safetensors.torch import load_file

    from speclm.forward.cache import StaticKV
    from speclm.heads.data import read_shards

    shard = next(read_shards(tmp_path / "data", [0]))
    states = load_file(str(tmp_path / "data" / "layers-00000.safetensors"))["layer0"]
    assert states.shape == shard["hidden"].shape
    first = shard["tokens"][: int(shard["starts"][1])].tolist()
    kv = StaticKV(target.model, 1, len(first) + 1)
    kv.forward([first], 1, hidden_layers=(0,), hidden_all=True)
    assert torch.allclose(kv.hidden[0][0], states[: len(first)].float(), rtol=1e-2, atol=1e-3)  # bf16 as stored
    summary = train(tmp_path / "data", tmp_path / "fused", "eagle", target, vocab=200, intermediate=128, chunk=64,
                    batch_size=4, steps=1, lr=1e-12, warmup=1, progress=False, valid_fraction=0.2,
                    fuse_layers=(0,), init=eagle)
    before, after = store.load(eagle)[0], store.load(summary["heads"])[0]
    assert after.config.fuse_layers == (0,)
    x = torch.randn(3, 2 * before.config.hidden_size)
    assert torch.allclose(after.lift(x), x[:, before.config.hidden_size:], atol=1e-3)
    summary = train(tmp_path / "data", tmp_path / "fused2", "eagle", target, vocab=200, intermediate=128, chunk=64,
                    batch_size=4, steps=60, eval_every=60, save_every=60, progress=False, valid_fraction=0.2,
                    fuse_layers=(0,), init=eagle, unroll=2)
    outs = engine.generate(PROMPTS, max_new_tokens=32, method="eagle", heads=summary["heads"])
    assert [o.token_ids for o in outs] == [p.token_ids for p in plain]
    assert sum(o.stats.accepted_tokens for o in outs) > 0


def test_adaptive_speculation_turns_head_trees_on_and_off(target, heads_files):
    """Under the serving policy (speclm.round.adaptive) a head's tree is verified whole or not at all in
    a round, sized by the nodes its rows really drafted; outputs stay those of plain decoding."""
    from speclm.round.adaptive import Adaptive
    from speclm.forward.costs import ForwardCosts

    engine = SpecEngine(target)
    # a cost line on which verifying is nearly free, so the trees run (a measured tiny model's need
    # not, above all one measured while other work holds the cores): the policy's and the proposers'
    policy = Adaptive(ForwardCosts({1: 0.1, 64: 0.1001}))
    engine.forward_costs = lambda: ForwardCosts({1: 0.1, 64: 0.1001})
    batch = engine.batch(rows=4, speculation=policy)
    requests = [batch.join(engine.request(p, method=kind, heads=heads_files[kind], max_new_tokens=30))
                for p, kind in zip(PROMPTS, ("medusa", "eagle", "medusa", "eagle"))]
    caps = []
    while batch.active:
        batch.step()
        caps.append(dict(policy.last))
    plain = engine.generate(PROMPTS, method="none", max_new_tokens=30)
    assert [r.generated for r in requests] == [p.token_ids for p in plain]
    assert all(cap in (None, 0, 1) for round_caps in caps for cap in round_caps.values())
    assert any(cap is None for round_caps in caps for cap in round_caps.values())  # trees verified whole
    assert len(policy._nodes) == 2 and all(0 < n <= 48 for n in policy._nodes.values())


def test_the_heads_reading_of_a_prompt_is_its_prefill_not_a_rounds_drafting(target, heads_files, monkeypatch):
    """EAGLE's head reads every prompt token's features before its first tree: that feed is its
    prefill (stats' draft prefill; speclm tune's step and the planner's measured rounds leave it
    out), not the first round's drafting, which priced the round 1.5x (a 900-token prompt) and
    turned auto's drafting off for the request. Later feeds (a round's path) are drafting."""
    import itertools

    import speclm.proposers.eagle as eagle

    clock = itertools.count()  # each reading of the clock one second on
    monkeypatch.setattr(eagle, "time", SimpleNamespace(perf_counter=lambda: float(next(clock))))
    engine = SpecEngine(target)
    prompt = "the quick brown fox jumps over the lazy dog, " * 3
    for method in ("eagle", "eagle+pld"):
        out = engine.generate(prompt, method=method, heads=heads_files["eagle"], max_new_tokens=16)
        assert out.stats.draft_prefill_seconds == 1.0, (method, out.stats.draft_prefill_seconds)  # the first feed alone
