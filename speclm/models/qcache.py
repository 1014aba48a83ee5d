"""The quantized-weights cache: a quantized model written once, in the layout speclm's compiled
kernels read, so that a later load reads about the quantized size and quantizes nothing.

One safetensors file per (source weights, quantization mode, layout version) under
`$SPECLM_HOME/quantized/`. The key hashes the source folder's path and its weights files' sizes and
modification times, so a changed or replaced checkpoint gets a new file; a file from another layout
version is never read. It is written to a temporary name and renamed under the model's lock, so a
reader sees a complete file or none; `speclm models rm` removes a model's files with it.

Its tensors: each quantized layer's `state()` (speclm.quant.weights), the parameters left in fp32 (norms),
and the embedding table in its compact form (speclm.forward.embedding); its metadata says which module
each belongs to, and which sibling projections share one fused layer.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from torch import nn

from speclm.forward.embedding import PackedEmbedding
from speclm.quant.gguf import GGUFLinear
from speclm.quant.weights import INT4_GROUP, Int4Linear, Int8Linear, Int8Slice, QuantLinear, _Fused, mark_quantized

# Bump when a stored tensor's layout or meaning changes: older files are then ignored, not misread.
LAYOUT_VERSION = 1
_KINDS = {"int8": Int8Linear, "int4": Int4Linear, "gguf": GGUFLinear}


def cache_dir() -> Path:
    from speclm.models.store import model_home

    return model_home() / "quantized"


def cache_path(folder: Path, mode: str) -> Path:
    """The cache file for the weights in `folder` quantized as `mode`."""
    folder = folder.resolve()
    files = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".gguf", ".bin"))
    stamp = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    key = json.dumps([LAYOUT_VERSION, mode, INT4_GROUP, str(folder), stamp])
    return cache_dir() / f"{folder.name}-{mode}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.safetensors"


def files_for(folder: Path, mode: str | None = None) -> list[Path]:
    """The cache files made from `folder` (of `mode`, or any), whatever their stamp: the name says
    the folder's name, the metadata its full path."""
    root, source = cache_dir(), str(folder.resolve())
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob(f"{folder.name}-{mode or '*'}-*.safetensors")
                  if _metadata(p).get("source") == source)


def _metadata(path: Path) -> dict:
    try:
        with _Reader(path) as f:
            return json.loads(f.metadata.get("speclm", "{}"))
    except Exception:  # damaged or foreign: not ours to judge here
        return {}


def _kind(layer: QuantLinear) -> str:
    return next(kind for kind, cls in _KINDS.items() if isinstance(layer, cls))


def save(model: nn.Module, mode: str, path: Path, folder: Path) -> None:
    """Write `model`, quantized as `mode` from the weights in `folder`, to `path` (atomically: a
    temporary file renamed), and remove the files of that folder and mode that an older checkpoint
    there made."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    layers, embedding = [], None
    fused: dict[int, dict] = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            entry = {"kind": _kind(module), "in": module.in_features, "out": module.out_features, "path": name}
        elif isinstance(module, Int8Slice):
            key = id(module.fused)
            if key in fused:
                fused[key]["slices"].append([name, module.start, module.stop])
                continue
            kernel = module.fused.kernel
            entry = fused[key] = {"kind": _kind(kernel), "in": kernel.in_features, "out": kernel.out_features,
                                  "slices": [[name, module.start, module.stop]]}
            module = kernel
        elif isinstance(module, PackedEmbedding):
            embedding = {"path": name, "kind": module.kind, "dim": module.embedding_dim}
            tensors["embedding"] = module.data
            continue
        else:
            continue
        for field, tensor in module.state().items():
            tensors[f"q{len(layers)}.{field}"] = tensor
        layers.append(entry)
    for name, param in model.named_parameters():
        tensors[f"p.{name}"] = param.detach()
    meta = {"version": LAYOUT_VERSION, "mode": mode, "source": str(folder.resolve()), "layers": layers,
            "embedding": embedding}
    stale = [p for p in files_for(folder, mode) if p != path]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"speclm": json.dumps(meta)})
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    for old in stale:
        old.unlink(missing_ok=True)


def load(model: nn.Module, path: Path, mode: str) -> nn.Module | None:
    """Fill skeleton `model` (speclm.models.weights.skeleton) from the cache file; None if the file
    is of another version or mode (then it is made anew)."""
    from speclm.models.weights import set_tensor

    with _Reader(path) as f:
        meta = json.loads(f.metadata.get("speclm", "{}"))
        if meta.get("version") != LAYOUT_VERSION or meta.get("mode") != mode:
            return None
        for i, entry in enumerate(meta["layers"]):
            prefix = f"q{i}."
            state = {k[len(prefix):]: f.get(k) for k in f.keys() if k.startswith(prefix)}
            layer = _KINDS[entry["kind"]].from_state(state, entry["in"], entry["out"])
            if "slices" in entry:
                shared = _Fused(layer)
                for name, start, stop in entry["slices"]:
                    model.set_submodule(name, Int8Slice(shared, start, stop))
            else:
                model.set_submodule(entry["path"], layer)
        if meta["embedding"] is not None:
            e = meta["embedding"]
            packed = PackedEmbedding(f.get("embedding"), e["kind"], e["dim"])
            model.set_submodule(e["path"], packed.scaled_as(model.get_submodule(e["path"])))  # Gemma's embed_scale
        for key in f.keys():
            if key.startswith("p."):
                set_tensor(model, key[2:], f.get(key))
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise ValueError(f"{path} lacks {', '.join(left[:3])}")
    mark_quantized(model, mode)
    return model


_DTYPES = {"I8": torch.int8, "U8": torch.uint8, "I32": torch.int32, "I64": torch.int64, "F16": torch.float16,
           "BF16": torch.bfloat16, "F32": torch.float32}


class _Reader:
    """A safetensors file read with plain reads into each tensor's own memory: no mapping, so a
    load's peak is the tensors themselves (a mapped file's touched pages would count beside their
    copies). The format: an 8-byte little-endian header size, a JSON header, the data."""

    def __init__(self, path: Path):
        self.file = path.open("rb")
        size = int.from_bytes(self.file.read(8), "little")
        header = json.loads(self.file.read(size))
        self.metadata = header.pop("__metadata__", None) or {}
        self.header, self.base = header, 8 + size

    def keys(self) -> list[str]:
        return list(self.header)

    def get(self, key: str) -> torch.Tensor:
        info = self.header[key]
        begin, end = info["data_offsets"]
        out = torch.empty(info["shape"], dtype=_DTYPES[info["dtype"]])
        view = memoryview(out.view(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
        if len(view) != end - begin:
            raise ValueError(f"{key}: {end - begin} bytes for shape {info['shape']}")
        self.file.seek(self.base + begin)
        if self.file.readinto(view) != len(view):
            raise ValueError(f"{key}: the file ends early")
        return out

    def __enter__(self) -> "_Reader":
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()
