"""A lean forward for the decoders speclm.forward.decoders describes (Llama, Qwen2/3, Mistral, Phi-3,
Gemma 2/3), over speclm's KV cache.

transformers' eager forward spends part of every step in Python (module calls, mask and
cache bookkeeping), which counts on a CPU next to int8 weights: there every aten op costs
microseconds, more right after a GEMM has streamed its weights through the caches. This
forward runs the model's own weights (nn.Linear or speclm.quant.weights's int8 kernels, so the model
object stays what transformers' `generate` uses too) in one flat loop per layer, on the
hidden state as (rows, features), with as few ops between the GEMMs as it can.

Attention is per query over exactly the slots before it (see speclm.forward.attention for why),
except in a prefill of a model whose projections are not quantized, which is one causal SDPA
call over the batch (on quantized weights a prefill attends per query too: LeanForward's
chunk_invariant says why).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from speclm.quant import kernels
from speclm.forward import decoders
from speclm.forward.attention import attend_each_query, attend_prefill, is_prefill
from speclm.forward.decoders import Decoder
from speclm.defaults import FP32_FEW_ROWS, FP32_PADDED_ROWS, PREFILL_ROW_BLOCK
from speclm.quant.weights import Int8Slice, QuantLinear, dense_linear, int4_copy, quantize_linears, quantized_bytes

Rows = Callable[[torch.Tensor], torch.Tensor]  # (R, in) -> (R, out), row by row

# Row-wise work (norms, projections, MLP) of a long feed runs in blocks of ROW_BLOCK rows: a
# block's activations, (rows, intermediate) floats, then stay in the CPU's cache, where the
# elementwise passes between the GEMMs run several times faster than over a prompt-long tensor.
# Rows are independent, so the bits do not change.
ROW_BLOCK = PREFILL_ROW_BLOCK


def supports(model) -> bool:
    return decoders.describe(model) is not None


def _few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b for x (R, in). Over up to FP32_FEW_ROWS rows on a CPU as (W x^T)^T: on the AVX2
    machine torch's MKL runs x W^T over 2 to 11 rows at 1.5-3.2x the cost of W x^T, which reads the
    weights once (benchmarks/avx2/records.md#fp32-linear-rows). Zero rows pad 2-3 rows to 4 and 13-15 to
    16, MKL's cheap shapes there: 4 rows cost what 1 does, 3 rows 1.45x; 13-15 rows 1.6-2.0x 16 rows'.
    The same fp32 products, summed as MKL chooses for the shape: fp32 stays exact up to near-ties."""
    rows = x.shape[0]
    if rows > FP32_FEW_ROWS:
        return F.linear(x, weight, bias)
    padded = FP32_PADDED_ROWS.get(rows, rows)  # a chain of k = 2 (fp32's default) verifies 3 tokens
    if padded != rows:
        x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
    y = torch.mm(weight, x.t()).t()[:rows].contiguous()
    return y.add_(bias) if bias is not None else y


def _projection(module: nn.Module) -> Rows:
    """A linear layer of the model as a function of (R, in) rows."""
    if isinstance(module, QuantLinear):
        return module.rows
    if isinstance(module, nn.Linear):
        if module.weight.dtype == torch.float32 and module.weight.device.type == "cpu":
            return partial(_few_rows_linear, weight=module.weight, bias=module.bias)
        return partial(F.linear, weight=module.weight, bias=module.bias)
    if isinstance(module, Int8Slice):
        return lambda x: module.fused.kernel.rows(x)[:, module.start : module.stop]
    return module


def _side_by_side(modules: list[nn.Module]) -> Rows:
    """Projections that read one input, outputs concatenated: one GEMM where speclm.quant.weights fused them."""
    first = modules[0]
    if isinstance(first, Int8Slice) and first.start == 0 and all(
            isinstance(m, Int8Slice) and m.fused is first.fused for m in modules) and modules[-1].stop == (
            first.fused.kernel.out_features):
        return first.fused.kernel.rows
    projections = [_projection(m) for m in modules]
    if len(projections) == 1:  # already one layer (Phi-3's qkv_proj)
        return projections[0]
    return lambda x: torch.cat([p(x) for p in projections], dim=-1)


def _rms_norm(norm: nn.Module, decoder: Decoder, dtype: torch.dtype, compiled=None) -> Rows:
    """transformers' RMSNorm formula (fp32 statistics, weight after; Gemma's weight is 1 + w):
    speclm's compiled kernel where it runs (one call instead of F.rms_norm's several ops), else
    one aten op."""
    weight, eps = decoders.norm_weight(norm, decoder), decoders.norm_eps(norm)
    if dtype == torch.float32 and compiled is not None and weight.shape[0] % 16 == 0:
        return partial(compiled.rms_norm, weight=weight, eps=eps)
    if dtype == torch.float32:
        return partial(F.rms_norm, normalized_shape=weight.shape, weight=weight, eps=eps)

    def rms(x):
        x32 = x.float()
        return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return rms


def _by_rows(fn: Callable[..., torch.Tensor], *xs: torch.Tensor) -> torch.Tensor:
    """fn over tensors of R rows in blocks of ROW_BLOCK rows."""
    if xs[0].shape[0] <= ROW_BLOCK:
        return fn(*xs)
    return torch.cat([fn(*blocks) for blocks in zip(*(x.split(ROW_BLOCK) for x in xs))])


def _plus_residual(module: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """(x, h) -> h + projection(x); int8 layers add h inside their kernel call."""
    if isinstance(module, QuantLinear):
        return lambda x, h: module.rows(x, h)
    projection = _projection(module)
    return lambda x, h: h + projection(x)


@dataclass
class _Layer:
    attn_in: Rows  # (R, E) -> (R, (H + 2 H_kv) D): input norm, then q | k | v (q and k normed per head where the family does)
    attn_out: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (R, H D), h (R, E) -> h + o_proj (post-normed where the family does)
    mlp: Rows  # h (R, E) -> h + gated MLP(norm(h))
    window: int = 0  # a sliding window's keys, 0: full attention
    rope: str = ""  # its rotary table, a key of the Decoder's tables


def _per_head(norm: Rows, width: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """A norm over each head's D features of x (R, n D) -> (R, n D)."""
    return lambda x: norm(x.reshape(-1, width)).view(x.shape)


def _layer(layer: nn.Module, decoder: Decoder, index: int, dtype: torch.dtype, compiled, shape: tuple[int, int, int]) -> _Layer:
    """shape: (H, H_kv, D)."""
    family = decoder.family
    attn, mlp = layer.self_attn, layer.mlp
    norm = partial(_rms_norm, decoder=decoder, dtype=dtype, compiled=compiled)
    norm1 = norm(layer.input_layernorm)
    qkv = _side_by_side([getattr(attn, n) for n in family.qkv])
    heads, kv_heads, dim = shape
    if family.qk_norm:
        q_norm, k_norm = _per_head(norm(attn.q_norm), dim), _per_head(norm(attn.k_norm), dim)
        q_end, k_end = heads * dim, (heads + kv_heads) * dim

        def attn_in(x):
            out = qkv(norm1(x))  # (R, (H + 2 H_kv) D), a fresh tensor
            out[:, :q_end] = q_norm(out[:, :q_end])
            out[:, q_end:k_end] = k_norm(out[:, q_end:k_end])
            return out
    else:
        def attn_in(x):
            return qkv(norm1(x))
    if family.sandwich:  # h + norm(o_proj(x)): the residual cannot be added inside the kernel
        o_proj, post_attn = _projection(attn.o_proj), norm(layer.post_attention_layernorm)
        pre_mlp, post_mlp = norm(layer.pre_feedforward_layernorm), norm(layer.post_feedforward_layernorm)
        attn_out = lambda x, h: h + post_attn(o_proj(x))  # noqa: E731
        down_fn = _projection(mlp.down_proj)
        down = lambda x, h: h + post_mlp(down_fn(x))  # noqa: E731
    else:
        attn_out, pre_mlp, down = _plus_residual(attn.o_proj), norm(layer.post_attention_layernorm), _plus_residual(mlp.down_proj)
    parts = [getattr(mlp, n) for n in family.gate_up]
    gate_up = _projection(parts[0]) if len(parts) == 1 else _side_by_side(parts) if isinstance(parts[0], Int8Slice) else None
    gate_fn, up_fn = (_projection(parts[0]), _projection(parts[1])) if gate_up is None else (None, None)
    silu = family.activation == "silu"
    fused_act = compiled.silu_mul if silu and compiled is not None and dtype == torch.float32 else None
    act = F.silu if silu else partial(F.gelu, approximate="tanh")

    def mlp_block(h):
        x = pre_mlp(h)
        if gate_up is not None:  # one GEMM, (R, 2 I)
            both = gate_up(x)
            if fused_act is not None:
                return down(fused_act(both), h)
            inner = both.shape[1] // 2
            return down(act(both[:, :inner]).mul_(both[:, inner:]), h)
        return down(act(gate_fn(x)).mul_(up_fn(x)), h)

    return _Layer(attn_in=attn_in, attn_out=attn_out, mlp=mlp_block, window=decoder.windows[index], rope=decoder.ropes[index])


@dataclass(frozen=True)
class Stack:
    """The decoder layers a forward runs, ascending, and stand-ins for some of them (a
    lower-precision copy of their weights: speclm.proposers.self_draft); the others run as they are.
    A forward given none runs every layer."""

    indices: tuple[int, ...]
    copies: dict = field(default_factory=dict, hash=False, compare=False)  # index -> _Layer


def int4_stack(model, indices: tuple[int, ...], progress: Callable[[], None] = lambda: None
               ) -> tuple[Stack, nn.Module, int]:
    """An int4 copy of the model's layers `indices` and of its output head, made from its own
    weights (fp32, or int8 de-quantized) one layer at a time: the Stack, the head (a quantized
    linear layer: its `rows` map (R, E) -> (R, V)), and the copy's bytes. The model itself is untouched. `progress` is called after each layer and
    after the head."""
    inner = model.model
    decoder = decoders.describe(model)
    dtype = inner.norm.weight.dtype
    compiled = kernels.compiled() if inner.norm.weight.device.type == "cpu" else None
    copies, size = {}, 0
    for i in indices:
        layer = inner.layers[i]
        stand_in = nn.Module()
        for part, names in decoder.projections:  # the layer's norms as they are, its projections copied
            setattr(stand_in, part, nn.Module())
            for name, child in getattr(layer, part).named_children():
                if name not in names:
                    setattr(getattr(stand_in, part), name, child)
            for name in names:
                setattr(getattr(stand_in, part), name, dense_linear(getattr(getattr(layer, part), name)))
        for name, child in layer.named_children():
            if name not in ("self_attn", "mlp"):
                setattr(stand_in, name, child)
        quantize_linears(stand_in, "int4")  # q|k|v and gate|up fused, as the model's own int8 layers are
        size += sum(quantized_bytes(m) for m in _kernels_of(stand_in))
        copies[i] = _layer(stand_in, decoder, i, dtype, compiled, _shape(model.config))
        progress()
    head = int4_copy(model.get_output_embeddings())
    progress()
    return Stack(tuple(indices), copies), head, size + quantized_bytes(head)


def _shape(cfg) -> tuple[int, int, int]:
    """(H, H_kv, D) of a model config."""
    heads = cfg.num_attention_heads
    return heads, getattr(cfg, "num_key_value_heads", None) or heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // heads


def _kernels_of(module: nn.Module) -> list[QuantLinear]:
    """The quantized layers under `module`, each once (fused siblings share one)."""
    out = {}
    for m in module.modules():
        kernel = m.fused.kernel if isinstance(m, Int8Slice) else m
        if isinstance(kernel, QuantLinear):
            out[id(kernel)] = kernel
    return list(out.values())


class LeanForward:
    def __init__(self, model):
        cfg = model.config
        inner = model.model
        self.embed = inner.embed_tokens  # nn.Embedding, or speclm.forward.embedding's compact table (fp32 rows)
        dtype, device = inner.norm.weight.dtype, inner.norm.weight.device
        # None where it does not run, and for a model off the CPU: torch's ops instead
        compiled = kernels.compiled() if device.type == "cpu" else None
        self.compiled = compiled
        self.decoder = decoder = decoders.describe(model)
        self.heads, self.kv_heads, self.head_dim = shape = _shape(cfg)
        self.layers = [_layer(layer, decoder, i, dtype, compiled, shape) for i, layer in enumerate(inner.layers)]
        self.norm = _rms_norm(inner.norm, decoder, dtype, compiled)
        self.head = _projection(model.get_output_embeddings())
        self.scaling = decoder.scaling
        self.embed_scale = decoder.embed_scale
        self.final_softcap = decoder.final_softcap
        # Quantized projections (each row quantized alone, speclm.quant.weights) and speclm's per-query
        # attention make a token's keys and values independent of how its prompt is split into
        # forwards: then every forward, a prefill too, attends per query, and keys and values
        # cached from an earlier prompt are the bits this prompt's own prefill would compute
        # (speclm.forward.prefix_cache). SDPA's batched prefill would round otherwise.
        self.chunk_invariant = (
            compiled is not None and dtype == torch.float32 and self.head_dim % 32 == 0
            and all(isinstance(getattr(getattr(layer, part), name, None), (QuantLinear, Int8Slice))
                    for layer in inner.layers for part, names in decoder.projections for name in names
                    if hasattr(getattr(layer, part), name)))
        # The compiled decode attention rotates whole heads: a partial rotary (Phi-4-mini) attends
        # through torch's ops instead.
        self.kernel_attention = decoder.rotary_dim == self.head_dim
        # rotary tables by name and position, grown on demand, on the model's device
        self._tables = {name: (rope, *[torch.empty(0, decoder.rotary_dim, device=rope.inv_freq.device)] * 2)
                        for name, rope in decoder.tables.items()}

    def _grow_rotary(self, window):
        """Each rotary table's cos and sign-folded sin (P, D_rot) covering `window` positions,
        computed once per length: rotate_half(x) * sin == roll(x, D_rot/2) * [-sin, sin], one roll
        instead of two slices, a negation and a cat (the same products, so the same bits)."""
        for name, (rope, cos, sin) in self._tables.items():
            if window > cos.shape[0]:
                length = max(window, 2 * cos.shape[0])
                at = torch.arange(length, dtype=torch.float32, device=rope.inv_freq.device)[:, None]
                freqs = at * rope.inv_freq
                if rope.long_inv_freq is not None and length > rope.switch:  # LongRoPE past its original length
                    freqs[rope.switch :] = at[rope.switch :] * rope.long_inv_freq
                cos = torch.cat((freqs, freqs), dim=-1).cos() * rope.scale  # (P, D_rot)
                half = freqs.sin() * rope.scale
                self._tables[name] = (rope, cos, torch.cat((-half, half), dim=-1))

    @torch.inference_mode()
    def __call__(self, ids, slots, kv, starts, counts, window, keep_cols, head=None, positions=None, tree=None,
                 hidden_layers: tuple[int, ...] = (), hidden: dict | None = None, cache_rows=None,
                 hidden_all: bool = False, layers: Stack | None = None, kept_mask: torch.Tensor | None = None):
        """ids, slots (B, M); kv: the StaticKV (its buffers are written at `slots`);
        starts, counts: per row, slots before this forward and new tokens; window: slots a
        prefill attends over; keep_cols: which columns' logits to return (a slice or an index tensor);
        head: (R, E) -> (R, V') in place of the model's output head (a draft's restricted vocabulary);
        positions (B, M), tree: where some rows hold a tree (speclm.forward.cache.StaticKV.forward), each token's
        position and the slots each query attends (speclm.forward.attention.Tree), else None.
        hidden_layers, hidden: the dict `hidden` receives, for each layer index asked, the hidden
        states (B, K, E) of the kept rows: layer i's output (the residual stream after it), and for
        -1 the final norm's, what the output head reads. Nothing is kept when none are asked.
        cache_rows (B,): each row's cache row in kv's pool (None: row b).
        hidden_all: the hidden states of every fed token (B, M, E), not only the kept ones (a head
        reading a prompt's features); the last layer then runs on every row.
        layers: only these decoder layers run, with their stand-ins (None: all), then the final norm
        and the head: the target's own layers as a draft (speclm.proposers.self_draft). The others'
        keys and values are left as they are.
        kept_mask (B, K): which of keep_cols' columns hold a row's token (None: all); the others'
        logits and hidden states are zeros, never computed (a round's row whose draft is narrower
        than the batch's widest).

        A ragged feed (some row shorter than M) is packed: embedding, norms, projections, MLP and
        head run on the T real tokens alone, and only attention sees the (B, M) layout (whose
        padding columns it skips), so padding costs nothing where it matters. Rows are
        independent in every row-wise op, so on speclm's kernels the bits do not change."""
        batch, width = ids.shape
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        real = inverse = None  # packed: the real tokens' indices into the R = B M columns, and back
        if min(counts) < width:
            real = (kv._slots[:width][None, :] < torch.tensor(counts, device=ids.device)[:, None]).view(-1).nonzero()[:, 0]  # (T,)
            inverse = torch.full((batch * width,), -1, dtype=torch.long, device=ids.device)
            inverse[real] = torch.arange(len(real), device=ids.device)
            h = self.embed(ids.view(-1)[real]).view(len(real), -1)  # (T, E)
        else:
            h = self.embed(ids).view(batch * width, -1)  # (R, E), R = B M
        if self.embed_scale is not None:  # Gemma's sqrt(E), in the rows' dtype
            h = h * torch.tensor(self.embed_scale, dtype=h.dtype)
        self._grow_rotary(window)
        rot = self.decoder.rotary_dim
        half, split = rot // 2, (heads + kv_heads) * dim
        softcap = self.decoder.attn_softcap
        per_query = self.chunk_invariant or not is_prefill(starts)
        rows = torch.arange(batch, device=ids.device)[:, None]  # (B, 1) batch rows
        cache_rows = rows[:, 0] if cache_rows is None else cache_rows  # (B,)
        cache_list = cache_rows.tolist()
        at_rows = cache_rows[:, None]  # (B, 1) where each row's keys and values live
        one_row = batch == 1
        start = starts[0]
        # a decode forward: rotary, cache writes and attention in one compiled call per layer
        compiled = self.compiled if (per_query and h.dtype == torch.float32 and dim % 32 == 0 and self.kernel_attention
                                     and kv.keys[0].dtype == torch.float32) else None
        at = slots if positions is None else positions
        flat = _flat_tree(tree, starts, width) if tree is not None else []  # the compiled kernel's form
        rotary = {}  # the torch ops' rotary, per table: cos and sin (R, 1, D_rot) at these positions
        if compiled is None:
            for name, (_, cos, sin) in self._tables.items():
                rotary[name] = (cos[at.view(-1)].to(h.dtype)[:, None, :], sin[at.view(-1)].to(h.dtype)[:, None, :])
        # The rows whose logits are returned, as indices into the R rows; None: all of them. The
        # last layer's output projection and MLP run on these alone: the other rows (a prompt's
        # all but last) need only their keys and values, which its attention has written by then.
        kept_rows = None
        if isinstance(keep_cols, slice):
            cols = kv._slots[:width][keep_cols]  # (K,)
            keep = len(cols)
            if keep < width or real is not None or kept_mask is not None:
                kept_rows = (rows * width + cols).view(-1)
        else:
            keep = keep_cols.shape[1]
            kept_rows = (rows * width + keep_cols).view(-1)
        kept_flat = None if kept_mask is None else kept_mask.reshape(-1)  # (B K,) which kept entries are tokens
        if kept_rows is not None:
            kept_rows = kept_rows if kept_flat is None else kept_rows[kept_flat]
            kept_rows = kept_rows if inverse is None else inverse[kept_rows]  # into h's rows
            assert inverse is None or bool((kept_rows >= 0).all()), "logits asked of a padding column"

        def as_kept(x):  # x (S, E) over the kept tokens -> (B, K, E), zeros at kept_mask's padding
            if kept_flat is None:
                return x.view(batch, -1, x.shape[-1])
            out = x.new_zeros(batch * keep, x.shape[-1])
            out[kept_flat] = x
            return out.view(batch, keep, -1)

        def as_fed(x):  # x over every fed token (T or R rows) -> (B, M, E), zeros at padding
            if real is None:
                return x.view(batch, width, -1)
            out = x.new_zeros(batch * width, x.shape[-1])
            out[real] = x
            return out.view(batch, width, -1)
        running, copies = (range(len(self.layers)), {}) if layers is None else (layers.indices, layers.copies)
        last = running[-1]
        laid_out = None  # a ragged feed's (R, (H + 2 H_kv) D) for attention, its padding rows zeros: one per forward
        for i in running:
            layer = copies.get(i) or self.layers[i]
            qkv = _by_rows(layer.attn_in, h)  # (R or T, (H + 2 H_kv) D)
            if real is not None:  # attention reads the (B, M) layout (and never writes it)
                if laid_out is None or laid_out.shape[1] != qkv.shape[1] or laid_out.dtype != qkv.dtype:
                    laid_out = qkv.new_zeros(batch * width, qkv.shape[1])
                laid_out[real] = qkv
                qkv = laid_out
            # this layer's cache: its keys and values (P, H_kv, capacity or ring size, D), which cache row
            # each batch row reads, and its ring size (0: none); a forward too wide for the ring runs
            # over a flat copy of the rows it reads (speclm.forward.cache's module docstring)
            ring = kv.ring(i)
            keys, values, layer_rows, layer_at = kv.keys[i], kv.values[i], cache_list, at_rows
            wide = ring and kv.flat(i, starts, width)
            if wide:
                keys, values = kv.flat_copy(i, starts, width, cache_list)
                layer_rows, layer_at, ring = list(range(batch)), rows, 0
            if compiled is not None:
                _, cos, sin = self._tables[layer.rope]
                out = compiled.decode_attention(qkv, cos, sin, keys, values, starts, counts,
                                                heads, kv_heads, self.scaling, flat,
                                                cache_rows=layer_rows, window=layer.window, softcap=softcap or 0.0,
                                                ring=bool(ring))  # (R, H D)
            else:
                cos, sin = rotary[layer.rope]
                qk = qkv[:, :split].view(-1, heads + kv_heads, dim)
                if rot == dim:
                    qk = qk * cos + qk.roll(half, dims=-1) * sin  # rotary on q and k at once
                else:  # partial rotary: the first D_rot features of each head
                    turned = qk[..., :rot]
                    qk = torch.cat((turned * cos + turned.roll(half, dims=-1) * sin, qk[..., rot:]), dim=-1)
                q = qk[:, :heads].view(batch, width, heads, dim)
                k = qk[:, heads:].view(batch, width, kv_heads, dim)
                v = qkv[:, split:].view(batch, width, kv_heads, dim)
                if one_row and not ring:  # the usual case: a slice copy, no scatter
                    keys[layer_rows[0], :, start : start + width] = k[0].transpose(0, 1)
                    values[layer_rows[0], :, start : start + width] = v[0].transpose(0, 1)
                else:
                    places = slots % ring if ring else slots
                    keys[layer_at, :, places] = k.to(keys.dtype)
                    values[layer_at, :, places] = v.to(values.dtype)
                if per_query:
                    out = attend_each_query(q, keys, values, starts, counts, self.scaling, tree, layer_rows,
                                            window=layer.window, softcap=softcap, ring=ring)  # (B, M, H, D)
                else:  # a prefill from slot 0: a ring holds it unwrapped (a wider one runs flat)
                    if layer_rows != list(range(keys.shape[0])):  # the batch's own rows of the pool
                        keys, values = keys[layer_at[:, 0]], values[layer_at[:, 0]]
                    out = attend_prefill(q, keys[:, :, :window], values[:, :, :window], self.scaling,
                                         window=layer.window, softcap=softcap)  # (B, M, H, D)
                out = out.reshape(batch * width, heads * dim)
            if wide:
                kv.settle(i, keys, values, starts, counts, cache_list)
            if real is not None:
                out = out[real]  # (T, H D)
            if i == last and kept_rows is not None and not hidden_all:
                out, h = out[kept_rows], h[kept_rows]
            h = _by_rows(layer.attn_out, out, h)
            h = _by_rows(layer.mlp, h)
            if i in hidden_layers:
                if hidden_all:
                    hidden[i] = as_fed(h)
                else:
                    hidden[i] = as_kept(h if i == last or kept_rows is None else h[kept_rows])
        head = self.head if head is None else head
        normed = self.norm(h)
        if -1 in hidden_layers:
            hidden[-1] = as_fed(normed) if hidden_all else as_kept(normed)
        if hidden_all and kept_rows is not None:
            normed = normed[kept_rows]
        logits = head(normed).float()  # (S, V): the kept tokens, row by row
        if self.final_softcap is not None:  # Gemma 2's cap * tanh(logits / cap)
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return as_kept(logits) if kept_flat is not None else logits.view(batch, -1, logits.shape[-1])  # (B, K, V)


def _flat_tree(tree: list, starts: list[int], width: int) -> list[int]:
    """speclm.forward.attention's Tree as decode_attention's `tree` vector (speclm/quant/csrc/common.h): B M + 1
    offsets, then each query's [reach, slots apart...]; a chain row's queries reach their slot."""
    rows = len(starts) * width
    offsets: list[int] = []
    body: list[int] = []
    for b, row in enumerate(tree):
        for i in range(width):
            reach, apart = row[i] if row is not None else (starts[b] + i + 1, ())
            offsets.append(rows + 1 + len(body))
            body.append(reach)
            body.extend(apart)
    return offsets + [rows + 1 + len(body)] + body
