"""Keys and values of recent prompts, reused by later prompts that begin with the same tokens.

Chat requests share their head (the template's system turn: 24 tokens for Qwen2.5 with its
default system prompt), few-shot prompts share their examples, a conversation's next turn
shares the whole previous one. Like llama.cpp's prompt cache and vLLM's automatic prefix
caching, a request copies the keys and values of the longest prefix it shares with a recent
prompt into its own cache rows and prefills only the rest.

Only exact where a token's keys and values do not depend on how the prompt was split into
forwards (StaticKV.chunk_invariant: quantized projections and per-query attention): then a
prompt read partly from this cache gives the same bits, so the same tokens, as a prompt read
whole, and speculative output still equals plain output whatever either found here. Elsewhere
(fp32 matmuls round by shape) the engine does not use it.

Entries are whole prompts (at most `max_tokens` tokens in all, least recently used dropped
first); a prompt that extends an entry replaces it. Matching is a scan over the entries'
tokens: at most `max_tokens` comparisons. A sliding-window layer's keys are kept from its ring
(speclm.forward.cache): an entry longer than the ring serves prefixes that reach within the ring's
spare slots of its end (a conversation's next turn extends the whole previous prompt).

An entry may also hold the target's hidden states of its prompt at the layers an EAGLE head reads
(a proposer with prompt_hidden "all"): a request whose head reads every prompt token's features
only reuses an entry that holds them, so its head starts from the whole prompt, as if it had
read it (without them it would draft from the uncached tail's features alone).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from speclm.defaults import PREFIX_CACHE_TOKENS as DEFAULT_TOKENS


@dataclass
class _Entry:
    tokens: list[int]
    keys: list[torch.Tensor]  # per layer (H_kv, n, D)
    values: list[torch.Tensor]
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (n, E): the target's features


@dataclass
class PrefixCache:
    max_tokens: int = DEFAULT_TOKENS
    entries: list[_Entry] = field(default_factory=list)  # least recently used first

    @property
    def tokens(self) -> int:
        return sum(len(e.tokens) for e in self.entries)

    @property
    def nbytes(self) -> int:
        """Memory its keys and values hold."""
        return sum(t.numel() * t.element_size() for e in self.entries for t in (*e.keys, *e.values, *e.hidden.values()))

    def clear(self) -> None:
        self.entries.clear()

    def _longest(self, ids: list[int], layers: tuple[int, ...] = (), kv=None, limit: int | None = None) -> tuple[_Entry | None, int]:
        """The entry sharing the longest prefix with `ids` (at most `limit` tokens), and its length;
        with a cache `kv`, only entries whose keys it can start a row of that length from."""
        best, most = None, 0
        for entry in self.entries:
            if any(layer not in entry.hidden for layer in layers):
                continue
            n, stop = 0, min(len(entry.tokens), len(ids), len(ids) if limit is None else limit)
            while n < stop and entry.tokens[n] == ids[n]:
                n += 1
            if n > most and (kv is None or kv.loadable(entry.keys, len(entry.tokens), n)):
                best, most = entry, n
        return best, most

    def reuse(self, kv, row: int, ids: list[int], limit: int) -> int:
        """Row `row` of StaticKV `kv` (empty) starts with the keys and values of the longest
        cached prefix of `ids`, at most `limit` tokens; returns its length (0: none found)."""
        return self.reuse_states(kv, row, ids, limit)[0]

    def reuse_states(self, kv, row: int, ids: list[int], limit: int,
                     layers: tuple[int, ...] = ()) -> tuple[int, dict[int, torch.Tensor]]:
        """`reuse` from entries that also hold the hidden states at `layers`: (its length n, layer ->
        the prefix's states (n, E))."""
        if self.max_tokens <= 0 or limit <= 0 or not kv.chunk_invariant:
            return 0, {}
        entry, n = self._longest(ids, layers, kv, limit)
        if entry is None or n == 0:
            return 0, {}
        self.entries.remove(entry)
        self.entries.append(entry)  # most recently used
        kv.load_prefix(row, entry.keys, entry.values, n, len(entry.tokens))
        return n, {layer: entry.hidden[layer][:n] for layer in layers}

    def add(self, kv, row: int, ids: list[int], hidden: dict[int, torch.Tensor] | None = None) -> None:
        """Remember row `row`'s first len(ids) slots of `kv` as the keys and values of `ids`, and
        `hidden` (layer -> (len(ids), E)), the target's states there, where given."""
        n, hidden = len(ids), hidden or {}
        if self.max_tokens <= 0 or n == 0 or n > self.max_tokens or not kv.chunk_invariant:
            return
        entry, common = self._longest(ids, tuple(hidden), kv)
        if entry is not None and common == n:  # already held (as itself or inside a longer prompt)
            self.entries.remove(entry)
            self.entries.append(entry)
            return
        for old in [e for e in self.entries if len(e.tokens) <= n and e.tokens == ids[: len(e.tokens)]
                    and set(e.hidden) <= set(hidden)]:
            self.entries.remove(old)  # this prompt extends it (or holds it, with the states it lacked)
        keys, values = kv.export(row, n)
        self.entries.append(_Entry(list(ids), keys, values, {layer: h.clone() for layer, h in hidden.items()}))
        while self.tokens > self.max_tokens:
            self.entries.pop(0)


@dataclass
class PrefixCaches:
    """One engine's caches: the target's and the draft model's (each model its own keys and values)."""

    target: PrefixCache
    draft: PrefixCache

    def clear(self) -> None:
        self.target.clear()
        self.draft.clear()

    @classmethod
    def of_size(cls, max_tokens: int) -> "PrefixCaches":
        return cls(PrefixCache(max_tokens), PrefixCache(max_tokens))
