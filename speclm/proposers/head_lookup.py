"""Trained heads and prompt lookup together: each round the heads' tree gains the lookup's chain
as one more branch, so the target verifies both in one forward.

The heads guess poorly where the output copies its context (summaries, answers from retrieved
text), which is where prompt lookup guesses well, and lookup costs no forward. Unlike `draft+pld`,
which takes one or the other per row, both are verified together: the heads' tree is small (a few
nodes, sized by the measured forward costs) and each added lookup node costs little more.

The chain is merged into the tree as a trie: its tokens follow the tree's nodes while they agree
and become new nodes from the first disagreement on, so no two siblings carry one token. Every
node stays a point mass (the heads rank, lookup copies; neither draws), so the verifier's
rejection sampling stays exact whatever the tree holds (speclm.spec.verify).
"""

from __future__ import annotations

import torch

from speclm.proposers.base import Draft, Proposer, Verified
from speclm.proposers.prompt_lookup import PromptLookupProposer
from speclm.spec.tree import PAD, ROOT


def merge_chains(draft: Draft, chains: list[list[int]]) -> Draft:
    """The point-mass tree `draft` (parents, probs None; a chain when parents is None) with each
    row's chain merged in below its root. Nodes keep their indices; new ones follow them."""
    tree = draft.tree()
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    rows_tokens, rows_parents = [], []
    for b, chain in enumerate(chains):
        size = sum(p != PAD for p in parents[b])
        t, p = tokens[b][:size], parents[b][:size]
        at = ROOT
        for token in chain:
            child = next((n for n in range(size) if p[n] == at and t[n] == token), None)
            if child is None:  # the tree lacks it: the rest of the chain hangs here
                t.append(token)
                p.append(at)
                child = len(t) - 1
            at = child
            size = len(t)
        rows_tokens.append(t)
        rows_parents.append(p)
    width = max((len(t) for t in rows_tokens), default=0)
    out_tokens = torch.zeros(len(chains), width, dtype=torch.long)
    out_parents = torch.full((len(chains), width), PAD, dtype=torch.long)
    for b, (t, p) in enumerate(zip(rows_tokens, rows_parents)):
        out_tokens[b, : len(t)] = torch.tensor(t, dtype=torch.long)
        out_parents[b, : len(p)] = torch.tensor(p, dtype=torch.long)
    lengths = torch.tensor([len(t) for t in rows_tokens], dtype=torch.long)
    return Draft(out_tokens, lengths, None, draft.forwards, parents=out_parents)


class HeadLookupProposer(Proposer):
    """A head proposer (speclm.proposers.eagle, speclm.proposers.medusa) whose tree each round also
    holds prompt lookup's chain. It passes everything else through to the heads: they read the
    target's features for whatever path was accepted, lookup's nodes included."""

    def __init__(self, heads: Proposer, k: int = 4, ngram_max: int = 3, ngram_min: int = 2):
        """heads: the head proposer (a HeadProposer); k, ngram_max, ngram_min: the lookup's
        (speclm.proposers.prompt_lookup)."""
        self.heads = heads
        self.lookup = PromptLookupProposer(k=k, max_ngram=ngram_max, min_ngram=ngram_min)
        self.name = heads.name + "+pld"
        self.k = max(heads.k, k)
        self.max_nodes = heads.max_nodes + k
        self.hidden_layers, self.prompt_hidden, self.tree = heads.hidden_layers, heads.prompt_hidden, heads.tree

    def start(self, batch_size, capacity, prompt_lengths=None, max_new_tokens=None, pool=0):
        self.heads.start(batch_size, capacity, prompt_lengths, max_new_tokens, pool)

    def add(self, count, prompt_lengths=None, max_new_tokens=None):
        self.heads.add(count, prompt_lengths, max_new_tokens)

    def read_prompt(self, hidden, starts):
        self.heads.read_prompt(hidden, starts)

    @property
    def forward_seconds(self) -> float:
        return self.heads.forward_seconds

    def propose(self, contexts, max_tokens, params, generators) -> Draft:
        draft = self.heads.propose(contexts, max_tokens, params, generators)
        # the heads size their tree as they would alone: the chain rides along (most rounds, no
        # chain; where one is found, its nodes cost little beside a tree of a few nodes)
        chains = self.lookup.found(contexts, max_tokens)  # each no longer than the row's budget
        return merge_chains(draft, chains) if any(chains) else draft

    def accept(self, verified: Verified) -> None:
        self.heads.accept(verified)

    def select(self, rows):
        self.heads.select(rows)
