// speclm's CPU kernels for x86 CPUs with AVX2, FMA and F16C but no AVX-512 VNNI (built by
// speclm/kernels.py in place of cpu_kernels.cpp; docs/cpu-fast-path.md, "The compiled kernels"). The
// same functions, the same weight layouts and the same arithmetic as cpu_kernels.cpp:
// linear_rows, linear_rows_w4, linear_rows_kq, rms_norm, silu_mul, decode_attention.
//
// The int8 dot products. AVX2 has no vpdpbusd, and vpmaddubsw (u8 x s8, pairs summed in int16)
// saturates when one operand is u8 up to 255: oneDNN's AVX2 int8 GEMM is inexact for that
// reason (speclm.quant probes it). Here both operands stay within 127 in magnitude: with w the
// weights and x a row's int8 activations, |w| * (x with w's sign) = w * x (vpabsb, vpsignb), so
// each pair sums to at most 2 * 127 * 127 = 32258 and vpmaddubsw is exact; vpmaddwd by ones
// then adds the pairs into int32. Every integer is the exact dot product, as on the VNNI kernel
// and torch._int_mm, so a layer's output bits are theirs. int4 weights (u = w + 8 in 0..15) need
// no sign trick: u * x pairs reach 2 * 15 * 127.
//
// Every fp32 step (rescale, RMSNorm, SiLU, rotary, softmax) is computed per row in a fixed order,
// so a row's bits do not depend on the other rows of the call. Built with -ffp-contract=off:
// only the FMAs written here fuse.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t GROUP = 64;  // columns packed together (speclm.quant.vnni_layout, int4_layout)
constexpr int64_t BLOCK = 8;   // output columns per 256-bit accumulator
constexpr int64_t PREFETCH = SPECLM_PREFETCH;  // speclm.defaults.WEIGHT_PREFETCH_BYTES
constexpr int64_t PREFETCH_ONE_ROW = SPECLM_PREFETCH_ONE_ROW;  // the int8 kernel's at 1 row (defaults, likewise)

// The tail of a row's 8 columns: masked loads and stores of `valid` floats.
inline __m256i lane_mask(int64_t valid) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(valid)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline __m256 load8(const float* p, int64_t valid) {
  return valid >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lane_mask(valid));
}

inline void store8(float* p, __m256 v, int64_t valid) {
  if (valid >= 8) _mm256_storeu_ps(p, v);
  else _mm256_maskstore_ps(p, lane_mask(valid), v);
}

// One activation row quantized for the int8 dot products: step = max|x| / 127 (returned) and
// out[i] = round(x[i] / step) (half to even), zero-padded to kp: torch's path in speclm.quant,
// the same operations in the same fp32 roundings, 8 lanes at a time as cpu_kernels.cpp's 16 (a
// maximum does not depend on the order, and vdivps rounds as the scalar division does); each
// int32 truncated to its low byte.
inline float quantize_row(const float* row, int64_t k, int64_t kp, int8_t* out) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 vmax = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; i += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, load8(row + i, k - i)));
  const __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
  const __m128 m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float top = _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps(m2, m2, 1)));
  const float s = std::max(top, 1e-12f) / 127.0f;
  const __m256 vs = _mm256_set1_ps(s);
  // byte 0 of each int32 lane, lanes 0-3 in the low 4 bytes of each 128-bit half
  const __m256i low_bytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                             0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  for (int64_t i = 0; i < k; i += 8) {
    const __m256 v = _mm256_round_ps(_mm256_div_ps(load8(row + i, k - i), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i b = _mm256_shuffle_epi8(_mm256_cvtps_epi32(v), low_bytes);
    const uint64_t bytes = uint64_t(uint32_t(_mm256_extract_epi32(b, 0))) | uint64_t(uint32_t(_mm256_extract_epi32(b, 4))) << 32;
    std::memcpy(out + i, &bytes, std::min<int64_t>(8, k - i));
  }
  for (int64_t i = k; i < kp; ++i) out[i] = 0;
  return s;
}

// From this many rows (prefill blocks) the activations are quantized on torch's threads, each row
// alone as before: the same bytes.
constexpr int64_t QUANTIZE_THREADED_ROWS = 16;

// The rows of x (R, K) fp32 quantized for the int4 and GGUF-block kernels (quantize_row), as
// cpu_kernels.cpp's signed_rows: a few rows on the calling thread.
using speclm_common::SignedRows;
inline SignedRows signed_rows(const float* xp, int64_t rows, int64_t k, int64_t group) {
  const int64_t groups = k / group;
  SignedRows q(rows, k, group);
  speclm_common::for_rows(rows, rows < QUANTIZE_THREADED_ROWS, 8, [&](int64_t r) {
    int8_t* out = q.xq.data() + r * k;
    q.step[r] = quantize_row(xp + r * k, k, k, out);
    speclm_common::group_sums(out, k, group, q.sums.data() + r * groups);
  });
  return q;
}

// One row's `valid` columns from their fp32 sums: times the row's step, + bias, then residual +,
// in that order (the int4 and GGUF-block kernels').
inline void finish8(__m256 sums, float step, const float* bp, const float* rp, float* out, int64_t valid) {
  __m256 v = _mm256_mul_ps(sums, _mm256_set1_ps(step));
  if (bp) v = _mm256_add_ps(v, load8(bp, valid));
  if (rp) v = _mm256_add_ps(load8(rp, valid), v);
  store8(out, v, valid);
}

// acc (8 int32 lanes, one per column) += the 4-term dot products of x's quad (broadcast) with
// each column's 4 int8 weights in w, exactly (see the top of this file).
inline __m256i dot_quads(__m256i acc, __m256i x, __m256i w, __m256i wabs, __m256i ones) {
  const __m256i pairs = _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(x, w));  // exact: |pair| <= 32258
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ones));
}

// Quads (4 input features) per tile of a group's weights: 32 x 256 bytes = 8 KB, read from memory
// (or L2) by a tile's first pass and from the L1 cache by its others.
constexpr int64_t TILE = 32;
// With several passes per tile, each pass also prefetches its share of the tile FAR_TILES (64 KB)
// ahead into L2, so that the stream from memory goes on while the later passes compute from L1
// (without it, passes of 2 blocks for 4 rows were slower than the spilling passes of 4 they replace).
constexpr int64_t FAR_TILES = 8;

// acc[r][c0 + c] += sum over the tile's quads of x[r] . w[block c0 + c] for ROWS rows and CB of a
// group's 8 blocks of 8 columns. w: the tile's weights (quads, 64, 4) offset to block c0; acc: int32
// (ROWS, 64) per row, offset likewise, loaded and stored around the loop. ROWS * CB accumulators,
// ROWS broadcasts and 3 more fit the 16 registers. `near`: the tile's first pass fetches the stream
// that far ahead into L1 (else null); `far`: far_lines lines per quad from there into L2.
template <int ROWS, int CB, bool FAR = true>
void dot_chunk(const int32_t* x32, int64_t stride, const int8_t* w, int64_t quads, int32_t* acc, const int8_t* near,
               const int8_t* far, int far_lines) {
  __m256i a[ROWS * CB];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < CB; ++c) a[r * CB + c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + r * GROUP + c * BLOCK));
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t q = 0; q < quads; ++q) {
    const int8_t* wq = w + q * GROUP * 4;
    if (near != nullptr)
      for (int l = 0; l < 4; ++l) _mm_prefetch(reinterpret_cast<const char*>(near + q * GROUP * 4 + l * 64), _MM_HINT_T0);
    if constexpr (FAR)
      for (int l = 0; l < far_lines; ++l) _mm_prefetch(reinterpret_cast<const char*>(far + (q * far_lines + l) * 64), _MM_HINT_T1);
    __m256i xb[ROWS];
    for (int r = 0; r < ROWS; ++r) xb[r] = _mm256_set1_epi32(x32[r * stride + q]);
    for (int c = 0; c < CB; ++c) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + c * 32));
      const __m256i wabs = _mm256_abs_epi8(wv);
      for (int r = 0; r < ROWS; ++r) a[r * CB + c] = dot_quads(a[r * CB + c], xb[r], wv, wabs, ones);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < CB; ++c) _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + r * GROUP + c * BLOCK), a[r * CB + c]);
}

// How a chunk of 1 to 4 rows goes over a tile: its dot_chunk and the blocks (of 8) each pass covers,
// so that the accumulators fit the 16 registers. PASSES[0]: up to 8 rows in the call, with the L2
// prefetch: 3 rows alone as one chunk in 4 passes of 2 blocks, else chunks of
// 2 rows in passes of 4 blocks (and a last row in one pass of 8): at 4 to 8 rows faster than chunks
// of 4 rows, in 4 passes of 2 blocks or 2 passes of 4 (spilled registers), though every pass after a
// tile's first reads it from L1 (benchmarks/avx2/int8-two-row-chunks-ab.txt). PASSES[1]: above 8
// rows (prefill blocks), where the arithmetic dominates: chunks of 3 rows in passes of 4 blocks, the
// prefetch compiled out. 12 accumulators, 3 broadcasts, the weights and their absolute values spill
// only 3 accumulators (a memory operand of vpaddd and a store, off the 2 pipes that multiply):
// faster than 4 rows x 4 blocks (7 spilled), 4 x 2 or 2 x 8, and than reloading the broadcasts to
// spill nothing (on Zen 3 a broadcast from memory also takes an arithmetic pipe).
using ChunkFn = void (*)(const int32_t*, int64_t, const int8_t*, int64_t, int32_t*, const int8_t*, const int8_t*, int);
struct ChunkPasses {
  ChunkFn fn;
  int blocks;
};
constexpr ChunkPasses PASSES[2][5] = {
    {{nullptr, 0}, {dot_chunk<1, 8>, 8}, {dot_chunk<2, 4>, 4}, {dot_chunk<3, 2>, 2}, {nullptr, 0}},
    {{nullptr, 0}, {dot_chunk<1, 8, false>, 8}, {dot_chunk<2, 4, false>, 4}, {dot_chunk<3, 4, false>, 4},
     {dot_chunk<4, 4, false>, 4}}};

// Columns col .. col + valid - 1 of one row: fp32(dot) * wscale * step (+ bias) (+ residual),
// in that order (speclm.quant.Int8Linear.rows).
inline void rescale8(__m256i dots, const float* ws, float step, const float* bp, const float* rp, float* out,
                     int64_t valid) {
  __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(dots), load8(ws, valid));
  v = _mm256_mul_ps(v, _mm256_set1_ps(step));
  if (bp) v = _mm256_add_ps(v, load8(bp, valid));
  if (rp) v = _mm256_add_ps(load8(rp, valid), v);
  store8(out, v, valid);
}

}  // namespace

// The signature of cpu_kernels.cpp's: x (R, K) fp32; packed (N_pad / 64, K_pad / 4, 64, 4) int8
// (speclm.quant.vnni_layout); colsum: unused here (activations stay signed, no zero point);
// wscale (N,) fp32; bias (N,) or None; residual (R, N) fp32 or None. Returns (R, N) fp32.
at::Tensor linear_rows(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& colsum,
                       const at::Tensor& wscale, const c10::optional<at::Tensor>& bias,
                       const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(x_in.dim() == 2, "x must be (R, K)");
  TORCH_CHECK(packed.scalar_type() == at::kChar && wscale.scalar_type() == at::kFloat, "packed int8, wscale fp32");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == GROUP && packed.size(3) == 4 && packed.stride(3) == 1 &&
              packed.stride(2) == 4 && packed.stride(1) == GROUP * 4, "packed must be (N/64, K/4, 64, 4), contiguous groups");
  const int64_t rows = x.size(0), k = x.size(1), quads = packed.size(1);
  const int64_t kp = quads * 4, n = wscale.size(0);
  TORCH_CHECK(k <= kp && kp < k + 4 && n <= packed.size(0) * GROUP, "packed weight does not match x or wscale");
  (void)colsum;
  const float* bp = speclm_common::optional_rows(bias, rows, n, false);
  const float* rp = speclm_common::optional_rows(residual, rows, n, true);
  if (rows == 0) return at::empty({0, n}, x.options());

  std::vector<int8_t> xq(rows * kp);
  std::vector<float> step(rows);
  const float* xp = x.data_ptr<float>();
  speclm_common::for_rows(rows, rows < QUANTIZE_THREADED_ROWS, 8,
                          [&](int64_t r) { step[r] = quantize_row(xp + r * k, k, kp, xq.data() + r * kp); });
  const int32_t* x32 = reinterpret_cast<const int32_t*>(xq.data());

  at::Tensor y = at::empty({rows, n}, x.options());
  float* yp = y.data_ptr<float>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  const int64_t group_stride = packed.stride(0), stride = kp / 4;
  const float* ws = wscale.data_ptr<float>();

  // Per group of 64 columns, tile by tile of its weights: rows in chunks of 2 (3 rows as one chunk),
  // or of 3 above 8 rows (a last 4 as one chunk, not 3 + 1), each chunk in its PASSES over the
  // tile's columns.
  // A tile's first pass reads memory, the others L1, and up to 8 rows the first passes prefetch a
  // tile FAR_TILES ahead into L2.
  const bool wide4 = rows > 8;
  const int table = wide4 ? 1 : 0;  // PASSES's
  std::vector<int64_t> chunk_rows, chunk_start;
  int64_t passes = 0;  // per tile
  for (int64_t r0 = 0; r0 < rows; r0 += chunk_rows.back()) {
    chunk_start.push_back(r0);
    const int64_t left = rows - r0;
    chunk_rows.push_back(wide4 ? (left == 4 ? 4 : std::min<int64_t>(3, left))  // 10 rows: 3 + 3 + 4
                               : std::min<int64_t>(rows == 3 ? 3 : 2, left));  // 7 rows: 2 + 2 + 2 + 1
    passes += 8 / PASSES[table][chunk_rows.back()].blocks;
  }
  const int64_t chunks = static_cast<int64_t>(chunk_rows.size());
  // a tile's 4 lines per quad spread over its first passes (all of them up to 4), once
  const int far_lines = passes == 1 || wide4 ? 0 : int((4 + passes - 1) / passes);
  const int64_t far_passes = far_lines == 0 ? 0 : (4 + far_lines - 1) / far_lines;
  const int64_t near_ahead = rows == 1 ? PREFETCH_ONE_ROW : PREFETCH;  // the first pass's prefetch distance
  at::parallel_for(0, packed.size(0), 1, [&](int64_t g0, int64_t g1) {
    std::vector<int32_t> acc(rows * GROUP);
    for (int64_t g = g0; g < g1; ++g) {
      const int8_t* wg = wp + g * group_stride;
      std::fill(acc.begin(), acc.end(), 0);
      for (int64_t t0 = 0; t0 < quads; t0 += TILE) {
        const int64_t tq = std::min(TILE, quads - t0);
        const int8_t* wt = wg + t0 * GROUP * 4;  // prefetches past the group run into the next one's
        const int8_t* far = wt + FAR_TILES * TILE * GROUP * 4;
        int64_t pass = 0;
        for (int64_t c = 0; c < chunks; ++c) {
          const int64_t r0 = chunk_start[c], rc = chunk_rows[c];
          const int32_t* xr = x32 + r0 * stride + t0;
          const ChunkPasses& chunk = PASSES[table][rc];
          for (int c0 = 0; c0 < 8; c0 += chunk.blocks, ++pass)
            chunk.fn(xr, stride, wt + c0 * 32, tq, acc.data() + r0 * GROUP + c0 * BLOCK,
                     pass == 0 ? wt + near_ahead : nullptr, far + pass * tq * far_lines * 64,
                     pass < far_passes ? far_lines : 0);
        }
      }
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < 8; ++c) {
          const int64_t col = g * GROUP + c * BLOCK;
          if (col >= n) break;
          const __m256i dots = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc.data() + r * GROUP + c * BLOCK));
          rescale8(dots, ws + col, step[r], bp ? bp + col : nullptr, rp ? rp + r * n + col : nullptr, yp + r * n + col,
                   std::min<int64_t>(BLOCK, n - col));
        }
    }
  });
  return y;
}

namespace {

// For ROWS rows and CB of a group's 8 blocks: out[r * CB + c] = sum over scale groups of
// fp32(sum x u - 8 sum x) * scale, fused multiply-add in group order, as cpu_kernels.cpp's
// w4_columns (so the same bits). w: the group's packed weights (K/8, 64, 4) offset to block c0:
// byte (p, col, j) holds u[col][8p + j] in its low nibble and u[col][8p + 4 + j] in its high one;
// scales: (K/G, 64) fp16, offset likewise; x32: rows' int8 activations as 4-byte quads. `first`:
// the first sweep over the group's weights fetches each pair's 4 lines PREFETCH ahead (fetching
// only the lines it read left the others to the hardware prefetcher, measured slower); a later
// sweep (the second half of 4 rows' blocks, or more rows) fetches the lines it reads, from L2.
template <int ROWS, int CB>
void w4_columns(const int32_t* x32, int64_t quad_stride, const int32_t* xsum, int64_t groups, const uint8_t* w,
                const at::Half* scales, int64_t pairs_per_group, __m256* out, bool first) {
  for (int i = 0; i < ROWS * CB; ++i) out[i] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < groups; ++g) {
    __m256i a[ROWS * CB];
    for (int i = 0; i < ROWS * CB; ++i) a[i] = _mm256_setzero_si256();
    for (int64_t p = g * pairs_per_group; p < (g + 1) * pairs_per_group; ++p) {
      const uint8_t* wp = w + p * 256;
      const int lines = first ? 4 : (CB * 32 + 63) / 64;
      for (int l = 0; l < lines; ++l) _mm_prefetch(reinterpret_cast<const char*>(wp + PREFETCH + l * 64), _MM_HINT_T0);
      __m256i xa[ROWS], xb[ROWS];
      for (int r = 0; r < ROWS; ++r) {
        xa[r] = _mm256_set1_epi32(x32[r * quad_stride + 2 * p]);
        xb[r] = _mm256_set1_epi32(x32[r * quad_stride + 2 * p + 1]);
      }
      for (int c = 0; c < CB; ++c) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + c * 32));
        const __m256i lo = _mm256_and_si256(v, low);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for (int r = 0; r < ROWS; ++r) {  // u * x pairs: at most 2 * 15 * 127 each, 4 * that in a sum
          const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xa[r]), _mm256_maddubs_epi16(hi, xb[r]));
          a[r * CB + c] = _mm256_add_epi32(a[r * CB + c], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
    for (int c = 0; c < CB; ++c) {
      const __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + g * GROUP + c * BLOCK)));
      for (int r = 0; r < ROWS; ++r) {
        const __m256i exact = _mm256_sub_epi32(a[r * CB + c], _mm256_set1_epi32(8 * xsum[r * groups + g]));
        out[r * CB + c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), sc, out[r * CB + c]);
      }
    }
  }
}

// How a chunk of 1, 2 or 4 rows goes over a column group: its w4_columns and the blocks (of 8) per
// sweep. All 8 in one sweep up to 2 rows (2 rows spill accumulators and still beat two sweeps);
// 4 rows in two sweeps of 4 (one sweep of 8 spilled more and was slower).
// benchmarks/avx2/int4-kernel-ab.txt times these against the sweeps of 4, 2 and 1 blocks before.
using W4Fn = void (*)(const int32_t*, int64_t, const int32_t*, int64_t, const uint8_t*, const at::Half*, int64_t,
                      __m256*, bool);
struct W4Sweeps {
  W4Fn fn;
  int blocks;
};
constexpr W4Sweeps W4_SWEEPS[5] = {{nullptr, 0}, {w4_columns<1, 8>, 8}, {w4_columns<2, 8>, 8}, {nullptr, 0},
                                   {w4_columns<4, 4>, 4}};
// the most ROWS * CB of a sweep (its fp32 outputs), from the table: a wider sweep added there cannot
// outgrow the caller's array
constexpr int w4_most() {
  int most = 0;
  for (int rows = 1; rows < 5; ++rows) most = std::max(most, rows * W4_SWEEPS[rows].blocks);
  return most;
}
constexpr int W4_MOST = w4_most();

}  // namespace

// cpu_kernels.cpp's linear_rows_w4: x (R, K) fp32; packed (N_pad / 64, K / 8, 64, 4) uint8;
// scales (N_pad / 64, K / G, 64) fp16; n: output features; bias (n,) or None; residual (R, n) or
// None. Returns (R, n).
at::Tensor linear_rows_w4(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scales, int64_t n,
                          const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(x_in.dim() == 2, "x must be (R, K)");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t rows = x.size(0), k = x.size(1);
  speclm_common::check_w4(packed, scales, k, n);
  const float* bp = speclm_common::optional_rows(bias, rows, n, false);
  const float* rp = speclm_common::optional_rows(residual, rows, n, true);
  if (rows == 0) return at::empty({0, n}, x.options());
  const int64_t groups = scales.size(1), group = k / groups;

  const SignedRows q = signed_rows(x.data_ptr<float>(), rows, k, group);
  const std::vector<int8_t>& xq = q.xq;
  const std::vector<int32_t>& xsum = q.sums;
  const std::vector<float>& step = q.step;

  at::Tensor y = at::empty({rows, n}, x.options());
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const at::Half* sp = scales.data_ptr<at::Half>();
  const int32_t* x32 = reinterpret_cast<const int32_t*>(xq.data());
  const int64_t quad_stride = k / 4, pairs_per_group = group / 8;
  at::parallel_for(0, packed.size(0), 1, [&](int64_t g0, int64_t g1) {
    __m256 acc[W4_MOST];
    for (int64_t cg = g0; cg < g1; ++cg) {
      const uint8_t* wg = wp + cg * (k / 8) * 256;
      const at::Half* sg = sp + cg * groups * GROUP;
      for (int64_t r0 = 0; r0 < rows;) {
        const int rc = rows - r0 >= 4 ? 4 : (rows - r0 >= 2 ? 2 : 1);
        const W4Sweeps& sweep = W4_SWEEPS[rc];
        const int cb = sweep.blocks;
        const int32_t* xr = x32 + r0 * quad_stride;
        const int32_t* sr = xsum.data() + r0 * groups;
        for (int c0 = 0; c0 < 8; c0 += cb) {
          sweep.fn(xr, quad_stride, sr, groups, wg + c0 * 32, sg + c0 * BLOCK, pairs_per_group, acc, r0 == 0 && c0 == 0);
          for (int c = 0; c < cb; ++c) {
            const int64_t col = cg * GROUP + (c0 + c) * BLOCK;
            if (col >= n) break;
            const int64_t valid = std::min<int64_t>(BLOCK, n - col);
            for (int r = 0; r < rc; ++r) {
              const int64_t row = r0 + r;
              finish8(acc[r * cb + c], step[row], bp ? bp + col : nullptr, rp ? rp + row * n + col : nullptr,
                      yp + row * n + col, valid);
            }
          }
        }
        r0 += rc;
      }
    }
  });
  return y;
}

// cpu_kernels.cpp's linear_rows_kq: a GGUF file's own blocks in the same layouts, computed with the
// same fp32 steps per column (so the same bits), by 8-column halves of each 16-column block. The
// integer sums: 4- and 6-bit quants (u <= 63) pair with int8 activations in vpmaddubsw exactly
// (2 * 63 * 127 = 16002, and two quads' pairs added in int16 stay below 32767; 4-bit ones' over 4
// steps, 16 products of at most 15 * 127, too); 8-bit quants (u up
// to 255) go in as w = u - 128 with the sign trick (|w| <= 128: a pair <= 32512), so their sum is
// sum x u - 128 sum x and the zero point's subtraction takes 128 less: the VNNI kernel's integer.
namespace {

// Rows per pass: their int32 and fp32 accumulators, broadcasts and unpacked quants in 16 registers.
constexpr int KQ_ROWS = 4;
constexpr int64_t KQ_FAR = SPECLM_KQ_FAR;  // speclm.defaults.KQ_FAR_PREFETCH_BYTES, as cpu_kernels.cpp's

// out[h * ROWS + r]: row r's 8 columns of half h0 + h (fp32 sums over blocks, before the step).
// w, sc, mn, d, dmin: the column block's. A step's quants are unpacked once for both halves and
// every row; each row's broadcasts live for that row only, so that the int16 (4 bits) or int32
// sums stay in the 16 registers.
template <int ROWS, int HALVES, int BITS, bool MINS>
void kq_halves(const int32_t* x32, int64_t quad_stride, const speclm_common::KqRowSums& sums, int64_t blocks,
               int64_t block, int64_t per_super, const uint8_t* w, const int8_t* sc, const int8_t* mn, const float* d,
               const float* dmin, int h0, __m256* out) {
  __m256 f[HALVES * ROWS];
  for (int i = 0; i < HALVES * ROWS; ++i) f[i] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30), ones = _mm256_set1_epi16(1);
  constexpr int64_t features = BITS == 4 ? 8 : BITS == 6 ? 16 : 4;
  constexpr int64_t step_bytes = BITS == 6 ? 192 : 64;
  constexpr int quads = features / 4;
  constexpr int64_t chunk = BITS == 4 ? 4 : 1;  // steps whose pairs add in int16 (4 bits: 16 products <= 16 * 15 * 127)
  const int64_t steps = block / features;
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i a[HALVES * ROWS];  // from the zero point's -z sum x (kq_sums), as cpu_kernels.cpp's
    for (int h = 0; h < HALVES; ++h)
      for (int r = 0; r < ROWS; ++r)
        a[h * ROWS + r] = MINS ? _mm256_setzero_si256() : _mm256_set1_epi32(sums.less[r * sums.stride + b]);
    for (int64_t p0 = b * steps; p0 < (b + 1) * steps; p0 += chunk) {
      __m256i s16[BITS == 4 ? HALVES * ROWS : 1];
      if (BITS == 4)
        for (int i = 0; i < HALVES * ROWS; ++i) s16[i] = _mm256_setzero_si256();
      for (int64_t p = p0; p < std::min(p0 + chunk, (b + 1) * steps); ++p) {
        const uint8_t* wp = w + p * step_bytes;
        for (int l = 0; l < step_bytes / 64; ++l) {
          _mm_prefetch(reinterpret_cast<const char*>(wp + PREFETCH + l * 64), _MM_HINT_T0);
          if (KQ_FAR > 0) _mm_prefetch(reinterpret_cast<const char*>(wp + KQ_FAR + l * 64), _MM_HINT_T1);
        }
        __m256i u[HALVES][BITS == 8 ? 2 : quads];  // 8 bits: w = u - 128 and |w|
        for (int h = 0; h < HALVES; ++h) {
          const uint8_t* wh = wp + (h0 + h) * 32;
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wh));
          if (BITS == 8) {
            u[h][0] = _mm256_xor_si256(v, _mm256_set1_epi8(char(0x80)));
            u[h][1] = _mm256_abs_epi8(u[h][0]);
            continue;
          }
          u[h][0] = _mm256_and_si256(v, low);
          u[h][1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
          if (BITS == 6) {
            const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wh + 64));
            const __m256i hp = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wh + 128));
            u[h][2 % quads] = _mm256_or_si256(_mm256_and_si256(v1, low), _mm256_and_si256(hp, top));
            u[h][3 % quads] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v1, 4), low),
                                              _mm256_and_si256(_mm256_srli_epi16(hp, 2), top));
            u[h][0] = _mm256_or_si256(u[h][0], _mm256_and_si256(_mm256_slli_epi16(hp, 4), top));
            u[h][1] = _mm256_or_si256(u[h][1], _mm256_and_si256(_mm256_slli_epi16(hp, 2), top));
          }
        }
        for (int r = 0; r < ROWS; ++r) {
          __m256i xb[quads];
          for (int q = 0; q < quads; ++q) xb[q] = _mm256_set1_epi32(x32[r * quad_stride + quads * p + q]);
          for (int h = 0; h < HALVES; ++h) {
            __m256i& acc = a[h * ROWS + r];
            if (BITS == 8) {
              acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u[h][1], _mm256_sign_epi8(xb[0], u[h][0])),
                                                            ones));
            } else if (BITS == 4) {
              s16[h * ROWS + r] = _mm256_add_epi16(s16[h * ROWS + r],
                                                   _mm256_add_epi16(_mm256_maddubs_epi16(u[h][0], xb[0]),
                                                                    _mm256_maddubs_epi16(u[h][1], xb[1 % quads])));
            } else {
              for (int q = 0; q < quads; q += 2) {
                const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(u[h][q], xb[q]),
                                                       _mm256_maddubs_epi16(u[h][(q + 1) % quads], xb[(q + 1) % quads]));
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ones));
              }
            }
          }
        }
      }
      if (BITS == 4)
        for (int i = 0; i < HALVES * ROWS; ++i) a[i] = _mm256_add_epi32(a[i], _mm256_madd_epi16(s16[i], ones));
    }
    const int64_t s = b / per_super;
    for (int h = 0; h < HALVES; ++h) {
      const int64_t c = (h0 + h) * 8;
      const __m256 scale = _mm256_mul_ps(
          _mm256_loadu_ps(d + s * 16 + c),
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + b * 16 + c)))));
      if (MINS) {
        const __m256 mins = _mm256_mul_ps(
            _mm256_loadu_ps(dmin + s * 16 + c),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn + b * 16 + c)))));
        for (int r = 0; r < ROWS; ++r) {
          f[h * ROWS + r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[h * ROWS + r]), scale, f[h * ROWS + r]);
          f[h * ROWS + r] = _mm256_fnmadd_ps(mins, _mm256_set1_ps(sums.fp32[r * sums.stride + b]), f[h * ROWS + r]);
        }
      } else {
        for (int r = 0; r < ROWS; ++r)
          f[h * ROWS + r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[h * ROWS + r]), scale, f[h * ROWS + r]);
      }
    }
  }
  for (int i = 0; i < HALVES * ROWS; ++i) out[i] = f[i];
}

using KqFn = void (*)(const int32_t*, int64_t, const speclm_common::KqRowSums&, int64_t, int64_t, int64_t, const uint8_t*,
                      const int8_t*, const int8_t*, const float*, const float*, int, __m256*);
// A pass takes both halves of a block in one sweep (its weights read and unpacked once), but 3 or
// 4 rows of 6-bit quants (four unpacked registers a half) one half a sweep.
struct KqPass {
  KqFn fn;
  int halves;
};
template <int BITS, bool MINS>
constexpr KqPass KQ_PASSES[KQ_ROWS + 1] = {{nullptr, 0},
                                           {kq_halves<1, 2, BITS, MINS>, 2},
                                           {kq_halves<2, 2, BITS, MINS>, 2},
                                           {kq_halves<3, BITS == 6 ? 1 : 2, BITS, MINS>, BITS == 6 ? 1 : 2},
                                           {kq_halves<4, BITS == 6 ? 1 : 2, BITS, MINS>, BITS == 6 ? 1 : 2}};

}  // namespace

// The signature and layouts of cpu_kernels.cpp's linear_rows_kq.
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
  if (rows == 0) return at::empty({0, n}, x.options());
  const int64_t blocks = call.blocks, block = call.block, per_super = call.per_super;

  const SignedRows q = signed_rows(x.data_ptr<float>(), rows, k, block);
  const std::vector<int8_t>& xq = q.xq;
  const std::vector<float>& step = q.step;
  // 8-bit quants' dot products already take 128 sum x off (w = u - 128)
  const speclm_common::KqSums all = speclm_common::kq_sums(q.sums, bits == 8 ? zero - 128 : zero, mins, blocks);

  at::Tensor y = at::empty({rows, n}, x.options());
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = qs.data_ptr<uint8_t>();
  const int8_t* scp = sc.data_ptr<int8_t>();
  const int8_t* mnp = mins ? mn->data_ptr<int8_t>() : nullptr;
  const float* dp = d.data_ptr<float>();
  const float* dmp = mins ? dmin->data_ptr<float>() : nullptr;
  const int32_t* x32 = reinterpret_cast<const int32_t*>(xq.data());
  const int64_t quad_stride = k / 4, column_blocks = qs.size(0), supers = d.size(1);
  const int64_t block_bytes = k * bits * speclm_common::KQ_COLUMNS / 8;
  const KqPass* passes_by_rows = (bits == 4 ? (mins ? KQ_PASSES<4, true> : KQ_PASSES<4, false>)
                                  : bits == 6 ? KQ_PASSES<6, false> : KQ_PASSES<8, false>);
  const int64_t passes = (rows + KQ_ROWS - 1) / KQ_ROWS;  // near-equal passes of at most KQ_ROWS rows
  at::parallel_for(0, column_blocks, 4, [&](int64_t c0, int64_t c1) {
    __m256 acc[2 * KQ_ROWS];
    for (int64_t cb = c0; cb < c1; ++cb) {
      for (int64_t r0 = 0, pass = 0; r0 < rows; ++pass) {
        const int rc = int((rows - r0) / (passes - pass));
        const KqPass& kp = passes_by_rows[rc];
        for (int h0 = 0; h0 < 2; h0 += kp.halves) {
          kp.fn(x32 + r0 * quad_stride, quad_stride, all.from(r0), blocks, block, per_super, wp + cb * block_bytes,
                scp + cb * blocks * 16, mins ? mnp + cb * blocks * 16 : nullptr, dp + cb * supers * 16,
                mins ? dmp + cb * supers * 16 : nullptr, h0, acc);
          for (int h = 0; h < kp.halves; ++h) {
            const int64_t col = cb * 16 + (h0 + h) * 8;
            if (col >= n) break;
            const int64_t valid = std::min<int64_t>(8, n - col);
            for (int r = 0; r < rc; ++r) {
              const int64_t row = r0 + r;
              finish8(acc[h * rc + r], step[row], bp ? bp + col : nullptr, rp ? rp + row * n + col : nullptr,
                      yp + row * n + col, valid);
            }
          }
        }
        r0 += rc;
      }
    }
  });
  return y;
}

namespace {

// The sum of 16 lanes held as lo (lanes 0-7) and hi (8-15), in the order of GCC's
// _mm512_reduce_add_ps, which cpu_kernels.cpp's rms_norm uses: the same bits on either build.
inline float reduce_add16(__m256 lo, __m256 hi) {
  const __m256 t3 = _mm256_add_ps(hi, lo);
  const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, _MM_SHUFFLE(1, 1, 1, 1)));
}

// 8 lanes summed: halves, then pairs, then the last two.
inline float reduce_add8(__m256 v) {
  const __m128 t = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  const __m128 u = _mm_add_ps(t, _mm_shuffle_ps(t, t, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(u) + _mm_cvtss_f32(_mm_shuffle_ps(u, u, _MM_SHUFFLE(1, 1, 1, 1)));
}

}  // namespace

// RMSNorm of each row of x (R, E) fp32: w * (x * 1 / sqrt(mean(x^2) + eps)), the sum of squares in
// 16 lanes (x[i] in lane i % 16) as cpu_kernels.cpp's.
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight, double eps) {
  return speclm_common::rms_norm_rows(x_in, weight, eps, [](const float* row, const float* wp, float* out, int64_t e,
                                                             float epsf) {
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int64_t i = 0; i < e; i += 16) {
      const __m256 a = load8(row + i, e - i);
      const __m256 b = i + 8 < e ? load8(row + i + 8, e - i - 8) : _mm256_setzero_ps();
      lo = _mm256_add_ps(lo, _mm256_mul_ps(a, a));
      hi = _mm256_add_ps(hi, _mm256_mul_ps(b, b));
    }
    const float inv = 1.0f / std::sqrt(reduce_add16(lo, hi) / static_cast<float>(e) + epsf);
    const __m256 vinv = _mm256_set1_ps(inv);
    for (int64_t i = 0; i < e; i += 8) {
      const int64_t valid = std::min<int64_t>(8, e - i);
      store8(out + i, _mm256_mul_ps(load8(wp + i, valid), _mm256_mul_ps(load8(row + i, valid), vinv)), valid);
    }
  });
}

namespace {

// exp as cpu_kernels.cpp's exp512, lane for lane: 2^n * p(r), n = round(x / ln 2), r = x - n ln 2 in
// two parts, Cephes' degree-6 polynomial. 2^n is built from its exponent bits (n in -126..127 on
// the clamped inputs), an exact scaling like vscalefps.
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

}  // namespace

// The gated MLP's middle: gate_up (R, 2 I) -> silu(gate) * up (R, I), silu(g) = g / (1 + exp(-g)).
at::Tensor silu_mul(const at::Tensor& gate_up_in) {
  return speclm_common::silu_mul_rows(gate_up_in, [](const float* g, const float* u, float* out, int64_t inner) {
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int64_t i = 0; i < inner; i += 8) {
      const int64_t valid = std::min<int64_t>(8, inner - i);
      const __m256 gv = load8(g + i, valid);
      const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
      store8(out + i, _mm256_mul_ps(silu, load8(u + i, valid)), valid);
    }
  });
}

namespace {

// q . k for N keys `apart` floats apart, over dim features (a multiple of 8): 8 lanes, feature d
// in lane d % 8, a product then FMAs in feature order, then reduce_add8. Depends on nothing but q
// and the key: the N chains run interleaved (a prefill's queries see hundreds of slots, and one
// chain alone waits on each FMA's latency) and each sum is what it is alone.
template <int N>
inline void dots(const float* q, const float* k, int64_t apart, int64_t dim, float* out) {
  __m256 a[N];
  const __m256 q0 = _mm256_loadu_ps(q);
  for (int i = 0; i < N; ++i) a[i] = _mm256_mul_ps(q0, _mm256_loadu_ps(k + i * apart));
  for (int64_t c = 8; c < dim; c += 8) {
    const __m256 qc = _mm256_loadu_ps(q + c);
    for (int i = 0; i < N; ++i) a[i] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k + i * apart + c), a[i]);
  }
  for (int i = 0; i < N; ++i) out[i] = reduce_add8(a[i]);
}

inline float dot(const float* q, const float* k, int64_t dim) {  // one key
  float out;
  dots<1>(q, k, 0, dim, &out);
  return out;
}

// acc[c .. c + 8 REGS) += p[j] * v_j[c ..] for the slots j0 <= j < j1 in order (v_j = v + j * dim), one
// FMA per feature and slot: across blocks of slots from acc = 0 the same operations as one loop
// over all slots, the accumulators held in registers through a block.
template <int REGS>
inline void weigh(const float* p, const float* v, int64_t dim, int64_t j0, int64_t j1, int64_t c, float* acc) {
  __m256 a[REGS];
  for (int i = 0; i < REGS; ++i) a[i] = _mm256_loadu_ps(acc + c + 8 * i);
  for (int64_t j = j0; j < j1; ++j) {
    const __m256 pv = _mm256_set1_ps(p[j]);
    const float* vj = v + j * dim + c;
    for (int i = 0; i < REGS; ++i) a[i] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vj + 8 * i), a[i]);
  }
  for (int i = 0; i < REGS; ++i) _mm256_storeu_ps(acc + c + 8 * i, a[i]);
}

// Every feature of acc (dim floats) over the slots j0 <= j < j1: 64 features at a time, then 8.
inline void weigh_values(const float* p, const float* v, int64_t dim, int64_t j0, int64_t j1, float* acc) {
  int64_t c = 0;
  for (; c + 64 <= dim; c += 64) weigh<8>(p, v, dim, j0, j1, c, acc);
  for (; c < dim; c += 8) weigh<1>(p, v, dim, j0, j1, c, acc);
}

// Slots per block of decode_attention: a block of keys or values (SLOT_BLOCK x D floats, 16 KB at
// D = 128) stays in the 32 KB L1 cache while every query of the tile goes through it.
constexpr int64_t SLOT_BLOCK = SPECLM_SLOT_BLOCK;  // speclm.defaults.ATTENTION_SLOT_BLOCK
constexpr int64_t QUERY_TILE = SPECLM_QUERY_TILE;  // speclm.defaults.ATTENTION_QUERY_TILE

}  // namespace

// cpu_kernels.cpp's decode_attention, same arguments and meaning: rotary on q and k, k and v
// written to the cache at each row's slots, and each query attending on its own over exactly
// the slots before it (a tree node: the shared prefix, its ancestors' slots, its own slot; common.h's
// visible_of; within a sliding `window` where one is given: windowed; scores soft-capped where
// `softcap` > 0; the cache a ring of `capacity` slots where `ring`), every query's arithmetic its own
// and in slot order. Returns (B M, H D).
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
  const int64_t stride = qkv.size(1), groups = heads / kv_heads;
  const float* src = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* kp = keys.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  std::vector<float> q(rows * heads * dim);

  auto rotate = [&](const float* x, const float* c, const float* sn, float* out) {
    for (int64_t d = 0; d < dim; d += 8) {  // x * cos + roll(x, D/2) * sin, three roundings
      const int64_t o = d < half ? d + half : d - half;
      const __m256 a = _mm256_mul_ps(_mm256_loadu_ps(x + d), _mm256_loadu_ps(c + d));
      const __m256 b = _mm256_mul_ps(_mm256_loadu_ps(x + o), _mm256_loadu_ps(sn + d));
      _mm256_storeu_ps(out + d, _mm256_add_ps(a, b));
    }
  };
  for (int64_t b = 0; b < batch; ++b) {
    float* kb = kp + speclm_common::cache_row(cache_rows, b) * kv_heads * capacity * dim;
    float* vb = vp + speclm_common::cache_row(cache_rows, b) * kv_heads * capacity * dim;
    for (int64_t i = 0; i < width; ++i) {
      const int64_t r = b * width + i, slot = speclm_common::place(starts[b] + i, capacity, ring);
      const int64_t at = visible(b, i).position();
      const float* row = src + r * stride;
      for (int64_t h = 0; h < heads; ++h) rotate(row + h * dim, cp + at * dim, sp + at * dim, q.data() + (r * heads + h) * dim);
      for (int64_t g = 0; g < kv_heads; ++g) {
        rotate(row + (heads + g) * dim, cp + at * dim, sp + at * dim, kb + (g * capacity + slot) * dim);
        std::copy_n(row + (heads + kv_heads + g) * dim, dim, vb + (g * capacity + slot) * dim);
      }
    }
  }

  // Attention per (row, kv head, share of its queries), as cpu_kernels.cpp's: the queries that read
  // one kv head (its query heads, of every token of the row) go through its cache together, a
  // block of slots at a time, so each block of keys and values is read once from memory per tile
  // of queries instead of once per query (at 2000 slots a kv head's cache no longer fits L2, and a
  // decode step read it once per query head). Each query's operations are those of the query
  // alone, in slot order, so the bits do not depend on the tiling or on the other queries.
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
      for (int64_t m = share; m < per_head; m += shares) {
        const int64_t i = m / groups, h = g * groups + m % groups, r = b * width + i;
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
      // weighing of values.
      for (int64_t n0 = 0; n0 < nq; n0 += query_tile) {
        const int64_t n1 = std::min(nq, n0 + query_tile);
        int64_t most = 0;  // entries of a query's scores: its leading slots, then those apart
        for (int64_t n = n0; n < n1; ++n) most = std::max(most, sees[n].lead() + sees[n].count);
        scores.resize((n1 - n0) * most);
        acc.assign((n1 - n0) * dim, 0.0f);
        for (int64_t j0 = 0; j0 < most; j0 += SLOT_BLOCK) {  // scores q . k_j * scale
          for (int64_t n = n0; n < n1; ++n) {
            const int64_t j1 = std::min(j0 + SLOT_BLOCK, sees[n].lead());
            const float* qh = q.data() + who[n] * dim;
            float* sn = scores.data() + (n - n0) * most;
            speclm_common::runs(sees[n].base, j0, j1, capacity, ring, [&](int64_t a, int64_t e, int64_t at) {
              const float* k0 = kg + at * dim;  // slot base + a; base + j at k0 + (j - a) * dim
              int64_t j = a;
              for (; j + 4 <= e; j += 4) dots<4>(qh, k0 + (j - a) * dim, dim, dim, sn + j);
              for (; j < e; ++j) sn[j] = dot(qh, k0 + (j - a) * dim, dim);
            });
            for (int64_t j = j0; j < j1; ++j) sn[j] *= sc;
          }
        }
        for (int64_t n = n0; n < n1; ++n)  // slots apart after the leading ones, in order
          for (int64_t e = 0; e < sees[n].count; ++e)
            scores[(n - n0) * most + sees[n].lead() + e] =
                dot(q.data() + who[n] * dim, kg + speclm_common::place(sees[n].apart[e], capacity, ring) * dim, dim) * sc;
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
          float top = -INFINITY;  // a maximum does not depend on the order
          for (int64_t j = 0; j < slots; ++j) top = std::max(top, sn[j]);
          const __m256 vtop = _mm256_set1_ps(top);
          __m256 vsum = _mm256_setzero_ps();
          for (int64_t j = 0; j < slots; j += 8) {  // summed in 8 lanes (slot j in lane j % 8)
            const int64_t valid = std::min<int64_t>(8, slots - j);
            const __m256 e = exp256(_mm256_sub_ps(load8(sn + j, valid), vtop));
            store8(sn + j, e, valid);
            vsum = _mm256_add_ps(vsum, valid >= 8 ? e : _mm256_and_ps(e, _mm256_castsi256_ps(lane_mask(valid))));
          }
          inverse[n - n0] = 1.0f / reduce_add8(vsum);
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
          const __m256 inv = _mm256_set1_ps(inverse[n - n0]);
          for (int64_t c = 0; c < dim; c += 8)
            _mm256_storeu_ps(oh + c, _mm256_mul_ps(_mm256_loadu_ps(acc.data() + (n - n0) * dim + c), inv));
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
  m.def("linear_rows", &linear_rows, nogil, "int8 W8A8 linear over rows (AVX2)", py::arg("x"), py::arg("packed"),
        py::arg("colsum"), py::arg("wscale"), py::arg("bias"), py::arg("residual") = py::none());
  m.def("linear_rows_w4", &linear_rows_w4, nogil, "int4-weight (W4A8, grouped scales) linear over rows (AVX2)",
        py::arg("x"), py::arg("packed"), py::arg("scales"), py::arg("n"), py::arg("bias"),
        py::arg("residual") = py::none());
  m.def("linear_rows_kq", &linear_rows_kq, nogil, "a GGUF's own quantized blocks (4, 6 or 8-bit quants, block "
        "scales, fp32 super-block scales) linear over rows (AVX2)", py::arg("x"), py::arg("qs"), py::arg("bits"),
        py::arg("zero"), py::arg("sc"), py::arg("d"), py::arg("mn"), py::arg("dmin"), py::arg("n"), py::arg("bias"),
        py::arg("residual") = py::none());
  m.def("silu_mul", &silu_mul, nogil, "silu(gate) * up over rows of gate | up, fp32");
  m.def("rms_norm", &rms_norm, nogil, "RMSNorm over rows, fp32", py::arg("x"), py::arg("weight"), py::arg("eps"));
  m.def("decode_attention", &decode_attention, nogil, "rotary, cache write and per-query attention of one decode forward",
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("keys"), py::arg("values"), py::arg("starts"),
        py::arg("counts"), py::arg("heads"), py::arg("kv_heads"), py::arg("scale"),
        py::arg("tree") = std::vector<int64_t>(), py::arg("query_tile") = QUERY_TILE,
        py::arg("cache_rows") = std::vector<int64_t>(), py::arg("window") = 0,
        py::arg("softcap") = 0.0, py::arg("ring") = false);
}
