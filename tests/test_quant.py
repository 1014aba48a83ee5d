"""int8 weights (speclm.quant.weights): batch invariance, accuracy, and speculative == plain on int8."""

import copy
from pathlib import Path

import pytest
import torch

import speclm.quant.weights as quant
from speclm import SpecEngine
from speclm.defaults import AMX_MIN_ROWS
from speclm.quant import kernels
from speclm.quant.weights import Int8Linear, Int8Slice, quantize_model
from tiny import assert_amx_gives_the_vnni_loops_bits, loaded, require_compiled_kernels, tiny_model

N = 40
PROMPTS = ["hello world, hello", "abc", "the quick brown fox jumps over the lazy dog, the quick"]


def _only(monkeypatch, kernel):
    """Make Int8Linear built from here on use only `kernel` (and, for int_mm, oneDNN or the exact
    fp32 GEMM for >1 row as where the VNNI kernel cannot run; int_mm_only: _int_mm for every row)."""
    if kernel == "compiled":
        require_compiled_kernels()
        monkeypatch.setattr(quant, "_onednn_available", lambda: False)
        return
    monkeypatch.setattr(quant, "_compiled_kernel", lambda: None)
    if kernel == "onednn" and not quant._onednn_available():
        pytest.skip("oneDNN int8 GEMM missing or inexact here (no VNNI)")
    if kernel in ("int_mm", "int_mm_only"):
        monkeypatch.setattr(quant, "_onednn_available", lambda: False)
    if kernel == "int_mm_only":
        monkeypatch.setattr(quant, "EXACT_FLOAT_GEMM", False)


@pytest.fixture(params=["compiled", "onednn", "int_mm", "int_mm_only"])
def kernel(request, monkeypatch):
    _only(monkeypatch, request.param)
    return request.param


@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_is_batch_invariant_and_close_to_fp32(kernel, bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 200, bias=bias)
    q = Int8Linear(linear)
    expected = {"int_mm": "float", "int_mm_only": "int_mm"}.get(kernel, kernel)
    assert q.kernel_for(5) == expected and (kernel not in ("int_mm", "int_mm_only") or q.kernel_for(1) == "int_mm")
    x = torch.randn(3, 7, 96)  # (batch, tokens, features)
    with torch.inference_mode():
        full = q(x)
        ref = linear(x)
        # every row alone, and every slice of rows, is bit-identical to the same rows in the batch
        for b in range(3):
            for lo, hi in ((0, 1), (2, 5), (6, 7), (0, 7)):
                assert torch.equal(q(x[b : b + 1, lo:hi].clone()), full[b : b + 1, lo:hi])
    rel = ((full - ref).norm() / ref.norm()).item()
    assert 0 < rel < 0.02  # int8 is not fp32, but close


@pytest.mark.parametrize("shape", [(64, 48), (1536, 256), (90, 13), (37, 200)])  # (in, out): ragged sizes pad
def test_kernels_agree_bit_for_bit(shape, monkeypatch):
    """speclm's VNNI kernel, oneDNN and _int_mm compute the same integer dot products and the same
    rescale, so they must give the same bits at any number of rows (the VNNI kernel's row
    chunks, its padded columns and features included)."""
    torch.manual_seed(1)
    linear = torch.nn.Linear(*shape)
    built = {}
    for kernel in ("compiled", "onednn", "int_mm", "int_mm_only"):
        with monkeypatch.context() as m:
            try:
                _only(m, kernel)
            except pytest.skip.Exception:
                continue
            built[kernel] = Int8Linear(linear)
    with torch.inference_mode():
        for rows in (1, 2, 5, 7, 8, 14, 15, 28, 29, 40, 57):  # each pass shape, chunks
            x = torch.randn(rows, shape[0]) * 3
            h = torch.randn(rows, shape[1])  # a residual, added last
            ref, ref_h = built["int_mm_only"].rows(x), built["int_mm_only"].rows(x, h)
            assert torch.equal(ref_h, h + ref)
            for kernel, layer in built.items():
                assert torch.equal(layer.rows(x), ref), (kernel, rows)
                assert torch.equal(layer.rows(x, h), ref_h), (kernel, rows)


@pytest.mark.parametrize("chunk, exact", [(quant.EXACT_CHUNK, True), (4096, False)])
def test_the_fp32_gemm_of_int8_values_is_exact_in_chunks(chunk, exact, monkeypatch):
    """Sums of 4096 products of 127 x 127 pass 2**24, where fp32 stops holding every integer: in
    chunks of EXACT_CHUNK features the fp32 GEMM still gives _int_mm's integers; in one chunk it
    does not (the check has power)."""
    monkeypatch.setattr(quant, "EXACT_CHUNK", chunk)
    gen = torch.Generator().manual_seed(0)
    w = torch.randint(100, 128, (64, 4096), dtype=torch.int8, generator=gen)  # (out, in)
    x = torch.randint(100, 128, (5, 4096), dtype=torch.int8, generator=gen)  # sums near 5e7, past 2**24
    got = quant._exact_float_gemm(x, w.t().float().contiguous())
    assert torch.equal(got, torch._int_mm(x, w.t())) == exact


def test_quantize_model_covers_every_linear_and_leaves_a_tied_embedding(tok):
    model = tiny_model(len(tok), seed=5)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    emb = model.get_input_embeddings().weight.detach().clone()
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    quantize_model(model, "int8")
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert all(isinstance(model.get_submodule(n), (Int8Linear, Int8Slice)) for n in names)
    assert isinstance(model.get_submodule("model.layers.0.self_attn.k_proj"), Int8Slice)  # q/k/v fused
    assert isinstance(model.get_output_embeddings(), Int8Linear)
    assert torch.equal(model.get_input_embeddings().weight, emb)
    assert model.get_input_embeddings().weight.dtype == torch.float32
    with pytest.raises(ValueError):
        quantize_model(model, "int3")


def test_fused_projections_equal_separate_ones(kernel):
    """q/k/v share one int8 GEMM; each slice equals that projection quantized alone, bit for bit."""
    torch.manual_seed(2)
    parent = torch.nn.Module()
    for name, out in (("q_proj", 64), ("k_proj", 32), ("v_proj", 32)):
        setattr(parent, name, torch.nn.Linear(64, out, bias=True))
    alone = {n: Int8Linear(getattr(parent, n)) for n in ("q_proj", "k_proj", "v_proj")}
    quantize_model(parent, "int8")
    x = torch.randn(2, 5, 64)
    with torch.inference_mode():
        for n in ("q_proj", "k_proj", "v_proj"):
            assert isinstance(getattr(parent, n), Int8Slice)
            assert torch.equal(getattr(parent, n)(x), alone[n](x))


@pytest.fixture(scope="module")
def int8_pair(tok):
    target = loaded(quantize_model(tiny_model(len(tok), seed=0), "int8"), tok, name="tiny-target-int8")
    draft = loaded(quantize_model(tiny_model(len(tok), seed=1, layers=1), "int8"), tok, name="tiny-draft-int8")
    return target, draft


@pytest.mark.parametrize("k", [1, 3, 6])
def test_int8_speculative_equals_int8_plain(int8_pair, k):
    target, draft = int8_pair
    plain = SpecEngine(target).generate(PROMPTS, method="none", max_new_tokens=N)
    for method, d in (("draft", draft), ("draft", target), ("pld", None)):
        outs = SpecEngine(target, draft=d).generate(PROMPTS, method=method, k=k, max_new_tokens=N)
        assert [o.token_ids for o in outs] == [p.token_ids for p in plain], (method, d.name if d else None)
    # a draft identical to the target is accepted in full: int8 verification is batch-invariant
    same = SpecEngine(target, draft=target).generate(PROMPTS[0], method="draft", k=k, max_new_tokens=N)
    assert same.stats.acceptance_rate == 1.0


def test_int8_logits_stay_close_to_fp32(tok):
    """Sanity of the quantized weights: teacher-forced logits within a few percent of fp32."""
    model = tiny_model(len(tok), seed=0)
    ids = torch.tensor([tok(PROMPTS[2]).input_ids])
    with torch.inference_mode():
        ref = model(ids).logits
        got = quantize_model(copy.deepcopy(model), "int8")(ids).logits
    rel = ((got - ref).norm() / ref.norm()).item()
    assert 0 < rel < 0.05


def test_int8_exact_through_the_transformers_forward_too(int8_pair, monkeypatch):
    """Models the lean forward does not cover run transformers' forward with speclm's
    per-query attention; speculative output still equals plain output on int8 weights."""
    import speclm.forward.runner as kv_mod

    monkeypatch.setattr(kv_mod.lean, "supports", lambda model: False)
    target, draft = int8_pair
    plain = SpecEngine(target).generate(PROMPTS, method="none", max_new_tokens=N)
    for method, d in (("draft", draft), ("pld", None)):
        outs = SpecEngine(target, draft=d).generate(PROMPTS, method=method, k=4, max_new_tokens=N)
        assert [o.token_ids for o in outs] == [p.token_ids for p in plain], method


def test_row_quantizer_rounds_half_to_even_and_leaves_its_input():
    x = torch.randn(6, 96) * 4
    x[0, :8] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 126.5, -126.5, 127.0])  # ties, and the row max
    before = x.clone()
    xq, step = quant._quantized_rows(x, 96)
    xs, step_s = quant._quantized_rows(x[:1], 96, signed=True)  # one row: the other max-|x| path
    assert torch.equal(x, before)
    assert torch.equal(step, x.abs().amax(dim=1, keepdim=True) / 127.0) and torch.equal(step_s, step[:1])
    expected = torch.round(x / (x.abs().amax(dim=1, keepdim=True) / 127.0))
    assert torch.equal(xq, (expected + 128).to(torch.uint8))
    assert torch.equal(xs, expected[:1].to(torch.int8))
    assert xq[0, :8].int().sub(128).tolist() == [0, 2, 2, 0, -2, 126, -126, 127]


def test_weight_rounding_equals_torch_round():
    torch.manual_seed(3)
    w = torch.randn(64, 96) * 0.05
    w[0, :4] = torch.tensor([0.5, 1.5, -2.5, 127.0]) * (0.05 / 127)  # ties at the scale of row 0's max
    w[0, 4:] = 0
    q, scale = quant.int8_per_channel(w)
    ref = torch.round(w / (w.abs().amax(dim=1).clamp_min(1e-12) / 127.0)[:, None]).clamp(-127, 127)
    assert torch.equal(q, ref.to(torch.int8))


def test_compiled_rms_norm_matches_the_formula_and_is_row_invariant():
    require_compiled_kernels()
    compiled = kernels.compiled()
    torch.manual_seed(4)
    for features in (96, 1536, 37):  # 37: a masked tail
        x, w = torch.randn(80, features) * 3, torch.randn(features)
        got = compiled.rms_norm(x, w, 1e-6)
        ref = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6)
        # 80 rows take the threaded path, 1 and 5 rows the serial one: the same bits per row
        assert torch.equal(compiled.rms_norm(x[3:4].clone(), w, 1e-6), got[3:4])
        assert torch.equal(compiled.rms_norm(x[10:15].clone(), w, 1e-6), got[10:15])


def test_compiled_silu_mul_matches_torch_and_is_row_invariant():
    require_compiled_kernels()
    compiled = kernels.compiled()
    torch.manual_seed(5)
    for inner in (8960, 37):
        both = torch.randn(40, 2 * inner) * 6
        both[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])  # past exp's range, and zero
        got = compiled.silu_mul(both)
        ref = torch.nn.functional.silu(both[:, :inner]) * both[:, inner:]
        assert torch.allclose(got, ref, rtol=2e-6, atol=1e-6) and torch.isfinite(got).all()
        assert torch.equal(compiled.silu_mul(both[7:9].clone()), got[7:9])  # 40 rows threaded, 2 serial


def test_the_kernel_build_follows_the_cpu_and_speclm_kernels(monkeypatch):
    """AVX-512 VNNI: cpu_kernels.cpp; AVX2 with FMA and F16C: cpu_kernels_avx2.cpp; neither, or
    SPECLM_KERNELS=torch: torch's ops. SPECLM_KERNELS=avx2 picks the AVX2 build where both run."""
    avx2 = ("sse4_2", "avx", "avx2", "fma", "f16c")
    cases = [(avx2 + ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"), "auto", "avx512"),
             (avx2 + ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"), "avx2", "avx2"),
             (avx2 + ("avx512f", "avx512bw", "avx512vl"), "auto", "avx2"),  # AVX-512 without VNNI
             (avx2, "auto", "avx2"), (avx2, "torch", None), (("sse4_2", "avx", "avx2"), "auto", None), ((), "auto", None)]
    for flags, choice, expected in cases:
        monkeypatch.setattr(kernels, "_cpu_flags", lambda flags=flags: flags)
        monkeypatch.setenv("SPECLM_KERNELS", choice)
        assert kernels.isa() == expected, (flags, choice)
        assert kernels.enabled() == (expected is not None)


def test_compiled_kernels_reject_mismatched_arguments():
    """The checks both builds share (speclm/quant/csrc/common.h) fail with an error, before anything is written."""
    require_compiled_kernels()
    compiled = kernels.compiled()
    q, scale = quant.int8_per_channel(torch.randn(70, 64))
    layout, colsum = quant.vnni_layout(q)
    x = torch.randn(3, 64)
    with pytest.raises(RuntimeError, match="bias must be fp32"):
        compiled.linear_rows(x, layout, colsum, scale, torch.zeros(69))
    with pytest.raises(RuntimeError, match="residual must be fp32"):
        compiled.linear_rows(x, layout, colsum, scale, None, torch.zeros(2, 70))
    u, s = quant.int4_groups(torch.randn(70, 128), 64)
    packed, scales = quant.int4_layout(u, s)
    with pytest.raises(RuntimeError, match="n does not match packed"):
        compiled.linear_rows_w4(torch.randn(1, 128), packed, scales, 200, None)
    assert compiled.linear_rows_w4(torch.randn(1, 128), packed, scales, 70, None).shape == (1, 70)


def test_amx_tiles_give_the_vnni_loops_bits():
    """On a CPU with AMX, linear_rows runs AMX_MIN_ROWS rows or more on its tiles: the same int32
    sums as the VNNI loop, so the same bits, at every row count (one tile of rows, several, a ragged
    last one, a prefill block's many pairs of them with its rows quantized on several threads),
    with bias and residual, at the largest activations and weights. Where the features are not whole
    64-byte steps the VNNI loop runs. Skipped on CPUs without AMX."""
    require_compiled_kernels()
    if not kernels.amx():
        pytest.skip("no AMX on this CPU (or SPECLM_AMX=0)")
    compiled = kernels.compiled()
    assert compiled.linear_rows_path(AMX_MIN_ROWS, 1536) == "amx"  # the comparison below compares two loops
    assert compiled.linear_rows_path(AMX_MIN_ROWS, 90) == compiled.linear_rows_path(1, 64) == "vnni"
    gen = torch.Generator().manual_seed(3)
    for in_f, out_f in ((64, 48), (1536, 200), (256, 64)):
        q, scale = quant.int8_per_channel(torch.randn(out_f, in_f, generator=gen))
        if in_f == 256:
            q = torch.full_like(q, -127)  # the largest sums the int32 accumulators see
        layout, colsum = quant.vnni_layout(q)
        bias = torch.randn(out_f, generator=gen)
        for rows in (1, 2, 3, 7, 15, 16, 17, 24, 31, 32, 48, 100):
            x = torch.randn(rows, in_f, generator=gen) * 3
            if in_f == 256:
                x = x.abs() + 1  # every row's values near its max: u8 near 255 everywhere
            h = torch.randn(rows, out_f, generator=gen)
            assert_amx_gives_the_vnni_loops_bits(lambda: (compiled.linear_rows(x, layout, colsum, scale, bias),
                                                          compiled.linear_rows(x, layout, colsum, scale, None, h)),
                                                 (in_f, out_f, rows))


def test_int8_layers_keep_a_onednn_copy_only_where_no_compiled_kernel_runs_or_when_asked(monkeypatch):
    """speclm's compiled kernel takes every row count, a prefill block's too, about as fast as oneDNN
    (benchmarks/amx/records.md#int8-prefill-paths, #int8-prefill-paths-vnni), so int8 layers hold no second, oneDNN-packed copy of
    their weights unless SPECLM_ONEDNN=1 asks for it; without a compiled kernel oneDNN takes more
    than one row where it is exact. Either path gives the same bits."""
    monkeypatch.setattr(quant, "_onednn_available", lambda: True)
    for asked in (None, "0", "1"):
        if asked is None:
            monkeypatch.delenv("SPECLM_ONEDNN", raising=False)
        else:
            monkeypatch.setenv("SPECLM_ONEDNN", asked)
        assert quant.onednn_used(True) == (asked == "1")
        assert quant.onednn_used(False)  # without a compiled kernel oneDNN takes the many rows
        assert ("onednn for more" in quant.int8_kernels(compiled=True)) == (asked == "1")
    monkeypatch.setattr(quant, "_onednn_available", lambda: False)  # a CPU where it is not exact
    assert not quant.onednn_used(True) and not quant.onednn_used(False)
    monkeypatch.undo()
    require_compiled_kernels()
    monkeypatch.delenv("SPECLM_ONEDNN", raising=False)
    linear = torch.nn.Linear(256, 96)
    layer = Int8Linear(linear)
    assert not layer.onednn and "packed" not in layer.__dict__ and layer.kernel_for(256) == "compiled"
    assert "onednn" not in quant.int8_kernels()
    if not quant._onednn_available():
        pytest.skip("oneDNN's int8 GEMM is not exact on this CPU")
    x = torch.randn(100, 256)
    ours = layer.rows(x)
    assert layer.with_onednn().kernel_for(100) == "onednn" and "packed" in layer.__dict__  # SPECLM_ONEDNN=1's
    assert torch.equal(layer.rows(x), ours)
    monkeypatch.setenv("SPECLM_ONEDNN", "1")
    asked = Int8Linear(linear)
    assert asked.onednn and "packed" in asked.__dict__ and asked.kernel_for(100) == "onednn"
    assert torch.equal(asked.rows(x), ours)


def test_speclm_amx_0_keeps_the_vnni_loop_and_says_so(monkeypatch):
    """SPECLM_AMX=0: no AMX in the kernel's name or its fingerprint (so measured cost tables are the
    VNNI loop's own), and linear_rows takes the VNNI loop at every row count."""
    require_compiled_kernels()
    if not kernels.amx():
        pytest.skip("no AMX on this CPU")
    compiled = kernels.compiled()
    try:
        monkeypatch.setenv("SPECLM_AMX", "0")
        kernels.fingerprint.cache_clear()
        off = kernels.fingerprint()
        assert not kernels.amx() and "AMX" not in kernels.describe()
        assert compiled.linear_rows_path(32, 1536) == "vnni"
    finally:
        monkeypatch.delenv("SPECLM_AMX")
        kernels.fingerprint.cache_clear()
        assert kernels.amx() and kernels.describe() == "speclm VNNI+AMX"  # and the module's rows set back
    assert kernels.fingerprint() != off
    assert compiled.linear_rows_path(AMX_MIN_ROWS, 1536) == "amx"


def test_far_prefetch_distance_by_vendor_and_environment(monkeypatch, capsys):
    """The L2 prefetch distance the kernels are built with: FAR_PREFETCH_BYTES on Intel CPUs only (measured
    there), SPECLM_FAR_PREFETCH's bytes where set, the default with one line on stderr for a value that
    is not a number; the build's flags carry it (so its own build and cost tables)."""
    from speclm.defaults import FAR_PREFETCH_BYTES

    monkeypatch.delenv("SPECLM_FAR_PREFETCH", raising=False)
    intel = "GenuineIntel" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else False
    assert kernels._far_prefetch() == (FAR_PREFETCH_BYTES if intel else 0)
    monkeypatch.setenv("SPECLM_FAR_PREFETCH", "0")
    assert kernels._far_prefetch() == 0
    monkeypatch.setenv("SPECLM_FAR_PREFETCH", "32768")
    assert kernels._far_prefetch() == 32768
    monkeypatch.setenv("SPECLM_FAR_PREFETCH", "64k")
    assert kernels._far_prefetch() == (FAR_PREFETCH_BYTES if intel else 0)
    assert "SPECLM_FAR_PREFETCH='64k' is not a number of bytes" in capsys.readouterr().err
    assert not kernels.enabled() or any(flag.startswith("-DSPECLM_FAR_PREFETCH=") for flag in kernels.build()[2])
