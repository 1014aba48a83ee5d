"""Every method on a CUDA model (skipped where torch sees no GPU; CI has none, so these run where
one is lent): greedy output equals plain decoding on the same GPU model, seeded sampling alone
equals the same request in a batch, the forward-cost table is timed to the forwards' end and
kept (the CPU-share rule, which would call a waiting GPU host busy, is for CPU models), and
`speclm tune`'s profile is measured and read there."""

import pytest
import torch

from speclm import SpecEngine, load_model, tune
from speclm.options import GenerationOptions
from tiny import byte_tokenizer, random_heads, tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(", "hello hello hello", "x = 1\ny = 2\nz = x +",
           "The quick brown fox jumps over"]


@pytest.fixture(scope="module")
def gpu(tmp_path_factory):
    tok = byte_tokenizer()
    target = load_model(tiny_model(len(tok), seed=0), tokenizer=tok, device="cuda")
    draft = load_model(tiny_model(len(tok), seed=1, layers=1), tokenizer=tok, device="cuda")
    root = tmp_path_factory.mktemp("cuda")
    heads = {kind: random_heads(kind, target.model, root / f"{kind}.safetensors", seed=i, std=0.3)
             for i, kind in enumerate(("medusa", "eagle"))}
    tree = root / "tree.json"
    tree.write_text("[[0], [1], [2], [0, 0], [0, 1], [0, 0, 0]]")
    engine = SpecEngine(target, draft=draft)
    return engine, heads, str(tree)


def _cases(heads, tree):
    return [dict(method="pld"), dict(method="draft"), dict(method="draft+pld"), dict(method="draft", tree="auto"),
            dict(method="draft", tree=tree), dict(method="draft+pld", tree="auto"),
            dict(method="medusa", heads=heads["medusa"]), dict(method="medusa", heads=heads["medusa"], tree=tree),
            dict(method="eagle", heads=heads["eagle"]), dict(method="eagle+pld", heads=heads["eagle"], ngram_min=1),
            dict(method="lookahead"), dict(method="lookahead+pld"), dict(method="self", layers="1", self_weights="target"),
            dict(method="auto", heads=heads["eagle"])]


def test_every_method_equals_plain_decoding(gpu):
    engine, heads, tree = gpu
    plain = [o.token_ids for o in engine.generate(PROMPTS, method="none", max_new_tokens=40)]
    for options in _cases(heads, tree):
        outs = engine.generate(PROMPTS, max_new_tokens=40, batch_size=3, **options)
        assert [o.token_ids for o in outs] == plain, options
        assert sum(o.stats.target_forwards for o in outs) <= sum(len(o.token_ids) for o in outs), options


@pytest.mark.parametrize("method", ["none", "draft", "eagle", "eagle+pld", "lookahead", "auto"])
def test_seeded_sampling_alone_equals_batched(gpu, method):
    engine, heads, _ = gpu
    options = {"heads": heads["eagle"]} if method.startswith("eagle") or method == "auto" else {}
    alone = engine.generate(PROMPTS[0], max_new_tokens=30, method=method, temperature=1.0, seed=7, **options)
    batch = engine.generate(PROMPTS, max_new_tokens=30, method=method, temperature=1.0, seed=7, batch_size=4, **options)
    assert alone.token_ids == batch[0].token_ids


def test_cost_table_is_timed_and_kept(gpu, capsys, tmp_path, monkeypatch):
    from speclm.forward.costs import verification_costs

    monkeypatch.setenv("SPECLM_HOME", str(tmp_path))
    engine = gpu[0]
    costs = verification_costs(engine.target.model, "cuda-test")
    assert costs.cpu_share == 1.0 and "busy" not in capsys.readouterr().err
    assert list((tmp_path / "costs").glob("*NVIDIA*.json"))
    assert all(seconds > 0 for seconds in costs.seconds.values())


def test_auto_plans_from_a_profile_tuned_on_the_gpu(gpu, tmp_path, monkeypatch):
    """`speclm tune` on a CUDA pair: its profile is named by the GPU and read back; auto then
    plans from it without measuring, and its output is plain decoding's."""
    monkeypatch.setenv("SPECLM_HOME", str(tmp_path))
    engine, heads, _ = gpu
    opts = GenerationOptions(method="auto", heads=heads["eagle"])
    profile = tune.measure(engine, opts)
    assert "NVIDIA" in profile.processor and profile.children
    assert tune.load(engine, opts) is not None
    plain = [o.token_ids for o in engine.generate(PROMPTS, method="none", max_new_tokens=40)]
    outs = engine.generate(PROMPTS, max_new_tokens=40, batch_size=4, method="auto", heads=heads["eagle"])
    assert [o.token_ids for o in outs] == plain
    assert sum(sum(o.stats.planned.values()) for o in outs) > 0
