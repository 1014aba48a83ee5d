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

