"""n completions per prompt (SpecEngine.generate(..., n=)): choice i of prompt p samples with
seed + p * n + i, each the same as its own run with that seed, and the later choices start from
the first's keys and values (the prefix cache, on int8 weights). The server's n: tests/test_serve.py."""

from __future__ import annotations

import copy

import pytest

from speclm import SpecEngine
from speclm.errors import UsageError
from speclm.quant.weights import quantize_model
from tiny import loaded

PROMPTS = ["ab ab ab ab", "hello world, hello"]


@pytest.fixture(scope="module")
def engine(target):
    t8 = loaded(quantize_model(copy.deepcopy(target.model), "int8"), target.tokenizer, name="tiny-int8")
    return SpecEngine(t8, draft=t8)


@pytest.mark.parametrize("method", ["none", "draft+pld"])
def test_each_choice_is_its_own_seeded_run(engine, method):
    outs = engine.generate(PROMPTS, n=3, method=method, max_new_tokens=16, temperature=0.9, seed=5)
    assert len(outs) == 6 and [o.prompt_index for o in outs] == [0, 0, 0, 1, 1, 1]
    for k, o in enumerate(outs):
        alone = engine.generate(PROMPTS[k // 3], method=method, max_new_tokens=16, temperature=0.9, seed=5 + k)
        assert o.token_ids == alone.token_ids, k
    assert len({tuple(o.token_ids) for o in outs[:3]}) > 1  # sampled apart
    for o in outs[1:3] + outs[4:]:  # the later choices read the prompt from the first's keys and values
        assert o.stats.cached_tokens == len(engine.target.tokenizer(PROMPTS[outs.index(o) // 3]).input_ids) - 1


def test_one_prompt_gives_a_list_and_n_is_checked(engine):
    one = engine.generate(PROMPTS[0], n=2, max_new_tokens=8)
    assert isinstance(one, list) and len(one) == 2 and one[0].token_ids == one[1].token_ids  # greedy
    assert not isinstance(engine.generate(PROMPTS[0], max_new_tokens=4), list)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(UsageError, match="n must be"):
            engine.generate(PROMPTS[0], n=bad)
