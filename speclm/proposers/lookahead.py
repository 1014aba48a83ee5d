"""Lookahead decoding (Fu et al., ICML 2024): Jacobi iteration over a window of guesses fills a pool
of n-grams, and the n-grams that start with the last committed token are verified.

Per row, the proposer keeps a window of W columns over N - 1 levels (oldest first): column i
guesses the token i + 1 places after the row's last committed token, each level one Jacobi
iteration newer than the one below it. Each round's one target forward carries, beside the
verification branch, the window itself as a tree (speclm.tree): level 0 is a chain, and the
token at level l > 0, column i hangs under level l - 1's token at column i - 1 (its trajectory;
at column 0, under the root), so that every window token sits at the position of its column and
sees the tokens its guess was made after. The target's argmax at (l, i) is the next level's guess
for column i + 1 (its argmax at the root: column 0), and at the top level it completes an n-gram:
the N - 1 tokens of that path ending at (N - 2, i), then the argmax. Completed n-grams enter the
pool, keyed by their first token, the most recent `pool_size` per key (and with `prompt_ngrams`,
every n-gram of the context as it grows, as prompt lookup would find them).

The verification branch holds up to G of the pool's n-grams whose first token is the row's last
committed token: their other N - 1 tokens, merged into a trie hanging from the root. Window
nodes equal to a trie node (same parent, same token) are that node. Every node is a one-hot
proposal and the one verifier (speclm.round.verify) verifies siblings by rejection, so greedy
output is plain greedy decoding's and sampled output follows the target's distribution, whatever
the window holds. A forward reads up to 1 + W (N - 1) + G (N - 1) tokens, fewer where nodes merge.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from speclm.proposers.base import Draft, Proposer, Verified
from speclm.tree import PAD, ROOT, lineage


@dataclass
class _Row:
    """One request's window, pool and the last round's layout."""

    levels: list[list[int]] = field(default_factory=list)  # oldest first, each W guesses
    pool: dict[int, "OrderedDict[tuple[int, ...], None]"] = field(default_factory=dict)  # first token -> rests
    scanned: int = 0  # context tokens whose n-grams are in the pool (prompt_ngrams)
    window_nodes: dict[tuple[int, int], int] = field(default_factory=dict)  # (level, column) -> node, last round
    tokens: list[int] = field(default_factory=list)  # the last round's nodes' tokens
    parents: list[int] = field(default_factory=list)  # and their parents
    tail: list[int] = field(default_factory=list)  # the context's last tokens, last round (n-grams start there)
    pooled: int = 0  # the last round's verification branch: its nodes are 0..pooled-1 (0: no pooled n-gram)


class LookaheadProposer(Proposer):
    name = "lookahead"
    shape = "tree"
    needs_logits = True

    def __init__(self, window: int = 4, ngram: int = 3, guesses: int = 2, pool_size: int = 8,
                 prompt_ngrams: bool = True):
        """window W, ngram N (>= 2), guesses G: n-grams verified per round; pool_size: n-grams kept per
        first token; prompt_ngrams: the context's own n-grams join the pool too."""
        if window < 1 or ngram < 2 or guesses < 0 or pool_size < 1:
            raise ValueError("need window >= 1, ngram >= 2, guesses >= 0, pool_size >= 1")
        self.window, self.ngram, self.guesses, self.pool_size = window, ngram, guesses, pool_size
        self.prompt_ngrams = prompt_ngrams
        self.k = max(window, ngram - 1)  # the deepest node: the window's last column, or a verified n-gram's end
        self.max_nodes = (window + guesses) * (ngram - 1)
        self.rows: list[_Row] = []
        self.counts: list[dict[str, int]] | None = None  # the last round's, per row (round_counts)
        self.proposed = False  # whether the round `accept` hears of drafted through `propose` (lookup first: not always)

    # ---------------------------------------------------------------- rows
    def add(self, count, prompt_lengths=None, max_new_tokens=None) -> None:
        self.rows += [_Row() for _ in range(count)]

    def select(self, rows: list[int]) -> None:
        self.rows = [self.rows[b] for b in rows]

    def round_counts(self) -> list[dict[str, int]] | None:
        """Per row: whether the verification branch held a pooled n-gram, and how many of its tokens
        were accepted (RequestStats.pool_hits, pool_tokens)."""
        return self.counts

    # ---------------------------------------------------------------- proposing
    def _remember(self, row: _Row, gram: list[int]) -> None:
        rests = row.pool.setdefault(gram[0], OrderedDict())
        rest = tuple(gram[1:])
        rests.pop(rest, None)
        rests[rest] = None  # the most recent last
        while len(rests) > self.pool_size:
            rests.popitem(last=False)

    def _scan(self, row: _Row, context: list[int]) -> None:
        """The context's n-grams that end in tokens not scanned yet join the pool."""
        n = self.ngram
        for start in range(max(0, row.scanned - n + 1), len(context) - n + 1):
            self._remember(row, context[start : start + n])
        row.scanned = len(context)

    def propose(self, contexts, max_tokens, params, generators) -> Draft:
        self.proposed = True
        tokens, parents = [], []
        for row, context, budget in zip(self.rows, contexts, max_tokens):
            if self.prompt_ngrams:
                self._scan(row, context)
            if not row.levels:  # the first guesses: the context's last W tokens (any tokens would do)
                row.levels = [[context[-1 - (i % len(context))] for i in range(self.window)]]
            nodes: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
            row.tokens, row.parents, row.window_nodes = [], [], {}

            def node(parent: int, token: int) -> int:
                key = (parent, token)
                if key not in nodes:
                    nodes[key] = len(row.tokens)
                    row.tokens.append(token)
                    row.parents.append(parent)
                return nodes[key]

            row.pooled = 0
            if budget > 0:
                pooled = list(row.pool.get(context[-1], ()))[::-1][: self.guesses]  # the most recent first
                for rest in pooled:  # the verification branch: a trie, numbered before the window
                    at = ROOT
                    for token in rest[:budget]:
                        at = node(at, token)
                row.pooled = len(row.tokens)
                columns = min(self.window, budget)  # column i sits i + 1 deep
                for level, guesses in enumerate(row.levels):
                    for i in range(columns):
                        if level == 0:
                            parent = row.window_nodes[(0, i - 1)] if i else ROOT
                        else:
                            parent = row.window_nodes[(level - 1, i - 1)] if i else ROOT
                        row.window_nodes[(level, i)] = node(parent, guesses[i])
            row.tail = list(context[-(self.ngram - 1):])
            tokens.append(row.tokens)
            parents.append(row.parents)
        width = max((len(t) for t in tokens), default=0)
        out = Draft.from_rows(tokens)
        out.parents = torch.tensor([p + [PAD] * (width - len(p)) for p in parents], dtype=torch.long).view(len(tokens), width)
        return out

    # ---------------------------------------------------------------- after verification
    def _path(self, row: _Row, n: int) -> list[int]:
        """Node n's tokens from the root down (the root's own token not included)."""
        return [row.tokens[m] for m in lineage(n, row.parents.__getitem__)[0]]

    def accept(self, verified: Verified) -> None:
        """Each window node's argmax is the next level's guess one column on; the top level's
        complete n-grams. The window then drops its oldest level once it holds N - 1."""
        proposed, self.proposed = self.proposed, False
        if not proposed:  # another proposer drafted every row this round: the window waits
            self.counts = [{"pool_hits": 0, "pool_tokens": 0} for _ in self.rows]
            return
        self.counts = [{"pool_hits": int(row.pooled > 0), "pool_tokens": sum(1 for n in path if n < row.pooled)}
                       for row, path in zip(self.rows, verified.paths)]
        logits = verified.logits  # (B, 1 + N, V)
        if logits is None:
            return
        best = logits.argmax(-1).tolist()  # (B, 1 + N): the target's next token at the root and each node
        for b, row in enumerate(self.rows):
            if not row.window_nodes:
                continue
            top = len(row.levels) - 1
            full = len(row.levels) == self.ngram - 1
            new = list(row.levels[-1])  # columns past the round's budget keep their guesses
            new[0] = best[b][0]
            for i in range(self.window - 1):
                at = row.window_nodes.get((top, i))
                if at is not None:
                    new[i + 1] = best[b][1 + at]
            if full:  # the top level's paths complete n-grams
                for i in range(self.window):
                    at = row.window_nodes.get((top, i))
                    if at is not None:
                        gram = (row.tail + self._path(row, at))[-(self.ngram - 1):] + [best[b][1 + at]]
                        if len(gram) == self.ngram:
                            self._remember(row, gram)
            row.levels = (row.levels[1:] if full else row.levels) + [new]
