"""Benchmark prompts: the Spec-Bench set shipped with speclm, or a JSON-lines file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from speclm.errors import UsageError
from speclm.prompts import prompt_of, read_json_lines, spec_bench

# Spec-Bench's six task kinds; its 80 MT-bench questions (8 sub-categories) form one kind.
SPEC_BENCH_KINDS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")


@dataclass(frozen=True)
class BenchPrompt:
    prompt_id: str
    category: str
    text: str


def load_prompts(dataset: str, categories: list[str] | None, per_category: int | None) -> list[BenchPrompt]:
    """per_category: N evenly spaced prompts of each category; None: all of them."""
    if per_category is not None and per_category < 1:
        raise UsageError(f"per-category must be >= 1, got {per_category} (leave it out for every prompt)")
    if dataset == "spec-bench":
        records = [
            BenchPrompt(str(r["question_id"]), "mt_bench" if 81 <= r["question_id"] <= 160 else r["category"], r["turns"][0])
            for r in spec_bench()
        ]
    else:
        path = Path(dataset)
        if not path.is_file():
            raise UsageError(f"dataset must be 'spec-bench' or a JSON-lines file; not found: {dataset}")
        records = []
        for n, raw in read_json_lines(path, "dataset"):
            cat = str(raw.get("category", "default")) if isinstance(raw, dict) else "default"
            pid = str(raw.get("question_id", raw.get("id", n))) if isinstance(raw, dict) else str(n)
            records.append(BenchPrompt(pid, cat, prompt_of(raw, f"{path}:{n}")))
        if not records:
            raise UsageError(f"dataset {path} holds no prompts")
    known = list(dict.fromkeys(r.category for r in records))
    wanted = categories or known
    unknown = [c for c in wanted if c not in known]
    if unknown:
        raise UsageError(f"unknown categories {', '.join(unknown)} (this dataset has {', '.join(known)})")
    chosen: list[BenchPrompt] = []
    for cat in wanted:
        pool = [r for r in records if r.category == cat]
        n = len(pool) if per_category is None else min(per_category, len(pool))
        # evenly spaced, so a few MT-bench prompts span its sub-categories
        chosen += [pool[(i * len(pool)) // n] for i in range(n)]
    if not chosen:
        raise UsageError("no prompts selected")
    return chosen
