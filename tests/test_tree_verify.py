"""The tree verifier (speclm.round.verify.verify_tree) is lossless for trees of several shapes.

A synthetic target and draft over a 4-token vocabulary: each is a fixed distribution for every
prefix (softmax of seeded random logits), so the exact distribution of the first L = 3 committed
tokens is the product of the target's conditionals, computed, never sampled. Each request decodes
round by round: the draft grows a tree of the case's shape from the committed tokens (children of
a node drawn from the draft's distribution after that node's path, with or without replacement,
or a one-hot draft's distinct top tokens), the target's logits are those after the root and after
every node's path, and verify_tree commits a path plus one token. SAMPLES requests per case are
compared with the exact distribution by a chi-square test (chisq.py: each check fails a correct
verifier with probability about ALPHA = 1e-4; this file's 6 checks, by the union bound, with
probability at most 6e-4 nominally).

Greedy: the longest root path of argmax tokens is committed, with the argmax after it.

The check has power: each mutation below breaks the verifier in one way and must fail the very
check its case passes (same seeds and sample count):
  no_residual_between_siblings  a rejected sibling leaves the target's distribution as it was;
  parent_q_without_replacement  siblings drawn without replacement verified against the parent's
                                distribution instead of the one each was drawn from;
  bonus_from_the_parent         after a path that ends at a leaf, the bonus drawn from the
                                distribution after the leaf's parent.
Measured locally over 5 disjoint batches of request seeds (base + i, base = j * 10**6, j = 0..4):
each mutation failed its check 5 times out of 5 (largest p-value 2.1e-18), and the real
verifier passed all 6 checks 5 times out of 5 (smallest p-value 0.077).
"""

import itertools
import zlib
from functools import lru_cache

import numpy as np
import pytest
import torch

import speclm.round.verify as verify_mod
from chisq import ALPHA, chisq_pvalue
from speclm.sampling import SamplingParams
from speclm.tree import PAD, ROOT, DraftTree

V = 4
L = 3  # committed tokens counted per request
SAMPLES = 3000
PARAMS = SamplingParams(temperature=1.0)


@lru_cache(maxsize=None)
def _logits(kind: str, prefix: tuple[int, ...]) -> torch.Tensor:
    """(V,): the target's ("p") or the draft's ("q") logits after `prefix`, fixed per prefix."""
    seed = zlib.crc32(repr((kind, prefix)).encode())
    g = torch.Generator().manual_seed(seed)
    scale = 1.5 if kind == "p" else 1.0
    return torch.randn(V, generator=g) * scale


def _q(prefix) -> torch.Tensor:
    return _logits("q", tuple(prefix)).softmax(-1)


# A shape: for each node, its parent (ROOT or an earlier node); siblings in node order.
SHAPES = {
    "chain": [ROOT, 0, 1],
    "wide": [ROOT, ROOT, ROOT],
    "two_by_two": [ROOT, ROOT, 0, 0, 1, 1],
    "uneven": [ROOT, 0, 0, ROOT, 3, 4],
}


def grow(shape: list[int], context: list[int], mode: str, g: torch.Generator) -> DraftTree:
    """One row's tree after `context`. mode: "with" (siblings i.i.d. from the parent's q),
    "without" (each sibling from q without the earlier siblings' tokens, renormalised, and
    carrying that distribution), "one_hot" (siblings: q's top tokens in order, no probabilities)."""
    n = len(shape)
    tokens, probs, paths = [0] * n, torch.zeros(n, V), {ROOT: []}
    taken: dict[int, list[int]] = {}
    for i, parent in enumerate(shape):
        q = _q(context + paths[parent])
        earlier = taken.setdefault(parent, [])
        if mode == "with":
            dist = q
        else:
            dist = q.clone()
            dist[earlier] = 0.0
            dist = dist / dist.sum()
        if mode == "one_hot":
            t = int(dist.argmax())
        else:
            t = int(torch.multinomial(dist, 1, generator=g))
        tokens[i], probs[i] = t, dist
        earlier.append(t)
        paths[i] = paths[parent] + [t]
    tree = DraftTree(torch.tensor([tokens]), torch.tensor([shape]), None if mode == "one_hot" else probs[None])
    tree.paths = paths  # for the target's logits
    return tree


def target_logits(tree: DraftTree, context: list[int]) -> torch.Tensor:
    n = tree.tokens.shape[1]
    return torch.stack([_logits("p", tuple(context + tree.paths[node])) for node in [ROOT, *range(n)]])[None]


def decode(shape, mode: str, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    context: list[int] = []
    while len(context) < L:
        tree = grow(shape, context, mode, g)
        verdict = verify_mod.verify_tree(target_logits(tree, context), tree, PARAMS, [g])
        context += verdict.committed(0)
    return context[:L]


def exact() -> np.ndarray:
    out = np.zeros((V,) * L)
    for seq in itertools.product(range(V), repeat=L):
        out[seq] = np.prod([float(_logits("p", seq[:i]).softmax(-1)[seq[i]]) for i in range(L)])
    return out


CASES = {
    "chain, with replacement": ("chain", "with"),
    "wide, with replacement": ("wide", "with"),
    "two by two, without replacement": ("two_by_two", "without"),
    "uneven, without replacement": ("uneven", "without"),
    "wide, without replacement": ("wide", "without"),
    "wide, one-hot": ("wide", "one_hot"),
}


def pvalue(case: str, base: int = 0) -> float:
    shape, mode = CASES[case]
    counts = np.zeros((V,) * L)
    for i in range(SAMPLES):
        counts[tuple(decode(SHAPES[shape], mode, base + i))] += 1
    return chisq_pvalue(counts, exact())


@pytest.mark.parametrize("case", list(CASES))
def test_committed_tokens_follow_the_target(case):
    assert pvalue(case) > ALPHA


# ---------------------------------------------------------------- mutations: the check has power

def no_residual_between_siblings(monkeypatch):
    monkeypatch.setattr(verify_mod, "_residual", lambda dist, q: dist)


def parent_q_without_replacement(monkeypatch):
    real = verify_mod.verify_tree

    def verify_tree(logits, tree, params, generators):
        probs = tree.probs.clone()
        for n, parent in enumerate(tree.parents[0].tolist()):
            probs[0, n] = _q(tree.context + tree.paths[parent])  # the parent's q, earlier siblings not removed
        return real(logits, DraftTree(tree.tokens, tree.parents, probs), params, generators)

    monkeypatch.setattr(verify_mod, "verify_tree", verify_tree)
    real_grow = grow

    def with_context(shape, context, mode, g):
        tree = real_grow(shape, context, mode, g)
        tree.context = list(context)
        return tree

    monkeypatch.setitem(globals(), "grow", with_context)


def bonus_from_the_parent(monkeypatch):
    real = verify_mod.verify_tree

    def verify_tree(logits, tree, params, generators):
        verdict = real(logits, tree, params, generators)
        children = tree.children(0)
        path = verdict.paths[0]
        if path and path[-1] not in children:  # ended at a leaf: the token after it is a bonus
            parent = int(tree.parents[0, path[-1]])
            probs = logits[0, 1 + parent].softmax(-1)
            verdict.tokens[0, len(path)] = int(torch.multinomial(probs, 1, generator=generators[0]))
        return verdict

    monkeypatch.setattr(verify_mod, "verify_tree", verify_tree)


MUTATIONS = {
    "no_residual_between_siblings": (no_residual_between_siblings, "wide, with replacement"),
    "parent_q_without_replacement": (parent_q_without_replacement, "wide, without replacement"),
    "bonus_from_the_parent": (bonus_from_the_parent, "uneven, without replacement"),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_mutation_is_caught(monkeypatch, mutation):
    breaks, case = MUTATIONS[mutation]
    breaks(monkeypatch)
    assert pvalue(case) < ALPHA


# ---------------------------------------------------------------- greedy, and the shapes

def test_greedy_commits_the_longest_argmax_path():
    # root's argmax 2; node 1 (token 2) is the second child of the root; its argmax 3 is node 3's token
    tree = DraftTree(torch.tensor([[1, 2, 0, 3, 3]]), torch.tensor([[ROOT, ROOT, 0, 1, 1]]), None)
    logits = torch.full((1, 6, V), -5.0)
    for index, best in enumerate([2, 0, 3, 0, 1, 0]):  # the root's, then nodes 0..4's
        logits[0, index, best] = 5.0
    verdict = verify_mod.verify_tree(logits, tree, SamplingParams(), [None])
    assert verdict.paths == [[1, 3]]  # node 4 has token 3 too, but node 3 comes first
    assert verdict.committed(0) == [2, 3, 1]  # then the argmax after node 3


def test_padding_nodes_are_never_children_and_the_chain_helper():
    tree = DraftTree.chain(torch.tensor([[5, 6, 7], [8, 9, 0]]), torch.tensor([3, 1]))
    assert tree.parents.tolist() == [[ROOT, 0, 1], [ROOT, PAD, PAD]]
    assert tree.sizes == [3, 1] and tree.depths().tolist() == [[0, 1, 2], [0, -1, -1]]
    assert tree.children(1) == {ROOT: [0]}
    tree.check()
    with pytest.raises(ValueError):
        DraftTree(tree.tokens, torch.tensor([[ROOT, 2, 0], [ROOT, PAD, PAD]]), None).check()


def test_lineage_walks_to_the_root_and_stops_where_told():
    from speclm.tree import lineage

    parents = [ROOT, 0, 0, 2, ROOT]  # 0 -> 1, 0 -> 2 -> 3; 4 alone
    assert lineage(3, parents.__getitem__) == ([0, 2, 3], ROOT)
    assert lineage(4, parents.__getitem__) == ([4], ROOT)
    assert lineage(ROOT, parents.__getitem__) == ([], ROOT)
    # slots as the KV cache links them: each slot's parent is the one before unless linked; stop below 10
    links = {12: 10, 13: 11}
    assert lineage(13, lambda s: links.get(s, s - 1), lambda s: s >= 10) == ([10, 11, 13], 9)
    assert lineage(12, lambda s: links.get(s, s - 1), lambda s: s >= 10) == ([10, 12], 9)
