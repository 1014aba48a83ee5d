"""A preallocated KV cache for the rows of a batch that advance at different speeds.

Every layer's keys and values live in one tensor (B, H_kv, capacity, D) allocated when the
request starts, sized to its longest row (prompt + max_new_tokens + one round of draft).
Row b's i-th token is written at slot lengths[b] + i, so a slot's index is its position id.
Rolling a row back is moving lengths[b]: slots past it are garbage that attention never
reads (a query sees only the slots before it) and the next forward overwrites. Nothing is concatenated or copied per step; the only
copy is when finished rows leave the batch.

A forward feeds each row its own number of new tokens, left-aligned: row b's n_b tokens
take columns [0, n_b) and the columns after them are padding. Padding writes finite values
into slots past the row's length (hidden by the mask, never read), and the logits a row
needs are gathered from its own last columns.
"""

from __future__ import annotations

import os
import time

import torch

from speclm import lean
from speclm.attention import is_prefill, per_query, use_exact_attention
from speclm.errors import UsageError
from speclm.lean import LeanForward


def available_memory(device: torch.device) -> int | None:
    """Bytes that can still be allocated on `device` without swapping: the kernel's MemAvailable
    (free pages plus reclaimable cache) on the CPU, free memory on a CUDA GPU; None if unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(nbytes: int, device: torch.device, what: str) -> None:
    """A KV cache that does not fit is a UsageError before it is allocated: torch.zeros would
    either fail with a traceback or, with overcommit, have the process killed as it fills."""
    free = available_memory(device)
    if free is not None and nbytes > free:
        raise UsageError(f"the KV cache ({what}) needs {_size(nbytes)} but {_size(free)} of memory is "
                         "available; lower --batch-size, --max-new-tokens or --k")


def _size(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.1f} {unit}"
    return f"{nbytes / 1024:.1f} KiB"


class _SlotWriter:
    """What the model sees as `past_key_values`: `update` writes this forward's keys and
    values at the slots the StaticKV chose and returns every layer's visible window."""

    def __init__(self, kv: "StaticKV"):
        self.kv = kv

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, cache_kwargs=None):
        kv = self.kv  # key, value (B, H_kv, M, D)
        keys, values = kv.keys[layer_idx], kv.values[layer_idx]
        if keys.dtype != key.dtype:  # first write decides the dtype (fp32, or bf16/fp16 models)
            keys = kv.keys[layer_idx] = keys.to(key.dtype)
            values = kv.values[layer_idx] = values.to(value.dtype)
        keys[kv._write_rows, :, kv._write_slots] = key.transpose(1, 2)  # (B, M, H, D) at (B, M) slots
        values[kv._write_rows, :, kv._write_slots] = value.transpose(1, 2)
        return keys[:, :, : kv._window], values[:, :, : kv._window]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.kv.lengths.max()) if self.kv.batch_size else 0


class StaticKV:
    def __init__(self, model, batch_size: int, capacity: int):
        """Decode forwards attend per query (speclm.attention), so that a token's logits do not
        depend on the other tokens of a forward. The target needs it; a draft model gets it
        too, at no measurable cost (its forwards are 1-2 tokens), so that a draft identical
        to the target is accepted in full."""
        self.model = model
        self.lean = LeanForward(model) if lean.supports(model) else None
        if self.lean is None:
            use_exact_attention(model)
        self.device = model.device
        cfg = model.config
        cfg = getattr(cfg, "text_config", None) or cfg
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.capacity = capacity
        # zeros, not empty: a masked slot still enters q.k before masking, and garbage NaNs would
        # survive it (NaN + -inf = NaN)
        shape = (batch_size, heads, capacity, head_dim)
        dtype = model.dtype if model.dtype.is_floating_point else torch.float32
        # keys and values of every layer: layers x 2 x B x H_kv x capacity x D elements
        check_memory(cfg.num_hidden_layers * 2 * batch_size * heads * capacity * head_dim * dtype.itemsize,
                     self.device, f"{batch_size} row(s) x {capacity} tokens x {cfg.num_hidden_layers} layers")
        self.keys = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(cfg.num_hidden_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(cfg.num_hidden_layers)]
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=self.device)  # (B,) valid slots per row
        self._writer = _SlotWriter(self)
        self._slots = torch.arange(capacity, device=self.device)  # built once
        self._rows = torch.arange(batch_size, device=self.device)
        # per row: slot -> its parent's slot, for the tree slots past the committed tokens whose
        # parent is not the slot before them (forward's `parents`); emptied as they are rolled back
        self._links: list[dict[int, int]] = [{} for _ in range(batch_size)]
        self.forward_seconds = 0.0  # time spent inside model forwards, for overhead accounting
        self.hidden: dict[int, torch.Tensor] | None = None  # the last forward's hidden states, where asked

    @property
    def chunk_invariant(self) -> bool:
        """A token's keys and values do not depend on how its prompt was split into forwards, so a
        prefix's may come from another prompt's forward (speclm.prefix_cache)."""
        return self.lean is not None and self.lean.chunk_invariant

    def load_prefix(self, row: int, keys: list[torch.Tensor], values: list[torch.Tensor], n: int) -> None:
        """Row `row` starts with n slots copied from keys, values (per layer (H_kv, >= n, D))."""
        for store, source in ((self.keys, keys), (self.values, values)):
            for t, s in zip(store, source):
                t[row, :, :n] = s[:, :n]
        self.lengths[row] = n

    def export(self, row: int, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of row `row`'s first n slots, per layer (H_kv, n, D)."""
        return ([t[row, :, :n].clone() for t in self.keys], [t[row, :, :n].clone() for t in self.values])

    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[0])

    def lengths_list(self) -> list[int]:
        return self.lengths.tolist()

    def _grow(self, needed: int) -> None:
        """Only when a caller under-estimated the request's length: one copy, doubling."""
        new_cap = max(needed, 2 * self.capacity)
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                bigger = torch.zeros(*t.shape[:2], new_cap, t.shape[3], dtype=t.dtype, device=t.device)
                bigger[:, :, : self.capacity] = t
                store[i] = bigger
        self.capacity = new_cap
        self._slots = torch.arange(new_cap, device=self.device)

    @torch.inference_mode()
    def forward(self, rows: list[list[int]], logits_to_keep: int, head=None,
                parents: list[list[int] | None] | None = None, hidden_layers: tuple[int, ...] = ()) -> torch.Tensor:
        """Append each row's tokens; return logits (B, logits_to_keep, V) of each row's last tokens.
        head: an output head in place of the model's, (R, E) -> (R, V'); only on the lean forward.
        parents: per row (or None: a chain), for each of its tokens the slot of its parent, or -1
        for the slot before its own. A token then attends the slots of its ancestors, through
        this and earlier forwards, and sits at the position of its depth: a tree's node computes
        what a plain step after its root path would (speclm.attention.attend_each_query).
        hidden_layers: layer indices (-1: after the final norm) whose hidden states (B,
        logits_to_keep, E) of the same tokens the forward leaves in `self.hidden`; none asked,
        none kept (self.hidden is then None). On transformers' own forward (other architectures)
        the last layer's are after the final norm, as transformers reports them."""
        counts = [len(r) for r in rows]
        width = max(counts)
        assert width >= 1 and min(counts) >= logits_to_keep >= 1
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long, device=self.device)  # (B, M)
        n = torch.tensor(counts, dtype=torch.long, device=self.device)  # (B,)
        offsets = self._slots[:width]  # (M,)
        slots = self.lengths[:, None] + offsets  # (B, M): where each token's keys and values go
        window = int(slots[:, -1].max()) + 1
        starts = self.lengths.tolist()
        tree = positions = None
        parents = parents if parents is not None else [None] * len(rows)
        if any(p is not None for p in parents) or any(self._links):
            assert not is_prefill(starts), "a prefill has no tree"
            tree = [self._visible(b, starts[b], width, p) for b, p in enumerate(parents)]
            tree = tree if any(row is not None for row in tree) else None
        if tree is not None:
            positions = slots.clone()  # (B, M): a node's position is its depth's
            for b, row in enumerate(tree):
                if row is not None:
                    positions[b] = torch.tensor([reach + len(apart) - 1 for reach, apart in row], dtype=torch.long)
        if window > self.capacity:
            self._grow(window)
        # which columns hold each row's last `logits_to_keep` tokens; all rows agree when the
        # feed is not ragged, the usual case after prefill
        ragged = min(counts) < width
        cols = (n[:, None] - logits_to_keep + self._slots[:logits_to_keep]) if ragged else None  # (B, K)
        t0 = time.perf_counter()
        self.hidden = {} if hidden_layers else None
        if self.lean is not None:
            keep_cols = cols if ragged else slice(width - logits_to_keep, width)
            logits = self.lean(ids, slots, self, starts, counts, window, keep_cols, head, positions, tree,
                               tuple(hidden_layers), self.hidden)
        else:
            assert head is None, "a replaced output head needs speclm's lean forward"
            logits = self._transformers_forward(ids, slots, positions, tree, window, starts, counts, logits_to_keep, cols,
                                                tuple(hidden_layers))
        self.forward_seconds += time.perf_counter() - t0
        self.lengths = self.lengths + n
        return logits

    def _visible(self, b: int, start: int, width: int, parents: list[int] | None) -> list[tuple[int, list[int]]] | None:
        """Row b's (reach, apart) per column (speclm.attention), its links recorded first; None
        where the row attends as a chain."""
        links = self._links[b]
        for i, p in enumerate(parents if parents is not None else [-1] * width):
            slot = start + i
            assert -1 <= p < slot, f"parent slot {p} of a token at slot {slot}"
            if p >= 0 and p != slot - 1:
                links[slot] = p
            else:
                links.pop(slot, None)
        if not links:
            return None
        lowest = min(links)  # below it every slot's parent is the slot before
        out = []
        for i in range(width):
            apart, at = [], start + i
            while at >= lowest:
                apart.append(at)
                at = links.get(at, at - 1)
            out.append((at + 1, apart[::-1]))
        return out

    def _transformers_forward(self, ids, slots, positions, tree, window, starts, counts, logits_to_keep, cols,
                              hidden_layers=()):
        """The model's own forward, this cache handed in as `past_key_values` (via _SlotWriter)."""
        # query (b, i) sees slots 0..lengths[b] + i, or its tree's slots; padding queries see the
        # same, harmlessly (a prefill's mask; decode forwards attend per query, speclm.attention)
        mask = self._slots[None, None, None, :window] <= slots[:, None, :, None]  # (B, 1, M, W)
        for b, row in enumerate(tree or ()):
            for i, (reach, apart) in enumerate(row or ()):
                mask[b, 0, i, reach:] = False
                mask[b, 0, i, apart] = True
        if cols is not None:
            keep, gather = torch.unique(cols, return_inverse=True)  # keep (U,), gather (B, K) into it
        else:
            keep, gather = logits_to_keep, None
        self._write_rows, self._write_slots, self._window = self._rows[:, None], slots, window
        with per_query(starts, counts, tree):
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=slots if positions is None else positions,
                past_key_values=self._writer,
                use_cache=True,
                logits_to_keep=keep,
                output_hidden_states=bool(hidden_layers),
            )
        logits = out.logits  # (B, keep or U, V)
        if gather is not None:
            logits = logits[self._rows[:, None], gather]  # (B, K, V)
        if hidden_layers:  # transformers' hidden_states: [0] the embeddings, [i + 1] layer i's output, [-1] normed
            columns = cols if cols is not None else slice(ids.shape[1] - logits_to_keep, None)
            for layer in hidden_layers:
                states = out.hidden_states[layer + 1 if layer >= 0 else -1]  # (B, M, E)
                self.hidden[layer] = (states[self._rows[:, None], columns] if cols is not None else states[:, columns]).float()
        return logits.float()

    def move_path(self, row: int, sources: list[int], start: int) -> None:
        """Row `row`'s slots `sources` (ascending, each at or past its target) are copied to slots
        start, start + 1, ... in every layer: a tree's accepted path, each node's keys and values
        computed at the position of its depth, takes its place in the sequence. Nothing is
        recomputed; one gather per layer and store, none where the path already lies in place."""
        pairs = [(s, start + i) for i, s in enumerate(sources) if s != start + i]
        if pairs:
            src = torch.tensor([s for s, _ in pairs], device=self.device)
            dst = torch.tensor([t for _, t in pairs], device=self.device)
            for store in (self.keys, self.values):
                for t in store:
                    t[row, :, dst] = t[row, :, src]
        self._links[row] = {s: p for s, p in self._links[row].items() if s < start}

    def truncate(self, keep: torch.Tensor | list[int]) -> None:
        """Row b keeps its first keep[b] slots; the rest are rolled back (a length moves)."""
        keep = torch.as_tensor(keep, dtype=torch.long, device=self.device)
        self.lengths = torch.minimum(self.lengths, keep)
        for links, k in zip(self._links, keep.tolist()):
            for s in [s for s in links if s >= k]:
                del links[s]

    def select(self, rows: torch.Tensor | list[int]) -> None:
        """Keep only these batch rows (finished rows leave the batch): one copy per exit."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.device)
        self.keys = [t[rows] for t in self.keys]
        self.values = [t[rows] for t in self.values]
        self.lengths = self.lengths[rows]
        self._links = [self._links[r] for r in rows.tolist()]
        self._rows = torch.arange(len(rows), device=self.device)
