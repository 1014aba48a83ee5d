"""A token embedding table kept in the compact form its weights file holds, turned into fp32 rows
per lookup.

The table is the largest tensor of a small model (151,936 x 1,536 for Qwen2.5 1.5B: 0.93 GB in
fp32), yet a decode step reads a handful of its rows. Kept as the GGUF's quantized blocks (that
table is Q4_K in the catalog's GGUF: 0.13 GB) or as the checkpoint's bf16/fp16, and de-quantized or widened row by row,
it gives the very fp32 values a whole-table conversion gives: GGUF de-quantization is elementwise
within each block of a row, and widening bf16/fp16 to fp32 is exact. So the output does not change
(tests/test_weights.py checks the bits). Each call to gguf's numpy code has a fixed cost that
dwarfs a row's, so the rows of recent small lookups (decode steps, a head's drafting) are kept in
fp32: at most ROW_CACHE rows (24 MiB for Qwen2.5 1.5B), the least recently used leaving first.

Gemma's embedding module (transformers' Gemma2/Gemma3TextScaledWordEmbedding) returns its rows
times `embed_scale` (sqrt(hidden)); a PackedEmbedding made in its place keeps that scale and
returns scaled rows too, as the same fp32 product: `embed_tokens(ids)` is the scaled input of the
first layer whichever class it is, and a forward must not scale it again. `full()` is the table
itself (unscaled), which is what an output head tied to it holds.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np
import torch
from torch import nn


ROW_CACHE = 4096  # fp32 rows kept from small lookups
SMALL = 64  # a lookup of at most this many ids reads and fills the row cache; larger ones (prefills) do not


class PackedEmbedding(nn.Module):
    """ids (...) long -> (..., dim) fp32 rows of a table kept as `data`:
    - kind "dense": data (V, dim) in bf16 or fp16, widened per lookup;
    - kind a GGML type name ("Q5_0", "Q4_K", ...): data (V, row_bytes) uint8, each row its blocks
      as the GGUF file stores them, de-quantized per lookup by the gguf library.
    `embed_scale` (a 0-dim fp32 tensor, else None; see `scaled_as`): the rows come out multiplied
    by it, as the Gemma module this table replaces returns them (see the module docstring)."""

    def __init__(self, data: torch.Tensor, kind: str, dim: int):
        super().__init__()
        if kind != "dense":
            from gguf import GGMLQuantizationType

            self.qtype = GGMLQuantizationType[kind]
        self.data, self.kind = data, kind  # a plain attribute: not a parameter, nothing to train
        self.num_embeddings, self.embedding_dim = data.shape[0], dim
        self.embed_scale: torch.Tensor | None = None  # a plain attribute, as `data`
        self._rows: OrderedDict[int, torch.Tensor] = OrderedDict()  # id -> (dim,) fp32, least recent first
        self._lock = threading.Lock()  # two threads decoding on one model share the cache

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def device(self) -> torch.device:
        return self.data.device

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def scaled_as(self, module: nn.Module) -> "PackedEmbedding":
        """This table, taking the `embed_scale` of the embedding module it replaces (Gemma's) if
        that has one; returns self."""
        scale = getattr(module, "embed_scale", None)
        self.embed_scale = scale.detach().to(torch.float32).reshape(()) if isinstance(scale, torch.Tensor) else None
        return self

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if self.kind != "dense" and len(flat) <= SMALL:
            rows = self._cached(flat.tolist())
        else:
            rows = self._lookup(flat)
        if self.embed_scale is not None:
            rows = rows * self.embed_scale  # a new tensor: the cached rows stay unscaled
        return rows.view(*ids.shape, self.embedding_dim)

    def _cached(self, ids: list[int]) -> torch.Tensor:
        """(N, dim) rows of `ids` through the row cache."""
        if not ids:
            return torch.zeros(0, self.embedding_dim)
        with self._lock:
            rows = self._rows
            missing = [i for i in dict.fromkeys(ids) if i not in rows]
            if missing:
                for i, row in zip(missing, self._lookup(torch.tensor(missing, dtype=torch.long)).unbind(0)):
                    rows[i] = row
            for i in ids:
                rows.move_to_end(i)
            out = torch.stack([rows[i] for i in ids])
            while len(rows) > ROW_CACHE:
                rows.popitem(last=False)
        return out

    def _lookup(self, flat: torch.Tensor) -> torch.Tensor:
        """(N, dim) fp32 rows of ids (N,), read from the table."""
        if self.kind == "dense":
            rows = self.data.index_select(0, flat).float()
        else:
            from gguf import dequantize

            blocks = self.data.index_select(0, flat).numpy()  # (N, row_bytes)
            rows = torch.from_numpy(np.ascontiguousarray(dequantize(blocks, self.qtype), dtype=np.float32))
        return rows

    def full(self) -> torch.Tensor:
        """The whole table in fp32 (V, dim), unscaled: for an output head tied to it, quantized once at load."""
        return self._lookup(torch.arange(self.num_embeddings))

    def extra_repr(self) -> str:
        form = str(self.data.dtype).removeprefix("torch.") if self.kind == "dense" else f"GGUF {self.kind} blocks"
        scale = "" if self.embed_scale is None else f", rows times {self.embed_scale.item():.4g}"
        return f"{self.num_embeddings}, {self.embedding_dim}, kept as {form} ({self.nbytes() / 2**20:.0f} MiB){scale}"
