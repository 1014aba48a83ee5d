"""Alternatives (a tree whose extra branches are leaves): greedy exactness and the bookkeeping
of an accepted alternative (its keys and values moved into the sequence, the draft's cache cut
back before it), on tiny random models."""

import copy

import pytest
import torch

from speclm import SpecEngine
from speclm.proposers import Draft, Proposer
from tiny import loaded

PROMPTS = ["hello world, hello", "abc", "the quick brown fox jumps over the lazy dog, the quick"]
N = 40


def plain(target, prompt, n=N):
    return SpecEngine(target).generate(prompt, method="none", max_new_tokens=n)


class PlantedAlternativeProposer(Proposer):
    """Per row: the true greedy continuation with a wrong token at position `error_at`, and the
    true token there as that position's alternative (rows in `without` get none)."""

    name = "planted"

    def __init__(self, references, prompt_lens, k, error_at, vocab, without=()):
        self.references, self.prompt_lens, self.k = references, prompt_lens, k
        self.error_at, self.vocab, self.without = error_at, vocab, set(without)
        self.rows = list(range(len(references)))
        self.rollbacks: list[list[int]] = []

    def select(self, rows):
        self.rows = [self.rows[r] for r in rows]

    def accept(self, verified):
        keep, paths = verified.keep, verified.paths
        # what a chain proposer keeps: the committed tokens before its draft, then its own accepted
        # chain tokens (an accepted alternative is a sibling it never fed)
        self.rollbacks.append([k - len(p) + next((j for j, n in enumerate(p) if n != j), len(p))
                               for k, p in zip(keep, paths)])

    def propose(self, contexts, max_tokens, params, generators):
        tokens = torch.zeros(len(contexts), self.k, dtype=torch.long)
        alternatives = torch.full((len(contexts), self.k), -1, dtype=torch.long)
        lengths = []
        for b, (ctx, budget) in enumerate(zip(contexts, max_tokens)):
            r = self.rows[b]
            pos = len(ctx) - self.prompt_lens[r]
            row = self.references[r][pos : pos + min(self.k, budget)]
            if self.error_at < len(row):
                if r not in self.without:
                    alternatives[b, self.error_at] = row[self.error_at]
                row[self.error_at] = (row[self.error_at] + 1) % self.vocab
            tokens[b, : len(row)] = torch.tensor(row, dtype=torch.long)
            lengths.append(len(row))
        return Draft(tokens, torch.tensor(lengths), None, alternatives=alternatives)


@pytest.mark.parametrize("error_at", range(4))
def test_planted_alternative_is_taken_every_round(target, tok, error_at, monkeypatch):
    """Every round's chain is wrong at error_at and its alternative right: each round commits
    error_at + 2 tokens (the alternative and the bonus after it), and the output is plain
    decoding's, so the moved keys and values are the ones a plain step writes."""
    prompt, k = PROMPTS[0], 4
    ref = plain(target, prompt)
    engine = SpecEngine(target)
    planted = PlantedAlternativeProposer([ref.token_ids], [len(tok(prompt).input_ids)], k, error_at, len(tok))
    monkeypatch.setattr(engine, "make_proposer", lambda opts: planted)
    out = engine.generate(prompt, method="pld", k=k, max_new_tokens=N)
    assert out.token_ids == ref.token_ids
    s = out.stats
    full_rounds = (N - 1) // (error_at + 2)  # rounds before the budget cuts the draft short
    assert s.accepted_alternatives >= full_rounds - 1 and s.alternatives >= s.accepted_alternatives
    assert s.target_forwards <= 1 + full_rounds + 3
    # the proposer keeps only its own accepted tokens: the context before the alternative
    prompt_len = len(tok(prompt).input_ids)
    assert all((keep[0] - prompt_len) % (error_at + 2) == error_at + 1 or keep[0] >= prompt_len + N - k - 2
               for keep in planted.rollbacks[1:])


def test_planted_alternatives_in_a_ragged_batch(target, tok, monkeypatch):
    """Rows of different lengths; one row without alternatives: every row equals its plain run."""
    refs = [plain(target, p).token_ids for p in PROMPTS]
    engine = SpecEngine(target)
    planted = PlantedAlternativeProposer(refs, [len(tok(p).input_ids) for p in PROMPTS], 3, 1, len(tok), without=[1])
    monkeypatch.setattr(engine, "make_proposer", lambda opts: planted)
    outs = engine.generate(PROMPTS, method="pld", k=3, max_new_tokens=N)
    assert [o.token_ids for o in outs] == refs
    assert outs[1].stats.accepted_alternatives == 0 and outs[0].stats.accepted_alternatives > 5


@pytest.fixture(scope="module")
def near_draft(target):
    """The target with noise on its output head: it mostly agrees with the target, and where it
    does not, its second choice often does."""
    model = copy.deepcopy(target.model)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head.add_(torch.randn(head.shape, generator=gen) * head.std() * 0.8)
    return loaded(model, target.tokenizer, name="near-draft")


@pytest.mark.parametrize("method", ["draft", "draft+pld"])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_draft_with_alternatives_reproduces_plain(target, near_draft, unrelated_draft, method, k):
    taken = 0
    for draft in (near_draft, unrelated_draft):
        engine = SpecEngine(target, draft=draft)
        for prompt in PROMPTS:
            out = engine.generate(prompt, method=method, k=k, max_new_tokens=N, alternatives=1.0)
            assert out.token_ids == plain(target, prompt).token_ids, (method, draft.name)
            taken += out.stats.accepted_alternatives
        batch = engine.generate(PROMPTS, method=method, k=k, max_new_tokens=N, alternatives=0.7, confidence=0.3)
        assert [b.token_ids for b in batch] == [plain(target, p).token_ids for p in PROMPTS]
    assert taken > 0  # the near draft's second choices were taken


def test_alternatives_off_by_default_with_a_full_precision_draft(target, near_draft):
    out = SpecEngine(target, draft=near_draft).generate(PROMPTS[0], method="draft", k=3, max_new_tokens=N)
    assert out.stats.alternatives == 0
