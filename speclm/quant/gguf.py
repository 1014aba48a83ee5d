"""`--quantize gguf`: linear layers that compute with a GGUF file's own quantized blocks.

int8 and int4 (speclm.quant.weights) quantize the de-quantized fp32 weights again: a second
rounding on top of the file's. Here a layer keeps the file's integers as they are: Q4_K (4-bit
quants, 6-bit scale and min per 32 features, fp16 super-block scales per 256), Q6_K (6-bit quants,
int8 scale per 16, fp16 scale per 256), Q5_0 (5-bit quants, fp16 scale per 32) and Q8_0 (int8
quants, fp16 scale per 32). Each is read into one form,

    weight[c, i] = d[c, i // super] * sc[c, i // block] * u[c, i] - dmin[c, i // super] * mn[c, i // block]

with u the unsigned quants, sc and mn the integer block scales and mins, d and dmin fp32 (each the
file's fp16 value, or 32, 16 and 128 times it for Q6_K's, Q5_0's and Q8_0's zero points, exact), laid out for
speclm's kernel `linear_rows_kq` (speclm/quant/csrc/cpu_kernels.cpp, and cpu_kernels_avx2.cpp with
the same bits): activations quantized per
row to int8 as the int4 kernel does, exact integer block sums, each row computed alone, so a
model on these layers is batch-invariant (speculation's output equals plain decoding's bit for
bit). Tensors of another type (F32, F16, Q4_0, Q5_K, ...) become int8 layers, said in the layer's repr.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from speclm.errors import UsageError
from speclm.quant import kernels
from speclm.quant.weights import QuantLinear, _gather_columns

_COLS = 16  # output columns the kernel takes side by side (one 512-bit accumulator)


@dataclass(frozen=True)
class Format:
    """How a GGML type maps onto the kernel: bits of u in the layout (4, 6 or 8), features per block
    and per super-block, and the zero point z of w = d sc (u - z), or 0 where the type has mins."""

    bits: int
    block: int
    super: int
    zero: int = 0


FORMATS = {"Q4_K": Format(4, 32, 256), "Q6_K": Format(6, 16, 256, zero=32), "Q5_0": Format(6, 32, 32, zero=16),
           "Q8_0": Format(8, 32, 32, zero=128)}
_BLOCK_BYTES = {"Q4_K": 144, "Q6_K": 210, "Q8_0": 34, "Q5_0": 22}


@dataclass
class Blocks:
    """One GGUF tensor's rows as its file holds them: kind (the GGML type's name), data (rows,
    row bytes) uint8."""

    kind: str
    data: np.ndarray


@dataclass
class Decoded:
    """A tensor's blocks in the kernel's terms, one row per output feature: u (N, K) uint8, sc and
    mn (N, K / block) int8, d and dmin (N, K / super) fp32."""

    fmt: Format
    u: torch.Tensor
    sc: torch.Tensor
    mn: torch.Tensor
    d: torch.Tensor
    dmin: torch.Tensor

    def values(self) -> torch.Tensor:
        """The weights (N, K) fp32: d * sc * u - dmin * mn, each product exact in fp32."""
        f = self.fmt
        scale = (self.d.repeat_interleave(f.super // f.block, 1) * self.sc.float()).repeat_interleave(f.block, 1)
        mins = (self.dmin.repeat_interleave(f.super // f.block, 1) * self.mn.float()).repeat_interleave(f.block, 1)
        return scale * self.u.float() - mins


def _fp16(raw: np.ndarray) -> torch.Tensor:
    """(N, B, 2) uint8 little-endian fp16 -> (N, B) fp32."""
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32))


def decode(blocks: Blocks) -> Decoded:
    """A tensor's file blocks in the kernel's terms (see the module docstring)."""
    kind, data = blocks.kind, blocks.data
    if kind not in FORMATS:
        raise ValueError(f"no kernel for GGUF type {kind}")
    n = data.shape[0]
    b = data.reshape(n, -1, _BLOCK_BYTES[kind])  # (N, blocks, bytes)
    nb = b.shape[1]
    if kind == "Q4_K":
        d, dmin = _fp16(b[:, :, 0:2]), _fp16(b[:, :, 2:4])
        s = b[:, :, 4:16].astype(np.uint8)
        sc = np.empty((n, nb, 8), np.uint8)
        mn = np.empty((n, nb, 8), np.uint8)
        sc[:, :, :4], mn[:, :, :4] = s[:, :, 0:4] & 63, s[:, :, 4:8] & 63
        sc[:, :, 4:] = (s[:, :, 8:12] & 0x0F) | ((s[:, :, 0:4] >> 6) << 4)
        mn[:, :, 4:] = (s[:, :, 8:12] >> 4) | ((s[:, :, 4:8] >> 6) << 4)
        qs = b[:, :, 16:144].reshape(n, nb, 4, 32)  # 4 chunks of 64 features: low nibbles, then high
        u = np.stack([qs & 0x0F, qs >> 4], axis=3)  # (N, nb, 4, 2, 32)
        return Decoded(FORMATS[kind], torch.from_numpy(u.reshape(n, -1)), torch.from_numpy(sc.reshape(n, -1).view(np.int8)),
                       torch.from_numpy(mn.reshape(n, -1).view(np.int8)), d, dmin)
    if kind == "Q6_K":
        ql = b[:, :, 0:128].reshape(n, nb, 2, 64)  # two halves of 128 features
        qh = b[:, :, 128:192].reshape(n, nb, 2, 32)
        sc = np.ascontiguousarray(b[:, :, 192:208]).view(np.int8).reshape(n, -1)  # (N, nb * 16)
        d = _fp16(b[:, :, 208:210])
        lo, hi = ql[..., :32], ql[..., 32:]
        u = np.stack([(lo & 0x0F) | ((qh & 3) << 4), (hi & 0x0F) | (((qh >> 2) & 3) << 4),
                      (lo >> 4) | (((qh >> 4) & 3) << 4), (hi >> 4) | (((qh >> 6) & 3) << 4)], axis=3)  # (N, nb, 2, 4, 32)
        sct = torch.from_numpy(np.ascontiguousarray(sc))
        return Decoded(FORMATS[kind], torch.from_numpy(u.reshape(n, -1).astype(np.uint8)), sct, sct.clone(), d, d * 32)
    if kind == "Q5_0":  # 5-bit quants: low nibbles in qs, the fifth bits in a 32-bit qh; w = d (q - 16)
        d = _fp16(b[:, :, 0:2])
        qh = np.ascontiguousarray(b[:, :, 2:6]).view("<u4")  # (N, nb, 1)
        qs = b[:, :, 6:22]
        high = (qh >> np.arange(32, dtype=np.uint32)) & 1  # (N, nb, 32): feature j's fifth bit
        u = np.concatenate([qs & 0x0F, qs >> 4], axis=2) | (high.astype(np.uint8) << 4)
        ones = torch.ones(n, nb, dtype=torch.int8)
        return Decoded(FORMATS[kind], torch.from_numpy(u.reshape(n, -1)), ones, ones.clone(), d, d * 16)
    d = _fp16(b[:, :, 0:2])  # Q8_0
    q = np.ascontiguousarray(b[:, :, 2:34]).view(np.int8).reshape(n, -1)
    u = torch.from_numpy((q.astype(np.int16) + 128).astype(np.uint8))
    ones = torch.ones(n, nb, dtype=torch.int8)
    return Decoded(FORMATS[kind], u, ones, ones.clone(), d, d * 128)


def _columns(t: torch.Tensor, n_pad: int) -> torch.Tensor:
    """(N, X) per output feature -> (N_pad / 16, X, 16), padded with zeros."""
    padded = t.new_zeros(n_pad, t.shape[1])
    padded[: t.shape[0]] = t
    return padded.view(n_pad // _COLS, _COLS, -1).transpose(1, 2).contiguous()


def layout(dec: Decoded) -> dict[str, torch.Tensor]:
    """The kernel's tensors (speclm/quant/csrc/cpu_kernels.cpp, linear_rows_kq's layouts, by blocks of
    16 output features): qs, sc, d, and mn, dmin for a type with mins; padded output features have
    zero scales and mins, so they compute 0."""
    n, k = dec.u.shape
    n_pad = -(-n // _COLS) * _COLS
    u = dec.u.new_zeros(n_pad, k)
    u[:n] = dec.u
    g = n_pad // _COLS
    bits = dec.fmt.bits
    if bits == 4:  # byte (p, col, j) = u[col, 8p + j] | u[col, 8p + 4 + j] << 4, as linear_rows_w4's
        halves = u.view(g, _COLS, k // 8, 2, 4)
        qs = (halves[:, :, :, 0] | (halves[:, :, :, 1] << 4)).permute(0, 2, 1, 3).contiguous()
    elif bits == 6:  # per 16 features: two nibble planes, then the 2-bit high parts
        parts = u.view(g, _COLS, k // 16, 4, 4)  # [.., t, j] = u[col, 16q + 4t + j]
        low, high = parts & 0x0F, parts >> 4
        planes = torch.stack([low[:, :, :, 0] | (low[:, :, :, 1] << 4), low[:, :, :, 2] | (low[:, :, :, 3] << 4),
                              high[:, :, :, 0] | (high[:, :, :, 1] << 2) | (high[:, :, :, 2] << 4) | (high[:, :, :, 3] << 6)],
                             dim=3)  # (G, 16, K / 16, 3, 4)
        qs = planes.permute(0, 2, 3, 1, 4).reshape(g, k // 16 * 3, _COLS, 4).contiguous()
    else:  # byte (q, col, j) = u[col, 4q + j]
        qs = u.view(g, _COLS, k // 4, 4).permute(0, 2, 1, 3).contiguous()
    out = {"qs": qs, "sc": _columns(dec.sc, n_pad), "d": _columns(dec.d, n_pad)}
    if dec.fmt.zero == 0:
        out.update(mn=_columns(dec.mn, n_pad), dmin=_columns(dec.dmin, n_pad))
    return out


def _unpacked(qs: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """layout's qs -> u (N_pad, K)."""
    g = qs.shape[0]
    if bits == 4:
        q = qs.permute(0, 2, 1, 3)  # (G, 16, K / 8, 4)
        return torch.stack([q & 0x0F, q >> 4], dim=3).reshape(g * _COLS, k)
    if bits == 6:
        planes = qs.view(g, k // 16, 3, _COLS, 4).permute(0, 3, 1, 2, 4)  # (G, 16, K / 16, 3, 4)
        low = torch.stack([planes[:, :, :, 0] & 0x0F, planes[:, :, :, 0] >> 4, planes[:, :, :, 1] & 0x0F,
                           planes[:, :, :, 1] >> 4], dim=3)  # (G, 16, K / 16, 4, 4)
        high = torch.stack([(planes[:, :, :, 2] >> s) & 3 for s in (0, 2, 4, 6)], dim=3)
        return (low | (high << 4)).reshape(g * _COLS, k)
    return qs.permute(0, 2, 1, 3).reshape(g * _COLS, k)


class GGUFLinear(QuantLinear):
    """y = x W^T + b with W the GGUF's own blocks (one format for all its outputs) and x quantized
    per row to int8; speclm's `linear_rows_kq` for every row count. Needs speclm's compiled kernels."""

    def __init__(self, *linears: nn.Linear):
        """One nn.Linear, or several that read the same input (fused: their outputs side by side),
        each carrying its file blocks as `speclm_blocks` (`attach`), all of one GGML type."""
        super().__init__(linears)
        parts = [blocks_of(lin) for lin in linears]
        kinds = {p.kind for p in parts if p is not None}
        if None in parts or len(kinds) != 1:
            raise ValueError(f"one GGUF type per layer, not {sorted(kinds)}")
        decoded = [decode(p) for p in parts]
        merged = Decoded(decoded[0].fmt, *(torch.cat([getattr(d, f) for d in decoded]) for f in ("u", "sc", "mn", "d", "dmin")))
        self._set(kinds.pop(), layout(merged))

    def _set(self, kind: str, tensors: dict[str, torch.Tensor]) -> None:
        self.kernel = _kernel()
        self.kind, self.fmt = kind, FORMATS[kind]
        if self.in_features % self.fmt.super:
            raise ValueError(f"in_features {self.in_features} is not a multiple of {kind}'s {self.fmt.super}")
        self.qs, self.sc, self.d = tensors["qs"], tensors["sc"], tensors["d"]
        self.mn, self.dmin = tensors.get("mn"), tensors.get("dmin")  # types with mins only

    def _tensors(self) -> dict[str, torch.Tensor]:
        names = ("qs", "sc", "d") if self.fmt.zero else ("qs", "sc", "d", "mn", "dmin")
        return {f: getattr(self, f) for f in names}

    def state(self) -> dict[str, torch.Tensor]:
        state = {**self._tensors(), "kind": torch.tensor(list(self.kind.encode()), dtype=torch.uint8)}
        return state if self.bias is None else {**state, "bias": self.bias}

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], in_features: int, out_features: int) -> "GGUFLinear":
        layer = cls.__new__(cls)
        layer._init(in_features, out_features, state.get("bias"))
        layer._set(bytes(state["kind"].tolist()).decode(), state)
        return layer

    def first_outputs(self, n: int) -> "GGUFLinear":
        sub = self._restricted(slice(0, n))
        for f, t in self._tensors().items():
            setattr(sub, f, t[: n // _COLS])
        return sub

    def outputs(self, ids: torch.Tensor) -> "GGUFLinear":
        sub = self._restricted(ids)
        for f, t in self._tensors().items():  # padding: zero scales and mins, so zero weights
            setattr(sub, f, _gather_columns(t, ids, 0, _COLS))
        return sub

    def decoded(self) -> Decoded:
        """The layer's weights in the kernel's terms, one row per output feature."""
        n = self.out_features

        def rows(t: torch.Tensor) -> torch.Tensor:  # (N_pad / 16, X, 16) -> (N, X)
            return t.transpose(1, 2).reshape(-1, t.shape[1])[:n]

        u, sc, d = _unpacked(self.qs, self.fmt.bits, self.in_features)[:n], rows(self.sc), rows(self.d)
        if self.fmt.zero:
            return Decoded(self.fmt, u, sc, sc.clone(), d, d * self.fmt.zero)
        return Decoded(self.fmt, u, sc, rows(self.mn), d, rows(self.dmin))

    def rows(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.kernel.linear_rows_kq(x, self.qs, self.fmt.bits, self.fmt.zero, self.sc, self.d, self.mn,
                                          self.dmin, self.out_features, self.bias, residual)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"GGUF {self.kind} blocks ({kernels.describe()})")


def available() -> bool:
    """Whether `--quantize gguf` runs here: speclm's compiled kernels (AVX-512 VNNI or AVX2)."""
    module = kernels.compiled()
    return module is not None and hasattr(module, "linear_rows_kq")


def _kernel():
    module = kernels.compiled()
    if module is None or not hasattr(module, "linear_rows_kq"):
        raise UsageError("quantize=gguf needs speclm's compiled kernels (an x86 CPU with AVX2 or AVX-512 VNNI; "
                         "SPECLM_KERNELS=torch turns them off); use --quantize int8 or none")
    return module


def supported(kind: str, in_features: int) -> bool:
    """Whether a tensor of this GGML type and width computes on its own blocks."""
    return kind in FORMATS and in_features % FORMATS[kind].super == 0


def attach(linear: nn.Module, blocks: Blocks | None) -> None:
    """Give an nn.Linear its tensor's file blocks, which `quantize_linears(..., "gguf")` reads."""
    if isinstance(linear, nn.Linear) and blocks is not None:
        linear.speclm_blocks = blocks


def blocks_of(linear: nn.Module) -> Blocks | None:
    """An nn.Linear's file blocks where the kernel computes with them (`attach`), else None."""
    blocks = getattr(linear, "speclm_blocks", None)
    return blocks if blocks is not None and supported(blocks.kind, linear.in_features) else None


def kind_of(linear: nn.Module) -> str | None:
    blocks = blocks_of(linear)
    return None if blocks is None else blocks.kind
