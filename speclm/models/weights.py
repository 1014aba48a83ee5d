"""Build a model from its weights file one tensor at a time: a GGUF file (de-quantized tensor by
tensor) or a safetensors folder.

transformers' `from_pretrained` materialises the whole model in the requested dtype, and its GGUF
loader de-quantizes every tensor before the first is used: the fp32 1.5B is 7 GB in memory, plus
the mapped file. speclm only needs that to quantize it. Here the model's modules are made without
weights (accelerate's `init_empty_weights`: parameters on the meta device, buffers such as the
rotary frequencies real), and each decoder layer's weights are read, quantized and dropped before
the next layer's are read; the embedding table stays in its file's compact form
(speclm.forward.embedding). The tensors are copies: no file stays mapped once the model is built.

The values are the ones `from_pretrained` gives: the same gguf de-quantization and transformers'
own GGUF name map and tensor processors (tests/test_weights.py compares every tensor bit for bit).
A source this path does not cover (a GGUF architecture whose processor renames or splits tensors,
a checkpoint whose names need transformers' renaming) returns None from `open_weights`, and the
caller uses `from_pretrained`.
"""

from __future__ import annotations

import gc
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn

from speclm.forward.embedding import PackedEmbedding

GGUF_FILE = "model.gguf"  # the name a store folder gives its GGUF


class GGUFWeights:
    """A GGUF file's tensors under the Hugging Face names of `model`'s parameters."""

    def __init__(self, path: Path, model: nn.Module):
        from gguf import GGUFReader
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS, Gemma2TensorProcessor, LlamaTensorProcessor, TensorProcessor, get_gguf_hf_weights_map,
            read_field)

        indexed = read_index(path)
        if indexed is not None:  # the store's index: no parsing of the file's metadata
            arch, tensors = indexed
            self.reader = None
        else:
            self.reader = GGUFReader(str(path))  # maps the file; `close` drops every reference to the map
            arch, tensors = read_field(self.reader, "general.architecture")[0], self.reader.tensors
        processor_class = TENSOR_PROCESSORS.get(arch, TensorProcessor)
        # these keep a tensor's name and shape (llama's only un-permutes q and k, Gemma's takes 1 from
        # the norms' weights): one tensor in, one out
        self.streamable = processor_class in (TensorProcessor, LlamaTensorProcessor, Gemma2TensorProcessor)
        self.processor = processor_class(config=model.config.to_dict())
        self.gguf_to_hf = get_gguf_hf_weights_map(model, self.processor)
        self.tensors = {self.gguf_to_hf[t.name]: t for t in tensors if t.name in self.gguf_to_hf}

    def names(self) -> set[str]:
        return set(self.tensors)

    def get(self, name: str) -> torch.Tensor:
        t = self.tensors[name]
        result = self.processor.process(weights=_dequantize(t.data, t.tensor_type), name=t.name,
                                        tensor_key_mapping=self.gguf_to_hf, parsed_parameters={"tensors": {}, "config": {}})
        return torch.from_numpy(np.asarray(result.weights, dtype=np.float32))

    def blocks(self, name: str):
        """The tensor's GGUF blocks (speclm.quant.gguf.Blocks, a copy: rows in the Hugging Face
        order, where the architecture's processor permutes them) where speclm's kernel takes its
        type, else None."""
        from speclm.quant.gguf import FORMATS, Blocks

        t = self.tensors[name]
        if t.tensor_type.name not in FORMATS:
            return None
        data = np.asarray(t.data, dtype=np.uint8)
        rows = np.arange(data.shape[0], dtype=np.float64)[:, None]
        order = np.asarray(self.processor.process(weights=rows, name=t.name, tensor_key_mapping=self.gguf_to_hf,
                                                  parsed_parameters={"tensors": {}, "config": {}}).weights)
        if order.shape != rows.shape or not np.array_equal(np.sort(order[:, 0]), rows[:, 0]):
            return None  # the processor does more than reorder rows
        return Blocks(t.tensor_type.name, np.ascontiguousarray(data[order[:, 0].astype(np.int64)]))

    def embedding(self, name: str, dim: int) -> PackedEmbedding | None:
        """The table as its GGUF blocks (a copy, not a view of the map), or None for a float table."""
        from gguf import GGMLQuantizationType

        t = self.tensors[name]
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F64):
            return None
        if t.tensor_type in (GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
            return PackedEmbedding(self.get(name).to(torch.bfloat16 if t.tensor_type.name == "BF16" else torch.float16),
                                   "dense", dim)
        blocks = torch.from_numpy(np.array(t.data, dtype=np.uint8, copy=True))  # (V, row bytes)
        return PackedEmbedding(blocks, t.tensor_type.name, dim)

    def close(self) -> None:
        self.tensors.clear()
        self.reader = None
        gc.collect()  # numpy views of the map go with the reader: the file is unmapped here


INDEX_SUFFIX = ".index.json"  # beside model.gguf: its architecture and where each tensor's bytes lie


@dataclass
class _IndexedTensor:
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    data: np.ndarray  # a view of the mapped file, shaped as gguf's reader shapes it


def write_index(path: Path) -> None:
    """Record a GGUF's architecture and its tensors' types, shapes and offsets beside it. gguf's
    reader parses every metadata field to find them: 11.5 s for the catalog's 1.5B (benchmarks/avx2/records.md#load-none), whose
    tokenizer alone is some 300,000 fields, at every load; the index is read in milliseconds."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import read_field

    reader = GGUFReader(str(path))
    index = {"bytes": path.stat().st_size, "architecture": read_field(reader, "general.architecture")[0],
             "tensors": [{"name": t.name, "type": int(t.tensor_type), "dtype": t.data.dtype.str,
                          "shape": list(t.data.shape), "offset": int(t.data_offset)} for t in reader.tensors]}
    path.with_name(path.name + INDEX_SUFFIX).write_text(json.dumps(index))


def read_index(path: Path) -> tuple[str, list[_IndexedTensor]] | None:
    """The index of a GGUF (write_index), or None where there is none or it is not this file's."""
    from gguf import GGMLQuantizationType

    try:
        index = json.loads(path.with_name(path.name + INDEX_SUFFIX).read_text())
        if index.get("bytes") != path.stat().st_size:
            return None
    except (OSError, ValueError):
        return None
    mapped = np.memmap(path, mode="r")
    return index["architecture"], [
        _IndexedTensor(t["name"], GGMLQuantizationType(t["type"]),
                       np.ndarray(t["shape"], dtype=np.dtype(t["dtype"]), buffer=mapped, offset=t["offset"]))
        for t in index["tensors"]]


def _dequantize(data: np.ndarray, qtype) -> np.ndarray:
    """gguf's de-quantization of a tensor's blocks into fp32, a few MB of rows at a time: its
    temporaries are several times a block's fp32 size, so the whole 151,936-row output head at once
    would hold GBs of them. Blocks never span rows, so the values are the same (a fresh array)."""
    from gguf import dequantize

    if data.ndim != 2 or data.nbytes <= _CHUNK_BYTES:
        return np.array(dequantize(data, qtype), dtype=np.float32)
    step = max(1, _CHUNK_BYTES // data[0].nbytes)
    first = dequantize(data[:step], qtype)
    out = np.empty((data.shape[0], first.shape[1]), dtype=np.float32)
    out[:step] = first
    for lo in range(step, data.shape[0], step):
        out[lo : lo + step] = dequantize(data[lo : lo + step], qtype)
    return out


_CHUNK_BYTES = 8 << 20


class SafetensorsWeights:
    """A folder's *.safetensors tensors, read one at a time."""

    streamable = True

    def __init__(self, folder: Path):
        from safetensors import safe_open

        self.handles, self.where = [], {}
        for file in sorted(folder.glob("*.safetensors")):
            handle = safe_open(str(file), framework="pt")
            self.handles.append(handle)
            self.where.update({key: handle for key in handle.keys()})

    def names(self) -> set[str]:
        return set(self.where)

    def get(self, name: str) -> torch.Tensor:
        return self.where[name].get_tensor(name).clone()  # a copy in memory, not a view of the mapped file

    def embedding(self, name: str, dim: int) -> PackedEmbedding | None:
        """The table in its own dtype where that is narrower than fp32 (widening is exact), else None
        (read from the header: an fp32 table is read once, by the caller)."""
        if self.where[name].get_slice(name).get_dtype() not in ("BF16", "F16"):
            return None
        return PackedEmbedding(self.get(name), "dense", dim)

    def close(self) -> None:
        self.where.clear()
        self.handles.clear()
        gc.collect()


def open_weights(folder: Path, model: nn.Module):
    """The folder's weights as a source `build` can read, or None where `from_pretrained` must load
    them (see the module docstring)."""
    if (folder / GGUF_FILE).is_file():
        weights = GGUFWeights(folder / GGUF_FILE, model)
    elif any(folder.glob("*.safetensors")):
        weights = SafetensorsWeights(folder)
    else:
        return None  # .bin checkpoints: transformers knows them
    expected = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    head = _weight_name(model, model.get_output_embeddings())
    missing = expected - weights.names() - ({head} if _tied(model) else set())
    if not weights.streamable or missing:
        weights.close()
        return None
    return weights


def attention_implementation(config) -> str:
    """transformers' SDPA attention where the model's class supports it, else its eager one
    (Gemma 2: SDPA has no attention-logit softcapping, and transformers refuses to build it so)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return "sdpa"  # transformers says what it cannot build
    return "sdpa" if getattr(cls, "_supports_sdpa", True) else "eager"


def skeleton(config, dtype: torch.dtype) -> nn.Module:
    """The model's modules with parameters on the meta device (no memory) and real buffers."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention_implementation(config))
    return model.eval()


def _tied(model: nn.Module) -> bool:
    return bool(getattr(model.config, "tie_word_embeddings", False))


def _weight_name(model: nn.Module, module: nn.Module) -> str:
    """The name of `module`'s weight in `model` (the input embedding's, the output head's)."""
    return next(f"{n}.weight" for n, m in model.named_modules() if m is module)


def set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    if attr in module._parameters:
        module._parameters[attr] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[attr] = value


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's longest ModuleList (its decoder layers) and its name."""
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    return max(lists, key=lambda nm: len(nm[1]))


def build(model: nn.Module, weights, dtype: torch.dtype, quantize: str,
          quantize_tree: Callable[[nn.Module], None], progress: bool = True) -> nn.Module:
    """Fill the skeleton `model` from `weights`: layer by layer, each quantized by
    `quantize_tree` before the next is read (when quantize != "none"); the embedding table in its
    compact form when the model is quantized. Closes `weights`."""
    from tqdm.auto import tqdm

    names = [n for n, p in model.named_parameters(remove_duplicate=False) if p.is_meta]
    embed_name = _weight_name(model, model.get_input_embeddings())
    head_name = _weight_name(model, model.get_output_embeddings())
    layers_name, layers = decoder_layers(model)
    groups: list[tuple[nn.Module | None, list[str]]] = [
        (layer, [n for n in names if n.startswith(f"{layers_name}.{i}.")]) for i, layer in enumerate(layers)]
    in_layers = {n for _, group in groups for n in group}
    groups.append((None, [n for n in names if n not in in_layers]))  # embedding, final norm, output head
    quantized = quantize != "none"
    try:
        for layer, group in tqdm(groups, desc="load", unit="layer", disable=not progress, leave=False):
            for name in group:
                if name == head_name and name not in weights.names():
                    continue  # tied: below
                if name == embed_name:
                    continue  # below
                set_tensor(model, name, weights.get(name).to(dtype if not quantized else torch.float32))
                if quantize == "gguf":
                    _attach_blocks(model, name, weights, name)
            if layer is not None and quantized:
                quantize_tree(layer)
        _embedding_and_head(model, weights, embed_name, head_name, dtype, quantize, quantize_tree)
    finally:
        weights.close()
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise ValueError(f"weights missing from the checkpoint: {', '.join(left[:3])}")
    return model


def _embedding_and_head(model, weights, embed_name, head_name, dtype, quantize, quantize_tree) -> None:
    table = model.get_input_embeddings()
    quantized = quantize != "none"
    tied = head_name not in weights.names()
    if not quantized:
        set_tensor(model, embed_name, weights.get(embed_name).to(dtype))
        if tied:
            model.tie_weights()
        return
    packed = weights.embedding(embed_name, table.embedding_dim)
    full = weights.get(embed_name) if packed is None or tied else None  # fp32 (V, E)
    if tied:  # the head gets its own quantized copy of the table
        head = model.get_output_embeddings()
        head._parameters["weight"] = nn.Parameter(full, requires_grad=False)
        if quantize == "gguf":
            _attach_blocks(model, head_name, weights, embed_name)
    quantize_tree(model)  # the output head, and any projection outside the decoder layers
    if packed is None:
        set_tensor(model, embed_name, full)
    else:
        model.set_submodule(embed_name.rpartition(".")[0], packed.scaled_as(table))  # Gemma's sqrt(hidden) kept
    del full


def _attach_blocks(model: nn.Module, name: str, weights, source: str) -> None:
    """quantize=gguf: give the linear layer owning parameter `name` the GGUF blocks of tensor
    `source` (speclm.quant.gguf.attach), where the file has them."""
    from speclm.quant import gguf

    module_name, _, attr = name.rpartition(".")
    blocks = getattr(weights, "blocks", None)
    if attr == "weight" and blocks is not None:
        gguf.attach(model.get_submodule(module_name), blocks(source))
