"""Tiny randomly initialised models and tokenizers for fast tests (no downloads), and the
check the tests of speclm's compiled kernels share."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from speclm.quant import kernels
from speclm.models.loading import LoadedModel

EOS = "<eos>"


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """256 byte tokens (no merges) + <eos>: a character outside ASCII spans several tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab[EOS] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    fast.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    return fast


def word_tokenizer(size: int) -> PreTrainedTokenizerFast:
    """Words 'w0'..'w{size-2}' and <eos> (id size-1): a small vocabulary for exact distributions."""
    vocab = {f"w{i}": i for i in range(size - 1)}
    vocab[EOS] = size - 1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)


def tiny_model(vocab_size: int, seed: int, layers: int = 2, hidden: int = 64, init: float = 0.2,
               heads: int = 2, kv_heads: int = 1) -> Qwen2ForCausalLM:
    """Head size hidden / heads = 32 by default: the smallest the compiled decode attention
    (speclm/quant/csrc) takes, so the tests run it; 2 query heads per kv head keep GQA covered."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
        tie_word_embeddings=False, initializer_range=init,
    )
    config._attn_implementation = "sdpa"
    return Qwen2ForCausalLM(config).eval()


def loaded(model, tokenizer, name: str = "tiny", eos: bool = True) -> LoadedModel:
    ids = (tokenizer.convert_tokens_to_ids(EOS),) if eos else ()
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, eos_token_ids=ids)


def require_compiled_kernels() -> None:
    """Skip where speclm's compiled kernels cannot run (no AVX2, or SPECLM_KERNELS=torch);
    where they can, a failed build is a failure here, not a silent fallback."""
    if not kernels.enabled():
        pytest.skip("a CPU without AVX2 (or SPECLM_KERNELS=torch): speclm's compiled kernels do not run")
    assert kernels.compiled() is not None, "speclm's CPU kernels did not build"


def assert_amx_gives_the_vnni_loops_bits(call, where) -> None:
    """call() (a tuple of a compiled kernel's outputs) on its VNNI loop alone, then on AMX tiles from
    one row: the same bits. The kernels' AMX rows are set back to the defaults after (kernels.amx)."""
    compiled = kernels.compiled()
    try:
        out = []
        for min_rows in (0, 1):  # 0: the VNNI loops alone; 1: AMX from one row (int8 and int4)
            compiled.set_amx(min_rows)
            out.append(call())
    finally:
        kernels.amx()
    for vnni, amx in zip(*out):
        assert torch.equal(vnni, amx), where


def random_heads(kind: str, model, path, seed: int = 0, std: float = 0.3, heads: int = 3, vocab_ids=None,
                 fuse_layers: tuple[int, ...] = ()) -> str:
    """A file of untrained heads of `kind` for `model` with random weights (std): they propose
    varied trees, mostly rejected, which is what wiring tests need. fuse_layers: an EAGLE head
    reading those layers too. Returns the path."""
    from speclm.heads.modules import HeadsConfig, make
    from speclm.heads.store import export

    cfg = model.config
    vocab = cfg.vocab_size
    ids = torch.arange(vocab) if vocab_ids is None else torch.as_tensor(vocab_ids)
    config = HeadsConfig(kind, cfg.hidden_size, len(ids), vocab, target="tiny", heads=heads,
                         num_heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
                         head_dim=cfg.hidden_size // cfg.num_attention_heads, intermediate=2 * cfg.hidden_size,
                         rope_theta=10000.0, fuse_layers=tuple(fuse_layers))
    torch.manual_seed(seed)
    module = make(config)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, std)
    export(path, module, config, ids)
    return str(path)


def random_plan(engine, seed: int = 0):
    """An auto planner (speclm.round.adaptive.Adaptive) that gives each row, each round, a choice
    drawn at random from its options (no draft, every child at every draft length), so that
    exactness tests see every child and mixed rounds. Installed as the engine's planner."""
    import random

    from speclm.round.adaptive import Adaptive

    class RandomPlan(Adaptive):
        rng = random.Random(seed)

        def _plan(self, batch, groups, planned, rows):
            for key, g in planned:
                g.proposer.plan = [self.rng.choice(self._options(key, g, r)) for r in g.requests]
            return {}

    engine._planner = RandomPlan(engine.forward_costs(), plans_only=True)
    return engine._planner


# One tiny random model per architecture of speclm.forward.decoders, built from transformers'
# own config class, with every feature the family has switched on at a size the tests reach:
# sliding windows of 6 keys (prompts in the tests run past them), soft-capping, q/k norms,
# partial rotary, per-layer rotary tables, Llama 3's rotary scaling.
WINDOW = 6
ARCHITECTURES = ("llama3", "mistral", "qwen2-sliding", "qwen3", "phi3", "phi4-partial", "gemma2", "gemma3")


def tiny_arch(arch: str, vocab_size: int, seed: int = 0, layers: int = 3, hidden: int = 64, heads: int = 2,
              kv_heads: int = 1, init: float = 0.2):
    """A tiny model of `arch` (ARCHITECTURES). Norm weights are drawn too (transformers starts them
    at 1, or at 0 where the norm multiplies by 1 + weight), so a norm's form is tested."""
    import transformers as tf

    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
                  tie_word_embeddings=False, initializer_range=init)
    head_dim = hidden // heads
    if arch == "llama3":
        config, cls = tf.LlamaConfig(**common, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}), tf.LlamaForCausalLM
    elif arch == "mistral":
        config, cls = tf.MistralConfig(**common, sliding_window=WINDOW, head_dim=head_dim), tf.MistralForCausalLM
    elif arch == "qwen2-sliding":  # layers from max_window_layers on slide
        config, cls = tf.Qwen2Config(**common, use_sliding_window=True, sliding_window=WINDOW,
                                     max_window_layers=1), tf.Qwen2ForCausalLM
    elif arch == "qwen3":
        config, cls = tf.Qwen3Config(**common, head_dim=head_dim), tf.Qwen3ForCausalLM
    elif arch in ("phi3", "phi4-partial"):
        extra = {"partial_rotary_factor": 0.5} if arch == "phi4-partial" else {"sliding_window": WINDOW}
        config, cls = tf.Phi3Config(**common, pad_token_id=0, **extra), tf.Phi3ForCausalLM
    elif arch == "gemma2":
        config, cls = tf.Gemma2Config(**common, head_dim=head_dim, query_pre_attn_scalar=24, sliding_window=WINDOW,
                                      attn_logit_softcapping=2.0, final_logit_softcapping=3.0), tf.Gemma2ForCausalLM
    elif arch == "gemma3":
        types = ["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] * (layers % 2)
        config, cls = tf.Gemma3TextConfig(**common, head_dim=head_dim, query_pre_attn_scalar=24, sliding_window=WINDOW,
                                          layer_types=types), tf.Gemma3ForCausalLM
    else:
        raise ValueError(arch)
    config._attn_implementation = "eager"  # transformers' reference: the one that does everything
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    return model
