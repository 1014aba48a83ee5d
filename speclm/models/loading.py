"""Load a model by catalog name, Hugging Face hub id, local model folder or `.gguf` file."""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from speclm.catalog import CATALOG
from speclm.errors import PullError, StoreError, UsageError
from speclm.models import store
from speclm.runtime import release_freed_memory


@dataclass
class LoadedModel:
    name: str  # as the user gave it
    model: object  # a transformers PreTrainedModel (causal LM), in eval mode
    tokenizer: object  # its transformers tokenizer
    eos_token_ids: tuple[int, ...]  # every id that ends generation
    quantize: str = "none"  # none | int8 | int4 (speclm.quant.weights) | gguf (speclm.quant.gguf)

    @property
    def vocab_size(self) -> int:
        head = self.model.get_output_embeddings()
        return int(getattr(head, "out_features", None) or head.weight.shape[0])

    @property
    def max_context(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    @property
    def device(self):
        """Where the model's weights are (torch.device)."""
        return self.model.device


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
        store.convert_gguf(path, work / "model", progress=progress, copy=True)
        return work / "model"

    try:
        return store.publish_model_folder(final, f"gguf-{key}", build, {"name": path.name, "source": str(path.resolve())})
    except PullError as exc:  # the user's file does not convert: bad input
        raise UsageError(str(exc)) from exc


def load_model(name, *, tokenizer=None, dtype: str = "float32", device: str = "cpu", quantize: str = "none",
               progress: bool = True, cache: bool = True) -> LoadedModel:
    """Load model and tokenizer; `name` as in `resolve_model`, or a transformers causal LM already
    loaded (then `tokenizer` is its tokenizer, and the model is used as it is: its dtype, its
    device unless `device` names another; quantize converts its linear layers in place, without
    the cache). quantize="int8" gives every linear layer, output head included, int8 weights
    (speclm.quant.weights); quantize="int4" int4 ones (grouped scales; meant for draft models);
    quantize="gguf" the GGUF file's own quantized blocks (speclm.quant.gguf; a model from a GGUF). A
    quantized model is written once to the quantized-weights cache (speclm.models.qcache;
    `cache=False`: neither read nor written) and later loads read it; the first quantization
    reads the weights one decoder layer at a time (speclm.models.weights), so the fp32 model is
    never held whole."""
    import torch

    from speclm.quant.weights import QUANTIZE_MODES

    if quantize not in QUANTIZE_MODES:
        raise UsageError(f"quantize must be one of {', '.join(QUANTIZE_MODES)}, not '{quantize}'")
    if quantize != "none" and device != "cpu":
        raise UsageError(f"quantize={quantize} is a CPU path (speclm's and oneDNN's int8 kernels); on a GPU use quantize=none")
    if not isinstance(name, (str, Path)):
        return _loaded_objects(name, tokenizer, device, quantize)
    if tokenizer is not None:
        raise UsageError("tokenizer= goes with a loaded model; a model named by a string loads its own")
    name = str(name)
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    folder = _local_folder(name, resolve_model(name, progress=progress))
    torch_dtype = getattr(torch, dtype)
    hf_logging.disable_progress_bar()
    try:
        # the config first: no weights are read for a model that is not a causal LM
        config = AutoConfig.from_pretrained(folder)
        check_causal_lm(config.to_dict(), name)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = _model(folder, config, torch_dtype, quantize, progress, cache)
    except (UsageError, StoreError):
        raise
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError, TypeError... for what it cannot load
        text = str(exc).strip()
        first = text.splitlines()[0] if text else type(exc).__name__
        raise UsageError(f"cannot load model '{name}': {first}") from exc
    finally:
        hf_logging.enable_progress_bar()
    model.to(device).eval()
    try:
        model.generation_config = GenerationConfig.from_pretrained(folder)
    except OSError:
        pass
    eos: set[int] = set()
    eos.update(store._as_list(model.generation_config.eos_token_id))
    eos.update(store._as_list(tokenizer.eos_token_id))
    release_freed_memory()  # what building the model freed (fp32 layers, file reads) goes back to the system
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, eos_token_ids=tuple(sorted(eos)), quantize=quantize)


def _loaded_objects(model, tokenizer, device: str, quantize: str) -> LoadedModel:
    """A transformers model and tokenizer the caller loaded, checked and taken as they are."""
    from speclm.quant.weights import quantize_model

    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "get_output_embeddings") or not callable(getattr(model, "forward", None)):
        raise UsageError(f"load_model takes a model name or a loaded transformers model, not {type(model).__name__}")
    name = getattr(config, "_name_or_path", "") or type(model).__name__
    check_causal_lm(config.to_dict(), name)
    if tokenizer is None or not callable(tokenizer) or not hasattr(tokenizer, "get_vocab"):
        raise UsageError("a loaded model needs its tokenizer: load_model(model, tokenizer=tokenizer)")
    if quantize != "none" and getattr(model, "speclm_quantize", "none") not in ("none", quantize):
        raise UsageError(f"this model is already quantized as {model.speclm_quantize}")
    if quantize != "none" and str(getattr(model, "device", "cpu")) != "cpu":
        raise UsageError(f"quantize={quantize} is a CPU path; this model is on {model.device}")
    model = quantize_model(model, quantize)
    if str(getattr(model, "device", device)) != device:
        model.to(device)
    model.eval()
    eos: set[int] = set()
    generation = getattr(model, "generation_config", None)
    eos.update(store._as_list(getattr(generation, "eos_token_id", None)))
    eos.update(store._as_list(tokenizer.eos_token_id))
    kind = getattr(model, "speclm_quantize", "none")
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, eos_token_ids=tuple(sorted(eos)), quantize=kind)


def _local_folder(name: str, source: str) -> Path:
    """The folder holding the model's files: a hub id's files are fetched (or found in the hub's
    cache) by huggingface_hub, which transformers would call anyway."""
    path = Path(source)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(source, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt",
                                                              "*.jinja", "*.tiktoken"]))
    except Exception as exc:  # offline, unknown repository, gated: huggingface_hub's own errors
        text = str(exc).strip()
        raise UsageError(f"cannot load model '{name}': {text.splitlines()[0] if text else type(exc).__name__}") from exc


def _model(folder: Path, config, dtype, quantize: str, progress: bool, cache: bool):
    """The model with its weights (quantized as asked): from the quantized-weights cache when it
    holds it, else built from the checkpoint (and then cached)."""
    import torch

    from speclm.models import qcache, weights

    if quantize == "none" or not cache:
        return _from_checkpoint(folder, config, dtype, quantize, progress)
    path = qcache.cache_path(folder, quantize)
    with store._model_lock(f"quantized-{path.stem}"):  # one process quantizes; the others then read its file
        if path.is_file():
            try:
                model = qcache.load(weights.skeleton(config, torch.float32), path, quantize)
                if model is not None:
                    return model
            except Exception as exc:  # a damaged file: made anew below
                print(f"speclm: ignoring the quantized-weights cache {path} ({exc}); quantizing again", file=sys.stderr)
        model = _from_checkpoint(folder, config, dtype, quantize, progress)
        try:
            qcache.save(model, quantize, path, folder)
        except Exception as exc:  # a full disk or a read-only cache costs speed, not the load
            print(f"speclm: could not write the quantized-weights cache {path} ({exc}); "
                  "the next load quantizes again", file=sys.stderr)
        return model


def _from_checkpoint(folder: Path, config, dtype, quantize: str, progress: bool):
    import torch

    from speclm.models import adapters, weights
    from speclm.quant.weights import mark_quantized, quantize_linears, quantize_model

    base = adapters.lora_base(folder)
    if base is not None:  # a distilled draft: its base in fp32, the adapter merged, then quantized
        base_folder = _local_folder(base, resolve_model(base, progress=progress))
        model = _from_checkpoint(base_folder, config, torch.float32, "none", progress)
        return quantize_model(adapters.merge_lora(model, folder).to(dtype), quantize)
    _warn_fp32_store(folder)
    if quantize == "gguf" and not (folder / weights.GGUF_FILE).is_file():
        raise UsageError("quantize=gguf computes with a GGUF file's own blocks: load the model from a GGUF "
                         "(a catalog name or a .gguf file), not from other weights")
    skel = weights.skeleton(config, dtype if quantize == "none" else torch.float32)
    source = weights.open_weights(folder, skel)
    if source is None:  # transformers' own loader, then quantize in memory
        from transformers import AutoModelForCausalLM

        if quantize == "gguf":
            raise UsageError("quantize=gguf: speclm cannot read this GGUF's tensors one by one (its architecture "
                             "renames or splits them); use --quantize int8 or int4")
        gguf = {"gguf_file": weights.GGUF_FILE} if (folder / weights.GGUF_FILE).is_file() else {}
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype,
                                                     attn_implementation=weights.attention_implementation(config), **gguf)
        return quantize_model(model, quantize)
    model = weights.build(skel, source, dtype, quantize, lambda tree: quantize_linears(tree, quantize), progress)
    if quantize != "none":
        mark_quantized(model, quantize)
    return model


def _warn_fp32_store(folder: Path) -> None:
    """A catalog model converted by an earlier speclm is a 7 GB fp32 copy: say once how to get the
    compact store."""
    from speclm.models.weights import GGUF_FILE

    if folder.parent == store.models_dir() and folder.name in CATALOG and not (folder / GGUF_FILE).is_file():
        print(f"speclm: '{folder.name}' is cached as de-quantized fp32 safetensors by an earlier speclm; "
              f"`speclm models pull {folder.name} --force` keeps its GGUF instead (a fraction of the disk and "
              "memory)", file=sys.stderr)
