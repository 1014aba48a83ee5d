"""A running decode: requests join between rounds and leave when done; one target forward per step.

Contract:
- Every method runs through the same round and the same verifier; `none` proposes nothing, so
  each target forward commits exactly one token (plain autoregressive decoding).
- Greedy output equals plain greedy decoding of the target, token for token. With int8 weights
  (speclm.quant.weights) the target's forward is batch-invariant, so this holds exactly; in fp32 the
  CPU's matmuls round by shape, so a floating-point near-tie can still flip a token.
- A request's output does not depend on which requests share its batch or when they joined: its
  rows of every forward compute what they would alone (speclm's kernels and per-query
  attention, on quantized weights), its draft draws only from its own generator, and a draft
  model reads only its own prompt (speclm.proposers.draft_vocab.RowVocabs).
- Sampled output follows the target's processed distribution exactly.
- A request stops at any EOS id (which is returned; unless it set ignore_eos), at exactly its
  max_new_tokens, or when a stop string appears (the text ends before it; the ids end with the token that completed it).
- A request may start from the keys and values of the longest prefix its prompt shares with a
  recent prompt (speclm.forward.prefix_cache), only where those are the bits its own prefill would
  compute.

A step is one of:
- the prefill of the requests that joined since the last step: their prompts in one forward of
  their own (as plain decoding reads a prompt, so that its keys and values are the same bits
  with and without speculation), which commits each one's first token. With `prefill_chunk`, a
  prompt is read at most that many tokens per step while other requests decode, and prefill
  steps alternate with rounds, so that they keep committing tokens while a long prompt is read
  (with none decoding, a prompt is read whole). Chunks only where
  the forward is chunk-invariant (speclm's kernels on quantized weights: a token's keys and
  values are the same bits however its prompt is split); elsewhere a prompt is read whole;
- a round for every other request (`_round`): propose -> score -> verify -> commit.
A request may come with its draft (speclm.requests.Given: remote verification, speclm.serve.remote):
its prefill forward keeps the logits of the draft and the token before it, the same verifier
decides, and the request commits the accepted tokens and the target's one and leaves.
A round's draft length may be capped per group by a `speculation` policy
(speclm.round.adaptive.Adaptive: from the batch's size, the measured forward costs and the rows'
acceptance; 0 is plain decoding for that round); greedy output does not depend on it.
Requests with equal proposer options (GenerationOptions.proposer_key) share one proposer, which
drafts their rows together; each request's tokens are verified with its own sampling options.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from speclm.constraint import forbid
from speclm.errors import UsageError
from speclm.forward.cache import StaticKV
from speclm.options import GenerationOptions
from speclm.proposers import Draft, Proposer, Verified
from speclm.requests import Request, TokenLogprob
from speclm.text import stop_cut
from speclm.tree import PAD, ROOT, DraftTree
from speclm.round.verify import Verdict, verify_tree


@dataclass
class _Group:
    """Requests that share a proposer (equal GenerationOptions.proposer_key), in its row order."""

    options: GenerationOptions
    proposer: Proposer | None
    requests: list[Request]


@dataclass
class _Proposal:
    """One group's part of a round."""

    group: _Group
    rows: list[int]  # its requests' batch rows, in its order
    draft: Draft
    tree: DraftTree  # (G, N_g)
    sizes: list[int]  # per request: its tree's nodes
    depths: list[int]  # per request: its tree's depth (the longest path it can accept)
    seconds: float  # proposing
    prefill_seconds: float  # of which the draft model's reading of prompts
    forward_seconds: float  # of which inside the draft model's forwards
    # per request: its constraint's (1 + N_g, W) int32 bitmasks at its root and after each node
    # (speclm.constraint.Matcher.masks), or None (unconstrained); None: no request of the group is
    masks: list[torch.Tensor | None] | None = None


@dataclass
class _Scored:
    """The round's target forward."""

    logits: torch.Tensor  # (B, 1 + N, V): at each row's root (its last committed token) and at its nodes
    lengths: list[int]  # per row: committed tokens before the round
    seconds: float  # in the target's forward


class Batch:
    """Requests decoding together. `join` adds one (it starts at the next step); `step` runs one
    target forward and returns the requests that committed tokens; a finished request has left
    by the time `step` returns it."""

    def __init__(self, engine, rows: int = 1, capacity: int = 0, prefill_chunk: int | None = None,
                 speculation=None):
        """rows: the batch's expected most requests at once (its caches' rows; more are made room
        for by copying); capacity: tokens a request may hold (prompt + max_new_tokens), at least;
        prefill_chunk: prompt tokens a request reads per step at most (None: whole);
        speculation: a policy capping each round's draft length (speclm.round.adaptive; None: the
        methods' own k)."""
        if prefill_chunk is not None and prefill_chunk < 1:
            raise UsageError(f"prefill-chunk must be >= 1 token, got {prefill_chunk}")
        self.engine, self.rows, self.capacity = engine, max(1, rows), capacity
        self.prefill_chunk, self.speculation = prefill_chunk, speculation
        self.kv: StaticKV | None = None  # the target's cache, made at the first prefill
        self.requests: list[Request] = []  # decoding, in the target cache's row order
        self.reading: list[Request] = []  # prompts partly read; their cache rows follow those of `requests`
        self.joining: list[Request] = []
        self._read_next = True  # with chunked prefill: whether the next step reads (else a round)
        self.last_step = ""  # what the last step was: "prefill" or "round"
        self.groups: dict[GenerationOptions, _Group] = {}
        self._prompt_hidden: dict[int, dict[int, list[torch.Tensor]]] = {}  # by id(request): a proposer's prompt states, by layer
        self.eos = set(engine.target.eos_token_ids)
        self._policy = None  # the policy the round in progress was planned by

    def join(self, request: Request) -> Request:
        if request.done or any(r is request for r in self.requests + self.joining):
            raise UsageError("a request joins one batch once, before it is done")
        self.joining.append(request)
        return request

    def cancel(self, request: Request) -> None:
        """The request stops now (finish_reason "cancelled"); its cache rows are free at once."""
        if request.done:
            return
        request.finish_reason = "cancelled"
        if any(r is request for r in self.joining):
            self.joining = [r for r in self.joining if r is not request]
        else:
            self._leave()

    @property
    def size(self) -> int:
        return len(self.requests) + len(self.reading) + len(self.joining)

    @property
    def active(self) -> bool:
        return bool(self.requests or self.reading or self.joining)

    def step(self) -> list[Request]:
        """One target forward: a prefill (of what joined, or a chunk of what is being read) or a
        round. Returns the requests that committed tokens."""
        if self.joining:
            self._admit()
        read = bool(self.reading) and (self._read_next or not self.requests)
        self._read_next = not read
        if read:
            self.last_step = "prefill"
            return self._prefill()
        if self.requests:
            self.last_step = "round"
            return self._round()
        return []

    # ---------------------------------------------------------------- joining
    def _group(self, options: GenerationOptions, joining: list[Request]) -> _Group:
        key = options.proposer_key()
        group = self.groups.get(key)
        if group is None:
            proposer = self.engine.make_proposer(options)
            group = self.groups[key] = _Group(key, proposer, [])
            if proposer is not None:
                proposer.start(0, self._capacity(joining), pool=self.rows)
        return group

    def _widest_round(self) -> int:
        """The most tokens a round feeds a row: its proposer's widest draft and the token before it."""
        return max((g.proposer.max_nodes for g in self.groups.values() if g.proposer), default=0) + 1

    def _capacity(self, requests: list[Request]) -> int:
        """Tokens per cache row: the longest request, and one round past its last token (a final
        round may feed a whole draft beyond it). A longer one later grows the caches (a copy)."""
        longest = max([self.capacity] + [r.prompt_len + r.max_new for r in requests])
        return longest + self._widest_round()

    def _admit(self) -> None:
        """Requests that joined take cache rows (after those of the others) and start from the
        longest prefix of their prompt the prefix cache holds; they are read from the next step."""
        joining, self.joining = self.joining, []
        now = time.perf_counter()
        for r in joining:
            self._group(r.options, joining)  # a group's proposer is sized for its first requests
        capacity = self._capacity(joining)
        if self.kv is None:
            self.kv = StaticKV(self.engine.target.model, 0, capacity, pool=self.rows)
        self.kv.reserve(capacity, self._widest_round())  # a longer request or a wider round than before: one copy
        rows = self.kv.add(len(joining))
        cache = self.engine.prefix.target
        for b, r in zip(rows, joining):
            r.joined_at = now
            proposer = self.groups[r.options.proposer_key()].proposer
            layers = proposer.hidden_layers if proposer is not None and proposer.prompt_hidden == "all" else ()
            r.stats.cached_tokens, hidden = cache.reuse_states(self.kv, b, r.prompt, r.prompt_len - r.tail, tuple(layers))
            if hidden:  # the head reads the cached prefix's features as if it had read them
                self._prompt_hidden[id(r)] = {layer: [h] for layer, h in hidden.items()}
        self.reading += joining

    def _prefill(self) -> list[Request]:
        """One forward over the prompts being read (each whole, or its next chunk); a request
        whose prompt is then read commits its first token and starts decoding."""
        kv, reading, first_row = self.kv, self.reading, len(self.requests)
        rows = list(range(first_row, first_row + len(reading)))
        have = kv.lengths_list()
        # chunks only while others decode (they are what chunks are for), and only where the split
        # changes no bit
        chunk = self.prefill_chunk if self.prefill_chunk and kv.chunk_invariant and self.requests else None
        ends = [r.prompt_len if chunk is None else _chunk_end(have[b], chunk, r) for b, r in zip(rows, reading)]
        kept = [r.tail if end == r.prompt_len else 1 for r, end in zip(reading, ends)]  # a given draft's logits too
        seen = kv.forward_seconds
        proposers = [self.groups[r.options.proposer_key()].proposer for r in reading]
        wanted = tuple(sorted({layer for p in proposers if p is not None and p.prompt_hidden for layer in p.hidden_layers}))
        every = any(p is not None and p.prompt_hidden == "all" for p in proposers)
        logits = kv.forward([r.context[have[b]:end] for b, r, end in zip(rows, reading, ends)], max(kept), only=rows,
                            hidden_layers=wanted, hidden_all=every, kept=kept if max(kept) > 1 else None)  # (R, T, V)
        if wanted:
            self._keep_prompt_hidden(reading, proposers, [end - have[b] for b, end in zip(rows, ends)], every)
        spent = kv.forward_seconds - seen
        done = [i for i, (r, end) in enumerate(zip(reading, ends)) if end == r.prompt_len]
        for r in reading:
            r.stats.target_forwards += 1
            r.stats.forward_seconds += spent
        if not done:
            return []
        read = [reading[i] for i in done]
        cache = self.engine.prefix.target
        states = {}  # id(request) -> layer -> its prompt's hidden states, as its proposer reads them
        for i in done:
            r = reading[i]
            states[id(r)] = {layer: torch.cat(parts) for layer, parts in self._prompt_hidden.pop(id(r), {}).items()}
            whole = states[id(r)] and proposers[i].prompt_hidden == "all" and all(
                len(h) == r.prompt_len for h in states[id(r)].values())
            if r.given is not None:  # its draft, verified: what it commits and what the cache keeps
                self._verify_given(r, rows[i], logits[i, : r.tail])
            else:
                cache.add(kv, rows[i], r.prompt, states[id(r)] if whole else None)
        # the read requests decode from now on: their rows move up behind the decoding ones (a
        # permutation of the batch's rows; no keys or values move)
        still = [i for i, end in enumerate(ends) if end < reading[i].prompt_len]
        kv.select(list(range(first_row)) + [rows[i] for i in done] + [rows[i] for i in still])
        self.reading = [reading[i] for i in still]
        for r in read:
            group = self._group(r.options, read)
            group.requests.append(r)
            if group.proposer is not None:
                group.proposer.add(1, [r.prompt_len], [r.max_new])
                if group.proposer.prompt_hidden:  # "all": the states from the first it has (the prefix's, if cached)
                    hidden = states[id(r)]
                    start = r.prompt_len - len(next(iter(hidden.values()))) if group.proposer.prompt_hidden == "all" \
                        else r.stats.cached_tokens
                    group.proposer.read_prompt([hidden], [start])
        self.requests += read
        by_sampling: dict = {}  # each one's first token, drawn with its own options
        for j, i in enumerate(done):
            if reading[i].given is None:
                by_sampling.setdefault(reading[i].options.sampling, []).append((j, i))
        for i in done:  # a constrained request's first token: its constraint's mask at the start
            matcher = reading[i].matcher if reading[i].given is None else None
            if matcher is not None:
                forbid(logits[i, :1], matcher.mask())
        for params, at in by_sampling.items():
            first = verify_tree(logits[[i for _, i in at]], Draft.empty(len(at)).tree(), params,
                                [reading[i].generator for _, i in at], coupled=[_coupled(reading[i]) for _, i in at])
            for n, (_, i) in enumerate(at):
                self._commit(reading[i], first.committed(n), logits[i, :1])
        for r in read:
            s = r.stats
            s.wall_seconds = s.verify_seconds = time.perf_counter() - r.joined_at
            s.prefill_seconds = s.wall_seconds
            s.new_tokens = len(r.generated)
        self._leave()
        return read

    def _verify_given(self, r: Request, row: int, logits: torch.Tensor) -> None:
        """r's prompt ends with a given draft (remote verification); logits (1 + K, V): the target's
        at the token before it and at each of its tokens. The one verifier decides, as in a round;
        r's prompt loses the draft, r commits the accepted tokens and the target's one, and ends;
        the prefix cache keeps the context with the accepted tokens (what the next call reuses)."""
        given, k = r.given, len(r.given.tokens)
        r.prompt_len -= k
        base = r.prompt_len
        del r.context[base:]
        draft = Draft.from_rows([given.tokens], given.probs[None] if given.probs is not None else None)
        verdict = verify_tree(logits[None], draft.tree(), r.options.sampling, [r.generator],
                              coupled=[(r.coupled, base) if r.coupled is not None else None])
        new = verdict.committed(0)
        accepted = len(new) - 1
        self.engine.prefix.target.add(self.kv, row, r.context + new[:-1])
        s = r.stats
        s.drafted_tokens, s.verified_nodes, s.accepted_tokens = s.drafted_tokens + k, s.verified_nodes + k, s.accepted_tokens + accepted
        for counts, n in ((s.drafted_per_position, k), (s.accepted_per_position, accepted)):
            counts += [0] * (n - len(counts))
            for j in range(n):
                counts[j] += 1
        self._commit(r, new, logits)
        if r.finish_reason is None:
            r.finish_reason = "verified"

    def _keep_prompt_hidden(self, reading: list[Request], proposers: list, fed: list[int], every: bool) -> None:
        """Keep what each reading request's proposer asked of this prefill forward's hidden states
        (its chunk's states, all or the last token's) until its prompt is read."""
        for i, (r, p, n) in enumerate(zip(reading, proposers, fed)):
            if p is None or not p.prompt_hidden:
                continue
            kept = self._prompt_hidden.setdefault(id(r), {})
            for layer in p.hidden_layers:
                states = self.kv.hidden[layer][i]  # (M, E) with hidden_all, else (1, E): the last fed token's
                part = states[:n] if every else states
                if p.prompt_hidden == "last":
                    kept[layer] = [part[-1:].clone()]
                else:
                    kept.setdefault(layer, []).append(part.clone())

    # ---------------------------------------------------------------- a round
    def _round(self) -> list[Request]:
        """propose -> score -> verify -> commit, each one call. Returns the round's requests (those
        that finished too: they have left by then)."""
        requests = self.requests
        proposals = self._propose_all()
        t1 = time.perf_counter()
        scored = self._score(proposals)
        for p in proposals:  # constrained rows: the logits of what their constraint forbids at each node, -inf
            for i, mask in enumerate(p.masks or ()):
                if mask is not None:
                    forbid(scored.logits[p.rows[i], : mask.shape[0]], mask)
        verdicts = [self._verify(p, scored.logits) for p in proposals]
        t2 = time.perf_counter()
        self._commit_round(proposals, verdicts, scored, verify_seconds=t2 - t1)
        if self._policy is not None:  # the round past its proposals against its forward's price
            self._policy.timed(time.perf_counter() - t1)
        self._leave()
        return requests

    @property
    def policy(self):
        """The speculation policy of this batch's rounds: its own, else, while an auto group
        (Proposer.plans) decodes, the engine's planner (which leaves the other groups' k alone)."""
        if self.speculation is not None:
            return self.speculation
        if any(g.proposer is not None and g.proposer.plans for g in self.groups.values()):
            return self.engine.planner()
        return None

    def _propose_all(self) -> list[_Proposal]:
        """1. propose: each group's draft for its rows, capped by the speculation policy (auto
        groups: planned per row)."""
        row_of = {id(r): b for b, r in enumerate(self.requests)}
        policy = self._policy = self.policy
        caps = policy.caps(self) if policy is not None else {}
        return [self._propose(g, [row_of[id(r)] for r in g.requests], caps.get(key))
                for key, g in self.groups.items() if g.requests]

    def _score(self, proposals: list[_Proposal]) -> _Scored:
        """2. score: one target forward over every row's unseen committed tokens and draft tree."""
        kv = self.kv
        seen = kv.forward_seconds  # the target's own forwards from here (a self-draft's ran on its runner)
        tree = _batch_tree(proposals, len(self.requests))  # (B, N)
        contexts = [r.context for r in self.requests]
        feed, parents, spans = _feed(contexts, kv.lengths_list(), tree)
        wanted = tuple(sorted({layer for p in proposals if p.group.proposer for layer in p.group.proposer.hidden_layers}))
        only = list(range(len(self.requests))) if self.reading else None  # rows still reading sit this out
        logits = kv.forward(feed, 1 + tree.width, parents=parents, hidden_layers=wanted, only=only,
                            kept=[1 + n for n in spans])  # (B, 1 + N, V), zeros past a row's span
        return _Scored(logits, [len(c) for c in contexts], kv.forward_seconds - seen)

    def _commit_round(self, proposals: list[_Proposal], verdicts: list[Verdict], scored: _Scored,
                      verify_seconds: float) -> None:
        """4. commit: each row's accepted path moves into place in the cache (the rest is rolled
        back by length), its proposer hears what was accepted, and its tokens are committed."""
        requests, kv = self.requests, self.kv
        paths: list[list[int]] = [[] for _ in requests]
        for p, verdict in zip(proposals, verdicts):
            for i, b in enumerate(p.rows):
                paths[b] = verdict.paths[i]
        keep = [n + len(path) for n, path in zip(scored.lengths, paths)]
        for b, (n, path) in enumerate(zip(scored.lengths, paths)):
            kv.move_path(b, [n + j for j in path], n)  # the accepted path's keys and values into place
        kv.truncate(keep + [kv.capacity] * len(self.reading))
        for p, verdict in zip(proposals, verdicts):
            proposer = p.group.proposer
            counts = None
            if proposer is not None:
                hidden = {layer: kv.hidden[layer][p.rows, : 1 + p.tree.width] for layer in proposer.hidden_layers}
                logits = scored.logits[p.rows, : 1 + p.tree.width] if proposer.needs_logits else None
                proposer.accept(Verified([keep[b] for b in p.rows], verdict.paths, hidden or None, logits))
                counts = proposer.round_counts()
            for i, b in enumerate(p.rows):
                r = requests[b]
                self._count(r, p, i, verdict, verify_seconds, scored.seconds)
                if counts is not None:
                    r.stats.add_counts(counts[i])
                if self._policy is None:
                    pass
                elif proposer is not None and proposer.plans:  # auto: its row's child, timed apart
                    child = proposer.last[i].child
                    if child is not None:
                        seconds, reading, forwards, rows = proposer.spent.get(child, (0.0, 0.0, 0, 1))
                        cap = (min(proposer.last[i].k, r.tokens_left - 1)  # what it could draft
                               if proposer.children[child].shape != "tree" else None)
                        self._policy.observe(r, int(p.draft.lengths[i]), len(verdict.paths[i]), seconds - reading,
                                             forwards, rows, child=child, cap=cap)
                else:
                    self._policy.observe(r, int(p.draft.lengths[i]), len(verdict.paths[i]),
                                         p.seconds - p.prefill_seconds, p.draft.forwards,
                                         p.draft.forward_rows or len(p.rows))
                columns = [0] + [1 + n for n in verdict.paths[i]]  # where each committed token was scored
                self._commit(r, verdict.committed(i), scored.logits[b, columns] if r.options.logprobs is not None else None)
                r.stats.new_tokens = len(r.generated)
                r.stats.wall_seconds = time.perf_counter() - r.joined_at

    def _propose(self, group: _Group, rows: list[int], cap: int | None = None) -> _Proposal:
        """The group's draft for its requests, at batch rows `rows`; cap: its most draft tokens
        per row this round (None: the proposer's k; 0: none, plain decoding)."""
        proposer = group.proposer
        t0 = time.perf_counter()
        if proposer is None or cap == 0:
            draft = Draft.empty(len(rows))
            prefill = forwards = 0.0
        else:
            read_before, forwards_before = proposer.prefill_seconds, proposer.forward_seconds
            # each row's budget: min(k, tokens left - 1), so a commit never passes max_new_tokens
            k = proposer.k if cap is None else min(proposer.k, cap)
            budgets = [min(k, r.tokens_left - 1) for r in group.requests]
            if proposer.drafts_on_target:  # the target's own layers draft, over its cache's rows
                proposer.bind_target(self.kv, rows)
            proposer.draws = [r.coupled for r in group.requests]  # seeded rows: draws by position
            proposer.guides = [r.matcher for r in group.requests]  # constrained rows: drafts masked where they can be
            draft = proposer.propose([r.context for r in group.requests], budgets, group.options.sampling,
                                     [r.generator for r in group.requests]).trimmed()
            prefill = proposer.prefill_seconds - read_before
            forwards = proposer.forward_seconds - forwards_before
        tree = draft.tree()
        masks = None
        if any(r.matcher is not None for r in group.requests):
            tree, masks = _fence(group, tree)
        return _Proposal(group, rows, draft, tree, tree.sizes, tree.max_depths(), time.perf_counter() - t0, prefill,
                         forwards, masks)

    @staticmethod
    def _verify(p: _Proposal, logits: torch.Tensor) -> Verdict:
        """The group's rows, verified with its sampling options; each request draws from its own generator."""
        return verify_tree(logits[p.rows, : 1 + p.tree.width], p.tree, p.group.options.sampling,
                           [r.generator for r in p.group.requests], acceptance=p.group.options.acceptance,
                           coupled=[_coupled(r) for r in p.group.requests])

    @staticmethod
    def _count(r: Request, p: _Proposal, i: int, verdict: Verdict, verify_seconds: float, target_seconds: float) -> None:
        s, draft = r.stats, p.draft
        s.target_forwards += 1
        s.draft_forwards += draft.forwards
        s.draft_seconds += p.seconds
        s.draft_prefill_seconds += p.prefill_seconds
        s.verify_seconds += verify_seconds
        s.forward_seconds += target_seconds + p.forward_seconds
        size = p.sizes[i]
        s.verified_nodes += size
        accepted = len(verdict.paths[i])
        if draft.alternatives is not None and draft.parents is None:  # a chain's extra leaves, counted apart
            chain = int(draft.lengths[i])
            s.alternatives += size - chain
            s.accepted_alternatives += int(accepted > 0 and verdict.paths[i][-1] >= draft.width)
            s.record_acceptance(chain, accepted)
        else:
            s.record_acceptance(size, accepted, p.depths[i])

    # ---------------------------------------------------------------- committing and leaving
    def _commit(self, r: Request, new: list[int], logits: torch.Tensor | None = None) -> None:
        """r commits `new`, cut at an end of sequence, a stop string or its length; logits (len(new),
        V): the target's where each was committed (its log-probabilities, where it asks)."""
        first_new = len(r.generated)
        for i, t in enumerate(new):
            if t in self.eos and not r.options.ignore_eos:
                new, r.finish_reason = new[: i + 1], "stop"
                break
        r.context.extend(new)
        if r.matcher is not None:
            r.matcher.commit(new)
            r.stats.constraint_seconds = r.matcher.mask_seconds
        cut = stop_cut(self.engine.target.tokenizer, r.generated, first_new, r.options.stop)
        if cut is not None:
            del r.context[r.prompt_len + cut :]
            r.finish_reason = "stop"
        elif r.finish_reason is None and len(r.generated) >= r.max_new:
            r.finish_reason = "length"
        if r.options.logprobs is not None and logits is not None:
            kept = r.generated[first_new:]
            r.logprobs += _logprobs(logits[: len(kept)], kept, r.options.logprobs)

    def _leave(self) -> None:
        """Finished requests leave: their cache rows are free for the next to join."""
        rows = self.requests + self.reading
        still = [b for b, r in enumerate(rows) if not r.done]
        if len(still) == len(rows):
            return
        self.kv.select(still)
        for r in rows:
            if r.done:
                self._prompt_hidden.pop(id(r), None)
        self.requests = [r for r in self.requests if not r.done]
        self.reading = [r for r in self.reading if not r.done]
        awaited = {r.options.proposer_key() for r in self.reading}  # groups made for prompts still being read
        for key, group in list(self.groups.items()):
            kept = [i for i, r in enumerate(group.requests) if not r.done]
            if len(kept) < len(group.requests):
                group.requests = [group.requests[i] for i in kept]
                if group.proposer is not None:  # none kept too: a group kept for a prompt being read starts empty
                    group.proposer.select(kept)
            if not group.requests and key not in awaited:
                del self.groups[key]  # its proposer's caches go with it


def _batch_tree(proposals: list[_Proposal], batch: int) -> DraftTree:
    """Every group's tree in one (B, N) tree for the target's forward (probabilities stay with
    each group's own tree, which its verification reads)."""
    width = max((p.tree.width for p in proposals), default=0)
    tokens = torch.zeros(batch, width, dtype=torch.long)
    parents = torch.full((batch, width), PAD, dtype=torch.long)
    for p in proposals:
        if p.tree.width:
            rows = torch.tensor(p.rows, dtype=torch.long)
            tokens[rows, : p.tree.width] = p.tree.tokens
            parents[rows, : p.tree.width] = p.tree.parents
    return DraftTree(tokens, parents, None)


def _feed(contexts: list[list[int]], have: list[int], tree: DraftTree
          ) -> tuple[list[list[int]], list[list[int]] | None, list[int]]:
    """What the target reads this round, per row: the committed tokens it has not seen (the last
    of them the tree's root), then the tree's nodes up to the row's last real one (its span: a
    padding node between real ones is fed too, so that node n's logits sit at column 1 + n; the
    padding after them is not, so a row drafting less than the widest costs the forward only its
    own tokens). Per token its parent's slot (speclm.forward.cache.StaticKV.forward), or None where
    every row is a chain: node n sits at slot len(context) + n. And per row its span."""
    nodes = tree.tokens.tolist()
    parents = tree.parents.tolist()
    feed, links, spans, chain = [], [], [], True
    for c, h, row, up in zip(contexts, have, nodes, parents):
        span = next((n + 1 for n in range(len(up) - 1, -1, -1) if up[n] != PAD), 0)
        row, up = row[:span], up[:span]
        spans.append(span)
        feed.append(c[h:] + row)
        # a padding node (after every real one) continues from the node before it, as in a chain
        slot = [len(c) - 1 if p == ROOT or (p == PAD and n == 0) else len(c) + n - 1 if p == PAD else len(c) + p
                for n, p in enumerate(up)]
        chain = chain and all(s == len(c) + n - 1 for n, s in enumerate(slot))
        links.append([-1] * (len(c) - h) + slot)
    return feed, None if chain else links, spans


def _logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """logits (M, V): the target's where tokens (M,) were committed -> each token's log-probability
    at temperature 1 and the `top` likeliest there (tokens a constraint forbids, at -inf, left out)."""
    with torch.inference_mode():
        logp = torch.log_softmax(logits.float().cpu(), -1)  # (M, V)
        chosen = logp[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)].tolist()
        best = logp.topk(top, -1) if top else None
    out = []
    for j, (token, value) in enumerate(zip(tokens, chosen)):
        pairs = () if best is None else tuple(
            (int(t), float(v)) for t, v in zip(best.indices[j].tolist(), best.values[j].tolist()) if v != float("-inf"))
        out.append(TokenLogprob(token, float(value), pairs))
    return out


def _fence(group: _Group, tree: DraftTree) -> tuple[DraftTree, list[torch.Tensor | None]]:
    """The group's tree less what its constrained rows' constraints forbid, and those rows' masks
    (speclm.constraint: a forbidden node ends its branch; it stays as a leaf only where a draft
    sampled it, unseeded, for the verifier to reject it against its distribution)."""
    parents = tree.parents.clone()
    tokens, rows = tree.tokens.tolist(), tree.parents.tolist()
    masks: list[torch.Tensor | None] = []
    for b, r in enumerate(group.requests):
        if r.matcher is None:
            masks.append(None)
            continue
        mask, forbidden, ends = r.matcher.masks(tokens[b], rows[b])
        masks.append(mask)
        sampled = tree.probs is not None and not group.options.sampling.greedy and r.coupled is None
        ended = set(forbidden) | set(ends)  # these and, below them, every node (parents come first)
        for n, parent in enumerate(rows[b]):
            if parent in ended:
                ended.add(n)
        for n in ended:
            if n not in ends and not (sampled and n in forbidden):
                parents[b, n] = PAD
    return DraftTree(tree.tokens, parents, tree.probs), masks


def _chunk_end(have: int, chunk: int, r: Request) -> int:
    """Where the chunk of r's prompt read this step ends: `chunk` tokens on, but never leaving a last
    chunk shorter than the tail whose logits it keeps (a given draft and the token before it)."""
    end = min(r.prompt_len, have + chunk)
    if end < r.prompt_len and r.prompt_len - end < r.tail:
        end = r.prompt_len - r.tail if r.prompt_len - r.tail > have else r.prompt_len
    return end


def _coupled(r: Request):
    """A seeded sampled request's draws and the position of the token after its context (verify_tree)."""
    return (r.coupled, len(r.context)) if r.coupled is not None else None
