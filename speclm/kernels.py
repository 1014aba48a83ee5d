"""speclm's compiled CPU kernels (speclm/csrc/cpu_kernels.cpp), built once per machine.

torch's int8 kernels read the weights of a decode step slower than this CPU can at more than
one row (benchmarks/intel/int8-gemm-rows-cpu.txt), which is what speculation needs: a k-token
verification that costs about one step; and a decode step's few rows make every small aten op
(an RMSNorm is several) cost more than its arithmetic. The kernels are built with torch's own extension
builder (the machine's C++ compiler, ninja) on first use and cached in torch's extension
folder (`TORCH_EXTENSIONS_DIR`, by default ~/.cache/torch_extensions); a changed source
rebuilds them. They need AVX-512 VNNI; elsewhere, or if the build fails (said once on
stderr), speclm runs torch's kernels: the same bits for the int8 GEMM, its own RMSNorm (a
model's forward is then exact with itself either way; it never mixes the two). int4 weights
(speclm.quant.Int4Linear, for drafts) have no torch fallback: asking for them there is a
usage error.

SPECLM_KERNELS=torch turns the compiled kernels off.
"""

from __future__ import annotations

import functools
import os
import platform
import sys
from pathlib import Path

from speclm.defaults import KERNEL_MACROS

NAME = "speclm_cpu_kernels"
SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.cpp"
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni",
         "-ffp-contract=off",  # no FMA contraction: the rescale must round as torch's does
         "-fopenmp",  # at::parallel_for runs on torch's own OpenMP pool (same libgomp)
         *(f"-D{name}={value}" for name, value in KERNEL_MACROS.items())]  # tuned sizes (speclm.defaults)
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")


def cpu_supports_vnni() -> bool:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return all(f in flags for f in CPU_FLAGS)


def enabled() -> bool:
    return os.environ.get("SPECLM_KERNELS", "auto") != "torch" and cpu_supports_vnni()


@functools.lru_cache(maxsize=None)
def compiled():
    """The compiled module (`linear_rows`, `linear_rows_w4`, `rms_norm`, `silu_mul`, `decode_attention`), or None
    where it cannot run here."""
    if not enabled():
        return None
    from torch.utils import cpp_extension

    try:  # the ninja package's binary, for a virtual environment that is not on PATH
        import ninja

        if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except (ImportError, AttributeError):
        pass  # a system ninja, if any
    try:  # only to say that a build is coming (a private torch helper: best effort)
        build_dir = Path(cpp_extension._get_build_directory(NAME, verbose=False))
        built = [so.stat().st_mtime for so in build_dir.glob(NAME + "*.so")]
    except Exception:
        built = [0.0]
    if not built or max(built) < SOURCE.stat().st_mtime:
        print("speclm: building its CPU kernels for this machine (once, about a minute)...", file=sys.stderr, flush=True)
    try:
        return cpp_extension.load(name=NAME, sources=[str(SOURCE)], extra_cflags=FLAGS,
                                  extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler, a broken toolchain: torch's kernels still work
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"speclm: its CPU kernels did not build ({reason}); using torch's kernels", file=sys.stderr)
        return None
