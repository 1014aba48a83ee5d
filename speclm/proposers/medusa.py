"""Medusa: K trained heads on the target's own last feature propose a tree of next tokens.

After a round, the target's feature at the last accepted token (the one its logits turned into
the round's last committed token, the new root) is all the heads read: head i's logits there
rank the tokens at depth i - 1 below the root. No draft model, no draft prefill, one small
computation per round. The tree is either static (Medusa's "choices", paths of ranks, one rank
per depth) or grown (`auto`): the candidates of highest cumulative probability (the product of the
heads' probabilities along a path). The target verifies as many of the best candidates as pay for
their verification by this machine's measured forward costs (speclm.proposers.head_tree), except
in a tree from `--tree FILE`, which is verified whole. The shipped tuned tree (`static`) was sized
on one machine; where a verified token costs more, each round cuts it.
"""

from __future__ import annotations

import heapq
import time

import torch

from speclm import defaults
from speclm.proposers.base import Draft, Verified
from speclm.proposers.head_tree import HeadProposer, Node, choose, to_draft
from speclm.tree import ROOT

BRANCH = defaults.MEDUSA_BRANCH  # candidates per head considered for a grown tree (ranks past it are rarely accepted)
MAX_TREE = defaults.MEDUSA_MAX_TREE  # the most nodes a grown tree may hold


class MedusaProposer(HeadProposer):
    name = "medusa"
    prompt_hidden = "last"

    def __init__(self, heads, vocab_ids: torch.Tensor, output_head, k: int, choices=None, costs=None):
        """heads: speclm.heads.modules.MedusaHeads (eval); vocab_ids (V',): target ids of the
        restricted vocabulary; output_head: (R, E) -> (R, V'), the target's head over them; k: the
        deepest draft (<= the heads); choices: a static tree (paths of ranks) or None (grown);
        costs: the target's ForwardCosts (how many candidates a round verifies; None: all of a static
        tree, up to MAX_TREE of a grown one)."""
        self.heads, self.ids, self.output_head = heads, vocab_ids, output_head
        self.k = min(k, len(heads.blocks))
        self.choices = [tuple(c) for c in choices] if choices else None
        if self.choices:
            self.k = min(self.k, max(map(len, self.choices)))
        self.costs = costs
        self.max_nodes = len(self.choices) if self.choices else MAX_TREE
        self.features: torch.Tensor | None = None  # (B, E): each row's feature at its root's predecessor
        self._seconds = 0.0

    def start(self, batch_size, capacity, prompt_lengths=None, max_new_tokens=None, pool=0):
        self.features = None
        self._seconds = 0.0

    def read_prompt(self, hidden, starts):
        new = torch.stack([h[-1][-1] for h in hidden]).float()  # (n, E): each prompt's last token's
        self.features = new if self.features is None else torch.cat([self.features, new])

    def accept(self, verified: Verified) -> None:
        states = verified.hidden[-1]  # (B, 1 + N, E): the root's, then each node's
        at = torch.tensor([1 + path[-1] if path else 0 for path in verified.paths], dtype=torch.long)
        self.features = states[torch.arange(len(at)), at].float()

    def select(self, rows):
        self.features = self.features[torch.as_tensor(rows, dtype=torch.long)]

    @torch.inference_mode()
    def propose(self, contexts, max_tokens, params, generators) -> Draft:
        t0 = time.perf_counter()
        batch = len(contexts)
        depth = min(self.k, max(max_tokens, default=0))
        if depth <= 0:
            return Draft.empty(batch)
        states = self.heads(self.features)[:depth]  # (D, B, E)
        logits = self.output_head(states.reshape(depth * batch, -1)).float()  # (D B, V')
        probs = torch.softmax(logits, -1).view(depth, batch, -1)
        top_p, top_i = probs.topk(min(BRANCH, probs.shape[-1]), dim=-1)  # (D, B, BRANCH)
        tokens = self.ids[top_i]  # target ids
        rows, chosen = [], []
        for b in range(batch):
            nodes = self._static(tokens[:, b], top_p[:, b]) if self.choices else self._grown(tokens[:, b], top_p[:, b])
            rows.append(nodes)
        for b, nodes in enumerate(rows):
            chosen.append(choose(nodes, min(depth, max_tokens[b]), self.costs, self.max_nodes))
        self._seconds += time.perf_counter() - t0
        return to_draft(rows, chosen, 1)

    def _static(self, tokens: torch.Tensor, probs: torch.Tensor) -> list[Node]:
        """The static tree's nodes (paths of ranks), with their cumulative probabilities."""
        depth = tokens.shape[0]
        nodes, at = [], {}
        for path in self.choices:
            if len(path) > depth or path[-1] >= tokens.shape[1]:
                continue
            parent = ROOT if len(path) == 1 else at.get(path[:-1])
            if parent is None:
                continue
            d, r = len(path) - 1, path[-1]
            cum = float(probs[d, r]) * (1.0 if parent == ROOT else nodes[parent].cum)
            at[path] = len(nodes)
            nodes.append(Node(int(tokens[d, r]), parent, d, cum))
        return nodes

    def _grown(self, tokens: torch.Tensor, probs: torch.Tensor) -> list[Node]:
        """The MAX_TREE paths of highest cumulative probability, best first (a heap over paths:
        a path's children are its rank choices one level deeper, each less likely than it)."""
        depth = tokens.shape[0]
        p = probs.tolist()
        nodes: list[Node] = []
        heap = [(-p[0][r], 0, r, ROOT) for r in range(len(p[0]))]
        heapq.heapify(heap)
        while heap and len(nodes) < MAX_TREE:
            neg, d, r, parent = heapq.heappop(heap)
            nodes.append(Node(int(tokens[d, r]), parent, d, -neg))
            if d + 1 < depth:
                me = len(nodes) - 1
                for r2, q in enumerate(p[d + 1]):
                    heapq.heappush(heap, (neg * q, d + 1, r2, me))
        return nodes
