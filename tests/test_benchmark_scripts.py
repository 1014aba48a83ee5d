"""Every script in benchmarks/ runs in its smoke mode (`--smoke`: the same code path on tiny
inputs, one torch thread) and prints what its full run prints, so a script that no longer runs
against speclm fails here. Scripts that load models get tiny random ones saved as folders;
those that read a `speclm bench` run get a tiny one's results.json. A script that needs
speclm's compiled kernels is skipped where they do not run."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from speclm.quant import kernels
from speclm.cli import main
from test_store import write_tiny_gguf
from tiny import byte_tokenizer, loaded, random_heads, require_compiled_kernels, tiny_model

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
HELPERS = {"gemm_shapes.py", "timing.py"}  # imported by the scripts, not run

# script: (arguments after --smoke, parts of lines (or patterns) its output must hold, needs the compiled kernels);
# {target}, {draft}: tiny model folders; {medusa}, {eagle}: untrained heads for the target (eagle's fused with
# layer 0); {data}: its heads data;
# {results}: a tiny bench run's results.json
SCRIPTS = {
    "allocator.py": (["--target", "{target}"],
                     ["## keep_freed_memory: False", "prefill after hf (none)",
                      "mean ratio none / pld over the 1 prompts that follow hf"], False),
    "cost_table_noise.py": (["--target", "{target}"],
                            ["passes over sizes 1, 2, 4, 8", "| forwards per size | tables | v(2) | v(4) | v(8) |",
                             re.compile(r"\| all 6 \| 1 \|( [0-9.]+ \|){3} – \|"), re.compile(r"\| 3 \| 2 \| "),
                             "One pass over the sizes takes about "], True),
    "decode_attention.py": ([], ["| model | context | rows | compiled us/layer | compiled ms/step |",
                                 "| tiny | 40 | 5 |"], True),
    "draft_policy.py": (["{results}"],
                        ["the run's cost model: c = ", "Target forwards measured in the run: ", "Replayed: ",
                         "| policy | ", "| confidence 0.6, alternatives below 0.6 (speclm's default since) |",
                         "`draft+pld` (the draft model with confidence 0.5, k 6;",
                         "Prompt lookup (n-grams 1-3, k 4 unless named):"], False),
    "int4_draft.py": (["--target", "{target}", "--draft", "{draft}"],
                      ["| GEMMs of one 0.5B step, 1 row | speclm int8 ms | speclm int4 ms |",
                       "| draft weights | draft step ms | prefill of 40 tokens ms |", "| int4 | ", " | 1/1 |"], True),
    "adaptive_ab.py": (["--target", "{target}", "--draft", "{draft}"],
                       ["| repeat | run | wall s | tokens | tokens/s | rounds | draft model s | of which reading prompts s "
                        "| identical to none |", re.compile(r"\| 1 \| draft\+pld, this \| .* \| 2/2 \|"),
                        "this / none "], True),
    "constrained.py": (["--target", "{target}", "--draft", "{draft}"],
                       ["## Libraries", "| library | compile ms (mean of schemas) | mask us / token (mean) | tokens walked |",
                        "| llguidance | ", "## Speed", re.compile(r"\| none \| .* \| 1\.000 \| 2/2 \| ./2 \| .*% \|"),
                        re.compile(r"\| auto \| .* \| 2/2 \| ./2 \| .*% \|")], False),
    "batch_generate.py": (["--target", "{target}", "--draft", "{draft}"],
                          ["| batch size | method | wall s | tokens | tokens/s | x none | identical to none | auto's plan |",
                           re.compile(r"\| 2 \| none \| .* \| 1\.000 \| 2/2 \| – \|"),
                           re.compile(r"\| 2 \| auto \| .* \| 2/2 \| .*%.* \|")], True),
    "engine_thread.py": (["--model", "{target}"],
                         ["| where | tokens/s (each run) | vs main thread |", "| main thread | ",
                          "| second thread, main thread's OpenMP workers freed | ",
                          "release_openmp_threads: True"], True),
    "fp32_linear_rows.py": ([], ["| rows | F.linear ms | (W x^T)^T ms | F.linear / (W x^T)^T |", "| 16 | "], False),
    "int8_gemm_rows.py": ([], ["| rows | speclm kernel ms (VNNI) | speclm kernel ms (AMX) | AMX / VNNI, median of "
                               "paired calls | onednn.qlinear_pointwise ms | torch._int_mm ms |", "| 32 | "], False),
    "kernel_ab.py": ([], ["int8 weights=0.00 GB; other build: the build's own source; outputs bit-identical",
                          "int4 weights=0.00 GB; other build: the build's own source; outputs bit-identical",
                          "| rows | other ms (median) | this build ms (median) |", "| 3 | ",
                          "attention of a prefill, 2 layers x 4 heads (2 kv) x 32; other build: the build's own source",
                          "| prompt tokens | other ms (median) |"], True),
    "amx_forward_rows.py": (["--target", "{target}", "--draft", "{draft}"],
                            ["AMX_MIN_ROWS=",
                             # both arms timed with the same logits, or a CPU without AMX
                             re.compile(r"\| 3 \|( [0-9.]+ \|){5} yes \||nothing to compare")], True),
    "int8_prefill_paths.py": (["--target", "{target}"],
                              ["default path past the VNNI rows: ",
                               # both paths timed with the same logits, or a CPU where oneDNN is not exact
                               re.compile(r"\| 90 \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| yes \||nothing to compare")], True),
    "int8_model.py": (["--target", "{target}"],
                      ["prompts=2", "fp32: load ", "int8 W8A8 per-row (speclm.quant.weights.Int8Linear, oneDNN): load ",
                       "int8 weight-only, bf16 act. (_weight_int8pack_mm): load ",
                       "argmax agreement with fp32"], False),
    "load_memory.py": (["--target", "{target}", "--draft", "{draft}"],
                       ["## First load: quantized from the store's files, then cached", "| both loaded | ",
                        "| after one request (8 tokens, draft+pld) | ", "| 6 | ", "together "], True),
    "prefill_blocks.py": (["--target", "{target}"],
                          ["| prompt tokens | block 64 s | block 128 s | block 256 s | no blocks s |",
                           "| 150 | "], False),
    "prefill_kernels.py": (["--target", "{target}", "--draft", "{draft}"],
                           ["| model | prompt tokens | query tile | prefill s | GEMMs s | attention s |",
                            "int4 | 90 | all queries | "], True),
    "prefix_cache.py": (["--target", "{target}", "--draft", "{draft}"],
                        ["| model | prompt tokens | SDPA prefill s | per-query prefill s | per-query / SDPA "
                         "| first 24 from the cache s | saved by the cache |", "int4 | 90 | "], True),
    "serve_overhead.py": (["--target", "{target}", "--draft", "{draft}"],
                          ["| method | tokens | generate tok/s | server-sized batch tok/s | serve tok/s, streamed | serve "
                           "tok/s, one reply | batch / generate | serve / generate, streamed | serve / generate, one reply | "
                           "identical outputs |",
                           re.compile(r"\| none \| \d+ \| .* \| 2/2 \|"), re.compile(r"\| draft\+pld \| .* \| 2/2 \|")],
                          False),
    "remote.py": (["--target", "{target}", "--draft", "{draft}"],
                  ["| round trip ms | plain tok/s | remote tok/s | remote / plain | target forwards per token ",
                   re.compile(r"\| 0 \| .* \| 1/1 \|"), re.compile(r"\| 20 \| .* \| 1/1 \|")], False),
    "distill_translation.py": (["--target", "{target}", "--out", "{data}/../de-en.jsonl"],
                               [re.compile(r"^4 prompts written to .*de-en\.jsonl \(\d+ left out")], False),
    "hf_dtype.py": (["--target", "{target}"], ["| dtype | tokens | seconds | tokens/s |", "| fp32 | ", "| bf16 | "], False),
    "sliding_cache.py": (["--target", "{target}"], ["| context | layout | KV MiB | KV MiB at 8192 |", "| 40 | every slot | ",
                                                    re.compile(r"\| 40 \| rings \| .* \| yes \|")], False),
    "typical_quality.py": (["--target", "{target}", "--heads", "{medusa}", "--methods", "medusa"],
                           ["| method | acceptance | tokens | target log-likelihood per token | tokens/s | speed vs exact |",
                            "| medusa | exact | ", "| medusa | typical | "], False),
    "heads_memory.py": (["--target", "{target}", "--medusa", "{medusa}", "--eagle", "{eagle}"],
                        ["| method | resident after the target's load MiB | added by heads or draft MiB |",
                         "| none | ", "| medusa | ", "| eagle | "], False),
    "eagle_levels.py": (["--target", "{target}", "--eagle", "{eagle}", "--per-category", "1", "--min-prob", "0.0,0.5"],
                        ["# EAGLE's MIN_PROB on 6 Spec-Bench prompts", "| run | tokens/s | speedup vs none |",
                         "| none | ", "| eagle, MIN_PROB 0.0 | ", "| eagle, MIN_PROB 0.5 | "], False),
    "gguf_rows.py": (["--target", "{gguf}"], ["rows | ", re.compile(r"^int8: \d+ GEMMs a step", re.M),
                                             re.compile(r"^4 \| .*x\)$", re.M)], True),
    "gguf_quality.py": (["--target", "{gguf}"], ["fp32 (the file's values de-quantized): perplexity ",
                                                 "int8: argmax agreement with fp32 "], True),
    "medusa_tree.py": (["--target", "{target}", "--heads", "{medusa}", "--data", "{data}"],
                       ["| head | rank 0 | rank 1 |", "| 3 | ", "tree: "], False),
}


def save(model, tokenizer, folder: Path) -> str:
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("benchmark-models")
    tok = byte_tokenizer()
    target = tiny_model(len(tok), seed=0)
    target.config.max_position_embeddings = 8192  # every Spec-Bench prompt fits at a byte a token
    from speclm.heads.data import build
    from speclm.heads.sources import Prompt

    prompts = [Prompt.of("code", "test", "Apache-2.0", f"def f{i}(x): return x + {i}") for i in range(8)]
    build(loaded(target, tok), root / "data", candidates=prompts, max_new_tokens=16, max_prompt_tokens=64,
          shard_size=4, progress=False)
    return {"target": save(target, tok, root / "target"),
            "draft": save(tiny_model(len(tok), seed=1, layers=1), tok, root / "draft"),
            "medusa": random_heads("medusa", target, root / "medusa.safetensors"),
            # fused with layer 0's states (EAGLE-3's input): the scripts' paths for the richer head
            "eagle": random_heads("eagle", target, root / "eagle.safetensors", fuse_layers=(0,)),
            "data": str(root / "data"),
            # a GGUF of random k-quant blocks, for the scripts that compare --quantize gguf
            "gguf": str(write_tiny_gguf(root / "kq.gguf", hidden=256, ff=512, layers=2, kquants=True))}


@pytest.fixture(scope="module")
def bench_results(models, tmp_path_factory) -> str:
    """results.json of a tiny `speclm bench` run with the methods draft_policy.py replays (int4
    draft where the compiled kernels run, as in the committed runs)."""
    root = tmp_path_factory.mktemp("benchmark-bench")
    dataset = root / "prompts.jsonl"  # Spec-Bench task kinds: draft_policy.py orders its columns by them
    rows = [("qa", "who wrote it? who wrote it?"), ("rag", "the cat sat. the cat"),
            ("translation", "Hallo Welt, Hallo")]
    dataset.write_text("".join(json.dumps({"id": i, "category": c, "prompt": p}) + "\n"
                               for i, (c, p) in enumerate(rows)))
    draft_quantize = "int4" if kernels.compiled() is not None else "int8"
    threads = torch.get_num_threads()
    try:
        code = main(["bench", "--target", models["target"], "--draft", models["draft"], "--quantize", "int8",
                     "--draft-quantize", draft_quantize, "--methods", "none,draft,pld,draft+pld", "--dataset",
                     str(dataset), "--max-new-tokens", "16", "--chat", "--cost-repeats", "1", "--threads", "1",
                     "--out", str(root / "run")])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    return str(root / "run" / "results.json")


def smoke_run(script: str, values: dict[str, str]) -> tuple[list[str], subprocess.CompletedProcess]:
    arguments = [a.format(**values) for a in SCRIPTS[script][0]]
    argv = [sys.executable, f"benchmarks/{script}", "--smoke", *arguments]
    return argv, subprocess.run(argv, cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def smoke_runs(models, request) -> dict[str, Future]:
    """Every script's smoke run that can run here, two at a time: each is mostly one thread
    importing torch and transformers, and the machine has 2 cores. The scripts that read a bench
    run start once the tiny bench has run."""
    needs_kernels = [name for name, (_, _, kernel) in SCRIPTS.items() if kernel]
    runnable = [name for name in SCRIPTS if name not in needs_kernels or kernels.compiled() is not None]
    later = [name for name in runnable if any("{results}" in a for a in SCRIPTS[name][0])]
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = {name: pool.submit(smoke_run, name, models) for name in runnable if name not in later}
        values = {**models, "results": request.getfixturevalue("bench_results")}  # while the first runs run
        runs.update({name: pool.submit(smoke_run, name, values) for name in later})
        yield runs


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_smoke_run(script, smoke_runs):
    if SCRIPTS[script][2]:
        require_compiled_kernels()
    argv, done = smoke_runs[script].result()
    report = f"{' '.join(argv)}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr[-4000:]}"
    assert done.returncode == 0, report
    for part in SCRIPTS[script][1]:
        found = part.search(done.stdout) if isinstance(part, re.Pattern) else part in done.stdout
        assert found, f"{part!r} missing\n{report}"


def test_every_script_has_a_smoke_test():
    assert {p.name for p in BENCHMARKS.glob("*.py")} == set(SCRIPTS) | HELPERS


def private_speclm_names(source: str) -> list[str]:
    """speclm names starting with an underscore that a script imports or reads off a speclm module."""
    tree = ast.parse(source)
    found, modules = [], set()  # modules: local names bound to speclm modules
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "speclm":
                    found += [alias.name for part in alias.name.split(".") if part.startswith("_")]
                    modules.add(alias.asname or "speclm")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "speclm":
            found += [node.module for part in node.module.split(".") if part.startswith("_")]
            found += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
            modules.update(a.asname or a.name for a in node.names)  # a submodule or a name: either reads as one
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in modules:
                found.append(f"{root.id}...{node.attr}")
    return found


def test_the_check_for_private_names_finds_them():
    assert private_speclm_names("from speclm.quant.weights import _vnni_layout, Int8Linear") == ["speclm.quant.weights._vnni_layout"]
    assert private_speclm_names("import speclm.quant.weights as q\nq._int4_groups(w, 64)") == ["q..._int4_groups"]
    assert private_speclm_names("from speclm import quant\nquant.Int8Linear._restricted") == ["quant..._restricted"]
    assert private_speclm_names("import torch\ntorch.ops.aten._weight_int8pack_mm(x)") == []


@pytest.mark.parametrize("path", sorted(BENCHMARKS.glob("*.py")), ids=lambda p: p.name)
def test_scripts_use_only_public_speclm_names(path):
    assert private_speclm_names(path.read_text()) == []
