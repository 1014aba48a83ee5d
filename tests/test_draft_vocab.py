"""A draft head restricted to part of the vocabulary (speclm.proposers.draft_vocab): its logits are
the full head's columns bit for bit, the draft proposes only those ids, and greedy output and the
sampled distribution stay exact."""

import pytest
import torch

import speclm.quant.weights as quant
from chisq import ALPHA, chisq_pvalue
from speclm import SpecEngine
from speclm.defaults import DRAFT_VOCAB
from speclm.engine import GenerationOptions
from speclm.proposers import DraftModelProposer
from speclm.proposers.draft_vocab import RestrictedHead
from speclm.quant.weights import Int4Linear, Int8Linear, quantize_model
from speclm.sampling import SamplingParams
from test_sampling_distribution import PROMPT, V, exact_joint, sampled_counts, small  # noqa: F401 (fixture)
from tiny import loaded, require_compiled_kernels, tiny_model

N = 40
PROMPTS = ["hello world, hello", "abc", "the quick brown fox jumps over the lazy dog, the quick"]


def _layer(kind: str, linear: torch.nn.Linear, monkeypatch) -> torch.nn.Module:
    if kind == "fp32":
        return linear
    if kind in ("int4", "int8-vnni"):
        require_compiled_kernels()
        return Int4Linear(linear) if kind == "int4" else Int8Linear(linear)
    monkeypatch.setattr(quant, "_compiled_kernel", lambda: None)  # torch's int8 kernels (_int_mm)
    return Int8Linear(linear)


@pytest.mark.parametrize("kind", ["fp32", "int8-vnni", "int8-torch", "int4"])
@pytest.mark.parametrize("first, extra", [(128, [300, 131, 999, 130]), (0, [5, 64, 700]), (1000, [3])])
def test_restricted_head_gives_the_full_heads_columns_bit_for_bit(kind, first, extra, monkeypatch):
    torch.manual_seed(first)
    linear = torch.nn.Linear(128, 1000, bias=True)
    head = _layer(kind, linear, monkeypatch)
    restricted = RestrictedHead(head, first, extra)
    whole = first // 64 * 64  # whole column groups
    expected_ids = sorted(set(range(whole)) | {t for t in extra if t >= whole})
    assert restricted.ids.tolist() == expected_ids
    x = torch.randn(3, 128)
    with torch.inference_mode():
        full = head.rows(x) if kind != "fp32" else linear(x)
        got = restricted(x)
        assert got.shape == (3, len(expected_ids))
        if kind == "fp32":  # a smaller matmul may block differently: equal up to rounding
            assert torch.allclose(got, full[:, restricted.ids], rtol=1e-5, atol=1e-5)
        else:  # each column's integer sums and rescale are its own
            assert torch.equal(got, full[:, restricted.ids])


def test_first_ids_round_down_to_whole_column_groups():
    head = torch.nn.Linear(8, 300)
    assert RestrictedHead(head, 100, [1, 70, 299]).ids.tolist() == list(range(64)) + [70, 299]
    with pytest.raises(ValueError):
        RestrictedHead(head, 10, [])


def _spy_drafts(monkeypatch):
    """Every draft token the engine sends to verification."""
    import speclm.round.batch as engine_mod

    seen: list[int] = []
    real = engine_mod.verify_tree

    def spy(logits, tree, params, generators, **options):
        for b, size in enumerate(tree.sizes):
            seen.extend(tree.tokens[b, :size].tolist())
        return real(logits, tree, params, generators, **options)

    monkeypatch.setattr(engine_mod, "verify_tree", spy)
    return seen


@pytest.mark.parametrize("quantize", ["none", "int8", "int4"])
def test_restricted_draft_keeps_greedy_output_and_proposes_only_its_ids(tok, quantize, monkeypatch):
    if quantize != "none":
        require_compiled_kernels()
    target = loaded(tiny_model(len(tok), seed=0), tok, name="tiny-target")
    draft_model = tiny_model(len(tok), seed=0)  # the target's weights: it agrees often, also at rare ids
    draft = loaded(quantize_model(draft_model, quantize), tok, name="tiny-draft")
    plain = SpecEngine(target).generate(PROMPTS, method="none", max_new_tokens=N)
    seen = _spy_drafts(monkeypatch)
    engine = SpecEngine(target, draft=draft)
    outs = engine.generate(PROMPTS, method="draft", k=4, max_new_tokens=N, draft_vocab=64)
    assert [o.token_ids for o in outs] == [p.token_ids for p in plain]
    # the first proposal sees each prompt and the target's first token
    allowed = (set(range(64)) | {t for p in engine.encode(PROMPTS, False) for t in p} | set(target.eos_token_ids)
               | {o.token_ids[0] for o in outs})
    assert seen and set(seen) <= allowed
    # the output uses ids the draft cannot propose, so the restriction was in force
    assert any(t not in allowed for o in outs for t in o.token_ids)
    assert sum(o.stats.accepted_tokens for o in outs) > 0


def test_default_restriction_and_where_it_does_not_apply(tok, target):
    assert GenerationOptions(method="draft").draft_vocab is None
    engine = SpecEngine(target, draft=target)
    assert engine.make_proposer(GenerationOptions(method="draft")).vocab == DRAFT_VOCAB
    assert engine.make_proposer(GenerationOptions(method="draft", draft_vocab=0)).vocab == 0
    # a vocabulary smaller than the default is scored whole: nothing is restricted
    proposer = engine.make_proposer(GenerationOptions(method="draft"))
    proposer.start(1, 64)
    proposer.vocabs.read([0], [[1, 2, 3]])
    assert proposer.head is None and proposer.vocabs.token_ids(0) is None
    assert isinstance(proposer, DraftModelProposer)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=3, top_p=0.9)])
def test_restricted_draft_samples_the_target_distribution(small, params):  # noqa: F811 (the fixture)
    """draft_vocab=1 leaves the draft only the prompt's tokens (w1..w4 of six): it gives the
    others probability 0, and the residual after a rejection must still restore them. Two
    checks at ALPHA = 1e-4 each (see chisq.py)."""
    tok, target, draft = small
    prompt_ids = tok(PROMPT).input_ids
    assert set(prompt_ids) == {1, 2, 3, 4} and V == 6
    counts = sampled_counts(SpecEngine(target, draft=draft), prompt_ids, "draft", params, draft_vocab=1)
    assert chisq_pvalue(counts, exact_joint(target, prompt_ids, params)) > ALPHA
