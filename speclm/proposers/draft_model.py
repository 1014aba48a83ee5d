"""Drafting with a smaller model that shares the target's tokenizer.

The draft keeps its own preallocated KV cache (speclm.kv.StaticKV). Each proposal first feeds the committed tokens
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
from speclm.proposers.draft_vocab import RestrictedHead, restricted_head
from speclm.kv import StaticKV
from speclm.prefix_cache import PrefixCache
from speclm.sampling import SamplingParams, processed_probs, sample


class DraftModelProposer(Proposer):
    name = "draft"

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
        if tree is not None:
            self.k, self.confidence, self.alternatives = tree.max_depth, 0.0, 0.0
        self.max_nodes = tree.max_nodes if tree is not None else 2 * self.k  # a chain's alternatives: one per token
        self._slots: list[list[int | None]] = []  # per row, the draft cache slot of each node of the last tree
        self._nodes: list = []  # per row, the last tree's nodes (speclm.proposers.draft_tree)
        self._times = times if times is not None else DraftTimes()  # measured, for trees grown by cost
        self.vocab, self.always = vocab, tuple(always)
        self.prefix_cache = prefix_cache
        self.kv: StaticKV | None = None
        self.head: RestrictedHead | None = None
        self._prefill_seconds = 0.0

    def start(self, batch_size: int, capacity: int, prompt_lengths=None, max_new_tokens=None) -> None:
        self.kv = StaticKV(self.model, batch_size, capacity)
        self.head = None
        self._prefill_seconds = 0.0

    def _restrict(self, contexts: list[list[int]]) -> None:
        """At a batch's first proposal: the head over the vocab lowest ids, the prompts' and `always`."""
        self.head = restricted_head(self.model, self.vocab, [t for c in contexts for t in c] + list(self.always))

    @property
    def forward_seconds(self) -> float:
        return self.kv.forward_seconds if self.kv is not None else 0.0

    @property
    def prefill_seconds(self) -> float:
        return self._prefill_seconds

    def propose(self, contexts, max_tokens, params: SamplingParams, generators) -> Draft:
        batch = len(contexts)
        width = min(self.k, max(max_tokens))
        if width <= 0:
            return Draft.empty(batch)
        have = self.kv.lengths_list()
        prefill = not any(have)  # the batch's first proposal: the draft reads the prompts
        began = time.perf_counter()
        if prefill:
            self._restrict(contexts)
        head = self.head
        if prefill and all(len(c) > 1 for c in contexts):
            # The target prefilled the prompt alone and fed its first token in a decode forward;
            # mirror that split (where a prefill attends batched and a decode forward per query,
            # they round differently), so that a draft equal to the target computes the same bits.
            # The prompt's longest cached prefix is copied in first (leaving a token to feed).
            cache = self.prefix_cache
            if cache is not None:
                have = [cache.reuse(self.kv, b, c, len(c) - 2) for b, c in enumerate(contexts)]
            self.kv.forward([c[h:-1] for c, h in zip(contexts, have)], 1, head)
            if cache is not None:
                for b, c in enumerate(contexts):
                    cache.add(self.kv, b, c[:-1])
            have = self.kv.lengths_list()
        # logits over the draft's vocabulary: all V ids, or head.ids (S,) when restricted
        t0 = time.perf_counter()
        logits = self.kv.forward([c[h:] for c, h in zip(contexts, have)], 1, head)[:, -1]  # (B, V or S)
        if not prefill and max(len(c) - h for c, h in zip(contexts, have)) == 1:
            self._times.record(1, time.perf_counter() - t0)
        if prefill:
            self._prefill_seconds += time.perf_counter() - began
        if self.tree is not None:
            vocab = head.vocab_size if head is not None else logits.shape[-1]
            grown = grow(self.kv, head, vocab, self.tree, logits, self.kv.lengths_list(), max_tokens, params,
                         generators, began, self._times)
            self._slots = grown.slots
            # greedy acceptance, measured for growing greedy trees by cost (a sampled node's is another matter)
            self._nodes = grown.nodes if params.greedy else []
            return Draft(grown.tokens, grown.lengths, grown.probs, forwards=1 + grown.forwards, parents=grown.parents)
        tokens = torch.zeros(batch, width, dtype=torch.long)
        others = torch.full((batch, width), -1, dtype=torch.long) if self.alternatives > 0 else None
        drafted = [min(width, max(m, 0)) for m in max_tokens]  # per row: its budget, cut where it stops
        probs = [] if not params.greedy else None
        steps = 0
        gauge = self.confidence > 0 or self.alternatives > 0  # the draft's probability of its token is needed
        for j in range(width):
            if params.greedy:
                step = logits.argmax(-1)  # (B,) indices into the draft's vocabulary
                sure = torch.softmax(logits, -1).gather(-1, step[:, None])[:, 0] if gauge else None
            else:
                p = processed_probs(logits, params)  # (B, V or S)
                probs.append(p if head is None else _full_vocabulary(p, head))
                # only rows still drafting draw (from their own generators), so that a row's draws do
                # not depend on how long the other rows of the batch draft
                step = torch.tensor([sample(p[b].cpu(), generators[b]) if j < drafted[b] else 0 for b in range(batch)])
                sure = p.gather(-1, step[:, None].to(p.device))[:, 0] if gauge else None
            if others is not None:  # rows unsure of this token get an alternative for it
                branch = (sure < self.alternatives).cpu()
                if bool(branch.any()):  # greedy: the second choice; sampling: a second draw from p
                    other = (logits.scatter(-1, step[:, None].to(logits.device), float("-inf")).argmax(-1).cpu()
                             if params.greedy else
                             torch.tensor([sample(p[b].cpu(), generators[b]) if branch[b] and j < drafted[b] else 0
                                           for b in range(batch)]))
                    ids = other if head is None else head.ids[other]
                    others[:, j] = torch.where(branch, ids, -1)
            step = step.cpu()
            if head is not None:
                step = head.ids[step]  # token ids
            tokens[:, j] = step
            steps = j + 1
            if self.confidence > 0:  # a row stops after a token its draft was unsure of
                unsure = (sure < self.confidence).tolist()
                drafted = [min(d, j + 1) if below else d for d, below in zip(drafted, unsure)]
            if any(d > j + 1 for d in drafted):  # some row still drafts: feed this step's tokens
                logits = self.kv.forward([[t] for t in step.tolist()], 1, head)[:, -1]
            else:
                break
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


def _full_vocabulary(probs: torch.Tensor, head: RestrictedHead) -> torch.Tensor:
    """probs (B, S) over head.ids -> (B, V), zero elsewhere: the distribution the verifier reads."""
    full = probs.new_zeros(probs.shape[0], head.vocab_size)
    full[:, head.ids.to(probs.device)] = probs
    return full
