"""Load a model by catalog name, Hugging Face hub id, local model folder or `.gguf` file."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from speclm.catalog import CATALOG
from speclm.errors import UsageError
from speclm.models import store


@dataclass
class LoadedModel:
    name: str  # as the user gave it
    model: object  # a transformers PreTrainedModel (causal LM), in eval mode
    tokenizer: object  # its transformers tokenizer
    eos_token_ids: tuple[int, ...]  # every id that ends generation
    quantize: str = "none"  # none | int8 | int4 (speclm.quant)

    @property
    def vocab_size(self) -> int:
        head = self.model.get_output_embeddings()
        return int(getattr(head, "out_features", None) or head.weight.shape[0])

    @property
    def max_context(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)


def check_model_name(name: str) -> None:
    """Raise UsageError if `name` cannot name a model; no download, conversion or loading."""
    if name in CATALOG:
        return
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise UsageError(f"model file not found: {name}")
    elif path.exists():
        if not (path / "config.json").is_file():
            raise UsageError(f"'{name}' is not a model folder (no config.json)")
    elif name.count("/") != 1 or name.startswith((".", "/")):
        raise UsageError(
            f"unknown model '{name}': not a catalog name ({', '.join(CATALOG)}), hub id, model folder or .gguf file"
        )


def resolve_model(name: str, *, progress: bool = True) -> str:
    """Map a user-facing model name to something `from_pretrained` accepts (a folder or hub id).

    Catalog names are pulled on first use; a `.gguf` file is converted once into the cache;
    a hub id is passed on, and transformers decides whether it can be had.
    """
    check_model_name(name)
    if name in CATALOG:
        return str(store.cached_path(name) or store.pull(name, progress=progress))
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        return str(_converted_gguf(path, progress))
    return str(path) if path.exists() else name


def _converted_gguf(path: Path, progress: bool) -> Path:
    stat = path.resolve().stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    final = store.models_dir() / f"gguf-{path.stem}-{key}"
    if store.is_model_folder(final):
        return final

    def build(work: Path) -> Path:
        store.convert_gguf(path, work / "model", progress=progress)
        return work / "model"

    return store.publish_model_folder(final, f"gguf-{key}", build, {"name": path.name, "source": str(path.resolve())})


def load_model(name: str, *, dtype: str = "float32", device: str = "cpu", quantize: str = "none",
               progress: bool = True) -> LoadedModel:
    """Load model and tokenizer; `name` as in `resolve_model`. quantize="int8" gives every
    linear layer, output head included, int8 weights (speclm.quant; done here, in seconds);
    quantize="int4" int4 ones (grouped scales; meant for draft models)."""
    import torch

    from speclm.quant import QUANTIZE_MODES, quantize_model

    if quantize not in QUANTIZE_MODES:
        raise UsageError(f"quantize must be one of {', '.join(QUANTIZE_MODES)}, not '{quantize}'")
    if quantize != "none" and device != "cpu":
        raise UsageError(f"quantize={quantize} is a CPU path (speclm's and oneDNN's int8 kernels); on a GPU use quantize=none")
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    source = resolve_model(name, progress=progress)
    torch_dtype = getattr(torch, dtype)
    hf_logging.disable_progress_bar()  # a cached safetensors folder loads in seconds
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, attn_implementation="sdpa")
    except OSError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"cannot load model '{name}': {first}") from exc
    finally:
        hf_logging.enable_progress_bar()
    model.to(device).eval()
    quantize_model(model, quantize)
    eos: set[int] = set()
    try:
        gen = GenerationConfig.from_pretrained(source)
        eos.update(store._as_list(gen.eos_token_id))
    except OSError:
        pass
    eos.update(store._as_list(model.generation_config.eos_token_id))
    eos.update(store._as_list(tokenizer.eos_token_id))
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, eos_token_ids=tuple(sorted(eos)), quantize=quantize)
