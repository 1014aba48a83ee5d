"""`auto`: every method the loaded models allow, each a proposer of its own, and per row and
round the one a plan chose (speclm.round.adaptive.Adaptive.caps), or none.

The children are the registry's planned methods (speclm.methods: `Method.planned`), built as
their own method would be, except that a `+pld` child drafts by its model alone
(`Proposer.drop_lookup`) beside a lookup child: where the context repeats itself the plan
chooses between the lookup's chain (`pld`, priced by the chain it finds) and the model, by price,
instead of the lookup taking the round whatever it found. Each round the plan gives every row a
child and a draft length, or nothing (plain decoding for that row). Each child then proposes for
all the group's rows, with a budget of 0 for rows that are not its own (a proposer drafts nothing
and draws nothing from a row's generator where its budget is 0), and each row's draft is its own
child's, node for node, so the verifier's paths index the child's own draft.

After verification every child hears of every row: its own rows' paths as they are; another
child's rows as an empty path (nothing of its draft was accepted: a draft model's cache keeps
what it had read and reads the rest when it drafts that row again), except for a child that reads
the target's states along the committed path (heads: `hidden_layers`; lookahead: `needs_logits`),
which is given the path that was taken, whoever drafted it, as lookup-first methods give it.

Greedy output does not depend on the plan (every path is verified by the target), nor does a
seeded sampled row's (it draws each token by position: speclm.sampling.Coupled). An unseeded
sampled row draws only from its own generator, in its own child.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from speclm.proposers.base import Draft, Proposer, Verified
from speclm.tree import PAD


@dataclass(frozen=True)
class Choice:
    """One row's plan for a round: its child (a method's name) and draft length; child None: no draft."""

    child: str | None
    k: int = 0


NO_DRAFT = Choice(None, 0)


class AutoProposer(Proposer):
    name = "auto"
    plans = True

    def __init__(self, children: dict[str, Proposer]):
        """children: method name -> its proposer, in the registry's order (the first is the plan's
        choice for a row before anything is measured)."""
        assert children, "auto needs a child"
        self.children = children
        if any(c.shadow([]) is not None for c in children.values()):  # a lookup child: it drafts the lookup's chains
            for c in children.values():
                c.drop_lookup()
        kids = list(children.values())
        self.k = max(c.k for c in kids)
        self.max_nodes = max(c.max_nodes for c in kids)
        self.hidden_layers = tuple(sorted({layer for c in kids for layer in c.hidden_layers}))
        wants = {c.prompt_hidden for c in kids}
        self.prompt_hidden = "all" if "all" in wants else "last" if "last" in wants else ""
        self.shape = "chain"  # planned per row, never turned on or off whole
        self.runs_model = any(c.runs_model for c in kids)
        self.reads_context = any(c.reads_context for c in kids)
        self.needs_logits = any(c.needs_logits for c in kids)
        self.drafts_on_target = any(c.drafts_on_target for c in kids)
        self.plan: list[Choice] = []  # per row: this round's choice (set before each `propose`)
        self.last: list[Choice] = []  # per row: the choice the last proposal ran
        # per child, the last proposal's (seconds proposing, of which reading prompts, forwards, rows drafted for)
        self.spent: dict[str, tuple[float, float, int, int]] = {}
        self._proposed: set[str] = set()  # the children that drafted in the last proposal

    # ---------------------------------------------------------------- rows
    def start(self, batch_size, capacity, prompt_lengths=None, max_new_tokens=None, pool=0):
        for c in self.children.values():
            c.start(0, capacity, pool=pool)
        self.add(batch_size, prompt_lengths, max_new_tokens)

    def add(self, count, prompt_lengths=None, max_new_tokens=None):
        for c in self.children.values():
            c.add(count, prompt_lengths, max_new_tokens)

    def select(self, rows):
        self.plan = [self.plan[r] for r in rows] if len(self.plan) > max(rows, default=-1) else []
        self.last = [self.last[r] for r in rows] if len(self.last) > max(rows, default=-1) else []
        for c in self.children.values():
            c.select(rows)

    def read_prompt(self, hidden, starts):
        for c in self.children.values():
            if not c.prompt_hidden:
                continue
            own = [{layer: h[layer] for layer in c.hidden_layers} for h in hidden]
            if c.prompt_hidden == "last" and self.prompt_hidden == "all":
                own = [{layer: s[-1:] for layer, s in h.items()} for h in own]
            c.read_prompt(own, starts)

    def unread(self, contexts):
        """Per row: what its own child (this round's plan) would read first (0 without a plan)."""
        plan = self._plan(len(contexts))
        per = {name: c.unread(contexts) for name, c in self.children.items() if c.reads_context}
        return [per[p.child][b] if p.child in per else 0 for b, p in enumerate(plan)]

    # ---------------------------------------------------------------- a round
    @property
    def forward_seconds(self) -> float:
        return sum(c.forward_seconds for c in self.children.values())

    @property
    def prefill_seconds(self) -> float:
        return sum(c.prefill_seconds for c in self.children.values())

    def bind_target(self, kv, rows):
        for c in self.children.values():
            if c.drafts_on_target:
                c.bind_target(kv, rows)

    def _plan(self, batch: int) -> list[Choice]:
        if len(self.plan) == batch:
            return self.plan
        first = next(iter(self.children.items()))
        return [Choice(first[0], first[1].k)] * batch  # no plan yet: the first child at its own k

    def propose(self, contexts, max_tokens, params, generators) -> Draft:
        batch = len(contexts)
        plan = self._plan(batch)
        self.last, self.spent = list(plan), {}
        drafts: dict[str, Draft] = {}
        for name, child in self.children.items():
            budgets = [min(m, p.k) if p.child == name else 0 for m, p in zip(max_tokens, plan)]
            if not any(budgets):
                continue
            t0, read0 = time.perf_counter(), child.prefill_seconds
            child.draws, child.guides = self.draws, self.guides
            draft = child.propose(contexts, budgets, params, generators).trimmed()
            drafts[name] = draft
            rows = sum(b > 0 for b in budgets)
            self.spent[name] = (time.perf_counter() - t0, child.prefill_seconds - read0, draft.forwards,
                                draft.forward_rows or rows)
        self._proposed = set(drafts)
        if not drafts:
            return Draft.empty(batch)
        if len(drafts) == 1:  # one child drafted: its draft as it is (rows not its own have none)
            return next(iter(drafts.values()))
        forwards = sum(d.forwards for d in drafts.values())
        return _merge(drafts, [p.child for p in plan], batch, params.greedy, forwards)

    def accept(self, verified: Verified) -> None:
        for name, child in self.children.items():
            if child.hidden_layers or child.needs_logits:  # it reads the target's states along whatever was taken
                child.accept(verified)
            else:
                paths = [path if p.child == name else [] for path, p in zip(verified.paths, self.last)]
                child.accept(Verified(verified.keep, paths, verified.hidden, verified.logits))

    def round_counts(self):
        counts = [{} for _ in self.last]
        for name, child in self.children.items():
            inner = child.round_counts() if name in self._proposed else None  # a child that sat out counts nothing
            if inner is None:
                continue
            for b, (own, p) in enumerate(zip(inner, self.last)):
                if p.child == name:
                    counts[b].update(own)
        for b, p in enumerate(self.last):
            counts[b]["planned"] = {p.child or "none": 1}
        return counts


def _merge(drafts: dict[str, Draft], owners: list[str | None], batch: int, greedy: bool, forwards: int) -> Draft:
    """One Draft whose row b is drafts[owners[b]]'s row b, as a tree (parents), node for node (a
    row's length is its span: a chain's alternatives follow its padding)."""
    trees = {name: d.tree() for name, d in drafts.items()}
    width = max(t.width for t in trees.values())
    tokens = torch.zeros(batch, width, dtype=torch.long)
    parents = torch.full((batch, width), PAD, dtype=torch.long)
    lengths = torch.zeros(batch, dtype=torch.long)
    sampled = not greedy and any(t.probs is not None for t in trees.values())
    vocab = next((t.probs.shape[-1] for t in trees.values() if t.probs is not None), 0)
    probs = torch.zeros(batch, width, vocab) if sampled else None
    for b, owner in enumerate(owners):
        if owner not in trees:
            continue
        t = trees[owner]  # copied whole: a chain with alternatives has padding between its nodes
        real = (t.parents[b] != PAD).nonzero()
        n = int(real[-1]) + 1 if len(real) else 0  # the row's span: up to its last real node
        tokens[b, :n], parents[b, :n], lengths[b] = t.tokens[b, :n], t.parents[b, :n], n
        if probs is not None:
            if t.probs is not None:
                probs[b, :n] = t.probs[b, :n]
            else:  # a one-hot proposal (lookup)
                probs[b, torch.arange(n), t.tokens[b, :n]] = 1.0
    rows = sum(1 for o in owners if o in trees)
    return Draft(tokens, lengths, probs, forwards=forwards, forward_rows=rows, parents=parents)
