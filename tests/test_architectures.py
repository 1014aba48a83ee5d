"""Every architecture speclm.forward.decoders describes, on a tiny random model built from
transformers' own config (tests/tiny.py's tiny_arch: sliding windows of 6 keys, soft-capping, q/k
norms, partial rotary, per-layer rotary tables, Llama 3's rotary scaling):

- the lean forward's fp32 logits equal transformers' (eager attention, the reference that does
  everything) within 1e-4 over a prompt of 51 tokens fed in pieces (a prefill, a 3-token forward,
  then single tokens), on the compiled kernels and on torch's ops; each feature's planted bug
  (window off or one key wider, no soft-cap, a norm without its 1 + weight, one rotary table for
  every layer, no q/k norm) moves them by more than 1;
- on int8 weights every method's greedy output is token for token `none`'s, and seeded sampling's
  too, over 40 tokens (past every window); on int4 weights the drafting methods' as well;
- sampling follows the target's distribution exactly (one chi-square check per architecture, a
  `draft+pld`: tests/test_sampling_distribution.py's check, its false-failure
  probability ALPHA = 1e-3 each, so 8e-3 for the eight).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from chisq import ALPHA, chisq_pvalue
from speclm import SpecEngine
from speclm.forward import decoders
from speclm.forward.cache import StaticKV
from speclm.quant.weights import quantize_model
from speclm.sampling import SamplingParams
from tiny import ARCHITECTURES, WINDOW, loaded, random_heads, require_compiled_kernels, tiny_arch, word_tokenizer

N = 40
PROMPTS = ["ab ab ba aab x", "a lean forward, a lean forward", "[1,2,3] [4,5"]
TEXT = "a lean forward over a prompt longer than any window"  # 51 byte tokens


def _in_pieces(kv: StaticKV, ids: list[int]) -> torch.Tensor:
    """Every token's logits, fed as a prefill of 20, a 3-token forward, then one token at a time."""
    pieces = [kv.forward([ids[:20]], 20), kv.forward([ids[20:23]], 3)] + [kv.forward([[t]], 1) for t in ids[23:]]
    return torch.cat(pieces, dim=1)


def _feed(model, ids: list[int], compiled: bool) -> torch.Tensor:
    kv = StaticKV(model, 1, 128)
    assert kv.lean is not None, "the lean forward runs this architecture"
    if not compiled:
        kv.lean.compiled = None
    return _in_pieces(kv, ids)


def _reference(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits.float()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_lean_forward_matches_transformers(tok, arch):
    model = tiny_arch(arch, len(tok), seed=1)
    ids = tok(TEXT).input_ids
    assert len(ids) > 4 * WINDOW
    ref = _reference(model, ids)
    for compiled in (True, False):
        got = _feed(model, ids, compiled)
        assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), (arch, compiled, (got - ref).abs().max().item())


# a feature's planted bug, and the architectures that have the feature
MUTATIONS = {
    "no window": (lambda d: dataclasses.replace(d, windows=(0,) * len(d.windows)),
                  ("mistral", "qwen2-sliding", "phi3", "gemma2", "gemma3")),
    "window one wider": (lambda d: dataclasses.replace(d, windows=tuple(w + 1 if w else 0 for w in d.windows)),
                         ("mistral", "qwen2-sliding", "phi3", "gemma2", "gemma3")),
    "no soft-cap": (lambda d: dataclasses.replace(d, attn_softcap=None, final_softcap=None), ("gemma2",)),
    "norm without 1 + w": (lambda d: dataclasses.replace(d, family=dataclasses.replace(d.family, norm_offset=0.0)),
                           ("gemma2", "gemma3")),
    "one rotary table": (lambda d: dataclasses.replace(d, ropes=(d.ropes[-1],) * len(d.ropes)), ("gemma3",)),
    "no q/k norm": (lambda d: dataclasses.replace(d, family=dataclasses.replace(d.family, qk_norm=False)),
                    ("qwen3", "gemma3")),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_each_features_planted_bug_fails(tok, monkeypatch, mutation):
    change, archs = MUTATIONS[mutation]
    real = decoders.describe
    monkeypatch.setattr(decoders, "describe", lambda model: change(real(model)))
    ids = tok(TEXT).input_ids
    for arch in archs:
        model = tiny_arch(arch, len(tok), seed=1)
        assert (_feed(model, ids, compiled=True) - _reference(model, ids)).abs().max() > 1.0, (mutation, arch)


def test_an_unknown_architecture_is_named_as_such(tok):
    import transformers as tf

    model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=len(tok), n_embd=64, n_layer=1, n_head=2))
    assert decoders.describe(model) is None and decoders.why_not(model).startswith("model_type 'gpt2' is not one of")


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_transformers_forward_over_speclms_cache_keeps_windows_and_soft_caps(tok, monkeypatch, capsys, arch):
    """The fallback for architectures the lean forward does not know (here forced): transformers'
    own layers over speclm's cache and per-query attention, its windows and soft-caps honoured,
    said once on stderr."""
    import speclm.forward.runner as runner

    monkeypatch.setattr(runner.lean, "supports", lambda model: False)
    model = tiny_arch(arch, len(tok), seed=1)
    ids = tok(TEXT).input_ids
    ref = _reference(model, ids)  # eager attention
    kv = StaticKV(model, 1, 128)
    assert kv.lean is None
    assert torch.allclose(_in_pieces(kv, ids), ref, atol=1e-4, rtol=1e-4), arch
    # and transformers' own forward outside speclm's (its `generate`), on speclm's attention now
    assert torch.allclose(_reference(model, ids), ref, atol=1e-4, rtol=1e-4), arch
    StaticKV(model, 1, 16)
    assert capsys.readouterr().err.count("speclm: transformers' forward runs this model") == 1


def _methods(heads):
    return [("pld", {}), ("draft", {}), ("draft", {"tree": "auto"}), ("draft", {"alternatives": 1.0}),
            ("draft+pld", {}), ("medusa", {"heads": heads["medusa"]}), ("eagle", {"heads": heads["eagle"]}),
            ("eagle+pld", {"heads": heads["eagle"]}), ("lookahead", {"lookahead": (2, 3, 2)}),
            ("lookahead+pld", {}), ("self", {"layers": "1", "self_weights": "target"}),
            ("self", {"layers": "1", "self_weights": "int4", "tree": "auto"}), ("auto", {"heads": heads["eagle"]})]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_method_is_plain_decoding_on_quantized_weights(tok, tmp_path, arch):
    require_compiled_kernels()
    target = tiny_arch(arch, len(tok), seed=1)
    quantize_model(target, "int8")
    heads = {kind: random_heads(kind, target, tmp_path / f"{kind}.safetensors", seed=5, std=0.5)
             for kind in ("medusa", "eagle")}
    engine = SpecEngine(loaded(target, tok, name=arch), draft=loaded(target, tok, name=f"{arch}-draft"))  # long accepted drafts
    refs = [engine.generate(p, method="none", max_new_tokens=N) for p in PROMPTS]
    accepted = 0.0
    for method, options in _methods(heads):
        outs = [engine.generate(p, method=method, max_new_tokens=N, **options) for p in PROMPTS]
        assert [o.token_ids for o in outs] == [r.token_ids for r in refs], (arch, method, options)
        accepted = max(accepted, max(o.stats.mean_accepted_tokens for o in outs))
    assert accepted > 2.0  # some method's drafts were accepted at length: the equality is not vacuous
    seeded = dict(temperature=0.8, seed=3, max_new_tokens=N)
    refs = [engine.generate(p, method="none", **seeded) for p in PROMPTS]
    for method, options in _methods(heads)[::3]:
        outs = [engine.generate(p, method=method, **seeded, **options) for p in PROMPTS]
        assert [o.token_ids for o in outs] == [r.token_ids for r in refs], (arch, method, options)
    # an int4 target, its draft an unrelated int4 model of the architecture
    target = tiny_arch(arch, len(tok), seed=1)
    quantize_model(target, "int4")
    draft = tiny_arch(arch, len(tok), seed=2, layers=1)
    quantize_model(draft, "int4")
    engine = SpecEngine(loaded(target, tok, name=arch), draft=loaded(draft, tok, name=f"{arch}-draft"))
    refs = [engine.generate(p, method="none", max_new_tokens=N) for p in PROMPTS]
    for method, options in (("draft", {}), ("draft+pld", {"tree": "auto"}), ("self", {"layers": "1", "self_weights": "target"})):
        outs = [engine.generate(p, method=method, max_new_tokens=N, **options) for p in PROMPTS]
        assert [o.token_ids for o in outs] == [r.token_ids for r in refs], (arch, "int4", method)


V, DEPTH, SAMPLES = 6, 4, 6000
PROMPT = "w1 w2 w3 w1 w2 w3 w4 w1 w2"  # 9 tokens: the sampled ones sit past the window of 6


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_sampled_tokens_follow_the_target_distribution(arch):
    """`draft+pld` (rows drafted by the model and rows by lookup in one batch), T = 1: the first
    DEPTH tokens of SAMPLES requests against the exact joint of transformers' forward."""
    from test_sampling_distribution import counted, decode, exact_joint

    tok = word_tokenizer(V)
    target = loaded(tiny_arch(arch, V, seed=3, init=0.15), tok, name="t", eos=False)
    draft = loaded(tiny_arch(arch, V, seed=4, layers=1, init=0.15), tok, name="d", eos=False)
    ids = tok(PROMPT).input_ids
    params = SamplingParams(temperature=1.0)
    outs = decode(SpecEngine(target, draft=draft), ids, "draft+pld", params, depth=DEPTH)
    assert chisq_pvalue(counted(outs, V, DEPTH), exact_joint(target, ids, params, DEPTH)) > ALPHA


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_heads_train_on_the_models_own_embedding(tok, arch):
    """A head's training reads the target's input embedding as the model does (Gemma's scaled by
    sqrt(hidden)): the rows it trains on are those it drafts from."""
    from speclm.heads.train import _frozen_on

    model = tiny_arch(arch, len(tok), seed=1)
    ids = torch.tensor([3, 5, 7])
    frozen = _frozen_on(loaded(model, tok), torch.arange(len(tok)), torch.device("cpu"))
    assert torch.equal(frozen.embed(ids), model.get_input_embeddings()(ids).float()), arch


def model_switch(config) -> int:
    return config.rope_parameters["original_max_position_embeddings"]


def test_longrope_switches_to_its_long_factors_where_transformers_decoding_does(tok):
    """Phi-3.5/Phi-4-mini's LongRoPE: transformers rotates a token with the short factors while its
    forward's length is within original_max_position_embeddings and with the long ones past it. A
    token decoded alone at position p therefore gets the long factors from p = original on: the
    lean forward's table switches there, and its logits equal transformers' token-by-token
    decoding within 1e-4 on both sides of the switch; a table of short factors only (the planted
    bug) does not."""
    import dataclasses as dc

    import transformers as tf

    dim = 16
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
            "short_factor": [1.0 + 0.1 * i for i in range(dim // 2)], "long_factor": [2.0 + 0.5 * i for i in range(dim // 2)]}
    config = tf.Phi3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                           original_max_position_embeddings=16, tie_word_embeddings=False, rope_parameters=rope)
    assert model_switch(config) == 16
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tf.Phi3ForCausalLM(config).eval()
    ids = tok(TEXT).input_ids[:40]
    with torch.inference_mode():  # transformers' own decoding: a prefill of 8, then a token per forward
        out = model(torch.tensor([ids[:8]]), use_cache=True)
        ref, cache = [out.logits], out.past_key_values
        for t in ids[8:]:
            out = model(torch.tensor([[t]]), past_key_values=cache, use_cache=True)
            ref.append(out.logits)
            cache = out.past_key_values
    ref = torch.cat(ref, dim=1)

    def lean_logits(compiled):
        kv = StaticKV(model, 1, 64)
        if not compiled:
            kv.lean.compiled = None
        return torch.cat([kv.forward([ids[:8]], 8)] + [kv.forward([[t]], 1) for t in ids[8:]], dim=1)

    for compiled in (True, False):
        got = lean_logits(compiled)
        assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), (compiled, (got - ref).abs().max().item())
    real = decoders._longrope
    try:
        decoders._longrope = lambda model, device: dc.replace(real(model, device), long_inv_freq=None)
        assert (lean_logits(True)[:, 16:] - ref[:, 16:]).abs().max() > 1e-3  # 10x the tolerance
    finally:
        decoders._longrope = real
