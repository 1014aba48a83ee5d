"""Which forward runs a model over speclm's KV cache (speclm.forward.cache.StaticKV), and how long it took.

speclm's lean forward (speclm.forward.lean) for the decoders speclm.forward.decoders describes; transformers'
own forward for every other architecture (said once per model on stderr), the cache handed in as its cache argument and attention
per query (speclm.forward.attention). The cache decides where each token's keys and values go and which
slots it sees (a `Plan`); the runner only runs it.
"""

from __future__ import annotations

import inspect
import sys
import time
import weakref
from dataclasses import dataclass

import torch

from speclm.forward import decoders, lean
from speclm.forward.attention import Tree, per_query, use_exact_attention
from speclm.forward.lean import LeanForward, Stack


@dataclass
class Plan:
    """One forward's layout, as the cache made it."""

    ids: torch.Tensor  # (B, M) tokens, each row's left-aligned, padded with 0
    slots: torch.Tensor  # (B, M) where each token's keys and values go
    starts: list[int]  # per row: slots before this forward
    counts: list[int]  # per row: its tokens (columns past them are padding)
    window: int  # slots the forward's queries can reach
    cache_rows: torch.Tensor  # (B,) each row's row of the cache's pool
    positions: torch.Tensor | None  # (B, M) position ids where some row holds a tree, else None (= slots)
    tree: Tree | None  # each query's visible slots where some row holds a tree (speclm.forward.attention)
    logits_to_keep: int
    cols: torch.Tensor | None  # (B, K) columns of each row's last tokens where rows are ragged, else None
    hidden_all: bool = False  # hidden states of every fed token (B, M, E), not only the kept ones
    layers: Stack | None = None  # the decoder layers that run, a speclm.forward.lean.Stack (None: all)
    kept_mask: torch.Tensor | None = None  # (B, K) which of cols hold a token (None: all); the rest are padding


_TOLD: weakref.WeakSet = weakref.WeakSet()  # models whose fallback to transformers' forward was said


class ModelRunner:
    def __init__(self, model):
        self.model = model
        self.lean = LeanForward(model) if lean.supports(model) else None
        if self.lean is None:
            use_exact_attention(model)
            if model not in _TOLD:  # once per model object
                _TOLD.add(model)
                print(f"speclm: transformers' forward runs this model, not speclm's lean forward and kernels "
                      f"({decoders.why_not(model)})", file=sys.stderr, flush=True)
        self._writer = _SlotWriter()
        self._cache_arg = cache_argument(model)
        self.forward_seconds = 0.0  # time spent inside model forwards, for overhead accounting
        self.hidden: dict[int, torch.Tensor] | None = None  # the last forward's hidden states, where asked

    @property
    def chunk_invariant(self) -> bool:
        return self.lean is not None and self.lean.chunk_invariant

    def run(self, kv, plan: Plan, head, hidden_layers: tuple[int, ...]) -> torch.Tensor:
        """The forward `plan` lays out over cache `kv`: logits (B, logits_to_keep, V); hidden states
        of the same tokens in `self.hidden` for the layers asked (else None)."""
        t0 = time.perf_counter()
        self.hidden = {} if hidden_layers else None
        width = plan.ids.shape[1]
        if self.lean is not None:
            keep_cols = plan.cols if plan.cols is not None else slice(width - plan.logits_to_keep, width)
            logits = self.lean(plan.ids, plan.slots, kv, plan.starts, plan.counts, plan.window, keep_cols, head,
                               plan.positions, plan.tree, hidden_layers, self.hidden, plan.cache_rows,
                               plan.hidden_all, plan.layers, plan.kept_mask)
        else:
            assert head is None, "a replaced output head needs speclm's lean forward"
            assert plan.layers is None, "a subset of the layers needs speclm's lean forward"
            logits = self._transformers_forward(kv, plan, hidden_layers)
        self.forward_seconds += time.perf_counter() - t0
        return logits

    def _transformers_forward(self, kv, plan: Plan, hidden_layers: tuple[int, ...]) -> torch.Tensor:
        """The model's own forward, the cache handed in as its cache argument (a _SlotWriter)."""
        ids, slots, positions, tree, window = plan.ids, plan.slots, plan.positions, plan.tree, plan.window
        starts, counts, logits_to_keep, cols, cache_rows = plan.starts, plan.counts, plan.logits_to_keep, plan.cols, plan.cache_rows
        # query (b, i) sees slots 0..lengths[b] + i, or its tree's slots; padding queries see the
        # same, harmlessly (a prefill's mask; decode forwards attend per query, speclm.forward.attention)
        mask = kv._slots[None, None, None, :window] <= slots[:, None, :, None]  # (B, 1, M, W)
        batch = torch.arange(len(starts), device=ids.device)
        for b, row in enumerate(tree or ()):
            for i, (reach, apart) in enumerate(row or ()):
                mask[b, 0, i, reach:] = False
                mask[b, 0, i, apart] = True
        if cols is not None:
            keep, gather = torch.unique(cols, return_inverse=True)  # keep (U,), gather (B, K) into it
        else:
            keep, gather = logits_to_keep, None
        writer = self._writer
        writer.kv, writer.rows, writer.slots, writer.window = kv, cache_rows[:, None], slots, window
        writer.whole_pool = len(starts) == kv.pool_size and bool((cache_rows == batch).all())
        with per_query(starts, counts, tree):
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=slots if positions is None else positions,
                use_cache=True,
                logits_to_keep=keep,
                output_hidden_states=bool(hidden_layers),
                **{self._cache_arg: self._writer},
            )
        logits = out.logits  # (B, keep or U, V)
        if gather is not None:
            logits = logits[batch[:, None], gather]  # (B, K, V)
        if hidden_layers:  # transformers' hidden_states: [0] the embeddings, [i + 1] layer i's output, [-1] normed
            columns = cols if cols is not None else slice(ids.shape[1] - logits_to_keep, None)
            for layer in hidden_layers:
                states = out.hidden_states[layer + 1 if layer >= 0 else -1]  # (B, M, E)
                if plan.hidden_all:
                    self.hidden[layer] = states.float()
                else:
                    self.hidden[layer] = (states[batch[:, None], columns] if cols is not None else states[:, columns]).float()
        return logits.float()


def cache_argument(model) -> str:
    """The name a transformers model's forward takes its KV cache by: `cache` from transformers 5.24,
    `past_key_values` before (5.24 still maps the old name, with a warning per call)."""
    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class _SlotWriter:
    """What the model sees as its KV cache: `update` writes this forward's keys and values at
    the slots the cache chose and returns every layer's visible window."""

    kv = rows = slots = None  # the cache, (B, 1) cache rows and (B, M) slots of the forward running
    window, whole_pool = 0, True

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        kv = self.kv  # key, value (B, H_kv, M, D)
        keys, values = kv.keys[layer_idx], kv.values[layer_idx]
        if keys.dtype != key.dtype:  # first write decides the dtype (fp32, or bf16/fp16 models)
            keys = kv.keys[layer_idx] = keys.to(key.dtype)
            values = kv.values[layer_idx] = values.to(value.dtype)
        rows = self.rows
        keys[rows, :, self.slots] = key.transpose(1, 2)  # (B, M, H, D) at (B, M) slots
        values[rows, :, self.slots] = value.transpose(1, 2)
        if self.whole_pool:  # the batch is the pool in order: a view
            return keys[:, :, : self.window], values[:, :, : self.window]
        # other rows share the pool: transformers' attention reads the batch's own (a copy per layer)
        return keys[rows[:, 0], :, : self.window], values[rows[:, 0], :, : self.window]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.kv.lengths.max()) if self.kv.batch_size else 0
