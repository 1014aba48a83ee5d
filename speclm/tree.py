"""A draft as a tree per row: the one shape the verifier reads, for chains, chains with
alternative leaves, and trees of any shape.

Row b holds sizes[b] nodes, numbered so that a node comes after its parent; N is the most any
row holds, and nodes n >= sizes[b] are padding:
- tokens (B, N) long: node n's token (padding: 0);
- parents (B, N) long: node n's parent, ROOT (-1) for a child of the row's last committed token,
  PAD (-2) for padding. A chain is the tree whose node i has parent i - 1;
- probs (B, N, V) float or None: the distribution the proposer drew node n's token from; None
  for one-hot proposers (prompt lookup), whose node n counts as drawn from a point mass on its
  token. Siblings drawn independently from one distribution (with replacement) share it; siblings
  drawn without replacement each carry the parent's distribution with the earlier siblings'
  tokens removed, renormalised. The verifier then needs no other word on how they were drawn.
The target scores a tree in one forward: its logits (B, 1 + N, V) hold the root's (the last
committed token's) at index 0 and node n's at 1 + n, each the distribution of the token after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

ROOT, PAD = -1, -2


def lineage(node: int, parent_of: Callable[[int], int], inside: Callable[[int], bool] = lambda n: n != ROOT
            ) -> tuple[list[int], int]:
    """The one ancestor walk: `node`, its parent, its parent's parent, ... while `inside` holds.
    Returns those nodes root side first, and the first node reached outside (ROOT by default).
    It gives a tree node's visibility (the KV cache's slots, EAGLE's scratch columns) and its path
    of tokens (lookahead's n-grams)."""
    out = []
    while inside(node):
        out.append(node)
        node = parent_of(node)
    return out[::-1], node


@dataclass
class DraftTree:
    tokens: torch.Tensor  # (B, N) long
    parents: torch.Tensor  # (B, N) long: ROOT, PAD or a node index below n
    probs: torch.Tensor | None  # (B, N, V) or None (one-hot)

    @property
    def width(self) -> int:
        """N: nodes per row, padding included."""
        return self.tokens.shape[1]

    @property
    def sizes(self) -> list[int]:
        return (self.parents != PAD).sum(1).tolist()

    def children(self, row: int) -> dict[int, list[int]]:
        """Row `row`'s nodes by parent (ROOT included), each list in node order: the order the
        verifier tries siblings in."""
        out: dict[int, list[int]] = {}
        for n, parent in enumerate(self.parents[row].tolist()):
            if parent != PAD:
                out.setdefault(parent, []).append(n)
        return out

    def depths(self) -> torch.Tensor:
        """(B, N) long: a node's depth (a child of the root: 0; padding: -1). Its position is the
        committed length plus its depth."""
        parents = self.parents.tolist()
        out = [[-1] * len(row) for row in parents]
        for b, row in enumerate(parents):
            for n, parent in enumerate(row):
                if parent != PAD:
                    out[b][n] = 0 if parent == ROOT else out[b][parent] + 1
        return torch.tensor(out, dtype=torch.long).view(self.parents.shape)

    def max_depths(self) -> list[int]:
        """Per row, its deepest node's depth + 1 (0: no nodes): the longest path it can accept."""
        return (self.depths().max(1).values + 1).tolist() if self.width else [0] * self.tokens.shape[0]

    def check(self) -> None:
        """Parents come before their children; padding after every node of its row."""
        for b, row in enumerate(self.parents.tolist()):
            seen_pad = False
            for n, parent in enumerate(row):
                if parent == PAD:
                    seen_pad = True
                elif seen_pad or not (parent == ROOT or 0 <= parent < n):
                    raise ValueError(f"row {b}: node {n} has parent {parent}")

    @staticmethod
    def chain(tokens: torch.Tensor, lengths: torch.Tensor, probs: torch.Tensor | None = None) -> "DraftTree":
        """tokens (B, K), lengths (B,): row b's first lengths[b] tokens as a chain."""
        batch, width = tokens.shape
        index = torch.arange(width)
        parents = (index - 1).expand(batch, width).clone()
        parents[index[None, :].expand(batch, width) >= lengths[:, None]] = PAD
        return DraftTree(tokens, parents, probs)
