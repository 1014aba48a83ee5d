"""Benchmark prompts: the Spec-Bench set shipped with speclm, or a JSON-lines file."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from speclm.errors import UsageError
from speclm.prompts import prompt_of, spec_bench

# Spec-Bench's six task kinds; its 80 MT-bench questions (8 sub-categories) form one kind.
SPEC_BENCH_KINDS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")


@dataclass(frozen=True)
class BenchPrompt:
    prompt_id: str
    category: str
    text: str


def load_prompts(dataset: str, categories: list[str] | None, per_category: int | None) -> list[BenchPrompt]:
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
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                raw = json.loads(line)
                cat = str(raw.get("category", "default")) if isinstance(raw, dict) else "default"
                pid = str(raw.get("question_id", raw.get("id", n))) if isinstance(raw, dict) else str(n)
                records.append(BenchPrompt(pid, cat, prompt_of(line, f"{path}:{n}")))
    known = list(dict.fromkeys(r.category for r in records))
    wanted = categories or known
    unknown = [c for c in wanted if c not in known]
    if unknown:
        raise UsageError(f"unknown categories {', '.join(unknown)} (this dataset has {', '.join(known)})")
    chosen: list[BenchPrompt] = []
    for cat in wanted:
        pool = [r for r in records if r.category == cat]
        n = min(per_category or len(pool), len(pool))
        # evenly spaced, so a few MT-bench prompts span its sub-categories
        chosen += [pool[(i * len(pool)) // n] for i in range(n)]
    if not chosen:
        raise UsageError("no prompts selected")
    return chosen
