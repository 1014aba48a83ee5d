"""draft+pld (speclm.proposers.draft_lookup): a row whose context repeats itself is drafted by
lookup, the others by the draft model; the draft's cache holds only committed tokens; greedy
output stays plain decoding's (sampling: test_sampling_distribution)."""

import pytest

from speclm import SpecEngine
from speclm.engine import GenerationOptions
from speclm.defaults import NGRAM_MIN_DRAFT_PLD as DRAFT_LOOKUP_NGRAM_MIN
from speclm.proposers import DraftLookupProposer, lookup
from speclm.proposers.base import Verified
from speclm.sampling import SamplingParams

GREEDY = SamplingParams()
REPEATS = [5, 6, 7, 8, 5, 6]  # its last 2 tokens occurred before: lookup proposes 7 8 5
FRESH = [9, 10, 11, 12, 13, 14]  # no token occurs twice: the draft model proposes


def test_rows_choose_lookup_or_the_model_and_the_cache_keeps_only_committed_tokens(target):
    proposer = DraftLookupProposer(target.model, k=3, ngram_min=2)
    proposer.start(2, 64)
    draft = proposer.propose([REPEATS, FRESH], [3, 3], GREEDY, [None, None])
    assert draft.lengths.tolist() == [3, 3] and draft.forwards == 3
    assert draft.tokens[0].tolist() == lookup(REPEATS, 3, 3, 2) == [7, 8, 5]
    # the model ran the fresh row alone and fed all but its last token; the lookup row waits
    assert proposer.kv.lengths_list() == [0, len(FRESH) + 2]
    # 2 lookup tokens and 1 model token accepted
    proposer.accept(Verified([len(REPEATS) + 2, len(FRESH) + 1], [[0, 1], [0]]))
    assert proposer.kv.lengths_list() == [0, len(FRESH) + 1]
    assert proposer.lookups == 1


def test_all_rows_by_lookup_run_no_model_forward_and_the_model_catches_up_later(target):
    proposer = DraftLookupProposer(target.model, k=4, ngram_min=2)
    proposer.start(1, 64)
    draft = proposer.propose([REPEATS], [4], GREEDY, [None])
    assert draft.forwards == 0 and draft.draft_probs is None
    assert draft.tokens[0].tolist() == [7, 8, 5, 6] and proposer.kv.lengths_list() == [0]
    proposer.accept(Verified([len(REPEATS) + 4], [[0, 1, 2, 3]]))
    later = REPEATS + [7, 8, 5, 6, 3, 4]  # committed meanwhile; 3 4 never occurred before
    draft = proposer.propose([later], [2], GREEDY, [None])
    assert draft.forwards == 2 and draft.lengths.tolist() == [2]
    assert proposer.kv.lengths_list() == [len(later) + 1]  # the whole context fed in this round


def test_ngram_min_defaults_and_budgets(target):
    assert GenerationOptions(method="draft+pld").lookup_ngram_min == DRAFT_LOOKUP_NGRAM_MIN
    assert GenerationOptions(method="pld").lookup_ngram_min == 1
    assert GenerationOptions(method="draft+pld", ngram_min=4, ngram_max=5).lookup_ngram_min == 4
    proposer = SpecEngine(target, draft=target).make_proposer(GenerationOptions(method="draft+pld", k=5))
    assert isinstance(proposer, DraftLookupProposer) and proposer.beside.min_ngram == DRAFT_LOOKUP_NGRAM_MIN
    proposer.start(2, 64)
    draft = proposer.propose([REPEATS, REPEATS], [1, 0], GREEDY, [None, None])
    assert draft.lengths.tolist() == [1, 0] and draft.forwards == 0


@pytest.mark.parametrize("k", [2, 5])
def test_greedy_output_is_plain_decoding_and_both_proposers_draft(target, unrelated_draft, monkeypatch, k):
    prompt = "the quick brown fox jumps over the lazy dog, the quick brown"
    plain = SpecEngine(target).generate(prompt, method="none", max_new_tokens=40)
    engine = SpecEngine(target, draft=unrelated_draft)
    made = []
    real = engine.make_proposer
    monkeypatch.setattr(engine, "make_proposer", lambda opts: made.append(real(opts)) or made[-1])
    out = engine.generate(prompt, method="draft+pld", k=k, max_new_tokens=40, ngram_min=1)
    assert out.token_ids == plain.token_ids
    assert made[0].lookups > 0 and out.stats.draft_forwards > 0


def test_long_prompts_leave_the_draft_model_off_and_draft_as_pld(target):
    proposer = DraftLookupProposer(target.model, k=6, ngram_min=2, prompt_ratio=3.0, lookup_k=2)
    prompt = [1, 2, 3, 4, 5, 6, 7, 3, 9, 9]  # 10 tokens; its last token, 9, occurred once before
    proposer.start(1, 64, [len(prompt)], [3])  # 10 > 3 * 3: off
    assert proposer.model_on == [False]
    draft = proposer.propose([prompt], [5], GREEDY, [None])
    # pld's settings: any n-gram (here the unigram 9), lookup_k tokens
    assert draft.tokens[0].tolist() == lookup(prompt, 2, 3, 1) == [9] and draft.forwards == 0
    proposer.start(1, 64, [len(prompt)], [4])  # 10 <= 3 * 4: on
    assert proposer.model_on == [True]
    proposer.start(2, 64, [len(prompt), 100], [4, 4])  # each row decides for itself
    assert proposer.model_on == [True, False]
    proposer.add(1, [3], [1])  # a row joining later too
    assert proposer.model_on == [True, False, True]


@pytest.mark.parametrize("ratio, model_runs", [(0.0, False), (float("inf"), True)])
def test_draft_prompt_ratio_end_to_end(target, unrelated_draft, ratio, model_runs):
    prompt = "abc abc abc abc abc abc abc abc abc abc"
    plain = SpecEngine(target).generate(prompt, method="none", max_new_tokens=30)
    out = SpecEngine(target, draft=unrelated_draft).generate(prompt, method="draft+pld", max_new_tokens=30,
                                                             draft_prompt_ratio=ratio)
    assert out.token_ids == plain.token_ids
    assert (out.stats.draft_forwards > 0) == model_runs


def test_sampling_draws_only_for_the_rows_the_model_drafts(target):
    """A lookup row's generator is left untouched when the model drafts the other rows beside it,
    and a model row draws what it draws alone: sampled output does not depend on the batch."""
    import torch

    params = SamplingParams(temperature=1.0)
    proposer = DraftLookupProposer(target.model, k=3, ngram_min=2)
    proposer.start(2, 64)
    gens = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    proposer.propose([REPEATS, FRESH], [3, 3], params, gens)
    alone = DraftLookupProposer(target.model, k=3, ngram_min=2)
    alone.start(1, 64)
    gen = torch.Generator().manual_seed(2)
    alone.propose([FRESH], [3], params, [gen])
    assert torch.equal(gens[0].get_state(), torch.Generator().manual_seed(1).get_state())
    assert torch.equal(gens[1].get_state(), gen.get_state())
