"""Load a model by catalog name, Hugging Face hub id, local model folder or `.gguf` file."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from speclm.catalog import CATALOG
from speclm.errors import PullError, UsageError
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
        try:
            config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise UsageError(f"'{name}' is not a model folder: cannot read its config.json ({exc})") from exc
        check_causal_lm(config, name)
    elif name.count("/") != 1 or name.startswith((".", "/")):
        raise UsageError(
            f"unknown model '{name}': not a catalog name ({', '.join(CATALOG)}), hub id, model folder or .gguf file"
        )


def check_causal_lm(config: dict, name: str) -> None:
    """speclm decodes with causal language models only: a config whose architectures (else its
    model_type) name no causal LM class of transformers, such as a BERT encoder
    (BertForMaskedLM: transformers would build a BertLMHeadModel from it), is a UsageError."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if not isinstance(config, dict):
        raise UsageError(f"'{name}' is not a model: its config.json is not a JSON object")
    causal = {c for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() for c in ((v,) if isinstance(v, str) else v)}
    archs = config.get("architectures") or []
    model_type = config.get("model_type")
    if archs and isinstance(archs, list):
        if any(isinstance(a, str) and (a in causal or a.endswith("ForCausalLM")) for a in archs):
            return
        raise UsageError(f"'{name}' is not a causal language model (architectures: {', '.join(map(str, archs))}); "
                         "speclm needs a decoder that predicts the next token")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UsageError(f"'{name}' is not a causal language model (model_type: {model_type}); "
                         "speclm needs a decoder that predicts the next token")


def resolve_model(name: str, *, progress: bool = True) -> str:
    """Map a user-facing model name to something `from_pretrained` accepts (a folder or hub id).

    Catalog names are pulled on first use; a `.gguf` file is converted once into the cache;
    a hub id is passed on, and transformers decides whether it can be had.
    """
    check_model_name(name)
    path = Path(name).expanduser()
    if name in CATALOG:
        folder = store.cached_path(name) or store.pull(name, progress=progress)
    elif path.suffix == ".gguf":
        folder = _converted_gguf(path, progress)
    elif path.exists():
        folder = path
    else:
        return name  # a hub id
    store.check_weights(folder, name)  # a store folder's weights as converted (sizes; `models verify` hashes)
    return str(folder)


def _converted_gguf(path: Path, progress: bool) -> Path:
    stat = path.resolve().stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    final = store.models_dir() / f"gguf-{path.stem}-{key}"
    if store.is_model_folder(final):
        return final

    def build(work: Path) -> Path:
        store.convert_gguf(path, work / "model", progress=progress)
        return work / "model"

    try:
        return store.publish_model_folder(final, f"gguf-{key}", build, {"name": path.name, "source": str(path.resolve())})
    except PullError as exc:  # the user's file does not convert: bad input
        raise UsageError(str(exc)) from exc


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
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    source = resolve_model(name, progress=progress)
    torch_dtype = getattr(torch, dtype)
    hf_logging.disable_progress_bar()  # a cached safetensors folder loads in seconds
    try:
        # the config first (a hub id's too): no weights are read for a model that is not a causal LM
        check_causal_lm(AutoConfig.from_pretrained(source).to_dict(), name)
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, attn_implementation="sdpa")
    except UsageError:
        raise
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError, TypeError... for what it cannot load
        text = str(exc).strip()
        first = text.splitlines()[0] if text else type(exc).__name__
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
