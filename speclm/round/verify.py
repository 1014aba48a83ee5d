"""The one verifier: decides, for every proposer, which drafted tokens are committed.

A draft is a tree per row (speclm.tree.DraftTree: a chain is the tree whose node i has parent
i - 1; a chain with alternatives is a chain with extra leaves). Words used throughout:
- path: the nodes committed, from a child of the root down; each node on it is *accepted*;
- recovered: where the path stops at a node whose children were all rejected, the token drawn
  instead from what is left of the target's distribution there (the residual);
- bonus: where the path ends at a leaf, one more token drawn from the target's distribution
  after it (the target forward computed it anyway).
Each row commits its path's tokens plus exactly one recovered or bonus token.

Greedy: at each node (the root first) the first child whose token is the target's argmax there
is accepted; the recovered or bonus token is the argmax where the path stops.

Sampling (SpecInfer's multi-candidate rejection sampling, Miao et al. 2024; with siblings drawn
without replacement, recursive rejection sampling, Jeon et al. 2024): at a node with target
distribution p, its children are tried in order. Child c, drawn from q_c (its `probs`, or a
point mass on its token for one-hot drafts), is accepted with probability
min(1, p[c] / q_c[c]); if rejected, p becomes the residual normalise(max(0, p - q_c)) and the
next child is tried against it. Each try is an ordinary speculative step (Leviathan et al. 2023,
Chen et al. 2023) against the distribution the tries before it left, so the committed token
follows the target's processed distribution exactly, whatever the tree's shape. If every child
is rejected the recovered token is drawn from the last residual; an accepted child's own
children are tried next against the target's distribution after it.

Seeded sampling (a request that set a seed: speclm.sampling.Coupled): at each node the row takes
the token its draws for that position give from the target's processed distribution (an exact
draw from it) and accepts the child holding it, as greedy does the argmax; where none holds it,
that token is the recovered one. So it commits what plain decoding with its seed commits, token
for token, whatever was drafted (where the target's logits are the same bits in both: speclm's
quantized kernels; fp32 may differ at near-ties of the race, as greedy at near-ties).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speclm.proposers.base import Draft
from speclm.tree import PAD, ROOT, DraftTree
from speclm.sampling import Coupled, SamplingParams, processed_probs


@dataclass
class Verdict:
    num_accepted: torch.Tensor  # (B,) long: accepted nodes per row (the path's length)
    tokens: torch.Tensor  # (B, D+1) long: row b commits tokens[b, : num_accepted[b] + 1]
    paths: list[list[int]]  # per row, the accepted nodes from the root down
    # (B,) long, from `verify` on a chain with alternatives: the position j whose alternative was
    # accepted (then num_accepted = j + 1), else -1; None from `verify_tree`
    alternative: torch.Tensor | None = None

    def committed(self, row: int) -> list[int]:
        return self.tokens[row, : int(self.num_accepted[row]) + 1].tolist()


def verify(
    target_logits: torch.Tensor,
    draft: Draft,
    params: SamplingParams,
    generators: list[torch.Generator | None],
) -> Verdict:
    """verify_tree over the draft's tree (Draft.tree: a chain, its alternatives numbered after it),
    with `alternative` set and tokens (B, K+1) wide. target_logits (B, 1+N, V) as verify_tree's."""
    batch, width = draft.tokens.shape
    verdict = verify_tree(target_logits, draft.tree(), params, generators)
    if verdict.tokens.shape[1] < width + 1:  # (B, K+1): room for any row's whole chain and its bonus
        verdict.tokens = torch.cat([verdict.tokens, verdict.tokens.new_zeros(batch, width + 1 - verdict.tokens.shape[1])], 1)
    if draft.parents is None:  # an accepted alternative is the path's last node
        verdict.alternative = torch.tensor([len(p) - 1 if p and p[-1] >= width else -1 for p in verdict.paths],
                                           dtype=torch.long)
    return verdict


def verify_tree(
    target_logits: torch.Tensor,
    tree: DraftTree,
    params: SamplingParams,
    generators: list[torch.Generator | None],
    acceptance: str = "exact",
    coupled: list[tuple[Coupled, int] | None] | None = None,
) -> Verdict:
    """target_logits (B, 1+N, V): the root's logits at 0, node n's at 1 + n (speclm.tree). Each
    row draws from its own generator only, as its own tree asks: what a row commits does not
    depend on the other rows of the batch. acceptance "typical": Medusa's lossy rule
    (`typical_paths`) in place of rejection sampling when sampling. coupled: per row, a seeded
    request's draws and the position of the token after the root (its context's length), or None:
    such a row takes, at each node, the token its draws give there (speclm.sampling.Coupled), and
    the child holding it, as a greedy row does the argmax."""
    target_logits = target_logits.cpu()
    tokens = tree.tokens.tolist()
    paths, finals = [], []
    if acceptance == "typical" and not params.greedy:
        target_probs = processed_probs(target_logits, params)  # (B, 1+N, V)
        paths = typical_paths(target_probs, tree)
        for b, (g, path) in enumerate(zip(generators, paths)):
            at = 1 + path[-1] if path else 0
            finals.append(int(torch.multinomial(target_probs[b, at], 1, generator=g)))
        return _verdict(tokens, paths, finals)
    if params.greedy:
        argmax = target_logits.argmax(-1).tolist()  # (B, 1+N)
        for b in range(len(tokens)):
            path, final = _walk(tokens[b], tree.children(b), lambda node, depth: argmax[b][1 + node])
            paths.append(path)
            finals.append(final)
        return _verdict(tokens, paths, finals)

    target_probs = processed_probs(target_logits, params)  # (B, 1+N, V)
    probs = tree.probs.cpu() if tree.probs is not None else None
    for b, g in enumerate(generators):
        children, node, path = tree.children(b), ROOT, []
        if coupled is not None and coupled[b] is not None:  # the token its draws give, node by node
            draws, position = coupled[b]
            path, final = _walk(tokens[b], children,
                                lambda node, depth: draws.token(target_probs[b, 1 + node], position + depth))
            paths.append(path)
            finals.append(final)
            continue
        dist = target_probs[b, 0]
        while True:
            accepted = None
            for c in children.get(node, ()):
                t = tokens[b][c]
                q = probs[b, c] if probs is not None else _point_mass(dist, t)
                if float(torch.rand(1, generator=g)) * float(q[t]) < float(dist[t]):  # u < p/q without dividing
                    accepted = c
                    break
                dist = _residual(dist, q)
            if accepted is None:  # recovered (some child rejected) or bonus (a leaf)
                break
            node = accepted
            path.append(node)
            dist = target_probs[b, 1 + node]
        paths.append(path)
        finals.append(int(torch.multinomial(dist, 1, generator=g)))
    return _verdict(tokens, paths, finals)


def _walk(row_tokens: list[int], children: dict, want) -> tuple[list[int], int]:
    """A row whose token at each node is fixed (greedy: the argmax; seeded: its draw): from the root,
    the child holding want(node, depth) while there is one. Its accepted path and the final token."""
    node, path = ROOT, []
    while True:
        token = want(node, len(path))
        node = next((c for c in children.get(node, ()) if row_tokens[c] == token), None)
        if node is None:
            return path, token
        path.append(node)


TYPICAL_THRESHOLD = 0.09  # Medusa's posterior threshold (epsilon)
TYPICAL_ALPHA = 0.3  # Medusa's posterior alpha (delta)


def typical_paths(target_probs: torch.Tensor, tree: DraftTree, threshold: float = TYPICAL_THRESHOLD,
                  alpha: float = TYPICAL_ALPHA) -> list[list[int]]:
    """Medusa's typical acceptance, LOSSY: a node is acceptable where the target gives its token
    more than min(threshold, alpha * exp(-H)) at its parent (H: the entropy of the target's
    processed distribution there); each row's path is its longest root path of acceptable nodes
    (the first in node order among the longest). The committed text then no longer follows the
    target's distribution exactly (likely tokens gain mass); at temperature 0 it is greedy."""
    entropy = -(target_probs * target_probs.clamp_min(1e-30).log()).sum(-1)  # (B, 1+N)
    bar = torch.minimum(torch.full_like(entropy, threshold), alpha * torch.exp(-entropy))
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    paths = []
    for b in range(len(tokens)):
        best: list[int] = []
        deep: dict[int, list[int]] = {}  # node -> its accepted path, where every node on it is acceptable
        for n, parent in enumerate(parents[b]):
            if parent == PAD:
                continue
            above = [] if parent == ROOT else deep.get(parent)
            if above is None:
                continue
            at = 0 if parent == ROOT else 1 + parent
            if float(target_probs[b, at, tokens[b][n]]) > float(bar[b, at]):
                deep[n] = above + [n]
                if len(deep[n]) > len(best):
                    best = deep[n]
        paths.append(best)
    return paths


def _verdict(tokens: list[list[int]], paths: list[list[int]], finals: list[int]) -> Verdict:
    out = torch.zeros(len(paths), max((len(p) for p in paths), default=0) + 1, dtype=torch.long)
    for b, (path, final) in enumerate(zip(paths, finals)):
        out[b, : len(path) + 1] = torch.tensor([tokens[b][n] for n in path] + [final])
    return Verdict(torch.tensor([len(p) for p in paths], dtype=torch.long), out, paths)


def _point_mass(like: torch.Tensor, token: int) -> torch.Tensor:
    """A one-hot draft's distribution: all its mass on `token`."""
    q = torch.zeros_like(like)
    q[token] = 1.0
    return q


def _residual(dist: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalise(max(0, dist - q)): what is left of dist after a token drawn from q was rejected;
    dist itself if nothing is left (only if the rejection had probability zero: rounding)."""
    residual = (dist - q).clamp_min(0.0)
    return residual / residual.sum() if residual.sum() > 0 else dist
