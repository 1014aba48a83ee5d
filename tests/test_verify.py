"""The verifier alone, on hand-made logits and drafts."""

import numpy as np
import torch

from chisq import ALPHA, chisq_pvalue
from speclm.proposers import Draft
from speclm.sampling import SamplingParams, processed_probs
from speclm.round.verify import verify

GREEDY = SamplingParams()


def logits_preferring(tokens: list[list[int]], vocab: int = 10) -> torch.Tensor:
    """(B, K+1, V) logits whose argmax at position j of row b is tokens[b][j]."""
    out = torch.randn(len(tokens), len(tokens[0]), vocab)
    for b, row in enumerate(tokens):
        for j, t in enumerate(row):
            out[b, j, t] = 10.0
    return out


def test_greedy_accepts_matching_prefix_per_row():
    logits = logits_preferring([[1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8]])
    draft = Draft(torch.tensor([[1, 2, 3], [1, 9, 3], [1, 2, 3]]), torch.tensor([3, 3, 3]), None)
    v = verify(logits, draft, GREEDY, [None] * 3)
    assert v.num_accepted.tolist() == [3, 1, 0]
    assert v.committed(0) == [1, 2, 3, 4]  # all accepted + bonus
    assert v.committed(1) == [1, 2]  # accepted 1, recovered 2
    assert v.committed(2) == [5]


def test_greedy_acceptance_stops_at_row_draft_length():
    logits = logits_preferring([[1, 2, 3, 4], [1, 2, 3, 4]])
    draft = Draft(torch.tensor([[1, 2, 3], [1, 2, 0]]), torch.tensor([1, 2]), None)
    v = verify(logits, draft, GREEDY, [None] * 2)
    assert v.num_accepted.tolist() == [1, 2]
    assert v.committed(0) == [1, 2] and v.committed(1) == [1, 2, 3]


def test_empty_draft_is_plain_decoding():
    logits = logits_preferring([[4], [7]])
    v = verify(logits, Draft.empty(2), GREEDY, [None] * 2)
    assert v.num_accepted.tolist() == [0, 0] and v.committed(0) == [4] and v.committed(1) == [7]


def _first_token_counts(draft_probs_fn, params, n=6000, vocab=6, width=3, seed=0):
    """Commit one verification round n times; count the first committed token."""
    gen = torch.Generator().manual_seed(1234)
    target_logits = torch.randn(1, width + 1, vocab, generator=gen) * 1.5
    target_probs = processed_probs(target_logits, params)[0, 0]
    counts = np.zeros(vocab)
    rngs = [torch.Generator().manual_seed(seed + i) for i in range(n)]
    for i in range(n):
        q = draft_probs_fn(gen)  # (width, V) or None
        if q is None:
            tokens = torch.tensor([[2, 3, 1]])
        else:
            tokens = torch.multinomial(q, 1, generator=rngs[i]).T
        draft = Draft(tokens, torch.tensor([width]), None if q is None else q[None])
        counts[verify(target_logits, draft, params, [rngs[i]]).committed(0)[0]] += 1
    return counts, target_probs.numpy()


def test_sampled_first_token_follows_target_with_draft_probs():
    fixed = torch.randn(3, 6, generator=torch.Generator().manual_seed(7)).softmax(-1)
    counts, target = _first_token_counts(lambda g: fixed, SamplingParams(temperature=1.0))
    assert chisq_pvalue(counts, target) > ALPHA


def test_sampled_first_token_follows_target_one_hot_draft():
    counts, target = _first_token_counts(lambda g: None, SamplingParams(temperature=0.8, top_k=5))
    assert chisq_pvalue(counts, target) > ALPHA


def _first_token_counts_with_alternative(residual=None, n=6000, width=3):
    """One round n times with an alternative for position 0 drawn from the same q as the chain's
    token, independently; count the first committed token. At position 0 the target p and the
    draft q lean opposite ways (p = .4 .3 .2 .1, q = .1 .2 .3 .4), so the first token is often
    rejected and the alternative's step, and the residuals, decide."""
    import speclm.round.verify as verify_mod

    gen = torch.Generator().manual_seed(99)
    params = SamplingParams(temperature=1.0)
    vocab = 4
    target_logits = torch.randn(1, width + 2, vocab, generator=gen)  # chain's K+1 columns, then the alternative's
    target_logits[0, 0] = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    q = torch.randn(width, vocab, generator=gen).softmax(-1)
    q[0] = torch.tensor([0.1, 0.2, 0.3, 0.4])
    counts = np.zeros(vocab)
    taken = 0
    real = verify_mod._residual
    calls = []
    if residual is not None:
        verify_mod._residual = lambda dist, q: residual(real, dist, q, len(calls)) if not calls.append(1) else None
    try:
        for i in range(n):
            calls.clear()
            rng = torch.Generator().manual_seed(i)
            tokens = torch.multinomial(q, 1, generator=rng).T  # (1, K)
            alternatives = torch.full((1, width), -1, dtype=torch.long)
            alternatives[0, 0] = int(torch.multinomial(q[0], 1, generator=rng))
            draft = Draft(tokens, torch.tensor([width]), q[None], alternatives=alternatives)
            v = verify(target_logits, draft, params, [rng])
            counts[v.committed(0)[0]] += 1
            taken += int(v.alternative[0]) == 0
    finally:
        verify_mod._residual = real
    return counts, processed_probs(target_logits, params)[0, 0].numpy(), taken


def test_sampled_first_token_follows_target_with_an_alternative():
    counts, target, taken = _first_token_counts_with_alternative()
    assert taken > 300  # the alternative's step decided the token in many rounds
    assert chisq_pvalue(counts, target) > ALPHA


def test_alternative_without_second_residual_is_caught():
    """After the alternative a is rejected the recovered token must come from normalise(max(0, p' - q));
    drawing it from p' (as if a had not been tried) biases the first token: the check sees it."""
    def no_second_residual(real, dist, q, call):  # call: this round's residual count so far, 1-based
        return real(dist, q) if call == 1 else dist

    counts, target, _ = _first_token_counts_with_alternative(no_second_residual)
    assert chisq_pvalue(counts, target) < ALPHA


def test_greedy_alternative_is_accepted_where_the_chain_is_rejected():
    # target argmax per column: chain positions 0..3 prefer 1, 2, 3, 4; the alternatives' columns 7 and 8
    logits = logits_preferring([[1, 2, 3, 4, 7, 8]])
    tokens = torch.tensor([[1, 5, 3]])
    draft = Draft(tokens, torch.tensor([3]), None, alternatives=torch.tensor([[6, 2, -1]]))
    v = verify(logits, draft, GREEDY, [None])
    # chain accepted up to position 1 (5 != 2); position 1's alternative 2 is the argmax: taken,
    # and the bonus after it is the argmax of its own column (the second alternative column: 8)
    assert v.num_accepted.tolist() == [2] and v.alternative.tolist() == [1]
    assert v.committed(0) == [1, 2, 8]
    wrong = Draft(tokens, torch.tensor([3]), None, alternatives=torch.tensor([[6, 7, -1]]))
    v = verify(logits, wrong, GREEDY, [None])
    assert v.num_accepted.tolist() == [1] and v.alternative.tolist() == [-1] and v.committed(0) == [1, 2]


def test_a_row_draws_the_same_random_numbers_alone_and_in_a_batch():
    """Sampling: what a row draws from its generator depends on its own draft only, not on the
    longer drafts of other rows (the batch's padded width): its verdict and its generator's state
    afterwards equal those of the row verified alone."""
    torch.manual_seed(3)
    vocab = 12
    params = SamplingParams(temperature=1.0)
    logits = torch.randn(2, 5, vocab)  # row 0 drafts 1 token, row 1 four
    draft = Draft.from_rows([[4], [1, 2, 3, 5]])
    gens = [torch.Generator().manual_seed(7), torch.Generator().manual_seed(8)]
    both = verify(logits, draft, params, gens)
    alone_gen = torch.Generator().manual_seed(7)
    alone = verify(logits[:1, :2], Draft.from_rows([[4]]), params, [alone_gen])
    assert both.num_accepted[0] == alone.num_accepted[0]
    assert both.tokens[0, :2].tolist() == alone.tokens[0, :2].tolist()
    assert torch.equal(gens[0].get_state(), alone_gen.get_state())
