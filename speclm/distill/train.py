"""Training the draft against the target's distributions (DistillSpec's objective).

Each batch holds whole sequences of the data folders (speclm.distill.data): a prompt and a
response (the target's greedy one, or the draft's own sample). At every response position the
target's distribution is its output head over its stored final hidden state (computed per batch,
no gradient); the draft reads the sequence and is trained to match it there, by the mean over
positions of forward KL(target || draft) or of the total-variation distance (`loss`). The
held-out split (a hash of the prompt's id, speclm.heads.train.is_validation) reports both, and two
acceptances: `acc0`, how often the draft's likeliest token is the target's (a greedy round
accepts a drafted token exactly then), and `sampled_acceptance`, 1 - TVD (the chance that a
sampled drafted token is accepted by rejection sampling).

Adapters: "lora" (peft; rank `rank` on every attention and MLP projection, the embeddings and the
output head frozen) or "full" (every weight); "auto" takes full fine-tuning for drafts under
FULL_BELOW parameters and LoRA above. The student's matrix products run in bfloat16 under autocast
where the CPU multiplies it natively (`precision` "auto"), its weights and the loss in fp32.

A run folder (`out`) holds checkpoint/ (the trained weights, the optimizer, state.json: step,
plan, data_sha256), replaced atomically every `save_every` steps; metrics.jsonl; loss.png and
acceptance.png; and, at the end, the draft itself (speclm.models.adapters). A run resumes from
its checkpoint to the weights an uninterrupted run reaches: the data order is a function of the
seed and the step, there is no dropout, and the plan (every argument that changes the weights)
must be the same.
"""

from __future__ import annotations

import json
import math
import shutil
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from speclm.errors import UsageError
from speclm.files import atomic_write
from speclm.heads.train import (CHECKPOINT, Shards, _append, _checkpoint_dir, _factor, _keep_metrics_until,
                                checkpoint_state, replace_checkpoint)

ADAPTERS = ("auto", "lora", "full")
LOSSES = ("kl", "tvd")
PRECISIONS = ("auto", "bf16", "fp32")
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FULL_BELOW = 200_000_000  # adapter "auto": full fine-tuning below this many parameters, LoRA above
DEFAULT_LR = {"lora": 2e-4, "full": 2e-5}
TEACHER_ROWS = 256  # the target's output head runs over this many positions at a time
LOG_EVERY = 5  # training steps per line of metrics.jsonl


def choose_adapter(adapter: str, model) -> str:
    if adapter not in ADAPTERS:
        raise UsageError(f"adapter must be one of {', '.join(ADAPTERS)}, not '{adapter}'")
    if adapter != "auto":
        return adapter
    return "full" if sum(p.numel() for p in model.parameters()) < FULL_BELOW else "lora"


def choose_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise UsageError(f"precision must be one of {', '.join(PRECISIONS)}, not '{precision}'")
    if precision != "auto":
        return precision
    from speclm.quant.kernels import bf16_native

    return "bf16" if bf16_native() else "fp32"


@torch.inference_mode()
def teacher_logprobs(head, features: torch.Tensor) -> torch.Tensor:
    """The target's log-probabilities (N, V) fp32 from its final hidden states features (N, E)."""
    out = [F.log_softmax(head(features[i:i + TEACHER_ROWS]).float(), -1) for i in range(0, len(features), TEACHER_ROWS)]
    return torch.cat(out) if out else features.new_zeros(0, 0)


def divergences(logits: torch.Tensor, teacher: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per position (N,): forward KL(teacher || student), total-variation distance, and whether the
    two argmaxes agree; logits (N, V) the student's, teacher (N, V) the target's log-probabilities."""
    logq = F.log_softmax(logits.float(), -1)
    p = teacher.exp()
    kl = (p * (teacher - logq)).sum(-1)
    tvd = 0.5 * (p - logq.exp()).abs().sum(-1)
    agree = logits.argmax(-1) == teacher.argmax(-1)
    return {"kl": kl, "tvd": tvd, "agree": agree}


class Student:
    """The draft being trained: its transformers model (with peft's LoRA layers, or whole), the
    decoder stack and the output head, so that the head runs at the scored positions only."""

    def __init__(self, model, adapter: str, rank: int, seed: int):
        self.adapter = adapter
        torch.manual_seed(seed)  # LoRA's A matrices start random
        if adapter == "lora":
            from peft import LoraConfig, get_peft_model

            present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
            modules = [m for m in LORA_MODULES if m in present]
            if not modules:
                raise UsageError(f"the draft has none of the projections LoRA adapts ({', '.join(LORA_MODULES)}): "
                                 "use --adapter full")
            config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=modules, bias="none")
            with warnings.catch_warnings():  # peft asks transformers a deprecated question; nothing for the user
                warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
                self.module = get_peft_model(model, config)
            inner = self.module.get_base_model()
        else:
            self.module = model
            inner = model
            for p in model.parameters():
                p.requires_grad_(True)
        self.decoder = inner.model
        self.head = inner.get_output_embeddings()

    def trainable(self) -> dict[str, torch.nn.Parameter]:
        return {n: p for n, p in self.module.named_parameters() if p.requires_grad}

    def logits(self, tokens: torch.Tensor, pad: torch.Tensor, mask: torch.Tensor, precision: str) -> torch.Tensor:
        """The student's logits (N, V) at the masked positions of tokens (B, L)."""
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            hidden = self.decoder(input_ids=tokens, attention_mask=(~pad).long()).last_hidden_state  # (B, L, E)
            return self.head(hidden[mask])


def train(out_dir, target, draft, folders: list[Path], *, adapter: str = "auto", rank: int = 16, loss: str = "kl",
          lr: float | None = None, batch_size: int = 4, steps: int | None = None, epochs: float | None = None,
          minutes: float | None = None, warmup: int = 10, eval_every: int = 50, save_every: int = 50,
          seed: int = 0, valid_fraction: float = 0.1, precision: str = "auto", resume: bool = True,
          progress: bool = True, on_step=None) -> dict:
    """Train `draft` (a LoadedModel in fp32, trained in place) on `folders` with `target`'s
    distributions (a LoadedModel, any quantization: its output head is the teacher's); write the
    run folder (the module's docstring) and return a summary with the Student. Stops at `steps`,
    after `epochs` passes, or after `minutes` of wall time, whichever first. on_step(step): a hook
    called after each optimizer step (tests interrupt runs with it)."""
    from safetensors.torch import load_file, save_file
    from tqdm.auto import tqdm

    from speclm.heads.plots import plot_run

    started = time.monotonic()
    if steps is None and epochs is None and minutes is None:
        raise UsageError("give a budget: --steps, --epochs or --minutes")
    for name, value, low in (("rank", rank, 1), ("batch-size", batch_size, 1), ("eval-every", eval_every, 1),
                             ("save-every", save_every, 1), ("warmup", warmup, 0)):
        if value < low:
            raise UsageError(f"{name} must be >= {low}, got {value}")
    if steps is not None and steps < 1 or epochs is not None and epochs <= 0 or minutes is not None and minutes < 0:
        raise UsageError("steps and epochs must be positive, minutes not negative")
    if loss not in LOSSES:
        raise UsageError(f"loss must be one of {', '.join(LOSSES)}, not '{loss}'")
    if not 0 < valid_fraction < 1:
        raise UsageError(f"valid-fraction must be in (0, 1), got {valid_fraction}")
    adapter = choose_adapter(adapter, draft.model)
    precision = choose_precision(precision)
    lr = DEFAULT_LR[adapter] if lr is None else lr
    manifests = [json.loads((f / "manifest.json").read_text(encoding="utf-8")) for f in folders]
    longest = max(int(m["max_prompt_tokens"]) + int(m["max_new_tokens"]) + 1 for m in manifests)
    data = Shards(folders, longest, valid_fraction)  # windows are whole sequences: the draft reads each from its start
    if data.vocab_size != target.vocab_size:
        raise UsageError(f"the data has vocabulary size {data.vocab_size}, the target '{target.name}' {target.vocab_size}")
    per_epoch = data.batches_per_epoch(batch_size)
    if not per_epoch:
        raise UsageError("no training sequences: every one is in the validation split")
    if not data.valid_windows:
        raise UsageError("no validation sequences: add prompts or raise --valid-fraction")
    totals = [t for t in (steps, None if epochs is None else max(1, math.ceil(epochs * per_epoch))) if t is not None]
    total = min(totals) if totals else None
    plan = {"draft": draft.name, "target": target.name, "adapter": adapter, "rank": rank if adapter == "lora" else None,
            "loss": loss, "lr": lr, "batch_size": batch_size, "steps": steps, "epochs": epochs, "warmup": warmup,
            "seed": seed, "valid_fraction": valid_fraction, "precision": precision}

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    metrics_path = out / "metrics.jsonl"
    checkpoint = _checkpoint_dir(out) if resume else None
    state = None if checkpoint is None else checkpoint_state(checkpoint, out, plan, data.data_sha256)
    if state is None:  # a fresh run: nothing of an earlier one stays
        for name in (CHECKPOINT, CHECKPOINT + ".old", CHECKPOINT + ".tmp"):
            shutil.rmtree(out / name, ignore_errors=True)
        metrics_path.unlink(missing_ok=True)

    student = Student(draft.model, adapter, rank, seed)
    student.module.train()
    params = student.trainable()
    optimizer = torch.optim.AdamW(list(params.values()), lr=lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda tick: _factor(tick, warmup, total))
    step, seconds_before, last_eval = 0, 0.0, {}
    if state is not None:
        weights = load_file(str(checkpoint / "trainable.safetensors"))
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(weights[name])
        saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        step, seconds_before, last_eval = int(state["step"]), float(state["seconds"]), state.get("validation") or {}
        _keep_metrics_until(metrics_path, step)
    head = target.model.get_output_embeddings()

    def seconds() -> float:
        return seconds_before + time.monotonic() - started

    def scored(windows) -> tuple[dict, int]:
        batch = data.collate(windows)
        mask = batch["mask"]
        return {"tokens": batch["tokens"], "pad": batch["pad"], "mask": mask,
                "teacher": teacher_logprobs(head, batch["features"][mask])}, int(mask.sum())

    def evaluate() -> dict:
        sums = {"kl": 0.0, "tvd": 0.0, "agree": 0.0}
        count = 0
        student.module.eval()
        with torch.no_grad():
            for k in range(0, len(data.valid_windows), batch_size):
                b, n = scored(data.valid_windows[k:k + batch_size])
                d = divergences(student.logits(b["tokens"], b["pad"], b["mask"], precision), b["teacher"])
                for key in sums:
                    sums[key] += float(d[key].float().sum())
                count += n
        student.module.train()
        result = {key: v / max(count, 1) for key, v in sums.items()}
        return {"loss": result[loss], "kl": result["kl"], "tvd": result["tvd"], "acc0": result["agree"],
                "sampled_acceptance": 1 - result["tvd"], "positions": count}

    def validate() -> None:
        nonlocal last_eval
        last_eval = evaluate()
        _append(metrics_path, {"step": step, "split": "validation", "seconds": round(seconds(), 3), **last_eval})
        plot_run(out, acceptance={"acc0": "greedy: argmax agrees (acc0)",
                                  "sampled_acceptance": "sampled: 1 - TVD"})

    def save() -> None:
        tmp = out / (CHECKPOINT + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_file({n: p.detach().contiguous() for n, p in params.items()}, str(tmp / "trainable.safetensors"))
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / "optimizer.pt")
        atomic_write(tmp / "state.json", json.dumps({"step": step, "seconds": seconds(), "plan": plan,
                                                   "data_sha256": data.data_sha256, "validation": last_eval}, indent=1))
        replace_checkpoint(out, tmp)

    if state is None:
        validate()  # step 0: the stock draft's held-out acceptance, the baseline of the plot
    bar = tqdm(total=total, initial=step, unit="step", desc=f"distill ({adapter})", disable=not progress,
               dynamic_ncols=True)
    order_epoch, order = None, []
    window: dict[str, float] = {}
    window_steps = 0
    saved = evaluated = step
    stopped = "steps"
    try:
        while total is None or step < total:
            t0 = time.monotonic()
            epoch, index = divmod(step, per_epoch)
            if epoch != order_epoch:
                order, order_epoch = data.epoch_order(seed, epoch, batch_size), epoch
            b, n = scored(order[index])
            d = divergences(student.logits(b["tokens"], b["pad"], b["mask"], precision), b["teacher"])
            value = d[loss].mean()
            value.backward()
            torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            rate = int((~b["pad"]).sum()) / max(time.monotonic() - t0, 1e-9)  # tokens read per second
            for key, v in (("loss", value.item()), ("kl", d["kl"].mean().item()), ("tvd", d["tvd"].mean().item()),
                           ("acc0", float(d["agree"].float().mean())), ("tokens_per_s", rate)):
                window[key] = window.get(key, 0.0) + v
            window_steps += 1
            bar.update(1)
            bar.set_postfix(loss=f"{value.item():.3f}", tok_s=f"{rate:.0f}")
            if step % LOG_EVERY == 0:
                _append(metrics_path, {"step": step, "split": "train", "seconds": round(seconds(), 3),
                                       "lr": scheduler.get_last_lr()[0], "epoch": step / per_epoch,
                                       **{k: v / window_steps for k, v in window.items()}})
                window, window_steps = {}, 0
            if step % eval_every == 0:
                validate()
                evaluated = step
            if step % save_every == 0:
                save()
                saved = step
            if on_step is not None:
                on_step(step)
            if minutes is not None and time.monotonic() - started >= minutes * 60:
                stopped = "minutes"
                break
        else:
            stopped = "steps" if steps is not None and total == steps else "epochs"
    finally:
        bar.close()
    if evaluated != step:
        validate()
    if saved != step:
        save()
    student.module.eval()
    return {"out_dir": str(out), "adapter": adapter, "precision": precision, "steps": step,
            "epochs": step / per_epoch, "total_steps": total, "stopped": stopped, "seconds": round(seconds(), 1),
            "train_sequences": len(data.sequences(False)), "validation_sequences": len(data.sequences(True)),
            "validation": last_eval, "student": student}
