"""A preallocated KV cache for the rows of a batch that advance at different speeds, join and leave:
where each token's keys and values go and which slots each token sees (speclm.forward.runner runs the
model's forward over it).

Every layer's keys and values live in one tensor (P, H_kv, capacity, D), a pool of P cache rows
allocated when the cache is made, each sized to the longest request expected (prompt +
max_new_tokens + one round of draft). The batch's rows are an ordered list of cache rows: a
request joining takes a free one (`add`), a finished one gives its back (`select`), and no other
row's keys or values move. Row b's i-th token is written at slot lengths[b] + i, so a slot's
index is its position id. Rolling a row back is moving lengths[b]: slots past it are garbage
that attention never reads (a query sees only the slots before it) and the next forward
overwrites. Nothing is concatenated or copied per step; the pool is copied only when a caller
asks for more rows or tokens than it was made for (doubling).

A forward feeds each row its own number of new tokens, left-aligned: row b's n_b tokens
take columns [0, n_b) and the columns after them are padding. Padding writes finite values
into slots past the row's length (hidden by the mask, never read), and the logits a row
needs are gathered from its own last columns. The lean forward runs only attention over that
layout (skipping the padding columns) and every other op on the real tokens packed, so rows of
different lengths cost their own tokens (speclm.forward.lean.LeanForward).

A sliding-window layer (Mistral, Gemma 2/3, Qwen2 with use_sliding_window) keeps only the keys its
queries can still see: a ring of window + `spare` slots per cache row, slot s at s mod its size,
where that is smaller than the capacity (full-attention layers keep every slot). A query reads at
most `window` slots back, so while at most `spare` tokens are fed past a row's last committed one
(a round: its draft steps and its verification forward), no write overwrites a key that a query of
theirs, or one after a roll back, reads; callers with wider rounds say so through `reserve`. A
forward wider than that (a long prompt read at once, always committed whole) attends over a copy
of the layer laid out flat and leaves the ring its last slots. The prefix cache keeps what a
sliding layer's ring holds of a prompt, so a later prompt reuses it from up to `spare` tokens
before its end.
"""

from __future__ import annotations

import os

import torch

from speclm.forward import decoders
from speclm.forward.attention import is_prefill
from speclm.errors import UsageError
from speclm.forward.lean import Stack
from speclm.forward.runner import ModelRunner, Plan
from speclm.tree import lineage


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


# Slots a sliding layer's ring holds beyond its window: the most tokens fed past a row's last
# committed one (a round's draft and verification; callers with wider rounds say so through
# StaticKV.reserve). 256 covers every proposer with room (MAX_K = 64 drafts a chain of 128 nodes at most).
RING_SPARE = 256


def _windows(model) -> tuple[int, ...]:
    """Each layer's sliding window where speclm's lean forward runs the model (0: full attention);
    transformers' own forward (another architecture) keeps every slot of every layer."""
    decoder = decoders.describe(model)
    return decoder.windows if decoder is not None else (0,) * _layout(model)[0].num_hidden_layers


def _sizes(windows: tuple[int, ...], capacity: int, spare: int) -> list[int]:
    """Slots per cache row of each layer: a sliding layer's ring (window + spare) where that is
    smaller than the capacity, else the capacity."""
    return [min(capacity, w + spare) if w else capacity for w in windows]


def _check_rows(rows: int, heads: int, dim: int, sizes: list[int], dtype: torch.dtype, device: torch.device) -> None:
    """Keys and values of layers of `sizes` slots, each (rows, H_kv, size, D), fit in memory (check_memory)."""
    check_memory(2 * rows * heads * sum(sizes) * dim * dtype.itemsize, device,
                 f"{rows} row(s) x {max(sizes)} tokens x {len(sizes)} layers")


def _layout(model) -> tuple:
    """(the text config, key/value heads, head size) of a model's attention."""
    cfg = model.config
    cfg = getattr(cfg, "text_config", None) or cfg
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return cfg, heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def check_fits(model, rows: int, capacity: int) -> None:
    """A StaticKV of `rows` rows of `capacity` tokens fits in memory (UsageError where it does not):
    checked before work that comes first (measuring costs, a calibration) rather than after it."""
    _, heads, head_dim = _layout(model)
    dtype = model.dtype if model.dtype.is_floating_point else torch.float32
    _check_rows(max(rows, 1), heads, head_dim, _sizes(_windows(model), capacity, RING_SPARE), dtype, model.device)


class StaticKV:
    # Every method that makes or writes the cache's tensors runs in inference mode: a cache grown
    # inside a forward (inference mode) holds inference tensors, which torch lets only inference
    # mode write, so all writes go through it alike.
    @torch.inference_mode()
    def __init__(self, model, batch_size: int, capacity: int, pool: int = 0, spare: int | None = None):
        """batch_size rows now, each up to `capacity` tokens; `pool`: cache rows to allocate for rows
        that join later (at least batch_size); spare: a sliding layer's ring slots past its window
        (the widest forward that may be rolled back; None: RING_SPARE; see the module docstring). Decode forwards attend per query
        (speclm.forward.attention), so that a token's logits do not depend on the other tokens of a
        forward. The target needs it; a draft model gets it too, at no measurable cost (its
        forwards are 1-2 tokens), so that a draft identical to the target is accepted in full."""
        self.model = model
        self.runner = ModelRunner(model)  # which forward runs, and its time
        self.device = model.device
        cfg, heads, head_dim = _layout(model)
        self.capacity = capacity
        # zeros, not empty: a masked slot still enters q.k before masking, and garbage NaNs would
        # survive it (NaN + -inf = NaN)
        pool = max(batch_size, pool, 1)
        # the lean forward's own description (described once, with the runner)
        self.windows = self.runner.lean.decoder.windows if self.runner.lean is not None else (0,) * cfg.num_hidden_layers
        self.spare = spare = RING_SPARE if spare is None else spare
        sizes = _sizes(self.windows, capacity, spare)
        dtype = model.dtype if model.dtype.is_floating_point else torch.float32
        _check_rows(pool, heads, head_dim, sizes, dtype, self.device)
        self.keys = [torch.zeros(pool, heads, n, head_dim, dtype=dtype, device=self.device) for n in sizes]
        self.values = [torch.zeros(pool, heads, n, head_dim, dtype=dtype, device=self.device) for n in sizes]
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=self.device)  # (B,) valid slots per row
        self._slots = torch.arange(capacity, device=self.device)  # built once
        self._rows = torch.arange(batch_size, device=self.device)  # (B,) each batch row's cache row
        self._free = list(range(batch_size, pool))  # cache rows no batch row holds
        # per row: slot -> its parent's slot, for the tree slots past the committed tokens whose
        # parent is not the slot before them (forward's `parents`); emptied as they are rolled back
        self._links: list[dict[int, int]] = [{} for _ in range(batch_size)]
        # per row: one past the last slot any forward wrote (rolled back or not): a ring holds a row
        # of length n from slot max(n, reach) - its size on (later slots written since overwrite earlier ones)
        self._reach = [0] * batch_size

    @property
    def lean(self):
        return self.runner.lean

    @property
    def forward_seconds(self) -> float:
        """Time spent inside model forwards, for overhead accounting."""
        return self.runner.forward_seconds

    @property
    def hidden(self) -> dict[int, torch.Tensor] | None:
        """The last forward's hidden states, where asked (`forward`'s hidden_layers)."""
        return self.runner.hidden

    @property
    def chunk_invariant(self) -> bool:
        """A token's keys and values do not depend on how its prompt was split into forwards, so a
        prefix's may come from another prompt's forward (speclm.forward.prefix_cache)."""
        return self.runner.chunk_invariant

    def ring(self, layer: int) -> int:
        """Layer `layer`'s ring size (slot s at s mod it), or 0 where it keeps every slot at its own index."""
        size = self.keys[layer].shape[2]
        return size if self.windows[layer] and size < self.capacity else 0

    def _held(self, layer: int, row: int, n: int) -> int:
        """The first of slots 0 .. n - 1 of batch row `row` that layer `layer` still holds."""
        ring = self.ring(layer)
        return max(0, max(n, self._reach[row]) - ring) if ring else 0

    def loadable(self, keys: list[torch.Tensor], total: int, n: int) -> bool:
        """Whether `export`'s keys of a prompt of `total` tokens hold what a row of its first n needs:
        every slot of a full layer, a sliding layer's last `window` slots."""
        return all(max(0, n - w) >= total - k.shape[1] if w else k.shape[1] >= n for w, k in zip(self.windows, keys))

    @torch.inference_mode()
    def load_prefix(self, row: int, keys: list[torch.Tensor], values: list[torch.Tensor], n: int,
                    total: int | None = None) -> None:
        """Row `row` starts with the first n slots of a prompt of `total` tokens (None: n) whose
        keys and values `export` gave (per layer (H_kv, held, D), its last `held` slots)."""
        total = n if total is None else total
        assert self.loadable(keys, total, n), "the prefix's keys do not reach back far enough"
        self.reserve(n)
        at = int(self._rows[row])
        for i in range(len(self.keys)):
            first = total - keys[i].shape[1]  # the slot of the source's first column
            low = max(0, n - self.windows[i]) if self.windows[i] else 0
            place = self._place(i, torch.arange(low, n, device=self.device))
            self.keys[i][at, :, place] = keys[i][:, low - first : n - first]
            self.values[i][at, :, place] = values[i][:, low - first : n - first]
        self.lengths[row] = n
        self._reach[row] = n

    def export(self, row: int, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of what each layer holds of row `row`'s first n slots, per layer (H_kv, held, D): every
        slot of a full layer, the last ones a sliding layer's ring holds (`loadable`, `load_prefix`)."""
        at = int(self._rows[row])
        places = [self._place(i, torch.arange(self._held(i, row, n), n, device=self.device)) for i in range(len(self.keys))]
        return ([t[at][:, p] for t, p in zip(self.keys, places)], [t[at][:, p] for t, p in zip(self.values, places)])

    def flat(self, layer: int, starts: list[int], width: int) -> bool:
        """Whether a forward of `width` tokens after `starts` attends layer `layer` over a flat copy
        (`flat_copy`, `settle`): its ring would wrap onto keys the forward reads."""
        ring = self.ring(layer)
        return bool(ring) and width > ring - self.windows[layer] and max(starts) + width > ring

    @torch.inference_mode()
    def flat_copy(self, layer: int, starts: list[int], width: int,
                  cache_rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s keys and values for a wide forward, laid out flat: (B, H_kv, max(starts) +
        width, D), row b's last `window` slots before starts[b] in place (the slots before them are
        never read: left unset)."""
        keys, values, window, ring = self.keys[layer], self.values[layer], self.windows[layer], self.ring(layer)
        shape = (len(starts), keys.shape[1], max(starts) + width, keys.shape[3])
        flat_keys, flat_values = keys.new_empty(shape), values.new_empty(shape)
        for b, (at, start) in enumerate(zip(cache_rows, starts)):
            low = max(0, start - window)
            if low < start:
                place = torch.arange(low, start, device=self.device) % ring
                flat_keys[b, :, low:start] = keys[at, :, place]
                flat_values[b, :, low:start] = values[at, :, place]
        return flat_keys, flat_values

    @torch.inference_mode()
    def settle(self, layer: int, flat_keys: torch.Tensor, flat_values: torch.Tensor, starts: list[int],
               counts: list[int], cache_rows: list[int]) -> None:
        """After a wide forward over `flat_copy`'s tensors: each row's new slots that its ring holds
        (its last ring-size ones) go to their places."""
        ring = self.ring(layer)
        for b, (at, start, n) in enumerate(zip(cache_rows, starts, counts)):
            slots = torch.arange(max(start, start + n - ring), start + n, device=self.device)
            self.keys[layer][at, :, slots % ring] = flat_keys[b, :, slots]
            self.values[layer][at, :, slots % ring] = flat_values[b, :, slots]

    def _place(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Where slots live along layer `layer`'s capacity (a ring's: mod its size)."""
        ring = self.ring(layer)
        return slots % ring if ring else slots

    @property
    def nbytes(self) -> int:
        """Memory the keys and values of every layer and cache row hold."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def pool_size(self) -> int:
        return self.keys[0].shape[0]

    def add(self, count: int) -> list[int]:
        """`count` empty rows join the batch after the others; returns their batch indices. They
        take free cache rows; only a full pool is copied (into one twice its size, or as large as needed)."""
        if count > len(self._free):
            self._grow_pool(max(2 * self.pool_size, self.batch_size + count))
        taken, self._free = self._free[:count], self._free[count:]
        first = self.batch_size
        self._rows = torch.cat([self._rows, torch.tensor(taken, dtype=torch.long, device=self.device)])
        self.lengths = torch.cat([self.lengths, torch.zeros(count, dtype=torch.long, device=self.device)])
        self._links += [{} for _ in range(count)]
        self._reach += [0] * count
        return list(range(first, first + count))

    @torch.inference_mode()
    def _grow_pool(self, size: int) -> None:
        old = self.pool_size
        _check_rows(size - old, self.keys[0].shape[1], self.keys[0].shape[3], [t.shape[2] for t in self.keys],
                    self.keys[0].dtype, self.device)
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                store[i] = torch.cat([t, t.new_zeros(size - old, *t.shape[1:])])
        self._free += list(range(old, size))

    def lengths_list(self) -> list[int]:
        return self.lengths.tolist()

    def reserve(self, tokens: int, width: int = 0) -> None:
        """Every row may hold `tokens` tokens (a copy where it is more than the capacity), and a
        forward of `width` tokens may be rolled back (a sliding layer's ring grows to window + width
        where that is more than it holds)."""
        if tokens > self.capacity or width > self.spare:
            self._grow(max(tokens, self.capacity), max(width, self.spare))

    @torch.inference_mode()
    def _grow(self, needed: int, spare: int) -> None:
        """Only when a caller under-estimated a request's length or its widest forward: one copy,
        doubling. A ring's slots move to their places in the larger one."""
        new_cap = max(needed, 2 * self.capacity) if needed > self.capacity else self.capacity
        sizes = _sizes(self.windows, new_cap, spare)
        lengths = self.lengths.tolist()
        rows = self._rows.tolist()
        reach = list(self._reach)
        for i, size in enumerate(sizes):
            old = self.keys[i].shape[2]
            if size == old:
                continue
            ring = self.ring(i)
            held = [self._held(i, b, n) for b, n in enumerate(lengths)]
            for store in (self.keys, self.values):
                t = store[i]
                bigger = torch.zeros(*t.shape[:2], size, t.shape[3], dtype=t.dtype, device=t.device)
                if not ring:
                    bigger[:, :, :old] = t
                else:  # each row's slots the ring holds, to their places in the new one
                    for at, n, first in zip(rows, lengths, held):
                        slots = torch.arange(first, n, device=self.device)
                        bigger[at, :, slots % size] = t[at, :, slots % ring]
                store[i] = bigger
            if ring:  # the larger ring holds no more of a row than was moved into it
                reach = [max(r, first + size) for r, first in zip(reach, held)]
        self._reach = reach
        self.capacity, self.spare = new_cap, spare
        self._slots = torch.arange(new_cap, device=self.device)

    @torch.inference_mode()
    def forward(self, rows: list[list[int]], logits_to_keep: int, head=None,
                parents: list[list[int] | None] | None = None, hidden_layers: tuple[int, ...] = (),
                only: list[int] | None = None, hidden_all: bool = False,
                layers: Stack | None = None, kept: list[int] | None = None) -> torch.Tensor:
        """Append each row's tokens; return logits (B, logits_to_keep, V) of each row's last tokens.
        only: the batch rows `rows` are for, in order (None: every row); the others are untouched.
        head: an output head in place of the model's, (R, E) -> (R, V'); only on the lean forward.
        parents: per row (or None: a chain), for each of its tokens the slot of its parent, or -1
        for the slot before its own. A token then attends the slots of its ancestors, through
        this and earlier forwards, and sits at the position of its depth: a tree's node computes
        what a plain step after its root path would (speclm.forward.attention.attend_each_query).
        hidden_layers: layer indices (-1: after the final norm) whose hidden states (B,
        logits_to_keep, E) of the same tokens the forward leaves in `self.hidden`; none asked,
        none kept (self.hidden is then None). On transformers' own forward (other architectures)
        the last layer's are after the final norm, as transformers reports them.
        hidden_all: those hidden states for every fed token, (B, M, E) (a row's columns past its
        own tokens are padding), not only for the kept ones.
        layers: a speclm.forward.lean.Stack: run only its decoder layers (with their stand-ins), then
        the final norm and head (None: all; speclm.proposers.self_draft); the others' keys and values
        are not written. Lean forward only.
        kept: per row, how many of its last tokens have logits (None: logits_to_keep each), in the
        first of its logits_to_keep columns; the columns past them are padding (zeros on the lean
        forward, never computed; read nothing from them): a round's rows whose drafts are narrower
        than the widest, fed without padding nodes."""
        counts = [len(r) for r in rows]
        width = max(counts)
        kept = [logits_to_keep] * len(rows) if kept is None else kept
        assert width >= 1 and logits_to_keep >= 1 and all(1 <= k <= min(c, logits_to_keep) for k, c in zip(kept, counts))
        batch = list(range(self.batch_size)) if only is None else list(only)
        assert len(batch) == len(rows)
        whole = only is None
        lengths = self.lengths if whole else self.lengths[batch]  # (B,)
        cache_rows = self._rows if whole else self._rows[batch]  # (B,)
        self.reserve(int(lengths.max()) + width)  # a caller that under-estimated a request's length
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long, device=self.device)  # (B, M)
        n = torch.tensor(counts, dtype=torch.long, device=self.device)  # (B,)
        offsets = self._slots[:width]  # (M,)
        slots = lengths[:, None] + offsets  # (B, M): where each token's keys and values go
        window = int(slots[:, -1].max()) + 1
        starts = lengths.tolist()
        tree = positions = None
        parents = parents if parents is not None else [None] * len(rows)
        if any(p is not None for p in parents) or any(self._links[b] for b in batch):
            assert not is_prefill(starts), "a prefill has no tree"
            tree = [self._visible(b, start, width, p) for b, start, p in zip(batch, starts, parents)]
            tree = tree if any(row is not None for row in tree) else None
        if tree is not None:
            positions = slots.clone()  # (B, M): a node's position is its depth's
            for b, row in enumerate(tree):
                if row is not None:
                    positions[b] = torch.tensor([reach + len(apart) - 1 for reach, apart in row], dtype=torch.long)
        # which columns hold each row's last `logits_to_keep` tokens; all rows agree when the
        # feed is not ragged, the usual case after prefill
        ragged = min(counts) < width
        short = min(kept) < logits_to_keep
        cols = kept_mask = None
        if ragged or short:
            k = torch.tensor(kept, dtype=torch.long, device=self.device)[:, None]  # (B, 1)
            at = self._slots[:logits_to_keep][None, :]  # (1, K)
            cols = n[:, None] - k + at  # (B, K)
            if short:
                kept_mask = at < k  # (B, K)
                cols = torch.where(kept_mask, cols, n[:, None] - 1)  # padding: the row's last token (not read)
        plan = Plan(ids, slots, starts, counts, window, cache_rows, positions, tree, logits_to_keep, cols, hidden_all,
                    layers, kept_mask)
        logits = self.runner.run(self, plan, head, tuple(hidden_layers))
        for b, start in zip(batch, starts):  # padding columns are written too
            self._reach[b] = max(self._reach[b], start + width)
        if whole:
            self.lengths = self.lengths + n
        else:
            self.lengths = self.lengths.clone()
            self.lengths[batch] += n
        return logits

    def _visible(self, b: int, start: int, width: int, parents: list[int] | None) -> list[tuple[int, list[int]]] | None:
        """Row b's (reach, apart) per column (speclm.forward.attention), its links recorded first; None
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
            apart, below = lineage(start + i, lambda s: links.get(s, s - 1), lambda s: s >= lowest)
            out.append((below + 1, apart))
        return out

    @torch.inference_mode()
    def move_path(self, row: int, sources: list[int], start: int) -> None:
        """Row `row`'s slots `sources` (ascending, each at or past its target) are copied to slots
        start, start + 1, ... in every layer: a tree's accepted path, each node's keys and values
        computed at the position of its depth, takes its place in the sequence. Nothing is
        recomputed; one gather per layer and store, none where the path already lies in place."""
        pairs = [(s, start + i) for i, s in enumerate(sources) if s != start + i]
        if pairs:
            src = torch.tensor([s for s, _ in pairs], device=self.device)
            dst = torch.tensor([t for _, t in pairs], device=self.device)
            at = int(self._rows[row])
            for i in range(len(self.keys)):
                s, d = self._place(i, src), self._place(i, dst)
                for store in (self.keys, self.values):
                    store[i][at, :, d] = store[i][at, :, s]
        self._links[row] = {s: p for s, p in self._links[row].items() if s < start}

    def truncate(self, keep: torch.Tensor | list[int]) -> None:
        """Row b keeps its first keep[b] slots; the rest are rolled back (a length moves)."""
        keep = torch.as_tensor(keep, dtype=torch.long, device=self.device)
        self.lengths = torch.minimum(self.lengths, keep)
        for links, k in zip(self._links, keep.tolist()):
            for s in [s for s in links if s >= k]:
                del links[s]

    def select(self, rows: torch.Tensor | list[int]) -> None:
        """Keep only these batch rows, in this order (finished rows leave the batch): their cache
        rows are free for rows that join later; nothing is copied."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.device)
        kept = set(rows.tolist())
        self._free += [int(self._rows[b]) for b in range(self.batch_size) if b not in kept]
        self.lengths = self.lengths[rows]
        self._links = [self._links[r] for r in rows.tolist()]
        self._reach = [self._reach[r] for r in rows.tolist()]
        self._rows = self._rows[rows]
