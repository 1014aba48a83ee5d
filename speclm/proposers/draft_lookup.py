"""A draft model and prompt lookup together: a row whose context repeats itself is drafted by
lookup, for free; the others by the draft model.

Prompt lookup wins where the output copies the prompt (summaries, answers from retrieved text)
and costs nothing, while a draft model wins everywhere else but pays a forward per drafted token.
Each round, per row: when the context's last `ngram_min`..`ngram_max` tokens occur earlier in it,
the tokens that followed are the row's draft (one-hot, as pld's); otherwise the draft model's.
The draft model runs in a round only if some row needs it, and catches up on the tokens committed
meanwhile in one forward the next time it runs (speclm.proposers.draft_model feeds every
committed token its cache lacks).

A row whose prompt is longer than `prompt_ratio` times its budget of new tokens never runs the
draft model: its prefill costs in proportion to the prompt and its gain over lookup in
proportion to the tokens generated, and long prompts are where lookup finds most to copy
(Spec-Bench's summarization and RAG prompts: prompt lookup beat the draft model on each of the
six measured; docs/methods.md). Lookup then drafts that row alone, with pld's settings.

Every choice depends on the context and the request alone, never on the target, so the
verifier's rejection sampling stays exact.
"""

from __future__ import annotations

from speclm.proposers.base import Draft, Verified, mixed_draft
from speclm.proposers.draft_model import DraftModelProposer
from speclm.proposers.prompt_lookup import PromptLookupProposer
from speclm.sampling import SamplingParams


class DraftLookupProposer(DraftModelProposer):
    name = "draft+pld"

    def __init__(self, model, k: int = 4, confidence: float = 0.0, vocab: int = 0, always: tuple[int, ...] = (),
                 alternatives: float = 0.0, ngram_max: int = 3, ngram_min: int = 2, prompt_ratio: float = 3.0,
                 lookup_k: int = 4, prefix_cache=None, tree=None, times=None):
        """k, confidence, vocab, always, alternatives: the draft model's (DraftModelProposer); ngram_max,
        ngram_min: the lookup's while the draft model runs; prompt_ratio: the draft model stays off
        for a row whose prompt is longer than this times its max_new_tokens (0: always off, inf:
        always on); lookup_k: tokens per lookup draft when the model is off; prefix_cache:
        the draft model's (speclm.forward.prefix_cache); tree: the draft model's tree (None: a chain)."""
        super().__init__(model, k=k, confidence=confidence, vocab=vocab, always=always, alternatives=alternatives,
                         prefix_cache=prefix_cache, tree=tree, times=times)
        # while the model runs (None: `drop_lookup`, the model drafts every row it runs)
        self.beside: PromptLookupProposer | None = PromptLookupProposer(k=k, max_ngram=ngram_max, min_ngram=ngram_min)
        self.alone = PromptLookupProposer(k=lookup_k, max_ngram=ngram_max, min_ngram=1)  # as method pld
        self.prompt_ratio = prompt_ratio
        self.max_nodes = max(self.max_nodes, lookup_k)
        self.model_on: list[bool] = []  # per row: the draft model drafts it (else lookup alone, as pld)
        self.lookups = 0  # rows drafted by lookup since start (statistics)
        # per row, this round: the context length of a row drafted by lookup while the model
        # drafted too (its cache then holds the model's tokens, not the lookup's), else None
        self._cut: list[int | None] = []

    def start(self, batch_size: int, capacity: int, prompt_lengths=None, max_new_tokens=None, pool: int = 0) -> None:
        self.lookups, self._cut, self.model_on = 0, [], []
        super().start(batch_size, capacity, prompt_lengths, max_new_tokens, pool)

    def add(self, count: int, prompt_lengths=None, max_new_tokens=None) -> None:
        super().add(count)
        if prompt_lengths is None or max_new_tokens is None:
            self.model_on += [True] * count
        else:
            self.model_on += [length <= self.prompt_ratio * budget for length, budget in zip(prompt_lengths, max_new_tokens)]

    def select(self, rows: list[int]) -> None:
        super().select(rows)
        self.model_on = [self.model_on[r] for r in rows]

    def lookup_only(self) -> list[bool]:
        return [not on for on in self.model_on]

    def drop_lookup(self) -> None:
        self.beside = None  # rows the model drafts: by it alone (a row it never drafts stays lookup's)

    def unread(self, contexts) -> list[int]:
        return [n if on else 0 for n, on in zip(super().unread(contexts), self.model_on)]  # lookup rows: never

    def propose(self, contexts, max_tokens, params: SamplingParams, generators) -> Draft:
        lookups = [self.beside if on else self.alone for on in self.model_on]  # None: the model alone
        found = [lookup.found([c], [m])[0] if lookup is not None else [] for c, m, lookup in zip(contexts, max_tokens, lookups)]
        by_lookup = [len(f) > 0 or not on for f, on in zip(found, self.model_on)]
        self.lookups += sum(len(f) > 0 for f in found)
        self._cut = []
        if not any(m > 0 and not hit for m, hit in zip(max_tokens, by_lookup)):
            return Draft.from_rows(found)  # no row needs the model: one-hot drafts
        # rows drafted by lookup (or never by the model) get no budget from it: it does not run them
        # and draws nothing from their generators, so a row samples as it would alone
        budgets = [0 if hit else m for m, hit in zip(max_tokens, by_lookup)]
        draft = super().propose(contexts, budgets, params, generators)
        if not any(by_lookup):
            return draft
        # rows with a lookup draft take it in place of the model's
        self._cut = [len(c) if hit else None for c, hit in zip(contexts, by_lookup)]
        rows = [f if hit else t[:n] for f, hit, t, n in
                zip(found, by_lookup, draft.tokens.tolist(), draft.lengths.tolist())]
        return mixed_draft(rows, by_lookup, draft, params)

    def accept(self, verified: Verified) -> None:
        if not self._cut:
            return super().accept(verified)
        # a lookup row keeps its context alone: the model's tokens past it were never committed
        keep = [k if cut is None else cut for k, cut in zip(verified.keep, self._cut)]
        paths = [p if cut is None else [] for p, cut in zip(verified.paths, self._cut)]
        self._cut = []
        self.kv.truncate(self._keep_cached(keep, paths))
