"""speclm's compiled CPU kernels, built once per machine: speclm/quant/csrc/cpu_kernels.cpp on a CPU with
AVX-512 VNNI, speclm/quant/csrc/cpu_kernels_avx2.cpp on one with AVX2, FMA and F16C only.

torch's int8 kernels read the weights of a decode step slower than this CPU can at more than
one row (benchmarks/epyc/records.md#int8-gemm-rows), which is what speculation needs: a k-token
verification that costs about one step; and a decode step's few rows make every small aten op
(an RMSNorm is several) cost more than its arithmetic. On an AVX2-only CPU torch has no fast
exact int8 kernel at all (speclm.quant.weights). The kernels are built with torch's own extension
builder (the machine's C++ compiler, ninja) on first use and cached in torch's extension
folder (`TORCH_EXTENSIONS_DIR`, by default ~/.cache/torch_extensions); a changed source
rebuilds them. Both builds compute the same integers and the same int4 and RMSNorm bits, with
the same weight layouts. Where neither runs (another CPU, no compiler, a failed build: said once
on stderr), speclm runs torch's kernels: the same bits for the int8 GEMM, its own RMSNorm (a
model's forward is then exact with itself either way; it never mixes the two). int4 weights
(speclm.quant.weights.Int4Linear, for drafts) have no torch fallback: asking for them there is a
usage error.

SPECLM_KERNELS=torch turns the compiled kernels off; SPECLM_KERNELS=avx2 builds the AVX2 ones on
a CPU that could run either (to test them there).

On a CPU with AMX (Intel Sapphire Rapids and later) the AVX-512 build's int8 GEMMs run
AMX_MIN_ROWS rows or more (verification, trees, batches) on AMX tiles, and its int4 GEMMs
AMX_MIN_ROWS_INT4 rows or more: the same int32 sums, so the same bits, in less time than their
VNNI loops take for that many rows. SPECLM_AMX=0 keeps the VNNI loops.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
from pathlib import Path

from speclm.defaults import AMX_MIN_ROWS, AMX_MIN_ROWS_INT4, FAR_PREFETCH_BYTES, KERNEL_MACROS


def _far_prefetch() -> int:
    """The AVX-512 kernels' L2 prefetch distance for few rows (speclm.defaults.FAR_PREFETCH_BYTES): measured
    faster on an Intel Xeon, not measured on AMD, so 0 (none) there; SPECLM_FAR_PREFETCH (bytes) sets it."""
    value = os.environ.get("SPECLM_FAR_PREFETCH", "").strip()
    if value.isdigit():
        return int(value)
    if value:
        print(f"speclm: SPECLM_FAR_PREFETCH={value!r} is not a number of bytes; using the default", file=sys.stderr)
    return FAR_PREFETCH_BYTES if _cpuinfo("vendor_id") == "GenuineIntel" else 0


@functools.lru_cache(maxsize=None)
def _cpuinfo(field: str) -> str:
    """The first value of `field` in /proc/cpuinfo, "" where there is none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in text.splitlines()
                 if line.split(":", 1)[0].strip() == field and ":" in line), "")


_COMMON = ["-O3",
           "-ffp-contract=off",  # no FMA contraction: the rescale must round as torch's does
           "-fopenmp",  # at::parallel_for runs on torch's own OpenMP pool (same libgomp)
           *(f"-D{name}={value}" for name, value in KERNEL_MACROS.items()),  # tuned sizes (speclm.defaults)
           f"-DSPECLM_FAR_PREFETCH={_far_prefetch()}"]
LDFLAGS = ["-fopenmp"]  # every build's, and the benchmarks' builds of other versions
# instruction set -> (module name, source, compiler flags, /proc/cpuinfo flags it needs)
BUILDS = {
    "avx512": ("speclm_cpu_kernels", "cpu_kernels.cpp", ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"],
               ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")),
    "avx2": ("speclm_cpu_kernels_avx2", "cpu_kernels_avx2.cpp", ["-mavx2", "-mfma", "-mf16c"], ("avx2", "fma", "f16c")),
}
NAME, _source, _flags, _ = BUILDS["avx512"]
SOURCE = Path(__file__).with_name("csrc") / _source
FLAGS = [*_COMMON, *_flags]  # the AVX-512 build's (benchmarks/decode_attention.py builds variants with them)


@functools.lru_cache(maxsize=None)
def _cpu_flags() -> tuple[str, ...]:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return ()
    return tuple(_cpuinfo("flags").split())


def bf16_native() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX-512 BF16 or AMX): where it does, bf16
    training runs faster than fp32; elsewhere torch emulates it, slower."""
    return any(f in _cpu_flags() for f in ("avx512_bf16", "amx_bf16"))


def isa() -> str | None:
    """Which build runs here: "avx512", "avx2", or None (SPECLM_KERNELS=torch, or a CPU with neither)."""
    choice = os.environ.get("SPECLM_KERNELS", "auto")
    if choice == "torch":
        return None
    flags = _cpu_flags()
    for name in (("avx2",) if choice == "avx2" else ("avx512", "avx2")):
        if all(f in flags for f in BUILDS[name][3]):
            return name
    return None


def cpu_supports_vnni() -> bool:
    return all(f in _cpu_flags() for f in BUILDS["avx512"][3])


def enabled() -> bool:
    return isa() is not None


def describe() -> str:
    """The compiled kernels' name in reports: "speclm VNNI", "speclm VNNI+AMX", "speclm AVX2", or "" where
    none run."""
    if compiled() is None:
        return ""
    return {"avx512": "speclm VNNI+AMX" if amx() else "speclm VNNI", "avx2": "speclm AVX2"}.get(isa() or "", "")


def amx() -> bool:
    """Whether the int8 and int4 GEMMs run many rows on AMX tiles here (the CPU has them, Linux granted
    them, SPECLM_AMX is not 0)."""
    module = compiled()
    if module is None or not hasattr(module, "set_amx"):  # the AVX2 build has no tiles
        return False
    rows = _amx_min_rows()
    return module.set_amx(*rows) and rows[0] > 0  # set_amx: whether the CPU and Linux let the tiles run


def _amx_min_rows() -> tuple[int, int]:
    """(int8, int4) rows from which the kernels take the tiles; 0: never."""
    return (0, 0) if os.environ.get("SPECLM_AMX", "1") == "0" else (AMX_MIN_ROWS, AMX_MIN_ROWS_INT4)


def build() -> tuple[str, tuple[Path, Path], list[str]]:
    """The build that runs here (isa() not None): its module name, its files (the source, then the
    header it includes) and its compiler flags."""
    name, source_name, flags, _ = BUILDS[isa()]
    source = Path(__file__).with_name("csrc") / source_name
    return name, (source, source.with_name("common.h")), [*_COMMON, *flags]


@functools.lru_cache(maxsize=None)
def fingerprint() -> str:
    """A short hash of the build that runs here (its sources and flags), or "torch" where none does:
    measured timings kept on disk (speclm.forward.costs) name it, so a changed kernel is measured again."""
    if compiled() is None:
        return "torch"
    _, files, cflags = build()
    digest = hashlib.sha256(" ".join(cflags).encode())
    for path in files:
        digest.update(path.read_bytes())
    if amx():  # another kernel for many rows: other timings
        digest.update(b"amx")
    return digest.hexdigest()[:10]


@functools.lru_cache(maxsize=None)
def compiled():
    """The compiled module (`linear_rows`, `linear_rows_w4`, `rms_norm`, `silu_mul`, `decode_attention`), or None
    where it cannot run here."""
    if not enabled():
        return None
    name, files, cflags = build()
    from torch.utils import cpp_extension

    try:  # the ninja package's binary, for a virtual environment that is not on PATH
        import ninja

        if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except (ImportError, AttributeError):
        pass  # a system ninja, if any
    try:  # only to say that a build is coming (a private torch helper: best effort)
        build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
        built = [so.stat().st_mtime for so in build_dir.glob(name + "*.so")]
    except Exception:
        built = [0.0]
    if not built or max(built) < max(path.stat().st_mtime for path in files):
        print("speclm: building its CPU kernels for this machine (once, about a minute)...", file=sys.stderr, flush=True)
    try:
        module = cpp_extension.load(name=name, sources=[str(files[0])], extra_cflags=cflags,
                                    extra_ldflags=LDFLAGS, verbose=False)
        if hasattr(module, "set_amx"):
            module.set_amx(*_amx_min_rows())
        return module
    except Exception as exc:  # no compiler, a broken toolchain: torch's kernels still work
        lines = str(exc).strip().splitlines()
        errors = [line.strip() for line in lines if "error:" in line]  # the compiler's, not ninja's command line
        reason = (errors or lines or [type(exc).__name__])[0]
        print(f"speclm: its CPU kernels did not build ({reason}); using torch's kernels", file=sys.stderr)
        return None
