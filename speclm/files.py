"""The ground floor's file and machine facts, for every layer above: speclm's cache folder, a
file written whole, and the CPU's name (no torch, no model, no bench)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def home() -> Path:
    """Root of speclm's cache; `SPECLM_HOME` overrides the platform's cache directory."""
    env = os.environ.get("SPECLM_HOME")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("speclm"))


def atomic_write(path: Path, text: str) -> None:
    """path holds text, replaced whole (a reader never sees half a file; two processes writing it at
    once each write their own temporary file)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform reports."""
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
