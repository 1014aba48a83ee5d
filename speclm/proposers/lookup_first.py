"""Prompt lookup first, another proposer elsewhere (eagle+pld, lookahead+pld): each round, a row
whose context repeats itself is drafted by lookup's chain, the others by the wrapped proposer.

The heads guess poorly where the output copies its context (summaries, answers from retrieved
text), which is where prompt lookup guesses well, at no cost. Per row and round: when the
context's last `ngram_min`..`ngram_max` tokens occur earlier in it, the tokens that followed are
the row's draft; otherwise the heads draft it. The heads still read the target's features at every
committed token, lookup's included: EAGLE keeps them pending and feeds them the next round it
drafts (speclm.proposers.eagle), Medusa reads the last one.

Verifying both together (the chain merged into the tree as one more branch) accepted more tokens
per forward but ran slower: the heads' drafting and the larger tree cost more than the extra
tokens gained (docs/heads.md). Every node is a point mass either way (the heads rank, lookup
copies; neither draws), so the verifier's rejection sampling stays exact.

Lookahead (speclm.proposers.lookahead) drafts nothing for a lookup row, so its window waits that
round; its pool still grows from the context.
"""

from __future__ import annotations

from speclm.proposers.base import Draft, Proposer, Verified, mixed_draft
from speclm.proposers.prompt_lookup import PromptLookupProposer


class LookupFirstProposer(Proposer):
    """A proposer (heads: speclm.proposers.eagle, medusa; lookahead) that leaves a row to prompt
    lookup in the rounds where lookup finds a chain for it. Everything else passes through to it:
    heads read the target's features for whatever path was accepted."""

    def __init__(self, heads: Proposer, k: int = 4, ngram_max: int = 3, ngram_min: int = 2):
        """heads: the wrapped proposer; k, ngram_max, ngram_min: the lookup's
        (speclm.proposers.prompt_lookup)."""
        self.heads = heads
        # None: `drop_lookup`, every row the wrapped proposer's
        self.lookup: PromptLookupProposer | None = PromptLookupProposer(k=k, max_ngram=ngram_max, min_ngram=ngram_min)
        self.name = heads.name + "+pld"
        self.k = max(heads.k, k)
        self.max_nodes = max(heads.max_nodes, k)
        self.hidden_layers, self.prompt_hidden, self.shape = heads.hidden_layers, heads.prompt_hidden, heads.shape
        self.runs_model, self.needs_logits = heads.runs_model, heads.needs_logits
        assert not heads.reads_context and not heads.drafts_on_target, "lookup first: a proposer that passes rows over"
        self.by_lookup: list[bool] | None = None  # this round's, per row (None: it has not proposed)

    def start(self, batch_size, capacity, prompt_lengths=None, max_new_tokens=None, pool=0):
        self.heads.start(batch_size, capacity, prompt_lengths, max_new_tokens, pool)

    def add(self, count, prompt_lengths=None, max_new_tokens=None):
        self.heads.add(count, prompt_lengths, max_new_tokens)

    def read_prompt(self, hidden, starts):
        self.heads.read_prompt(hidden, starts)

    @property
    def forward_seconds(self) -> float:
        return self.heads.forward_seconds

    @property
    def prefill_seconds(self) -> float:
        return self.heads.prefill_seconds

    def unread(self, contexts):
        return self.heads.unread(contexts)

    def reading_seconds(self, tokens):
        return self.heads.reading_seconds(tokens)

    def drop_lookup(self) -> None:
        self.lookup = None  # every row the wrapped proposer's

    def propose(self, contexts, max_tokens, params, generators) -> Draft:
        if self.lookup is None:
            self.by_lookup = [False] * len(contexts)
            return self.heads.propose(contexts, max_tokens, params, generators)
        chains = self.lookup.found(contexts, max_tokens)  # each no longer than the row's budget
        self.by_lookup = [bool(chain) for chain in chains]
        if not any(chains):
            return self.heads.propose(contexts, max_tokens, params, generators)
        # rows with a chain get no budget from the heads, which draft nothing there; the heads run
        # only if some row needs them
        budgets = [0 if chain else m for chain, m in zip(chains, max_tokens)]
        draft = (self.heads.propose(contexts, budgets, params, generators) if any(budgets)
                 else Draft.empty(len(contexts)))
        rows = [chain or tokens[:n] for chain, tokens, n in zip(chains, draft.tokens.tolist(), draft.lengths.tolist())]
        return mixed_draft(rows, [bool(chain) for chain in chains], draft, params)

    def accept(self, verified: Verified) -> None:
        if self.by_lookup is None:  # a round it sat out (a cap of 0): no row looked anything up
            self.by_lookup = [False] * len(verified.paths)
        self.heads.accept(verified)

    def round_counts(self) -> list[dict[str, int]] | None:
        """Per row of the round just accepted; the next round starts unproposed."""
        looked, self.by_lookup = self.by_lookup or [], None
        inner = self.heads.round_counts() or [{} for _ in looked]
        return [{**counts, "lookup_rounds": int(x)} for counts, x in zip(inner, looked)]

    def select(self, rows):
        self.heads.select(rows)
