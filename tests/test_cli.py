"""The CLI contract: JSON output keys, and one-line errors with exit status 2."""

import json
import re
import subprocess
import sys

import pytest

from speclm.cli import main
from speclm.defaults import MAX_K
from speclm.errors import UsageError
from tiny import require_compiled_kernels

STAT_KEYS = {
    "target_forwards", "draft_forwards", "drafted_tokens", "accepted_tokens", "acceptance_rate",
    "mean_accepted_tokens", "accepted_per_position", "drafted_per_position", "draft_seconds", "verify_seconds",
    "wall_seconds", "new_tokens", "tokens_per_second", "forward_seconds", "overhead_share",
    "prefill_seconds", "decode_tokens_per_second", "alternatives", "accepted_alternatives",
    "draft_prefill_seconds", "cached_tokens", "verified_nodes", "lookup_rounds", "pool_hits", "pool_tokens",
    "planned", "plan_switches", "constraint_seconds", "round_trips", "round_trip_seconds", "resumed_sessions",
}


def run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_json_batch(folders, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello hello"}\n{"question_id": 1, "turns": ["abc abc", "second turn"]}\n{"prompt": "x"}\n')
    argv = ["generate", "--target", folders["target"], "--method", "draft", "--draft", folders["draft"],
            "--prompt-file", str(prompts), "--max-new-tokens", "9", "--batch-size", "2", "--json"]
    code, out, _ = run(argv, capsys)
    assert code == 0
    lines = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt_index"] for r in lines] == [0, 1, 2]
    for r in lines:
        assert set(r) >= {"prompt_index", "text", "token_ids", "stats"}
        assert set(r["stats"]) == STAT_KEYS
        assert len(r["token_ids"]) == r["stats"]["new_tokens"] <= 9
    # same greedy ids as plain decoding, prompt by prompt
    code, plain_out, _ = run(argv[:4] + ["none"] + argv[7:], capsys)
    assert [json.loads(x)["token_ids"] for x in plain_out.splitlines()] == [r["token_ids"] for r in lines]


def test_generate_streams_text_and_stats(folders, capsys):
    code, out, err = run(["generate", "--target", folders["target"], "--method", "pld", "--prompt", "ab ab ab",
                          "--max-new-tokens", "5", "--chat"], capsys)
    assert code == 0 and out.endswith("\n")
    assert re.match(r"\[[1-5] tokens, [0-9.]+ tok/s, \d+ target forwards, mean accepted", err)
    assert re.search(r"; peak memory [0-9.]+ GiB\]$", err.strip())  # the process's peak resident size
    assert "its prefill" not in err  # prompt lookup reads no prompt into a model
    code, out, err = run(["generate", "--target", folders["target"], "--method", "draft", "--draft", folders["draft"],
                          "--prompt", "ab ab ab", "--max-new-tokens", "5"], capsys)
    assert code == 0 and re.search(r"draft [0-9.]+s \(its prefill [0-9.]+s\), verify", err)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--method", "draft"], "needs --draft"),
        (["--method", "draft+pld"], "needs --draft"),
        (["--ngram-min", "0"], "need 1 <= ngram-min <= ngram-max"),
        (["--draft-prompt-ratio", "-1"], "draft-prompt-ratio must be >= 0"),
        (["--k", "0"], "k must be >= 1"),
        (["--k", str(MAX_K + 1)], f"k must be <= {MAX_K}"),
        (["--temperature", "-0.5"], "temperature must be >= 0"),
        (["--top-p", "0"], "top-p must be in (0, 1]"),
        (["--top-p", "1.01"], "top-p must be in (0, 1]"),
        (["--max-new-tokens", "0"], "max-new-tokens must be >= 1"),
        (["--method", "beam"], "invalid choice"),
        (["--batch-size", "0"], "batch-size must be >= 1"),
        (["--draft-vocab", "-1"], "draft-vocab must be >= 0"),
        (["--confidence", "1"], "confidence must be in [0, 1)"),
        (["--alternatives", "1.5"], "alternatives must be in [0, 1]"),
        (["--prefix-cache", "-1"], "prefix-cache must be >= 0"),
    ],
)
def test_bad_options_exit_2_with_one_line(folders, capsys, extra, message):
    code, out, err = run(["generate", "--target", folders["target"], "--prompt", "hi"] + extra, capsys)
    assert code == 2 and out == ""
    assert message in err and len(err.strip().splitlines()) == 1


def test_unknown_model(capsys):
    code, _, err = run(["generate", "--target", "no-such-model", "--prompt", "hi"], capsys)
    assert code == 2 and "unknown model 'no-such-model'" in err and len(err.splitlines()) == 1


def test_folder_without_config(tmp_path, capsys):
    code, _, err = run(["generate", "--target", str(tmp_path), "--prompt", "hi"], capsys)
    assert code == 2 and "not a model folder" in err


def test_draft_vocabulary_mismatch(folders, capsys):
    code, out, err = run(["generate", "--target", folders["target"], "--method", "draft", "--draft",
                          folders["other_vocab"], "--prompt", "hi"], capsys)
    assert code == 2 and out == "" and "does not share the target's vocabulary" in err


def test_prompt_longer_than_context(folders, capsys):
    code, out, err = run(["generate", "--target", folders["target"], "--prompt", "x" * 300], capsys)
    assert code == 2 and out == "" and "does not fit the context of 256 tokens" in err


def test_bad_prompt_file(folders, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": 1}\n')
    code, out, err = run(["generate", "--target", folders["target"], "--prompt-file", str(bad)], capsys)
    assert code == 2 and out == "" and "bad.jsonl:2" in err
    code, _, err = run(["generate", "--target", folders["target"], "--prompt-file", str(tmp_path / "none.jsonl")], capsys)
    assert code == 2 and "cannot read prompt file" in err


def test_no_traceback_from_the_console_script(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "speclm.cli", "generate", "--target", "nope", "--prompt", "x"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    proc = subprocess.run([sys.executable, "-m", "speclm.cli", "generate"], capture_output=True, text=True)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1


def test_models_list(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECLM_HOME", str(tmp_path))
    code, out, _ = run(["models", "list"], capsys)
    assert code == 0
    for name in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "smollm2-135m", "gemma3-270m"):
        assert name in out
    code, _, err = run(["models", "pull", "gpt-9"], capsys)
    assert code == 2 and "not in the catalog" in err
    code, _, err = run(["models", "verify", "gpt-9"], capsys)
    assert code == 2 and "neither in the catalog nor in the cache" in err
    code, _, err = run(["models", "verify", "smollm2-135m"], capsys)  # a catalog name, not pulled
    assert code == 1 and err.startswith("speclm: verify failed: 'smollm2-135m' is not in the cache")


def test_demo_runs_both_methods_and_reports_speedup(folders, capsys):
    code, out, err = run(["demo", "--target", folders["target"], "--draft", folders["target"], "--max-new-tokens", "12",
                          "--prompt", "hello"], capsys)
    assert code == 0
    assert "== statistics (speculative)" in out and "mean_accepted_tokens:" in out
    assert re.search(r"speedup: +[0-9.]+x", out)
    assert "identical output: yes" in out


def test_demo_reads_the_prompt_raw_for_a_model_without_a_chat_template(tmp_path, capsys):
    """A base model (no chat template, as gemma3-270m) runs the demo on its raw prompt."""
    from conftest import save
    from tiny import byte_tokenizer, tiny_model

    tok = byte_tokenizer()
    tok.chat_template = None
    folder = save(tiny_model(len(tok), seed=0), tok, tmp_path / "base")
    code, out, err = run(["demo", "--target", folder, "--draft", folder, "--max-new-tokens", "8", "--prompt", "hello"],
                         capsys)
    assert code == 0, err
    assert "identical output: yes" in out


def test_generate_int8(folders, capsys):
    """--quantize int8: speculative ids equal plain ids of the same int8 model."""
    base = ["generate", "--target", folders["target"], "--prompt", "int8 int8 int8", "--max-new-tokens", "12",
            "--json", "--quantize", "int8"]
    code, plain, _ = run(base + ["--method", "none"], capsys)
    assert code == 0
    for extra in (["--method", "pld", "--k", "5"], ["--method", "draft", "--draft", folders["draft"], "--k", "3"]):
        code, out, _ = run(base + extra, capsys)
        assert code == 0
        assert json.loads(out)["token_ids"] == json.loads(plain)["token_ids"]


def test_generate_with_an_int4_draft(folders, capsys):
    """--draft-quantize int4: the draft on int4 weights, the target on int8; output unchanged."""
    require_compiled_kernels()  # int4 has no torch fallback
    base = ["generate", "--target", folders["target"], "--prompt", "int4 int4 int4", "--max-new-tokens", "12",
            "--json", "--quantize", "int8"]
    code, plain, _ = run(base + ["--method", "none"], capsys)
    assert code == 0
    for method in ("draft", "draft+pld"):
        code, out, _ = run(base + ["--method", method, "--draft", folders["draft"], "--k", "3", "--draft-quantize", "int4"],
                           capsys)
        assert code == 0
        assert json.loads(out)["token_ids"] == json.loads(plain)["token_ids"], method


def test_generate_reuses_a_shared_head_through_the_prefix_cache(folders, tmp_path, capsys):
    """Prompts of one file that begin alike: the later ones take that head from the prefix cache
    (int8 weights), the stats line says how many tokens, and the output is what it is without."""
    require_compiled_kernels()
    head = "You answer in one line. "
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": head + q}) + "\n" for q in ("first?", "second?")))
    base = ["generate", "--target", folders["target"], "--prompt-file", str(prompts), "--max-new-tokens", "6",
            "--quantize", "int8", "--method", "draft", "--draft", folders["draft"]]
    outs = {}
    for size in ("4096", "0"):
        code, out, _ = run(base + ["--json", "--prefix-cache", size], capsys)
        assert code == 0
        outs[size] = [json.loads(line) for line in out.splitlines()]
    assert [r["stats"]["cached_tokens"] for r in outs["4096"]] == [0, len(head)]  # byte tokens
    assert [r["stats"]["cached_tokens"] for r in outs["0"]] == [0, 0]
    assert [r["token_ids"] for r in outs["4096"]] == [r["token_ids"] for r in outs["0"]]
    code, _, err = run(base, capsys)
    assert code == 0 and f"{len(head)} prompt tokens from the prefix cache" in err.splitlines()[-1]


def test_quantize_and_threads_errors(folders, capsys):
    code, _, err = run(["generate", "--target", folders["target"], "--prompt", "x", "--quantize", "int2"], capsys)
    assert code == 2 and "invalid choice" in err and "Traceback" not in err
    code, _, err = run(["generate", "--target", folders["target"], "--prompt", "x", "--draft-quantize", "fp8"], capsys)
    assert code == 2 and "invalid choice" in err and "Traceback" not in err
    code, _, err = run(["generate", "--target", folders["target"], "--prompt", "x", "--threads", "0"], capsys)
    assert code == 2 and "threads must be >= 1" in err
    code, _, err = run(["bench", "--target", folders["target"], "--methods", "none:quantize=int2", "--out", "o"], capsys)
    assert code == 2 and "quantize must be one of" in err


def test_threads_default_to_usable_cores(monkeypatch):
    import torch

    from speclm.runtime import set_threads, usable_cores

    before = torch.get_num_threads()
    try:
        assert set_threads() == usable_cores() == torch.get_num_threads()
        assert set_threads(1) == 1 == torch.get_num_threads()
        with pytest.raises(UsageError):
            set_threads(0)
    finally:
        torch.set_num_threads(before)


def test_auto_weights_resolve_to_the_exact_fast_path_where_kernels_run(monkeypatch):
    from speclm.quant import kernels
    from speclm.runtime import weights_for

    monkeypatch.setattr(kernels, "compiled", lambda: object())  # speclm's kernels run here
    assert weights_for("auto") == ("int8", "int4")
    assert weights_for("auto", "int8") == ("int8", "int8")
    assert weights_for("none") == ("none", "none")
    assert weights_for("int8") == ("int8", "int4")
    monkeypatch.setattr(kernels, "compiled", lambda: None)  # none: no int8 path that is exact by construction
    assert weights_for("auto") == ("none", "none")
    assert weights_for("int8") == ("int8", "int8")


def test_generate_runs_int8_by_default_and_says_so(folders, capsys):
    """No --quantize: int8 target and int4-or-int8 draft where speclm's kernels run, named on the
    statistics line; the output equals the explicit int8 run's."""
    require_compiled_kernels()
    base = ["generate", "--target", folders["target"], "--prompt", "auto auto auto", "--max-new-tokens", "8",
            "--method", "draft", "--draft", folders["draft"]]
    code, _, err = run(base, capsys)
    assert code == 0
    assert "target int8 weights on speclm" in err.splitlines()[-1] and "draft int" in err.splitlines()[-1]
    code, out_auto, _ = run(base + ["--json"], capsys)
    code2, out_int8, _ = run(base + ["--json", "--quantize", "int8"], capsys)
    assert code == code2 == 0
    assert json.loads(out_auto)["token_ids"] == json.loads(out_int8)["token_ids"]
    code, _, err = run(base + ["--quantize", "none"], capsys)
    assert code == 0 and "target float32 weights" in err.splitlines()[-1]


def test_tune_measures_then_shows_the_profile(folders, tmp_path, monkeypatch, capsys):
    import speclm.forward.costs as costs

    monkeypatch.setenv("SPECLM_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(costs, "BUSY", 0.0)  # cost tables kept even when measured on busy cores: --show reads them
    argv = ["tune", "--target", folders["target"], "--draft", folders["draft"], "--quantize", "none"]
    code, out, err = run(argv, capsys)
    assert code == 0, err
    assert "profile of" in err and "draft+pld" in out and "predicted speedup" in out
    code, shown, _ = run(argv + ["--show"], capsys)  # reads it back, measures nothing
    assert code == 0 and shown.splitlines()[1:] == out.splitlines()[1:]
    rows = [line.split() for line in shown.splitlines() if line[:1].isdigit()]
    assert [(r[0], r[1]) for r in rows] == [(p, b) for p in ("64", "2048") for b in ("1", "2", "4", "8")]


def test_quantize_auto_loads_the_weight_mode_tune_chose(tmp_path, monkeypatch, capsys):
    """`speclm tune`'s race decides --quantize auto for its target and draft on this machine, said
    once on stderr; a tie keeps int8; an explicit mode, another draft or an unreadable file leave it
    alone; no race measured: int8."""
    require_compiled_kernels()
    from speclm import runtime, tune

    monkeypatch.setenv("SPECLM_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(runtime, "_SAID", set())
    assert runtime.weights_for("auto", None, "t", "d") == ("int8", "int4")
    assert tune.choose_weights("t", "d", {"int8": 30.0, "gguf": 33.0}).mode == "gguf"
    assert runtime.weights_for("auto", None, "t", "d") == ("gguf", "int4")
    assert "--quantize auto: gguf weights (speclm tune" in capsys.readouterr().err
    assert runtime.weights_for("auto", None, "t", "d")[0] == "gguf" and capsys.readouterr().err == ""  # said once
    assert runtime.weights_for("int8", None, "t", "d")[0] == "int8"
    assert runtime.weights_for("auto", None, "t", None)[0] == runtime.weights_for("auto", None, "u", "d")[0] == "int8"
    assert tune.choose_weights("t", "d", {"int8": 33.0, "gguf": 30.0}).mode == "int8"
    assert tune.choose_weights("t", "d", {"gguf": 30.0, "int8": 30.0}).mode == "int8"
    tune.choose_weights("t", "d", {"int8": 1.0, "gguf": 2.0})
    tune._choice_path("t", "d").write_text("{not json")
    assert runtime.weights_for("auto", None, "t", "d")[0] == "int8"


def test_the_weights_race_interleaves_the_modes_and_times_whole_requests():
    """race: every tuning prompt on each mode in turn, the order reversed in the second pass, a
    request's whole time (its prefill too) over the tokens it made."""
    from types import SimpleNamespace

    from speclm import tune
    from speclm.options import GenerationOptions

    now, calls = [0.0], []

    class Engine:
        target = SimpleNamespace(tokenizer=SimpleNamespace(chat_template=None), max_context=None)

        def __init__(self, mode, per_token):
            self.mode, self.per_token = mode, per_token

        def generate(self, prompt, max_new_tokens, method, heads, chat):
            assert method == "auto"
            calls.append(self.mode)
            now[0] += 0.5 + self.per_token * max_new_tokens  # a prefill, then the tokens
            return SimpleNamespace(token_ids=[1] * max_new_tokens)

    speeds = tune.race({"int8": Engine("int8", 0.02), "gguf": Engine("gguf", 0.01)}, GenerationOptions(method="auto"),
                       progress=False, clock=lambda: now[0])
    n = len(tune.PROMPTS)
    assert calls[2:] == ["int8", "gguf"] * n + ["gguf", "int8"] * n
    assert speeds["int8"] == pytest.approx(tune.TOKENS / (0.5 + 0.02 * tune.TOKENS))
    assert speeds["gguf"] == pytest.approx(tune.TOKENS / (0.5 + 0.01 * tune.TOKENS))


def test_tune_races_the_weight_modes_of_a_gguf_and_auto_loads_the_winner(folders, tmp_path, monkeypatch, capsys):
    """`speclm tune` (--quantize auto) on a k-quant GGUF measures a profile for int8 and for gguf,
    races them and keeps the faster; `generate` with --quantize auto then loads that mode and says
    so. A model without GGUF blocks has int8 alone to choose."""
    require_compiled_kernels()
    import speclm.forward.costs as costs
    from speclm import runtime
    from test_store import write_tiny_gguf

    monkeypatch.setenv("SPECLM_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(costs, "BUSY", 0.0)
    monkeypatch.setattr(runtime, "_SAID", set())
    path = str(write_tiny_gguf(tmp_path / "kq.gguf", hidden=256, ff=512, layers=2, heads=2, kv_heads=1, kquants=True))
    code, out, err = run(["tune", "--target", path, "--draft", "none"], capsys)
    assert code == 0, err
    assert err.count("profile of") == 2 and "-int8+no-draft" in err and "-gguf+no-draft" in err
    line = out.splitlines()[-1]
    speeds = {m: float(t) for m, t in re.findall(r"(int8|gguf) ([0-9.]+)", line)}
    assert set(speeds) == {"int8", "gguf"}
    chosen = max(speeds, key=lambda m: (speeds[m], m == "int8"))
    assert line.startswith(f"--quantize auto: {chosen} weights (speclm tune")
    code, shown, _ = run(["tune", "--target", path, "--draft", "none", "--show"], capsys)  # measures nothing
    assert code == 0 and shown.splitlines()[-1] == line
    code, _, err = run(["generate", "--target", path, "--draft", "none", "--prompt", "abc", "--max-new-tokens", "4",
                        "--method", "none"], capsys)
    assert code == 0 and f"--quantize auto: {chosen} weights" in err and f"target {chosen} weights" in err.splitlines()[-1]
    code, out, err = run(["tune", "--target", folders["target"], "--draft", "none"], capsys)  # no GGUF: int8 alone
    assert code == 0 and err.count("profile of") == 1 and "cannot choose gguf" in err
    assert out.splitlines()[-1].startswith("--quantize auto: int8 weights (the target has no GGUF blocks")
