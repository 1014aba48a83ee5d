"""int8 weights for every linear layer of a transformers model, output head included.

Speculative output equals plain output only if the target's forward is batch-invariant: a
token's logits must not depend on how many other tokens share the forward. The kernel kept
here is W8A8 with *per-row* scales: weights int8 per output channel (symmetric), each
activation row quantized to int8 with its own scale, products accumulated in int32 (exact
integer arithmetic: speclm's compiled kernel (AVX-512 VNNI or AVX2, speclm.quant.kernels) for every
row count; where it does not run, `torch._int_mm` for one row and oneDNN's int8 GEMM for more where
it sums exactly (a CPU with VNNI)), then rescaled elementwise. Nothing couples the rows, so the
result is bit-identical at any batch width. torch's `quantize_dynamic` uses one
activation scale for the whole batch and is *not* batch-invariant; the weight-only
`_weight_int8pack_mm` path is invariant but its cost grows with the rows. The measurements
behind the choice are in benchmarks/int8_kernels.py, benchmarks/int8_model.py and
benchmarks/int8_gemm_rows.py.

Quantized weights are cached on disk in the compiled kernels' layout (`state` and `from_state`
here, the file in speclm.models.qcache); oneDNN's packed copy is opaque and made again at load.
"""

from __future__ import annotations

import functools
import os
import sys

import torch
from torch import nn

from speclm.quant import kernels
from speclm.defaults import VNNI_MAX_ROWS
from speclm.errors import UsageError
from speclm.runtime import QUANTIZE_MODES

# Adding 1.5 * 2**23 to a float32 of magnitude < 2**22 leaves no fraction bits, so x + M - M is
# x rounded half to even: the same integers as torch.round, in two vectorised additions.
_MAGIC = 12582912.0


def _weights_of(linears: tuple[nn.Linear, ...]) -> torch.Tensor:
    """(sum of out, in): the layers' weights side by side; one layer's without a copy (an output head's is GBs)."""
    if len(linears) == 1:
        return linears[0].weight.detach()
    return torch.cat([lin.weight.detach() for lin in linears])


# Quantizing works through this many weights at a time: an output head's temporaries stay small
# (each row is quantized alone, so the blocks give the same integers).
_QUANT_BLOCK = 1 << 22


def int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (out, in) -> int8 (out, in) and fp32 scale (out,), symmetric, max-abs."""
    out_f, in_f = weight.shape
    q = torch.empty(out_f, in_f, dtype=torch.int8)
    scale = torch.empty(out_f)
    step = max(1, _QUANT_BLOCK // max(1, in_f))
    for lo in range(0, out_f, step):
        w = weight[lo : lo + step].detach().float()
        s = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        q[lo : lo + step] = (w / s[:, None]).clamp_(-127, 127).add_(_MAGIC).sub_(_MAGIC)  # = torch.round, vectorised
        scale[lo : lo + step] = s
    return q, scale


def _quantized_rows(x: torch.Tensor, features: int, signed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., in) -> int8 rows (R, in), or u8 ones with zero point 128, and each row's step (R, 1):
    max |x| / 127, so that a row's largest entry maps to +-127."""
    rows = x if x.dim() == 2 else x.reshape(-1, features)
    if rows.dtype != torch.float32:
        rows = rows.float()  # (R, in)
    step = rows.abs().amax(dim=1, keepdim=True).clamp_min_(1e-12).div_(127.0)  # (R, 1)
    scaled = rows / step  # (R, in) in [-127, 127]; a new tensor, the input stays untouched
    # the same integers either way (round half to even, tested): round_ is one op, which counts
    # at one row; the two additions vectorise better over the many rows of a prefill
    if signed:
        return scaled.round_().to(torch.int8), step
    return scaled.add_(_MAGIC).sub_(_MAGIC - 128.0).to(torch.uint8), step  # round(scaled) + 128: 1..255


def int8_kernels(compiled: bool | None = None, onednn: bool | None = None) -> str:
    """The int8 GEMM kernels a layer runs (by default: what this process picks), in words; said in
    `generate`'s statistics line and bench reports, since the path decides the speed."""
    compiled = _compiled_kernel() is not None if compiled is None else compiled
    onednn = onednn_used(compiled) if onednn is None else onednn
    if compiled:
        name = kernels.describe() or "speclm's kernel"
        return f"{name} up to {VNNI_MAX_ROWS} rows, onednn for more" if onednn else name
    if onednn:
        return "_int_mm for one row, onednn for more"
    return "_int_mm for one row, exact fp32 GEMM for more" if EXACT_FLOAT_GEMM else "_int_mm"


# Where neither speclm's kernel nor an exact oneDNN runs (SPECLM_KERNELS=torch on a CPU without
# VNNI, or a failed build), torch._int_mm is a
# plain loop (about 6 G int8 operations/s on 2 AVX2 cores: a 256-row prefill block of one MLP
# matrix takes 1.2 s) and its cost grows with the rows. An fp32 GEMM over int8 values is exact in
# chunks of EXACT_CHUNK input features: every product and partial sum is an integer below
# 127 * 127 * 1024 < 2**24, so any order of additions gives the same integer; the chunks' sums are
# added in int32. It computes _int_mm's very integers (tested) at MKL's speed, for an fp32 copy of
# the weights. One row keeps _int_mm, which reads a quarter of the bytes.
EXACT_FLOAT_GEMM = True
EXACT_CHUNK = 1024


def _exact_float_gemm(xq: torch.Tensor, fweight: torch.Tensor) -> torch.Tensor:
    """xq (R, in) int8, fweight (in, out) fp32 holding int8 values -> (R, out) int32, exactly
    xq @ fweight."""
    xf = xq.float()
    acc = None
    for lo in range(0, xf.shape[1], EXACT_CHUNK):
        part = (xf[:, lo : lo + EXACT_CHUNK] @ fweight[lo : lo + EXACT_CHUNK]).to(torch.int32)  # exact integers
        acc = part if acc is None else acc.add_(part)
    return acc


@functools.lru_cache(maxsize=None)
def _onednn_available() -> bool:
    """oneDNN's int8 GEMM is used only where it computes exact integer sums. On a CPU without VNNI
    it multiplies u8 by s8 with vpmaddubsw, whose pairwise sums saturate at int16, and its results
    would then differ from the other kernels' (and a prefill's keys from a decode step's): probed
    once with the worst case (255 x 127 in every pair) and random values."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")):
        return False
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (64, 256), dtype=torch.int8, generator=gen)  # (out, in)
    q[0] = 127
    xu = torch.randint(1, 256, (3, 256), dtype=torch.uint8, generator=gen)  # u8 rows, zero point 128
    xu[0] = 255
    exact = (xu.long() - 128) @ q.long().t()  # (3, out), in int64
    got = torch.ops.onednn.qlinear_pointwise(
        xu, 1.0, 128, torch.ops.onednn.qlinear_prepack(q, None), torch.ones(64), torch.zeros(64, dtype=torch.long),
        None, 1.0, 0, torch.float32, "none", [], "")
    if torch.equal(got, exact.float()):  # every sum here is below 2**24: exact in fp32
        return True
    if _compiled_kernel() is None:  # else speclm's kernel takes every row count: nothing changes for the user
        print("speclm: oneDNN's int8 GEMM is not exact on this CPU (no VNNI: its u8*s8 pairs saturate); "
              "int8 layers use torch._int_mm and an exact fp32 GEMM instead", file=sys.stderr)
    return False


def onednn_used(compiled: bool) -> bool:
    """Whether int8 layers keep a oneDNN copy of their weights for calls of more than VNNI_MAX_ROWS
    rows: where it is exact and speclm's compiled kernel does not run, or where SPECLM_ONEDNN=1 asks
    for it. speclm's kernel takes a prefill block's rows about as fast (0.82-0.88x oneDNN's time on
    AMX tiles, 0.96-1.15x on the VNNI loop: benchmarks/amx/records.md#int8-prefill-paths and its -vnni section) without a second
    copy of every weight, which would double the int8 model's resident weights."""
    if compiled and os.environ.get("SPECLM_ONEDNN", "0") != "1":
        return False
    return _onednn_available()


def _compiled_kernel():
    """speclm's compiled kernel (speclm.quant.kernels), or None where it does not run."""
    return kernels.compiled()


_GROUP = 64  # output columns the kernel packs side by side (speclm/quant/csrc/cpu_kernels.cpp)


def _gather_columns(layout: torch.Tensor, ids: torch.Tensor, pad: int, group: int = _GROUP) -> torch.Tensor:
    """Output columns `ids` of a (N_pad / group, X, group, ...) layout, whose column c sits at
    [c // group, :, c % group], in a new layout of the same kind (len(ids) columns, padded with `pad`)."""
    picked = layout[ids // group, :, ids % group]  # (S, X, ...)
    padded = picked.new_full((-(-len(ids) // group) * group, *picked.shape[1:]), pad)
    padded[: len(ids)] = picked
    return padded.view(-1, group, *picked.shape[1:]).transpose(1, 2).contiguous()


def from_vnni_layout(layout: torch.Tensor, out_f: int, in_f: int) -> torch.Tensor:
    """vnni_layout's inverse: the int8 weights (out, in)."""
    groups, quads = layout.shape[:2]
    return layout.permute(0, 2, 1, 3).reshape(groups * _GROUP, quads * 4)[:out_f, :in_f].contiguous()


def vnni_layout(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 (out, in) -> the kernel's layout (out/64, in/4, 64, 4), zero-padded, and each output
    column's sum of weights (int32, padded), which undoes the u8 zero point of 128."""
    out_f, in_f = q.shape
    shape = (-(-out_f // _GROUP) * _GROUP, -(-in_f // 4) * 4)
    padded = q
    if shape != q.shape:
        padded = torch.zeros(shape, dtype=torch.int8)
        padded[:out_f, :in_f] = q
    step = max(1, _QUANT_BLOCK // shape[1])  # the int32 sum's temporaries a block at a time
    colsum = torch.cat([block.sum(dim=1, dtype=torch.int32) for block in padded.split(step)])
    layout = padded.view(padded.shape[0] // _GROUP, _GROUP, padded.shape[1] // 4, 4).permute(0, 2, 1, 3).contiguous()
    return layout, colsum


class QuantLinear(nn.Module):
    """A linear layer with quantized weights: `rows` is its hot path over (R, in) fp32 rows."""

    def __init__(self, linears: tuple[nn.Linear, ...]):
        """One linear, or several that read the same input (fused: their outputs side by side);
        subclasses quantize torch.cat of their weights."""
        bias = None
        if any(lin.bias is not None for lin in linears):
            bias = torch.cat([lin.bias.detach().float() if lin.bias is not None else torch.zeros(lin.out_features)
                              for lin in linears])
        self._init(linears[0].in_features, sum(lin.out_features for lin in linears), bias)

    def _init(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        self.bias = bias  # plain attributes, not buffers: the hot path reads them without nn.Module's lookup

    def state(self) -> dict[str, torch.Tensor]:
        """The tensors that rebuild this layer (`from_state`), in the compiled kernels' layout: what
        the quantized-weights cache stores."""
        raise NotImplementedError

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], in_features: int, out_features: int) -> "QuantLinear":
        raise NotImplementedError

    def rows(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def outputs(self, ids: torch.Tensor) -> "QuantLinear":
        """The same layer restricted to output features `ids` (S,) long, in that order: a copy of
        their weights, whose results are bit for bit those columns of the full layer's (each
        column's dot products and rescale are its own)."""
        raise NotImplementedError

    def first_outputs(self, n: int) -> "QuantLinear":
        """The layer restricted to its first n output features, n a multiple of 64: views of the
        weights, no copy; the same bits as those columns of the full layer."""
        raise NotImplementedError

    def _restricted(self, ids: torch.Tensor | slice) -> "QuantLinear":
        """A shallow copy with the per-column attributes cut to `ids`; subclasses gather their weights."""
        if isinstance(ids, slice) and ids.stop % _GROUP:
            raise ValueError(f"first_outputs takes a multiple of {_GROUP}, not {ids.stop}")
        sub = object.__new__(type(self))
        sub.__dict__.update(self.__dict__)
        sub._parameters, sub._buffers, sub._modules = {}, {}, {}
        sub.out_features = len(range(self.out_features)[ids]) if isinstance(ids, slice) else len(ids)
        sub.bias = self.bias[ids] if self.bias is not None else None
        return sub

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (..., in)
        y = self.rows(x.reshape(-1, self.in_features))
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)


class Int8Linear(QuantLinear):
    """y = x W^T + b with int8 W (per output channel) and x quantized per row on the fly.

    Three kernels compute the same int32 dot products and the same fp32 rescale (int32 ->
    fp32, times the weight scale, times the row's step), so they give the same bits (tested)
    and the choice between them is one of speed and memory:
    - every row count (decode steps, draft steps, verification, prefill blocks): speclm's compiled
      kernel (AVX-512 VNNI, AMX tiles or AVX2, speclm.quant.kernels), which reads each weight once
      for all the rows;
    - more than VNNI_MAX_ROWS rows where no compiled kernel runs, or SPECLM_ONEDNN=1 asks for it
      (`onednn_used`): oneDNN's int8 GEMM on the weight packed once (`onednn.qlinear_pointwise`,
      what torch's x86 int8 path uses), u8 activations with zero point 128, where it sums exactly
      (`_onednn_available`: not on a CPU without VNNI);
    - where no compiled kernel runs: `torch._int_mm` for one row (its one-row path streams
      the weight at read bandwidth) and oneDNN for more, or `_int_mm` for every row count
      where oneDNN is not exact.
    Each kernel that runs keeps its own layout of the int8 weights: one copy where the compiled
    kernel runs, two with SPECLM_ONEDNN=1 (benchmarks/epyc/records.md#int8-gemm-rows times them by rows).
    """

    def __init__(self, *linears: nn.Linear):
        super().__init__(linears)
        q, scale = int8_per_channel(_weights_of(linears))
        self._weights(scale, q=q)

    def _weights(self, scale: torch.Tensor, q: torch.Tensor | None = None, layout: torch.Tensor | None = None,
                 colsum: torch.Tensor | None = None) -> None:
        """Each kernel's copy from the int8 weights q (out, in), or from the compiled kernel's layout."""
        self.wscale = scale  # (out,) fp32
        self.compiled = _compiled_kernel()
        self.onednn = onednn_used(self.compiled is not None)
        if self.compiled is not None:
            self.vnni_weight, self.colsum = (layout, colsum) if layout is not None else vnni_layout(q)
        if q is None and (self.compiled is None or self.onednn):
            q = from_vnni_layout(layout, self.out_features, self.in_features)
        if self.compiled is None:
            self.qweight_t = q.t()  # (in, out) column-major: _int_mm's fast CPU layout
        if self.onednn:
            self._pack_onednn(q)
        elif self.compiled is None and EXACT_FLOAT_GEMM:
            self.fweight = q.t().float().contiguous()  # (in, out) fp32 of int8 values, for several rows

    def state(self) -> dict[str, torch.Tensor]:
        if self.compiled is not None:
            layout, colsum = self.vnni_weight, self.colsum
        else:
            layout, colsum = vnni_layout(self.qweight_t.t())
        state = {"vnni_weight": layout, "colsum": colsum, "wscale": self.wscale}
        return state if self.bias is None else {**state, "bias": self.bias}

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], in_features: int, out_features: int) -> "Int8Linear":
        layer = cls.__new__(cls)
        layer._init(in_features, out_features, state.get("bias"))
        layer._weights(state["wscale"], layout=state["vnni_weight"], colsum=state["colsum"])
        return layer

    def first_outputs(self, n: int) -> "Int8Linear":
        sub = self._restricted(slice(0, n))
        sub.wscale = self.wscale[:n]
        if self.compiled is not None:
            sub.vnni_weight, sub.colsum = self.vnni_weight[: n // _GROUP], self.colsum[:n]
        else:
            sub.qweight_t = self.qweight_t[:, :n]
        if "fweight" in self.__dict__:
            sub.fweight = self.fweight[:, :n]
        return sub.without_onednn()

    def _pack_onednn(self, q: torch.Tensor) -> None:
        """oneDNN's copy of the int8 weights q (out, in), in its opaque blocked layout."""
        self.packed = torch.ops.onednn.qlinear_prepack(q, None)
        self.wzero = torch.zeros(self.out_features, dtype=torch.long)

    def with_onednn(self) -> "Int8Linear":
        """The layer as SPECLM_ONEDNN=1 holds it: a oneDNN copy of the weights for calls of more
        than VNNI_MAX_ROWS rows (for comparing the paths: benchmarks/int8_prefill_paths.py)."""
        if "packed" not in self.__dict__:
            self._pack_onednn(from_vnni_layout(self.vnni_weight, self.out_features, self.in_features))
        self.onednn = True
        return self

    def without_onednn(self) -> "Int8Linear":
        """No second, oneDNN-packed copy of the weights, for layers that mostly see a few rows (a
        restricted head, trained heads): many rows then go to another kernel, the same bits."""
        self.onednn = False
        self.__dict__.pop("packed", None)
        self.__dict__.pop("wzero", None)
        return self

    def outputs(self, ids: torch.Tensor) -> "Int8Linear":
        sub = self._restricted(ids)
        sub.wscale = self.wscale[ids]
        if self.compiled is not None:
            sub.vnni_weight = _gather_columns(self.vnni_weight, ids, 0)
            sub.colsum = torch.zeros(sub.vnni_weight.shape[0] * _GROUP, dtype=torch.int32)
            sub.colsum[: len(ids)] = self.colsum[ids]
        else:
            sub.qweight_t = self.qweight_t[:, ids].t().contiguous().t()  # (in, S) column-major, as _int_mm wants
        if "fweight" in self.__dict__:
            sub.fweight = self.fweight[:, ids].contiguous()
        return sub.without_onednn()

    def kernel_for(self, rows: int) -> str:
        if self.compiled is not None and (rows <= VNNI_MAX_ROWS or not self.onednn):
            return "compiled"
        if rows > 1 and self.onednn:
            return "onednn"
        return "float" if rows > 1 and "fweight" in self.__dict__ else "int_mm"

    def rows(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x (R, in) fp32 -> (R, out) fp32, plus `residual` (R, out) if given: the forward without
        reshapes (speclm.forward.lean's hot path; the residual is a decoder's h + f(h), added last)."""
        kernel = self.kernel_for(x.shape[0])
        if kernel == "compiled":  # quantizes, multiplies, rescales and adds in one call
            return self.compiled.linear_rows(x, self.vnni_weight, self.colsum, self.wscale, self.bias, residual)
        xq, step = _quantized_rows(x, self.in_features, signed=kernel != "onednn")  # (R, in), (R, 1)
        if kernel == "onednn":
            acc = torch.ops.onednn.qlinear_pointwise(
                xq, 1.0, 128, self.packed, self.wscale, self.wzero, None, 1.0, 0, torch.float32, "none", [], "",
            )  # (R, out) = fp32(integer dot products) * wscale
        elif kernel == "float":
            acc = _exact_float_gemm(xq, self.fweight).mul(self.wscale)  # the same int32, the same rescale
        else:
            acc = torch._int_mm(xq, self.qweight_t).mul(self.wscale)  # int32 * fp32: fp32(int32) * wscale
        y = acc.mul_(step)  # the row's own activation scale
        if self.bias is not None:
            y = y.add_(self.bias)
        return y if residual is None else y.add_(residual)

    def extra_repr(self) -> str:
        kernel = int8_kernels(self.compiled is not None, self.onednn)
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 W8A8 per-row ({kernel})"


# int4 weights: symmetric per output channel and group of this many input features. As the
# 0.5B draft of the int8 1.5B (chat, Spec-Bench, k = 3): 2.797 tokens per target forward against
# 2.840 with int8 weights (benchmarks/intel/records.md#int4-draft-cpu).
INT4_GROUP = 64


def int4_groups(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (out, in) -> u = w + 8 in 0..15 (uint8, (out, in)) and fp16 scales (out, in / group):
    w = round(weight / scale) in -7..7, scale = max |weight| over the group / 7 (as fp16)."""
    out_f, in_f = weight.shape
    u = torch.empty(out_f, in_f, dtype=torch.uint8)
    scale = torch.empty(out_f, in_f // group, dtype=torch.float16)
    step = max(1, _QUANT_BLOCK // max(1, in_f))
    for lo in range(0, out_f, step):
        g = weight[lo : lo + step].detach().float().view(-1, in_f // group, group)
        # fp16 keeps scales down to 2**-14 as normal numbers; a group smaller than 7 * 2**-14 rounds coarser
        s = (g.abs().amax(dim=2) / 7.0).clamp_min(2.0**-14).half()  # (rows, in / group)
        q = (g / s.float()[:, :, None]).add_(_MAGIC).sub_(_MAGIC).clamp_(-8, 7)  # round half to even
        u[lo : lo + step] = (q + 8).view(-1, in_f)
        scale[lo : lo + step] = s
    return u, scale


def int4_layout(u: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """u (out, in) uint8 0..15, scale (out, in / G) fp16 -> the kernel's layouts: packed (out/64,
    in/8, 64, 4) uint8, byte (p, col, j) = u[col, 8p + j] | u[col, 8p + 4 + j] << 4, and scales
    (out/64, in/G, 64); output columns padded to 64 with zero weights (u = 8) and zero scales."""
    out_f, in_f = u.shape
    out_p = -(-out_f // _GROUP) * _GROUP
    padded = torch.full((out_p, in_f), 8, dtype=torch.uint8)
    padded[:out_f] = u
    halves = padded.view(out_p // _GROUP, _GROUP, in_f // 8, 2, 4)
    packed = (halves[:, :, :, 0] | (halves[:, :, :, 1] << 4)).permute(0, 2, 1, 3).contiguous()
    scales = torch.zeros(out_p, scale.shape[1], dtype=torch.float16)
    scales[:out_f] = scale
    return packed, scales.view(out_p // _GROUP, _GROUP, -1).permute(0, 2, 1).contiguous()


class Int4Linear(QuantLinear):
    """y = x W^T + b with int4 W (per output channel and group of INT4_GROUP inputs) and x
    quantized per row to int8: half the bytes of Int8Linear per step, for draft models (whose
    weights only decide what is proposed; the target verifies). One kernel for every row count
    (speclm's `linear_rows_w4`), each row computed alone, so a model on these weights is
    batch-invariant too. Needs speclm's compiled kernels."""

    def __init__(self, *linears: nn.Linear, group: int = INT4_GROUP):
        super().__init__(linears)
        self._kernel(group)
        u, scale = int4_groups(_weights_of(linears), group)
        self.packed, self.scales = int4_layout(u, scale)

    def _kernel(self, group: int) -> None:
        self.kernel = kernels.compiled()
        if self.kernel is None:
            raise UsageError("int4 weights need speclm's compiled CPU kernels (an x86 CPU with AVX2 or AVX-512 VNNI, "
                             "and a C++ compiler)")
        if self.in_features % group:
            raise ValueError(f"in_features {self.in_features} is not a multiple of the int4 group {group}")
        self.group = group

    def state(self) -> dict[str, torch.Tensor]:
        state = {"packed": self.packed, "scales": self.scales}
        return state if self.bias is None else {**state, "bias": self.bias}

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], in_features: int, out_features: int) -> "Int4Linear":
        layer = cls.__new__(cls)
        layer._init(in_features, out_features, state.get("bias"))
        group = in_features // state["scales"].shape[1]
        layer._kernel(group)
        layer.packed, layer.scales = state["packed"], state["scales"]
        return layer

    def first_outputs(self, n: int) -> "Int4Linear":
        sub = self._restricted(slice(0, n))
        sub.packed, sub.scales = self.packed[: n // _GROUP], self.scales[: n // _GROUP]
        return sub

    def outputs(self, ids: torch.Tensor) -> "Int4Linear":
        sub = self._restricted(ids)
        sub.packed = _gather_columns(self.packed, ids, 0x88)  # padding: u = 8, weight 0
        scales = self.scales.transpose(1, 2)  # (N_pad / 64, 64, K / G): column c at [c // 64, c % 64]
        picked = scales[ids // _GROUP, ids % _GROUP]  # (S, K / G)
        padded = picked.new_zeros(sub.packed.shape[0] * _GROUP, picked.shape[1])
        padded[: len(ids)] = picked
        sub.scales = padded.view(-1, _GROUP, picked.shape[1]).transpose(1, 2).contiguous()
        return sub

    def rows(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.kernel.linear_rows_w4(x, self.packed, self.scales, self.out_features, self.bias, residual)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int4 W4A8, groups of {self.group} ({kernels.describe()})")


def _quantized_linear(mode: str, *linears: nn.Linear) -> QuantLinear:
    """int4 where the input features split into groups; the file's own blocks (gguf) where every
    layer carries blocks of one type the kernel takes (speclm.quant.gguf); else int8."""
    if mode == "int4" and linears[0].in_features % INT4_GROUP == 0:
        return Int4Linear(*linears)
    if mode == "gguf":
        from speclm.quant import gguf

        kinds = {gguf.kind_of(lin) for lin in linears}
        if None not in kinds and len(kinds) == 1:
            return gguf.GGUFLinear(*linears)
    return Int8Linear(*linears)


def _fusable(mode: str, mods: list[nn.Module]) -> bool:
    """Whether sibling projections share one quantized layer: always, except on gguf weights of
    different types (or some on their blocks, some not), which each keep their own."""
    if mode != "gguf":
        return True
    from speclm.quant import gguf

    return len({gguf.kind_of(m) for m in mods}) == 1


class Int8Slice(nn.Module):
    """One of several sibling projections fused into one quantized linear (Int8Linear or Int4Linear) (q/k/v, gate/up): the
    first sibling called with an input computes all outputs, the others read their columns."""

    def __init__(self, fused: "_Fused", start: int, stop: int):
        super().__init__()
        self.fused, self.start, self.stop = fused, start, stop
        self.in_features, self.out_features = fused.kernel.in_features, stop - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused(x)[..., self.start : self.stop]

    def extra_repr(self) -> str:
        return f"columns {self.start}:{self.stop} of a fused int8 projection"


class _Fused:
    """Not a module: siblings share it without registering its buffers twice."""

    def __init__(self, kernel: QuantLinear):
        self.kernel = kernel
        self._x: torch.Tensor | None = None  # the last input, by identity; kept alive so no other tensor can take its id
        self._y: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x is not self._x:
            self._x, self._y = x, self.kernel(x)
        return self._y


def dense(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A linear layer's weight (out, in) in fp32 and its bias: an nn.Linear's own, an int8 layer's
    de-quantized (its int8 values times their scales). For a lower-precision copy of a model's
    layers (speclm.proposers.self_draft); int4 layers have none below them (ValueError)."""
    if isinstance(module, nn.Linear):
        return module.weight.detach().float(), None if module.bias is None else module.bias.detach().float()
    if isinstance(module, Int8Slice):
        weight, bias = dense(module.fused.kernel)
        return weight[module.start : module.stop], None if bias is None else bias[module.start : module.stop]
    if isinstance(module, Int8Linear):
        q = (from_vnni_layout(module.vnni_weight, module.out_features, module.in_features)
             if module.compiled is not None else module.qweight_t.t())
        return q.float() * module.wscale[:, None], module.bias
    if callable(getattr(module, "decoded", None)):  # a GGUF layer: its blocks' values (speclm.quant.gguf)
        return module.decoded().values(), module.bias
    raise ValueError(f"no fp32 weights to copy from a {type(module).__name__}")


def dense_linear(module: nn.Module) -> nn.Linear:
    """A new fp32 nn.Linear of a linear layer's weights (`dense`)."""
    weight, bias = dense(module)
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)
    return linear


def int4_copy(module: nn.Module) -> QuantLinear:
    """A linear layer (nn.Linear, int8) as a new int4 one: a copy, the layer itself untouched."""
    return _quantized_linear("int4", dense_linear(module))


def quantized_bytes(module: QuantLinear) -> int:
    """The bytes a quantized layer's tensors hold."""
    return sum(t.numel() * t.element_size() for t in module.state().values())


# projections that read one input in the Llama-family decoders (Llama, Qwen2, Mistral, ...)
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def quantize_model(model: nn.Module, mode: str) -> nn.Module:
    """Replace every nn.Linear (output head included) in place; returns the model."""
    if mode not in QUANTIZE_MODES:
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZE_MODES)}, not {mode!r}")
    if mode == "none":
        return model
    if getattr(model, "speclm_quantize", "none") == mode:
        return model
    if mode == "gguf" and not any(getattr(m, "speclm_blocks", None) is not None for m in model.modules()):
        raise UsageError("quantize=gguf computes with a GGUF file's own blocks: load the model from a GGUF "
                         "(a catalog name or a .gguf file), not from other weights")
    quantize_linears(model, mode)
    mark_quantized(model, mode)
    return model


def mark_quantized(model: nn.Module, mode: str) -> None:
    if hasattr(model, "config"):
        model.config.tie_word_embeddings = False
    model.speclm_quantize = mode


def quantize_linears(model: nn.Module, mode: str) -> None:
    """quantize_model's work on any module tree (a model, or one decoder layer at a time while
    loading, so that the fp32 weights of one layer at most are held beside the quantized ones)."""
    # A tied output head shares its weight with the embedding table; quantizing it must
    # leave the (fp32) embedding untouched, so the head gets its own int8 copy.
    with torch.no_grad():
        for parent in list(model.modules()):
            for names in SIBLINGS:
                mods = [getattr(parent, n, None) for n in names]
                if (all(isinstance(m, nn.Linear) for m in mods) and len({m.in_features for m in mods}) == 1
                        and _fusable(mode, mods)):
                    fused, start = _Fused(_quantized_linear(mode, *mods)), 0
                    for n, m in zip(names, mods):
                        setattr(parent, n, Int8Slice(fused, start, start + m.out_features))
                        start += m.out_features
    targets = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    for name, linear in targets:
        with torch.no_grad():
            model.set_submodule(name, _quantized_linear(mode, linear))
