"""auto: the planner picks, per request and round, a child method (the registry's planned methods
the loaded models allow), its draft length, or no draft. Whatever it picks, greedy output is plain
decoding's token for token (fp32 and int8, alone and batched, random plans and the planner's own);
it chooses no draft where drafting is priced above a plain step and moves away from a child whose
acceptance collapses; a seeded sampled request samples plain decoding's text in any batch. Its exact-distribution
test is in test_sampling_distribution.py (case auto)."""

from __future__ import annotations

import copy
from dataclasses import replace
from types import SimpleNamespace

import pytest

from speclm import SpecEngine, tune
from speclm.errors import UsageError
from speclm.forward.costs import ForwardCosts
from speclm.methods import children
from speclm.options import GenerationOptions
from speclm.proposers.auto import NO_DRAFT, AutoProposer, Choice
from speclm.proposers.base import Draft, Proposer
from speclm.proposers.prompt_lookup import PromptLookupProposer, lookup
from speclm.quant.weights import quantize_model
from speclm.requests import Request
from speclm.round.adaptive import Adaptive
from tiny import loaded, random_heads, random_plan

PROMPTS = ["hello world, hello", "abc", "the quick brown fox jumps over the lazy dog, the quick",
           "def f(x):\n    return x\n\ndef f("]
N = 40


@pytest.fixture(scope="module")
def heads(tmp_path_factory, target):
    return random_heads("eagle", target.model, tmp_path_factory.mktemp("auto") / "eagle.safetensors", seed=1, std=0.3)


@pytest.fixture(scope="module")
def same_draft(target, tok):
    """A draft equal to the target: it drafts what the target will commit (long accepted paths)."""
    return loaded(copy.deepcopy(target.model), tok, name="tiny-draft-same")


@pytest.fixture(scope="module")
def int8_pair(target, tok):
    int8 = lambda: quantize_model(copy.deepcopy(target.model), "int8")  # noqa: E731
    return loaded(int8(), tok, name="tiny-int8"), loaded(int8(), tok, name="tiny-int8-draft")


@pytest.mark.parametrize("weights", ["fp32", "int8"])
@pytest.mark.parametrize("models", ["draft+heads", "target alone"])
def test_any_plan_gives_plain_greedy_output(target, same_draft, int8_pair, heads, weights, models):
    """Random plans: rows of one round drafted by different children (and none), in every mix.
    With a draft and heads: draft+pld, eagle+pld, pld; the target alone: pld and self (its layers
    drafting on the target's own cache)."""
    t, d = (target, same_draft) if weights == "fp32" else int8_pair
    engine = SpecEngine(t, draft=d) if models == "draft+heads" else SpecEngine(t)
    kw = dict(heads=heads) if models == "draft+heads" else {}
    if models == "target alone":
        tune.measure(engine, GenerationOptions(method="auto"))  # self is a child once tuned
    random_plan(engine, seed=len(models))
    refs = engine.generate(PROMPTS, method="none", max_new_tokens=N)
    for prompt, ref in zip(PROMPTS, refs):
        out = engine.generate(prompt, method="auto", max_new_tokens=N, **kw)
        assert out.token_ids == ref.token_ids, prompt
    outs = engine.generate(PROMPTS, method="auto", max_new_tokens=N, **kw)  # one batch
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
    planned = {}
    for o in outs:
        for name, n in o.stats.planned.items():
            planned[name] = planned.get(name, 0) + n
    every = {"none", "pld", "draft+pld", "eagle+pld"} if models == "draft+heads" else {"none", "pld", "self"}
    assert every <= set(planned), planned  # every child took rounds
    assert sum(o.stats.accepted_tokens for o in outs) > 0


def test_the_planner_gives_plain_greedy_output(target, same_draft, heads):
    engine = SpecEngine(target, draft=same_draft)
    refs = engine.generate(PROMPTS, method="none", max_new_tokens=N)
    outs = engine.generate(PROMPTS, method="auto", max_new_tokens=N, heads=heads)
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
    outs = engine.generate(PROMPTS, method="auto", max_new_tokens=N, heads=heads, batch_size=1)
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
    for o in outs:  # every round is counted under the child that drafted it, or none
        assert sum(o.stats.planned.values()) == o.stats.target_forwards - 1


def test_children_are_what_the_loaded_models_allow(target, same_draft, heads):
    names = lambda engine, **kw: [o.method for o in children(engine, GenerationOptions(method="auto", **kw))]  # noqa: E731
    assert names(SpecEngine(target, draft=same_draft)) == ["draft+pld", "pld"]
    assert names(SpecEngine(target, draft=same_draft), heads=heads) == ["draft+pld", "eagle+pld", "pld"]
    assert names(SpecEngine(target), heads=heads) == ["eagle+pld", "pld"]
    alone = SpecEngine(target)
    assert names(alone) == ["pld"]  # self only where nothing else runs a model, and once tuned
    assert [o.method for o in children(alone, GenerationOptions(method="auto"), fallback=True)] == ["pld", "self"]
    tune.measure(alone, GenerationOptions(method="auto"))  # what `speclm tune` runs: self set up and measured
    assert names(alone) == ["pld", "self"]
    with pytest.raises(UsageError):
        GenerationOptions(method="auto", tree="auto")  # a child's option, not auto's


def test_no_draft_where_drafting_costs_more_than_it_gains(target, same_draft):
    """Every forward past one token priced at 10 plain steps: no child pays; only the probes (one
    round in 32 tries prompt lookup for one token) draft."""
    engine = SpecEngine(target, draft=same_draft)
    steep = ForwardCosts({1: 1.0, 2: 10.0, 64: 640.0})
    engine._planner = Adaptive(steep, draft_costs=steep, plans_only=True)
    outs = engine.generate(PROMPTS, method="auto", max_new_tokens=N, batch_size=1)
    for o in outs:
        rounds = o.stats.target_forwards - 1
        assert o.stats.planned.get("none", 0) >= rounds - (rounds // 32 + 1), o.stats.planned
        assert "draft+pld" not in o.stats.planned
    cheap = ForwardCosts({1: 1.0, 64: 1.0})  # verification as cheap as a step: the draft equal to the target pays
    engine._planner = Adaptive(cheap, draft_costs=ForwardCosts({1: 0.01, 64: 0.01}), plans_only=True)
    out = engine.generate(PROMPTS[2], method="auto", max_new_tokens=N)
    assert out.stats.planned.get("draft+pld", 0) > out.stats.planned.get("none", 0), out.stats.planned


class _Child(Proposer):
    runs_model = True

    def __init__(self, k):
        self.k = self.max_nodes = k

    def propose(self, contexts, max_tokens, params, generators):
        return Draft.from_rows([[1] * m for m in max_tokens])


def _round(policy, batch, group, accepted: dict[str, int]):
    """One planned round where child c's draft is accepted for accepted[c] tokens."""
    policy.caps(batch)
    choice = group.proposer.plan[0]
    if choice.child is not None:
        policy.observe(group.requests[0], choice.k, min(choice.k, accepted[choice.child]), 0.001, choice.k, 1,
                       child=choice.child, cap=choice.k)
    return choice


def test_the_planner_moves_away_from_a_child_whose_acceptance_collapses():
    costs = ForwardCosts({1: 1.0, 2: 1.3, 5: 2.0, 64: 20.0})
    policy = Adaptive(costs)
    options = GenerationOptions(method="auto")
    proposer = AutoProposer({"a": _Child(4), "b": _Child(4)})
    request = Request.of(0, list(range(10)), replace_max(options, 200), 0, None)
    group = SimpleNamespace(options=options.proposer_key(), proposer=proposer, requests=[request])
    batch = SimpleNamespace(groups={options.proposer_key(): group}, requests=[request])
    for _ in range(30):  # a accepts everything, b nothing
        _round(policy, batch, group, {"a": 4, "b": 0})
    assert _round(policy, batch, group, {"a": 4, "b": 0}).child == "a"
    chosen = [_round(policy, batch, group, {"a": 0, "b": 4}).child for _ in range(40)]  # a collapses
    moved = chosen.index("b")  # as a's decayed acceptance (ADAPTIVE_DECAY a round) falls below b's prior
    assert moved < 20 and set(chosen[moved:]) == {"b"}, chosen
    assert any("a -> b" in line for line in request.stats.plan_switches), request.stats.plan_switches
    for _ in range(40):  # then both collapse: no draft pays for its verification
        last = _round(policy, batch, group, {"a": 0, "b": 0})
    assert last == NO_DRAFT


def _one_row(children):
    options = GenerationOptions(method="auto")
    proposer = AutoProposer(children)
    request = Request.of(0, list(range(10)), replace_max(options, 200), 0, None)
    group = SimpleNamespace(options=options.proposer_key(), proposer=proposer, requests=[request])
    return options.proposer_key(), group, request


def test_a_chain_is_priced_by_its_positions_not_as_geometric():
    """Prompt lookup's spans pass whole or not at all: half the rounds accept all 4 tokens, half
    none, so a 4-token chain commits 1 + 2 tokens a round (a geometric chain of the same per-token
    acceptance, 0.8, would say 3.36); a draft that stops below its confidence after 2 of its 6
    positions is priced for under 3 draft forwards and verified tokens (its prior, with no
    profile, drafts all 6), not 6; a lookup that
    drafts in half its rounds (no match in the others), all accepted, is priced at 1 + 2 tokens,
    not 1 + 4; and each request by its own rounds."""
    policy = Adaptive(ForwardCosts({1: 1.0, 64: 20.0}))
    key, group, request = _one_row({"lookup": _Child(4), "model": _Child(6)})
    for n in range(200):
        accepted = 4 if n % 2 else 0
        policy.observe(request, 4, accepted, 0.001, 0, 1, child="lookup", cap=4)
        policy.observe(request, 2, 2, 0.001, 2, 1, child="model", cap=6)
    # within 0.2: decayed counts weigh the last (accepted) round a little more
    assert abs(policy._child_tokens(key, group, request, Choice("lookup", 4)) - 3.0) < 0.2
    assert abs(policy._child_tokens(key, group, request, Choice("lookup", 1)) - 1.5) < 0.2
    accepted, drafted = policy._chain(key, request, Choice("model", 6))
    sparse = Adaptive(ForwardCosts({1: 1.0, 64: 20.0}))  # a lookup that finds a match in half its rounds
    for n in range(200):
        sparse.observe(request, 4 if n % 2 else 0, 4 if n % 2 else 0, 0.001, 0, 1, child="lookup", cap=4)
    assert abs(sparse._child_tokens(key, group, request, Choice("lookup", 4)) - 3.0) < 0.2  # not 5
    # per request: where lookup copies whole spans for one request and finds nothing for another
    # (a summary beside a question), each is priced by its own rounds, not by their mean
    mixed = Adaptive(ForwardCosts({1: 1.0, 64: 20.0}))
    other = Request.of(1, list(range(10)), request.options, 1, None)
    for _ in range(100):
        mixed.observe(request, 4, 4, 0.001, 0, 1, child="lookup", cap=4)
        mixed.observe(other, 0, 0, 0.001, 0, 1, child="lookup", cap=4)
    assert mixed._child_tokens(key, group, request, Choice("lookup", 4)) > 4.5
    assert mixed._child_tokens(key, group, other, Choice("lookup", 4)) < 1.5
    # positions 3-6: never drafted, against a prior (no profile: drafted) weighing 2 of ~12 decayed rounds
    assert 2.0 < drafted < 2.8 and abs(accepted - 2.0) < 0.2
    assert policy._width(key, group, request, Choice("model", 6)) == drafted


class _Tree(_Child):
    shape = "tree"


def test_a_tree_is_priced_by_the_levels_it_drafts_not_its_most():
    """EAGLE's dynamic tree of 6 levels stops where another level is not worth it (2 forwards a
    round here): priced at 6 draft forwards a round, it lost to prompt lookup at every round and
    was never planned again (no-draft auto planned pld where eagle+pld ran 1.37x against pld's
    1.23x). Priced by the forwards its rounds ran; before any, by `speclm tune`'s."""
    costs = ForwardCosts({1: 1.0, 64: 1.0})
    policy = Adaptive(costs)
    key, group, request = _one_row({"tree": _Tree(6)})
    plan = [(key, group, request, Choice("tree", 6), {})]
    for _ in range(50):
        policy.observe(request, 8, 2, 0.2, 2, 1, child="tree")  # 2 forwards of 0.1 s each a round
    seconds = policy._price(plan, 1, 0.0, 0).seconds
    assert seconds == pytest.approx(1.0 + 2 * 0.1), seconds  # not 1.0 + 6 * 0.1
    tuned = Adaptive(costs, measured={"tree": tune.ChildProfile(0.1, 0.5, 1.0, 8.0, 50, forwards=3.0)})
    assert tuned._price(plan, 1, 0.0, 0).seconds == pytest.approx(1.0 + 3 * 0.1)
    # a fixed tree method's own rounds (not auto's: no child), as the server's adaptive policy prices them
    fixed = Adaptive(costs)
    for _ in range(50):
        fixed.observe(request, 8, 2, 0.2, 2, 1)
    assert fixed._tree_forwards(key, 6) == pytest.approx(2.0)


def test_a_tuned_chain_is_priced_by_its_positions_and_forwards_before_it_runs():
    """Before a chain child's first round, `speclm tune`'s rounds price it position by position
    (a draft whose tokens, once one passes, pass together: 3.3 tokens of 4, where a geometric
    chain at its per-token acceptance, 0.5, says 0.94) and by the draft forwards they ran per
    position drafted (draft+pld drafts some rounds by lookup: 2 forwards for 4 positions, not 4).
    Priced as geometric and a forward a position, it lost to a tree that gains less (auto planned
    eagle+pld where draft+pld commits more per second)."""
    costs = ForwardCosts({1: 1.0, 64: 1.0})
    chain = tune.ChildProfile(0.1, 0.5, 3.3, 4.0, 50, forwards=2.0, drafted_at=[1.0] * 4,
                              accepted_at=[0.9, 0.85, 0.8, 0.75])
    tree = tune.ChildProfile(0.1, 0.8, 1.5, 6.0, 50, forwards=1.0)
    policy = Adaptive(costs, measured={"model": chain, "tree": tree})
    key, group, request = _one_row({"model": _Child(4), "tree": _Tree(6)})
    accepted, drafted = policy._chain(key, request, Choice("model", 4))
    assert accepted == pytest.approx(3.3) and drafted == pytest.approx(4.0)
    assert policy._chain(key, request, Choice("model", 2))[0] == pytest.approx(1.75)
    seconds = policy._price([(key, group, request, Choice("model", 4), {})], 1, 0.0, 0).seconds
    assert seconds == pytest.approx(1.0 + 2 * 0.1)  # two forwards of 0.1 s, not four
    batch = SimpleNamespace(groups={key: group}, requests=[request])
    assert _round(policy, batch, group, {"model": 4, "tree": 0}) == Choice("model", 4)


def test_a_row_capped_short_is_priced_past_its_cap_by_how_its_rounds_went():
    """A row whose rounds, capped at 3 positions, accepted all 3: its positions past the cap are
    priced by the profile's step from position 3 to each next one taken from the row's own
    estimate at 3, not by the profile's position alone (times the ease): priced so, the planner kept
    capping a math answer at 4 of 6 positions that fixed draft+pld accepted (35 rounds where it
    took 28), the positions past its cap never reached and so never measured."""
    costs = ForwardCosts({1: 1.0, 64: 1.0})
    geometric = [0.6 ** (i + 1) for i in range(6)]
    model = tune.ChildProfile(0.12, 0.6, 1.5, 6.0, 50, forwards=6.0, drafted_at=[1.0] * 6, accepted_at=geometric)
    policy = Adaptive(costs, measured={"model": model})
    key, group, request = _one_row({"model": _Child(6)})
    for _ in range(30):
        policy.observe(request, 3, 3, 0.36, 3, 1, child="model", cap=3)
    short, long = (policy._chain(key, request, Choice("model", k))[0] for k in (3, 6))
    assert short > 2.8 and long - short > 1.0, (short, long)  # the profile's positions times the ease: 0.6
    policy.caps(SimpleNamespace(groups={key: group}, requests=[request]))
    assert group.proposer.plan[0].k > 3, group.proposer.plan


def test_a_child_priced_out_by_one_stalled_forward_is_tried_again():
    """The draft model's first forward here stalls (a page-fault storm, another process on the
    cores): measured at 100 times its tuned cost, it priced draft+pld out, and as it then never ran,
    its forward was never measured again (a whole run planned no draft model). A child no row runs
    has its measured forward drift back to its tuned one (ADAPTIVE_DECAY a round), so it is tried
    again, measured, and kept where it pays."""
    costs = ForwardCosts({1: 1.0, 64: 1.0})
    model = tune.ChildProfile(0.01, 0.8, 3.0, 4.0, 50, forwards=4.0, drafted_at=[1.0] * 4, accepted_at=[0.9, 0.8, 0.7, 0.6])
    tree = tune.ChildProfile(0.001, 0.6, 1.0, 4.0, 50, forwards=1.0)
    policy = Adaptive(costs, measured={"model": model, "tree": tree})
    key, group, request = _one_row({"model": _Child(4), "tree": _Tree(4)})
    batch = SimpleNamespace(groups={key: group}, requests=[request])
    policy.caps(batch)
    assert group.proposer.plan[0].child == "model"
    policy.observe(request, 4, 3, 4.0, 4, 1, child="model", cap=4)  # 1 s a forward: stalled

    def observe(n, choice):
        if choice.child == "model":
            policy.observe(request, choice.k, min(choice.k, 3), 0.01 * choice.k, choice.k, 1, child="model", cap=choice.k)
        elif choice.child == "tree":
            policy.observe(request, 4, 1, 0.001, 1, 1, child="tree")
    chosen = _planned(policy, batch, group, 60, observe)
    assert chosen[0] != "model" and "model" in chosen, chosen  # priced out by the stall, then tried again
    back = chosen.index("model")
    assert back < 40 and set(chosen[back:]) == {"model"}, chosen


def test_a_forward_slower_than_its_table_does_not_inflate_the_draft_forwards():
    """The target's forward runs 2x its table (a VM slower now than when the table was measured,
    bookkeeping the table leaves out); the draft forwards are measured here, at that speed. A ratio
    of each round's whole time to its price (draft forwards included) came out 1.57 after a round
    of the model's chain and 1.98 after the cheap tree's, and either way priced the tree, which
    commits fewer tokens per second, above the chain (auto planned eagle+pld where draft+pld was
    faster). Only the forward is scaled: the chain is kept."""
    model = tune.ChildProfile(0.25, 0.9, 3.0, 4.0, 50, forwards=4.0, drafted_at=[1.0] * 4, accepted_at=[1.0, 1.0, 1.0, 0.0])
    tree = tune.ChildProfile(0.02, 0.6, 1.5, 4.0, 50, forwards=1.0)
    policy = Adaptive(ForwardCosts({1: 1.0, 64: 1.0}), measured={"model": model, "tree": tree})
    key, group, request = _one_row({"model": _Child(4), "tree": _Tree(4)})
    batch = SimpleNamespace(groups={key: group}, requests=[request])

    def observe(n, choice):  # truth: the chain at 3 commits 4 tokens in 2.75 s, the tree 2.5 in 2.02 s
        if choice.child == "model":
            policy.observe(request, choice.k, min(choice.k, 3), 0.25 * choice.k, choice.k, 1, child="model", cap=choice.k)
        elif choice.child == "tree":
            policy.observe(request, 4, 1 + n % 2, 0.02, 1, 1, child="tree")
        policy.timed(2.0)  # the round past its proposals: the forward at 2x its table
    chosen = _planned(policy, batch, group, 60, observe)
    assert set(chosen[-20:]) == {"model"}, chosen
    assert group.proposer.plan[0].k == 3
    assert policy.ratio(1, True) == pytest.approx(2.0)


class _Heads(_Tree):
    """A tree child whose features wait while it sits out (EAGLE's pending features)."""

    def __init__(self, k, unread, per_token=None):
        super().__init__(k)
        self._unread, self._per_token = unread, per_token

    def unread(self, contexts):
        return [self._unread] * len(contexts)

    def reading_seconds(self, tokens):
        return None if self._per_token is None else tokens * self._per_token


def test_heads_that_sat_out_are_priced_for_the_features_they_would_read():
    """A row the heads have not drafted for 100 rounds has 300 features pending: the heads read
    them all before drafting it. Priced as a catch-up, its share of the rounds the row has left:
    as the heads measured it, else as `speclm tune` did; nothing pending, nothing."""
    tree = tune.ChildProfile(0.01, 0.6, 1.5, 4.0, 50, forwards=1.0, reading_seconds=0.002)
    policy = Adaptive(ForwardCosts({1: 1.0, 64: 1.0}), measured={"tree": tree})

    def seconds(heads, pending):  # the round's price, its reading included
        key, group, request = _one_row({"tree": heads})
        plan = [(key, group, request, Choice("tree", 4), {"tree": pending})]
        return 2.5 / policy._price(plan, 1, 0.0, 0).rate, request.tokens_left / 2.5  # 1 + 1.5 tokens a round

    base = 1.0 + 0.01  # the forward and one level
    priced, rounds_left = seconds(_Heads(4, 300), 300)
    assert priced == pytest.approx(base + 300 * 0.002 / rounds_left)
    assert seconds(_Heads(4, 300, per_token=0.004), 300)[0] == pytest.approx(base + 300 * 0.004 / rounds_left)
    assert seconds(_Heads(4, 0), 0)[0] == pytest.approx(base)


def _planned(policy, batch, group, rounds: int, observe) -> list:
    """The child planned in each of `rounds` rounds; observe(n, choice) tells the policy how round n went."""
    chosen = []
    for n in range(rounds):
        policy.caps(batch)
        choice = group.proposer.plan[0]
        chosen.append(choice.child)
        observe(n, choice)
    return chosen


def _ranked_pair():
    """A chain child `a` whose profile gains 2.0 tokens a round, a tree `b` gaining 1.8, at equal
    cost: a is the better by 10%."""
    a = tune.ChildProfile(0.001, 0.6, 2.0, 4.0, 50, forwards=4.0, drafted_at=[1.0] * 4, accepted_at=[0.7, 0.5, 0.45, 0.35])
    b = tune.ChildProfile(0.001, 0.6, 1.8, 4.0, 50, forwards=4.0)
    policy = Adaptive(ForwardCosts({1: 1.0, 64: 1.0}), measured={"a": a, "b": b})
    key, group, request = _one_row({"a": _Child(4), "b": _Tree(4)})
    return policy, SimpleNamespace(groups={key: group}, requests=[request]), group, request


def test_a_child_that_drafted_an_easy_workload_does_not_outrank_one_that_did_not():
    """Every request's rounds of `b` accepted 3 tokens where its profile said 1.8: the workload is
    easier than the profile's prompts, for every child. A mean per child over every request
    priced b at 3 and a, not drafted since, at its profile's 2.0: a new request took b (no-draft
    auto kept eagle+pld where draft+pld ran 1.09x its speed). The workload's ease moves both."""
    policy, batch, group, request = _ranked_pair()
    other = Request.of(1, list(range(10)), request.options, 1, None)
    for _ in range(60):
        policy.observe(other, 4, 3, 0.001, 4, 1, child="b")
    assert policy.ease(request, "a") > 1.4  # an easy workload, for a too
    policy.caps(batch)
    assert group.proposer.plan[0] == Choice("a", 4)
    sampled = Request.of(2, list(range(10)), replace(request.options, temperature=1.0), 2, None)
    assert policy.ease(sampled, "a") == 1.0  # another group's workload: sampled drafts are accepted less


def test_one_bad_round_of_a_child_does_not_send_a_request_to_the_next_best():
    """The better child's first round for a request accepts nothing. Alone, its own counts price
    it below the next child's prior, and the request moved there (and back when that one's first
    round went as badly). Text one child cannot guess the other mostly cannot either: the next
    child's prior moves with the request's ease, and the request stays."""
    policy, batch, group, request = _ranked_pair()
    for _ in range(2):  # its first round, and the one after it
        policy.caps(batch)
        assert group.proposer.plan[0] == Choice("a", 4)
        policy.observe(request, 4, 0, 0.001, 4, 1, child="a", cap=4)
        assert policy.ease(request, "b") < 0.75
    for _ in range(10):  # a collapsed for this request: the request moves on
        policy.caps(batch)
        policy.observe(request, 4, 0, 0.001, 4, 1, child="a", cap=4)
    assert group.proposer.plan[0] != Choice("a", 4)


def test_a_child_a_row_stopped_trying_is_tried_again_once_it_pays():
    """A row whose first rounds of a tree child accepted nothing moves to another child; while
    every other request accepts that tree's drafts, what the row measured itself drifts back to
    that prior (its counts of a child it did not try decay as every request's do), and the row tries
    the tree again (explored, not written off for good)."""
    costs = ForwardCosts({1: 1.0, 64: 1.2})
    policy = Adaptive(costs, measured={"tree": tune.ChildProfile(0.01, 0.8, 3.0, 6.0, 50, forwards=1.0)})
    key, group, request = _one_row({"tree": _Tree(6), "chain": _Child(2)})
    batch = SimpleNamespace(groups={key: group}, requests=[request])
    other = Request.of(1, list(range(10)), request.options, 1, None)

    def observe(n, choice):
        if choice.child == "tree":
            policy.observe(request, 6, 0 if n < 20 else 3, 0.01, 1, 1, child="tree")
        elif choice.child == "chain":
            policy.observe(request, choice.k, 1, 0.001, choice.k, 1, child="chain", cap=choice.k)
        policy.observe(other, 6, 3, 0.01, 1, 1, child="tree")  # every other request: 3 tokens a round
    chosen = _planned(policy, batch, group, 60, observe)
    assert chosen[0] == "tree" and "chain" in chosen[:12], chosen
    left = chosen.index("chain")
    assert "tree" in chosen[left:left + 35], chosen  # tried again (30 rounds later; unaged: not in 50)
    assert set(chosen[45:]) == {"tree"}, chosen  # and kept once it pays for this row too


def _copying_rows(policy, rounds: int) -> list:
    """A row whose text repeats its prompt's cycle of 8 tokens, with a prompt-lookup child (its
    profile: it drafts in a tenth of its rounds and accepts little) and a tree (its profile: 1.5
    tokens a round). Each round commits what the tree is told it accepted (one token past its
    target's) or all four looked up. Returns the child planned in each round."""
    cycle = list(range(5, 13))
    key, group, request = _one_row({"lookup": PromptLookupProposer(k=4), "tree": _Tree(6)})
    request.context[:] = cycle * 3
    request.prompt_len = len(request.context)
    batch = SimpleNamespace(groups={key: group}, requests=[request])

    def observe(n, choice):
        taken = 4 if choice.child == "lookup" else 1
        if choice.child is not None:
            policy.observe(request, 4 if choice.child == "lookup" else 6, taken, 0.001, 0 if choice.child == "lookup" else 1, 1,
                           child=choice.child, cap=choice.k if choice.child == "lookup" else None)
        for _ in range(taken + 1):  # the accepted tokens and the target's own
            request.context.append(cycle[len(request.context) % len(cycle)])
    return _planned(policy, batch, group, rounds, observe)


def _copying_policy():
    lookup = tune.ChildProfile(0.0, 0.05, 0.05, 0.4, 50, forwards=0.0, drafted_at=[0.1] * 4,
                               accepted_at=[0.02, 0.01, 0.01, 0.01])
    tree = tune.ChildProfile(0.001, 0.5, 1.5, 6.0, 50, forwards=1.0)
    return Adaptive(ForwardCosts({1: 1.0, 64: 1.0}), measured={"lookup": lookup, "tree": tree})


def test_a_lookup_child_is_priced_by_what_it_would_have_accepted_in_the_rows_text(monkeypatch):
    """Prompt lookup's profile (other text) says it seldom finds a match; this row copies its
    prompt, where every lookup of 4 tokens would be taken whole. While the tree is planned, the
    lookup's chains for the row (Proposer.shadow) are scored against the text the row then commits,
    and the row moves to the lookup, and stays: its rounds, 80x what its profile expected, do not
    raise the tree's prior (the ease: copying is easy for a lookup far beyond a model). Priced by
    its profile alone it was never tried (auto planned eagle+pld for every summary where prompt
    lookup ran faster): planted, with no shadows the row stays on the tree."""
    chosen = _copying_rows(_copying_policy(), 30)
    assert chosen[0] == "tree" and set(chosen[4:]) == {"lookup"}, chosen
    monkeypatch.setattr(PromptLookupProposer, "shadow", lambda self, contexts: None)
    assert set(_copying_rows(_copying_policy(), 30)) == {"tree"}


def test_a_new_request_prices_lookup_by_how_it_went_on_the_workload():
    """A lookup child's prior for a new request is its chains' record on the workload's text (the
    rounds and shadows of every request), not only its profile's: after one request that copies its
    prompt, the next starts on the lookup. Planted: priced by the profile alone, it starts on the tree."""
    policy = _copying_policy()
    assert _copying_rows(policy, 30)[0] == "tree"
    assert _copying_rows(policy, 5)[0] == "lookup"
    policy = _copying_policy()
    _copying_rows(policy, 30)
    policy._workload_curves.clear()  # the planted bug: the workload's record forgotten
    assert _copying_rows(policy, 5)[0] == "tree"


def _copy_and_novel_rows(policy, children, model_takes: int, rounds: int = 60):
    """A row whose text alternates 6 rounds copying its prompt's cycle of 8 tokens (a lookup finds
    a chain there and it is taken whole) with 6 rounds of new text (no lookup finds anything; a
    model's draft of 4 is taken for `model_takes` tokens). Returns (planned child, whether the
    lookup found a chain) per round."""
    cycle, fresh = list(range(5, 13)), iter(range(1000, 100000))
    key, group, request = _one_row(children)
    request.context[:] = cycle * 3
    request.prompt_len = len(request.context)
    batch = SimpleNamespace(groups={key: group}, requests=[request])
    found, chosen = [], []
    for n in range(rounds):
        chain = lookup(request.context, 4)
        policy.caps(batch)
        choice = group.proposer.plan[0]
        chosen.append(choice.child)
        found.append(bool(chain))
        copying = (n // 6) % 2 == 0
        if choice.child is None:
            taken, drafted, forwards = 0, 0, 0
        elif chain and choice.child == "lookup":
            taken, drafted, forwards = (len(chain) if copying else 0), len(chain), 0
        else:
            model = choice.child != "lookup"
            taken, drafted, forwards = (model_takes if model else 0), (choice.k if model else 0), (choice.k if model else 0)
        if choice.child is not None:
            policy.observe(request, drafted, min(taken, choice.k), 0.05 * forwards, forwards, 1,
                           child=choice.child, cap=choice.k)
        for _ in range(min(taken, max(choice.k, 0)) + 1):  # the accepted tokens and the target's own
            request.context.append(cycle[len(request.context) % len(cycle)] if copying else next(fresh))
    return chosen, found


def _lookup_and_model_policy():
    lookup_profile = tune.ChildProfile(0.0, 0.5, 2.0, 4.0, 50, forwards=0.0, drafted_at=[0.5] * 4,
                                       accepted_at=[0.5] * 4)
    model_profile = tune.ChildProfile(0.05, 0.6, 1.8, 4.0, 50, forwards=4.0, drafted_at=[1.0] * 4,
                                      accepted_at=[0.7, 0.5, 0.35, 0.25])
    return Adaptive(ForwardCosts({1: 1.0, 64: 1.0}), measured={"lookup": lookup_profile, "model": model_profile})


def test_a_lookup_child_is_priced_by_the_chain_it_finds_this_round(monkeypatch):
    """Prompt lookup finds its chain before the round at no cost: where it finds none it drafts
    nothing (priced as no draft), where it finds one its positions are priced as its drafted chains
    went. So a row whose text copies some stretches and not others takes the lookup where it finds
    a chain and the model where it does not. Planted (the round's chain unknown, the lookup priced
    by its record over every round): the lookup is planned in rounds where it drafts nothing."""
    chosen, found = _copy_and_novel_rows(_lookup_and_model_policy(), {"model": _Child(4), "lookup": PromptLookupProposer(k=4)}, 2)
    late = list(zip(chosen, found))[12:]
    assert all(child == "lookup" for child, hit in late if hit), late
    assert all(child == "model" for child, hit in late if not hit), late
    monkeypatch.setattr(Adaptive, "_chain", _unconditioned_chain)
    chosen, found = _copy_and_novel_rows(_lookup_and_model_policy(), {"model": _Child(4), "lookup": PromptLookupProposer(k=4)}, 2)
    assert any(child == "lookup" and not hit for child, hit in list(zip(chosen, found))[12:])


_conditioned_chain = Adaptive._chain


def _unconditioned_chain(self, key, r, choice):
    saved = dict(self._found)
    self._found.clear()
    try:
        return _conditioned_chain(self, key, r, choice)
    finally:
        self._found.update(saved)


def test_a_plus_lookup_child_drafts_by_its_model_inside_auto(target, monkeypatch):
    """Beside a lookup child, auto's `+pld` children (draft+pld, eagle+pld) draft every row they are
    planned for by their model: where the context repeats itself the plan weighs the lookup's chain
    (`pld`, priced by the chain found) against the model's draft, instead of the child's own lookup
    taking the round whatever it found. Their own methods keep the lookup. Planted (auto leaves the
    children's lookups on): the planned model drafts the lookup's chain."""
    from speclm.proposers import DraftLookupProposer
    from speclm.proposers.lookup_first import LookupFirstProposer
    from speclm.sampling import SamplingParams

    repeats = [5, 6, 7, 8, 5, 6]  # its last 2 tokens occurred before: a lookup drafts 7 8 5 6

    def drafted(child, planned: bool):
        children = {"model": child, "pld": PromptLookupProposer(k=4)}
        proposer = AutoProposer(children) if planned else None
        one = proposer or child
        one.start(1, 64)
        if planned:
            proposer.plan = [Choice("model", 4)]
        draft = one.propose([repeats], [4], SamplingParams(), [None])
        return draft.tokens[0, :int(draft.lengths[0])].tolist(), draft.forwards

    def plus_lookups():
        return DraftLookupProposer(target.model, k=4, ngram_min=2), LookupFirstProposer(_Child(4), k=4, ngram_min=2)

    for child in plus_lookups():  # alone (their own methods): the lookup's chain, no model forward
        assert drafted(child, planned=False) == ([7, 8, 5, 6], 0)
    model, heads = plus_lookups()
    tokens, forwards = drafted(model, planned=True)
    assert forwards == 4 and len(tokens) == 4  # the draft model drafted the row (its own tokens)
    assert drafted(heads, planned=True)[0] == [1, 1, 1, 1]  # the stand-in heads' draft
    monkeypatch.setattr(Proposer, "drop_lookup", lambda self: None)  # the planted bug
    monkeypatch.setattr(DraftLookupProposer, "drop_lookup", lambda self: None)
    monkeypatch.setattr(LookupFirstProposer, "drop_lookup", lambda self: None)
    for child in plus_lookups():
        assert drafted(child, planned=True) == ([7, 8, 5, 6], 0)


def replace_max(options, n):
    return replace(options, max_new_tokens=n)


def test_a_seeded_sampled_request_is_plain_decodings_in_any_batch(target, same_draft, heads):
    """Planned like any other (it draws by position: test_coupled.py), a seeded sampled request
    samples plain decoding's text alone and in a batch."""
    engine = SpecEngine(target, draft=same_draft)
    kw = dict(max_new_tokens=30, temperature=1.0)
    plain = engine.generate(PROMPTS[0], seed=7, method="none", **kw)
    alone = engine.generate(PROMPTS[0], seed=7, method="auto", heads=heads, **kw)
    batched = engine.generate(PROMPTS, seed=7, method="auto", heads=heads, **kw)[0]
    assert alone.token_ids == batched.token_ids == plain.token_ids
    assert sum(alone.stats.planned.values()) == alone.stats.target_forwards - 1


def test_choice_options_cover_children_and_lengths():
    policy = Adaptive(ForwardCosts({1: 1.0}))
    proposer = AutoProposer({"a": _Child(3), "b": _Child(1)})
    key = GenerationOptions(method="auto", k=2).proposer_key()
    options = policy._options(key, SimpleNamespace(proposer=proposer), None)
    assert options == [NO_DRAFT, Choice("a", 1), Choice("a", 2), Choice("b", 1)]  # k caps every child


class _LookupOnly(_Child):
    """A draft+pld child whose draft model is off for the rows marked (their prompts too long)."""

    def __init__(self, k, off):
        super().__init__(k)
        self.off = off

    def lookup_only(self):
        return self.off


def test_a_child_that_would_draft_a_row_by_lookup_alone_is_not_planned_for_it():
    """A draft+pld row whose prompt is too long for the draft model (a server's warm-up: 4 new
    tokens) is prompt lookup's: planned it, its lookup rounds taught the child's curve over every
    request that its model drafts nothing, and auto chose pld for every later request."""
    policy = Adaptive(ForwardCosts({1: 1.0, 2: 1.01, 64: 1.5}))  # verification nearly free: the model pays
    key, group, request = _one_row({"model": _LookupOnly(4, [True]), "lookup": _Child(2)})
    batch = SimpleNamespace(groups={key: group}, requests=[request])
    for _ in range(5):
        assert _round(policy, batch, group, {"model": 4, "lookup": 0}).child != "model"
    group.proposer.children["model"].off = [False]
    assert _round(policy, batch, group, {"model": 4, "lookup": 0}).child == "model"
    assert policy._options(key, group, request, frozenset({"model"})) == [NO_DRAFT, Choice("lookup", 1), Choice("lookup", 2)]


def test_after_tune_a_request_measures_nothing(target, same_draft, heads, monkeypatch, tmp_path):
    """`speclm tune` stores the profile (and the cost tables); a new engine's first auto request
    reads them: measuring anything then fails this test (counted, not timed)."""
    import speclm.forward.costs as costs

    monkeypatch.setenv("SPECLM_HOME", str(tmp_path))
    monkeypatch.setattr(costs, "BUSY", 0.0)  # a busy test machine's table is kept all the same
    opts = GenerationOptions(method="auto", heads=heads)
    tuned = SpecEngine(target, draft=same_draft)
    profile = tune.measure(tuned, opts)
    assert set(profile.children) == {"draft+pld", "eagle+pld", "pld"} and tune.path_of(tuned, opts).exists()
    for c in profile.children.values():  # by position: a round drafts position j+1 only past position j
        assert c.drafted_at and all(a <= d + 1e-9 for a, d in zip(c.accepted_at, c.drafted_at))
        assert sorted(c.drafted_at, reverse=True) == c.drafted_at and sum(c.accepted_at) == pytest.approx(c.gained)
    measured = []
    monkeypatch.setattr(costs, "measure", lambda *a, **k: measured.append("costs"))
    monkeypatch.setattr(tune, "measure", lambda *a, **k: measured.append("profile"))
    engine = SpecEngine(target, draft=same_draft)
    out = engine.generate(PROMPTS[0], method="auto", heads=heads, max_new_tokens=N)
    assert measured == [] and out.stats.target_forwards > 1
    assert engine.measured_children.keys() == profile.children.keys()
    shown = tune.show(engine, opts)
    assert "predicted speedup" in shown and all(name in shown for name in profile.children)
    with pytest.raises(UsageError):  # another draft: another profile, none stored
        tune.show(SpecEngine(target, draft=loaded(same_draft.model, same_draft.tokenizer, name="other")), opts)
    del profile.children["eagle+pld"]  # a profile measured before a method became a child: measured again
    tune.path_of(tuned, opts).write_text(profile.to_json())
    assert tune.load(tuned, opts) is None


def test_the_catalogs_draft_is_used_only_where_it_is_in_the_store(monkeypatch, capsys):
    """With no --draft, auto drafts with the draft the catalog names for the target, only where that
    is already in the store (said on stderr); nothing is pulled, and a method that drafts no model
    is given none."""
    from speclm import catalog
    from speclm.models import store
    from speclm.runtime import family_draft

    assert catalog.CATALOG["qwen2.5-coder-1.5b"].draft == "qwen2.5-coder-0.5b"
    monkeypatch.setattr(store, "cached_path", lambda name: None)  # not pulled
    assert family_draft("qwen2.5-coder-1.5b", "auto") is None
    monkeypatch.setattr(store, "cached_path", lambda name: f"/store/{name}")
    assert family_draft("qwen2.5-coder-1.5b", "pld") is None and capsys.readouterr().err == ""
    assert family_draft("qwen2.5-coder-1.5b", "auto") == "qwen2.5-coder-0.5b"
    assert "the catalog's draft for qwen2.5-coder-1.5b" in capsys.readouterr().err
    assert family_draft("smollm2-135m", "auto") is None  # it names no draft
    # --draft as given; `none`: no draft model, not even the catalog's (said nothing of)
    assert family_draft("qwen2.5-coder-1.5b", "auto", "my-draft") == "my-draft"
    assert family_draft("qwen2.5-coder-1.5b", "auto", "none") is None and capsys.readouterr().err == ""


def test_draft_none_with_a_method_that_needs_a_draft_is_a_usage_error(tmp_path, capsys, monkeypatch):
    """`--draft none`, or no --draft, beside a method that drafts with a model: one line, exit 2,
    before anything loads; the catalog's draft in the store is auto's alone, not taken for it."""
    from speclm.cli import main
    from speclm.models import store

    monkeypatch.setattr(store, "cached_path", lambda name: f"/store/{name}")
    for command in (["generate", "--prompt", "hi"], ["serve"]):
        for draft in (["--draft", "none"], []):
            code = main([*command, "--target", "qwen2.5-coder-1.5b", "--method", "draft", *draft])
            err = capsys.readouterr().err
            assert code == 2 and err.strip().splitlines() == ["speclm: error: --method draft needs --draft MODEL"], (
                command, draft, err)
    bench = ["bench", "--target", "qwen2.5-coder-1.5b", "--out", str(tmp_path / "run"), "--methods", "none,draft"]
    for draft in (["--draft", "none"], []):  # bench reads `none` as no draft too (never the catalog's)
        code = main([*bench, *draft])
        err = capsys.readouterr().err
        assert code == 2 and err.strip().splitlines() == [
            "speclm: error: methods draft, draft+pld, hf-assisted and openvino-draft need --draft MODEL"], (draft, err)
        assert not (tmp_path / "run").exists()
