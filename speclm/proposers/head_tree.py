"""Trees for trained heads (speclm.proposers.medusa, speclm.proposers.eagle): candidates with their
cumulative probabilities, the best-first order, and how many of them the target verifies.

A candidate's cumulative probability is the product of the head's probabilities along its path:
the head's estimate that the target accepts the whole path. Both heads' trees are deterministic
given the features (ranks, never draws), so every node counts as a point mass for the verifier
(`probs` None), which keeps sampling exact for any choice of nodes (speclm.round.verify).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from speclm.proposers.base import Draft, Proposer
from speclm.tree import PAD, ROOT


class HeadProposer(Proposer):
    """What Medusa's and EAGLE's proposers share: they read the target's final features and draft
    a tree each round (speclm.round.adaptive turns it on or off whole, never cuts its depth)."""

    hidden_layers = (-1,)
    shape = "tree"
    runs_model = True
    _seconds = 0.0  # time proposing since `start`: the heads' forwards and the tree's bookkeeping

    @property
    def forward_seconds(self) -> float:
        return self._seconds


@dataclass
class Node:
    token: int  # target id
    parent: int  # index into the row's candidate list, or ROOT
    depth: int  # 0: a child of the root
    cum: float  # cumulative probability along its path


def verified_size(nodes: list[Node], costs: Callable[[int], float] | None, limit: int) -> int:
    """N: how many of a row's best candidates (best-first order, an ancestor before its
    descendants) the target verifies: N maximising the expected committed tokens, 1 + the N best
    cumulative probabilities, per second of the target's measured forward over 1 + N tokens;
    without costs, `limit`. Per row and from the measured cost line alone, so a row's tree depends
    neither on the other rows of its batch nor on a timing taken during the request."""
    longest = min(limit, len(nodes))
    if costs is None:
        return longest
    best, best_rate, gained = 0, -1.0, 1.0
    for n in range(longest + 1):
        if n:
            gained += nodes[n - 1].cum
        rate = gained / costs(1 + n)
        if rate > best_rate:
            best, best_rate = n, rate
    return best


def best_first(nodes: list[Node], size: int, max_depth: int) -> list[int]:
    """The indices of the `size` candidates of highest cumulative probability no deeper than
    max_depth (depth < max_depth) whose ancestors are all chosen, parents before children."""
    order = sorted(range(len(nodes)), key=lambda i: (-nodes[i].cum, nodes[i].depth, i))
    chosen: list[int] = []
    kept: set[int] = set()
    for i in order:
        if len(chosen) == size:
            break
        n = nodes[i]
        if n.depth < max_depth and (n.parent == ROOT or n.parent in kept):
            chosen.append(i)
            kept.add(i)
    chosen.sort(key=lambda i: (nodes[i].depth, -nodes[i].cum, i))  # by level: parents first
    return chosen


def choose(nodes: list[Node], max_depth: int, costs: Callable[[int], float] | None, limit: int) -> list[int]:
    """A row's verified tree: its best candidates no deeper than max_depth, as many as
    `verified_size` says (without costs, up to `limit`), parents first."""
    ranked = sorted(best_first(nodes, len(nodes), max_depth), key=lambda i: -nodes[i].cum)
    return best_first(nodes, verified_size([nodes[i] for i in ranked], costs, limit), max_depth)


def to_draft(rows: list[list[Node]], chosen: list[list[int]], forwards: int) -> Draft:
    """Each row's chosen candidates as a Draft with parents (probs None: point masses)."""
    width = max((len(c) for c in chosen), default=0)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    parents = torch.full((len(rows), width), PAD, dtype=torch.long)
    for b, (nodes, picked) in enumerate(zip(rows, chosen)):
        at = {i: j for j, i in enumerate(picked)}
        for j, i in enumerate(picked):
            tokens[b, j] = nodes[i].token
            parents[b, j] = ROOT if nodes[i].parent == ROOT else at[nodes[i].parent]
    lengths = torch.tensor([len(c) for c in chosen], dtype=torch.long)
    return Draft(tokens, lengths, None, forwards, parents=parents)
