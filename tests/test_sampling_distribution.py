"""Speculative sampling follows the target's exact distribution.

On a tiny model with a 6-token vocabulary, every request drafts K = 2 tokens per round and
generates DEPTH = K + 2 tokens: the first round prefills the prompt and samples token 1 as
plain decoding does; the second drafts K tokens (fewer where a confidence stop or a lookup
miss ends a draft early), so tokens 2 .. K + 2 hold every draft position, the recovered token
of a rejection at any of them, and the bonus token of a draft accepted whole (later rounds
fill the window where a draft was rejected; each check also asserts that some rows' first
drafting round was accepted whole, its bonus counted). The exact joint distribution of these
DEPTH tokens (V ** DEPTH = 1296 cells) is computed from the target's processed probabilities
alone, never from samples: one batched forward over the V ** (DEPTH - 1) prefixes. SAMPLES independent
requests, one row each with its own generator, are decoded as one batch per case (`draft`,
`pld`, `draft+pld`, confidence stops, alternatives, draft trees: static, static past top-k,
auto, and auto under draft+pld; a tree two deep fills the same window; trained heads' trees:
medusa grown and static, eagle (reading the final feature, and fused with a lower layer's), eagle+pld's and lookahead+pld's rows of lookup chains beside rows of the other's trees, lookahead, self (chains, a tree, a restricted head),
with untrained random heads; auto with a random plan: each row's child and draft length drawn
each round; seeded requests, which draw each token by position: plain, draft+pld and auto) and
their counts compared with the
exact joint by a chi-square test (chisq.py: each check fails a correct sampler with probability
about ALPHA = 1e-4; this file's 33 checks, by the union bound, with probability at most 3.3e-3
nominally, 6.6e-3 with the chi-square approximation's error as measured there). An auto tree
sized from cost lines (its nodes' children counts chosen from their distributions) is one of them.

The check has power: each mutation below breaks the verifier or a proposer in one way and must
fail the very check (same case, seed and sample count) the real code passes:
  bonus_from_previous_position  the bonus drawn from the last draft position's distribution;
  no_residual                   after a rejection, the token drawn from the target, not the residual;
  residual_not_normalised       the residual max(0, p - q) sampled by inverse CDF as if it summed
                                to 1 (a uniform draw past its total falls on the last id);
  draft_samples_sharper         the draft samples from q^2 (renormalised) but reports q;
  lookup_rows_as_model_rows     draft+pld's lookup rows verified against the draft model's q;
  siblings_report_first_draw    a tree's siblings drawn without replacement, each reporting the
                                parent's whole distribution (as if drawn with replacement);
  tree_bonus_from_previous_position  the first mutation, on a static tree;
  heads_claim_uniform_draws     a head's tree (nodes chosen by rank) reported as uniform draws
                                over the vocabulary instead of point masses;
  lookup_rows_claim_uniform_draws  eagle+pld (and lookahead+pld): the rows lookup drafts reported
                                as uniform draws instead of point masses;
  lookahead_claims_uniform_draws  lookahead's nodes (window guesses, pooled n-grams) reported as
                                uniform draws instead of point masses;
  self_samples_sharper          self-speculation's draft samples from q^2 but reports q (on the
                                target's layers, and on their int4 copy);
  auto_rows_claim_uniform_draws  auto: a round whose rows several children drafted reported as
                                uniform draws (a point mass verified as one is exact whatever
                                drew it, so uniform is the claim that must fail);
  coupled_draws_ignore_position  a seeded request's exponential variables the same at every
                                position (its tokens then depend on one another).
Measured locally over 5 disjoint batches (seeds 11 + i * 10**6, i = 0..4: no request's generator
seed shared between them): every mutation failed its check 5 times out of 5, with p-values
between 0 and 5e-78 (ALPHA = 1e-4), and the real code passed all 11 checks 5 times out of 5
(55 of 55, smallest p-value 0.008). The tree cases and mutations, measured the same way: the 4
tree checks passed 20 of 20 (smallest p-value 0.18), the two tree mutations failed 10 of 10
(largest p-value 9.4e-77). eagle+pld, the same way: its check passed 5 of 5 (smallest p-value
0.16; about 1 row in 6 drafted by a chain in each drafting round), its mutation failed 5 of 5
(every p-value 0 to double precision). lookahead and self (cases lookahead, lookahead-top, self,
self-top), the same way: 20 of 20 passed (smallest p-value 3.2e-4), their two mutations failed 10
of 10 (largest p-value 8.7e-138). lookahead+pld (lookup's chains beside lookahead's trees), the same
way: 5 of 5 passed (smallest p-value 0.011), lookup's rows claiming uniform draws failed 5 of 5
(largest p-value 1.0e-46). self-int4 (self on an int4 copy of its layer and the head), the same
way: 5 of 5 passed (smallest p-value 0.23), sharper samples failed 5 of 5 (largest p-value 2.8e-132).
self-tree (self's auto tree) and self-vocab (its head over the prompt's tokens), the same way: 10 of
10 passed (smallest p-value 0.128); siblings reporting the first draw on self's tree failed 5 of 5
(largest p-value 1.6e-12). auto (draft+pld, eagle+pld and pld rows, of every length, and rows not
drafting, in one round), the same way: 5 of 5 passed (smallest p-value 0.171), uniform claims failed
5 of 5 (every p-value 0 to double precision). The seeded cases (coupled-plain, coupled-draft+pld,
coupled-auto), the same way: 15 of 15 passed (smallest p-value 0.131; coupled-auto's p-values are
coupled-plain's, its outputs being plain decoding's), variables ignoring the position failed 5 of 5
(every p-value 0 to double precision).
"""

import json
import os
import tempfile
from unittest import mock

import numpy as np
import pytest
import torch

import speclm.round.verify as verify_mod
from chisq import ALPHA, MIN_EXPECTED, chisq_pvalue, joint, pool
from speclm import SpecEngine
from speclm.sampling import SamplingParams, processed_probs
from tiny import loaded, random_heads, random_plan, tiny_model, word_tokenizer

V = 6
K = 2  # tokens drafted per round
DEPTH = K + 2  # tokens counted: the prefill round's, then the first drafting round's K + 1
SAMPLES = 6000
SEED = 11
PROMPT = "w1 w2 w3 w1 w2 w3 w4 w1 w2"  # repeats, so prompt lookup proposes from the first drafting round


@pytest.fixture(scope="module")
def small():
    tok = word_tokenizer(V)
    target = loaded(tiny_model(V, seed=3, init=0.15), tok, name="t", eos=False)
    draft = loaded(tiny_model(V, seed=4, layers=1, init=0.15), tok, name="d", eos=False)
    for kind, path in HEADS.items():  # untrained heads: their trees vary with the context
        random_heads(kind, target.model, path, seed=5, std=0.5)
    random_heads("eagle", target.model, EAGLE_FUSED, seed=6, std=0.5, fuse_layers=(0,))
    return tok, target, draft


def exact_joint(target, prompt_ids, params, depth: int = DEPTH) -> np.ndarray:
    """P(first `depth` tokens) under the target's processed distribution, shape (V,) * depth
    (tests/chisq.py's joint over every prefix)."""
    return joint(target.model, prompt_ids, params, [range(target.model.config.vocab_size)] * depth)


def decode(engine, prompt_ids, method, params, depth: int = DEPTH, k: int = K, samples: int = SAMPLES,
           seed: int = SEED, coupled: bool = False, **options):
    """`samples` requests for `depth` tokens, decoded as one batch drafting `k` tokens a round.
    coupled: the requests set their seed, so each draws by position (speclm.sampling.Coupled);
    else they set none and are verified by rejection sampling, their generators seeded seed + i
    all the same (the engine's random seed fixed here, so that a run repeats)."""
    run = lambda given: engine.generate(  # noqa: E731
        [prompt_ids] * samples, method=method, k=k, max_new_tokens=depth, seed=given,
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, **options,
    )
    if coupled:
        return run(seed)
    with mock.patch("speclm.engine.secrets.randbits", lambda bits: seed):
        return run(None)


def counted(outs, vocab: int, depth: int = DEPTH) -> np.ndarray:
    counts = np.zeros((vocab,) * depth)
    for o in outs:
        counts[tuple(o.token_ids[:depth])] += 1
    return counts


def sampled_counts(engine, prompt_ids, method, params, depth: int = DEPTH, **options) -> np.ndarray:
    """Counts of the first `depth` tokens (decode's options; max_new_tokens = depth, k + 2 by
    default: the prefill round's token and the whole first drafting round)."""
    outs = decode(engine, prompt_ids, method, params, depth=depth, **options)
    return counted(outs, engine.target.model.config.vocab_size, depth)


def pvalue(small, method, params, options, seed: int = SEED) -> float:
    """The check: this case's counts against the exact joint."""
    tok, target, draft = small
    prompt_ids = tok(PROMPT).input_ids
    engine = SpecEngine(target, draft=draft if method != "none" else None)
    if method == "auto":  # every row's child and draft length drawn at random each round: mixed rounds
        random_plan(engine, seed)
    outs = decode(engine, prompt_ids, method, params, seed=seed, **options)
    if method != "none":  # the window holds whole drafting rounds: in some rows (pld: 0.7%) the first
        # one drafted K tokens, all accepted, and its bonus token is counted (DEPTH tokens, 2 forwards)
        assert sum(o.stats.target_forwards == 2 and len(o.token_ids) == DEPTH for o in outs) > SAMPLES // 1000
    return chisq_pvalue(counted(outs, V), exact_joint(target, prompt_ids, params))


T1 = SamplingParams(temperature=1.0)
# a static tree two deep (Medusa's "choices"): three candidates for the next token, then two after
# the first, one after the second; ranks are draws without replacement
_TREE_DIR = tempfile.mkdtemp(prefix="speclm-tree-")
STATIC_TREE = os.path.join(_TREE_DIR, "tree.json")
WIDE_TREE = os.path.join(_TREE_DIR, "wide.json")
for path, choices in ((STATIC_TREE, [[0], [1], [2], [0, 0], [0, 1], [1, 0]]),
                      (WIDE_TREE, [[0], [1], [2], [3], [4], [0, 0], [1, 0], [0, 1]])):
    with open(path, "w") as f:
        json.dump(choices, f)
HEADS = {kind: os.path.join(_TREE_DIR, f"{kind}.safetensors") for kind in ("medusa", "eagle")}
EAGLE_FUSED = os.path.join(_TREE_DIR, "eagle-fused.safetensors")  # reading layer 0's states too (EAGLE-3's input)
CASES = {
    "plain": ("none", T1, {}),
    "draft": ("draft", T1, {}),
    "draft-top": ("draft", SamplingParams(temperature=0.7, top_k=4, top_p=0.9), {}),
    # rows stop drafting where the draft is unsure: drafts of 1 and 2 tokens in one batch
    "draft-confidence": ("draft", T1, {"confidence": 0.35}),
    "pld": ("pld", T1, {}),
    "pld-top": ("pld", SamplingParams(temperature=1.3, top_p=0.8), {}),
    # rows drafted by lookup and rows drafted by the model in one batch (the contexts differ
    # after the first token; a 2-gram recurs in some of them)
    "draft+pld": ("draft+pld", T1, {}),
    "draft+pld-top": ("draft+pld", SamplingParams(temperature=0.8, top_k=5), {"ngram_min": 3, "confidence": 0.35}),
    # alternatives: every drafted token gets a second, independent draw verified beside it
    "alternatives": ("draft", T1, {"alternatives": 1.0}),
    "alternatives-some": ("draft", SamplingParams(temperature=0.8, top_k=5), {"alternatives": 0.6, "confidence": 0.35}),
    "draft+pld-alternatives": ("draft+pld", T1, {"alternatives": 1.0}),
    # trees: a node's children are draws without replacement from its distribution
    "tree-static": ("draft", T1, {"tree": STATIC_TREE}),
    # five ranks at the root, past top-k's four tokens
    "tree-static-top": ("draft", SamplingParams(temperature=0.7, top_k=4, top_p=0.9), {"tree": WIDE_TREE}),
    "tree-auto": ("draft", T1, {"tree": "auto"}),
    "draft+pld-tree": ("draft+pld", T1, {"tree": "auto"}),
    # trained heads' trees: deterministic top-ranked candidates, verified as point masses
    "medusa": ("medusa", T1, {"heads": HEADS["medusa"]}),
    "medusa-static-top": ("medusa", SamplingParams(temperature=0.7, top_k=4, top_p=0.9),
                          {"heads": HEADS["medusa"], "tree": WIDE_TREE}),
    "eagle": ("eagle", T1, {"heads": HEADS["eagle"]}),
    "eagle-fused": ("eagle", T1, {"heads": EAGLE_FUSED}),
    # rows drafted by lookup's chain (their first token w3: "w2 w3" recurs) and rows drafted by
    # eagle's tree in one batch
    "eagle+pld": ("eagle+pld", T1, {"heads": HEADS["eagle"]}),
    # lookahead: the window's trajectories and the pool's n-grams, one-hot siblings in one tree
    "lookahead": ("lookahead", T1, {"lookahead": (2, 3, 2)}),
    "lookahead-top": ("lookahead", SamplingParams(temperature=0.7, top_k=4, top_p=0.9), {"lookahead": (3, 2, 3)}),
    # rows drafted by lookup's chain beside rows drafted by lookahead's tree in one batch
    "lookahead+pld": ("lookahead+pld", T1, {"lookahead": (2, 3, 2)}),
    # self: the target's first layer drafts, sampled from its own distribution
    "self": ("self", T1, {"layers": "1", "self_weights": "target"}),
    "self-top": ("self", SamplingParams(temperature=0.8, top_k=5), {"layers": "skip:0", "self_weights": "target"}),
    # self on an int4 copy of its layers and the head: the copy's distribution is what it reports
    "self-int4": ("self", T1, {"layers": "1", "self_weights": "int4"}),
    # self's tree: a node's children are draws without replacement from the drafting layers' distribution
    "self-tree": ("self", T1, {"layers": "1", "self_weights": "target", "tree": "auto"}),
    # self's head scoring the prompt's tokens alone (none of the lowest ids: a whole group of 64 is more than V)
    "self-vocab": ("self", SamplingParams(temperature=0.8, top_k=5), {"layers": "1", "self_weights": "target",
                                                                     "draft_vocab": 1}),
    # auto: in each round each row drafted by draft+pld, eagle+pld or pld, at any length, or not at all
    "auto": ("auto", T1, {"heads": HEADS["eagle"]}),
    # seeded requests: every token drawn by position (plain decoding's draws), whatever was drafted
    "coupled-plain": ("none", T1, {"coupled": True}),
    "coupled-draft+pld": ("draft+pld", SamplingParams(temperature=0.7, top_k=4, top_p=0.9), {"coupled": True}),
    "coupled-auto": ("auto", T1, {"heads": HEADS["eagle"], "coupled": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tokens_follow_target_distribution(small, case):
    assert pvalue(small, *CASES[case]) > ALPHA


def test_sized_auto_tree_follows_target_distribution(small, monkeypatch):
    """A sampled auto tree sized by cost lines under which each verified token costs 15% of a
    forward: its nodes get 1 to 4 children as their distributions say, and the tokens still
    follow the target's distribution (the tiny models' own measured lines are flat, so the
    `tree-auto` case draws every node's 4 children)."""
    import speclm.proposers.draft_tree as draft_tree
    from speclm.forward.costs import ForwardCosts

    monkeypatch.setattr(SpecEngine, "forward_costs", lambda self: ForwardCosts({1: 1.0, 64: 10.45}))
    monkeypatch.setattr(SpecEngine, "draft_costs", lambda self: ForwardCosts({1: 0.1, 64: 0.73}))
    seen = []
    real = draft_tree._sampled_counts

    def counts(*args):
        out = real(*args)
        seen.extend(out)
        return out

    monkeypatch.setattr(draft_tree, "_sampled_counts", counts)
    assert pvalue(small, "draft", T1, {"tree": "auto"}) > ALPHA
    assert {1, 2} <= set(seen) and max(seen) <= 4, sorted(set(seen))


# ---------------------------------------------------------------- mutations: the check has power

def _redraw_after_verify(monkeypatch, position):
    """Wrap the verifier: where position(accepted, drafted) names a position, a row's token after
    its accepted ones is drawn again from the target's processed distribution at that position."""
    real = verify_mod.verify_tree

    def verify(target_logits, tree, params, generators, acceptance="exact", coupled=None):
        verdict = real(target_logits, tree, params, generators, acceptance, coupled)
        probs = processed_probs(target_logits.cpu(), params)
        depths = tree.max_depths()
        for b, g in enumerate(generators):
            n = int(verdict.num_accepted[b])
            at = position(n, depths[b])
            if at is not None:
                verdict.tokens[b, n] = torch.multinomial(probs[b, at], 1, generator=g).item()
        return verdict

    monkeypatch.setattr("speclm.round.batch.verify_tree", verify)


def bonus_from_previous_position(monkeypatch):
    """Rows whose whole draft was accepted draw the bonus from the last draft position's
    distribution (an off-by-one) instead of the next position's."""
    _redraw_after_verify(monkeypatch, lambda n, drafted: n - 1 if n == drafted > 0 else None)


def no_residual(monkeypatch):
    """After a rejection the token is drawn from the target's distribution, not the residual."""
    _redraw_after_verify(monkeypatch, lambda n, drafted: n if n < drafted else None)


def residual_not_normalised(monkeypatch):
    """The residual max(0, p - q) sampled as if it summed to 1: inverse-CDF sampling walks its
    cumulative sum with a uniform draw and clamps to the last id, so the mass it lacks,
    1 - sum(max(0, p - q)), lands on the last id."""

    def residual(dist, q):
        left = (dist - q).clamp_min(0.0)
        left[-1] += 1.0 - left.sum()
        return left

    monkeypatch.setattr(verify_mod, "_residual", residual)


def draft_samples_sharper(monkeypatch):
    """The draft model samples from q^2 (renormalised: as at half the temperature) but reports q."""
    import speclm.proposers.draft_model as draft_model

    real = draft_model.sample

    def sample(probs, generator):
        return real(probs**2 / (probs**2).sum(), generator)

    monkeypatch.setattr(draft_model, "sample", sample)


def lookup_rows_as_model_rows(monkeypatch):
    """draft+pld: rows drafted by lookup must be verified as one-hot drafts; here they read the
    draft model's distribution instead (as if the model had drafted them)."""
    import speclm.proposers.draft_lookup as draft_lookup

    real = draft_lookup.mixed_draft

    def mixed(rows, by_lookup, model, params):
        return real(rows, [False] * len(rows), model, params)

    monkeypatch.setattr(draft_lookup, "mixed_draft", mixed)


def siblings_report_first_draw(monkeypatch):
    """A tree's siblings are drawn without replacement, but each reports the parent's whole
    distribution (as if drawn with replacement)."""
    import speclm.proposers.draft_tree as draft_tree

    real = draft_tree._children

    def children(*args, **kwargs):
        out = real(*args, **kwargs)
        return [(r, t, p, out[0][3]) for r, t, p, _ in out]

    monkeypatch.setattr(draft_tree, "_children", children)


def heads_claim_uniform_draws(monkeypatch):
    """A head's tree (chosen by rank, never drawn) reports its nodes as uniform draws over the
    vocabulary instead of point masses."""
    import speclm.proposers.eagle as eagle

    real = eagle.to_draft

    def to_draft(rows, chosen, forwards):
        draft = real(rows, chosen, forwards)
        draft.draft_probs = torch.full((*draft.tokens.shape, V), 1.0 / V)
        return draft

    monkeypatch.setattr(eagle, "to_draft", to_draft)


def lookup_rows_claim_uniform_draws(monkeypatch):
    """eagle+pld, lookahead+pld: rows drafted by lookup's chain report uniform draws over the vocabulary instead
    of point masses (the other rows stay point masses)."""
    import speclm.proposers.lookup_first as lookup_first

    real = lookup_first.mixed_draft

    def mixed(rows, by_lookup, model, params):
        draft = real(rows, by_lookup, model, params)
        probs = torch.nn.functional.one_hot(draft.tokens, V).float()  # (B, N, V)
        for b, hit in enumerate(by_lookup):
            if hit:
                probs[b] = 1.0 / V
        draft.draft_probs = probs
        return draft

    monkeypatch.setattr(lookup_first, "mixed_draft", mixed)


def lookahead_claims_uniform_draws(monkeypatch):
    """lookahead: its nodes (guesses and pooled n-grams, point masses) reported as uniform draws."""
    import speclm.proposers.lookahead as lookahead

    real = lookahead.LookaheadProposer.propose

    def propose(self, contexts, max_tokens, params, generators):
        draft = real(self, contexts, max_tokens, params, generators)
        draft.draft_probs = torch.full((*draft.tokens.shape, V), 1.0 / V)
        return draft

    monkeypatch.setattr(lookahead.LookaheadProposer, "propose", propose)


def auto_rows_claim_uniform_draws(monkeypatch):
    """auto: a round drafted by several children reported as uniform draws over the vocabulary
    (lookup's and the heads' point masses, and the draft model's distributions, all replaced)."""
    import speclm.proposers.auto as auto

    real = auto._merge

    def merge(drafts, owners, batch, greedy, forwards):
        out = real(drafts, owners, batch, greedy, forwards)
        if not greedy:
            out.draft_probs = torch.full((*out.tokens.shape, V), 1.0 / V)
        return out

    monkeypatch.setattr(auto, "_merge", merge)


def self_samples_sharper(monkeypatch):
    """self: the draft samples from q^2 (renormalised) but reports q."""
    import speclm.proposers.self_draft as self_draft

    real = self_draft.sample
    monkeypatch.setattr(self_draft, "sample", lambda probs, generator: real(probs**2 / (probs**2).sum(), generator))


def coupled_draws_ignore_position(monkeypatch):
    """A seeded request's variables made from its seed alone, the same at every position (its
    tokens then depend on one another)."""
    from speclm.sampling import Coupled

    real = Coupled.token
    monkeypatch.setattr(Coupled, "token", lambda self, probs, position, ids=None: real(self, probs, 0, ids))


MUTATIONS = {  # each with the case whose check it must fail
    "bonus_from_previous_position": (bonus_from_previous_position, "draft"),
    "no_residual": (no_residual, "pld"),
    "residual_not_normalised": (residual_not_normalised, "draft"),
    "draft_samples_sharper": (draft_samples_sharper, "draft"),
    "lookup_rows_as_model_rows": (lookup_rows_as_model_rows, "draft+pld"),
    "siblings_report_first_draw": (siblings_report_first_draw, "tree-auto"),
    "tree_bonus_from_previous_position": (bonus_from_previous_position, "tree-static"),
    "heads_claim_uniform_draws": (heads_claim_uniform_draws, "eagle"),
    "lookup_rows_claim_uniform_draws": (lookup_rows_claim_uniform_draws, "eagle+pld"),
    "lookahead_claims_uniform_draws": (lookahead_claims_uniform_draws, "lookahead"),
    "lookahead+pld_lookup_rows_claim_uniform_draws": (lookup_rows_claim_uniform_draws, "lookahead+pld"),
    "self_samples_sharper": (self_samples_sharper, "self"),
    "self_int4_samples_sharper": (self_samples_sharper, "self-int4"),
    "self_tree_siblings_report_first_draw": (siblings_report_first_draw, "self-tree"),
    "auto_rows_claim_uniform_draws": (auto_rows_claim_uniform_draws, "auto"),
    "coupled_draws_ignore_position": (coupled_draws_ignore_position, "coupled-plain"),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_mutation_is_caught(small, monkeypatch, mutation):
    """A broken verifier or proposer fails the check its case passes (measured failure rates:
    the module's docstring)."""
    breaks, case = MUTATIONS[mutation]
    breaks(monkeypatch)
    assert pvalue(small, *CASES[case]) < ALPHA


# ---------------------------------------------------------------- the check itself

def test_pooling_gives_every_cell_five_expected():
    expected = np.array([0.2, 0.3, 0.5, 1.0, 1.0, 2.0, 4.0, 4.5, 6.0, 30.0])
    groups = pool(expected)
    assert sorted(np.concatenate(groups).tolist()) == list(range(len(expected)))  # each cell once
    assert [sorted(g.tolist()) for g in groups] == [[0, 1, 2, 3, 4, 5], [6, 7], [8], [9]]
    # a remainder below 5 joins the last group: 1 + 1 + 1 + 1 + 1, then 1 + 1 left over
    assert [sorted(g.tolist()) for g in pool(np.ones(7))] == [list(range(7))]
    assert [g.tolist() for g in pool(np.array([6.0, 1.0, 1.0]))] == [[1, 2, 0]]
    assert [g.tolist() for g in pool(np.array([2.0]))] == [[0]]  # too few in all: one group
    rng = np.random.default_rng(0)
    for _ in range(200):
        e = rng.exponential(rng.uniform(0.1, 20), size=rng.integers(1, 60))
        groups = pool(e)
        assert sorted(np.concatenate(groups).tolist()) == list(range(len(e)))
        if e.sum() >= MIN_EXPECTED:
            assert min(e[g].sum() for g in groups) >= MIN_EXPECTED


def test_chisq_pvalue_edges():
    probs = np.array([0.5, 0.25, 0.25, 0.0])
    assert chisq_pvalue([500, 250, 250, 0], probs) == pytest.approx(1.0)
    assert chisq_pvalue([500, 250, 249, 1], probs) == 0.0  # a sample where the law puts none
    assert chisq_pvalue([600, 200, 200, 0], probs) < ALPHA
