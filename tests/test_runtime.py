"""Process-wide settings: glibc's malloc (threads: test_cli.py)."""

import platform

import pytest

from speclm.runtime import keep_freed_memory


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_keep_freed_memory_applies_on_glibc_and_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("SPECLM_MALLOC", "system")
    assert keep_freed_memory() is False
    monkeypatch.delenv("SPECLM_MALLOC")
    assert keep_freed_memory() is True  # every mallopt call accepted its value



BOUND = """
import sys, torch
from speclm import memory
from speclm.runtime import KEPT_FREE_BYTES, bound_freed_memory, keep_freed_memory
assert keep_freed_memory() == (sys.argv[1] == "keep")
def rss():
    return memory.resident().anonymous
base = rss()
for _ in range(3):  # requests whose activations come from the heap (blocks below the mmap threshold)
    blocks = [torch.ones(4 << 20) for _ in range(40)]  # 40 x 16 MB
    grown = rss() - base
    del blocks
    bound_freed_memory()  # what the engine does after each request
print(grown >> 20, (rss() - base) >> 20, KEPT_FREE_BYTES >> 20)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_freed_memory_kept_is_bounded():
    """640 MB of heap blocks, freed, then what the engine does after a request: the process keeps
    at most KEPT_FREE_BYTES of it (plus glibc's top pad), so a long-running process does not hold
    its peak. Without bound_freed_memory the "keep" process holds all 640 MB."""
    import subprocess
    import sys

    for setting in ("keep", "system"):
        env = {**__import__("os").environ, "SPECLM_MALLOC": setting}
        out = subprocess.run([sys.executable, "-c", BOUND, setting], env=env, capture_output=True, text=True, check=True)
        grown, kept, bound = map(int, out.stdout.split())
        assert grown >= 600  # the blocks were resident
        assert kept <= bound + 64 + 16, (setting, kept)  # plus glibc's top pad and one block of slack


def test_the_engine_bounds_freed_memory_after_each_request(target, monkeypatch):
    from speclm import engine as engine_module
    from speclm.engine import SpecEngine

    calls = []
    monkeypatch.setattr(engine_module, "bound_freed_memory", lambda: calls.append(1))
    eng = SpecEngine(target)
    eng.generate(["ab", "cd"], max_new_tokens=3, batch_size=1)
    assert len(calls) == 2
    list(eng.stream("ab", max_new_tokens=3))
    assert len(calls) == 3


def test_freed_memory_is_trimmed_when_it_grows_not_after_every_request(monkeypatch):
    """A trim leaves its blocks on malloc's free lists: requests that free the same memory again,
    resident memory flat, must not trim again (each trim costs the next request its page
    faults); resident growth past the bound does."""
    from types import SimpleNamespace

    import speclm.runtime as rt

    mb = 1 << 20
    free = iter([300, 310, 305, 900])  # MB free after requests 1-4
    # MB resident: before and after request 1's trim; after requests 2 and 3 (flat); before and after 4's trim
    anon = iter([2000, 1800, 1810, 1805, 2500, 1900])
    trims = []
    monkeypatch.setattr(rt, "freed_bytes", lambda: next(free) * mb)
    monkeypatch.setattr(rt, "resident", lambda: SimpleNamespace(anonymous=next(anon) * mb))
    monkeypatch.setattr(rt, "release_freed_memory", lambda: trims.append(1))
    monkeypatch.setattr(rt, "_resident_after_trim", 0)
    for _ in range(4):
        rt.bound_freed_memory()
    assert len(trims) == 2 and rt._resident_after_trim == 1900 * mb
