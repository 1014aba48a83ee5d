"""This process's resident memory, read from Linux's /proc: what `generate`'s statistics line and
`bench` report, and what the load-memory benchmark measures."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

_STATUS = Path("/proc/self/status")


@dataclass(frozen=True)
class Resident:
    """Bytes resident now, split by what backs them, and the peak since the last `reset_peak`."""

    total: int  # VmRSS
    anonymous: int  # RssAnon: heap, tensors
    file: int  # RssFile: mapped files (libraries; a mapped weights file would count here)
    peak: int  # VmHWM


def resident() -> Resident | None:
    """None where /proc/self/status does not say (not Linux)."""
    try:
        fields = dict(line.split(":", 1) for line in _STATUS.read_text().splitlines() if ":" in line)
        kib = {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "RssAnon", "RssFile", "VmHWM")}
    except (OSError, KeyError, ValueError, IndexError):
        return None
    return Resident(kib["VmRSS"], kib["RssAnon"], kib["RssFile"], kib["VmHWM"])


def peak_bytes() -> int | None:
    r = resident()
    return r.peak if r else None


def reset_peak() -> bool:
    """Start the peak anew from the current resident size (Linux's clear_refs "5"), so that a
    benchmark reports each method's own peak; False where the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"
