"""Drafting with a smaller model that shares the target's tokenizer.

The draft keeps its own preallocated KV cache (speclm.forward.cache.StaticKV). Each proposal first feeds the committed tokens
the draft has not seen (at the start the prompt, then the target's first token, split as the
target fed them; afterwards the target's
recovered or bonus token, plus the last draft token when every draft was accepted), then
drafts autoregressively. Its last drafted token is never fed, so a fully accepted round
costs k draft forwards, not k+1.
"""

from __future__ import annotations

import time

import torch

from speclm.proposers.base import Draft, Proposer, Verified
from speclm.proposers.draft_tree import DraftTimes, TreeSpec, grow, record_acceptance
from speclm.proposers.draft_vocab import RestrictedHead, RowVocabs, on_vocabulary, token_of
from speclm.forward.cache import StaticKV
from speclm.forward.prefix_cache import PrefixCache
from speclm.sampling import SamplingParams, processed_probs, sample


class DraftModelProposer(Proposer):
    name = "draft"
    runs_model = reads_context = True

    def __init__(self, model, k: int = 4, confidence: float = 0.0, vocab: int = 0, always: tuple[int, ...] = (),
                 alternatives: float = 0.0, prefix_cache: PrefixCache | None = None, tree: TreeSpec | None = None,
                 times: DraftTimes | None = None):
        """k: most tokens per round; confidence: a row stops drafting after a token the draft gave
        less than this probability (0: never), so a round where the draft is unsure costs
        fewer draft steps and a narrower verification. The stop depends on the draft alone, so
        sampling stays exact. vocab: the draft scores only the `vocab` lowest token ids, the
        prompts' tokens and `always` (end-of-sequence ids) (speclm.proposers.draft_vocab; 0: the
        whole vocabulary, as where speclm's lean forward does not run). alternatives: where the
        draft gave its token less than this probability, a second candidate for that position
        is verified beside it (greedy: the draft's second choice; sampling: a second, independent
        draw), one more token in the target's forward and no draft step (0: never). tree: draft a
        tree of this shape each round instead of a chain (speclm.proposers.draft_tree; k,
        confidence and alternatives then do not apply)."""
        self.model, self.k, self.confidence, self.alternatives = model, k, confidence, alternatives
        self.tree = tree
        self.shape = "chain" if tree is None else "tree"
        if tree is not None:
            self.k, self.confidence, self.alternatives = tree.max_depth, 0.0, 0.0
        self.max_nodes = tree.max_nodes if tree is not None else 2 * self.k  # a chain's alternatives: one per token
        self._slots: list[list[int | None]] = []  # per row, the draft cache slot of each node of the last tree
        self._nodes: list = []  # per row, the last tree's nodes (speclm.proposers.draft_tree)
        self._times = times if times is not None else DraftTimes()  # measured, for trees grown by cost
        self.vocab, self.always = vocab, tuple(always)
        self.prefix_cache = prefix_cache
        self.kv: StaticKV | None = None
        self.vocabs = RowVocabs(model, vocab, self.always)  # each row's restricted vocabulary
        self._prefill_seconds = 0.0

    def start(self, batch_size: int, capacity: int, prompt_lengths=None, max_new_tokens=None, pool: int = 0) -> None:
        # a round rolls back every draft token it fed (a sliding layer's ring keeps them all)
        self.kv = StaticKV(self.model, 0, capacity, pool=max(batch_size, pool))
        self.kv.reserve(capacity, width=self.max_nodes + 2)
        self.vocabs = RowVocabs(self.model, self.vocab, self.always)
        self._prefill_seconds = 0.0
        self.add(batch_size, prompt_lengths, max_new_tokens)

    def add(self, count: int, prompt_lengths=None, max_new_tokens=None) -> None:
        self.kv.add(count)
        self.vocabs.add(count)
        self._slots += [[] for _ in range(count)] if self._slots else []
        self._nodes += [[] for _ in range(count)] if self._nodes else []

    @property
    def head(self) -> RestrictedHead | None:
        """The draft's output head over its rows' vocabularies (None: the whole vocabulary)."""
        return self.vocabs.head

    @property
    def forward_seconds(self) -> float:
        return self.kv.forward_seconds if self.kv is not None else 0.0

    @property
    def prefill_seconds(self) -> float:
        return self._prefill_seconds

    def unread(self, contexts) -> list[int]:
        have = self.kv.lengths_list() if self.kv is not None else [0] * len(contexts)
        return [max(0, len(c) - h) for c, h in zip(contexts, have)]

    def propose(self, contexts, max_tokens, params: SamplingParams, generators) -> Draft:
        batch = len(contexts)
        rows = [b for b in range(batch) if max_tokens[b] > 0]  # rows that draft this round; the others wait
        if not rows or self.k <= 0:
            return Draft.empty(batch)
        draft = self._draft([contexts[b] for b in rows], rows, [max_tokens[b] for b in rows], params,
                            [generators[b] for b in rows])
        return draft if len(rows) == batch else draft.spread(rows, batch)

    def _draft(self, contexts, rows, max_tokens, params: SamplingParams, generators) -> Draft:
        """Draft for batch rows `rows` (contexts, budgets and generators theirs, in order); the
        Draft's rows are theirs."""
        batch, kv = len(rows), self.kv
        only = None if batch == kv.batch_size else rows  # forwards over these rows alone
        width = min(self.k, max(max_tokens))
        lengths = kv.lengths_list()
        have = [lengths[b] for b in rows]
        new = [i for i, h in enumerate(have) if h == 0]  # rows drafting for the first time read their prompts
        began = time.perf_counter()
        if new:
            self.vocabs.read([rows[i] for i in new], [contexts[i] for i in new])
        head = self.vocabs.head
        if new and all(len(contexts[i]) > 1 for i in new):
            # The target prefilled the prompt alone and fed its first token in a decode forward;
            # mirror that split (where a prefill attends batched and a decode forward per query,
            # they round differently), so that a draft equal to the target computes the same bits.
            # The prompt's longest cached prefix is copied in first (leaving a token to feed).
            cache = self.prefix_cache
            for i in new:
                if cache is not None:
                    have[i] = cache.reuse(kv, rows[i], contexts[i], len(contexts[i]) - 2)
            kv.forward([contexts[i][have[i]:-1] for i in new], 1, head, only=[rows[i] for i in new])
            for i in new:
                if cache is not None:
                    cache.add(kv, rows[i], contexts[i][:-1])
                have[i] = len(contexts[i]) - 1
        # logits over the draft's vocabulary: all V ids, or head.ids (S,) when restricted
        t0 = time.perf_counter()
        logits = kv.forward([c[h:] for c, h in zip(contexts, have)], 1, head, only=only)[:, -1]  # (B, V or S)
        unseen = max(len(c) - h for c, h in zip(contexts, have))  # normally the target's token, and a last draft
        if not new and unseen == 1:
            self._times.steps.record(1, time.perf_counter() - t0)
        if new:
            self._prefill_seconds += time.perf_counter() - began
        elif unseen > 2:  # reading what was committed while this draft sat out (adaptive speculation): a prefill
            self._prefill_seconds += time.perf_counter() - t0
        vocab_size = head.vocab_size if head is not None else logits.shape[-1]  # the target's V
        if self.tree is not None:
            lengths = kv.lengths_list()
            lengths = [lengths[b] for b in rows]
            grown = grow(kv, self.vocabs, rows, vocab_size, self.tree, logits, lengths, max_tokens, params, generators,
                         began, self._times, only, [self.guides[b] if len(self.guides) > b else None for b in rows])
            # per batch row: the draft cache slot of each node it fed, and (greedy) the nodes, for
            # measuring acceptance (a sampled node's is another matter)
            self._slots = [[] for _ in range(kv.batch_size)]
            self._nodes = [[] for _ in range(kv.batch_size)]
            for i, b in enumerate(rows):
                self._slots[b] = grown.slots[i]
                self._nodes[b] = grown.nodes[i] if params.greedy else []
            return Draft(grown.tokens, grown.lengths, grown.probs, forwards=1 + grown.forwards, parents=grown.parents)
        tokens = torch.zeros(batch, width, dtype=torch.long)
        others = torch.full((batch, width), -1, dtype=torch.long) if self.alternatives > 0 else None
        drafted = [min(width, max(m, 0)) for m in max_tokens]  # per row: its budget, cut where it stops
        probs = [] if not params.greedy else None
        steps = 0
        gauge = self.confidence > 0 or self.alternatives > 0  # the draft's probability of its token is needed
        vocab = self.vocabs
        mask = vocab.mask(rows, logits.shape[-1]) if params.greedy else None  # each row's own columns
        guides = [self.guides[b] if len(self.guides) > b else None for b in rows]  # constrained rows' parsers
        pushed = [0] * batch  # tokens pushed on each row's parser this round (popped at the end)
        for j in range(width):
            allowed = _allowed(guides, head, logits.shape[-1], drafted, j)  # (B, S) or None
            if allowed is not None:  # a row whose constraint leaves none of the draft's columns stops
                drafted = [d if bool(a.any()) else min(d, j) for d, a in zip(drafted, allowed)]
                allowed[~allowed.any(-1)] = True
            if params.greedy:
                own = logits if mask is None else logits.masked_fill(~mask.to(logits.device), float("-inf"))
                if allowed is not None:
                    own = own.masked_fill(~allowed.to(own.device), float("-inf"))
                step = own.argmax(-1).cpu()  # (B,) columns of the head
                ids = step if head is None else head.ids[step]  # token ids
                sure = torch.softmax(own, -1).gather(-1, step[:, None].to(own.device))[:, 0].cpu() if gauge else None
            else:
                # each row's distribution over its own vocabulary, drawn from its own generator; only
                # rows still drafting draw, so a row's draws do not depend on the other rows
                dists = [processed_probs(_masked(vocab.logits(b, logits[i : i + 1]),
                                                 None if allowed is None else vocab.logits(b, allowed[i : i + 1])),
                                         params)[0].cpu() for i, b in enumerate(rows)]  # (S_b,) each
                probs.append(torch.stack([on_vocabulary(d, vocab.token_ids(b), vocab_size) for d, b in zip(dists, rows)]))
                draws = [self.draws[b] if len(self.draws) > b else None for b in rows]
                columns = [(c.token(d, len(ctx) + j, vocab.token_ids(b)) if c is not None else sample(d, g)) if j < n else 0
                           for d, g, n, c, ctx, b in zip(dists, generators, drafted, draws, contexts, rows)]
                ids = torch.tensor([token_of(vocab.token_ids(b), c) for b, c in zip(rows, columns)], dtype=torch.long)
                sure = torch.tensor([float(d[c]) for d, c in zip(dists, columns)]) if gauge else None
            if others is not None:  # rows unsure of this token get an alternative for it
                branch = sure < self.alternatives
                if bool(branch.any()):  # greedy: the second choice; sampling: a second draw
                    if params.greedy:
                        second = own.scatter(-1, step[:, None].to(own.device), float("-inf")).argmax(-1).tolist()
                        other = second if head is None else head.ids[second].tolist()
                    else:
                        other = [token_of(vocab.token_ids(b), sample(d, g)) if branch[i] and j < drafted[i] else 0
                                 for i, (b, d, g) in enumerate(zip(rows, dists, generators))]
                    others[:, j] = torch.where(branch, torch.tensor(other, dtype=torch.long), -1)
            tokens[:, j] = ids
            steps = j + 1
            for i, g in enumerate(guides):  # a constrained row's parser follows its draft (an end of sequence ends it)
                if g is not None and j < drafted[i]:
                    if g.push(int(ids[i])):
                        pushed[i] += 1
                    else:
                        drafted[i] = j + 1
            if self.confidence > 0:  # a row stops after a token its draft was unsure of
                unsure = (sure < self.confidence).tolist()
                drafted = [min(d, j + 1) if below else d for d, below in zip(drafted, unsure)]
            if any(d > j + 1 for d in drafted):  # some row still drafts: feed this step's tokens
                logits = kv.forward([[t] for t in ids.tolist()], 1, head, only=only)[:, -1]
            else:
                break
        for g, n in zip(guides, pushed):
            if g is not None:
                g.pop(n)
        lengths = torch.tensor(drafted, dtype=torch.long)
        draft_probs = torch.stack(probs, dim=1) if probs is not None else None  # (B, steps, V)
        alternatives = others[:, :steps] if others is not None else None
        return Draft(tokens[:, :steps], lengths, draft_probs, forwards=steps, alternatives=alternatives)

    def accept(self, verified: Verified) -> None:
        self.kv.truncate(self._keep_cached(verified.keep, verified.paths))

    def _keep_cached(self, keep: list[int], paths: list[list[int]]) -> list[int]:
        """Per row, how many tokens of its cache stay: the committed ones before this round's draft,
        then the accepted nodes the draft fed (a tree's are moved into place first, and what the
        target accepted of a greedy tree is counted for growing the next ones)."""
        out = []
        for b, (k, path) in enumerate(zip(keep, paths)):
            start = k - len(path)  # committed tokens before this round's draft
            if self.tree is not None and self._slots:
                if self._nodes and self._nodes[b]:
                    record_acceptance(self._times, self._nodes[b], path)
                fed = [self._slots[b][n] for n in path]
                fed = fed[: fed.index(None)] if None in fed else fed
                self.kv.move_path(b, fed, start)
                out.append(start + len(fed))
            else:  # a chain's node j sits at slot start + j; an accepted alternative was never fed
                fed = next((j for j, n in enumerate(path) if n != j), len(path))
                out.append(start + fed)
        self._slots, self._nodes = [], []
        return out

    def select(self, rows: list[int]) -> None:
        self.kv.select(rows)
        self.vocabs.select(rows)
        self._slots = [self._slots[r] for r in rows] if self._slots else []
        self._nodes = [self._nodes[r] for r in rows] if self._nodes else []


def _allowed(guides: list, head, width: int, drafted: list[int], j: int) -> torch.Tensor | None:
    """(B, width) bool: each constrained row's columns its constraint allows next (True for the
    other rows, and for rows done drafting); None where no row is constrained and drafting."""
    if not any(g is not None and j < d for g, d in zip(guides, drafted)):
        return None
    out = torch.ones(len(guides), width, dtype=torch.bool)
    for i, (g, d) in enumerate(zip(guides, drafted)):
        if g is not None and j < d:
            out[i] = g.allowed(width, head.ids if head is not None else None)
    return out


def _masked(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """logits (1, S) with what `allowed` (1, S) forbids at -inf (a constrained row's draft distribution)."""
    return logits if allowed is None else logits.masked_fill(~allowed.to(logits.device), float("-inf"))
