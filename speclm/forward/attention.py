"""Attention whose result for a token does not depend on the other tokens of the forward.

Speculative greedy output equals plain greedy output only if a target forward over k+1
tokens gives every token the logits a 1-token forward would. With int8 activations that is
strict: each row is quantized on its own max, so a last-bit difference upstream can move a
rounding step and change logits by far more than fp32 noise. SDPA over a block of queries
is not bit-identical to SDPA over each query alone (other blocking, GQA packing only at one
query), so during speclm's decode forwards each query attends on its own, over exactly
the slots before it; a plain step does the very same call. A prefill (every row starting
from an empty cache) runs batched: the engine prefills the prompt alone, so it is the same
forward with and without speculation. Outside speclm's forwards (e.g. transformers'
`generate` on the same model), this is transformers' SDPA attention, unchanged.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "speclm"
# A query's visible slots where they are not simply the slots up to its own: (reach, apart) =
# slots 0 .. reach - 1, then the ascending slots `apart` (a tree node's ancestors past the shared
# prefix, its own slot last). Per forward: a row's list of these per column, or None for a chain.
Tree = list  # list[list[tuple[int, list[int]]] | None], (B,) of (M,)
# per forward: each row's slots before its first new token, its number of new tokens, its tree
_PLAN: ContextVar[tuple | None] = ContextVar("speclm_attention_plan", default=None)


def is_prefill(starts: list[int]) -> bool:
    """Every row starts from an empty cache: attend batched (see the module docstring)."""
    return not any(starts)


@contextmanager
def per_query(starts: list[int], counts: list[int], tree: Tree | None = None):
    token = _PLAN.set((starts, counts, tree))
    try:
        yield
    finally:
        _PLAN.reset(token)


def attend_each_query(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, starts: list[int],
                      counts: list[int], scaling: float | None, tree: Tree | None = None,
                      cache_rows: list[int] | None = None, window: int = 0, softcap: float | None = None,
                      ring: int = 0) -> torch.Tensor:
    """q (B, M, H, D); keys, values (P, H_kv, >= W, D) -> (B, M, H, D): row b's query i attends
    alone over slots [0, starts[b] + i] of cache row cache_rows[b] (None: row b, P = B); padding
    columns (i >= counts[b]) stay zero. tree: where a row holds a tree (speclm.forward.cache.StaticKV.forward's
    parents), query i attends slots [0, reach) and then `apart`: the slots and order of a plain
    step at its position. window: a sliding window's keys (0: none), a query at position p sees
    the keys of positions p - window + 1 .. p (transformers' sliding mask); softcap: scores
    cap * tanh(s / cap) before the softmax (Gemma 2); ring: the cache rows are rings of this many
    slots, slot s at s mod ring (a sliding layer's, speclm.forward.cache; 0: slot s at s)."""
    batch, width, heads, dim = q.shape
    kv_heads = keys.shape[1]
    groups = heads // kv_heads  # query head h reads kv head h // groups, as repeat_kv lays them out

    def visible(t: torch.Tensor, b: int, i: int) -> torch.Tensor:  # (1, H_kv, slots, D) query (b, i) reads
        reach, apart = (starts[b] + i + 1, []) if tree is None or tree[b] is None else tree[b][i]
        low = max(0, reach + len(apart) - window) if window else 0  # the first position seen
        if low > reach:  # leading slots hold their positions, those apart positions reach, reach + 1, ...
            apart, reach = apart[low - reach:], low
        if ring:
            return t[:, :, torch.cat([torch.arange(low, reach), torch.tensor(apart, dtype=torch.long)]).to(t.device) % ring]
        if not apart:
            return t[:, :, low:reach]
        return torch.cat([t[:, :, low:reach], t[:, :, apart]], dim=2)

    per_row = []
    for b in range(batch):
        at = b if cache_rows is None else cache_rows[b]
        row_keys, row_values = (keys, values) if keys.shape[0] == 1 else (keys[at : at + 1], values[at : at + 1])
        outs = [_attend(qi.reshape(1, kv_heads, groups, dim), visible(row_keys, b, i), visible(row_values, b, i), scaling,
                        softcap)
                for i, qi in enumerate(q[b].unbind(0)[: counts[b]])]  # qi (H, D): a kv head's query heads as its "queries"
        outs += [q.new_zeros(1, kv_heads, groups, dim)] * (width - counts[b])  # padding columns
        per_row.append(torch.cat(outs) if width > 1 else outs[0])  # (M, H_kv, G, D)
    out = per_row[0][None] if batch == 1 else torch.stack(per_row)  # (B, M, H_kv, G, D)
    return out.view(batch, width, heads, dim)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float | None, softcap: float | None = None,
            mask: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
    """softmax(q k^T * scaling [soft-capped] [masked]) v for q (B, H, M, D) and k, v (B, H_kv, S, D),
    query head h reading kv head h // (H / H_kv): SDPA, or where scores are soft-capped (which
    SDPA cannot do) the same formula as transformers' eager attention."""
    gqa = q.shape[1] > k.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=scaling,
                                              enable_gqa=gqa)
    if gqa:  # the eager formula reads one kv head per query head
        k, v = k.repeat_interleave(q.shape[1] // k.shape[1], 1), v.repeat_interleave(q.shape[1] // k.shape[1], 1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (scaling if scaling is not None else q.shape[-1] ** -0.5)
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif causal:
        scores = scores.masked_fill(~torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(), float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _within_window(queries: int, keys: int, window: int, device) -> torch.Tensor:
    """(queries, keys) bool: key j within query i's sliding window (transformers' kv > q - window),
    a prefill's queries and keys both counted from position 0."""
    at = torch.arange(max(queries, keys), device=device)
    return at[None, :keys] > at[:queries, None] - window


def attend_prefill(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float | None, window: int = 0,
                   softcap: float | None = None) -> torch.Tensor:
    """A batched prefill: q (B, M, H, D), every row from slot 0, left-aligned; keys, values
    (B, H_kv, M, D) -> (B, M, H, D). Its mask is the causal one (which lets SDPA skip the blocks
    above the diagonal), within the sliding window where there is one."""
    width = q.shape[1]
    mask = None
    if window and window < width:
        mask = torch.ones(width, width, dtype=torch.bool, device=q.device).tril() & _within_window(width, width, window, q.device)
    return _attend(q.transpose(1, 2), keys, values, scaling, softcap, mask, causal=True).transpose(1, 2)


def exact_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                    **kwargs):
    """transformers' attention interface: query (B, H, M, D); key, value (B, H_kv, W, D) -> (B, M, H, D).
    A layer's sliding window (`sliding_window`) and soft-capped scores (`softcap`) are honoured
    on every path: speclm's prefill mask is causal only, and SDPA has no soft-cap."""
    plan = _PLAN.get()
    window, softcap = kwargs.pop("sliding_window", None) or 0, kwargs.pop("softcap", None)
    if plan is None or is_prefill(plan[0]):
        if plan is not None and window and attention_mask is not None and attention_mask.dtype == torch.bool:
            # speclm's prefill (slots are positions): its causal mask, within the window
            attention_mask = attention_mask & _within_window(query.shape[2], key.shape[2], window, query.device)
        if softcap is None:
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                          **kwargs)
        mask = attention_mask if attention_mask is None or attention_mask.dtype == torch.bool else attention_mask == 0
        out = _attend(query, key, value, scaling, softcap, None if mask is None else mask[:, :, :, : key.shape[2]],
                      causal=mask is None and query.shape[2] > 1)  # as SDPA's is_causal where transformers gives no mask
        return out.transpose(1, 2), None
    return attend_each_query(query.transpose(1, 2), key, value, plan[0], plan[1], scaling, plan[2],
                             window=window, softcap=softcap), None


AttentionInterface.register(NAME, exact_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)


def use_exact_attention(model) -> None:
    """Switch a transformers model to this attention (SDPA whenever speclm is not decoding)."""
    if getattr(model.config, "_attn_implementation", None) == NAME:
        return
    try:
        model.set_attn_implementation(NAME)
    except (AttributeError, ValueError):
        model.config._attn_implementation = NAME
