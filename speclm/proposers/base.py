"""What every proposer returns, and the interface the engine drives.

A proposer sees each active row's committed tokens (prompt + generated) and proposes up to
`max_tokens[b]` next tokens per row. It may keep state (a draft model's KV cache); the engine
tells it which rows leave the batch (`select`) and what verification accepted (`accept`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speclm.sampling import SamplingParams
from speclm.tree import PAD, ROOT, DraftTree


@dataclass
class Verified:
    """What a round's verification produced, as a proposer receives it (`Proposer.accept`)."""

    keep: list[int]  # per row: committed tokens now, the round's last (recovered or bonus) token not counted
    paths: list[list[int]]  # per row: the accepted nodes of the proposer's draft, from the root down
    # layer -> (B, 1 + N, E): the target's hidden states at the root and at each node of the draft,
    # for the layers the proposer asked for (Proposer.hidden_layers; -1: after the final norm), else None
    hidden: dict[int, torch.Tensor] | None = None
    # (B, 1 + N, V): the target's logits at the root and at each node, for proposers that ask (needs_logits)
    logits: torch.Tensor | None = None


@dataclass
class Draft:
    tokens: torch.Tensor  # (B, K) long; entries at j >= lengths[b] are padding
    lengths: torch.Tensor  # (B,) long; drafted tokens per row, 0 <= lengths[b] <= K
    draft_probs: torch.Tensor | None  # (B, K, V) the distribution each token was drawn from; None: one-hot
    forwards: int = 0  # draft model forwards spent on this proposal
    forward_rows: int = 0  # the rows those forwards ran over (a draft model's; 0: all B)
    # (B, K) long or None: a second candidate for position j, verified beside tokens[:, j] (a tree
    # whose extra branches are leaves), -1 where none; drawn from draft_probs[:, j] independently
    # of tokens[:, j] (greedy: the draft's second choice). See speclm.round.verify.
    alternatives: torch.Tensor | None = None
    # (B, K) long or None: a tree's parents (speclm.tree: ROOT, PAD or an earlier node); then row
    # b's nodes are tokens[b, :lengths[b]] and `alternatives` is None. None: a chain.
    parents: torch.Tensor | None = None

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    def trimmed(self) -> "Draft":
        """The same draft, padded only to its longest row (no columns that no row uses)."""
        width = int(self.lengths.max()) if len(self.lengths) else 0
        probs = self.draft_probs[:, :width] if self.draft_probs is not None and width else None
        alternatives = self.alternatives[:, :width] if self.alternatives is not None and width else None
        if alternatives is not None:  # none past a row's own draft
            alternatives = alternatives.masked_fill(torch.arange(width)[None, :] >= self.lengths[:, None], -1)
            alternatives = alternatives if bool((alternatives >= 0).any()) else None
        parents = self.parents[:, :width] if self.parents is not None else None
        return Draft(self.tokens[:, :width], self.lengths, probs, self.forwards, self.forward_rows, alternatives,
                     parents)

    def tree(self) -> DraftTree:
        """The draft as the verifier reads it: a chain's node j has parent j - 1; an alternative for
        position j is a sibling of chain node j (same parent, drawn from the same distribution),
        numbered after the row's chain in order of j."""
        if self.parents is not None:
            return DraftTree(self.tokens, self.parents, self.draft_probs)
        chain = DraftTree.chain(self.tokens, self.lengths, self.draft_probs)
        branches, most = self.alternative_slots()
        if not most:
            return chain
        batch, width = self.tokens.shape
        tokens = torch.zeros(batch, most, dtype=torch.long)
        parents = torch.full((batch, most), PAD, dtype=torch.long)
        at = torch.zeros(batch, most, dtype=torch.long)  # the chain position each alternative stands for
        for b, row in enumerate(branches):
            for a, (j, t) in enumerate(row):
                tokens[b, a], parents[b, a], at[b, a] = t, j - 1 if j else ROOT, j
        probs = None
        if self.draft_probs is not None:
            probs = torch.cat([self.draft_probs, self.draft_probs.gather(
                1, at[:, :, None].expand(-1, -1, self.draft_probs.shape[-1]))], dim=1)
        return DraftTree(torch.cat([self.tokens, tokens], 1), torch.cat([chain.parents, parents], 1), probs)

    def alternative_slots(self) -> tuple[list[list[tuple[int, int]]], int]:
        """Per row, its alternatives as (position j, token) in order of j; and the most any row has
        (the target is fed each row's alternatives after its chain, padded to that many)."""
        if self.alternatives is None:
            return [[] for _ in range(len(self.lengths))], 0
        rows = [[(j, t) for j, t in enumerate(row) if t >= 0] for row in self.alternatives.tolist()]
        return rows, max(len(r) for r in rows)

    def spread(self, rows: list[int], batch_size: int) -> "Draft":
        """This draft of rows `rows` as a draft of batch_size rows, the others drafting nothing."""
        at = torch.tensor(rows, dtype=torch.long)

        def place(t: torch.Tensor | None, fill) -> torch.Tensor | None:
            if t is None:
                return None
            out = t.new_full((batch_size, *t.shape[1:]), fill)
            out[at] = t
            return out

        return Draft(place(self.tokens, 0), place(self.lengths, 0), place(self.draft_probs, 0.0), self.forwards,
                     self.forward_rows or len(rows), place(self.alternatives, -1), place(self.parents, PAD))

    @staticmethod
    def from_rows(rows: list[list[int]], draft_probs: torch.Tensor | None = None, forwards: int = 0) -> "Draft":
        """Each row's token list, padded to the longest."""
        tokens = torch.zeros(len(rows), max((len(r) for r in rows), default=0), dtype=torch.long)
        for b, r in enumerate(rows):
            tokens[b, : len(r)] = torch.tensor(r, dtype=torch.long)
        return Draft(tokens, torch.tensor([len(r) for r in rows], dtype=torch.long), draft_probs, forwards)

    @staticmethod
    def empty(batch_size: int) -> "Draft":
        zeros = torch.zeros(batch_size, dtype=torch.long)
        return Draft(torch.zeros(batch_size, 0, dtype=torch.long), zeros, None)


class Proposer:
    """Base class; stateless proposers only implement `propose`."""

    name = "proposer"
    k = 0  # the deepest draft it proposes per round (the engine's budgets: min(k, tokens left - 1))
    max_nodes = 0  # the most draft tokens it proposes per row and round (the KV caches' headroom)
    hidden_layers: tuple[int, ...] = ()  # target layers whose hidden states `accept` receives
    # what of a prompt's hidden states (at hidden_layers) `read_prompt` receives: "" none, "last"
    # the last prompt token's, "all" every token the target read (a prefix cache hit is not read)
    prompt_hidden: str = ""
    # What the round and adaptive speculation (speclm.round.adaptive) read of a proposer, declared:
    shape = "chain"  # "tree": it drafts a tree each round, which adaptive speculation turns on or off whole
    runs_model = False  # model forwards draft (a draft model, heads, the target's own layers): priced per forward
    reads_context = False  # a draft model with a cache of its own: it reads every committed token (a catch-up)
    needs_logits = False  # `accept` receives the target's logits at the root and every node (Verified.logits)
    drafts_on_target = False  # it drafts through the target's own KV cache (`bind_target` before each proposal)
    plans = False  # auto (speclm.proposers.auto): the policy sets its per-row `plan` before each proposal
    # per row, set before each proposal: a seeded sampled request's draws by position (speclm.sampling.Coupled)
    # or None; a proposer that samples its tokens may draw them so (the verifier takes the target's draw
    # at each position whatever was drafted: this only makes a sampled draft likelier to hold it)
    draws: tuple = ()
    # per row, set before each proposal: a constrained request's parser at its committed tokens
    # (speclm.constraint.Matcher) or None; a proposer that drafts from a distribution may mask it
    # (left where it was: push, then pop what it pushed). The round cuts what a constraint forbids
    # anyway (speclm.round.batch._fence): this only keeps a draft to tokens that can be accepted
    guides: tuple = ()

    def start(self, batch_size: int, capacity: int, prompt_lengths: list[int] | None = None,
              max_new_tokens: list[int] | None = None, pool: int = 0) -> None:
        """A new batch begins with batch_size rows (`add`); no row will hold more than `capacity`
        tokens; `pool`: rows to make room for (rows join later)."""
        self.add(batch_size, prompt_lengths, max_new_tokens)

    def add(self, count: int, prompt_lengths: list[int] | None = None, max_new_tokens: list[int] | None = None) -> None:
        """`count` rows join the batch after the others (between rounds). Where known, each row's
        prompt length and its budget of new tokens."""

    def read_prompt(self, hidden: list[dict[int, torch.Tensor]], starts: list[int]) -> None:
        """With `prompt_hidden`: right after `add`, the added rows' prompt hidden states, per row
        layer -> (P - start, E), the states of prompt tokens start..P-1 ("all"; the tokens before
        `start` came from the prefix cache, unread) or of the last one alone ("last", (1, E))."""

    @property
    def forward_seconds(self) -> float:
        """Time spent inside model forwards since `start` (0 for model-free proposers)."""
        return 0.0

    @property
    def prefill_seconds(self) -> float:
        """Time since `start` spent reading the batch's prompts (a draft model's own prefill: its
        restricted head and its forwards over the prompts), part of proposing."""
        return 0.0

    def unread(self, contexts: list[list[int]]) -> list[int]:
        """Per row: the tokens of its context a model of this proposer would read before drafting
        for it (a new prompt, tokens committed while it sat out), 0 where it never reads the row."""
        return [0] * len(contexts)

    def reading_seconds(self, tokens: int) -> float | None:
        """Seconds its model takes to read `tokens` unread tokens of one row (`unread`), as measured
        here; None where it does not measure it (a draft model: its cost line prices it)."""
        return None

    def lookup_only(self) -> list[bool]:
        """Per row: whether this proposer drafts the row by prompt lookup alone whatever happens (a
        draft+pld row whose prompt is too long for its draft model); [] where it never does."""
        return []

    def drop_lookup(self) -> None:
        """From now on draft every row by this proposer's model, never by its own prompt lookup (a
        `+pld` method): auto plans its lookup child (`pld`) beside it, priced by the chain it finds
        each round, so a lookup inside this child would only take rounds the plan priced as its
        model's. Nothing where it has no lookup of its own."""

    def shadow(self, contexts: list[list[int]]) -> list[list[int]] | None:
        """Per row: the chain it would draft at its k from the context alone, for rows it does not
        draft this round, where that needs no state and costs next to nothing (a lookup); None where
        it does not (a model, or state of its own). auto scores these against the text the row then
        commits: what the child would have accepted, learnt without running its rounds."""
        return None

    def propose(
        self,
        contexts: list[list[int]],
        max_tokens: list[int],
        params: SamplingParams,
        generators: list[torch.Generator | None],
    ) -> Draft:
        raise NotImplementedError

    def bind_target(self, kv, rows: list[int]) -> None:
        """With `drafts_on_target`: the target's cache (speclm.forward.cache.StaticKV) and the batch
        rows of this proposer's rows, in its order, for the proposal that follows. What it writes
        past a row's committed tokens is rolled back before it returns."""

    def accept(self, verified: Verified) -> None:
        """The one hook after verification: row b accepted verified.paths[b] (node indices of this
        proposer's last draft) and holds verified.keep[b] committed tokens, plus one more from the
        target that the proposer has not seen; anything it cached past what it can keep is stale.
        With `hidden_layers`, verified.hidden holds the target's features there (a head drafts
        from them)."""

    def select(self, rows: list[int]) -> None:
        """Only these rows stay in the batch, in this order (finished rows leave)."""

    def round_counts(self) -> list[dict[str, int]] | None:
        """After `accept`: per row of the last round, counters its request's stats add up (names of
        speclm.stats.RequestStats fields, such as lookahead's pool hits); None: nothing to count."""
        return None


def mixed_draft(rows: list[list[int]], by_lookup: list[bool], model: Draft, params: SamplingParams) -> Draft:
    """A Draft of these token rows, some by lookup (chains), the others the model's: a draft
    model's or heads' (with its tree's parents and its alternatives). Sampling: the model's rows
    read their distributions from model.draft_probs (B, K', V); lookup rows are one-hot."""
    draft = Draft.from_rows(rows, forwards=model.forwards)
    draft.forward_rows = model.forward_rows
    if model.parents is not None:  # the model's rows are trees: they keep their parents, lookup rows are chains
        chain = DraftTree.chain(draft.tokens, draft.lengths).parents
        trees = torch.full_like(chain, PAD)  # (B, K): past a model row's nodes, padding
        width = min(model.width, draft.width)
        trees[:, :width] = model.parents[:, :width]
        draft.parents = torch.where(torch.tensor(by_lookup)[:, None], chain, trees)
    if model.alternatives is not None:  # the model's rows keep their alternatives
        others = torch.full(draft.tokens.shape, -1, dtype=torch.long)
        for b, (r, hit) in enumerate(zip(rows, by_lookup)):
            if not hit:
                others[b, : len(r)] = model.alternatives[b, : len(r)]
        draft.alternatives = others if bool((others >= 0).any()) else None
    if params.greedy or model.draft_probs is None:
        return draft  # draft_probs None: one-hot for every row
    probs = model.draft_probs.new_zeros(len(rows), draft.width, model.draft_probs.shape[-1])  # (B, K, V)
    for b, (r, hit) in enumerate(zip(rows, by_lookup)):
        if not hit:
            probs[b, : len(r)] = model.draft_probs[b, : len(r)]
        elif r:
            probs[b, torch.arange(len(r)), draft.tokens[b, : len(r)]] = 1.0
    draft.draft_probs = probs
    return draft
