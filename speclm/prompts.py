"""Reading prompts: JSON lines with a "prompt" string, or Spec-Bench lines (first of "turns")."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from speclm.errors import UsageError


def read_prompt_file(path: str | Path) -> list[str]:
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise UsageError(f"cannot read prompt file {path}: {exc.strerror or exc}") from exc
    prompts = [prompt_of(line, f"{path}:{n}") for n, line in enumerate(lines, 1) if line.strip()]
    if not prompts:
        raise UsageError(f"prompt file {path} holds no prompts")
    return prompts


def prompt_of(line: str, where: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{where}: not JSON ({exc.msg})") from exc
    if isinstance(record, dict) and isinstance(record.get("prompt"), str):
        return record["prompt"]
    if isinstance(record, dict) and record.get("turns") and isinstance(record["turns"][0], str):
        return record["turns"][0]
    raise UsageError(f'{where}: expected an object with a "prompt" string or a "turns" list')


def spec_bench() -> list[dict]:
    """The Spec-Bench question set shipped with the package (480 records, 13 categories)."""
    text = resources.files("speclm").joinpath("data/spec_bench/question.jsonl").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]
