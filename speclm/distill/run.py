"""`distill`: prompts -> data (target greedy, draft samples) -> training -> the draft folder.

The output folder is a run folder and a draft at once: data/ (speclm.distill.data), checkpoint/,
metrics.jsonl, loss.png, acceptance.png (speclm.distill.train), and the draft's files at its top
(speclm.models.adapters): a LoRA run's adapter with its base's config and tokenizer, or a full
run's whole model, and speclm-draft.json naming the base and the target. The same command again
continues an interrupted run (data shards and the training checkpoint are kept).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from speclm.errors import UsageError
from speclm.files import atomic_write
from speclm.models import adapters

OWN = ("data", "checkpoint", "checkpoint.old", "checkpoint.tmp", "metrics.jsonl", "loss.png", "acceptance.png",
       adapters.DRAFT_FILE)  # what tells a run folder


def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not any((out / name).exists() for name in OWN):
        raise UsageError(f"--out {out} is a folder that holds other files, not a distillation run; choose a new one")


def _base_name(name: str) -> str:
    """The draft's name as a later load needs it from anywhere: a folder or file by its absolute path."""
    path = Path(name).expanduser()
    return str(path.resolve()) if path.exists() else name


def export(out: Path, student, target_name: str, draft, summary: dict, command: list[str] | None) -> dict:
    """Write the trained draft into `out` (the module's docstring) and register it; returns its record."""
    record = {"base": _base_name(draft.name), "target": target_name, "adapter": student.adapter,
              "steps": summary["steps"], "validation": {k: v for k, v in summary["validation"].items()},
              "command": command}
    draft.tokenizer.save_pretrained(str(out))
    if student.adapter == "lora":
        student.module.save_pretrained(str(out))
        (out / "README.md").unlink(missing_ok=True)  # peft's model-card template, empty of facts
        inner = student.module.get_base_model()
        inner.config.save_pretrained(str(out))
        if getattr(inner, "generation_config", None) is not None:
            inner.generation_config.save_pretrained(str(out))
    else:
        student.module.save_pretrained(str(out), safe_serialization=True)
    atomic_write(out / adapters.DRAFT_FILE, json.dumps(record, indent=1) + "\n")
    adapters.register(out, record)
    return record


def distill(target: str, draft: str, prompt_spec: str, out, *, max_prompts: int = 200, max_new_tokens: int = 128,
            max_prompt_tokens: int = 1024, samples: str = "both", quantize: str = "int8",
            gen_batch_size: int = 8, shard_size: int = 32, seed: int = 0, progress: bool = True,
            command: list[str] | None = None, **training) -> dict:
    """The whole run (the module's docstring); `training`: speclm.distill.train.train's options.
    Returns a summary (JSON-able)."""
    from speclm.distill import data
    from speclm.distill.train import train
    from speclm.models.loading import check_model_name, load_model
    from speclm.runtime import weights_for

    started = time.monotonic()
    out = Path(out)
    folders = data.data_folders(out, samples)  # checks `samples`
    for name, value in (("max-prompts", max_prompts), ("max-new-tokens", max_new_tokens),
                        ("max-prompt-tokens", max_prompt_tokens), ("batch-size", gen_batch_size),
                        ("shard-size", shard_size)):
        if not isinstance(value, int) or value < 1:
            raise UsageError(f"{name} must be an integer >= 1, got {value!r}")
    check_model_name(target)
    check_model_name(draft)
    _check_out(out)
    candidates = data.prompts(prompt_spec, seed)  # a file's bad or evaluation lines fail here, before any load

    quantize, draft_quantize = weights_for(quantize, None)
    teacher = load_model(target, quantize=quantize, progress=progress)
    sampler = load_model(draft, quantize=draft_quantize, progress=progress)
    data.check_pair(teacher, sampler)
    _say(progress, f"data: the target's greedy responses to up to {max_prompts} prompts")
    manifest = data.build_target(teacher, out, candidates, prompts_wanted=max_prompts, max_new_tokens=max_new_tokens,
                                 max_prompt_tokens=max_prompt_tokens, batch_size=gen_batch_size,
                                 shard_size=shard_size, seed=seed, progress=progress)
    if out / data.DRAFT_DATA in folders:
        _say(progress, "data: the draft's own samples, scored by the target")
        data.build_draft(teacher, sampler, out, max_new_tokens=max_new_tokens, batch_size=gen_batch_size,
                         shard_size=shard_size, seed=seed, progress=progress)
    del sampler
    student = load_model(draft, quantize="none", progress=progress)
    _say(progress, "training")
    summary = train(out, teacher, student, folders, seed=seed, progress=progress, **training)
    trained = summary.pop("student")
    export(out, trained, teacher.name, student, summary, command)
    return {**summary, "draft": str(out), "prompts": manifest["prompts"],
            "excluded_eval_overlap": manifest["excluded_eval_overlap"],
            "skipped_long_prompts": manifest["skipped_long_prompts"], "total_seconds": round(time.monotonic() - started, 1)}


def _say(progress: bool, text: str) -> None:
    if progress:
        print(f"speclm: {text}", file=sys.stderr)
