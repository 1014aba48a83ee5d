"""Drafts that are a base model plus a LoRA adapter (`speclm draft distill`'s output): the folder
holds peft's adapter (adapter_config.json, adapter_model.safetensors), the base's config and
tokenizer files, and DRAFT_FILE naming the base. Loading builds the base in fp32, merges the
adapter into its weights (peft's merge_and_unload: W + scale * B @ A) and then quantizes as asked,
so a distilled draft runs on the same kernels as its base and costs nothing more per token.

A registry in speclm's cache (REGISTRY) remembers every folder distill wrote, for `speclm models`.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from speclm.errors import UsageError
from speclm.files import atomic_write, home

DRAFT_FILE = "speclm-draft.json"  # {"base", "target", "adapter": "lora" | "full", ...}
ADAPTER_CONFIG = "adapter_config.json"
REGISTRY = "distilled.json"  # in speclm's cache: {folder: its DRAFT_FILE record}


def draft_record(folder: Path) -> dict | None:
    """The DRAFT_FILE record of a distilled draft's folder (None: not one)."""
    path = Path(folder) / DRAFT_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read {path}: {exc}") from exc
    if not isinstance(record, dict) or not isinstance(record.get("base"), str):
        raise UsageError(f"{path} names no base model")
    return record


def lora_base(folder: Path) -> str | None:
    """The base model (as load_model takes it) of a folder holding a LoRA adapter; None for any
    other folder (a full model folder loads as it is)."""
    record = draft_record(folder)
    if record is None or record.get("adapter") != "lora":
        return None
    if not (Path(folder) / ADAPTER_CONFIG).is_file():
        raise UsageError(f"{folder} says it holds a LoRA adapter but has no {ADAPTER_CONFIG}")
    return record["base"]


def merge_lora(model, folder: Path):
    """`model` (a transformers causal LM in fp32, the adapter's base) with the adapter in `folder`
    merged into its linear weights; returns the plain transformers model."""
    from peft import PeftModel

    try:
        with warnings.catch_warnings():  # peft asks transformers a deprecated question; nothing for the user
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            merged = PeftModel.from_pretrained(model, str(folder), is_trainable=False).merge_and_unload()
    except (ValueError, KeyError, RuntimeError, OSError) as exc:
        text = str(exc).strip().splitlines()
        raise UsageError(f"cannot merge the adapter in {folder}: {text[0] if text else type(exc).__name__}") from exc
    return merged


def register(folder: Path, record: dict) -> None:
    """Remember a distilled draft's folder for `speclm models list`."""
    path = home() / REGISTRY
    entries = registered_raw()
    entries[str(Path(folder).resolve())] = record
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(entries, indent=1) + "\n")


def registered_raw() -> dict:
    path = home() / REGISTRY
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def registered() -> dict[Path, dict]:
    """The distilled drafts still on disk: folder -> record."""
    out = {}
    for folder, record in registered_raw().items():
        path = Path(folder)
        if (path / DRAFT_FILE).is_file() and isinstance(record, dict):
            out[path] = record
    return out
