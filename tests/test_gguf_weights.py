"""--quantize gguf (speclm.quant.gguf, speclm/quant/csrc's linear_rows_kq): the GGUF's own blocks
decoded to the file's values, the kernel's exact block sums and fp32 chain, batch invariance, and
speculative == plain on a model loaded from a k-quant GGUF."""

import numpy as np
import pytest
import torch

from speclm import SpecEngine, UsageError
from speclm.quant import gguf as kq
from test_store import random_kquant_blocks, write_tiny_gguf
from tiny import require_compiled_kernels

KINDS = ("Q4_K", "Q6_K", "Q8_0", "Q5_0")


@pytest.fixture(autouse=True)
def _needs_the_compiled_kernels():
    require_compiled_kernels()  # both builds (AVX-512 VNNI, AVX2) have linear_rows_kq


def _linear(kind: str, out_f: int, in_f: int, seed: int, bias: bool = False) -> tuple[torch.nn.Linear, kq.Blocks]:
    rng = np.random.default_rng(seed)
    blocks = kq.Blocks(kind, random_kquant_blocks(rng, kind, out_f, in_f))
    linear = torch.nn.Linear(in_f, out_f, bias=bias)
    kq.attach(linear, blocks)
    return linear, blocks


@pytest.mark.parametrize("kind", KINDS)
def test_decoded_blocks_are_ggufs_own_values(kind):
    """decode + values reproduce gguf's own de-quantization bit for bit (what transformers loads)."""
    from gguf import GGMLQuantizationType, dequantize

    _, blocks = _linear(kind, 37, 512, seed=1)
    ref = dequantize(blocks.data, GGMLQuantizationType[kind])
    assert np.array_equal(kq.decode(blocks).values().numpy(), ref)


def _fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 a * b + c rounded once (fp64 holds the product exactly; see tests/test_int4.py)."""
    return (a.double() * b.double() + c.double()).float()


@pytest.mark.parametrize("kind,out_f,in_f,rows", [("Q4_K", 200, 512, 1), ("Q4_K", 70, 1536, 6), ("Q6_K", 130, 768, 5),
                                                  ("Q8_0", 64, 256, 3), ("Q6_K", 64, 256, 17),
                                                  ("Q5_0", 96, 320, 4)])
def test_kernel_is_the_exact_block_sums_in_one_fp32_chain(kind, out_f, in_f, rows):
    """Per block, in order: f = fma(fp32(sum x u), d sc, f), then f = fma(-(dmin mn), fp32(sum x), f)
    (Q4_K's mins), or f = fma(fp32(sum x u - z sum x), d sc, f) (a zero point z); then times the
    row's step, plus the bias: checked bit for bit against that chain written out here; each row
    alone gives its bits in the batch; the residual is added last."""
    from speclm.quant.weights import _quantized_rows

    torch.manual_seed(rows)
    linear, blocks = _linear(kind, out_f, in_f, seed=out_f, bias=True)
    layer = kq.GGUFLinear(linear)
    dec = kq.decode(blocks)
    x = torch.randn(rows, in_f)
    xq, step = _quantized_rows(x, in_f, signed=True)
    block = dec.fmt.block
    isum = torch.einsum("rbk,obk->rob", xq.view(rows, -1, block).long(), dec.u.view(out_f, -1, block).long())
    xsum = xq.view(rows, -1, block).long().sum(-1)  # (R, blocks)
    per = dec.fmt.super // block
    acc = torch.zeros(rows, out_f)
    for b in range(in_f // block):
        scale = dec.d[:, b // per] * dec.sc[:, b].float()  # exact
        mins = dec.dmin[:, b // per] * dec.mn[:, b].float()
        if dec.fmt.zero:  # exact integers
            acc = _fma32((isum[:, :, b] - dec.fmt.zero * xsum[:, b : b + 1]).float(), scale[None], acc)
        else:
            acc = _fma32(isum[:, :, b].float(), scale[None], acc)
            acc = _fma32(-mins[None], xsum[:, b : b + 1].float(), acc)
    ref = acc * step + linear.bias.detach()
    with torch.inference_mode():
        y = layer.rows(x)
        assert torch.equal(y, ref)
        for r in range(rows):
            assert torch.equal(layer.rows(x[r : r + 1].clone()), y[r : r + 1])
        h = torch.randn(rows, out_f)
        assert torch.equal(layer.rows(x, h), y + h)
        # near the fp32 product with the file's values (the activations' int8 rounding only)
        full = x @ dec.values().t() + linear.bias.detach()
    assert ((y - full).norm() / full.norm()).item() < 0.02


def test_restricted_outputs_and_the_cache_state_keep_the_bits():
    linear, _ = _linear("Q4_K", 150, 256, seed=3, bias=True)
    layer = kq.GGUFLinear(linear)
    x = torch.randn(4, 256)
    with torch.inference_mode():
        y = layer.rows(x)
        ids = torch.tensor([5, 149, 0, 64, 65])
        assert torch.equal(layer.outputs(ids).rows(x), y[:, ids])
        assert torch.equal(layer.first_outputs(128).rows(x), y[:, :128])
        again = kq.GGUFLinear.from_state(layer.state(), 256, 150)
        assert torch.equal(again.rows(x), y)
    assert torch.equal(layer.decoded().values(), kq.decode(linear.speclm_blocks).values())


def test_siblings_of_one_type_fuse_and_of_two_types_do_not():
    from speclm.quant.weights import Int8Linear, Int8Slice, quantize_linears

    class Attention(torch.nn.Module):
        def __init__(self, v_kind: str):
            super().__init__()
            self.q_proj, _ = _linear("Q4_K", 64, 256, seed=1)
            self.k_proj, _ = _linear("Q4_K", 64, 256, seed=2)
            self.v_proj, _ = _linear(v_kind, 64, 256, seed=3)
            self.o_proj = torch.nn.Linear(256, 64)  # no blocks: int8

    same, mixed = Attention("Q4_K"), Attention("Q6_K")
    quantize_linears(same, "gguf")
    quantize_linears(mixed, "gguf")
    assert isinstance(same.q_proj, Int8Slice) and isinstance(same.q_proj.fused.kernel, kq.GGUFLinear)
    assert isinstance(mixed.q_proj, kq.GGUFLinear) and mixed.v_proj.kind == "Q6_K"
    assert isinstance(same.o_proj, Int8Linear)


def _loaded_pair(tmp_path, monkeypatch, arch: str):
    from speclm.models.loading import load_model

    monkeypatch.setenv("SPECLM_HOME", str(tmp_path / "home"))
    path = write_tiny_gguf(tmp_path / f"kq-{arch}.gguf", hidden=256, ff=512, layers=2, heads=2, kv_heads=1,
                           kquants=True, arch=arch)
    return load_model(str(path), progress=False), load_model(str(path), quantize="gguf", progress=False), path


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_kquant_gguf_loads_onto_its_own_blocks(tmp_path, monkeypatch, arch):
    """Every matrix of the file's k-quant types becomes a GGUFLinear whose values are the fp32
    model's weights bit for bit (llama's q and k rows in transformers' order, un-permuted as its
    loader does); the Q8_0 embedding's tied-free head too; logits near the fp32 model's; the
    quantized-weights cache gives the same layers back."""
    from speclm.models.loading import load_model
    from speclm.quant.weights import Int8Slice, dense

    fp32, ours, path = _loaded_pair(tmp_path, monkeypatch, arch)
    ref = dict(fp32.model.named_modules())
    layers = 0
    for name, module in ours.model.named_modules():
        if isinstance(module, (kq.GGUFLinear, Int8Slice)):
            if isinstance(module, Int8Slice) and not isinstance(module.fused.kernel, kq.GGUFLinear):
                continue
            weight, _ = dense(module)
            if name in ref:
                assert torch.equal(weight, ref[name].weight.detach()), name
                layers += 1
    assert layers == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the head
    ids = torch.tensor([[3, 100, 7, 256, 42, 42, 9]])
    with torch.inference_mode():
        a, b = fp32.model(ids).logits, ours.model(ids).logits
    assert ((a - b).norm() / a.norm()).item() < 0.05
    again = load_model(str(path), quantize="gguf", progress=False)  # from the cache
    with torch.inference_mode():
        assert torch.equal(again.model(ids).logits, b)


@pytest.mark.parametrize("method", ["pld", "draft"])
def test_speculation_on_gguf_weights_equals_their_plain_decoding(tmp_path, monkeypatch, method):
    """A gguf target is batch-invariant: speculative greedy output equals its own plain greedy output,
    and with a seed its sampled output equals plain sampling's (one random stream per request)."""
    _, target, _ = _loaded_pair(tmp_path, monkeypatch, "qwen2")
    engine = SpecEngine(target, draft=target if method == "draft" else None)
    prompts = ["abcabcabc abc", "hello hello hello"]
    plain = engine.generate(prompts, method="none", max_new_tokens=24)
    spec = engine.generate(prompts, method=method, k=4, max_new_tokens=24)
    assert [o.token_ids for o in spec] == [p.token_ids for p in plain]
    if method == "draft":  # the target as its own draft: every token accepted
        assert all(o.stats.acceptance_rate == 1.0 for o in spec)
    sampled = dict(temperature=0.8, seed=7, max_new_tokens=24)
    assert (engine.generate(prompts[0], method=method, k=4, **sampled).token_ids
            == engine.generate(prompts[0], method="none", **sampled).token_ids)


def test_gguf_on_weights_that_are_no_gguf_is_a_usage_error(tok):
    from speclm.quant.weights import quantize_model
    from tiny import tiny_model

    with pytest.raises(UsageError, match="GGUF file's own blocks"):
        quantize_model(tiny_model(len(tok), seed=0), "gguf")
