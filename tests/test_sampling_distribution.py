"""Speculative sampling follows the target's exact distribution.

On a tiny model with a 6-token vocabulary, the exact joint distribution of the first three
generated tokens is computed from the target alone (36 forwards). Many independent
requests, one row each with its own generator, are decoded as one batch with `draft`,
`pld` and `draft+pld`; their first three tokens are compared with the exact distribution by a
chi-square test (see chisq.py: each check fails a correct sampler with probability ALPHA = 1e-4, so
the whole file with its 11 checks has a false-failure probability below 1.1e-3).
The first round drafts up to k = 3 tokens, so acceptance, residual resampling and the bonus
token all shape these three tokens.

test_broken_verifier_is_caught shows the check has power: a verifier that resamples from
the target instead of the residual after a rejection fails it; so does a draft+pld batch whose
lookup rows are verified against the draft model's probabilities
(test_mixed_batch_with_wrong_draft_probabilities_is_caught). The alternatives' own step has
its power test in test_verify.py, on hand-made distributions far apart.
"""

import itertools

import numpy as np
import pytest
import torch

import speclm.verify as verify_mod
from chisq import ALPHA, chisq_pvalue
from speclm import SpecEngine
from speclm.sampling import SamplingParams, processed_probs
from tiny import loaded, tiny_model, word_tokenizer

V = 6
DEPTH = 3
SAMPLES = 6000
PROMPT = "w1 w2 w3 w1 w2 w3 w4 w1 w2"  # repeats, so prompt lookup proposes from the first round


@pytest.fixture(scope="module")
def small():
    tok = word_tokenizer(V)
    target = loaded(tiny_model(V, seed=3, init=0.15), tok, name="t", eos=False)
    draft = loaded(tiny_model(V, seed=4, layers=1, init=0.15), tok, name="d", eos=False)
    return tok, target, draft


def exact_joint(target, prompt_ids, params) -> np.ndarray:
    """P(first DEPTH tokens) under the target's processed distribution, shape (V,) * DEPTH."""
    joint = np.zeros((V,) * DEPTH)
    model = target.model
    with torch.no_grad():
        for prefix in itertools.product(range(V), repeat=DEPTH - 1):
            ids = torch.tensor([prompt_ids + list(prefix)])
            probs = processed_probs(model(ids).logits[0, len(prompt_ids) - 1 :], params).double().numpy()
            p_prefix = np.prod([probs[i, t] for i, t in enumerate(prefix)])
            joint[prefix] = p_prefix * probs[DEPTH - 1]
    return joint


def sampled_counts(engine, prompt_ids, method, params, **options) -> np.ndarray:
    outs = engine.generate(
        [prompt_ids] * SAMPLES, method=method, k=3, max_new_tokens=DEPTH + 1, seed=11,
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, **options,
    )
    counts = np.zeros((V,) * DEPTH)
    for o in outs:
        counts[tuple(o.token_ids[:DEPTH])] += 1
    return counts


CASES = [
    ("draft", SamplingParams(temperature=1.0), {}),
    ("draft", SamplingParams(temperature=0.7, top_k=4, top_p=0.9), {}),
    # rows stop drafting where the draft is unsure: drafts of 1, 2 or 3 tokens in one batch
    ("draft", SamplingParams(temperature=1.0), {"confidence": 0.35}),
    ("pld", SamplingParams(temperature=1.0), {}),
    ("pld", SamplingParams(temperature=1.3, top_p=0.8), {}),
    # rows drafted by lookup and rows drafted by the model in one batch (the contexts differ
    # after the first token; a 2-gram recurs in some of them)
    ("draft+pld", SamplingParams(temperature=1.0), {}),
    ("draft+pld", SamplingParams(temperature=0.8, top_k=5), {"ngram_min": 3, "confidence": 0.35}),
    # alternatives: every drafted token gets a second, independent draw verified beside it
    ("draft", SamplingParams(temperature=1.0), {"alternatives": 1.0}),
    ("draft", SamplingParams(temperature=0.8, top_k=5), {"alternatives": 0.6, "confidence": 0.35}),
    ("draft+pld", SamplingParams(temperature=1.0), {"alternatives": 1.0}),
]


@pytest.mark.parametrize("method, params, options", CASES)
def test_first_tokens_follow_target_distribution(small, method, params, options):
    tok, target, draft = small
    prompt_ids = tok(PROMPT).input_ids
    engine = SpecEngine(target, draft=draft)
    counts = sampled_counts(engine, prompt_ids, method, params, **options)
    joint = exact_joint(target, prompt_ids, params)
    assert chisq_pvalue(counts, joint) > ALPHA


def test_plain_sampling_follows_target_distribution(small):
    tok, target, _ = small
    prompt_ids = tok(PROMPT).input_ids
    params = SamplingParams(temperature=1.0)
    counts = sampled_counts(SpecEngine(target), prompt_ids, "none", params)
    assert chisq_pvalue(counts, exact_joint(target, prompt_ids, params)) > ALPHA


def test_broken_verifier_is_caught(small, monkeypatch):
    """Resampling from target_probs instead of the residual biases the output: the test must see it."""
    tok, target, draft = small
    prompt_ids = tok(PROMPT).input_ids
    params = SamplingParams(temperature=1.0)
    real_verify = verify_mod.verify

    def no_residual(target_logits, draft_obj, p, generators):
        verdict = real_verify(target_logits, draft_obj, p, generators)
        probs = processed_probs(target_logits.cpu(), p)
        for b in range(len(generators)):
            n = int(verdict.num_accepted[b])
            if n < int(draft_obj.lengths[b]):
                verdict.tokens[b, n] = torch.multinomial(probs[b, n], 1, generator=generators[b]).item()
        return verdict

    monkeypatch.setattr("speclm.engine.verify", no_residual)
    counts = sampled_counts(SpecEngine(target, draft=draft), prompt_ids, "pld", params)
    assert chisq_pvalue(counts, exact_joint(target, prompt_ids, params)) < ALPHA


def test_mixed_batch_with_wrong_draft_probabilities_is_caught(small, monkeypatch):
    """draft+pld: rows drafted by lookup must be verified as one-hot drafts. Reading the draft
    model's distribution for them instead (as if the model had drafted them) biases the output."""
    import speclm.proposers.draft_lookup as draft_lookup

    real = draft_lookup._mixed

    def model_probs_for_every_row(rows, by_lookup, model, params):
        return real(rows, [False] * len(rows), model, params)

    monkeypatch.setattr(draft_lookup, "_mixed", model_probs_for_every_row)
    tok, target, draft = small
    prompt_ids = tok(PROMPT).input_ids
    params = SamplingParams(temperature=1.0)
    counts = sampled_counts(SpecEngine(target, draft=draft), prompt_ids, "draft+pld", params)
    assert chisq_pvalue(counts, exact_joint(target, prompt_ids, params)) < ALPHA

