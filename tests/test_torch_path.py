"""The exactness tests on torch's ops alone: SPECLM_KERNELS=torch turns every compiled kernel off
(speclm.quant.kernels), and int8 then runs on oneDNN and torch._int_mm, RMSNorm, silu and attention on
torch's ops. Where the compiled kernels run, this file runs the greedy-equality, kernel-agreement
and alternatives tests again in a process with them off; where they do not run, the whole suite
is already on that path and this test is skipped. On a CPU with AVX-512 VNNI the same tests, and the GGUF-block kernel's,
run once more on the AVX2 build (SPECLM_KERNELS=avx2), which the whole suite runs on an AVX2-only CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from speclm.quant import kernels

ROOT = Path(__file__).resolve().parent.parent
EXACTNESS_TESTS = ["tests/test_engine_greedy.py", "tests/test_quant.py", "tests/test_alternatives.py",
                   "tests/test_draft_lookup.py", "tests/test_draft_vocab.py", "tests/test_prefix_cache.py"]
COMPILED_ONLY = ["tests/test_gguf_weights.py"]  # skipped with the kernels off: run on the AVX2 build alone


def _run_exactness_tests(kernel_choice: str, tests: list[str] = EXACTNESS_TESTS) -> None:
    env = {**os.environ, "SPECLM_KERNELS": kernel_choice}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout.splitlines()[-1]


@pytest.mark.skipif(not kernels.enabled(), reason="no compiled kernels here: the whole suite runs on torch's ops")
def test_exactness_tests_pass_with_the_compiled_kernels_off():
    _run_exactness_tests("torch")


@pytest.mark.skipif(not kernels.cpu_supports_vnni(), reason="an AVX2-only CPU: the whole suite runs on the AVX2 build")
def test_exactness_tests_pass_on_the_avx2_build():
    _run_exactness_tests("avx2", EXACTNESS_TESTS + COMPILED_ONLY)
