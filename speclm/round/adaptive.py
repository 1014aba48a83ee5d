"""Speculation that adapts to the batch: each round's draft length from measured costs.

On a CPU a target forward's cost grows with the tokens it reads (speclm.forward.costs), and a
batch of B rows that each verify k drafted tokens reads B * (k + 1) of them (a row drafting fewer
reads only its own: rounds feed no padding, speclm.round.batch._feed). With one row reading
the weights dominates and drafting is nearly free to verify; with many rows every drafted token
is paid for whether it is accepted or not. So before
each round `Adaptive.caps` picks the draft length k (0: plain decoding) that maximises the
tokens the round is expected to commit per second:

    sum over rows of E[tokens | k, a_row]  /  (T(B * (1 + k)) + drafting time for k)

where E = (1 - a^(k+1)) / (1 - a) for a chain whose row accepts each next token with
probability a. Each row's a is measured from its own rounds (decayed counts, starting from
`prior`); a group's drafting time per draft forward is measured too. A tree-shaped draft is
either kept whole or turned off (k = 0) by the same comparison, its expected tokens measured; until
its first round is measured it is kept whole (priced by its most nodes, it would stay off unmeasured).
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
the serving run of a864972). Each round's measured seconds past its proposals (scoring,
verifying, committing) are therefore kept against the table's price of its forward, as a decayed
ratio per batch size and per drafting or not (`timed`), and every candidate's forward is scaled by
its ratio (`ratio`). Only the forward: its draft forwards are priced as measured here, at this
machine's speed now. Where the forward runs slower than its table and the ratio also scaled the
draft forwards, one ratio shared by every child overpriced the children that draft with a model
and underpriced a cheap tree: auto planned eagle+pld where draft+pld commits more per second.

`auto` (speclm.proposers.auto) is planned here too, per row: each round every row of an auto
group gets one of its children (a method's proposer) and a draft length, or no draft, the choice
that maximises the same tokens per second with the other rows' choices held (`_plan`: every row
on one choice, the best of those, then each row in turn moved to its own best). A chain child is
priced by position, not as geometric (`_Curve`, `_chain`): per position, how often the row's rounds
with it drafted and accepted it (a round that drafted nothing included), its prior `speclm tune`'s
rounds of it by position, each position a step from the one before (so a position past the cap the
row's rounds stopped at is priced from how they went); its width is the positions it is expected to
draft, and a draft model's forwards those times its forwards per position drafted. A child that
can say what it would draft without running (prompt lookup: `Proposer.shadow`) is scored each
round against the text a row then commits, for rows it did not draft, and counted in the row's
curve as the rounds it would have been: it is priced by the row's own text from the start, and a
new row's prior for it is how its chains went on the workload's recent text (every request's rounds
and shadows of it, SHARED_DECAY an update; the profile's by position as WORKLOAD_WEIGHT rounds'
worth): priced by the profile's prompts alone, which copy little, a summary's first rounds went
to eagle+pld, paying EAGLE's reading of its prompt, before its own text was scored. Before a
round is planned each lookup finds its chain for every row (free): a lookup child is priced by
that chain, its positions accepted as its drafted chains' were (none found: it drafts nothing, so
it is priced as no draft), not by its record over rounds with and without a match. A `+pld`
child drafts by its model alone (speclm.proposers.auto: `Proposer.drop_lookup`), so where the
lookup finds a chain the plan weighs that chain against the model's draft: taken whatever it
found, a lookup's chain took rounds priced as the model's (a chat row's short matches), and
its rounds, counted as the model's, priced eagle+pld's tree in summaries at what the lookup
copied. A row's acceptance is kept per child; a
child's prior is the profile's (else the policy's prior) times an ease (`ease`): how much better
than their priors every request's drafts went (the workload's, whichever child drafted them) and
how the row's other children went. Children's acceptances move together, and the profile ranks
them on the same prompts: a per-child mean over every request is measured only where that child
was chosen (a child that drafted a workload easier than the profile's prompts looked better than
one that had not drafted since, and kept every request). A child's measured draft forward drifts
back to its profile's in each round no row runs it (one stalled forward would price it out for
good). A child not run yet is priced by its cost line (a draft model's) or as free (prompt lookup,
heads), so each is tried early. A child whose
acceptance collapses prices itself below another and the row moves; a child that would draft the row
by prompt lookup alone (`Proposer.lookup_only`: draft+pld for a prompt too long for its draft) is not
offered for it, so its curve stays its model's; each move is written in the
request's stats (`plan_switches`), and the rounds each child took (`planned`). The policy that
plans auto for `generate` and `stream` leaves every other method's k alone (`plans_only`).

A request that sets k keeps it (auto: k caps every child). Greedy output does not depend on the
draft, so it is unchanged; nor does a seeded sampled request's, which draws each token by its
position (speclm.sampling.Coupled): its text is its plain decoding's with that seed. An unseeded
sampled request's output follows the target's distribution whatever the draft.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Callable

from speclm import defaults
from speclm.methods import DRAFT_MODEL, REGISTRY
from speclm.proposers.auto import NO_DRAFT, Choice
from speclm.forward.costs import ForwardCosts, StepTimes


# auto: each round's weight on the workload's ease, and on a request's own counts of a child it
# did not try that round (they drift back to its prior: explored again)
SHARED_DECAY = 0.98
DRAFT_ROW_PREMIUM = defaults.DRAFT_ROW_PREMIUM  # speclm.defaults.TABLE
EASE_WEIGHT = 2.0  # a request's ease starts at the workload's, as this many expected tokens' worth
WORKLOAD_WEIGHT = 8.0  # the workload's starts at 1 (the profile's prompts), as this many
EASE_SHARE = 0.5  # a child's prior moves by the square root of the ease of the request's other children
SHADOW_WEIGHT = 0.5  # a child scored every round (`Adaptive._shadow`): its prior weighs half a round's worth
CURVE_SPAN = 8  # positions of a chain's curve priced at once (`Adaptive._chain`): every child's k up to it


@dataclass
class _Priced:
    """A round as `Adaptive._price` priced it."""

    rate: float  # tokens per second: its forward scaled by the measured ratio, its draft forwards as measured
    forward: float  # seconds of the target's forward, as the cost table prices it
    drafting: float  # seconds of its draft forwards
    drafts: bool  # any row drafted

    @property
    def seconds(self) -> float:
        """The round before the measured ratio."""
        return self.forward + self.drafting


@dataclass
class _Sums:
    """Auto rows' part of a round (Adaptive._sums): their tokens committed, drafted tokens fed to
    the target and reading, and per (group, child) drafting: (rows, deepest draft forwards, group key)."""

    tokens: float = 0.0
    fed: float = 0.0
    catch_up: float = 0.0
    used: dict = field(default_factory=dict)

    def add(self, plan: tuple, row: tuple[float, float, float, float]) -> None:
        key, g, _, choice, _ = plan
        own, width, steps, catch = row
        self.tokens, self.fed, self.catch_up = self.tokens + own, self.fed + width, self.catch_up + catch
        if choice.child is not None:
            at = (id(g), choice.child)
            count, depth, _ = self.used.get(at, (0, 0, None))
            self.used[at] = (count + 1, max(depth, steps), key)

    def plus(self, plan: tuple, row: tuple[float, float, float, float]) -> "_Sums":
        out = _Sums(self.tokens, self.fed, self.catch_up, dict(self.used))
        out.add(plan, row)
        return out


@dataclass
class _Rate:
    """One request's acceptance, as decayed counts."""

    hits: float = 0.0
    tries: float = 0.0
    gained: float = 0.0  # a tree's: accepted tokens per round
    rounds: float = 0.0

    def update(self, decay: float, drafted: int, accepted: int) -> None:
        self.hits = decay * self.hits + accepted
        self.tries = decay * self.tries + min(accepted + 1, drafted)
        self.gained = decay * self.gained + accepted
        self.rounds = decay * self.rounds + 1

    def age(self, factor: float) -> None:
        """A round that did not try it: its counts weigh less against the prior they blend with."""
        self.hits, self.tries, self.gained, self.rounds = (factor * x for x in (self.hits, self.tries, self.gained, self.rounds))


@dataclass
class _Curve:
    """A request's rounds of an auto chain child by draft position (decayed counts): of the
    rounds whose cap let it draft position i (`reach`), those that had drafted position i - 1
    (`carried`) and drafted i too (`drafted`), and those whose path had accepted positions
    0..i-1 (`survived`) and accepted i too (`accepted`). A chain's acceptance is not geometric:
    prompt lookup's copied spans are taken whole or not at all (a later position, once reached, is
    likelier accepted than the first), a lookup finds no match in some rounds (it drafts nothing
    there), and a draft model that stops below a confidence drafts fewer positions than its cap,
    which are then neither drafted, verified nor paid for."""

    reach: list[float] = field(default_factory=list)
    carried: list[float] = field(default_factory=list)
    drafted: list[float] = field(default_factory=list)
    survived: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def _counts(self):
        return (self.reach, self.carried, self.drafted, self.survived, self.accepted)

    def update(self, decay: float, cap: int, drafted: int, accepted: int) -> None:
        for counts in self._counts():
            counts.extend([0.0] * (cap - len(counts)))
            counts[:] = [decay * c for c in counts]
        for i in range(cap):
            self.reach[i] += 1.0
            self.carried[i] += float(drafted >= i)
            self.drafted[i] += float(drafted > i)
            self.survived[i] += float(accepted >= i)
            self.accepted[i] += float(accepted > i)

    def chain(self, prior: list[tuple[float, float]], weight: float = 2.0) -> list[tuple[float, float]]:
        """[(P(position i drafted), P(positions 0..i all accepted))] for a round capped past every
        position of `prior` (those two by position, before this row's rounds), position by position
        as conditionals: each step from i - 1 to i is the prior's step blended with the row's rounds
        that took it (the prior's as `weight` rounds' worth). A position the row's rounds did not
        reach (its cap stopped them short) is priced by the prior's step from how the row's shorter
        rounds went, not by the prior alone."""
        out, drafted, accepted, before = [], 1.0, 1.0, (1.0, 1.0)
        for i, (p_drafted, p_accepted) in enumerate(prior):
            step_d = p_drafted / before[0] if before[0] > 0 else 0.0
            step_a = p_accepted / before[1] if before[1] > 0 else 0.0
            before = (p_drafted, p_accepted)
            if i < len(self.reach):
                step_d = (self.drafted[i] + weight * step_d) / (self.carried[i] + weight)
                step_a = (self.accepted[i] + weight * step_a) / (self.survived[i] + weight)
            drafted *= min(step_d, 1.0)
            accepted = min(accepted * min(step_a, 1.0), drafted)
            out.append((drafted, accepted))
        return out

    def age(self, factor: float) -> None:
        for counts in self._counts():
            counts[:] = [factor * c for c in counts]


@dataclass
class _Shadow:
    """A chain an auto child would have drafted for a row it did not draft (Proposer.shadow): its
    tokens for the row's positions from `at` on, capped at `cap`, scored once the row has
    committed past them."""

    child: str
    at: int
    tokens: list[int]
    cap: int

    def accepted(self, context: list[int]) -> int | None:
        """Its leading tokens the row's text took; None while the row has not committed far enough
        to say."""
        taken = 0
        for drafted, committed in zip(self.tokens, context[self.at:]):
            if drafted != committed:
                return taken
            taken += 1
        return taken if taken == len(self.tokens) else None


@dataclass
class _Ease:
    """How much more a request's drafts by one child are accepted than the child's prior expected
    (decayed sums of accepted and expected tokens over its rounds). Children's acceptances move
    together: text the draft model cannot guess, EAGLE's heads mostly cannot either. So a child's
    prior for a request moves with the other children's ease there (Adaptive.ease): one bad round
    of a child does not send the request to another priced at its unmoved prior, and back."""

    accepted: float = 0.0
    expected: float = 0.0

    def update(self, decay: float, accepted: float, expected: float) -> None:
        self.accepted = decay * self.accepted + accepted
        self.expected = decay * self.expected + expected

    def ratio(self, prior: float, weight: float = EASE_WEIGHT) -> float:
        return min(max((self.accepted + weight * prior) / (self.expected + weight), 0.25), 4.0)


class Adaptive:
    def __init__(self, costs: ForwardCosts, prior: float = defaults.ADAPTIVE_PRIOR, decay: float = defaults.ADAPTIVE_DECAY, probe: int = 32,
                 draft_costs: Callable[[int], float] | None = None, plans_only: bool = False,
                 measured: dict | None = None):
        """costs: the target's forward seconds by tokens read; draft_costs: the draft model's (None:
        its forwards are known only once measured here); plans_only: plan auto groups alone (every
        other method keeps its k); measured: auto's child -> what `speclm tune` measured of it
        (speclm.tune.ChildProfile: step_seconds, acceptance, gained), its prior here."""
        self.measured = measured if measured is not None else {}
        self.costs, self.prior, self.decay, self.probe = costs, prior, decay, probe
        self.draft_costs, self.plans_only = draft_costs, plans_only
        # auto: (request, child) -> _Rate via a per-request dict
        self._child_rates: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Request -> {child: _Rate}
        self._own_curves: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Request -> {chain child: _Curve}
        self._chains: dict = {}  # (request, child) -> _chain's running sums by k, until the next observe or plan
        self._rows: dict = {}  # (request, child, k) -> _row's answer, until the next observe or plan
        self._steps: dict = {}  # (group key, child, rows) -> _step_seconds' answer, until the next observe or plan
        self._ratio_memo: dict = {}  # (rows, drafting) -> ratio's answer, until the next round is timed
        self._chosen: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Request -> its last Choice
        self._shadows: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Request -> [_Shadow] not yet scored
        self._shadowing: set = set()  # auto children whose chains are scored for rows they do not draft
        self._found: dict = {}  # (request, such a child) -> the chain it finds for the row this round, while planning
        # (group key, such a child) -> _Curve of every request's rounds and shadows of it (SHARED_DECAY an
        # update): a new request's prior for the child, the profile's weighing WORKLOAD_WEIGHT rounds
        self._workload_curves: dict = {}
        self._ease: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Request -> {child: _Ease of its rounds}
        self._workloads: dict = {}  # group key -> _Ease of every request's auto rounds, whichever child (SHARED_DECAY a round)
        self._ran_model: set = set()  # group keys whose proposals ran model forwards
        self._rounds = 0
        self._rates: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Request -> _Rate
        self._step: dict = {}  # group key -> StepTimes by rows drafted for: a draft forward (or proposal, where none)
        self._nodes: dict = {}  # group key -> decayed mean of the nodes a row's draft held
        self._levels: dict = {}  # group key -> decayed mean of the draft forwards a drafting round ran
        self._ratios = {False: StepTimes(), True: StepTimes()}  # drafting or not -> seconds past proposals / the forward's price, by rows
        self._predicted: tuple[int, bool, float] | None = None  # the last round's (rows, drafting, its forward's seconds) as priced
        self.last: dict = {}  # the last round's caps, for metrics and tests

    def acceptance(self, request) -> float:
        """The request's estimated probability of accepting the next drafted token."""
        rate = self._rates.get(request)
        prior_weight = 2.0
        if rate is None:
            return self.prior
        return (rate.hits + self.prior * prior_weight) / (rate.tries + prior_weight)

    def observe(self, request, drafted: int, accepted: int, propose_seconds: float, forwards: int,
                rows: int = 1, child: str | None = None, cap: int | None = None) -> None:
        """One round of `request`: `drafted` tokens proposed (a tree's nodes), `accepted` on its path;
        its group's proposal took propose_seconds (its prefill left out) over `forwards` draft
        forwards for `rows` rows; child: the auto child planned for it; cap: the chain length it
        was planned (within what the request had left; None: a tree). A chain child's round counts
        in its curve even where it drafted nothing (a lookup that found no match): what it drafts
        how often is its price."""
        key = request.options.proposer_key()
        self._chains.clear()  # priced from the counts this round changes
        self._rows.clear()
        self._steps.clear()
        if child is not None and child not in self._shadowing and (cap or drafted > 0):  # against its prior's expectation
            expected = self._prior_chain(child, cap)[0] if cap else self._prior_tree(child)
            self._ease.setdefault(request, {}).setdefault(child, _Ease()).update(self.decay, accepted, expected)
            self._workloads.setdefault(key, _Ease()).update(SHARED_DECAY, accepted, expected)
        if child is not None and cap:
            self._count_chain(request, key, child, cap, min(drafted, cap), accepted)
        if drafted <= 0:
            return
        if child is not None:
            self._child_rates.setdefault(request, {}).setdefault(child, _Rate()).update(self.decay, drafted, accepted)
            key = (key, child)
        else:
            self._rates.setdefault(request, _Rate()).update(self.decay, drafted, accepted)
        if forwards > 0:
            if key not in self._ran_model:  # proposals without a forward kept before say nothing of one
                self._ran_model.add(key)
                self._step[key] = StepTimes()
            self._step[key].record(rows, propose_seconds / forwards)  # per draft forward
        elif key not in self._ran_model:  # prompt lookup: per proposal
            self._step.setdefault(key, StepTimes()).record(rows, propose_seconds)
        old = self._nodes.get(key)  # a tree's verified nodes per row, as its proposer sized them
        self._nodes[key] = drafted if old is None else 0.8 * old + 0.2 * drafted
        old = self._levels.get(key)  # a tree's levels drafted (a lookup round's: none)
        self._levels[key] = forwards if old is None else 0.8 * old + 0.2 * forwards

    def ratio(self, rows: int, drafting: bool) -> float:
        """Measured over predicted seconds of rounds of `rows` rows that drafted (or not), at that
        size. A plain round not measured there: as at the nearest size measured (the smaller on a
        tie), else 1 (tried at the table's price, and measured). A drafting round: the plain
        round's ratio there times the premium (`premium`) where plain rounds ran there, else as at
        the nearest size a drafting round ran, else the plain ratio times the premium. A drafting
        round verifies and commits per drafted row what the table's forward leaves out: at the
        plain ratio, one that never ran at a size looks cheaper than it is, and trying it there
        costs a draft's reading of every row's prompt."""
        memo = self._ratio_memo.get((rows, drafting))
        if memo is None:
            memo = self._ratio_memo[rows, drafting] = self._ratio(rows, drafting)
        return memo

    def _ratio(self, rows: int, drafting: bool) -> float:
        own = self._ratios[drafting]
        if rows in own.seconds:
            return own.seconds[rows]
        plain = self._ratios[False]
        if drafting and rows not in plain.seconds:
            near = own.at(rows, lambda n: 1.0)  # a ratio does not scale with rows
            if near is not None:
                return near
        base = plain.at(rows, lambda n: 1.0) or 1.0
        return base * self.premium(rows) if drafting else base

    def measured_ratios(self) -> dict[int, tuple[float | None, float | None]]:
        """By rows: the measured ratios of plain and drafting rounds (None: none ran at that size)."""
        plain, drafting = self._ratios[False].seconds, self._ratios[True].seconds
        return {n: (plain.get(n), drafting.get(n)) for n in sorted({*plain, *drafting})}

    def premium(self, rows: int) -> float:
        """A drafting round's ratio over a plain one's at `rows` rows: as measured at the nearest
        size where both ran (the smaller on a tie), else 1 + DRAFT_ROW_PREMIUM a row past the first."""
        both = [n for n in self._ratios[True].seconds if n in self._ratios[False].seconds]
        if not both:
            return 1.0 + DRAFT_ROW_PREMIUM * (rows - 1)
        near = min(both, key=lambda n: (abs(n - rows), n))
        return self._ratios[True].seconds[near] / self._ratios[False].seconds[near]

    def timed(self, seconds: float) -> None:
        """The round `caps` last priced took `seconds` past its proposals (its forward, verifying
        and committing): kept as a ratio to the table's price of its forward, a decayed mean from
        the size's prior (`ratio`): a size's first round runs cold (new shapes: allocations), and
        taken as it is it would misprice that size's rounds for the next ten."""
        if self._predicted is None:
            return
        rows, drafting, predicted = self._predicted
        self._predicted = None
        ratio = min(max(seconds / max(predicted, 1e-9), 0.25), 4.0)  # one stall (a page fault storm) moves it little
        own = self._ratios[drafting]
        if rows not in own.seconds:  # a size's first round (new shapes: allocations, cold caches) moves its prior
            own.record(rows, self.ratio(rows, drafting))
        own.record(rows, ratio)
        self._ratio_memo.clear()

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
        tuned = self._tuned_step(key, rows)
        if tuned is not None and key not in (self._ran_model if _runs_model(key) else self._step):
            # auto's child before its first forward here (a lookup-only round is no measure of one): as tuned
            return tuned
        if (getattr(_spec(key), "needs", None) == DRAFT_MODEL and key not in self._ran_model and self.draft_costs is not None
                and (unread is None or any(unread))):
            return self.draft_costs(rows)
        steps = self._step.get(key)
        seconds = steps.at(rows, self.costs) if steps is not None else None
        return seconds or 0.0

    def _tuned_step(self, key, rows: int) -> float | None:
        """Seconds `speclm tune` measured of auto's child (key: (group key, child)) drafting for
        `rows` rows (a draft model's forward scaled as the target's); None without a profile."""
        tuned = self.measured.get(key[1]) if isinstance(key, tuple) else None
        if tuned is None:
            return None
        return tuned.step_seconds * (self.costs(rows) / self.costs(1) if _runs_model(key) else 1.0)

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

    def _tree_forwards(self, key, most: int, child: str | None = None) -> float:
        """A tree's draft forwards per drafting round: as measured here, else as `speclm tune`
        measured of auto's `child`, else its most levels (`most`). A dynamic tree stops below its
        most (EAGLE's levels past their worth; prompt lookup's rounds run none)."""
        seen = self._levels.get(key)
        if seen is not None:
            return seen
        tuned = self.measured.get(child) if child is not None else None
        return tuned.forwards if tuned is not None and tuned.forwards > 0 else most

    def _forwards_per_position(self, key, child: str) -> float:
        """A chain child's draft forwards per position it drafts: as measured here, else in `speclm
        tune`, else one."""
        levels, nodes = self._levels.get(key), self._nodes.get(key)
        if levels is not None and nodes:
            return min(levels / nodes, 2.0)
        tuned = self.measured.get(child)
        per = tuned.forwards_per_position() if tuned is not None else None
        return min(per, 2.0) if per is not None else 1.0

    def _tree_width(self, key, g) -> int:
        """A tree's verified nodes per row: as measured (a tree sized by cost is far below its
        most), else its most."""
        seen = self._nodes.get(key)
        return g.proposer.max_nodes if seen is None else max(1, round(seen))

    def caps(self, batch) -> dict:
        """Per group key (GenerationOptions.proposer_key): its draft length cap this round (0: none;
        None: a tree kept whole)."""
        self._predicted = None
        every = [(key, g) for key, g in batch.groups.items() if g.requests and g.proposer is not None]
        planned = [(key, g) for key, g in every if g.proposer.plans]
        groups = [(key, g) for key, g in every if not g.proposer.plans]
        rows = len(batch.requests)
        # groups whose k this policy leaves alone: a k set by the request (a seeded sampled request
        # draws by position, speclm.sampling.Coupled: its text does not depend on k)
        trees = {key for key, g in groups if g.proposer.shape == "tree"}
        # and a tree not yet measured here, kept whole until it is (priced before that at its most
        # nodes, it was turned off and never measured: a served eagle+pld ran as plain decoding)
        kept = {key for key, g in groups if key.k is not None or self.plans_only or (key in trees and key not in self._nodes)}
        free = [(key, g) for key, g in groups if key not in kept]
        if planned:
            return self._plan(batch, groups, planned, rows)
        unmeasured = {key: None for key in kept if key in trees and key not in self._nodes}  # kept whole
        if not free:
            self.last = unmeasured
            return {}
        # rows whose draft this policy does not choose: plain ones commit one token, kept ones their method's
        tokens0 = rows - sum(len(g.requests) for _, g in groups)
        fed0 = 0  # drafted tokens the round's forward reads (each row its own: no padding)
        for key, g in groups:
            if key in kept:
                tokens0 += sum(self._expected(r, g.proposer.k, key in trees) for r in g.requests)
                fed0 += len(g.requests) * (self._tree_width(key, g) if key in trees else g.proposer.k)
        longest = max((g.proposer.k for key, g in free if key not in trees), default=0)
        choices = [(k, on) for k in range(longest + 1) for on in ((False, True) if any(key in trees for key, _ in free) else (False,))]
        unread = {key: self._unread(g) for key, g in free}  # once a round, for every choice priced
        best, best_rate, priced = (0, False), -1.0, None
        for k, tree_on in choices:
            tokens, drafting, catch_up, fed = tokens0, 0.0, 0.0, fed0
            for key, g in free:
                is_tree = key in trees
                own = (g.proposer.k if tree_on else 0) if is_tree else min(k, g.proposer.k)
                tokens += sum(self._expected(r, own, is_tree) for r in g.requests)
                if own:
                    forwards = self._tree_forwards(key, own) if is_tree else own
                    drafting += self._step_seconds(key, len(g.requests), unread[key]) * forwards
                    catch_up += self._catch_up(key, g, own, is_tree, unread[key])
                    fed += len(g.requests) * (self._tree_width(key, g) if is_tree else own)
            rate, forward = self._per_second(tokens, rows, fed, drafting + catch_up)
            if rate > best_rate * (1 + 1e-9):
                best, best_rate, priced = (k, tree_on), rate, (rows, fed > 0, forward)
        k, tree_on = best
        self._predicted = priced
        self.last = {**unmeasured, **{key: (None if tree_on else 0) if key in trees else min(k, g.proposer.k)
                                      for key, g in free}}
        self._rounds += 1
        if self._rounds % self.probe == 0:  # a probe: drafting off learns nothing about acceptance
            for key, g in free:
                if self.last[key] == 0 and not g.proposer.reads_context:  # no draft model to catch up
                    self.last[key] = 1
                    self._predicted = None  # not the round priced
        return self.last

    # ---------------------------------------------------------------- auto
    def _options(self, key, g, r, lookup_only: frozenset = frozenset()) -> list[Choice]:
        """A row's choices: no draft, and each child at each draft length (a tree: whole); not the
        children that would draft the row by lookup alone (`lookup_only`: a draft+pld row whose
        prompt is too long for its draft model is prompt lookup's, and its rounds, measured against
        its model's prior, would teach the workload's ease that drafts fail)."""
        out = [NO_DRAFT]
        cap = key.k
        for name, child in g.proposer.children.items():
            if name in lookup_only:
                continue
            most = child.k if cap is None else min(cap, child.k)
            if child.shape == "tree":
                out.append(Choice(name, most))
            else:
                out += [Choice(name, k) for k in range(1, most + 1)]
        return out

    def _child_tokens(self, key, g, r, choice: Choice) -> float:
        """Tokens the round commits for row r with `choice` (the target's own included)."""
        if choice.child is None:
            return 1.0
        child = g.proposer.children[choice.child]
        if child.shape == "tree":  # the row's own rounds, their prior the profile's times the ease
            gained = self._prior_tree(choice.child) * self.ease(r, choice.child, key)
            rate = self._child_rates.get(r, {}).get(choice.child)
            if rate is not None:
                gained = (rate.gained + gained * 2.0) / (rate.rounds + 2.0)
            return 1.0 + gained
        return 1.0 + self._chain(key, r, choice)[0]

    def _chain(self, key, r, choice: Choice) -> tuple[float, float]:
        """(accepted tokens, drafted positions) expected of row r's chain `choice`, position by
        position: the row's own rounds with that child (_Curve, decayed by the policy's decay),
        their prior the child's before them (_prior_chain), its acceptance times the row's ease.
        A cap's curve is the first k positions of any longer cap's (each position depends on those
        before it alone), so one curve per row and child prices every k (kept as running sums)."""
        if choice.k <= 0:
            return 0.0, 0.0
        memo = (r, choice.child)  # a request is in one group: its key is implied; keyed by the request
        # itself, not its id(), which a request freed since the last clear may hand to a new one
        sums = self._chains.get(memo)  # a round prices each choice many times over (every k, every row's move)
        found = self._found.get(memo)  # a lookup's chain this round, found before planning
        if sums is None or len(sums[0]) < choice.k:
            own = self._own_curves.get(r, {}).get(choice.child) or _Curve()
            ease = self.ease(r, choice.child, key)
            span = max(choice.k, CURVE_SPAN)
            prior = [(d, min(a * ease, d)) for d, a in self._prior_chain(choice.child, span)[1]]
            workload = self._workload_curves.get((key, choice.child))
            if workload is not None:  # a child scored on every row's text: how it went on the workload's
                prior = workload.chain(prior, WORKLOAD_WEIGHT)
            curve = own.chain(prior, SHADOW_WEIGHT if choice.child in self._shadowing else 2.0)
            sums = self._chains[memo] = (list(accumulate(d for d, _ in curve)), list(accumulate(a for _, a in curve)),
                                         list(accumulate(a / d if d > 0 else 0.0 for d, a in curve)))
        if found is not None:  # its chain is known: its positions drafted, each accepted as when drafted
            n = min(choice.k, len(found), len(sums[2]))
            return (sums[2][n - 1], float(n)) if n else (0.0, 0.0)
        drafted, accepted = sums[0][choice.k - 1], sums[1][choice.k - 1]
        return min(accepted, drafted), drafted

    def _prior_chain(self, child: str, k: int) -> tuple[float, list[tuple[float, float]]]:
        """(accepted tokens, [(P(drafted), P(accepted)) by position]) of auto's chain `child` capped
        at k, before the ease of the workload and request: as `speclm tune` measured its rounds by
        position (ChildProfile.drafted_at, accepted_at), else a chain drafted to its cap whose
        tokens each pass with its measured acceptance (none measured: the policy's prior)."""
        tuned = self.measured.get(child)
        out = tuned.by_position(k) if tuned is not None else []
        if not out:
            a = min(tuned.acceptance if tuned is not None else self.prior, 0.999)
            out = [(1.0, a ** (i + 1)) for i in range(k)]
        return sum(p for _, p in out), out

    def _prior_tree(self, child: str) -> float:
        """Accepted tokens per round of auto's tree `child` before the ease of the workload and
        request: the profile's, else the policy's prior (two tokens at its acceptance)."""
        tuned = self.measured.get(child)
        return tuned.gained if tuned is not None else self.prior * 2

    def ease(self, request, child: str, key=None) -> float:
        """What `child`'s prior is scaled by for the request: every request's drafts' accepted
        tokens over their priors' (the workload's ease, whichever child drafted them; per group key:
        sampled requests accept less than greedy ones), moved by the request's other children's (its
        own rounds are in its own counts) to the power EASE_SHARE. A child scored on every row's
        own text (`_shadow`: prompt lookup) neither moves the ease nor is moved by it: text that
        copies its source is far easier for a lookup than for a model (summaries: 4x its profile's
        prompts), and taken as the workload's ease it sent rows back to a tree that gained little."""
        if child in self._shadowing:  # scored on the row's own text each round: no ease of others'
            return 1.0
        key = request.options.proposer_key() if key is None else key  # the request's group's
        workload = self._workloads.get(key, _Ease()).ratio(1.0, WORKLOAD_WEIGHT)
        others = [e for name, e in self._ease.get(request, {}).items() if name != child]
        if not others:
            return workload
        own = _Ease(sum(e.accepted for e in others), sum(e.expected for e in others)).ratio(workload)
        return workload * (own / workload) ** EASE_SHARE

    def _width(self, key, g, r, choice: Choice) -> float:
        """Tokens the row's draft puts in the target's forward: a chain's expected drafted positions
        (the cost table interpolates between token counts), a tree's nodes."""
        if choice.child is None:
            return 0
        child = g.proposer.children[choice.child]
        if child.shape != "tree":
            return self._chain(key, r, choice)[1]
        seen = self._nodes.get((key, choice.child))
        if seen is None and choice.child in self.measured:
            seen = self.measured[choice.child].nodes or None
        return child.max_nodes if seen is None else max(1, round(seen))

    def _row(self, key, g, r, choice: Choice, unread: dict) -> tuple[float, float, float, float]:
        """Row r's part of a round with `choice`: (tokens it commits, tokens it feeds the target's
        forward, its child's draft forwards, its share of the child's reading of tokens it has not
        read), kept for the round (a round prices each choice many times over: every row's move)."""
        memo = (r, choice.child, choice.k)  # the request itself (see _chain)
        got = self._rows.get(memo)
        if got is not None:
            return got
        tokens, width = self._child_tokens(key, g, r, choice), self._width(key, g, r, choice)
        steps = catch_up = 0.0
        if choice.child is not None:
            child = g.proposer.children[choice.child]
            at = (key, choice.child)
            # a draft model's forwards: one per position it is expected to draft (a tree: the levels its rounds ran)
            if not child.runs_model:
                steps = 1
            elif child.shape == "tree":
                steps = self._tree_forwards(at, choice.k, choice.child)
            else:
                steps = self._chain(key, r, choice)[1] * self._forwards_per_position(at, choice.child)
            seen = unread.get(choice.child, 0)
            if seen > 2:  # this round's share of reading what it has not read
                catch_up = self._reading(choice.child, child, seen) / max(1.0, r.tokens_left / tokens)
        self._rows[memo] = tokens, width, steps, catch_up
        return self._rows[memo]

    def _reading(self, name: str, child, tokens: int) -> float:
        """Seconds auto's `child` (named `name`) takes to read `tokens` unread tokens of one row: a
        draft model's by its cost line; heads' (their pending features) as they measured it here,
        else as `speclm tune` measured it, else unpriced."""
        if child.reads_context:
            return (self.draft_costs if self.draft_costs is not None else self.costs)(tokens)
        seconds = child.reading_seconds(tokens)
        if seconds is None:
            tuned = self.measured.get(name)
            seconds = tokens * tuned.reading_seconds if tuned is not None else 0.0
        return seconds

    def _price(self, plans: list[tuple], rows: int, tokens0: float, fed0: float) -> "_Priced":
        """A round whose auto rows take `plans`: a list of (key, group, request, choice, unread by
        child). The forward reads `rows` roots and every row's own drafted tokens (fed0: the other
        groups'), no padding."""
        return self._priced(self._sums(plans), rows, tokens0, fed0)

    def _sums(self, plans) -> "_Sums":
        """What `plans`' rows add to a round (their tokens, fed tokens and reading, and per child
        its rows and deepest forwards)."""
        out = _Sums()
        for plan in plans:
            out.add(plan, self._row(*plan))
        return out

    def _priced(self, sums: "_Sums", rows: int, tokens0: float, fed0: float) -> "_Priced":
        # a child's forwards run once for all its rows: its deepest row's
        drafting = 0.0
        for (_, child), (count, depth, key) in sums.used.items():
            memo = (key, child, count)
            seconds = self._steps.get(memo)
            if seconds is None:
                seconds = self._steps[memo] = self._step_seconds((key, child), count)
            drafting += seconds * depth
        fed = fed0 + sums.fed
        rate, forward = self._per_second(tokens0 + sums.tokens, rows, fed, drafting + sums.catch_up)
        return _Priced(rate, forward, drafting, fed > 0)

    def _per_second(self, tokens: float, rows: int, fed: float, beside: float) -> tuple[float, float]:
        """(tokens per second, the table's seconds of the forward) of a round committing `tokens`
        whose forward reads `rows` roots and `fed` drafted tokens: the forward scaled by its measured
        ratio (`timed`), the seconds `beside` it (draft forwards, a draft's reading) as they are."""
        forward = self.costs(rows + fed)
        return tokens / (forward * self.ratio(rows, fed > 0) + beside), forward

    def _plan(self, batch, groups, planned, rows) -> dict:
        """Each auto row's Choice for this round (set on its group's proposer); the other groups
        keep their k. Returns {} (no caps for the others)."""
        self._chains.clear()  # ids of requests that left may come back as new ones
        self._rows.clear()
        self._found.clear()
        self._steps.clear()
        tokens0, fed0 = float(rows - sum(len(g.requests) for _, g in planned)), 0
        for key, g in groups:  # the other groups at their own k
            tokens0 += sum(self._expected(r, g.proposer.k, g.proposer.shape == "tree") - 1.0 for r in g.requests)
            fed0 += len(g.requests) * (self._tree_width(key, g) if g.proposer.shape == "tree" else g.proposer.k)
        free, alone = [], {}
        for key, g in planned:
            for r in g.requests:
                self._score_shadows(r)
            contexts = [r.context for r in g.requests]
            for name, child in g.proposer.children.items():  # what a lookup finds this round: its price
                chains = child.shadow(contexts) if child.shape != "tree" else None
                for r, chain in zip(g.requests, chains or ()):
                    self._found[(r, name)] = chain
            unread = {name: c.unread(contexts) for name, c in g.proposer.children.items()}
            lookup = {name: c.lookup_only() for name, c in g.proposer.children.items()}
            for b, r in enumerate(g.requests):
                own = {name: u[b] for name, u in unread.items()}
                alone[id(r)] = frozenset(name for name, rows in lookup.items() if b < len(rows) and rows[b])
                free.append([key, g, r, NO_DRAFT, own])  # a seeded row draws by position: any plan keeps its text
        if free:
            options = {id(e): self._options(e[0], e[1], e[2], alone[id(e[2])]) for e in free}
            uniform = {c for e in free for c in options[id(e)]}
            best_rate, best = -1.0, None
            for choice in sorted(uniform, key=lambda c: (c.child or "", c.k)):  # every row on one choice
                for e in free:
                    e[3] = choice if choice in options[id(e)] else NO_DRAFT
                rate = self._price([tuple(e) for e in free], rows, tokens0, fed0).rate
                if rate > best_rate * (1 + 1e-9):
                    best_rate, best = rate, [e[3] for e in free]
            for e, c in zip(free, best):
                e[3] = c
            if len(free) > 1:  # then each row in turn to its own best, the others held
                for e in free:
                    held = e[3]
                    others = self._sums(tuple(x) for x in free if x is not e)
                    for choice in options[id(e)]:
                        e[3] = choice
                        plan = tuple(e)
                        rate = self._priced(others.plus(plan, self._row(*plan)), rows, tokens0, fed0).rate
                        if rate > best_rate * (1 + 1e-9):
                            best_rate, held = rate, choice
                    e[3] = held
            self._rounds += 1
            if self._rounds % self.probe == 0:  # a probe: a row off learns nothing of acceptance
                for e in free:
                    if e[3].child is None:
                        cheap = next((n for n, c in e[1].proposer.children.items() if not c.runs_model), None)
                        if cheap is not None:
                            e[3] = Choice(cheap, 1)
            shadowed = self._shadow(free)
            ran = {(e[0], e[3].child) for e in free if e[3].child is not None}
            for key, g in planned:  # a child no row ran: its measured forward drifts back to its tuned one
                for name in g.proposer.children:
                    at = (key, name)
                    if at not in ran and at in self._step and name in self.measured:
                        self._step[at].drift(lambda n: self._tuned_step(at, n), self.decay)
            for e in free:  # what a row no longer tries drifts back to its prior: explored again once it pays
                r, chosen = e[2], e[3].child
                for name, rate in self._child_rates.get(r, {}).items():
                    if name != chosen:
                        rate.age(SHARED_DECAY)
                for name, curve in self._own_curves.get(r, {}).items():
                    if name != chosen and (id(r), name) not in shadowed:
                        curve.age(SHARED_DECAY)
        plans = [tuple(e) for e in free]
        priced = self._price(plans, rows, tokens0, fed0)
        self._predicted = (rows, priced.drafts, priced.forward) if free else None
        for key, g in planned:
            mine = {id(r): c for k2, g2, r, c, _ in plans if g2 is g}
            g.proposer.plan = [mine[id(r)] for r in g.requests]
            for r, c in zip(g.requests, g.proposer.plan):
                before = self._chosen.get(r)
                if before is not None and before.child != c.child:
                    tokens = self._child_tokens(key, g, r, c)
                    r.stats.plan_switches.append(
                        f"round {r.stats.target_forwards}: {before.child or 'none'} -> {c.child or 'none'} "
                        f"(expected {tokens:.2f} tokens per round)")
                    del r.stats.plan_switches[:-16]  # the last 16
                self._chosen[r] = c
        self.last = {key: [c for c in g.proposer.plan] for key, g in planned}
        self._found.clear()
        return {}

    def _shadow(self, free) -> set:
        """For each planned row, the chain each child that can say so without running
        (Proposer.shadow: a lookup) would have drafted, where the row is not its this round: kept
        until the row commits past it (`_score_shadows`). A child whose rounds are lookups is then
        priced by what it would have accepted in the row's own text, not by a prior from other text
        (in text that copies its source, prompt lookup's chains are taken whole far more often than
        the profile's prompts say, and it was never tried while a tree looked better). Returns the
        (id of the request, child) pairs shadowed."""
        out = set()
        groups: dict = {}
        for e in free:
            groups.setdefault(id(e[1]), (e[0], e[1], []))[2].append(e)
        for key, g, rows in groups.values():
            for name, child in g.proposer.children.items():
                if child.shape == "tree":
                    continue
                others = [e[2] for e in rows if e[3].child != name]
                if others and all((r, name) in self._found for r in others):  # found before planning
                    chains = [self._found[(r, name)] for r in others]
                else:
                    chains = child.shadow([r.context for r in others])  # asked with no rows too: it says whether it can
                if chains is None:
                    continue
                self._shadowing.add(name)
                most = child.k if key.k is None else min(key.k, child.k)
                for r, chain in zip(others, chains):
                    cap = min(most, r.tokens_left - 1)  # what it could draft (the target's token after it)
                    if cap > 0:
                        self._shadows.setdefault(r, []).append(_Shadow(name, len(r.context), chain[:cap], cap))
                        out.add((id(r), name))
        return out

    def _score_shadows(self, r) -> None:
        """The row's shadows (`_shadow`) it has committed past, counted in its child's curve as the
        rounds they would have been (a chain that drafted nothing included)."""
        pending = self._shadows.get(r)
        if not pending:
            return
        left = []
        for s in pending:
            taken = s.accepted(r.context)
            if taken is None:
                left.append(s)
            else:
                self._count_chain(r, r.options.proposer_key(), s.child, s.cap, len(s.tokens), taken)
        pending[:] = left

    def _count_chain(self, request, key, child: str, cap: int, drafted: int, accepted: int) -> None:
        """One round of a chain child for the request, run or shadowed: in the request's curve, and
        for a child scored on every row's text (`_shadowing`), in the workload's (group key `key`)."""
        self._own_curves.setdefault(request, {}).setdefault(child, _Curve()).update(self.decay, cap, drafted, accepted)
        if child in self._shadowing:
            self._workload_curves.setdefault((key, child), _Curve()).update(SHARED_DECAY, cap, drafted, accepted)


def _spec(key):
    """The method of a step-time key: a group key's, or (auto's group key, its child)'s; None for a
    child the registry does not hold (tests' stand-ins)."""
    return REGISTRY.get(key[1]) if isinstance(key, tuple) else key.spec


def _runs_model(key) -> bool:
    spec = _spec(key)
    return spec is None or spec.runs_model
