"""The model store: a failed or interrupted pull leaves nothing that looks like a model.

Downloads are replaced by locally built wheels here (no network); the real download and
GGUF conversion run in test_real_model.py.
"""

import hashlib
import json
import zipfile

import pytest

from speclm.catalog import CatalogEntry, WheelPart
from speclm.errors import PullError
from speclm.models import store

PAYLOAD = [b"GGUF" + bytes(range(200)) * 50, bytes(reversed(range(256))) * 30]


def fake_entry(sha: str) -> CatalogEntry:
    parts = tuple(WheelPart(f"fake-part{i}", "1.0", f"fake_part{i}/data/part{i:02d}.bin") for i in (1, 2))
    return CatalogEntry("fake-model", "test", "x/y", parts, "fake.gguf", sum(map(len, PAYLOAD)), sha)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECLM_HOME", str(tmp_path / "home"))

    def download(entry, dest, progress):
        dest.mkdir(parents=True)
        wheels = []
        for part, data in zip(entry.parts, PAYLOAD):
            wheel = dest / f"{part.package}-1.0-py3-none-any.whl"
            with zipfile.ZipFile(wheel, "w") as zf:
                zf.writestr(part.member, data)
            wheels.append(wheel)
        return wheels

    monkeypatch.setattr(store, "_download", download)
    return tmp_path / "home"


def use_entry(monkeypatch, entry):
    monkeypatch.setitem(store.CATALOG, entry.name, entry)


def leftovers(home):
    root = home / "models"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_checksum_mismatch_leaves_nothing(home, monkeypatch):
    use_entry(monkeypatch, fake_entry("0" * 64))
    with pytest.raises(PullError, match="checksum mismatch for fake-model"):
        store.pull("fake-model", progress=False)
    assert leftovers(home) == []


def test_good_pull_is_atomic_and_marked(home, monkeypatch):
    good = hashlib.sha256(b"".join(PAYLOAD)).hexdigest()
    use_entry(monkeypatch, fake_entry(good))
    seen = {}

    def convert(gguf, folder, **kw):
        seen["bytes"] = gguf.read_bytes()
        folder.mkdir()
        (folder / "config.json").write_text("{}")

    monkeypatch.setattr(store, "convert_gguf", convert)
    path = store.pull("fake-model", progress=False)
    assert seen["bytes"] == b"".join(PAYLOAD)  # parts concatenated in order
    assert leftovers(home) == ["fake-model"] and store.is_model_folder(path)
    assert json.loads((path / store.MARKER).read_text())["gguf_sha256"] == good
    assert "fake-model" in store.cached_models()


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_interrupted_conversion_leaves_nothing(home, monkeypatch, error):
    use_entry(monkeypatch, fake_entry(hashlib.sha256(b"".join(PAYLOAD)).hexdigest()))

    def convert(gguf, folder, **kw):
        folder.mkdir()
        (folder / "config.json").write_text("{}")  # half-written model
        raise error("stopped")

    monkeypatch.setattr(store, "convert_gguf", convert)
    with pytest.raises(error):
        store.pull("fake-model", progress=False)
    assert leftovers(home) == [] and store.cached_models() == {}


def test_stale_partial_is_ignored_then_removed(home, monkeypatch):
    stale = home / "models" / ".partial-fake-model-abc" / "model"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    (stale / store.MARKER).write_text("{}")
    assert store.cached_models() == {}
    use_entry(monkeypatch, fake_entry("0" * 64))
    with pytest.raises(PullError):
        store.pull("fake-model", progress=False)
    assert leftovers(home) == []
