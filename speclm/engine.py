"""The speculative decoding engine: propose -> verify -> commit, for a batch of prompts.

Contract:
- Every method runs through the same loop and the same verifier; `none` proposes nothing, so
  each target forward commits exactly one token (plain autoregressive decoding).
- Greedy output equals plain greedy decoding of the target, token for token. With int8
  weights (speclm.quant) the target's forward is batch-invariant, so this holds exactly; in
  fp32 the CPU's matmuls round by shape, so a floating-point near-tie can still flip a token.
- Sampled output follows the target's processed distribution exactly; each row draws from
  its own `torch.Generator` (seeded `seed + prompt_index`), never from global state.
- A row stops at any EOS id (which is returned), at exactly `max_new_tokens`, or when a stop
  string appears (the text ends before it; the ids end with the token that completed it).
- A row may start from the keys and values of the longest prefix its prompt shares with a
  recent prompt (speclm.prefix_cache), only where those are the bits its own prefill would
  compute: the output does not depend on what the cache held.

One round, for the rows still active:
  1. each row's budget: min(k, tokens left - 1), so a commit never passes max_new_tokens
     (0 in the first round, which prefills the prompt alone, exactly as plain decoding);
  2. the proposer drafts up to that many tokens per row;
  3. the target scores [tokens it has not seen, draft tokens] in one forward;
  4. the verifier picks the accepted prefix plus one recovered or bonus token per row;
  5. both caches roll back to the committed prefix; stops are applied; finished rows leave.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field, replace
from typing import Iterator

import torch

from speclm.errors import UsageError
from speclm.kv import StaticKV
from speclm import defaults
from speclm.defaults import DRAFT_METHODS, METHODS
from speclm.models.loading import LoadedModel
from speclm.prefix_cache import PrefixCaches
from speclm.costmodel import verification_costs
from speclm.proposers.draft_tree import DraftTimes, TreeSpec, parse_tree
from speclm.proposers import (Draft, DraftLookupProposer, DraftModelProposer, PromptLookupProposer, Proposer,
                              Verified)
from speclm.sampling import SamplingParams
from speclm.runtime import bound_freed_memory
from speclm.stats import RequestStats
from speclm.text import IncrementalText, final_text, stop_cut
from speclm.tree import ROOT, PAD, DraftTree
from speclm.verify import verify_tree

@dataclass(frozen=True)
class GenerationOptions:
    """`generate`-style arguments."""

    method: str = "none"  # none | draft | pld | draft+pld
    k: int | None = None  # draft length per round; None: the method's default
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    chat: bool = False  # apply the target's chat template to each prompt as one user message
    ngram_max: int = defaults.NGRAM_MAX  # pld, draft+pld: longest n-gram to match
    ngram_min: int | None = None  # pld, draft+pld: shortest n-gram to match (None: the method's default)
    # draft: stop a round after a token the draft gave less probability than this (0: never;
    # None: speclm.defaults.confidence, 0.6 with an int4 draft, else 0)
    confidence: float | None = None
    # draft: a drafted token the draft gave less probability than this gets a second candidate
    # verified beside it (0: never; None: speclm.defaults.alternatives, 0.6 with an int4 draft, else 0)
    alternatives: float | None = None
    # draft: score only the this many lowest token ids, the prompt's tokens and EOS
    # (speclm.proposers.draft_vocab; 0: the whole vocabulary; None: speclm.defaults.DRAFT_VOCAB)
    draft_vocab: int | None = None
    # draft+pld: no draft model for a batch whose every prompt is longer than this times its
    # max_new_tokens (prompt lookup alone); 0: never the model, inf: always
    draft_prompt_ratio: float = defaults.DRAFT_PROMPT_RATIO
    # draft, draft+pld: the draft's shape each round: "chain", "auto" (a tree grown from the draft's
    # probabilities, its size chosen from this machine's measured verification cost) or a JSON
    # file of root paths of ranks (speclm.proposers.draft_tree); None: speclm.defaults.TREE
    tree: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise UsageError(f"unknown method '{self.method}' (choose from {', '.join(METHODS)})")
        if self.k is not None and self.k < 1:
            raise UsageError(f"k must be >= 1, got {self.k}")
        if self.k is not None and self.k > defaults.MAX_K:
            raise UsageError(f"k must be <= {defaults.MAX_K} (tokens drafted per round), got {self.k}")
        if self.max_new_tokens < 1:
            raise UsageError(f"max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if not 1 <= self.lookup_ngram_min <= self.ngram_max:
            raise UsageError("need 1 <= ngram-min <= ngram-max")
        if self.draft_vocab is not None and self.draft_vocab < 0:
            raise UsageError(f"draft-vocab must be >= 0, got {self.draft_vocab}")
        if not self.draft_prompt_ratio >= 0:
            raise UsageError(f"draft-prompt-ratio must be >= 0, got {self.draft_prompt_ratio}")
        if self.confidence is not None and not 0 <= self.confidence < 1:
            raise UsageError(f"confidence must be in [0, 1), got {self.confidence}")
        if self.alternatives is not None and not 0 <= self.alternatives <= 1:
            raise UsageError(f"alternatives must be in [0, 1], got {self.alternatives}")
        self.sampling  # validates temperature, top-p, top-k
        if self.tree is not None and self.method not in DRAFT_METHODS and self.tree != "chain":
            raise UsageError(f"--tree applies to {' and '.join(DRAFT_METHODS)}, not '{self.method}'")
        self.tree_spec  # validates the tree

    @property
    def tree_spec(self) -> TreeSpec | None:
        """The draft's tree (None: a chain)."""
        if self.method not in DRAFT_METHODS:
            return None
        return parse_tree(self.tree if self.tree is not None else defaults.TREE)

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p, self.top_k)

    def draft_length(self, quantize: str = "none", draft_quantize: str | None = None) -> int:
        """k, or the method's default for target weights `quantize` (and the draft's)."""
        return self.k if self.k is not None else defaults.k(self.method, quantize, draft_quantize)

    @property
    def lookup_ngram_min(self) -> int:
        """ngram_min, or the method's default (speclm.defaults.ngram_min)."""
        return self.ngram_min if self.ngram_min is not None else defaults.ngram_min(self.method)

    def draft_vocabulary(self) -> int:
        """draft_vocab, or the default."""
        return defaults.DRAFT_VOCAB if self.draft_vocab is None else self.draft_vocab

    def draft_confidence(self, draft_quantize: str | None = None) -> float:
        return self.confidence if self.confidence is not None else defaults.confidence(draft_quantize)

    def draft_alternatives(self, draft_quantize: str | None = None) -> float:
        return self.alternatives if self.alternatives is not None else defaults.alternatives(draft_quantize)


@dataclass
class Completion:
    prompt_index: int
    text: str
    token_ids: list[int]  # generated ids only
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    stats: RequestStats

    def to_dict(self) -> dict:
        return {
            "prompt_index": self.prompt_index,
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_dict(),
        }


@dataclass
class _Row:
    index: int  # position in the caller's prompt list
    context: list[int]  # prompt + generated ids
    prompt_len: int
    max_new: int
    generator: torch.Generator | None
    stats: RequestStats = field(default_factory=RequestStats)
    finish_reason: str | None = None

    @property
    def generated(self) -> list[int]:
        return self.context[self.prompt_len :]


class SpecEngine:
    """Speculative decoding over a loaded target (and optionally a draft) model.

    >>> engine = SpecEngine(load_model("qwen2.5-coder-1.5b"), draft=load_model("qwen2.5-coder-0.5b"))
    >>> engine.generate("def fib(n):", method="draft", max_new_tokens=64).text
    """

    def __init__(self, target: LoadedModel, draft: LoadedModel | None = None, prefix_cache: int = defaults.PREFIX_CACHE_TOKENS):
        """prefix_cache: tokens of recent prompts whose keys and values each model keeps for later
        prompts that begin alike (speclm.prefix_cache; 0: none). Only on quantized CPU weights,
        where reusing them gives the same bits as reading the prompt whole."""
        if prefix_cache < 0:
            raise UsageError(f"prefix-cache must be >= 0 tokens, got {prefix_cache}")
        self.target, self.draft = target, draft
        self.prefix = PrefixCaches.of_size(prefix_cache)
        self._draft_times = DraftTimes()  # the draft's measured forward times, kept across requests (auto trees)
        if draft is not None:
            check_same_vocabulary(target, draft)

    # ---------------------------------------------------------------- public API
    def generate(self, prompts, batch_size: int | None = None, **options) -> Completion | list[Completion]:
        """Generate for one prompt (returns a Completion) or a list (returns a list, in order).

        A prompt is a string or a list of token ids. A list runs as batches of `batch_size`
        rows (default: all at once); each row accepts its own number of tokens per round.
        Keyword options are those of `GenerationOptions`.
        """
        opts = GenerationOptions(**options)
        single = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
        encoded = self.encode([prompts] if single else list(prompts), opts.chat)
        size = batch_size or len(encoded)
        results: list[Completion] = []
        for start in range(0, len(encoded), size):
            chunk = list(enumerate(encoded))[start : start + size]
            rows = self._rows(chunk, opts)
            for _ in self._decode(rows, opts):
                pass
            results.extend(self._completion(r, opts) for r in rows)
            bound_freed_memory()  # the batch's caches and activations are free now
        return results[0] if single else results

    def stream(self, prompt, **options) -> "TextStream":
        """Iterate over text deltas as tokens are committed; `.completion` holds the result after."""
        opts = GenerationOptions(**options)
        rows = self._rows(list(enumerate(self.encode([prompt], opts.chat))), opts)
        return TextStream(self, rows[0], opts)

    def encode(self, prompts: list, chat: bool) -> list[list[int]]:
        tok = self.target.tokenizer
        out = []
        for p in prompts:
            if not isinstance(p, str):
                ids = [int(t) for t in p]
            elif chat:
                if not getattr(tok, "chat_template", None):
                    raise UsageError(f"model '{self.target.name}' has no chat template; drop --chat")
                text = tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
                ids = tok(text, add_special_tokens=False).input_ids
            else:
                ids = tok(p).input_ids
            if not ids:
                raise UsageError("empty prompt")
            limit = self.target.max_context
            if limit and len(ids) >= limit:
                raise UsageError(f"prompt of {len(ids)} tokens does not fit the context of {limit} tokens")
            out.append(ids)
        return out

    def make_proposer(self, opts: GenerationOptions) -> Proposer | None:
        if opts.method == "none":
            return None
        if opts.method in DRAFT_METHODS:
            if self.draft is None:
                raise UsageError(f"method '{opts.method}' needs a draft model (--draft MODEL)")
            model = dict(k=self._k(opts), confidence=opts.draft_confidence(self.draft.quantize),
                         vocab=opts.draft_vocabulary(), always=tuple(self.target.eos_token_ids),
                         alternatives=opts.draft_alternatives(self.draft.quantize), tree=self._tree(opts),
                         times=self._draft_times)
            if opts.method == "draft":
                return DraftModelProposer(self.draft.model, **model, prefix_cache=self.prefix.draft)
            lookup_k = opts.k if opts.k is not None else defaults.k("pld", self.target.quantize)
            return DraftLookupProposer(self.draft.model, **model, ngram_max=opts.ngram_max,
                                       ngram_min=opts.lookup_ngram_min, prompt_ratio=opts.draft_prompt_ratio,
                                       lookup_k=lookup_k, prefix_cache=self.prefix.draft)
        return PromptLookupProposer(k=self._k(opts), max_ngram=opts.ngram_max, min_ngram=opts.lookup_ngram_min)

    def _tree(self, opts: GenerationOptions) -> TreeSpec | None:
        spec = opts.tree_spec
        if spec is not None and spec.choices is None and opts.sampling.greedy:  # auto's budget: measured costs
            key = f"{self.target.name}-{self.target.quantize}"
            spec = replace(spec, costs=verification_costs(self.target.model, key))
        return spec

    def _k(self, opts: GenerationOptions) -> int:
        return opts.draft_length(self.target.quantize, self.draft.quantize if self.draft is not None else None)

    # ---------------------------------------------------------------- the loop
    def _rows(self, indexed: list[tuple[int, list[int]]], opts: GenerationOptions) -> list[_Row]:
        seed = opts.seed if opts.seed is not None else secrets.randbits(62)
        limit = self.target.max_context or 1 << 62
        rows = []
        for index, ids in indexed:
            gen = None if opts.sampling.greedy else torch.Generator().manual_seed(seed + index)
            rows.append(_Row(index, list(ids), len(ids), min(opts.max_new_tokens, limit - len(ids)), gen))
        return rows

    def _decode(self, rows: list[_Row], opts: GenerationOptions) -> Iterator[list[_Row]]:
        """Run rows to completion; after each round yield the rows that committed tokens."""
        params = opts.sampling
        eos = set(self.target.eos_token_ids)
        proposer = self.make_proposer(opts)
        k = proposer.k if proposer else 0  # the deepest draft per round
        # one round past the last token: a row's final round may feed a whole draft beyond it
        capacity = max(r.prompt_len + r.max_new for r in rows) + (proposer.max_nodes if proposer else 0) + 1
        target_kv = StaticKV(self.target.model, len(rows), capacity)
        cache = self.prefix.target  # each row starts from the longest prefix of its prompt held there
        for b, r in enumerate(rows):
            r.stats.cached_tokens = cache.reuse(target_kv, b, r.context[: r.prompt_len], r.prompt_len - 1)
        if proposer:
            proposer.start(len(rows), capacity, [r.prompt_len for r in rows], [r.max_new for r in rows])
        active = list(rows)
        first_round = True
        t_start = time.perf_counter()
        while active:
            contexts = [r.context for r in active]
            # the first round prefills the prompt alone, as plain decoding does, so that the
            # prompt's keys and values are bit-identical with and without speculation
            prefill, first_round = first_round, False
            budgets = [0 if prefill else min(k, r.max_new - len(r.generated) - 1) for r in active]
            gens = [r.generator for r in active]

            read_before = proposer.prefill_seconds if proposer else 0.0  # the draft's reading of prompts so far
            t0 = time.perf_counter()
            draft = proposer.propose(contexts, budgets, params, gens).trimmed() if proposer else Draft.empty(len(active))
            t1 = time.perf_counter()
            draft_prefill = (proposer.prefill_seconds - read_before) if proposer else 0.0  # within t1 - t0

            tree = draft.tree()  # (B, N) nodes; the chain is its own special case
            have = target_kv.lengths_list()
            feed, parents = _feed(contexts, have, tree)
            wanted = proposer.hidden_layers if proposer else ()  # features a proposer drafts from
            logits = target_kv.forward(feed, 1 + tree.width, parents=parents, hidden_layers=wanted)  # (B, 1+N, V)
            if prefill:  # the slots now hold each row's prompt
                for b, r in enumerate(active):
                    cache.add(target_kv, b, r.context[: r.prompt_len])
            verdict = verify_tree(logits, tree, params, gens)
            t2 = time.perf_counter()
            in_forwards = target_kv.forward_seconds + (proposer.forward_seconds if proposer else 0.0)

            # the accepted path's keys and values take their places after the committed tokens
            keep = [len(c) + len(path) for c, path in zip(contexts, verdict.paths)]
            for b, (c, path) in enumerate(zip(contexts, verdict.paths)):
                target_kv.move_path(b, [len(c) + n for n in path], len(c))
            target_kv.truncate(keep)
            if proposer:
                proposer.accept(Verified(keep, verdict.paths, target_kv.hidden))
            sizes, depths = tree.sizes, tree.max_depths()
            chain_alternatives = draft.alternatives is not None and draft.parents is None

            for b, row in enumerate(active):
                s = row.stats
                s.target_forwards += 1
                s.draft_forwards += draft.forwards
                s.draft_seconds += t1 - t0
                s.draft_prefill_seconds += draft_prefill
                s.verify_seconds += t2 - t1
                s.forward_seconds = in_forwards
                s.verified_nodes += sizes[b]
                accepted = len(verdict.paths[b])
                if chain_alternatives:  # a chain's extra leaves, counted apart from its drafted tokens
                    chain = int(draft.lengths[b])
                    s.alternatives += sizes[b] - chain
                    s.accepted_alternatives += int(accepted > 0 and verdict.paths[b][-1] >= draft.width)
                    s.record_acceptance(chain, accepted)
                else:
                    s.record_acceptance(sizes[b], accepted, depths[b])
                self._commit(row, verdict.committed(b), eos, opts.stop)
                s.new_tokens = len(row.generated)
                s.wall_seconds = time.perf_counter() - t_start
                if prefill:
                    s.prefill_seconds = s.wall_seconds
            yield active

            still = [b for b, r in enumerate(active) if r.finish_reason is None]
            if len(still) < len(active):
                active = [active[b] for b in still]
                if active:
                    target_kv.select(still)
                    if proposer:
                        proposer.select(still)

    def _commit(self, row: _Row, new: list[int], eos: set[int], stops: tuple[str, ...]) -> None:
        first_new = len(row.generated)
        for i, t in enumerate(new):
            if t in eos:
                new, row.finish_reason = new[: i + 1], "stop"
                break
        row.context.extend(new)
        cut = stop_cut(self.target.tokenizer, row.generated, first_new, stops)
        if cut is not None:
            del row.context[row.prompt_len + cut :]
            row.finish_reason = "stop"
        elif row.finish_reason is None and len(row.generated) >= row.max_new:
            row.finish_reason = "length"

    def _completion(self, row: _Row, opts: GenerationOptions) -> Completion:
        text = final_text(self.target.tokenizer, row.generated, opts.stop)
        return Completion(row.index, text, list(row.generated), row.finish_reason or "length", row.stats)


class TextStream:
    """Iterator of text deltas for one prompt; `completion` is set once it is exhausted."""

    def __init__(self, engine: SpecEngine, row: _Row, opts: GenerationOptions):
        self._engine, self._row, self._opts = engine, row, opts
        self.completion: Completion | None = None

    def __iter__(self) -> Iterator[str]:
        text = IncrementalText(self._engine.target.tokenizer, self._opts.stop)
        for _ in self._engine._decode([self._row], self._opts):
            delta = text.delta(self._row.generated, finished=self._row.finish_reason is not None)
            if delta:
                yield delta
        self.completion = self._engine._completion(self._row, self._opts)
        bound_freed_memory()


def _feed(contexts: list[list[int]], have: list[int], tree: DraftTree) -> tuple[list[list[int]], list[list[int]] | None]:
    """What the target reads this round, per row: the committed tokens it has not seen (the last
    of them the tree's root), then every node of the tree (padding nodes too: a row's logits sit
    at fixed columns). And per token its parent's slot (speclm.kv.StaticKV.forward), or None
    where every row is a chain: node n sits at slot len(context) + n."""
    nodes = tree.tokens.tolist()
    parents = tree.parents.tolist()
    feed, links, chain = [], [], True
    for c, h, row, up in zip(contexts, have, nodes, parents):
        feed.append(c[h:] + row)
        # a padding node (after every real one) continues from the node before it, as in a chain
        slot = [len(c) - 1 if p == ROOT or (p == PAD and n == 0) else len(c) + n - 1 if p == PAD else len(c) + p
                for n, p in enumerate(up)]
        chain = chain and all(s == len(c) + n - 1 for n, s in enumerate(slot))
        links.append([-1] * (len(c) - h) + slot)
    return feed, None if chain else links


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """Draft tokens are target token ids, so both must share one tokenizer vocabulary."""
    if target.vocab_size != draft.vocab_size or target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise UsageError(
            f"draft '{draft.name}' does not share the target's vocabulary "
            f"({draft.vocab_size} vs {target.vocab_size} output ids); pick a draft of the same family"
        )
