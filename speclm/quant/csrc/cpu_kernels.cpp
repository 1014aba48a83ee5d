// speclm's CPU kernels (built by speclm/kernels.py; docs/cpu-fast-path.md, "The compiled kernels"):
// linear_rows, the int8 GEMM for a few rows; linear_rows_w4, its int4-weight twin for draft
// models; rms_norm; silu_mul; decode_attention.
//
// linear_rows: int8 W8A8 linear for a few rows (decode steps, verification, draft steps) with
// AVX-512 VNNI. Decoding at batch 1 is bound by reading the weights, and torch's int8 kernels read them
// slower than the machine can at more than one row (benchmarks/intel/int8-gemm-rows-cpu.txt). Here
// every 64-byte block of weights is loaded once and multiplied into all the rows (up to
// CHUNK at a time), so a few rows cost about what one does. On a CPU with AMX, AMX_MIN_ROWS rows
// or more run on its int8 tiles instead (below), with the same integer sums.
//
// The arithmetic is the one speclm.quant's torch kernels do, step for step, so the bits are
// theirs (tested): each row quantized with its own step max|x| / 127 (round half to even),
// exact int32 dot products, then fp32(int32) * weight scale, * step, + bias. Built with
// -ffp-contract=off so the compiler cannot fuse those into FMAs, which would round once less.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "common.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

namespace {

// acc += dot products of 4 u8 in u with 4 s8 in s per 32-bit lane, all in registers. GCC 12 wraps
// the _mm512_dpbusd_epi32 intrinsic in two register copies per call in a loop, which costs more
// than the instruction; the instruction itself, in place, does not need them.
inline void dpbusd(__m512i& acc, const __m512i u, const __m512i s) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
}

constexpr int64_t BLOCK = 16;   // output columns per 512-bit accumulator
// Software prefetch this many bytes ahead in the weight stream: the hardware prefetchers alone
// left the kernel slower, more so at several rows.
constexpr int64_t PREFETCH = SPECLM_PREFETCH;  // speclm.defaults.WEIGHT_PREFETCH_BYTES
// Few rows in one pass over the weights (int8 up to CHUNK rows, int4's VNNI loop, AMX's one chunk of
// up to 16 rows) also prefetch one line per 256 bytes of weights this far ahead into L2, so the stream from memory runs ahead of
// the L1 prefetch; the hardware prefetchers fetch the lines between (every line so prefetched
// cost more than it saved). 0: none. speclm.defaults.FAR_PREFETCH_BYTES on Intel CPUs, 0 elsewhere.
constexpr int64_t FAR_PREFETCH = SPECLM_FAR_PREFETCH;
constexpr int64_t GROUP = 64;   // columns packed together: 4 blocks side by side per k-quad

// acc[r * 4 + c] += sum over quads of xu[r, k] * w[block c, k] for the 4 blocks of a group, from
// `w` (this group's weights, at the first quad); xu is u8 (x + 128). The 4 weight blocks of a
// k-quad are loaded into registers once and every row's broadcast multiplied into all of them: 4
// wide loads and ROWS narrow ones per 4 * ROWS products. With the weights as memory operands (one
// wide load per product) the load port held the kernel to about half the multiplier's rate.
// 4 * ROWS accumulators, 4 weights and a broadcast fit the 32 vector registers up to 6 rows.
// Prefetch, per quad step: the step's 4 lines PREFETCH bytes ahead into L1 (`near`, when given),
// and `far_lines` lines, consecutive from `far`, into L2; with near given and no far lines, the
// step's first line FAR_PREFETCH bytes ahead into L2 where FAR_PREFETCH is set.

template <int ROWS, size_t... I>
inline void dot_group_impl(const uint8_t* xu, int64_t kp, const int8_t* w, int64_t quads, __m512i* acc,
                           const int8_t* near, const int8_t* far, int far_lines, std::index_sequence<I...>) {
  // accumulator I is row I / 4, block I % 4; constant indices let GCC keep them in registers
  __m512i a[ROWS * 4] = {_mm512_loadu_si512(acc + I)...};
  const int32_t* x32 = reinterpret_cast<const int32_t*>(xu);
  const int64_t stride = kp / 4;
  for (int64_t q = 0; q < quads; ++q) {
    const int8_t* wq = w + q * GROUP * 4;
    if (near != nullptr) {
      for (int l = 0; l < 4; ++l) _mm_prefetch(reinterpret_cast<const char*>(near + q * GROUP * 4 + l * 64), _MM_HINT_T0);
      if (FAR_PREFETCH > 0 && far_lines == 0)
        _mm_prefetch(reinterpret_cast<const char*>(near - PREFETCH + FAR_PREFETCH + q * GROUP * 4), _MM_HINT_T1);
    }
    for (int l = 0; l < far_lines; ++l) _mm_prefetch(reinterpret_cast<const char*>(far + (q * far_lines + l) * 64), _MM_HINT_T1);
    const __m512i wv[4] = {_mm512_loadu_si512(wq), _mm512_loadu_si512(wq + 64), _mm512_loadu_si512(wq + 128),
                           _mm512_loadu_si512(wq + 192)};
    (dpbusd(a[I], _mm512_set1_epi32(x32[(I / 4) * stride + q]), wv[I % 4]), ...);  // 16 columns x 4 k
  }
  ((_mm512_storeu_si512(acc + I, a[I])), ...);
}

template <int ROWS>
void dot_group(const uint8_t* xu, int64_t kp, const int8_t* w, int64_t quads, __m512i* acc, const int8_t* near,
               const int8_t* far, int far_lines) {
  dot_group_impl<ROWS>(xu, kp, w, quads, acc, near, far, far_lines, std::make_index_sequence<ROWS * 4>{});
}

using DotFn = void (*)(const uint8_t*, int64_t, const int8_t*, int64_t, __m512i*, const int8_t*, const int8_t*, int);
// Up to 6 rows in one pass over a group (the registers). More rows go in near-equal chunks, k-tile
// by k-tile: the first chunk reads a tile from L2 and the others from L1, while every chunk
// prefetches its share of a tile FAR_TILES ahead into L2, so the stream from memory goes on while
// the chunks compute from cache (benchmarks/epyc/int8-gemm-rows.txt: up to 12 rows cost about
// what 1 does). Chunks one after the other over whole groups left the stream idle meanwhile.
constexpr int CHUNK = 6;
constexpr int64_t QUANTIZE_PARALLEL = 65536;  // features quantized per task, at least (quantize_grain)
constexpr int64_t TILE = 32;      // quads per k-tile: 8 KB of a group's weights
constexpr int64_t FAR_TILES = 8;  // 64 KB ahead: prefetches into L1 alone left the stream waiting
constexpr DotFn DOTS[CHUNK + 1] = {nullptr, dot_group<1>, dot_group<2>, dot_group<3>,
                                   dot_group<4>, dot_group<5>, dot_group<6>};

// One activation row quantized for the int8 dot products: step = max|x| / 127 (returned) and
// out[i] = round(x[i] / step) + offset (half to even) as bytes: offset 128 gives linear_rows'
// u8 values, 0 linear_rows_w4's int8 ones.
inline float quantize_row(const float* row, int64_t k, int32_t offset, uint8_t* out) {
  __m512 vmax = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 16) {
    const __mmask16 m = i + 16 <= k ? __mmask16(0xFFFF) : __mmask16((1u << (k - i)) - 1);
    vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_maskz_loadu_ps(m, row + i)));
  }
  const float s = std::max(_mm512_reduce_max_ps(vmax), 1e-12f) / 127.0f;
  const __m512 vs = _mm512_set1_ps(s);
  const __m512i shift = _mm512_set1_epi32(offset);
  for (int64_t i = 0; i < k; i += 16) {
    const __mmask16 m = i + 16 <= k ? __mmask16(0xFFFF) : __mmask16((1u << (k - i)) - 1);
    const __m512 v = _mm512_roundscale_ps(_mm512_div_ps(_mm512_maskz_loadu_ps(m, row + i), vs),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_mask_storeu_epi8(out + i, m, _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(v), shift)));
  }
  return s;
}

// Rows per task when a call quantizes its rows on torch's threads: a prefill block's rows (each
// quantized alone, so the same bits) in parallel; a few decode rows on the calling thread, where
// waking the pool would cost more than the work.
inline int64_t quantize_grain(int64_t k) { return std::max<int64_t>(1, QUANTIZE_PARALLEL / k); }

// The rows of x (R, K) fp32 quantized for the int4 and GGUF-block kernels (quantize_row, offset 0).
using speclm_common::SignedRows;
inline SignedRows signed_rows(const float* xp, int64_t rows, int64_t k, int64_t group) {
  const int64_t groups = k / group;
  SignedRows q(rows, k, group);
  at::parallel_for(0, rows, quantize_grain(k), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      int8_t* out = q.xq.data() + r * k;
      q.step[r] = quantize_row(xp + r * k, k, 0, reinterpret_cast<uint8_t*>(out));
      speclm_common::group_sums(out, k, group, q.sums.data() + r * groups);
    }
  });
  return q;
}

// AMX (Intel's tile unit, Sapphire Rapids on): many rows of linear_rows in int8 tiles. A tile
// product is the same exact int32 sum of u8 x s8 products as vpdpbusd's, so the result is
// bit-identical to the VNNI loop's (tested); what changes is the rate: 16 rows x 16 columns x 64 k
// per instruction, so a tree's verification or a batch's forward of 10 to 32 rows costs less than
// the VNNI loop's arithmetic (benchmarks/amx/int8-gemm-rows.txt). The weights need no other layout: quad q of block c of a group lies at
// q * 256 + c * 64, so a B tile (16 quads x 16 columns x 4 bytes) is a 64-byte-row load with a
// 256-byte stride.
constexpr int64_t AMX_QUADS = 16;  // k-quads per tile step (64 bytes of a row)
constexpr int64_t AMX_ROWS = 16;   // rows per A and C tile
constexpr int64_t AMX_PREFETCH = 8192;  // two steps (4 KB each) ahead in the weight stream

// Linux hands a process the tile state only when it asks (arch_prctl ARCH_REQ_XCOMP_PERM).
bool amx_supported() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = (d >> 24) & 1, int8 = (d >> 25) & 1;
    if (!tile || !int8) return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}
// Rows from which each kernel takes the tiles (0: never; set_amx): speclm.defaults.AMX_MIN_ROWS and
// AMX_MIN_ROWS_INT4. The int4 kernel spreads nibbles into u8 tiles first, so it needs more rows to gain.
int amx_min_rows = SPECLM_AMX_MIN_ROWS;
int amx_min_rows_int4 = SPECLM_AMX_MIN_ROWS_INT4;

// Whether a kernel whose tiles start at min_rows runs `rows` rows of kp (padded) features on AMX:
// enough rows, whole 64-byte steps of k (every model in the catalog; others take the VNNI loop),
// and the CPU's tiles.
bool use_amx(int64_t rows, int64_t kp, int min_rows) {
  return min_rows > 0 && rows >= min_rows && kp % (AMX_QUADS * 4) == 0 && amx_supported();
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles for one chunk of m rows (m1 = 0; amx_group): 0-3 the 4 blocks' sums, 4 the rows'
// activations, 5-7 weight blocks. For two chunks of m and m1 rows (amx_pair): 0-1 the first
// chunk's sums for two blocks, 2-3 the second's, 4-5 the chunks' activations, 6-7 two weight blocks.
__attribute__((target("amx-tile"))) void amx_configure(int64_t m, int64_t m1) {
  TileConfig cfg;
  const int c_tiles = m1 == 0 ? 4 : 2;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = AMX_QUADS;  // weight tiles
  for (int t = 0; t < c_tiles; ++t) cfg.rows[t] = uint8_t(m);
  for (int t = c_tiles; m1 != 0 && t < 4; ++t) cfg.rows[t] = uint8_t(m1);
  cfg.rows[4] = uint8_t(m);
  if (m1 != 0) cfg.rows[5] = uint8_t(m1);
  asm volatile("ldtilecfg %0" : : "m"(cfg));  // GCC 12's _tile_loadconfig lets it drop the stores above
}
__attribute__((target("amx-tile"))) void amx_release() { _tile_release(); }

// The next step's 4 KB of a group's weights, AMX_PREFETCH bytes ahead, into L1.
inline void amx_prefetch(const int8_t* wq) {
  for (int l = 0; l < 64; ++l) _mm_prefetch(reinterpret_cast<const char*>(wq + AMX_PREFETCH + l * 64), _MM_HINT_T0);
}

// acc[r * 4 + c] (as linear_rows' accumulators) = sum over all quads of xu[r] * block c of the
// group at w, for the m rows the tiles are configured for (amx_configure(m, 0)).
__attribute__((target("amx-tile,amx-int8"))) void amx_group(const uint8_t* xu, int64_t kp, const int8_t* w,
                                                            int64_t quads, __m512i* acc) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t q = 0; q < quads; q += AMX_QUADS) {
    const int8_t* wq = w + q * GROUP * 4;
    amx_prefetch(wq);
    if (FAR_PREFETCH > 0)
      for (int l = 0; l < AMX_QUADS; ++l) _mm_prefetch(reinterpret_cast<const char*>(wq + FAR_PREFETCH + l * GROUP * 4), _MM_HINT_T1);
    _tile_loadd(4, xu + q * 4, kp);
    _tile_loadd(5, wq, GROUP * 4);
    _tile_dpbusd(0, 4, 5);
    _tile_loadd(6, wq + 64, GROUP * 4);
    _tile_dpbusd(1, 4, 6);
    _tile_loadd(7, wq + 128, GROUP * 4);
    _tile_dpbusd(2, 4, 7);
    _tile_loadd(5, wq + 192, GROUP * 4);
    _tile_dpbusd(3, 4, 5);
  }
  _tile_stored(0, acc, 4 * 64);
  _tile_stored(1, acc + 1, 4 * 64);
  _tile_stored(2, acc + 2, 4 * 64);
  _tile_stored(3, acc + 3, 4 * 64);
}

// The same for two chunks of rows at once (xu, acc: the first; xu1, acc1: the second), tiles
// configured by amx_configure(m, m1): each weight tile feeds both chunks, two blocks per pass over
// the group (the second pass reads the group from L2, where the first one's prefetches left it),
// rather than amx_group once per chunk, each reading all the group's weights again.
__attribute__((target("amx-tile,amx-int8"))) void amx_pair(const uint8_t* xu, const uint8_t* xu1, int64_t kp,
                                                           const int8_t* w, int64_t quads, __m512i* acc,
                                                           __m512i* acc1) {
  for (int b = 0; b < 4; b += 2) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t q = 0; q < quads; q += AMX_QUADS) {
      const int8_t* wq = w + q * GROUP * 4 + b * 64;
      amx_prefetch(wq - b * 64);
      _tile_loadd(4, xu + q * 4, kp);
      _tile_loadd(5, xu1 + q * 4, kp);
      _tile_loadd(6, wq, GROUP * 4);
      _tile_dpbusd(0, 4, 6);
      _tile_dpbusd(2, 5, 6);
      _tile_loadd(7, wq + 64, GROUP * 4);
      _tile_dpbusd(1, 4, 7);
      _tile_dpbusd(3, 5, 7);
    }
    _tile_stored(0, acc + b, 4 * 64);
    _tile_stored(1, acc + b + 1, 4 * 64);
    _tile_stored(2, acc1 + b, 4 * 64);
    _tile_stored(3, acc1 + b + 1, 4 * 64);
  }
}

// One group's 64 columns of y for rc rows from their int32 sums (acc[r * 4 + c]: row r, block c):
// fp32(sum - 128 colsum) * wscale * step (+ bias) (+ residual), in that order. Row by row, so each
// row's 4 blocks are 256 contiguous bytes of y; bp, rp: None where absent; rp and yp at row 0.
inline void store_group(const __m512i* acc, int64_t rc, const float* step, int64_t col0, int64_t n,
                        const int32_t* cs, const float* ws, const float* bp, const float* rp, float* yp) {
  const int blocks = int(std::min<int64_t>(4, (n - col0 + BLOCK - 1) / BLOCK));
  __mmask16 mask[4];
  __m512i zero_point[4];
  __m512 scale[4], add[4];
  for (int c = 0; c < blocks; ++c) {
    const int64_t col = col0 + c * BLOCK;
    mask[c] = col + BLOCK <= n ? __mmask16(0xFFFF) : __mmask16((1u << (n - col)) - 1);
    zero_point[c] = _mm512_slli_epi32(_mm512_loadu_si512(cs + col), 7);  // 128 * colsum
    scale[c] = _mm512_maskz_loadu_ps(mask[c], ws + col);
    add[c] = bp != nullptr ? _mm512_maskz_loadu_ps(mask[c], bp + col) : _mm512_setzero_ps();
  }
  for (int64_t r = 0; r < rc; ++r) {
    const __m512 row_step = _mm512_set1_ps(step[r]);
    float* yr = yp + r * n + col0;
    const float* rr = rp != nullptr ? rp + r * n + col0 : nullptr;
    for (int c = 0; c < blocks; ++c) {
      __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r * 4 + c], zero_point[c]));  // int32 -> fp32
      v = _mm512_mul_ps(v, scale[c]);
      v = _mm512_mul_ps(v, row_step);
      if (bp != nullptr) v = _mm512_add_ps(v, add[c]);
      if (rr != nullptr) v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask[c], rr + c * BLOCK), v);  // h + f(h)
      _mm512_mask_storeu_ps(yr + c * BLOCK, mask[c], v);
    }
  }
}

}  // namespace

// x (R, K) fp32; packed (N_pad / 64, K_pad / 4, 64, 4) int8; colsum (N_pad,) int32: each
// column's sum of weights (the u8 zero point's correction); wscale (N,) fp32; bias (N,) or None;
// residual (R, N) fp32 or None, added last (a decoder's h + f(h) in the same call).
// Returns (R, N) fp32.
at::Tensor linear_rows(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& colsum,
                       const at::Tensor& wscale, const c10::optional<at::Tensor>& bias,
                       const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(x_in.dim() == 2, "x must be (R, K)");
  TORCH_CHECK(packed.scalar_type() == at::kChar && colsum.scalar_type() == at::kInt && wscale.scalar_type() == at::kFloat,
              "packed int8, colsum int32, wscale fp32");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();  // no copy when it already is
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == GROUP && packed.size(3) == 4, "packed must be (N/64, K/4, 64, 4)");
  const int64_t rows = x.size(0), k = x.size(1), quads = packed.size(1);
  const int64_t kp = quads * 4, n = wscale.size(0);
  TORCH_CHECK(k <= kp && kp < k + 4 && n <= packed.size(0) * GROUP && colsum.numel() == packed.size(0) * GROUP, "packed weight does not match x or wscale");
  const float* bp = speclm_common::optional_rows(bias, rows, n, false);
  const float* rp = speclm_common::optional_rows(residual, rows, n, true);
  const bool has_residual = rp != nullptr;
  if (rows == 0) return at::empty({0, n}, x.options());

  // Quantize each row: step = max|x| / 127, xu = round(x / step) + 128 (half to even), zero-padded.
  std::unique_ptr<uint8_t[]> xu_buffer(new uint8_t[rows * kp]);  // uninitialized: each row writes its own padding
  uint8_t* const xu = xu_buffer.get();
  std::vector<float> step(rows);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, rows, quantize_grain(k), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      step[r] = quantize_row(xp + r * k, k, 128, xu + r * kp);
      std::memset(xu + r * kp + k, 0, kp - k);
    }
  });

  at::Tensor y = at::empty({rows, n}, x.options());
  float* yp = y.data_ptr<float>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  const int32_t* cs = colsum.data_ptr<int32_t>();
  const float* ws = wscale.data_ptr<float>();

  // AMX where it runs, for enough rows and whole 64-byte steps of k: near-equal chunks of at most
  // AMX_ROWS rows, two at a time sharing the weight tiles (amx_pair). Else the VNNI loop: rows
  // in near-equal chunks of at most CHUNK; one chunk: a pass over each whole group with the L1
  // prefetch; several: tile by tile, each chunk's steps prefetching its share of a far tile.
  const bool amx = use_amx(rows, kp, amx_min_rows);
  const int64_t most = amx ? AMX_ROWS : CHUNK;
  const int64_t chunks = (rows + most - 1) / most;
  std::vector<int64_t> chunk_rows(chunks), chunk_start(chunks);
  for (int64_t c = 0, r0 = 0; c < chunks; r0 += chunk_rows[c], ++c) {
    chunk_start[c] = r0;
    chunk_rows[c] = (rows - r0) / (chunks - c);
  }
  const int64_t groups = packed.size(0);
  const int64_t group_bytes = quads * GROUP * 4;
  const int64_t tile = chunks == 1 ? quads : TILE;
  const int far_lines = chunks == 1 ? 0 : int((4 + chunks - 1) / chunks);  // a tile's 4 * TILE lines over the chunks
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    std::vector<__m512i> acc(chunks * most * 4);  // chunk c's accumulators from c * most * 4
    int64_t configured = 0;  // the tiles' configuration (amx_configure's m * 64 + m1), 0: none yet
    for (int64_t g = g0; g < g1; ++g) {
      const int8_t* wg = wp + g * group_bytes;
      if (!amx) std::fill(acc.begin(), acc.end(), _mm512_setzero_si512());  // the tiles store whole sums
      for (int64_t c = 0; amx && c < chunks; c += 2) {  // chunks two at a time, the last alone
        const int64_t m = chunk_rows[c], m1 = c + 1 < chunks ? chunk_rows[c + 1] : 0;
        if (m * 64 + m1 != configured) amx_configure(m, m1), configured = m * 64 + m1;
        if (m1 == 0)
          amx_group(xu + chunk_start[c] * kp, kp, wg, quads, acc.data() + c * most * 4);
        else
          amx_pair(xu + chunk_start[c] * kp, xu + chunk_start[c + 1] * kp, kp, wg, quads,
                   acc.data() + c * most * 4, acc.data() + (c + 1) * most * 4);
      }
      for (int64_t t0 = 0; !amx && t0 < quads; t0 += tile) {
        const int64_t tq = std::min(tile, quads - t0);
        const int8_t* wt = wg + t0 * GROUP * 4;  // prefetches past the group run into the next one's
        for (int64_t c = 0; c < chunks; ++c) {
          const int8_t* far = wt + FAR_TILES * tile * GROUP * 4 + c * tile * far_lines * 64;
          DOTS[chunk_rows[c]](xu + chunk_start[c] * kp + t0 * 4, kp, wt, tq, acc.data() + c * most * 4,
                              chunks == 1 ? wt + PREFETCH : nullptr, far, far_lines);
        }
      }
      for (int64_t chunk = 0; chunk < chunks; ++chunk) {
        const int64_t r0 = chunk_start[chunk];
        store_group(acc.data() + chunk * most * 4, chunk_rows[chunk], step.data() + r0, g * GROUP, n, cs, ws, bp,
                    has_residual ? rp + r0 * n : nullptr, yp + r0 * n);
      }
    }
    if (configured != 0) amx_release();
  });
  return y;
}

// linear_rows_w4: int4 weights (W4A8), for a draft model, whose step is then bound by reading
// half the bytes. Weights symmetric per output column and group of G input features (G a multiple
// of 8), stored as u = w + 8 in 0..15, two per byte; activations quantized per row as in
// linear_rows, but signed. Per group, with x the row's int8 values:
//   sum x w = sum x u - 8 sum x   (exact in int32: vpdpbusd takes u as its unsigned operand)
// then fp32(that) * the group's scale, accumulated over groups in order; * the row's step, + bias,
// + residual. Each row is computed alone, so the result does not depend on the other rows. On a
// CPU with AMX, AMX_MIN_ROWS_INT4 rows or more (a draft's wide tree levels, batches) take its tiles for the
// integer sums (w4_columns_amx), the rest unchanged.

// The 64 columns of one column group for ROWS rows: out[r * 4 + c] = sum over groups of
// scale * (sum x u - 8 sum x) for block c (16 columns). w: the group's packed weights
// (K/8, 64, 4): byte (p, col, j) holds u[col][8p + j] in its low nibble and u[col][8p + 4 + j]
// in its high one; scales: (K/G, 64) fp16; x32: rows' int8 activations as 4-byte quads.
template <int ROWS>
inline void w4_columns(const int32_t* x32, int64_t quad_stride, const int32_t* xsum, int64_t groups,
                       const uint8_t* w, const at::Half* scales, int64_t pairs_per_group, __m512* out) {
  // up to 2 rows the fp32 sums stay in registers; 4 rows need all 32 for the int32 ones, and
  // theirs live in `out` between groups
  __m512 regs[ROWS <= 2 ? ROWS * 4 : 1];
  __m512* f = ROWS <= 2 ? regs : out;
  for (int i = 0; i < ROWS * 4; ++i) f[i] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    __m512i a[ROWS * 4];
    for (int i = 0; i < ROWS * 4; ++i) a[i] = _mm512_setzero_si512();
    for (int64_t p = g * pairs_per_group; p < (g + 1) * pairs_per_group; ++p) {
      const uint8_t* wp = w + p * 256;
      for (int l = 0; l < 4; ++l) _mm_prefetch(reinterpret_cast<const char*>(wp + PREFETCH + l * 64), _MM_HINT_T0);
      if (FAR_PREFETCH > 0) _mm_prefetch(reinterpret_cast<const char*>(wp + FAR_PREFETCH), _MM_HINT_T1);
      __m512i xa[ROWS], xb[ROWS];
      for (int r = 0; r < ROWS; ++r) {
        xa[r] = _mm512_set1_epi32(x32[r * quad_stride + 2 * p]);
        xb[r] = _mm512_set1_epi32(x32[r * quad_stride + 2 * p + 1]);
      }
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(wp + c * 64);
        const __m512i lo = _mm512_and_si512(v, low);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        for (int r = 0; r < ROWS; ++r) {
          dpbusd(a[r * 4 + c], lo, xa[r]);
          dpbusd(a[r * 4 + c], hi, xb[r]);
        }
      }
    }
    for (int c = 0; c < 4; ++c) {
      const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + g * 64 + c * 16)));
      for (int r = 0; r < ROWS; ++r) {
        const __m512i exact = _mm512_sub_epi32(a[r * 4 + c], _mm512_set1_epi32(8 * xsum[r * groups + g]));
        f[r * 4 + c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), sc, f[r * 4 + c]);
      }
    }
  }
  if (ROWS <= 2)
    for (int i = 0; i < ROWS * 4; ++i) out[i] = f[i];
}

// w4_columns on AMX, for m rows (tiles configured by amx_configure(m, 0)) and groups of 64
// features (one tile step each): per group the 4 blocks' nibbles are spread into u8 weight tiles
// (ub, 4 x 16 quads x 64 bytes), tdpbsud takes the rows' signed int8 against them (the same exact
// sum x u as vpdpbusd's), and the group's fp32 step is the VNNI loop's, with the same FMA, so the
// bits are the same. out[r * 4 + c] as w4_columns'; x8: the rows' int8 values, k apart.
// ub_all: the u8 tiles, 4 KB per group, ub_step bytes apart: 0 (each group's spread in turn into
// the same 4 KB) or 4096 (the first of many chunks spreads every group of the column group once,
// `spread`, and the others read them).
__attribute__((target("amx-tile,amx-int8"))) void w4_columns_amx(const int8_t* x8, int64_t k, int64_t m,
                                                                 const int32_t* xsum, int64_t groups,
                                                                 const uint8_t* w, const at::Half* scales,
                                                                 uint8_t* ub_all, int64_t ub_step, bool spread,
                                                                 int32_t* sums, __m512* out) {
  for (int64_t i = 0; i < m * 4; ++i) out[i] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    uint8_t* ub = ub_all + g * ub_step;
    for (int64_t p = 0; spread && p < 8; ++p) {  // 8 byte pairs of quads per 64 features
      const uint8_t* wp = w + (g * 8 + p) * 256;
      for (int l = 0; l < 4; ++l) _mm_prefetch(reinterpret_cast<const char*>(wp + PREFETCH + l * 64), _MM_HINT_T0);
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(wp + c * 64);
        _mm512_store_si512(ub + c * 1024 + 2 * p * 64, _mm512_and_si512(v, low));
        _mm512_store_si512(ub + c * 1024 + (2 * p + 1) * 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
      }
    }
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, x8 + g * 64, k);
    _tile_loadd(5, ub, 64);
    _tile_dpbsud(0, 4, 5);
    _tile_loadd(6, ub + 1024, 64);
    _tile_dpbsud(1, 4, 6);
    _tile_loadd(7, ub + 2048, 64);
    _tile_dpbsud(2, 4, 7);
    _tile_loadd(5, ub + 3072, 64);
    _tile_dpbsud(3, 4, 5);
    _tile_stored(0, sums, 4 * 64);  // sums[r * 64 + c * 16 + j]: row r, block c, column j
    _tile_stored(1, sums + 16, 4 * 64);
    _tile_stored(2, sums + 32, 4 * 64);
    _tile_stored(3, sums + 48, 4 * 64);
    for (int c = 0; c < 4; ++c) {
      const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + g * 64 + c * 16)));
      for (int64_t r = 0; r < m; ++r) {
        const __m512i exact = _mm512_sub_epi32(_mm512_loadu_si512(sums + r * 64 + c * 16),
                                               _mm512_set1_epi32(8 * xsum[r * groups + g]));
        out[r * 4 + c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), sc, out[r * 4 + c]);
      }
    }
  }
}

// x (R, K) fp32; packed (N_pad / 64, K / 8, 64, 4) uint8; scales (N_pad / 64, K / G, 64) fp16;
// n: output features (<= N_pad); bias (n,) fp32 or None; residual (R, n) fp32 or None. Returns (R, n).
at::Tensor linear_rows_w4(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scales, int64_t n,
                          const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(x_in.dim() == 2, "x must be (R, K)");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t rows = x.size(0), k = x.size(1);
  speclm_common::check_w4(packed, scales, k, n);
  const float* bp = speclm_common::optional_rows(bias, rows, n, false);
  const float* rp = speclm_common::optional_rows(residual, rows, n, true);
  const bool has_bias = bp != nullptr, has_residual = rp != nullptr;
  if (rows == 0) return at::empty({0, n}, x.options());
  const int64_t groups = scales.size(1), group = k / groups;

  // Quantize each row: step = max|x| / 127, xq = round(x / step) (half to even); xsum: per group.
  const SignedRows q = signed_rows(x.data_ptr<float>(), rows, k, group);
  const std::vector<int8_t>& xq = q.xq;
  const std::vector<int32_t>& xsum = q.sums;
  const std::vector<float>& step = q.step;

  at::Tensor y = at::empty({rows, n}, x.options());
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const at::Half* sp = scales.data_ptr<at::Half>();
  const int32_t* x32 = reinterpret_cast<const int32_t*>(xq.data());
  const int64_t quad_stride = k / 4, pairs_per_group = group / 8, column_groups = packed.size(0);
  // AMX for enough rows where a group is one tile step (64 features): near-equal chunks of at most
  // AMX_ROWS rows a pass; else the VNNI loop, up to four rows a pass.
  const bool amx = group == AMX_QUADS * 4 && use_amx(rows, k, amx_min_rows_int4);
  const int64_t amx_chunks = amx ? (rows + AMX_ROWS - 1) / AMX_ROWS : 0;
  at::parallel_for(0, column_groups, 1, [&](int64_t g0, int64_t g1) {
    __m512 acc[AMX_ROWS * 4];
    // the weights as u8 tiles (AMX): a group's 4 KB at a time, or for more than two chunks (a
    // prefill block) a whole column group's, spread once: two chunks spread them again for less
    // than writing them out and reading them back costs
    const int64_t ub_step = amx_chunks > 2 ? 4096 : 0;
    std::unique_ptr<uint8_t[], void (*)(void*)> ub(
        amx ? static_cast<uint8_t*>(std::aligned_alloc(64, ub_step ? groups * ub_step : 4096)) : nullptr, std::free);
    alignas(64) int32_t sums[AMX_ROWS * 64];  // a group's tile sums (AMX)
    int64_t configured = 0;                   // the rows the tiles are configured for, 0: none yet
    for (int64_t cg = g0; cg < g1; ++cg) {
      const uint8_t* wg = wp + cg * (k / 8) * 256;
      const at::Half* sg = sp + cg * groups * GROUP;
      for (int64_t r0 = 0, chunk = 0; r0 < rows; ++chunk) {  // rows a pass; the weights stay in cache
        const int rc = amx ? int((rows - r0) / (amx_chunks - chunk))
                           : rows - r0 >= 4 ? 4 : (rows - r0 >= 2 ? 2 : 1);
        const int32_t* xr = x32 + r0 * quad_stride;
        const int32_t* sr = xsum.data() + r0 * groups;
        if (amx) {
          if (rc != configured) amx_configure(rc, 0), configured = rc;
          w4_columns_amx(xq.data() + r0 * k, k, rc, sr, groups, wg, sg, ub.get(), ub_step, chunk == 0 || !ub_step,
                         sums, acc);
        } else if (rc == 4) w4_columns<4>(xr, quad_stride, sr, groups, wg, sg, pairs_per_group, acc);
        else if (rc == 2) w4_columns<2>(xr, quad_stride, sr, groups, wg, sg, pairs_per_group, acc);
        else w4_columns<1>(xr, quad_stride, sr, groups, wg, sg, pairs_per_group, acc);
        const int64_t col0 = cg * GROUP;
        const int blocks = int(std::min<int64_t>(4, (n - col0 + BLOCK - 1) / BLOCK));
        for (int r = 0; r < rc; ++r) {  // row by row: a row's blocks are contiguous in y
          const __m512 row_step = _mm512_set1_ps(step[r0 + r]);
          for (int c = 0; c < blocks; ++c) {
            const int64_t col = col0 + c * BLOCK;
            const __mmask16 mask = col + BLOCK <= n ? __mmask16(0xFFFF) : __mmask16((1u << (n - col)) - 1);
            __m512 v = _mm512_mul_ps(acc[r * 4 + c], row_step);
            if (has_bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bp + col));
            if (has_residual) v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, rp + (r0 + r) * n + col), v);
            _mm512_mask_storeu_ps(yp + (r0 + r) * n + col, mask, v);
          }
        }
        r0 += rc;
      }
    }
    if (configured != 0) amx_release();
  });
  return y;
}

// linear_rows_kq: a GGUF file's own quantized blocks (Q4_K, Q6_K, Q5_0, Q8_0; speclm.quant.gguf), not
// quantized again. Weight (column c, feature i), b = i / block, s = i / super:
//   with mins (Q4_K):       d[c, s] * sc[c, b] * u[c, i] - dmin[c, s] * mn[c, b]
//   with a zero point z:    d[c, s] * sc[c, b] * (u[c, i] - z)          (Q6_K 32, Q5_0 16, Q8_0 128)
// u the file's unsigned quants, packed 4 bits (linear_rows_w4's nibbles), 6 bits (those nibbles
// and a plane of 2-bit high parts) or 8; sc and mn the file's integer block scales and mins
// (int8), d and dmin its fp16 super-block scales as fp32. Each activation row is quantized to int8
// as linear_rows_w4's, and per block, with exact integer sums,
//   mins:        f = fma(fp32(sum x u), d sc, f);  f = fma(-(dmin mn), fp32(sum x), f)
//   zero point:  f = fma(fp32(sum x u - z sum x), d sc, f)
// (d sc and dmin mn are exact in fp32: an fp16 times an integer below 2**8), blocks in order; then
// * the row's step, + bias, + residual. Each row is computed alone, so its bits do not depend on
// the other rows.
// Layouts per block of 16 output columns (one 512-bit accumulator), 64-byte k-steps (col, j) of:
// 4 bits: 8 features, (K/8, 16, 4), low nibble feature 8p + j, high 8p + 4 + j;
// 6 bits: 16 features in 3 steps, (K/16 * 3, 16, 4): two nibble planes as 4 bits' for features
//   16q .. 16q + 7 and 16q + 8 .. 16q + 15, then the 2-bit high parts of features 16q + j, + 4, + 8,
//   + 12 at bits 0, 2, 4, 6;
// 8 bits: 4 features, (K/4, 16, 4), feature 4q + j.
// A pass takes one column block for up to KQ_ROWS rows, its integer and fp32 sums in registers:
// each 64-byte line of weights is read once per pass and unpacked once for all its rows.
constexpr int KQ_ROWS = 12;
// Each pass also prefetches its stream KQ_FAR bytes ahead into L2 (speclm.defaults.KQ_FAR_PREFETCH_BYTES).
constexpr int64_t KQ_FAR = SPECLM_KQ_FAR;

template <int BITS>
constexpr int64_t kq_step_features() { return BITS == 4 ? 8 : BITS == 6 ? 16 : 4; }

template <int ROWS, int BITS, bool MINS>
void kq_block(const int32_t* x32, int64_t quad_stride, const speclm_common::KqRowSums& sums, int64_t blocks,
              int64_t block, int64_t per_super, const uint8_t* w, const int8_t* sc, const int8_t* mn, const float* d,
              const float* dmin, __m512* out) {
  __m512 f[ROWS];
  for (int r = 0; r < ROWS; ++r) f[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
  constexpr int64_t features = kq_step_features<BITS>();
  constexpr int64_t step_bytes = BITS == 6 ? 192 : 64;
  constexpr int quads = features / 4;
  const int64_t steps = block / features;
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i a[ROWS];  // from - z sum x with a zero point: the sum ends as sum x (u - z)
    for (int r = 0; r < ROWS; ++r)
      a[r] = MINS ? _mm512_setzero_si512() : _mm512_set1_epi32(sums.less[r * sums.stride + b]);
    for (int64_t p = b * steps; p < (b + 1) * steps; ++p) {
      const uint8_t* wp = w + p * step_bytes;
      for (int l = 0; l < step_bytes / 64; ++l) {
        _mm_prefetch(reinterpret_cast<const char*>(wp + PREFETCH + l * 64), _MM_HINT_T0);
        if (KQ_FAR > 0) _mm_prefetch(reinterpret_cast<const char*>(wp + KQ_FAR + l * 64), _MM_HINT_T1);
      }
      __m512i u[quads];
      if (BITS == 8) {
        u[0] = _mm512_loadu_si512(wp);
      } else {
        const __m512i v = _mm512_loadu_si512(wp);
        u[0] = _mm512_and_si512(v, low);
        u[1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        if (BITS == 6) {
          const __m512i v1 = _mm512_loadu_si512(wp + 64);
          const __m512i h = _mm512_loadu_si512(wp + 128);
          u[2] = _mm512_and_si512(v1, low);
          u[3] = _mm512_and_si512(_mm512_srli_epi16(v1, 4), low);
          // u |= the high parts at bits 4-5: A | (B & C) is ternary logic 0xF8
          u[0] = _mm512_ternarylogic_epi32(u[0], _mm512_slli_epi16(h, 4), top, 0xF8);
          u[1] = _mm512_ternarylogic_epi32(u[1], _mm512_slli_epi16(h, 2), top, 0xF8);
          u[2] = _mm512_ternarylogic_epi32(u[2], h, top, 0xF8);
          u[3] = _mm512_ternarylogic_epi32(u[3], _mm512_srli_epi16(h, 2), top, 0xF8);
        }
      }
      for (int q = 0; q < quads; ++q)
        for (int r = 0; r < ROWS; ++r) dpbusd(a[r], u[q], _mm512_set1_epi32(x32[r * quad_stride + quads * p + q]));
    }
    const int64_t s = b / per_super;
    const __m512 scale = _mm512_mul_ps(
        _mm512_loadu_ps(d + s * 16),
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + b * 16)))));
    if (MINS) {
      const __m512 mins = _mm512_mul_ps(
          _mm512_loadu_ps(dmin + s * 16),
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mn + b * 16)))));
      for (int r = 0; r < ROWS; ++r) {
        f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[r]), scale, f[r]);
        f[r] = _mm512_fnmadd_ps(mins, _mm512_set1_ps(sums.fp32[r * sums.stride + b]), f[r]);
      }
    } else {
      for (int r = 0; r < ROWS; ++r) f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[r]), scale, f[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) out[r] = f[r];
}

using KqFn = void (*)(const int32_t*, int64_t, const speclm_common::KqRowSums&, int64_t, int64_t, int64_t, const uint8_t*,
                      const int8_t*, const int8_t*, const float*, const float*, __m512*);

template <int BITS, bool MINS, size_t... I>
constexpr std::array<KqFn, sizeof...(I)> kq_by_rows(std::index_sequence<I...>) {
  return {kq_block<int(I) + 1, BITS, MINS>...};
}
template <int BITS, bool MINS>
constexpr std::array<KqFn, KQ_ROWS> KQ_BY_ROWS = kq_by_rows<BITS, MINS>(std::make_index_sequence<KQ_ROWS>{});

// x (R, K) fp32; qs uint8 in the layout of `bits` (above), N_pad/16 column blocks first; sc (N_pad/16,
// K/block, 16) int8; d (N_pad/16, K/super, 16) fp32; mn and dmin as sc and d where the format has
// mins (zero 0), else None; n output features; bias (n,) or None; residual (R, n) or None.
at::Tensor linear_rows_kq(const at::Tensor& x_in, const at::Tensor& qs, int64_t bits, int64_t zero, const at::Tensor& sc,
                          const at::Tensor& d, const c10::optional<at::Tensor>& mn,
                          const c10::optional<at::Tensor>& dmin, int64_t n, const c10::optional<at::Tensor>& bias,
                          const c10::optional<at::Tensor>& residual) {
  const speclm_common::KqCall call = speclm_common::kq_call(x_in, qs, bits, zero, sc, d, mn, dmin, n, bias, residual);
  const at::Tensor& x = call.x;
  const int64_t rows = call.rows, k = call.k;
  const bool mins = call.mins;
  const float* bp = call.bias;
  const float* rp = call.residual;
  const bool has_bias = bp != nullptr, has_residual = rp != nullptr;
  if (rows == 0) return at::empty({0, n}, x.options());
  const int64_t blocks = call.blocks, block = call.block, per_super = call.per_super;

  const SignedRows q = signed_rows(x.data_ptr<float>(), rows, k, block);
  const std::vector<int8_t>& xq = q.xq;
  const std::vector<float>& step = q.step;
  const speclm_common::KqSums all = speclm_common::kq_sums(q.sums, zero, mins, blocks);

  at::Tensor y = at::empty({rows, n}, x.options());
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = qs.data_ptr<uint8_t>();
  const int8_t* scp = sc.data_ptr<int8_t>();
  const int8_t* mnp = mins ? mn->data_ptr<int8_t>() : nullptr;
  const float* dp = d.data_ptr<float>();
  const float* dmp = mins ? dmin->data_ptr<float>() : nullptr;
  const int32_t* x32 = reinterpret_cast<const int32_t*>(xq.data());
  const int64_t quad_stride = k / 4, column_blocks = qs.size(0), supers = d.size(1);
  const int64_t block_bytes = k * bits * BLOCK / 8;  // a column block's quants
  const KqFn* by_rows = (bits == 4 ? (mins ? KQ_BY_ROWS<4, true> : KQ_BY_ROWS<4, false>)
                         : bits == 6 ? KQ_BY_ROWS<6, false> : KQ_BY_ROWS<8, false>).data();
  // near-equal passes of at most KQ_ROWS rows
  const int64_t passes = (rows + KQ_ROWS - 1) / KQ_ROWS;
  at::parallel_for(0, column_blocks, 4, [&](int64_t c0, int64_t c1) {
    __m512 acc[KQ_ROWS];
    for (int64_t cb = c0; cb < c1; ++cb) {
      const int64_t col = cb * BLOCK;
      const __mmask16 mask = col + BLOCK <= n ? __mmask16(0xFFFF) : __mmask16((1u << (n - col)) - 1);
      for (int64_t r0 = 0, pass = 0; r0 < rows; ++pass) {
        const int rc = int((rows - r0) / (passes - pass));
        by_rows[rc - 1](x32 + r0 * quad_stride, quad_stride, all.from(r0), blocks, block, per_super,
                        wp + cb * block_bytes, scp + cb * blocks * BLOCK,
                        mins ? mnp + cb * blocks * BLOCK : nullptr, dp + cb * supers * BLOCK,
                        mins ? dmp + cb * supers * BLOCK : nullptr, acc);
        for (int r = 0; r < rc; ++r) {
          __m512 v = _mm512_mul_ps(acc[r], _mm512_set1_ps(step[r0 + r]));
          if (has_bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bp + col));
          if (has_residual) v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, rp + (r0 + r) * n + col), v);
          _mm512_mask_storeu_ps(yp + (r0 + r) * n + col, mask, v);
        }
        r0 += rc;
      }
    }
  });
  return y;
}

// RMSNorm of each row of x (R, E) fp32, transformers' formula: w * (x * 1 / sqrt(mean(x^2) + eps)).
// One call instead of the several aten ops of F.rms_norm, which cost more than the arithmetic
// on a decode step's few rows. The sum of squares runs in 16 lanes in a fixed order, so a row's
// result does not depend on the other rows.
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight, double eps) {
  return speclm_common::rms_norm_rows(x_in, weight, eps, [](const float* row, const float* wp, float* out, int64_t e,
                                                             float epsf) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < e; i += 16) {
      const __mmask16 m = i + 16 <= e ? __mmask16(0xFFFF) : __mmask16((1u << (e - i)) - 1);
      const __m512 v = _mm512_maskz_loadu_ps(m, row + i);
      acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
    }
    const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(e) + epsf);
    const __m512 vinv = _mm512_set1_ps(inv);
    for (int64_t i = 0; i < e; i += 16) {
      const __mmask16 m = i + 16 <= e ? __mmask16(0xFFFF) : __mmask16((1u << (e - i)) - 1);
      const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + i), vinv);
      _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, wp + i), v));
    }
  });
}

namespace {

// exp: 2^n * p(r), n = round(x / ln 2), r = x - n ln 2 in two parts, p Cephes' degree-6
// polynomial; about 1 ulp. Inputs clamped to [-87, 88], where float exp neither under- nor overflows.
inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

}  // namespace

// The gated MLP's middle: gate_up (R, 2 I) -> silu(gate) * up (R, I), silu(g) = g / (1 + exp(-g)).
at::Tensor silu_mul(const at::Tensor& gate_up_in) {
  return speclm_common::silu_mul_rows(gate_up_in, [](const float* g, const float* u, float* out, int64_t inner) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t i = 0; i < inner; i += 16) {
      const __mmask16 m = i + 16 <= inner ? __mmask16(0xFFFF) : __mmask16((1u << (inner - i)) - 1);
      const __m512 gv = _mm512_maskz_loadu_ps(m, g + i);
      const __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
      _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(silu, _mm512_maskz_loadu_ps(m, u + i)));
    }
  });
}

// Slots per block in decode_attention: a block of keys or values (SLOT_BLOCK x D floats, 16 KB at
// D = 128) stays in the 32 KB L1 cache while every query of the kv head goes through it.
constexpr int64_t SLOT_BLOCK = SPECLM_SLOT_BLOCK;  // speclm.defaults.ATTENTION_SLOT_BLOCK
// Queries per tile in decode_attention (its default query_tile): a tile's scores (64 x its slots
// floats, 180 KB at 700 slots) stay in the per-core L2 cache. A decode forward's queries (its
// tokens times the query heads of a kv head) fit in one tile.
constexpr int64_t QUERY_TILE = SPECLM_QUERY_TILE;  // speclm.defaults.ATTENTION_QUERY_TILE

// Lane j of the result: the sum of a[j]'s 16 lanes, by a fixed tree for each j (halves, then
// quarters, ...; the additions of 16 one-by-one reductions, in a quarter of the instructions).
inline __m512 sum_lanes16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)  // 256-bit halves: slot i's 8 partial sums, then slot i + 8's
    b[i] = _mm512_add_ps(_mm512_mask_blend_ps(0xFF00, a[i], a[i + 8]),
                         _mm512_shuffle_f32x4(a[i], a[i + 8], _MM_SHUFFLE(1, 0, 3, 2)));
  for (int i = 0; i < 4; ++i)  // 128-bit quarters: slots i, i + 8, i + 4, i + 12
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[i], b[i + 4], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(b[i], b[i + 4], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)  // pairs within quarters
    d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[i], c[i + 2], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(c[i], c[i + 2], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // e holds slots 0 2 1 3 8 10 9 11 4 6 5 7 12 14 13 15, an order that is its own inverse
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15), e);
}

// out[s0 + u] = (q . k_{s0 + u}) * scale for u < valid (<= 16): 16 slots' dot products side by
// side, one accumulator each, then summed across lanes together. A slot's bits depend on nothing
// but its own q and k: other lanes are not stored (a short block re-reads slot s0 for them).
template <int D>
inline void score16_fixed(const float* q, const float* k, float scale, float* out) {  // 16 slots from k
  __m512 a[16];
  const __m512 q0 = _mm512_loadu_ps(q);
  for (int u = 0; u < 16; ++u) a[u] = _mm512_mul_ps(q0, _mm512_loadu_ps(k + u * D));
  for (int c = 16; c < D; c += 16) {
    const __m512 qc = _mm512_loadu_ps(q + c);
    for (int u = 0; u < 16; ++u) a[u] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(k + u * D + c), a[u]);
  }
  _mm512_storeu_ps(out, _mm512_mul_ps(sum_lanes16(a), _mm512_set1_ps(scale)));
}

// Lane u of the result: q . rows[u], summed across lanes as score16_fixed's blocks are.
inline __m512 dots16(const float* q, const float* const* rows, int64_t dim) {
  __m512 a[16];
  const __m512 q0 = _mm512_loadu_ps(q);
  for (int u = 0; u < 16; ++u) a[u] = _mm512_mul_ps(q0, _mm512_loadu_ps(rows[u]));
  for (int64_t c = 16; c < dim; c += 16) {
    const __m512 qc = _mm512_loadu_ps(q + c);
    for (int u = 0; u < 16; ++u) a[u] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(rows[u] + c), a[u]);
  }
  return sum_lanes16(a);
}

inline void score16(const float* q, const float* k, int64_t dim, int64_t s0, int64_t valid, float scale, float* out) {
  if (valid == 16 && dim == 128) return score16_fixed<128>(q, k + s0 * dim, scale, out + s0);
  if (valid == 16 && dim == 64) return score16_fixed<64>(q, k + s0 * dim, scale, out + s0);
  const float* rows[16];
  for (int u = 0; u < 16; ++u) rows[u] = k + (s0 + (u < valid ? u : 0)) * dim;
  const __mmask16 m = valid == 16 ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
  _mm512_mask_storeu_ps(out + s0, m, _mm512_mul_ps(dots16(q, rows, dim), _mm512_set1_ps(scale)));
}

// score16 for the leading slots s0 .. s0 + valid - 1 of a query whose first is slot `base`, each in the
// lane it has there (u = its index - s0), read where the cache holds them (common.h's place: in a ring
// a block may wrap past the end).
inline void score16_at(const float* q, const float* kg, int64_t dim, int64_t base, int64_t s0, int64_t valid,
                       int64_t capacity, bool ring, float scale, float* out) {
  const int64_t at = speclm_common::place(base + s0, capacity, ring);
  if (!ring || at + valid <= capacity) return score16(q, kg + at * dim, dim, 0, valid, scale, out + s0);
  const float* rows[16];
  for (int u = 0; u < 16; ++u) rows[u] = kg + speclm_common::place(base + s0 + (u < valid ? u : 0), capacity, ring) * dim;
  const __mmask16 m = valid == 16 ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
  _mm512_mask_storeu_ps(out + s0, m, _mm512_mul_ps(dots16(q, rows, dim), _mm512_set1_ps(scale)));
}

// out[index] = (q . k) * scale for one key row k, computed in lane index % 16 of a 16-slot block,
// where a plain step computes the slot at that index: the same operations, so the same bits.
inline void score_apart(const float* q, const float* k, int64_t dim, int64_t index, float scale, float* out) {
  const float* rows[16];
  for (int u = 0; u < 16; ++u) rows[u] = k;
  const int lane = static_cast<int>(index % 16);
  _mm512_mask_storeu_ps(out + index - lane, __mmask16(1u << lane), _mm512_mul_ps(dots16(q, rows, dim), _mm512_set1_ps(scale)));
}

// acc (D) += p_j v_j for slots j0 .. j1 - 1, one FMA per feature and slot in slot order: with the
// features of one query in registers (C chunks of 16), the C chains run side by side.
template <int C>
inline void weigh_values_fixed(const float* p, const float* v, int64_t j0, int64_t j1, float* acc) {
  __m512 a[C];
  for (int c = 0; c < C; ++c) a[c] = _mm512_loadu_ps(acc + c * 16);
  for (int64_t j = j0; j < j1; ++j) {
    const __m512 pj = _mm512_set1_ps(p[j]);
    for (int c = 0; c < C; ++c) a[c] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(v + j * C * 16 + c * 16), a[c]);
  }
  for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + c * 16, a[c]);
}

inline void weigh_values(const float* p, const float* v, int64_t dim, int64_t j0, int64_t j1, float* acc) {
  switch (dim) {
    case 64: return weigh_values_fixed<4>(p, v, j0, j1, acc);
    case 128: return weigh_values_fixed<8>(p, v, j0, j1, acc);
    default:
      for (int64_t c = 0; c < dim; c += 16) {
        __m512 a = _mm512_loadu_ps(acc + c);
        for (int64_t j = j0; j < j1; ++j) a = _mm512_fmadd_ps(_mm512_set1_ps(p[j]), _mm512_loadu_ps(v + j * dim + c), a);
        _mm512_storeu_ps(acc + c, a);
      }
  }
}

// One decode forward's attention, after the q/k/v projection: rotary on q and k, k and v
// written to the cache at each row's slots start_b .. start_b + M - 1, and each query
// attending on its own over exactly the slots before it (speclm.attention explains why: a
// token's result must not depend on the other tokens of the forward, nor on other rows).
// Replaces some forty aten ops per layer (slices, rolls, copies, one SDPA call per query).
// qkv (B M, (H + 2 H_kv) D); cos, sin (P, D) rotary tables by position (sin sign-folded, as
// speclm.forward.lean's: x * cos + roll(x, D/2) * sin, the same three roundings); keys, values
// (B, H_kv, capacity, D) this layer's cache; starts, counts (B,): slots before this forward and
// real tokens per row (the rest of a ragged row's M columns are padding: written, not attended
// from, output zero). tree: empty for chains, else which slots each query attends
// (common.h's visible_of): a tree node attends the shared prefix, then its ancestors' slots and
// its own, and is rotated at its depth's position: the slots, values and order of a plain step at
// that position, so its bits are that step's. window: a sliding window's keys (0: none; common.h's
// windowed): a query attends only the slots of its last `window` positions. softcap: scores become
// cap * tanh(s / cap) before the softmax (0: none). ring: the cache is a ring of `capacity` slots
// (a sliding layer's, speclm.forward.cache): slot s lives at s mod capacity.
// Returns (B M, H D).
at::Tensor decode_attention(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor keys,
                            at::Tensor values, const std::vector<int64_t>& starts, const std::vector<int64_t>& counts,
                            int64_t heads, int64_t kv_heads, double scale, const std::vector<int64_t>& tree,
                            int64_t query_tile, const std::vector<int64_t>& cache_rows, int64_t window, double softcap,
                            bool ring) {
  const speclm_common::AttentionShape shape = speclm_common::check_attention(
      qkv, cos, sin, keys, values, starts, counts, heads, kv_heads, tree, query_tile, cache_rows, ring);
  const int64_t batch = shape.batch, rows = shape.rows, width = shape.width, dim = shape.dim;
  const int64_t capacity = shape.capacity, half = dim / 2;
  auto visible = [&](int64_t b, int64_t i) { return speclm_common::visible_of(tree, b * width + i, starts[b] + i); };
  const int64_t stride = qkv.size(1), groups = heads / kv_heads, chunks = dim / 16;
  const float* src = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* kp = keys.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  std::vector<float> q(rows * heads * dim);

  auto rotate = [&](const float* x, const float* c, const float* sn, float* out) {
    for (int64_t d = 0; d < dim; d += 16) {  // roll by D/2: the other half, at the same offset
      const int64_t o = d < half ? d + half : d - half;
      const __m512 a = _mm512_mul_ps(_mm512_loadu_ps(x + d), _mm512_loadu_ps(c + d));
      const __m512 b = _mm512_mul_ps(_mm512_loadu_ps(x + o), _mm512_loadu_ps(sn + d));
      _mm512_storeu_ps(out + d, _mm512_add_ps(a, b));
    }
  };
  for (int64_t b = 0; b < batch; ++b) {
    float* kb = kp + speclm_common::cache_row(cache_rows, b) * kv_heads * capacity * dim;
    float* vb = vp + speclm_common::cache_row(cache_rows, b) * kv_heads * capacity * dim;
    for (int64_t i = 0; i < width; ++i) {
      const int64_t r = b * width + i, slot = speclm_common::place(starts[b] + i, capacity, ring);
      const int64_t at = visible(b, i).position();
      const float* row = src + r * stride;
      const float* c = cp + at * dim;
      const float* sn = sp + at * dim;
      for (int64_t h = 0; h < heads; ++h) rotate(row + h * dim, c, sn, q.data() + (r * heads + h) * dim);
      for (int64_t g = 0; g < kv_heads; ++g) {
        rotate(row + (heads + g) * dim, c, sn, kb + (g * capacity + slot) * dim);
        std::copy_n(row + (heads + kv_heads + g) * dim, dim, vb + (g * capacity + slot) * dim);
      }
    }
  }

  // Attention per (row, kv head, share of its queries): all the queries that read one kv head's
  // cache go through it together, a block of slots at a time, so each block of keys and values
  // is read once from memory for all of them (a per-query pass re-read the whole cache once per
  // query: at 2000 slots that no longer fits the caches). Each query's arithmetic is still its
  // own and in slot order (the same operations as one query alone), so the bits do not depend on
  // the other queries of the forward.
  at::Tensor out = at::empty({rows, heads * dim}, qkv.options());
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int64_t per_head = width * groups;  // queries that read one kv head of one row
  const int64_t shares = std::max<int64_t>(1, std::min<int64_t>(per_head, (at::get_num_threads() + batch * kv_heads - 1) /
                                                                              (batch * kv_heads)));
  at::parallel_for(0, batch * kv_heads * shares, 1, [&](int64_t t0, int64_t t1) {
    std::vector<int64_t> who;                 // query index r * heads + h, per query of this task
    std::vector<speclm_common::Visible> sees;  // the slots each query attends
    std::vector<float> scores, acc, inverse;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t share = t % shares, bg = t / shares, b = bg / kv_heads, g = bg % kv_heads;
      who.clear();
      sees.clear();
      for (int64_t n = share; n < per_head; n += shares) {
        const int64_t i = n / groups, h = g * groups + n % groups, r = b * width + i;
        if (i >= counts[b]) {  // a padding column
          std::fill_n(op + r * heads * dim + h * dim, dim, 0.0f);
          continue;
        }
        who.push_back(r * heads + h);
        sees.push_back(speclm_common::windowed(visible(b, i), window));
      }
      const int64_t nq = static_cast<int64_t>(who.size());
      if (nq == 0) continue;
      inverse.resize(nq);
      const float* kg = kp + (speclm_common::cache_row(cache_rows, b) * kv_heads + g) * capacity * dim;
      const float* vg = vp + (speclm_common::cache_row(cache_rows, b) * kv_heads + g) * capacity * dim;
      // Queries in tiles, so that a tile's scores stay in cache through the softmax and the
      // weighing of values (a prefill has thousands of queries per kv head: their scores all
      // at once were tens of MB, written and read back from memory). Each query's operations
      // are the same in any tile, so the bits do not depend on the tiling.
      for (int64_t n0 = 0; n0 < nq; n0 += query_tile) {
        const int64_t n1 = std::min(nq, n0 + query_tile);
        int64_t most = 0;  // entries of a query's scores: its leading slots, then those apart
        for (int64_t n = n0; n < n1; ++n) most = std::max(most, sees[n].lead() + sees[n].count);
        scores.resize((n1 - n0) * most);
        acc.assign((n1 - n0) * dim, 0.0f);
        for (int64_t j0 = 0; j0 < most; j0 += SLOT_BLOCK) {  // scores q . k_j * scale
          for (int64_t n = n0; n < n1; ++n) {
            const int64_t j1 = std::min(j0 + SLOT_BLOCK, sees[n].lead());
            for (int64_t s0 = j0; s0 < j1; s0 += 16)
              score16_at(q.data() + who[n] * dim, kg, dim, sees[n].base, s0, std::min<int64_t>(16, j1 - s0), capacity, ring,
                         sc, scores.data() + (n - n0) * most);
          }
        }
        for (int64_t n = n0; n < n1; ++n)  // slots apart, each scored in the lane a plain step's slot has
          for (int64_t e = 0; e < sees[n].count; ++e)
            score_apart(q.data() + who[n] * dim, kg + speclm_common::place(sees[n].apart[e], capacity, ring) * dim, dim, sees[n].lead() + e, sc,
                        scores.data() + (n - n0) * most);
        if (softcap > 0) {  // Gemma 2's soft-capped scores: cap * tanh(s / cap), each score on its own
          const float cap = static_cast<float>(softcap);
          for (int64_t n = n0; n < n1; ++n) {
            float* sn = scores.data() + (n - n0) * most;
            for (int64_t j = 0; j < sees[n].lead() + sees[n].count; ++j) sn[j] = cap * std::tanh(sn[j] / cap);
          }
        }
        for (int64_t n = n0; n < n1; ++n) {  // softmax numerators in place, and 1 / their sum
          float* sn = scores.data() + (n - n0) * most;
          const int64_t slots = sees[n].lead() + sees[n].count;
          __m512 vmax = _mm512_set1_ps(-INFINITY);  // a maximum does not depend on the order
          int64_t j = 0;
          for (; j + 16 <= slots; j += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(sn + j));
          if (j < slots) {
            const __mmask16 m = __mmask16((1u << (slots - j)) - 1);
            vmax = _mm512_mask_max_ps(vmax, m, vmax, _mm512_maskz_loadu_ps(m, sn + j));
          }
          const __m512 vtop = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
          __m512 vsum = _mm512_setzero_ps();
          for (j = 0; j + 16 <= slots; j += 16) {
            const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(sn + j), vtop));
            _mm512_storeu_ps(sn + j, e);
            vsum = _mm512_add_ps(vsum, e);
          }
          if (j < slots) {
            const __mmask16 m = __mmask16((1u << (slots - j)) - 1);
            const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sn + j), vtop));
            _mm512_mask_storeu_ps(sn + j, m, e);
            vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(m, e));
          }
          inverse[n] = 1.0f / _mm512_reduce_add_ps(vsum);
        }
        for (int64_t j0 = 0; j0 < most; j0 += SLOT_BLOCK) {  // out = sum_j p_j v_j in slot order, per feature
          for (int64_t n = n0; n < n1; ++n) {
            const int64_t j1 = std::min(j0 + SLOT_BLOCK, sees[n].lead());
            const float* pn = scores.data() + (n - n0) * most;
            speclm_common::runs(sees[n].base, j0, j1, capacity, ring, [&](int64_t a, int64_t e, int64_t at) {
              weigh_values(pn + a, vg + at * dim, dim, 0, e - a, acc.data() + (n - n0) * dim);
            });
          }
        }
        for (int64_t n = n0; n < n1; ++n)  // slots apart after, in order, as a plain step's last slots
          for (int64_t e = 0; e < sees[n].count; ++e)
            weigh_values(scores.data() + (n - n0) * most + sees[n].lead() + e,
                         vg + speclm_common::place(sees[n].apart[e], capacity, ring) * dim, dim, 0, 1,
                         acc.data() + (n - n0) * dim);
        for (int64_t n = n0; n < n1; ++n) {
          float* oh = op + (who[n] / heads) * heads * dim + (who[n] % heads) * dim;
          const __m512 inv = _mm512_set1_ps(inverse[n]);
          for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(oh + c * 16, _mm512_mul_ps(_mm512_loadu_ps(acc.data() + (n - n0) * dim + c * 16), inv));
        }
      }
    }
  });
  return out;
}

// The kernels run without the GIL (they touch no Python object): a server's event loop thread
// answers its clients while the engine thread computes, instead of waiting for a layer to end.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("linear_rows", &linear_rows, nogil, "int8 W8A8 linear over a few rows (AVX-512 VNNI)", py::arg("x"),
        py::arg("packed"), py::arg("colsum"), py::arg("wscale"), py::arg("bias"), py::arg("residual") = py::none());
  m.def("linear_rows_w4", &linear_rows_w4, nogil, "int4-weight (W4A8, grouped scales) linear over rows (AVX-512 VNNI)",
        py::arg("x"), py::arg("packed"), py::arg("scales"), py::arg("n"), py::arg("bias"),
        py::arg("residual") = py::none());
  m.def("linear_rows_kq", &linear_rows_kq, nogil, "a GGUF's own quantized blocks (4, 6 or 8-bit quants, block "
        "scales, mins or a zero point) linear over rows", py::arg("x"), py::arg("qs"), py::arg("bits"), py::arg("zero"),
        py::arg("sc"), py::arg("d"), py::arg("mn"), py::arg("dmin"), py::arg("n"), py::arg("bias"),
        py::arg("residual") = py::none());
  m.def("set_amx",
        [](int64_t min_rows, int64_t int4_min_rows) {
          amx_min_rows = int(min_rows);
          amx_min_rows_int4 = int(int4_min_rows < 0 ? min_rows : int4_min_rows);
          return amx_supported();
        },
        "linear_rows runs on AMX tiles from min_rows rows, linear_rows_w4 from int4_min_rows (-1: min_rows; 0: "
        "never); returns whether the CPU and Linux let AMX run here",
        py::arg("min_rows"), py::arg("int4_min_rows") = -1);
  m.def("linear_rows_path", [](int64_t rows, int64_t k) { return use_amx(rows, (k + 3) / 4 * 4, amx_min_rows) ? "amx" : "vnni"; },
        "which loop linear_rows runs for rows x k", py::arg("rows"), py::arg("k"));
  m.def("silu_mul", &silu_mul, nogil, "silu(gate) * up over rows of gate | up, fp32");
  m.def("rms_norm", &rms_norm, nogil, "RMSNorm over rows, fp32", py::arg("x"), py::arg("weight"), py::arg("eps"));
  m.def("decode_attention", &decode_attention, nogil, "rotary, cache write and per-query attention of one decode forward",
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("keys"), py::arg("values"), py::arg("starts"),
        py::arg("counts"), py::arg("heads"), py::arg("kv_heads"), py::arg("scale"),
        py::arg("tree") = std::vector<int64_t>(), py::arg("query_tile") = QUERY_TILE,
        py::arg("cache_rows") = std::vector<int64_t>(), py::arg("window") = 0,
        py::arg("softcap") = 0.0, py::arg("ring") = false);
}
