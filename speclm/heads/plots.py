"""Plots of a heads training run (speclm.heads.train): from its metrics.jsonl, loss.png (training
and validation loss by step) and acceptance.png (validation top-1 accuracy of each position
ahead, one line per Medusa head or EAGLE's one step, by step).

matplotlib's object-oriented API on the Agg canvas: no display, and no pyplot state shared with
whatever else runs in the process.
"""

from __future__ import annotations

import json
import re
from pathlib import Path


def read_metrics(path) -> list[dict]:
    """The records of a metrics.jsonl (a line that does not parse, from a run killed while
    writing it, is skipped)."""
    records = []
    path = Path(path)
    if not path.is_file():
        return records
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "step" in record:
            records.append(record)
    return records


def _figure():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot(1, 1, 1)


def _save(fig, path: Path) -> None:
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.tight_layout()
    fig.savefig(tmp)
    tmp.replace(path)


def plot_run(out_dir, acceptance: dict[str, str] | None = None) -> tuple[Path, Path]:
    """Write out_dir/loss.png and out_dir/acceptance.png from out_dir/metrics.jsonl; returns their
    paths. acceptance: the validation metrics to draw there, key -> label (default: every acc{i},
    the heads' top-1 accuracy i + 1 tokens ahead)."""
    out = Path(out_dir)
    records = read_metrics(out / "metrics.jsonl")
    train = [r for r in records if r.get("split") == "train" and "loss" in r]
    valid = [r for r in records if r.get("split") == "validation"]

    fig, ax = _figure()
    if train:
        ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train", color="tab:blue", alpha=0.8)
    vl = [r for r in valid if "loss" in r]
    if vl:
        ax.plot([r["step"] for r in vl], [r["loss"] for r in vl], "o-", label="validation", color="tab:orange")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("loss")
    ax.grid(alpha=0.3)
    if train or vl:
        ax.legend()
    loss_path = out / "loss.png"
    _save(fig, loss_path)

    fig, ax = _figure()
    if acceptance is None:
        positions = sorted({int(m.group(1)) for r in valid for k in r if (m := re.fullmatch(r"acc(\d+)", k))})
        acceptance = {f"acc{i}": f"token t+{i + 1} (acc{i})" for i in positions}
        ax.set_ylabel("validation top-1 accuracy")
        ax.set_title("validation accuracy by position ahead")
    else:
        ax.set_ylabel("validation acceptance")
        ax.set_title("held-out acceptance")
    for key, label in acceptance.items():
        points = [(r["step"], r[key]) for r in valid if key in r]
        ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label=label)
    ax.set_xlabel("step")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    if acceptance:
        ax.legend()
    acceptance_path = out / "acceptance.png"
    _save(fig, acceptance_path)
    return loss_path, acceptance_path
