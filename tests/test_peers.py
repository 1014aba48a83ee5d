"""The bench's peers: llama.cpp and OpenVINO GenAI beside speclm, each checked against its own plain decoding.

The runner's bookkeeping is tested with a stand-in engine; the engines themselves run for real on
tiny models (the `peers` extra, which `make test` installs: `make peers`).
"""

import importlib.util
import json
import os
import shutil
import sys

import pytest

from speclm.bench import peers
from speclm.bench.dataset import load_prompts
from speclm.bench.methods import parse_methods
from speclm.bench.runner import BenchConfig, run_bench
from speclm.cli import main
from speclm.errors import UsageError
from test_store import write_tiny_gguf

HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
HAS_OPENVINO = importlib.util.find_spec("openvino_genai") is not None
OPTIMUM_CLI = os.environ.get("SPECLM_OPTIMUM_CLI") or shutil.which("optimum-cli")


def test_parse_peer_methods(monkeypatch):
    monkeypatch.setattr(peers, "check", lambda name, options: None)  # the packages' presence is tested below
    specs = parse_methods("none,llama.cpp,llama.cpp-pld:k=4,ngram_max=3,openvino,openvino-draft:draft_weights=int8,openvino-pld")
    assert [s.plain for s in specs] == ["none", "llama.cpp", "llama.cpp", "openvino", "openvino", "openvino"]
    assert [s.is_peer for s in specs] == [False] + [True] * 5
    assert specs[2].options == {"k": 4, "ngram_max": 3}
    assert specs[4].needs_draft and not specs[3].needs_draft
    assert peers.settings("llama.cpp-pld", specs[2].options) == {"k": 4, "ngram_max": 3}
    assert peers.settings("openvino-pld", {}) == {"k": 5, "ngram_max": 3, "weights": "int8", "precision": "f32"}
    for bad in ("llama.cpp:quantize=int8", "draft:weights=int4", "pld:draft_weights=int8"):
        with pytest.raises(UsageError):
            parse_methods(bad)


@pytest.mark.parametrize("method, options, message", [
    ("llama.cpp", {"weights": "int8"}, "takes no option weights"),
    ("openvino", {"weights": "int3"}, "weights must be one of"),
    ("openvino-pld", {"depth": 2}, "takes no option depth"),
    ("openvino", {"precision": "fp8"}, "precision must be one of f32, bf16, auto"),
    ("llama.cpp", {"precision": "f32"}, "takes no option precision"),
])
def test_peer_options_are_checked(method, options, message):
    with pytest.raises(UsageError, match=message):
        peers.check(method, options)


def test_missing_engine_package_is_one_line(monkeypatch, capsys, folders, tmp_path):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as where the extra is not installed
    code = main(["bench", "--target", folders["target"], "--methods", "none,llama.cpp", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1
    assert "needs the llama_cpp package" in err and "speclm[peers]" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("options, hint", [({}, "f32"), ({"precision": "bf16"}, "bf16"), ({"precision": "auto"}, None)])
def test_openvino_activation_precision_reaches_both_models(monkeypatch, tmp_path, options, hint):
    import types

    made = []
    fake = types.SimpleNamespace(LLMPipeline=lambda model, device, **props: made.append(("target", props)),
                                 draft_model=lambda model, device, **props: made.append(("draft", props)))
    monkeypatch.setitem(sys.modules, "openvino_genai", fake)
    monkeypatch.setattr(peers, "openvino_model", lambda folder, weights, progress=True: tmp_path / weights)
    peers.OpenVINOPeer(tmp_path, tmp_path, "openvino-draft", options, 2, (0,), progress=False)
    assert [m for m, _ in made] == ["draft", "target"]
    for _, props in made:  # auto leaves OpenVINO its own choice (bf16 where the CPU has AMX)
        assert props.get("INFERENCE_PRECISION_HINT") == hint and props["INFERENCE_NUM_THREADS"] == 2
    assert f"activations {options.get('precision', 'f32')}" in peers.describe("openvino-draft", options)


class StandIn:
    """An engine that answers like a peer: its plain decoding a fixed continuation, its
    speculative one the same, except where it is told to differ."""

    def __init__(self, name, differ_at=None):
        self.name, self.differ_at = name, differ_at

    def generate(self, prompt_ids, max_new_tokens, temperature, seed):
        out = [(sum(prompt_ids) + 7 * i) % 200 for i in range(max_new_tokens)]
        if self.differ_at is not None and max_new_tokens > self.differ_at:
            out[self.differ_at] += 1
        return out


def test_runner_checks_each_peer_against_its_own_plain_decoding(engine, tmp_path, monkeypatch, dataset):
    import speclm.bench.runner as runner

    monkeypatch.setattr(peers, "check", lambda name, options: None)
    made = {}

    def make(name, options, target, draft, n_ctx, threads, eos, progress):
        made[name] = (n_ctx, threads, eos)
        return StandIn(name, differ_at=3 if name == "openvino-pld" else None)

    monkeypatch.setattr(runner, "make_peer", make)
    specs = parse_methods("none,pld,llama.cpp-pld,llama.cpp,openvino,openvino-pld,hf-assisted,hf-assisted:k=2")
    config = BenchConfig(target="tiny", draft="tiny-draft", methods=[s.label for s in specs], dataset="x", categories=None,
                         per_category=1, max_new_tokens=8, temperature=0.0, seed=0, repeats=1, chat=False, cost_repeats=1)
    out = tmp_path / "out"
    results = run_bench(engine, specs, load_prompts(dataset, ["qa", "rag"], 1), config, out, progress=False,
                        measure_cost_model=False)
    assert set(made) == {"llama.cpp", "llama.cpp-pld", "openvino", "openvino-pld"}
    runs = {(r["method"], r["prompt_id"]): r for r in results["runs"]}
    for pid in ("0", "1"):
        assert runs[("llama.cpp-pld", pid)]["compared_with"] == "llama.cpp" and runs[("llama.cpp-pld", pid)]["lossless"]
        assert runs[("llama.cpp", pid)]["lossless"] is None  # the reference itself
        bad = runs[("openvino-pld", pid)]
        assert bad["lossless"] is False and bad["mismatch"]["position"] == 3 and bad["mismatch"]["top2_margin"] is None
        assert runs[("pld", pid)]["compared_with"] == "none" and runs[("pld", pid)]["lossless"]
    text = (out / "report.md").read_text()
    assert "## Other engines and their settings" in text
    assert "num_pred_tokens 2, max_ngram_size 2" in text  # llama-cpp-python's CPU recommendation
    assert "transformers' default schedule" in text and "constant schedule" in text
    assert "| 0/2 |" in text  # openvino-pld's identical count
    assert "2 output(s) differ from their plain decoding" in text


def bench_peers(target, methods, dataset, out, *extra):
    return main(["bench", "--target", str(target), "--methods", methods, "--dataset", dataset, "--max-new-tokens", "24",
                 "--cost-repeats", "0", "--quantize", "none", "--out", str(out), *extra])


@pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed (make peers)")
def test_llama_cpp_peer_runs_and_its_prompt_lookup_is_lossless(tmp_path, dataset, monkeypatch, capsys):
    monkeypatch.setenv("SPECLM_HOME", str(tmp_path / "home"))
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", layers=2, hidden=128, heads=4, kv_heads=2, merges=("a b",))
    assert bench_peers(gguf, "none,llama.cpp,llama.cpp-pld,llama.cpp-pld:k=6", dataset, tmp_path / "out") == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    runs = [r for r in results["runs"] if r["method"].startswith("llama.cpp")]
    assert len(runs) == 9 and all(r["new_tokens"] > 0 for r in runs)
    assert all(r["lossless"] for r in runs if r["method"] != "llama.cpp")
    assert "llama.cpp prompt lookup (LlamaPromptLookupDecoding), num_pred_tokens 6" in (tmp_path / "out" / "report.md").read_text()
    peer = peers.make_peer("llama.cpp", {}, str(gguf), None, 256, 1, (257,), progress=False)  # EOS after "ab"
    ids = list(b"the cat sat on the mat")
    assert peer.generate(ids, 20, 1.0, 5) == peer.generate(ids, 20, 1.0, 5)  # seeded sampling repeats
    # a context past llama.cpp's 512-token batch: prompt lookup keeps every position's logits
    long = list(b"one two three four five six seven eight nine ten. " * 14)  # 700 byte tokens
    plain = peers.make_peer("llama.cpp", {}, str(gguf), None, 1024, 1, (257,), progress=False)
    lookup = peers.make_peer("llama.cpp-pld", {}, str(gguf), None, 1024, 1, (257,), progress=False)
    assert lookup.generate(long, 40, 0.0, 0) == plain.generate(long, 40, 0.0, 0)


def test_llama_cpp_amx_trial_turns_extra_buffer_types_off_only_on_a_trap(monkeypatch):
    monkeypatch.setattr(peers, "_has_amx_kernels", lambda: True)
    sigill = "import os, signal; os.kill(os.getpid(), signal.SIGILL)"
    for script, traps in ((sigill, True), ("raise SystemExit(3)", False), ("pass", False)):
        monkeypatch.setattr(peers, "_AMX_PROBE", script)
        peers.llama_cpp_amx_traps.cache_clear()
        assert peers.llama_cpp_amx_traps("model.gguf", 1) is traps, script

    def hangs(*args, **kwargs):
        raise peers.subprocess.TimeoutExpired(args[0], kwargs["timeout"])

    with monkeypatch.context() as m:
        m.setattr(peers.subprocess, "run", hangs)
        peers.llama_cpp_amx_traps.cache_clear()
        with pytest.raises(UsageError, match="did not end in 15 minutes"):
            peers.llama_cpp_amx_traps("model.gguf", 1)
    monkeypatch.setattr(peers, "_has_amx_kernels", lambda: False)  # a build without AMX kernels runs no trial
    monkeypatch.setattr(peers, "_AMX_PROBE", sigill)
    peers.llama_cpp_amx_traps.cache_clear()
    assert peers.llama_cpp_amx_traps("model.gguf", 1) is False
    peers.llama_cpp_amx_traps.cache_clear()


@pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed (make peers)")
def test_llama_cpp_without_extra_buffer_types_where_its_amx_kernels_trap(tmp_path, dataset, monkeypatch):
    import subprocess

    monkeypatch.setenv("SPECLM_HOME", str(tmp_path / "home"))
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", layers=2, hidden=128, heads=4, kv_heads=2, merges=("a b",))
    # the trial script itself runs to its end (an error in it would read as "no trap" everywhere); the
    # tiny model's fp32 weights take no AMX kernel
    done = subprocess.run([sys.executable, "-c", peers._AMX_PROBE, str(gguf), "1"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    ids = list(b"the cat sat on the mat")
    usual = peers.make_peer("llama.cpp", {}, str(gguf), None, 256, 1, (257,), progress=False)
    monkeypatch.setattr(peers, "llama_cpp_amx_traps", lambda gguf, threads: True)
    fallback = peers.make_peer("llama.cpp", {}, str(gguf), None, 256, 1, (257,), progress=False)
    assert fallback.llm.model_params.use_extra_bufts is False and usual.llm.model_params.use_extra_bufts is True
    assert fallback.generate(ids, 16, 0.0, 0) == usual.generate(ids, 16, 0.0, 0)
    import llama_cpp.llama_cpp as lib

    assert lib.llama_model_default_params().use_extra_bufts is True  # the wrap ends with the load
    assert bench_peers(gguf, "none,llama.cpp", dataset, tmp_path / "out") == 0
    assert "extra buffer types off (its AMX kernels trapped" in (tmp_path / "out" / "report.md").read_text()


@pytest.mark.skipif(not (HAS_OPENVINO and OPTIMUM_CLI), reason="openvino-genai or optimum-cli is missing (make peers)")
def test_openvino_peers_export_once_and_run(tmp_path, dataset, folders, monkeypatch):
    monkeypatch.setenv("SPECLM_HOME", str(tmp_path / "home"))
    out = tmp_path / "out"
    # int8 draft weights: int4's groups of 128 inputs do not divide the tiny model's 64
    code = bench_peers(folders["target"], "none,openvino,openvino-pld,openvino-draft:k=3,draft_weights=int8", dataset, out,
                       "--draft", folders["draft"])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    runs = [r for r in results["runs"] if r["method"].startswith("openvino")]
    assert len(runs) == 9 and all(r["new_tokens"] > 0 for r in runs)
    assert all(r["lossless"] is not None for r in runs if r["method"] != "openvino")
    exports = sorted(p.name for p in (tmp_path / "home" / "openvino").iterdir() if not p.name.startswith("."))
    assert exports == ["draft-int8", "target-int8"]  # once each, into the cache
    assert "OpenVINO GenAI speculative decoding, num_assistant_tokens 3" in (out / "report.md").read_text()
