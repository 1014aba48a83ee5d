"""Speculation that adapts to the batch: each round's draft length from measured costs.

On a CPU a target forward's cost grows with the tokens it reads (speclm.forward.costs), and a
batch of B rows that each verify k drafted tokens reads B * (k + 1) of them. With one row reading
the weights dominates and drafting is nearly free to verify; with many rows every drafted token
is paid for whether it is accepted or not. So before
each round `Adaptive.caps` picks the draft length k (0: plain decoding) that maximises the
tokens the round is expected to commit per second:

    sum over rows of E[tokens | k, a_row]  /  (T(B * (1 + k)) + drafting time for k)

where E = (1 - a^(k+1)) / (1 - a) for a chain whose row accepts each next token with
probability a. Each row's a is measured from its own rounds (decayed counts, starting from
`prior`); a group's drafting time per draft forward is measured too. A tree-shaped draft is
either kept whole or turned off (k = 0) by the same comparison, its expected tokens measured.
While k = 0 nothing is learnt about acceptance, so for prompt lookup one round in `probe` drafts
anyway (k = 1): at most one round in 32 costs a few more verified tokens per row. A draft model is
not probed: after rounds without drafting it would first have to read every token it missed
(and a new request's whole prompt), which at the load that turned it off costs more than the
probe can win; it drafts again when the batch is small enough for its last measured acceptance.
What a draft forward costs is measured by the number of rows it drafted for (a forward for 8 rows
costs more than one for 1), without the time a draft spends reading tokens committed while it sat
out (its prefill): priced at a burst's width or with a catch-up in it, a draft would look too dear
to turn on again once the load is gone. Until a draft model has run, its forward is priced by its
own measured cost line (`draft_costs`, measured as the target's), not as free. A round that
`draft+pld` drafted by lookup alone ran no draft forward, and its time (a lookup's) is not kept
as one: counted as one, it would price the model's forwards and its reading at a fraction of their
cost, and the policy would turn the draft on for the last rows of a burst, paying to read their
prompts for the few tokens they have left. That reading is priced apart: a draft model about to draft
for rows it has not read (a new request's prompt, tokens committed while it was off) costs the
round a share of reading them (the draft's cost line over those tokens; without one, the
target's scaled by the draft's measured step against the target's), the share being one over
the rounds the request has left, over which the reading pays off.

The forward cost table is measured on one row; a round's forward reads B rows of 1 + k tokens
(each row attending its own context) and the round adds bookkeeping to its forwards, so the
table alone can price a drafting round too low and a plain one too high (on the 2-core AVX-512
EPYC the policy drafted at 4 rows and served 0.88x the tokens/s of not drafting:
the serving run of a864972). Each round's measured seconds (the draft's
reading of unread tokens left out) are therefore kept against its predicted seconds, as a decayed
ratio per batch size and per drafting or not (`timed`), and every candidate's price is scaled by
its ratio (`ratio`).

A request that sets k keeps it. Greedy output does not depend on the draft, so it is unchanged.
A sampled request that asked for a seed keeps its method's fixed k: its draws then depend on
nothing but its own seed, so it is reproducible in any batch; an unseeded one adapts (its output
follows the target's distribution whatever the draft).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

from speclm import defaults
from speclm.methods import DRAFT_MODEL
from speclm.forward.costs import ForwardCosts, StepTimes


@dataclass
class _Rate:
    """One request's acceptance, as decayed counts."""

    hits: float = 0.0
    tries: float = 0.0
    gained: float = 0.0  # a tree's: accepted tokens per round
    rounds: float = 0.0


class Adaptive:
    def __init__(self, costs: ForwardCosts, prior: float = defaults.ADAPTIVE_PRIOR, decay: float = defaults.ADAPTIVE_DECAY, probe: int = 32,
                 draft_costs: Callable[[int], float] | None = None):
        """costs: the target's forward seconds by tokens read; draft_costs: the draft model's (None:
        its forwards are known only once measured here)."""
        self.costs, self.prior, self.decay, self.probe = costs, prior, decay, probe
        self.draft_costs = draft_costs
        self._ran_model: set = set()  # group keys whose proposals ran model forwards
        self._rounds = 0
        self._rates: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Request -> _Rate
        self._step: dict = {}  # group key -> StepTimes by rows drafted for: a draft forward (or proposal, where none)
        self._nodes: dict = {}  # group key -> decayed mean of the nodes a row's draft held
        self._ratios = {False: StepTimes(), True: StepTimes()}  # drafting or not -> measured / predicted seconds, by rows
        self._predicted: tuple[int, bool, float] | None = None  # the last round's (rows, drafting, seconds) as priced
        self.last: dict = {}  # the last round's caps, for metrics and tests

    def acceptance(self, request) -> float:
        """The request's estimated probability of accepting the next drafted token."""
        rate = self._rates.get(request)
        prior_weight = 2.0
        if rate is None:
            return self.prior
        return (rate.hits + self.prior * prior_weight) / (rate.tries + prior_weight)

    def observe(self, request, drafted: int, accepted: int, propose_seconds: float, forwards: int,
                rows: int = 1) -> None:
        """One round of `request`: `drafted` tokens proposed (a tree's nodes), `accepted` on its path;
        its group's proposal took propose_seconds (its prefill left out) over `forwards` draft
        forwards for `rows` rows."""
        if drafted <= 0:
            return
        rate = self._rates.setdefault(request, _Rate())
        d = self.decay
        rate.hits = d * rate.hits + accepted
        rate.tries = d * rate.tries + min(accepted + 1, drafted)
        rate.gained = d * rate.gained + accepted
        rate.rounds = d * rate.rounds + 1
        key = request.options.proposer_key()
        if forwards > 0:
            if key not in self._ran_model:  # proposals without a forward kept before say nothing of one
                self._ran_model.add(key)
                self._step[key] = StepTimes()
            self._step[key].record(rows, propose_seconds / forwards)  # per draft forward
        elif key not in self._ran_model:  # prompt lookup: per proposal
            self._step.setdefault(key, StepTimes()).record(rows, propose_seconds)
        old = self._nodes.get(key)  # a tree's verified nodes per row, as its proposer sized them
        self._nodes[key] = drafted if old is None else 0.8 * old + 0.2 * drafted

    def ratio(self, rows: int, drafting: bool) -> float:
        """Measured over predicted seconds of rounds of `rows` rows that drafted (or not): at that
        size, else at the nearest size measured (the smaller on a tie); 1 where no round of that
        kind ran yet, so that a kind priced dearer by its rounds is tried against the table's price
        of the other and measured too."""
        return self._ratios[drafting].at(rows, lambda n: 1.0) or 1.0  # a ratio does not scale with rows

    def timed(self, seconds: float) -> None:
        """The round `caps` last priced took `seconds` (its draft model's reading of tokens it had
        not read left out, which is priced apart): kept as a ratio to the price."""
        if self._predicted is None:
            return
        rows, drafting, predicted = self._predicted
        self._predicted = None
        ratio = min(max(seconds / max(predicted, 1e-9), 0.25), 4.0)  # one stall (a page fault storm) moves it little
        self._ratios[drafting].record(rows, ratio)

    def _expected(self, request, k: int, tree: bool) -> float:
        """Tokens a round commits for `request` with draft length k (the target's own token included)."""
        if k == 0:
            return 1.0
        if tree:
            rate = self._rates.get(request)
            return 1.0 + (rate.gained / rate.rounds if rate is not None and rate.rounds else self.prior * 2)
        a = min(self.acceptance(request), 0.999)
        return (1.0 - a ** (k + 1)) / (1.0 - a)

    @staticmethod
    def _unread(g) -> list[int] | None:
        """Per row of the group, the tokens its draft model has not read (None: no draft model)."""
        return g.proposer.unread([r.context for r in g.requests]) if g.proposer.reads_context else None

    def _step_seconds(self, key, rows: int, unread: list[int] | None = None) -> float:
        """Seconds of the group's draft forward for `rows` rows (StepTimes.at); a draft model's
        before it ran, its cost line's, unless the group's rows (`unread`: their _unread, where
        known) have nothing for it to read and draft for (`draft+pld` rows with long prompts are
        lookup's alone: those proposals are priced as measured); else 0 before any."""
        if (key.spec.needs == DRAFT_MODEL and key not in self._ran_model and self.draft_costs is not None
                and (unread is None or any(unread))):
            return self.draft_costs(rows)
        steps = self._step.get(key)
        seconds = steps.at(rows, self.costs) if steps is not None else None
        return seconds or 0.0

    def _catch_up(self, key, g, own: int, is_tree: bool, unread: list[int] | None = None) -> float:
        """This round's share of the seconds the group's draft model would spend reading the tokens
        of its rows it has not seen: each row's over the rounds it has left at this draft length.
        `unread`: the group's _unread, where the caller has it."""
        if not own or not g.proposer.reads_context:
            return 0.0
        if unread is None:
            unread = self._unread(g)
        rows = len(g.requests)
        if self.draft_costs is not None:
            reading = self.draft_costs
        else:
            ratio = self._step_seconds(key, rows) / self.costs(rows)  # the draft's forward against the target's
            reading = lambda n: ratio * self.costs(n)  # noqa: E731
        seconds = 0.0
        for r, unseen in zip(g.requests, unread):
            if unseen > 2:  # more than a round's own: the target's token and a last draft
                rounds = max(1.0, r.tokens_left / self._expected(r, own, is_tree))
                seconds += reading(unseen) / rounds
        return seconds

    def _tree_width(self, key, g) -> int:
        """A tree's verified nodes per row: as measured (a tree sized by cost is far below its
        most), else its most."""
        seen = self._nodes.get(key)
        return g.proposer.max_nodes if seen is None else max(1, round(seen))

    def caps(self, batch) -> dict:
        """Per group key (GenerationOptions.proposer_key): its draft length cap this round (0: none;
        None: a tree kept whole)."""
        self._predicted = None
        groups = [(key, g) for key, g in batch.groups.items() if g.requests and g.proposer is not None]
        rows = len(batch.requests)
        # groups whose k this policy leaves alone: a k set by the request, or a seeded sampled request
        seeded = {key for key, g in groups if key.k is not None or any(r.seeded for r in g.requests)}
        trees = {key for key, g in groups if g.proposer.shape == "tree"}
        free = [(key, g) for key, g in groups if key not in seeded]
        if not free:
            self.last = {}
            return {}
        # rows whose draft this policy does not choose: plain ones commit one token, seeded ones their method's
        tokens0 = rows - sum(len(g.requests) for _, g in groups)
        width0 = 0
        for key, g in groups:
            if key in seeded:
                tokens0 += sum(self._expected(r, g.proposer.k, key in trees) for r in g.requests)
                width0 = max(width0, self._tree_width(key, g) if key in trees else g.proposer.k)
        longest = max((g.proposer.k for key, g in free if key not in trees), default=0)
        choices = [(k, on) for k in range(longest + 1) for on in ((False, True) if any(key in trees for key, _ in free) else (False,))]
        unread = {key: self._unread(g) for key, g in free}  # once a round, for every choice priced
        best, best_rate, priced = (0, False), -1.0, None
        for k, tree_on in choices:
            tokens, drafting, catch_up, width = tokens0, 0.0, 0.0, width0
            for key, g in free:
                is_tree = key in trees
                own = (g.proposer.k if tree_on else 0) if is_tree else min(k, g.proposer.k)
                tokens += sum(self._expected(r, own, is_tree) for r in g.requests)
                if own:
                    drafting += self._step_seconds(key, len(g.requests), unread[key]) * own
                    catch_up += self._catch_up(key, g, own, is_tree, unread[key])
                    width = max(width, self._tree_width(key, g) if is_tree else own)
            seconds = self.costs(rows * (1 + width)) + drafting
            rate = tokens / (seconds * self.ratio(rows, width > 0) + catch_up)
            if rate > best_rate * (1 + 1e-9):
                best, best_rate, priced = (k, tree_on), rate, (rows, width > 0, seconds)
        k, tree_on = best
        self._predicted = priced
        self.last = {key: (None if tree_on else 0) if key in trees else min(k, g.proposer.k) for key, g in free}
        self._rounds += 1
        if self._rounds % self.probe == 0:  # a probe: drafting off learns nothing about acceptance
            for key, g in free:
                if self.last[key] == 0 and not g.proposer.reads_context:  # no draft model to catch up
                    self.last[key] = 1
                    self._predicted = None  # not the round priced
        return self.last
