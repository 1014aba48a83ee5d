"""Draft-model trees (speclm.proposers.draft_tree): greedy output equals plain decoding for every
tree shape, a draft equal to the target is accepted whole, the auto budget, and bad trees."""

import copy
import json

import pytest
import torch

from speclm import SpecEngine
from speclm.errors import UsageError
from speclm.forward.costs import ForwardCosts
from speclm.proposers.draft_tree import (MAX_NODES, TreeSpec, _best, _Node, _Plan, _sampled_counts, check_choices,
                                         coverage, parse_tree)
from speclm.quant.weights import quantize_model
from speclm.tree import ROOT
from tiny import loaded, tiny_model

PROMPTS = ["hello world, hello", "abc", "the quick brown fox jumps over the lazy dog, the quick"]
N = 40
SHAPES = {
    "chain3": [[0], [0, 0], [0, 0, 0]],
    "wide": [[0], [1], [2], [3]],
    "medusa-like": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0], [0, 0, 0, 0]],
}


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    root = tmp_path_factory.mktemp("trees")
    out = {}
    for name, choices in SHAPES.items():
        out[name] = str(root / f"{name}.json")
        with open(out[name], "w") as f:
            json.dump(choices, f)
    return out


@pytest.fixture(scope="module")
def int8_target(target):
    model = quantize_model(copy.deepcopy(target.model), "int8")
    return loaded(model, target.tokenizer, name="tiny-target-int8")


def plain(target, prompts, n=N):
    return SpecEngine(target).generate(prompts, method="none", max_new_tokens=n)


@pytest.mark.parametrize("weights", ["int8", "fp32"])
def test_trees_reproduce_plain_greedy_decoding(target, int8_target, unrelated_draft, trees, weights):
    """Every tree shape, draft and draft+pld, alone and in a ragged batch: plain decoding's tokens."""
    tgt = int8_target if weights == "int8" else target
    ref = [o.token_ids for o in plain(tgt, PROMPTS)]
    for draft in (unrelated_draft, tgt):
        engine = SpecEngine(tgt, draft=draft)
        # a flat cost line (every tree size costs one forward): `auto` drafts nodes whatever the cores
        # were doing while a measured line would be taken (a busy machine's line cut it to none)
        engine.forward_costs = lambda: ForwardCosts({n: 1.0 for n in (1, 2, 4, 8, 16, 32, 48)})
        for tree in ("auto", *trees.values()):
            for method in ("draft", "draft+pld"):
                batch = engine.generate(PROMPTS, method=method, tree=tree, max_new_tokens=N)
                assert [o.token_ids for o in batch] == ref, (draft.name, tree, method)
                alone = engine.generate(PROMPTS[0], method=method, tree=tree, max_new_tokens=N)
                assert alone.token_ids == ref[0], (draft.name, tree, method)
                assert alone.stats.verified_nodes > 0


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_draft_equal_to_the_target_is_accepted_whole(int8_target, trees, shape):
    """On int8 weights a draft identical to the target agrees with it bit for bit, so every round
    accepts the tree's deepest first-choice path: the draft's cache must hold exactly the
    committed tokens' keys and values after each round's moves and rollback."""
    depth = max(map(len, SHAPES[shape]))
    for prompt in PROMPTS:
        ref = plain(int8_target, prompt)
        out = SpecEngine(int8_target, draft=int8_target).generate(prompt, method="draft", tree=trees[shape],
                                                                  max_new_tokens=N)
        assert out.token_ids == ref.token_ids
        # the prefill commits one token, every later round depth + 1 (the last one fewer, at EOS or the budget)
        n = len(ref.token_ids)
        assert out.stats.target_forwards == 1 + -(-(n - 1) // (depth + 1))
        assert out.stats.accepted_per_position[0] >= out.stats.target_forwards - 2  # the last round may draft nothing
        assert out.stats.verified_nodes >= len(SHAPES[shape])


def test_auto_tree_budget_follows_the_measured_costs():
    """Greedy auto trees keep the nodes of highest cumulative probability, as many as maximise
    (1 + their probability) / (drafting time + verification time), parents always with them."""
    nodes = [_Node(1, ROOT, 0, (0,), 0.9, None), _Node(2, ROOT, 0, (1,), 0.05, None),
             _Node(3, 0, 1, (0, 0), 0.6, None), _Node(4, 2, 2, (0, 0, 0), 0.3, None)]
    free = _best(nodes, lambda n: 1.0, spent=0.0)  # verification costs the same at any size: keep all
    assert [n.token for n in free] == [1, 2, 3, 4] and [n.parent for n in free] == [ROOT, ROOT, 0, 2]
    steep = _best(nodes, lambda n: float(n), spent=0.0)  # each node costs a whole forward: keep none
    assert steep == []
    linear = _best(nodes, lambda n: 1.0 + 0.4 * (n - 1), spent=0.0)  # 0.9 and 0.6 pay for 0.4 each, 0.3 does not
    assert [n.token for n in linear] == [1, 3] and [n.parent for n in linear] == [ROOT, 0]


def test_forward_costs_follow_a_staircase():
    """The cost line interpolates the measured medians made non-decreasing: a kernel that reads
    1 to 7 rows at one price and 8 at another is priced so, not as one straight line."""
    costs = ForwardCosts({1: 0.10, 2: 0.10, 4: 0.11, 6: 0.09, 8: 0.15, 16: 0.20, 32: 0.36})
    assert costs(1) == pytest.approx(0.10) and costs(3) == pytest.approx(0.10)
    assert costs(4) == pytest.approx(0.10) and costs(6) == pytest.approx(0.10)  # 0.11 and 0.09 pooled
    assert costs(7) == pytest.approx(0.125) and costs(12) == pytest.approx(0.175)
    assert costs(64) > costs(32) == pytest.approx(0.36)  # past the last size: the line's slope
    assert all(costs(n) <= costs(n + 1) for n in range(1, 80))
    assert ForwardCosts({1: 0.2})(5) == pytest.approx(0.2)


def test_sampled_children_counts_follow_the_distribution():
    """A sampled auto tree chooses a node's children count from its distribution before drawing:
    a sure draft one child, an unsure one more, as many as the cost line says pay."""
    spec = TreeSpec(costs=lambda n: 1.0 + 0.05 * (n - 1), draft_costs=lambda n: 0.1)
    sure, unsure = torch.tensor([0.97, 0.01, 0.01, 0.01]), torch.full((4,), 0.25)
    assert coverage(unsure, 2)[0] == pytest.approx(0.25) and coverage(unsure, 2)[1] == pytest.approx(0.4375)
    assert _sampled_counts(spec, _Plan(spent=0.1), [1.0], [sure]) == [1]
    counts = _sampled_counts(spec, _Plan(spent=0.1), [1.0, 0.5], [unsure, unsure])
    assert counts[0] > 1 and counts[0] >= counts[1] >= 1 and max(counts) <= spec.branch
    free = TreeSpec(costs=lambda n: 1.0, draft_costs=lambda n: 0.1)  # verification free: every draw
    assert _sampled_counts(free, _Plan(spent=0.1), [1.0], [unsure]) == [4]


def test_tree_files_are_checked(tmp_path):
    assert parse_tree("chain") is None and parse_tree(None) is None
    assert parse_tree("auto") == TreeSpec()
    good = tmp_path / "good.json"
    good.write_text("[[0, 0], [0], [1]]")
    spec = parse_tree(str(good))
    assert spec.choices == ((0,), (1,), (0, 0)) and spec.max_depth == 2 and spec.max_nodes == 3
    bad = {
        "missing.json": None,
        "notjson.json": "[[0],",
        "empty.json": "[]",
        "orphan.json": "[[0], [1, 0]]",
        "negative.json": "[[-1]]",
        "twice.json": "[[0], [0]]",
        "flat.json": "[0, 1]",
        "bool.json": "[[true]]",
        "huge.json": json.dumps([[i] for i in range(MAX_NODES + 1)]),
    }
    for name, text in bad.items():
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        with pytest.raises(UsageError):
            parse_tree(str(path))
    assert check_choices([[0], [0, 1]]) == ((0,), (0, 1))  # rank 1 without rank 0 below a node: allowed


def test_tree_needs_a_draft_method(target):
    with pytest.raises(UsageError, match="--tree applies"):
        SpecEngine(target).generate("abc", method="pld", tree="auto", max_new_tokens=4)
    assert SpecEngine(target).generate("abc", method="pld", tree="chain", max_new_tokens=4).token_ids


def test_tree_padding_in_a_batch_keeps_rows_apart(int8_target, unrelated_draft):
    """Rows with trees of different sizes share forwards (padding nodes); each row's sampled output
    is the one it gets alone with its seed (int8 weights: a row's bits do not depend on the batch)."""
    draft = loaded(quantize_model(copy.deepcopy(unrelated_draft.model), "int8"), unrelated_draft.tokenizer, name="d8")
    engine = SpecEngine(int8_target, draft=draft)
    batch = engine.generate(PROMPTS, method="draft", tree="auto", max_new_tokens=N, temperature=0.9, seed=5)
    alone = [engine.generate(p, method="draft", tree="auto", max_new_tokens=N, temperature=0.9, seed=5 + i)
             for i, p in enumerate(PROMPTS)]
    assert [o.token_ids for o in batch] == [o.token_ids for o in alone]


def test_a_proposer_gets_the_accepted_path_and_the_targets_hidden_states(target):
    """The one hook: after each round `accept` receives the accepted path of the proposer's own
    draft and, for the layers it asks for, the target's hidden states at the root and every node."""
    from speclm.proposers import Draft, Proposer

    seen = []

    class Asks(Proposer):
        hidden_layers = (-1,)
        k, max_nodes = 1, 2

        def propose(self, contexts, max_tokens, params, generators):
            tokens = [[7, 8] if m > 0 else [] for m in max_tokens]  # two siblings: one deep
            draft = Draft.from_rows(tokens)
            draft.parents = torch.tensor([[-1, -1][: len(t)] + [-2] * (draft.width - len(t)) for t in tokens])
            return draft

        def accept(self, verified):
            seen.append(verified)

    engine = SpecEngine(target)
    engine.make_proposer = lambda opts: Asks()
    ref = plain(target, PROMPTS[0], n=6)
    out = engine.generate(PROMPTS[0], method="pld", max_new_tokens=6)
    assert out.token_ids == ref.token_ids
    hidden_size = target.model.config.hidden_size
    for v in seen[1:-1]:  # rounds with two sibling nodes (the prefill round drafts nothing)
        assert v.hidden[-1].shape == (1, 3, hidden_size) and len(v.paths[0]) <= 1
        # the root's features give the target's logits after it: the verifier's argmax decided the path
        with torch.no_grad():
            root_next = int(target.model.lm_head(v.hidden[-1][0, 0]).argmax())
        assert (v.paths[0] == [0]) == (root_next == 7) and (v.paths[0] == [1]) == (root_next == 8)


def test_acceptance_is_measured_by_rank_and_draft_probability():
    """A node the target tested (a child of the root or of an accepted node) counts toward its
    (rank, probability tenth) cell; untested nodes do not."""
    from speclm.proposers.draft_tree import DraftTimes, record_acceptance

    times = DraftTimes()
    assert times.acceptance(0.75, 0) == pytest.approx(0.75)  # before any measurement: the draft's probability
    nodes = [_Node(1, ROOT, 0, (0,), 0.9, None, local=0.9), _Node(2, ROOT, 0, (1,), 0.05, None, local=0.05),
             _Node(3, 0, 1, (0, 0), 0.5, None, local=0.55), _Node(4, 1, 1, (1, 0), 0.01, None, local=0.2)]
    for _ in range(20):
        record_acceptance(times, nodes, [0])  # node 0 accepted; 1 rejected; 2 tested and rejected; 3 untested
    assert times.acceptance(0.9, 0) > 0.95 and times.acceptance(0.55, 0) < 0.1
    assert times.acceptance(0.05, 1) < 0.05 and times.acceptance(0.2, 0) == pytest.approx(0.25)  # untested: its prior


def test_a_cost_table_measured_on_a_busy_machine_is_used_but_not_kept(tmp_path, monkeypatch, capsys):
    """A table measured while other work held the cores times that work too: it serves the
    process that measured it and is measured again, never kept for later trees."""
    from speclm.forward import costs

    monkeypatch.setenv("SPECLM_HOME", str(tmp_path))
    real = costs.measure(tiny_model(300, 0), sizes=(1, 2), repeats=1)
    assert set(real.seconds) == {1, 2} and 0 < real.cpu_share < 4
    shares = [0.5, 0.5, 1.0, 0.5]

    def fake(model):
        return ForwardCosts({1: 1.0, 2: 1.5}, cpu_share=shares.pop(0))

    monkeypatch.setattr(costs, "measure", fake)
    for _ in range(2):  # busy: measured each time, nothing kept
        assert costs.verification_costs(None, "m")(2) == 1.5
        assert not list(tmp_path.glob("costs/*.json"))
        assert "busy" in capsys.readouterr().err
    costs.verification_costs(None, "m")  # an idle machine's table is kept and read after
    assert len(list(tmp_path.glob("costs/*.json"))) == 1
    assert costs.verification_costs(None, "m")(2) == 1.5 and shares == [0.5]


def test_a_kept_cost_table_belongs_to_the_kernels_and_the_count_that_measured_it(tmp_path, monkeypatch):
    """Trees are priced by the kept table; after the compiled kernels change (another build, or
    none), or the forwards timed per size (an older, noisier default), the table is measured
    again instead of read."""
    from speclm.forward import costs
    from speclm.quant import kernels

    assert costs.FORM.endswith(f"-r{costs.REPEATS}")
    monkeypatch.setenv("SPECLM_HOME", str(tmp_path))
    measured = []

    def fake(model):
        measured.append(1)
        return ForwardCosts({1: 1.0, 2: float(len(measured))})

    monkeypatch.setattr(costs, "measure", fake)
    monkeypatch.setattr(kernels, "fingerprint", lambda: "build-a")
    assert costs.verification_costs(None, "m")(2) == 1.0
    assert costs.verification_costs(None, "m")(2) == 1.0 and len(measured) == 1  # read back
    monkeypatch.setattr(kernels, "fingerprint", lambda: "build-b")
    assert costs.verification_costs(None, "m")(2) == 2.0 and len(measured) == 2
    assert len(list(tmp_path.glob("costs/*.json"))) == 2
    monkeypatch.setattr(costs, "FORM", "all-logits-r5")
    assert costs.verification_costs(None, "m")(2) == 3.0 and len(measured) == 3
    assert costs.verification_costs(None, "m")(2) == 3.0 and len(measured) == 3


def test_a_cost_table_is_the_median_of_its_forwards_after_the_first_pass(monkeypatch):
    """measure drops the warm-up pass (each shape's first forward allocates) and keeps each size's median."""
    from speclm.forward import costs

    passes = []

    def fake(model, sizes, count, desc="verification cost"):
        passes.append(count)
        return {1: [9.0, 3.0, 1.0, 2.0], 2: [9.0, 4.0, 6.0, 5.0]}, 1.0

    monkeypatch.setattr(costs, "sample", fake)
    table = costs.measure(None, sizes=(1, 2), repeats=3)
    assert table.seconds == {1: 2.0, 2: 5.0} and passes == [4]


def test_a_new_cost_table_removes_other_builds_tables_unread_for_a_month(tmp_path, monkeypatch):
    """Each kernel build measures its own table; an upgrade would leave the old build's behind
    for good. Storing a table removes the other builds' tables of the same model and processor that
    were not read for STALE_DAYS; a table in use (read recently, as by a second install sharing
    the folder) and other models' tables stay."""
    import os
    import time

    from speclm.forward import costs
    from speclm.quant import kernels

    monkeypatch.setenv("SPECLM_HOME", str(tmp_path))
    monkeypatch.setattr(costs, "measure", lambda model: ForwardCosts({1: 1.0, 2: 1.5}))
    month = costs.STALE_DAYS * 86400
    for build in ("build-a", "build-b"):
        monkeypatch.setattr(kernels, "fingerprint", lambda build=build: build)
        costs.verification_costs(None, "m")
    costs.verification_costs(None, "other-model")  # build-b's
    files = {p.name: p for p in tmp_path.glob("costs/*.json")}
    assert len(files) == 3
    old = time.time() - month - 60
    for p in files.values():
        os.utime(p, (old, old))
    monkeypatch.setattr(kernels, "fingerprint", lambda: "build-a")
    costs.verification_costs(None, "m")  # read: build-a's table is in use again, nothing stored
    assert len(list(tmp_path.glob("costs/*.json"))) == 3
    monkeypatch.setattr(kernels, "fingerprint", lambda: "build-c")
    costs.verification_costs(None, "m")  # stored: build-b's (unread for a month) goes
    names = sorted(p.name for p in tmp_path.glob("costs/*.json"))
    assert len(names) == 3 and not any("build-b" in n and n.startswith("m-") for n in names)
    assert any("build-a" in n for n in names) and any(n.startswith("other-model") for n in names)


def test_the_cost_tables_are_measured_before_a_request_runs_and_once_per_engine(
        int8_target, unrelated_draft, tmp_path, monkeypatch):
    """A method that sizes trees from measured costs has them measured when its request is made,
    not inside its first round (where the request's time and stats would carry them); an engine
    measures a table once, even one a busy machine keeps from the disk."""
    from speclm.forward import costs

    monkeypatch.setenv("SPECLM_HOME", str(tmp_path))
    measured = []

    def fake(model):
        measured.append(model)
        return ForwardCosts({1: 1.0, 8: 1.2}, cpu_share=0.5)  # busy: not stored

    monkeypatch.setattr(costs, "measure", fake)
    engine = SpecEngine(int8_target, draft=unrelated_draft)
    engine.request("abc", method="draft", tree="auto")
    assert measured == [int8_target.model]
    engine.request("abc", method="draft", tree="auto", temperature=0.8)  # sampling: the draft's too
    assert measured == [int8_target.model, unrelated_draft.model]
    for _ in range(2):
        engine.generate(PROMPTS[:2], method="draft+pld", tree="auto", max_new_tokens=8)
        engine.generate(PROMPTS[0], method="draft", tree="auto", max_new_tokens=8, temperature=0.8, seed=1)
    assert len(measured) == 2
    engine.request("abc", method="draft")  # a chain: nothing to measure
    assert len(measured) == 2 and not list(tmp_path.glob("costs/*.json"))


def test_the_kernels_fingerprint_follows_their_source(tmp_path, monkeypatch):
    """A changed kernel source gives another fingerprint (where the compiled kernels run)."""
    from speclm.quant import kernels

    if kernels.compiled() is None:
        assert kernels.fingerprint() == "torch"
        return
    first = kernels.fingerprint()
    assert first != "torch" and len(first) == 10
    _, source_name, _, _ = kernels.BUILDS[kernels.isa()]
    csrc = kernels.SOURCE.parent
    (tmp_path / "csrc").mkdir()
    (tmp_path / "csrc" / source_name).write_bytes((csrc / source_name).read_bytes() + b"\n// changed\n")
    (tmp_path / "csrc" / "common.h").write_bytes((csrc / "common.h").read_bytes())
    monkeypatch.setattr(kernels, "__file__", str(tmp_path / "kernels.py"))  # the sources beside it: the copies
    kernels.fingerprint.cache_clear()
    try:
        assert kernels.fingerprint() != first
    finally:
        kernels.fingerprint.cache_clear()
