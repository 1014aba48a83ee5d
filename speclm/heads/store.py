"""A file of trained heads: safetensors with int8 linear weights, and a manifest beside it.

`NAME.safetensors` holds every linear weight as int8 per output channel with its fp32 scales
(`W.q`, `W.scale`: a quarter of fp32's bytes; the heads run on int8 kernels anyway), the other
tensors (norms, biases) in fp32, and the restricted vocabulary `vocab_ids`; its metadata holds the
HeadsConfig. `NAME.json` is the manifest: the config, how it was trained (command, steps, time,
the data's sha256, validation metrics) and the safetensors file's sha256. Heads ship for the
default target in speclm/data/heads/<target>/, so a fresh clone drafts with them at once.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from speclm.files import atomic_write
from speclm.errors import UsageError
from speclm.models.store import file_sha256
from speclm.heads.modules import HeadsConfig, make
from speclm.quant.weights import int8_per_channel

FORMAT = "speclm-heads-1"
SHIPPED = Path(__file__).resolve().parent.parent / "data" / "heads"


def export(path, model: nn.Module, config: HeadsConfig, vocab_ids: torch.Tensor, info: dict | None = None) -> dict:
    """Write model's weights to `path` (.safetensors) and its manifest beside it (.json); returns
    the manifest."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    linear = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    tensors = {"vocab_ids": vocab_ids.to(torch.int64).contiguous()}
    for name, value in model.state_dict().items():
        value = value.detach().float().cpu()
        if name in linear:
            q, scale = int8_per_channel(value)
            tensors[f"{name}.q"], tensors[f"{name}.scale"] = q.contiguous(), scale.contiguous()
        else:
            tensors[name] = value.contiguous()
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    save_file(tensors, str(tmp), metadata={"format": FORMAT, "config": json.dumps(config.to_dict())})
    os.replace(tmp, path)
    manifest = {"format": FORMAT, "file": path.name, "sha256": file_sha256(path), "bytes": path.stat().st_size,
                "config": config.to_dict(), **(info or {})}
    atomic_write(path.with_suffix(".json"), json.dumps(manifest, indent=1) + "\n")
    return manifest


def load(path, target=None) -> tuple[nn.Module, HeadsConfig, torch.Tensor]:
    """The heads in `path` (eval mode, fp32 weights de-quantized from the file's int8), their
    config and vocabulary. With a LoadedModel `target`: UsageError unless they fit it."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise UsageError(f"heads file not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise UsageError(f"{path} is not a speclm heads file (format {meta.get('format')!r})")
            config = HeadsConfig.from_dict(json.loads(meta["config"]))
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except UsageError:
        raise
    except Exception as exc:  # safetensors' own error type for a damaged file, OSError, bad JSON
        raise UsageError(f"cannot read heads file {path}: {exc}") from None
    if target is not None:
        check_fits(config, target, str(path))
    with torch.device("meta"):
        model = make(config)  # no weights allocated here: the file's take their places
    state = {}
    for name in model.state_dict():
        if name in tensors:
            state[name] = tensors[name]
        elif f"{name}.q" in tensors:
            state[name] = tensors[f"{name}.q"].float() * tensors[f"{name}.scale"][:, None]
        else:
            raise UsageError(f"heads file {path} lacks {name}")
    model.load_state_dict(state, assign=True)
    return model.eval(), config, tensors["vocab_ids"].long()


def check_fits(config: HeadsConfig, target, where: str) -> None:
    """UsageError unless heads of `config` read this target's features and ids."""
    cfg = getattr(target.model.config, "text_config", None) or target.model.config
    if config.hidden_size != cfg.hidden_size or config.target_vocab_size != target.vocab_size:
        raise UsageError(
            f"heads {where} do not fit target '{target.name}': trained for hidden size {config.hidden_size} and "
            f"{config.target_vocab_size} ids ({config.target or 'unnamed target'}), the target has "
            f"{cfg.hidden_size} and {target.vocab_size}")
    if config.fuse_layers and max(config.fuse_layers) >= cfg.num_hidden_layers:
        raise UsageError(f"heads {where} read layer {max(config.fuse_layers)} of their target; '{target.name}' has "
                         f"{cfg.num_hidden_layers} layers")


def shipped(target_name: str, kind: str) -> Path | None:
    """The heads shipped for a catalog target, if any."""
    path = SHIPPED / target_name / f"{kind}.safetensors"
    return path if path.is_file() else None
