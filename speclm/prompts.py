"""Reading prompts: JSON lines with a "prompt" string, or Spec-Bench lines (first of "turns")."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from speclm.errors import UsageError


def read_prompt_file(path: str | Path) -> list[str]:
    path = Path(path)
    prompts = [prompt_of(record, f"{path}:{n}") for n, record in read_json_lines(path, "prompt file")]
    if not prompts:
        raise UsageError(f"prompt file {path} holds no prompts")
    return prompts


def read_json_lines(path: Path, what: str) -> list[tuple[int, object]]:
    """(line number, parsed JSON value) for every non-blank line of a UTF-8 file; a file that
    cannot be read, is not UTF-8 or holds a line that is not JSON is a UsageError naming the line."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read {what} {path}: {exc.strerror or exc}") from exc
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise UsageError(f"{path}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x}); save the file as UTF-8") from exc
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                records.append((n, json.loads(line)))
            except json.JSONDecodeError as exc:
                raise UsageError(f"{path}:{n}: not JSON ({exc.msg} at column {exc.colno})") from exc
    return records


def prompt_of(record, where: str) -> str:
    """The prompt of one parsed JSON line: its "prompt" string, else the first of its "turns"."""
    if isinstance(record, dict) and isinstance(record.get("prompt"), str):
        return record["prompt"]
    if isinstance(record, dict) and "turns" in record:
        turns = record["turns"]
        if isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns):
            return turns[0]
        raise UsageError(f'{where}: "turns" must be a non-empty list of strings, got {_shape(turns)}')
    raise UsageError(f'{where}: expected an object with a "prompt" string or a "turns" list')


def _shape(value) -> str:
    if isinstance(value, list):
        kinds = sorted({type(v).__name__ for v in value})
        return f"a list of {', '.join(kinds)}" if value else "an empty list"
    return f"a {type(value).__name__}"


def spec_bench() -> list[dict]:
    """The Spec-Bench question set shipped with the package (480 records, 13 categories)."""
    text = resources.files("speclm").joinpath("data/spec_bench/question.jsonl").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]
