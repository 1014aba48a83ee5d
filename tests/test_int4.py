"""int4 weights (speclm.quant.weights.Int4Linear, speclm/quant/csrc's linear_rows_w4): exact integer
arithmetic, batch invariance, and speculative == plain with an int4 draft or target."""

import copy

import pytest
import torch

import speclm.quant.weights as quant
from speclm import SpecEngine, UsageError
from speclm.quant import kernels
from speclm.quant.weights import INT4_GROUP, Int4Linear, Int8Linear, Int8Slice, quantize_model
from tiny import assert_amx_gives_the_vnni_loops_bits, loaded, require_compiled_kernels, tiny_model

N = 40
PROMPTS = ["hello world, hello", "abc", "the quick brown fox jumps over the lazy dog, the quick"]


@pytest.fixture(autouse=True)
def _int4_needs_the_compiled_kernels():
    require_compiled_kernels()


def _exact(layer_weight, bias, x):
    """What the kernel must compute, in float64 from the same integers: per row step and int8
    activations, per group int4 weights times their fp16 scale."""
    u, scale = quant.int4_groups(layer_weight, INT4_GROUP)
    rows, out_f = x.shape[0], u.shape[0]
    step = x.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
    xq = torch.round(x / step)  # half to even, as the kernel
    dots = torch.einsum("rgk,ogk->rog", xq.view(rows, -1, INT4_GROUP).double(),
                        (u.double() - 8).view(out_f, -1, INT4_GROUP))  # exact integers
    y = (dots * scale.double()[None]).sum(-1) * step.double()
    return y + bias.double() if bias is not None else y


@pytest.mark.parametrize("out_f,in_f,rows,bias", [(200, 128, 1, True), (64, 64, 3, False), (100, 256, 5, True),
                                                  (70, 192, 17, False)])
def test_int4_linear_computes_the_exact_integer_sums(out_f, in_f, rows, bias):
    torch.manual_seed(out_f + rows)
    linear = torch.nn.Linear(in_f, out_f, bias=bias)
    layer = Int4Linear(linear)
    x = torch.randn(rows, in_f)
    with torch.inference_mode():
        y = layer.rows(x)
        # fp32 rounding of the per-group sums only: far below one int4 step
        assert torch.allclose(y.double(), _exact(linear.weight, linear.bias, x), rtol=1e-5, atol=1e-5)
        h = torch.randn(rows, out_f)
        assert torch.allclose(layer.rows(x, h), y + h, rtol=0, atol=1e-6)  # the residual, added last
        for r in range(rows):  # each row alone gives the same bits as in the batch
            assert torch.equal(layer.rows(x[r : r + 1].clone()), y[r : r + 1])
        full = linear(x)
    rel = ((y - full).norm() / full.norm()).item()
    assert 0.01 < rel < 0.15  # int4 is coarse: it is for drafts


def _fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 fused multiply-add, a * b + c rounded once: in fp64 the product of two fp32 is exact and
    the sum rounds far below fp32's precision, so this rounds as an FMA does (but at a rare
    double-rounding tie: none with these seeds)."""
    return (a.double() * b.double() + c.double()).float()


@pytest.mark.parametrize("out_f,in_f,rows", [(200, 1536, 1), (70, 960, 6), (1536, 512, 3)])
def test_int4_bits_are_one_fma_per_group_on_either_build(out_f, in_f, rows):
    """The AVX-512 and the AVX2 builds must give a draft the same bits: fp32(the group's exact
    integer sum) times its fp16 scale added by one FMA per group in group order, then times the
    row's step, plus the bias. Checked bit for bit against that chain written out here (summing
    the groups in reverse order changes 25 of the 200 outputs of the first case, 7 of the third's)."""
    torch.manual_seed(out_f + in_f)
    linear = torch.nn.Linear(in_f, out_f)
    layer = Int4Linear(linear)
    x = torch.randn(rows, in_f)
    u, scale = quant.int4_groups(linear.weight, INT4_GROUP)
    xq, step = quant._quantized_rows(x, in_f, signed=True)
    dots = torch.einsum("rgk,ogk->rog", xq.view(rows, -1, INT4_GROUP).long(),
                        (u.long() - 8).view(out_f, -1, INT4_GROUP)).float()  # exact integers, fp32
    acc = torch.zeros(rows, out_f)
    for g in range(in_f // INT4_GROUP):
        acc = _fma32(dots[:, :, g], scale[:, g].float()[None], acc)
    ref = acc * step + linear.bias.detach()
    with torch.inference_mode():
        assert torch.equal(layer.rows(x), ref)


def test_int4_weights_round_half_to_even_within_their_group():
    w = torch.zeros(1, INT4_GROUP)
    w[0, 0], w[0, 1], w[0, 2] = 7.0, 2.5, -3.5  # scale 1: 2.5 -> 2, -3.5 -> -4
    u, scale = quant.int4_groups(w, INT4_GROUP)
    assert scale.item() == 1.0
    assert (u[0, :3].int() - 8).tolist() == [7, 2, -4]


def test_quantize_model_int4_covers_every_linear(tok):
    model = tiny_model(len(tok), seed=5)
    quantize_model(model, "int4")
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert isinstance(model.get_output_embeddings(), Int4Linear)
    qkv = model.get_submodule("model.layers.0.self_attn.k_proj")
    assert isinstance(qkv, Int8Slice) and isinstance(qkv.fused.kernel, Int4Linear)  # q/k/v fused, int4
    # input features that do not split into groups of 64 stay int8
    odd = tiny_model(len(tok), seed=5, hidden=96, heads=3, kv_heads=1)
    quantize_model(odd, "int4")
    assert isinstance(odd.get_output_embeddings(), Int8Linear)
    assert isinstance(odd.get_submodule("model.layers.0.mlp.down_proj"), Int4Linear)  # 192 inputs


def test_int4_without_the_compiled_kernels_is_a_usage_error(monkeypatch):
    monkeypatch.setattr(kernels, "compiled", lambda: None)
    with pytest.raises(UsageError, match="compiled CPU kernels"):
        Int4Linear(torch.nn.Linear(64, 64))


@pytest.mark.parametrize("k", [2, 5])
def test_int4_draft_and_int4_target_keep_output_exact(tok, k):
    """An int4 draft only changes what is proposed; an int4 target is batch-invariant, so its
    speculative output equals its own plain output, and a copy of it as draft is accepted in full."""
    target = loaded(quantize_model(tiny_model(len(tok), seed=0), "int8"), tok, name="tiny-target-int8")
    draft = loaded(quantize_model(tiny_model(len(tok), seed=0), "int4"), tok, name="tiny-target-as-int4-draft")
    plain = SpecEngine(target).generate(PROMPTS, method="none", max_new_tokens=N)
    outs = SpecEngine(target, draft=draft).generate(PROMPTS, method="draft", k=k, max_new_tokens=N)
    assert [o.token_ids for o in outs] == [p.token_ids for p in plain]
    assert 0 < sum(o.stats.accepted_tokens for o in outs)  # the int4 copy of the target still agrees often

    target4 = loaded(quantize_model(tiny_model(len(tok), seed=0), "int4"), tok, name="tiny-target-int4")
    plain4 = SpecEngine(target4).generate(PROMPTS, method="none", max_new_tokens=N)
    for method, d in (("draft", draft), ("pld", None)):
        outs = SpecEngine(target4, draft=d).generate(PROMPTS, method=method, k=k, max_new_tokens=N)
        assert [o.token_ids for o in outs] == [p.token_ids for p in plain4], method
    same = SpecEngine(target4, draft=target4).generate(PROMPTS[0], method="draft", k=k, max_new_tokens=N)
    assert same.stats.acceptance_rate == 1.0


def test_int4_logits_follow_fp32(tok):
    """Sanity of the int4 weights on a tiny random model (whose weights are all noise, the
    hardest case for 15 levels): its logits stay far nearer fp32's than another model's do.
    What int4 does to a real draft's acceptance is measured in benchmarks/intel/records.md#int4-draft-cpu."""
    model = tiny_model(len(tok), seed=0)
    ids = torch.tensor([tok(PROMPTS[2]).input_ids])
    with torch.inference_mode():
        ref = model(ids).logits
        got = quantize_model(copy.deepcopy(model), "int4")(ids).logits
        other = tiny_model(len(tok), seed=10)(ids).logits
    rel = ((got - ref).norm() / ref.norm()).item()
    rel_other = ((other - ref).norm() / ref.norm()).item()
    assert 0 < rel < 0.75 < rel_other
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree > 0.25 > (other.argmax(-1) == ref.argmax(-1)).float().mean().item()


def test_an_int4_draft_drafts_further_and_stops_when_unsure_by_default(tok):
    from speclm.defaults import ALTERNATIVES_INT4 as INT4_DRAFT_ALTERNATIVES, CONFIDENCE_INT4 as INT4_DRAFT_CONFIDENCE, K_DRAFT_INT4 as INT4_DRAFT_K
    from speclm.engine import GenerationOptions

    target = loaded(quantize_model(tiny_model(len(tok), seed=0), "int8"), tok, name="t")
    target.quantize = "int8"
    draft = loaded(quantize_model(tiny_model(len(tok), seed=1, layers=1), "int4"), tok, name="d")
    draft.quantize = "int4"
    engine = SpecEngine(target, draft=draft)
    proposer = engine.make_proposer(GenerationOptions(method="draft"))
    assert (proposer.k, proposer.confidence, proposer.alternatives) == (
        INT4_DRAFT_K, INT4_DRAFT_CONFIDENCE, INT4_DRAFT_ALTERNATIVES)
    proposer = engine.make_proposer(GenerationOptions(method="draft+pld"))
    assert (proposer.k, proposer.confidence, proposer.alternatives) == (
        INT4_DRAFT_K, INT4_DRAFT_CONFIDENCE, INT4_DRAFT_ALTERNATIVES)
    proposer = engine.make_proposer(GenerationOptions(method="draft", k=3, confidence=0.0, alternatives=0.0))
    assert (proposer.k, proposer.confidence, proposer.alternatives) == (3, 0.0, 0.0)
    draft.quantize = "int8"
    proposer = engine.make_proposer(GenerationOptions(method="draft"))
    assert proposer.confidence == 0.0 and proposer.alternatives == 0.0
    # greedy output with the int4 defaults (alternatives on) is plain decoding's
    prompt = "an int4 draft, an int4 draft"
    draft.quantize = "int4"
    ref = engine.generate(prompt, method="none", max_new_tokens=30)
    for method in ("draft", "draft+pld"):
        assert engine.generate(prompt, method=method, max_new_tokens=30).token_ids == ref.token_ids


def test_int4_amx_tiles_give_the_vnni_loops_bits():
    """On a CPU with AMX the int4 kernel runs AMX_MIN_ROWS rows or more on its tiles (groups of 64
    features, one tile step each): the same exact sums and the same FMA per group as the VNNI loop,
    so the same bits at every row count, with bias and residual. Skipped on CPUs without AMX."""
    if not kernels.amx():
        pytest.skip("no AMX on this CPU (or SPECLM_AMX=0)")
    assert INT4_GROUP == 64  # a group is one tile step; other groups keep the VNNI loop
    compiled = kernels.compiled()
    gen = torch.Generator().manual_seed(4)
    for in_f, out_f in ((64, 48), (896, 200), (1536, 70)):
        u, scale = quant.int4_groups(torch.randn(out_f, in_f, generator=gen), INT4_GROUP)
        packed, scales = quant.int4_layout(u, scale)
        bias = torch.randn(out_f, generator=gen)
        for rows in (1, 2, 9, 10, 15, 16, 17, 31, 32, 40, 100):  # 40, 100: a column group's tiles spread once
            x = torch.randn(rows, in_f, generator=gen) * 3
            h = torch.randn(rows, out_f, generator=gen)
            assert_amx_gives_the_vnni_loops_bits(lambda: (compiled.linear_rows_w4(x, packed, scales, out_f, bias),
                                                          compiled.linear_rows_w4(x, packed, scales, out_f, None, h)),
                                                 (in_f, out_f, rows))
