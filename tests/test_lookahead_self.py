"""Lookahead decoding and self-speculation: greedy output is plain decoding's token for token (fp32
and int8 weights, alone and in batches), the pieces each method is made of do what they say,
and their options are checked. Their exact-distribution tests are in test_sampling_distribution.py."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from speclm import SpecEngine
from speclm.errors import UsageError
from speclm.forward.lean import Stack
from speclm.options import GenerationOptions
from speclm.proposers.lookahead import LookaheadProposer
from speclm.proposers.self_draft import candidates, layers_of, parse_layers
from speclm.quant.weights import quantize_model
from speclm.tree import ROOT
from tiny import loaded, require_compiled_kernels, tiny_model

PROMPTS = ["hello world, hello", "abc", "the quick brown fox jumps over the lazy dog, the quick"]
N = 40
SETTINGS = [("lookahead", {}), ("lookahead", {"lookahead": (3, 4, 3)}), ("lookahead", {"lookahead": (1, 2, 1)}),
            ("lookahead+pld", {}), ("lookahead+pld", {"lookahead": (2, 3, 2), "ngram_min": 1}),
            ("self", {"layers": "2", "self_weights": "target"}), ("self", {"layers": "skip:1-2", "self_weights": "target"}),
            ("self", {"layers": "1", "k": 5, "self_weights": "target"}),
            ("self", {"layers": "2", "self_weights": "int4"}), ("self", {"layers": "skip:1", "self_weights": "int4"}),
            ("self", {"layers": "all", "self_weights": "int4", "k": 4}),
            ("self", {"layers": "2", "self_weights": "target", "tree": "auto"}),
            ("self", {"layers": "skip:1", "self_weights": "int4", "tree": "auto"}),
            ("self", {"layers": "2", "self_weights": "target", "draft_vocab": 64}),
            ("self", {"layers": "all", "self_weights": "int4", "draft_vocab": 64, "tree": "auto"})]


@pytest.fixture(scope="module")
def deep(tok):
    """A 4-layer target: room for early exit and skips."""
    return loaded(tiny_model(len(tok), seed=0, layers=4), tok, name="tiny-deep")


@pytest.fixture(scope="module")
def deep8(deep):
    return loaded(quantize_model(copy.deepcopy(deep.model), "int8"), deep.tokenizer, name="tiny-deep-int8")


@pytest.mark.parametrize("weights", ["fp32", "int8"])
@pytest.mark.parametrize("method,options", SETTINGS, ids=lambda v: str(v))
def test_greedy_output_is_plain_decoding(deep, deep8, weights, method, options):
    if options.get("self_weights") == "int4":
        require_compiled_kernels()  # int4 layers run on speclm's kernels only
    model = deep if weights == "fp32" else deep8
    engine = SpecEngine(model)
    for prompt in PROMPTS:
        ref = engine.generate(prompt, method="none", max_new_tokens=N)
        out = engine.generate(prompt, method=method, max_new_tokens=N, **options)
        assert out.token_ids == ref.token_ids, (prompt, method, options)
    refs = engine.generate(PROMPTS, method="none", max_new_tokens=N)
    outs = engine.generate(PROMPTS, method=method, max_new_tokens=N, **options)  # one batch, rows apart
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]


class _Planted(LookaheadProposer):
    """Lookahead whose pool holds, before each round, the true continuation of the context with
    its token at `error_at` changed (None: unchanged): the verification branch's n-gram."""

    def __init__(self, reference: list[int], prompt_len: int, error_at: int | None, vocab: int, **kw):
        super().__init__(**kw)
        self.reference, self.prompt_len, self.error_at, self.vocab = reference, prompt_len, error_at, vocab

    def propose(self, contexts, max_tokens, params, generators):
        for row, context in zip(self.rows, contexts):
            at = len(context) - self.prompt_len
            rest = self.reference[at : at + self.ngram - 1]
            if self.error_at is not None and self.error_at < len(rest):
                rest[self.error_at] = (rest[self.error_at] + 1) % self.vocab
            if len(rest) == self.ngram - 1:
                self._remember(row, [context[-1], *rest])
        return super().propose(contexts, max_tokens, params, generators)


@pytest.mark.parametrize("error_at", [None, 0, 1, 2, 3])
def test_pooled_ngrams_right_wrong_and_wrong_at_each_position(deep, tok, monkeypatch, error_at):
    prompt, ngram = PROMPTS[0], 5
    engine = SpecEngine(deep)
    ref = engine.generate(prompt, method="none", max_new_tokens=N)
    planted = _Planted(ref.token_ids, len(tok(prompt).input_ids), error_at, len(tok), window=2, ngram=ngram,
                       guesses=1, prompt_ngrams=False)
    monkeypatch.setattr(engine, "make_proposer", lambda opts: planted)
    out = engine.generate(prompt, method="lookahead", max_new_tokens=N, lookahead=(2, ngram, 1))
    assert out.token_ids == ref.token_ids
    if error_at is None:  # every round commits the whole n-gram and the target's token after it
        assert out.stats.target_forwards <= 1 + -(-(N - 1) // ngram) + 1
    elif error_at == 0:  # the n-gram never helps (the window's guesses rarely do on a random model)
        assert out.stats.target_forwards >= N // 2
    else:  # each round after the prefill accepts the n-gram up to its wrong token
        rounds = out.stats.target_forwards - 1
        assert out.stats.accepted_per_position[error_at - 1] >= rounds - 3  # the last rounds: no n-gram left to plant


def test_window_is_a_tree_of_trajectories_and_merges_equal_nodes():
    p = LookaheadProposer(window=3, ngram=3, guesses=2, prompt_ngrams=False)
    p.add(1)
    p.rows[0].levels = [[7, 8, 9], [7, 5, 6]]  # level 1's column 0 equals level 0's: one node
    p._remember(p.rows[0], [4, 7, 8])  # a pooled n-gram after the last token 4: merged with the window too
    draft = p.propose([[1, 2, 3, 4]], [3], None, [None])
    tokens, parents = draft.tokens[0].tolist(), draft.parents[0].tolist()
    nodes = list(zip(tokens, parents))
    # the n-gram's trie 7 -> 8; level 0 the chain 7 -> 8 -> 9 (7, 8 shared); level 1: 7 at the root (shared),
    # 5 under level 0's 7, 6 under level 0's 8
    assert nodes == [(7, ROOT), (8, 0), (9, 1), (5, 0), (6, 1)]
    window = p.rows[0].window_nodes
    assert window == {(0, 0): 0, (0, 1): 1, (0, 2): 2, (1, 0): 0, (1, 1): 3, (1, 2): 4}
    # the target's argmax at each node is the next level's guess one column on; the top level's paths
    # complete n-grams (the context's last token, then the path's last token, then the argmax)
    logits = torch.zeros(1, 1 + len(tokens), 20)
    for column, best in enumerate([11, 12, 13, 14, 15, 16]):  # root, then nodes 0..4
        logits[0, column, best] = 1.0
    from speclm.proposers.base import Verified

    p.accept(Verified([4], [[]], None, logits))
    assert p.rows[0].levels == [[7, 5, 6], [11, 12, 15]]  # root -> column 0; (1, 0) = node 0 -> 12; (1, 1) = node 3 -> 15
    pool = p.rows[0].pool
    assert (12,) in [rest[-1:] for rest in pool[4]]  # n-gram (4, 7, 12): (1, 0)'s path is the root's 7
    assert tuple(pool[7]) == ((5, 15),) and tuple(pool[8]) == ((6, 16),)  # (1, 1): 7 5 -> 15; (1, 2): 8 6 -> 16


def _bigram_model(tok):
    """A target whose next token depends on the last token alone (attention's output zeroed): its
    greedy output is the iterates of one function, so Jacobi iteration's guesses become exact."""
    model = tiny_model(len(tok), seed=7, layers=2)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    return loaded(model, tok, name="tiny-bigram")


@pytest.mark.parametrize("wrong_column", [False, True])
def test_jacobi_window_fills_the_pool_with_ngrams_that_are_accepted(tok, monkeypatch, wrong_column):
    """On the bigram target the window's n-grams (no prompt n-grams: the pool is the window's alone)
    are the true continuations: 2.6 tokens commit per target forward. Each new guess placed one
    column off (a planted bug) leaves most of them wrong: 1.6 (the output is a short loop, where
    shifted guesses are sometimes right). Greedy and one fixed model: the same numbers each run."""
    import speclm.proposers.lookahead as lookahead

    bigram = _bigram_model(tok)
    engine = SpecEngine(bigram)
    prompt = "the quick brown fox"
    ref = engine.generate(prompt, method="none", max_new_tokens=120)
    if wrong_column:
        real = lookahead.LookaheadProposer.accept

        def accept(self, verified):
            real(self, verified)
            for row in self.rows:  # the newest level's guesses moved one column on
                if row.levels:
                    row.levels[-1] = row.levels[-1][-1:] + row.levels[-1][:-1]

        monkeypatch.setattr(lookahead.LookaheadProposer, "accept", accept)
    proposer = lookahead.LookaheadProposer(window=4, ngram=4, guesses=2, prompt_ngrams=False)
    engine.make_proposer = lambda opts: proposer
    out = engine.generate(prompt, method="lookahead", max_new_tokens=120)
    assert out.token_ids == ref.token_ids
    s = out.stats
    rounds = s.target_forwards - 1  # the prefill is no round
    if wrong_column:
        assert s.mean_accepted_tokens < 1.9, s.mean_accepted_tokens  # measured: 1.64
    else:
        assert s.pool_hits > rounds // 2 and s.mean_accepted_tokens > 2.3, (s.pool_hits, rounds, s.mean_accepted_tokens)  # 2.61
        # every committed token past one per forward came from a pooled n-gram or the window
        assert 0 < s.pool_tokens <= s.accepted_tokens, (s.pool_tokens, s.accepted_tokens)


def test_self_draft_reads_the_targets_cache_and_leaves_it_as_it_was(deep):
    """The draft writes only past the committed tokens and rolls them back: after a proposal the
    cache's lengths are as before, and a draft of every layer is the target's own greedy output."""
    engine = SpecEngine(deep)
    ref = engine.generate(PROMPTS[2], method="none", max_new_tokens=N)
    layers = tuple(range(4))
    from speclm.proposers.self_draft import SelfDraftProposer

    proposer = SelfDraftProposer(deep.model, Stack(layers), 4)
    engine.make_proposer = lambda opts: proposer
    seen = []
    real = proposer.propose

    def propose(contexts, max_tokens, params, generators):
        before = proposer.kv.lengths_list()
        draft = real(contexts, max_tokens, params, generators)
        seen.append(before == proposer.kv.lengths_list())
        return draft

    proposer.propose = propose
    out = engine.generate(PROMPTS[2], method="self", max_new_tokens=N, k=4)
    assert out.token_ids == ref.token_ids and all(seen) and seen
    assert out.stats.acceptance_rate == 1.0  # all layers: the target's own tokens (fp32 near-ties aside)


def test_self_tree_branches_on_the_targets_cache_and_leaves_it_as_it_was(deep):
    """--tree on self: each round's draft is a tree grown through the drafting layers (nodes with
    two children, as deep as the shape says), written past the committed tokens and rolled back;
    the output is plain decoding's. On every layer of the target's own weights the target accepts
    the draft's first choice at each level (fp32 near-ties aside), so every round takes the tree's
    whole depth."""
    from speclm.proposers.draft_tree import TreeSpec
    from speclm.proposers.self_draft import SelfDraftProposer

    engine = SpecEngine(deep)
    ref = engine.generate(PROMPTS[2], method="none", max_new_tokens=N)
    spec = TreeSpec(depth=3, branch=2, expand=2, min_prob=0.0)  # no cost line: the whole shape, 2 + 4 + 4 nodes
    proposer = SelfDraftProposer(deep.model, Stack(tuple(range(4))), 2, tree=spec)
    assert (proposer.k, proposer.max_nodes, proposer.shape) == (3, 10, "tree")
    engine.make_proposer = lambda opts: proposer
    drafts, kept = [], []
    real = proposer.propose

    def propose(contexts, max_tokens, params, generators):
        before = proposer.kv.lengths_list()
        draft = real(contexts, max_tokens, params, generators)
        kept.append(before == proposer.kv.lengths_list())
        drafts.append(draft)
        return draft

    proposer.propose = propose
    out = engine.generate(PROMPTS[2], method="self", max_new_tokens=N, tree="auto")
    assert out.token_ids == ref.token_ids and all(kept) and drafts
    full = [d for d in drafts if int(d.lengths[0]) == 10]
    assert full, [int(d.lengths[0]) for d in drafts]
    tree = full[0].tree()
    children = [int((full[0].parents[0] == n).sum()) for n in range(10)]
    assert max(children) == 2 and tree.max_depths()[0] == 3, (full[0].parents, children)
    assert out.stats.accepted_tokens >= 3 * (out.stats.target_forwards - 2)  # each round but the prefill and the last: 3


def test_self_restricted_head_scores_the_lowest_ids_and_the_prompts(deep):
    """--draft-vocab on self: the drafting head scores the 64 lowest ids and the prompt's tokens,
    not the whole vocabulary; the output is plain decoding's."""
    engine = SpecEngine(deep)
    ref = engine.generate(PROMPTS[2], method="none", max_new_tokens=N)
    real, made = engine.make_proposer, []
    engine.make_proposer = lambda opts: made.append(real(opts)) or made[-1]
    out = engine.generate(PROMPTS[2], method="self", max_new_tokens=N, layers="2", self_weights="target",
                          draft_vocab=64)
    assert out.token_ids == ref.token_ids
    head = made[0].vocabs.head
    ids = set(head.ids.tolist())
    prompt = deep.tokenizer(PROMPTS[2]).input_ids
    assert set(range(64)) <= ids and set(prompt) <= ids and len(ids) < head.vocab_size
    assert any(t >= 64 for t in prompt)  # the prompt's own tokens are what widens it


@pytest.mark.parametrize("weights", ["fp32", "int8"])
def test_self_int4_copy_drafts_apart_from_the_target_and_reports_its_size(deep, deep8, weights, capsys):
    """--self-weights int4: the drafting layers and the head run on an int4 copy made once per
    engine (its size on stderr); the target's own weights are untouched and its output is plain
    decoding's. The copy drafts differently from the layers it copies: on every layer the
    target's own weights draft the target's tokens (acceptance 1), the copy's rounding does not."""
    require_compiled_kernels()
    model = deep if weights == "fp32" else deep8
    before = {name: t.clone() for name, t in model.model.state_dict().items()}
    engine = SpecEngine(model)
    ref = engine.generate(PROMPTS[2], method="none", max_new_tokens=N)
    outs = [engine.generate(p, method="self", max_new_tokens=N, layers="skip:0", self_weights="int4", k=4)
            for p in PROMPTS]
    assert outs[2].token_ids == ref.token_ids
    err = capsys.readouterr().err
    assert err.count("int4 copy of 3 layers and the head") == 1, err  # made once, for the engine's life
    assert all(torch.equal(before[name], t) for name, t in model.model.state_dict().items())

    stack, head = engine.self_stack(GenerationOptions(method="self", layers="skip:0", self_weights="int4"))
    assert isinstance(stack, Stack) and stack.indices == (1, 2, 3) and set(stack.copies) == {1, 2, 3} and head
    # every layer on the copy: not the target's own tokens every time (its own layers would be)
    from speclm.proposers.self_draft import SelfDraftProposer
    from speclm.forward.lean import int4_stack

    all_layers, all_head, size = int4_stack(model.model, (0, 1, 2, 3))
    assert size > 0
    if weights == "fp32":  # the copy computes what the model quantized to int4 whole computes, bit for bit
        from speclm.forward.cache import StaticKV

        whole = quantize_model(copy.deepcopy(model.model), "int4")
        ids = [[70]]  # one token: both forwards attend alike (an fp32 model's prefill of more takes SDPA)
        got = StaticKV(model.model, 1, 64).forward(ids, 1, layers=all_layers, head=all_head.rows)
        assert torch.equal(got, StaticKV(whole, 1, 64).forward(ids, 1))
    proposer = SelfDraftProposer(model.model, all_layers, 4, head=all_head)
    engine.make_proposer = lambda opts: proposer
    out = engine.generate(PROMPTS[2], method="self", max_new_tokens=N, k=4)
    assert out.token_ids == ref.token_ids and out.stats.acceptance_rate < 1.0, out.stats.acceptance_rate


def test_layers_and_lookahead_options_are_checked():
    assert parse_layers("auto").kind == "auto"
    assert layers_of(parse_layers("2"), 4) == (0, 1)
    assert layers_of(parse_layers("skip:1,3"), 4) == (0, 2)
    assert layers_of(parse_layers("skip:1-2+3"), 5) == (0, 4)
    for bad in ("0", "skip:", "skip:a", "first", "skip:2-x"):
        with pytest.raises(UsageError):
            parse_layers(bad)
    for bad, count in (("4", 4), ("skip:0-3", 4), ("skip:9", 4)):
        with pytest.raises(UsageError):
            layers_of(parse_layers(bad), count)
    assert all(0 < len(kept) < 28 for kept in candidates(28).values()) and len(candidates(28)) == 4
    assert candidates(28, "int4")["every layer"] == tuple(range(28)) and len(candidates(28, "int4")) == 5
    assert layers_of(parse_layers("all"), 4) == (0, 1, 2, 3)
    with pytest.raises(UsageError, match="int4"):  # every layer of the target's own weights: the target itself
        GenerationOptions(method="self", layers="all", self_weights="target")
    assert GenerationOptions(method="self", layers="all", self_weights="int4").layers == "all"
    assert GenerationOptions(method="self", layers="all").self_draft_weights == "int4"  # the default
    with pytest.raises(UsageError, match="lookahead"):
        GenerationOptions(method="pld", lookahead=(2, 3, 1))
    with pytest.raises(UsageError, match="layers"):
        GenerationOptions(method="lookahead", layers="2")
    for shape in ((0, 3, 1), (2, 1, 1), (2, 3, -1), (2, 3)):
        with pytest.raises(UsageError):
            GenerationOptions(method="lookahead", lookahead=shape)
    assert GenerationOptions(method="lookahead", lookahead=[2, 3, 1]).lookahead == (2, 3, 1)
    assert GenerationOptions(method="lookahead", lookahead=(5, 3, 1)).draft_length("int8") == 5


def test_self_needs_the_lean_forward(tok):
    from transformers import GPT2Config, GPT2LMHeadModel

    other = loaded(GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=2)).eval(), tok,
                   name="gpt2-tiny")
    with pytest.raises(UsageError, match="lean forward"):
        SpecEngine(other).generate("abc", method="self", layers="1", max_new_tokens=4)


def test_self_calibration_times_decoding_not_the_int4_copy(deep, monkeypatch):
    """--layers auto with --self-weights int4: each candidate's copy is made before its timed
    runs (a copy made inside them once decided the calibration by how fast it was made)."""
    require_compiled_kernels()
    import speclm.forward.lean as lean
    from speclm.proposers.self_draft import calibrate

    engine = SpecEngine(deep)
    timing, built_while_timed, built = [False], [], []
    real_stack, real_generate = lean.int4_stack, engine.generate

    def int4_stack(model, indices, progress=lambda: None):
        built.append(indices)
        built_while_timed.append(timing[0])
        return real_stack(model, indices, progress)

    def generate(*args, **kwargs):
        timing[0] = True
        try:
            return real_generate(*args, **kwargs)
        finally:
            timing[0] = False

    monkeypatch.setattr(lean, "int4_stack", int4_stack)
    monkeypatch.setattr(engine, "generate", generate)
    layers, report = calibrate(engine, candidates(4, "int4"), "int4")
    assert len(built) == len(set(candidates(4, "int4").values())) and not any(built_while_timed), built_while_timed
    assert layers in candidates(4, "int4").values() and set(report) == {"none", *candidates(4, "int4")}


def test_self_calibration_is_cached_per_candidate_set(deep, monkeypatch, tmp_path):
    """auto's choice is measured once per model, machine and drafting weights; a saved choice made
    over other candidates (an older speclm's) is measured again."""
    import speclm.proposers.self_draft as self_draft

    monkeypatch.setenv("SPECLM_HOME", str(tmp_path))
    calls = []

    def calibrate(engine, options, weights="target"):
        calls.append((weights, tuple(options)))
        return next(iter(options.values())), {"none": 1.0, **{name: 1.0 for name in options}}

    monkeypatch.setattr(self_draft, "calibrate", calibrate)
    engine = SpecEngine(deep)
    auto = parse_layers("auto")
    first = self_draft.resolve_layers(auto, engine)
    assert self_draft.resolve_layers(auto, engine) == first and len(calls) == 1  # read back
    self_draft.resolve_layers(auto, engine, "int4")
    assert len(calls) == 2 and "every layer" in calls[1][1]  # its own calibration, every layer a candidate
    path = next(p for p in (tmp_path / "self-layers").iterdir() if "int4" not in p.name)
    saved = json.loads(path.read_text())
    saved["measured"] = {"none": 1.0, "first 2": 1.0}
    path.write_text(json.dumps(saved))
    self_draft.resolve_layers(auto, engine)
    assert len(calls) == 3
