"""A request that sets a seed draws each token by its position (speclm.sampling.Coupled): its
sampled text is its plain decoding's with that seed, token for token, whatever the method, the
plan auto makes, the draft length or the batch (where the target's logits are the same bits:
the tiny models here, fp32 and int8). Its exact distribution is checked in
test_sampling_distribution.py (cases coupled-*, and a mutation that must fail them)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from speclm import SpecEngine
from speclm.proposers.draft_model import DraftModelProposer
from speclm.sampling import Coupled
from test_auto import int8_pair, same_draft  # noqa: F401 (fixtures: a draft equal to the target, an int8 pair)
from tiny import random_heads, random_plan

PROMPTS = ["hello world, hello", "abc", "the quick brown fox jumps over the lazy dog, the quick",
           "def f(x):\n    return x\n\ndef f("]
N = 30
SAMPLED = dict(temperature=1.0, top_p=0.95, seed=5)


@pytest.fixture(scope="module")
def heads(tmp_path_factory, target):
    return {kind: random_heads(kind, target.model, tmp_path_factory.mktemp("coupled") / f"{kind}.safetensors", seed=1,
                               std=0.3) for kind in ("eagle", "medusa")}


METHODS = [("draft", {}), ("draft", {"tree": "auto"}), ("pld", {}), ("draft+pld", {}), ("medusa", {"heads": "medusa"}),
           ("eagle", {"heads": "eagle"}), ("eagle+pld", {"heads": "eagle"}), ("lookahead", {}),
           ("self", {"layers": "1", "self_weights": "target"}), ("auto", {"heads": "eagle"})]


@pytest.mark.parametrize("weights", ["fp32", "int8"])
def test_seeded_sampled_text_is_plain_decodings_whatever_the_method(target, same_draft, int8_pair, heads, weights):
    t, d = (target, same_draft) if weights == "fp32" else int8_pair
    engine = SpecEngine(t, draft=d)
    refs = engine.generate(PROMPTS, method="none", max_new_tokens=N, **SAMPLED)
    alone = [engine.generate(p, method="none", max_new_tokens=N, **SAMPLED, ).token_ids for p in PROMPTS[:1]]
    assert alone == [refs[0].token_ids]  # prompt 0's seed is the same alone
    for method, options in METHODS:
        options = {k: heads[v] if k == "heads" else v for k, v in options.items()}
        if method == "auto":
            random_plan(engine, seed=2)  # rows on any child, at any length, or none, round by round
        outs = engine.generate(PROMPTS, method=method, max_new_tokens=N, **SAMPLED, **options)
        assert [o.token_ids for o in outs] == [r.token_ids for r in refs], (method, options)
        outs = engine.generate(PROMPTS, method=method, max_new_tokens=N, batch_size=1, **SAMPLED, **options)
        assert [o.token_ids for o in outs] == [r.token_ids for r in refs], (method, options, "alone")
    other = engine.generate(PROMPTS, method="none", max_new_tokens=N, **{**SAMPLED, "seed": 6})
    assert [o.token_ids for o in other] != [r.token_ids for r in refs]  # the seed matters


def test_a_draft_equal_to_the_target_drafts_the_target_s_draws(target, same_draft):
    """A draft model draws its tokens with the request's variables too: a draft equal to the target
    then drafts exactly what the target draws, and every drafted token is accepted. A draft that
    ignored them (drawing from its own generator) would match the target's draw with probability
    sum_x p(x)^2 < 1 per token: the second half shows the first can fail."""
    engine = SpecEngine(target, draft=same_draft)
    outs = engine.generate(PROMPTS, method="draft", max_new_tokens=N, **SAMPLED)
    drafted = sum(o.stats.drafted_tokens for o in outs)
    assert drafted > 0 and sum(o.stats.accepted_tokens for o in outs) == drafted
    with mock.patch.object(DraftModelProposer, "draws", property(lambda self: (), lambda self, value: None)):
        own = engine.generate(PROMPTS, method="draft", max_new_tokens=N, **SAMPLED)
    assert [o.token_ids for o in own] == [o.token_ids for o in outs]  # the same text, fewer accepted
    assert sum(o.stats.accepted_tokens for o in own) < sum(o.stats.drafted_tokens for o in own)


def test_a_draw_follows_its_distribution_and_its_columns():
    """Coupled.token over a restricted vocabulary (a draft's own columns and their token ids) draws
    the token the full vocabulary would, where the distribution is the same."""
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    ids = torch.tensor([1, 3, 4])
    draws = Coupled(seed=9, vocab=6)
    for position in range(200):
        full = draws.token(probs, position)
        column = draws.token(probs[ids], position, ids)
        assert probs[full] > 0 and int(ids[column]) == full
