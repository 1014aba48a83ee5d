"""Properties of the verifier (speclm.round.verify) on random cases: random logits, ragged draft
lengths, one-hot and probabilistic drafts, alternatives, greedy and sampled, every sampling
filter. Whatever the case:
- row b commits num_accepted[b] + 1 tokens, num_accepted[b] <= lengths[b] (its budget: a
  commit never passes lengths[b] + 1 tokens), every token an id of the vocabulary;
- the accepted tokens are the draft's own (the chain's, and an accepted alternative at the
  last accepted position only, where it was offered);
- greedy: exactly the longest draft prefix equal to the target's argmax, then the argmax
  after it (or the alternative at the first mismatch, when it is the argmax, then the argmax
  of its own column);
- sampled: no committed token outside the target's processed support (top-k, top-p); a
  recovered token only in the residual's support, normalise(max(0, p - q)) (never the rejected
  token of a one-hot draft; after a rejected alternative, what is left once more); a draft
  equal to the target accepted whole; top-k = 1 identical to greedy;
- rows are independent: a row verified alone, with its generator seeded alike, commits what it
  commits within the batch.
Distributional errors that keep every token in its support (e.g. the alternative's recovered
token drawn from p' instead of normalise(max(0, p' - q))) are the chi-square tests' to catch
(test_verify.py, test_sampling_distribution.py). Examples are derandomized (a fixed sequence,
like the other tests' fixed seeds) and no example database is kept.
"""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from speclm.proposers import Draft
from speclm.sampling import SamplingParams, processed_probs
from speclm.round.verify import verify

SETTINGS = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def cases(draw, greedy=None, kind=None, alternatives=None):
    """(target_logits, draft, params, seed); kind: 'one-hot', 'probs' or 'target' (q = the
    target's own processed distribution); alternatives: True for one at every drafted position."""
    batch = draw(st.integers(1, 4))
    width = draw(st.integers(0 if alternatives is None else 1, 5))
    vocab = draw(st.integers(2, 12))
    seed = draw(st.integers(0, 2**31 - 1))
    greedy = draw(st.booleans()) if greedy is None else greedy
    if greedy:
        params = SamplingParams()
    else:
        params = SamplingParams(temperature=draw(st.sampled_from([0.5, 1.0, 1.7])),
                                top_k=draw(st.integers(0, vocab)),
                                top_p=draw(st.sampled_from([1.0, 0.9, 0.5, 0.05])))
    kind = draw(st.sampled_from(["one-hot", "probs", "target"])) if kind is None else kind
    lengths = [draw(st.one_of(st.just(width), st.integers(0, width))) for _ in range(batch)]  # ragged
    # per row: how many leading draft tokens to set to the target's argmax (the rest random)
    planted = [draw(st.integers(0, n)) for n in lengths]
    every = alternatives is True  # else drawn per position
    with_alternatives = every or ((greedy or kind != "one-hot") and width > 0 and draw(st.booleans()))
    gen = torch.Generator().manual_seed(seed)

    scale = draw(st.sampled_from([0.5, 2.0, 6.0]))  # flat to peaked
    chain_logits = torch.randn(batch, width + 1, vocab, generator=gen) * scale
    target_probs = processed_probs(chain_logits, params) if not greedy else chain_logits.softmax(-1)
    argmax = chain_logits.argmax(-1)

    if kind == "one-hot":
        q = None
    elif kind == "target":
        q = target_probs[:, :width].clone()
    else:
        q = (torch.randn(batch, width, vocab, generator=gen) * scale).softmax(-1)
        if vocab > 2 and draw(st.booleans()):  # a draft over part of the vocabulary (draft_vocab)
            q[..., : vocab // 2] = 0
            q = q / q.sum(-1, keepdim=True)
    tokens = torch.zeros(batch, width, dtype=torch.long)
    alternatives = torch.full((batch, width), -1, dtype=torch.long)
    for b in range(batch):
        for j in range(lengths[b]):
            if j < planted[b]:
                tokens[b, j] = argmax[b, j]
            elif q is not None:
                tokens[b, j] = torch.multinomial(q[b, j], 1, generator=gen)
            else:
                tokens[b, j] = torch.randint(vocab, (1,), generator=gen)
            if with_alternatives and (every or draw(st.booleans())):
                # the argmax (greedy: the alternative that wins) or a second draw from q
                if greedy and draw(st.booleans()):
                    alternatives[b, j] = argmax[b, j]
                elif q is not None:
                    alternatives[b, j] = torch.multinomial(q[b, j], 1, generator=gen)
                else:
                    alternatives[b, j] = torch.randint(vocab, (1,), generator=gen)
        if q is not None:  # padding past the row's draft, as speclm.proposers.draft_lookup leaves it
            q[b, lengths[b]:] = 0
    draft = Draft(tokens, torch.tensor(lengths), q, alternatives=alternatives if with_alternatives else None)
    branches, most = draft.alternative_slots()
    extra = torch.randn(batch, most, vocab, generator=gen) * scale  # the alternatives' own columns
    return torch.cat([chain_logits, extra], 1), draft, params, seed


def generators(seed: int, batch: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + b) for b in range(batch)]


def run(logits, draft, params, seed):
    return verify(logits, draft, params, generators(seed, len(draft.lengths)) if not params.greedy else
                  [None] * len(draft.lengths))


def check_common(logits, draft, verdict):
    batch, width = draft.tokens.shape
    vocab = logits.shape[-1]
    branches, _ = draft.alternative_slots()
    assert verdict.tokens.shape == (batch, width + 1)
    for b in range(batch):
        n, length = int(verdict.num_accepted[b]), int(draft.lengths[b])
        committed = verdict.committed(b)
        assert 0 <= n <= length and len(committed) == n + 1 <= length + 1
        assert all(0 <= t < vocab for t in committed)
        alt = int(verdict.alternative[b]) if verdict.alternative is not None else -1
        if alt >= 0:  # an accepted alternative: offered at n - 1, the chain rejected there
            assert alt == n - 1 and (alt, committed[alt]) in branches[b]
            assert committed[:alt] == draft.tokens[b, :alt].tolist()
        else:
            assert committed[:n] == draft.tokens[b, :n].tolist()


def greedy_oracle(logits, draft) -> list[list[int]]:
    argmax = logits.argmax(-1)
    width = draft.width
    branches, _ = draft.alternative_slots()
    out = []
    for b in range(len(draft.lengths)):
        length, n = int(draft.lengths[b]), 0
        while n < length and int(draft.tokens[b, n]) == int(argmax[b, n]):
            n += 1
        row = draft.tokens[b, :n].tolist() + [int(argmax[b, n])]
        for a, (j, t) in enumerate(branches[b]):
            if j == n < length and t == int(argmax[b, n]):
                row = draft.tokens[b, :n].tolist() + [t, int(argmax[b, width + 1 + a])]
        out.append(row)
    return out


@SETTINGS
@given(cases(greedy=True))
def test_greedy_commits_the_argmax_path(case):
    logits, draft, params, seed = case
    verdict = run(logits, draft, params, seed)
    check_common(logits, draft, verdict)
    assert [verdict.committed(b) for b in range(len(draft.lengths))] == greedy_oracle(logits, draft)


@SETTINGS
@given(cases(greedy=False))
def test_sampled_tokens_stay_in_the_target_support(case):
    check_sampled(*case)


@SETTINGS
@given(cases(greedy=False, kind="probs", alternatives=True))
def test_sampled_alternatives_stay_in_the_residual_support(case):
    check_sampled(*case)


def check_sampled(logits, draft, params, seed):
    verdict = run(logits, draft, params, seed)
    check_common(logits, draft, verdict)
    p = processed_probs(logits, params)
    width = draft.width
    branches, _ = draft.alternative_slots()
    for b in range(len(draft.lengths)):
        n, length = int(verdict.num_accepted[b]), int(draft.lengths[b])
        committed = verdict.committed(b)
        alt = int(verdict.alternative[b]) if verdict.alternative is not None else -1
        columns = list(range(n)) + [n if alt < 0 else width + 1 + [j for j, _ in branches[b]].index(alt)]
        assert all(p[b, c, t] > 0 for c, t in zip(columns, committed))
        if alt < 0 and n < length:  # rejected at n: the recovered token lies in the residual's support
            if draft.draft_probs is None:
                q = torch.zeros_like(p[b, n])
                q[draft.tokens[b, n]] = 1.0
            else:
                q = draft.draft_probs[b, n]
            left = support_left(p[b, n], q)
            if any(j == n for j, _ in branches[b]):  # and the alternative's, rejected too
                left = support_left(left, q)
            assert left[committed[n]] > 0
            if draft.draft_probs is None:
                assert committed[n] != int(draft.tokens[b, n])


def support_left(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalise(max(0, p - q)), or p where nothing is left: the distribution after a candidate
    drawn from q was rejected (speclm.round.verify's residual)."""
    left = (p - q).clamp_min(0.0)
    return left / left.sum() if left.sum() > 0 else p


@SETTINGS
@given(cases(greedy=False, kind="target"))
def test_a_draft_equal_to_the_target_is_accepted_whole(case):
    logits, draft, params, seed = case
    verdict = run(logits, draft, params, seed)
    check_common(logits, draft, verdict)
    assert verdict.num_accepted.tolist() == draft.lengths.tolist()


@SETTINGS
@given(cases(greedy=False), st.booleans())
def test_top_k_one_is_greedy(case, one_hot):
    logits, draft, params, seed = case
    if one_hot and draft.alternatives is None:
        draft.draft_probs = None
    top1 = SamplingParams(temperature=params.temperature, top_k=1)
    verdict = run(logits, draft, top1, seed)
    check_common(logits, draft, verdict)
    assert [verdict.committed(b) for b in range(len(draft.lengths))] == greedy_oracle(logits, draft)


@SETTINGS
@given(cases())
def test_rows_are_independent(case):
    logits, draft, params, seed = case
    together = run(logits, draft, params, seed)
    for b in range(len(draft.lengths)):
        alts = draft.alternatives[b : b + 1] if draft.alternatives is not None else None
        probs = draft.draft_probs[b : b + 1] if draft.draft_probs is not None else None
        row = Draft(draft.tokens[b : b + 1], draft.lengths[b : b + 1], probs, alternatives=alts)
        gens = [torch.Generator().manual_seed(seed + b)] if not params.greedy else [None]
        alone = verify(logits[b : b + 1], row, params, gens)
        assert alone.committed(0) == together.committed(b)
        assert int(alone.alternative[0]) == int(together.alternative[b])
