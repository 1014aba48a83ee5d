// What cpu_kernels.cpp (AVX-512 VNNI) and cpu_kernels_avx2.cpp (AVX2) share: argument checks and
// the frames of the row-wise kernels, whose per-row arithmetic each build passes in. Plain C++,
// no vector instructions, so that either build includes it. Each check fails with torch's error
// (a Python RuntimeError) before anything is written.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace speclm_common {

constexpr int64_t COLUMNS = 64;  // output columns packed together in both weight layouts
constexpr int64_t KQ_COLUMNS = 16;  // and in linear_rows_kq's (a GGUF's own blocks)

// An optional fp32 bias (n,) or residual (rows, n): its data, or nullptr when absent.
inline const float* optional_rows(const c10::optional<at::Tensor>& t, int64_t rows, int64_t n, bool per_row) {
  if (!t.has_value() || !t->defined()) return nullptr;
  if (per_row) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == rows &&
                t->size(1) == n, "residual must be fp32 (R, N)");
  } else {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == n, "bias must be fp32 (N,)");
  }
  return t->data_ptr<float>();
}

// linear_rows_w4's weights for x of k features and n outputs: packed uint8 (N/64, K/8, 64, 4),
// scales fp16 (N/64, K/G, 64) with G a multiple of 8.
inline void check_w4(const at::Tensor& packed, const at::Tensor& scales, int64_t k, int64_t n) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 4 && packed.size(1) * 8 == k &&
              packed.size(2) == COLUMNS && packed.size(3) == 4 && packed.is_contiguous(),
              "packed must be uint8 (N/64, K/8, 64, 4)");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.dim() == 3 && scales.size(0) == packed.size(0) &&
              scales.size(2) == COLUMNS && scales.is_contiguous() && k % scales.size(1) == 0 &&
              (k / scales.size(1)) % 8 == 0, "scales must be fp16 (N/64, K/G, 64), G a multiple of 8");
  TORCH_CHECK(n <= packed.size(0) * COLUMNS && n > packed.size(0) * COLUMNS - COLUMNS, "n does not match packed");
}

// The exact sums of a row's int8 values q (k) over each group of `group` features (k / group):
// |sum| <= 127 * group, exact in fp32 too.
inline void group_sums(const int8_t* q, int64_t k, int64_t group, int32_t* sums) {
  for (int64_t g = 0; g < k / group; ++g) {
    int32_t sum = 0;
    for (int64_t i = g * group; i < (g + 1) * group; ++i) sum += q[i];
    sums[g] = sum;
  }
}

// The rows of x (R, K) quantized for the int4 and GGUF-block kernels (each build's signed_rows): each
// row's int8 values, its step, and its group_sums (R, K / group).
struct SignedRows {
  std::vector<int8_t> xq;
  std::vector<int32_t> sums;
  std::vector<float> step;
  SignedRows(int64_t rows, int64_t k, int64_t group) : xq(rows * k), sums(rows * (k / group)), step(rows) {}
};

// linear_rows_kq's inputs as both builds take them (check_kq done): x fp32 (R, K) contiguous, whether
// the format has mins, the bias and residual (or null), and its blocks: `blocks` a row, `block`
// features each, `per_super` a super-block.
struct KqCall {
  at::Tensor x;
  int64_t rows, k;
  bool mins;
  const float* bias;
  const float* residual;
  int64_t blocks, block, per_super;
};

// linear_rows_kq's activation sums per row and block, as its chain takes them: with mins, fp32(sum x)
// for the mins' term; with a zero point, -z sum x, where a block's integer sum starts (so that it
// ends as the exact sum x (u - z)). `from(r)`: the view from row r on.
struct KqRowSums {
  const int32_t* less;  // (rows, stride) or null
  const float* fp32;    // (rows, stride) or null
  int64_t stride;       // blocks per row
};
struct KqSums {
  std::vector<int32_t> less;
  std::vector<float> fp32;
  int64_t stride;
  KqRowSums from(int64_t r) const {
    return {less.empty() ? nullptr : less.data() + r * stride, fp32.empty() ? nullptr : fp32.data() + r * stride,
            stride};
  }
};
// sums: (rows, blocks) exact integer sums of each row's int8 activations; zero: the build's integer
// offset (the format's zero point, less what its dot products already take off).
inline KqSums kq_sums(const std::vector<int32_t>& sums, int64_t zero, bool mins, int64_t blocks) {
  KqSums out{{}, {}, blocks};
  if (mins) {
    out.fp32.resize(sums.size());
    for (size_t i = 0; i < sums.size(); ++i) out.fp32[i] = float(sums[i]);  // |sum| <= 127 * block: exact
  } else {
    out.less.resize(sums.size());
    for (size_t i = 0; i < sums.size(); ++i) out.less[i] = -int32_t(zero) * sums[i];
  }
  return out;
}

// linear_rows_kq's weights for x of k features and n outputs (cpu_kernels.cpp's layouts, by blocks of
// 16 columns): qs uint8 (N/16, K/8, 16, 4) for bits 4, (N/16, K/16 * 3, 16, 4) for 6, (N/16, K/4, 16,
// 4) for 8; sc int8 (N/16, K/block, 16), block a multiple of the layout's k-step (8, 16, 4 features);
// d fp32 (N/16, K/super, 16), super a multiple of block; mn and dmin (as sc and d) given exactly when
// zero is 0.
inline void check_kq(const at::Tensor& qs, int64_t bits, int64_t zero, const at::Tensor& sc, const at::Tensor& d,
                     const at::Tensor* mn, const at::Tensor* dmin, int64_t k, int64_t n) {
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "bits must be 4, 6 or 8");
  const int64_t step = bits == 4 ? 8 : bits == 6 ? 16 : 4;
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.is_contiguous() && qs.size(0) > 0 && k % step == 0 &&
              qs.dim() == 4 && qs.numel() == qs.size(0) * KQ_COLUMNS * k * bits / 8 && qs.size(2) == KQ_COLUMNS &&
              qs.size(3) == 4,
              "qs must be uint8 in the layout of ", bits, " bits for ", k, " features");
  TORCH_CHECK(sc.scalar_type() == at::kChar && sc.dim() == 3 && sc.size(0) == qs.size(0) &&
              sc.size(2) == KQ_COLUMNS && sc.is_contiguous() && sc.size(1) > 0 && k % sc.size(1) == 0 &&
              (k / sc.size(1)) % step == 0, "sc must be int8 (N/16, K/block, 16)");
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.dim() == 3 && d.size(0) == qs.size(0) && d.size(2) == KQ_COLUMNS &&
              d.is_contiguous() && d.size(1) > 0 && sc.size(1) % d.size(1) == 0, "d must be fp32 (N/16, K/super, 16)");
  TORCH_CHECK((zero == 0) == (mn != nullptr && dmin != nullptr), "mn and dmin go with zero 0, and only with it");
  TORCH_CHECK(zero >= 0 && zero <= 255, "zero must be 0 .. 255");
  if (mn != nullptr) {
    TORCH_CHECK(mn->scalar_type() == at::kChar && mn->sizes() == sc.sizes() && mn->is_contiguous(), "mn must be as sc");
    TORCH_CHECK(dmin->scalar_type() == at::kFloat && dmin->sizes() == d.sizes() && dmin->is_contiguous(),
                "dmin must be as d");
  }
  TORCH_CHECK(n <= qs.size(0) * KQ_COLUMNS && n > qs.size(0) * KQ_COLUMNS - KQ_COLUMNS, "n does not match qs");
}

inline KqCall kq_call(const at::Tensor& x_in, const at::Tensor& qs, int64_t bits, int64_t zero, const at::Tensor& sc,
                      const at::Tensor& d, const c10::optional<at::Tensor>& mn, const c10::optional<at::Tensor>& dmin,
                      int64_t n, const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(x_in.dim() == 2, "x must be (R, K)");
  KqCall c;
  c.x = x_in.to(at::kFloat).contiguous();
  c.rows = c.x.size(0);
  c.k = c.x.size(1);
  c.mins = mn.has_value() && mn->defined();
  check_kq(qs, bits, zero, sc, d, c.mins ? &*mn : nullptr, c.mins && dmin.has_value() ? &*dmin : nullptr, c.k, n);
  c.bias = optional_rows(bias, c.rows, n, false);
  c.residual = optional_rows(residual, c.rows, n, true);
  c.blocks = sc.size(1);
  c.block = c.k / c.blocks;
  c.per_super = c.blocks / d.size(1);
  return c;
}

// fn(r) for every row r: serially where `serial` (a decode step's few rows: threads would cost more
// than they save), else on torch's threads in grains of `grain` rows. Each row is computed alone
// either way, so its bits do not depend on which.
template <class Fn>
inline void for_rows(int64_t rows, bool serial, int64_t grain, const Fn& fn) {
  if (serial) {
    for (int64_t r = 0; r < rows; ++r) fn(r);
  } else {
    at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) { for (int64_t r = r0; r < r1; ++r) fn(r); });
  }
}

// RMSNorm over the rows of x (R, E) fp32 with weight (E,): one_row(row, weight, out, E, eps), the
// build's arithmetic for one row.
template <class Row>
inline at::Tensor rms_norm_rows(const at::Tensor& x_in, const at::Tensor& weight, double eps, const Row& one_row) {
  TORCH_CHECK(x_in.dim() == 2 && weight.scalar_type() == at::kFloat && weight.numel() == x_in.size(1),
              "x (R, E), weight fp32 (E,)");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const at::Tensor w = weight.contiguous();
  const int64_t rows = x.size(0), e = x.size(1);
  at::Tensor y = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float epsf = static_cast<float>(eps);
  for_rows(rows, rows < 64, 16, [&](int64_t r) { one_row(xp + r * e, wp, yp + r * e, e, epsf); });
  return y;
}

// silu(gate) * up over the rows of gate_up (R, 2 I) fp32 -> (R, I): one_row(gate, up, out, I), the
// build's arithmetic for one row.
template <class Row>
inline at::Tensor silu_mul_rows(const at::Tensor& gate_up_in, const Row& one_row) {
  const at::Tensor gu = gate_up_in.to(at::kFloat).contiguous();
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) % 2 == 0, "gate_up must be (R, 2 I)");
  const int64_t rows = gu.size(0), inner = gu.size(1) / 2;
  at::Tensor y = at::empty({rows, inner}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for_rows(rows, rows * inner < 65536, 4, [&](int64_t r) {
    one_row(gp + r * 2 * inner, gp + r * 2 * inner + inner, yp + r * inner, inner);
  });
  return y;
}

// Which slots a query attends, in order: slots 0 .. reach - 1, then `count` slots apart from
// them (a tree node's ancestors past the shared prefix, ascending, its own slot last). A query
// at slot s of a chain has reach s + 1 and nothing apart. Its position is reach + count - 1:
// the slots it reads are exactly those a plain step at that position reads, in the same order.
struct Visible {
  int64_t reach;
  const int64_t* apart;
  int64_t count;
  int64_t base = 0;  // the first leading slot attended (a sliding window's), <= reach
  int64_t position() const { return reach + count - 1; }
  int64_t lead() const { return reach - base; }  // leading slots attended: base .. reach - 1
};

// v within a sliding window of `window` keys (0: none): a query at position p attends the slots of
// positions p - window + 1 .. p (transformers' sliding mask, kv > q - window). Leading slots hold
// their positions; slots apart hold positions reach, reach + 1, ...: those before the window are
// dropped. The query's score for a slot sits at index (its position) - base, as in a plain step at
// that position, so its bits stay that step's.
inline Visible windowed(Visible v, int64_t window) {
  if (window <= 0) return v;
  const int64_t lo = v.position() - window + 1;
  if (lo <= v.base) return v;
  if (lo > v.reach) {
    const int64_t drop = lo - v.reach;
    v.apart += drop;
    v.count -= drop;
    v.reach = lo;
  }
  v.base = lo;
  return v;
}

// decode_attention's `tree` argument: empty for chains; else tree[r] .. tree[r + 1] - 1 (r < B M,
// offsets into the vector itself) hold query r's [reach, slots apart...].
inline Visible visible_of(const std::vector<int64_t>& tree, int64_t r, int64_t slot) {
  if (tree.empty()) return {slot + 1, nullptr, 0};
  const int64_t b = tree[r], e = tree[r + 1];
  return {tree[b], tree.data() + b + 1, e - b - 1};
}

// decode_attention's shapes, after its checks.
struct AttentionShape {
  int64_t batch, rows, width, dim, capacity;
};

// Where slot s lives along a cache row's capacity: at s itself, or in a ring (a sliding layer's cache,
// speclm.forward.cache) at s mod capacity.
inline int64_t place(int64_t slot, int64_t capacity, bool ring) { return ring ? slot % capacity : slot; }

// Calls f(j0', j1', first) for the pieces of a query's leading slots j0 <= j < j1 (slot base + j)
// that lie in one run along the cache: `first` is where slot base + j0' lives. One piece, or two
// where a ring wraps past its end.
template <typename F>
inline void runs(int64_t base, int64_t j0, int64_t j1, int64_t capacity, bool ring, F&& f) {
  if (j0 >= j1) return;
  const int64_t at = place(base + j0, capacity, ring);
  const int64_t split = ring ? std::min(j1, j0 + capacity - at) : j1;
  f(j0, split, at);
  if (split < j1) f(split, j1, int64_t(0));
}

// decode_attention's `cache_rows`: the cache row (first index of keys and values) of batch row b;
// empty: row b.
inline int64_t cache_row(const std::vector<int64_t>& cache_rows, int64_t b) {
  return cache_rows.empty() ? b : cache_rows[b];
}

inline AttentionShape check_attention(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                      const at::Tensor& keys, const at::Tensor& values, const std::vector<int64_t>& starts,
                                      const std::vector<int64_t>& counts, int64_t heads, int64_t kv_heads,
                                      const std::vector<int64_t>& tree, int64_t query_tile,
                                      const std::vector<int64_t>& cache_rows, bool ring = false) {
  AttentionShape s{};
  s.batch = static_cast<int64_t>(starts.size());
  TORCH_CHECK(query_tile >= 1, "query_tile must be >= 1");
  TORCH_CHECK(s.batch >= 1 && counts.size() == starts.size() && keys.dim() == 4, "one start and count per row");
  if (cache_rows.empty()) {
    TORCH_CHECK(keys.size(0) == s.batch, "one cache row per batch row");
  } else {
    TORCH_CHECK(static_cast<int64_t>(cache_rows.size()) == s.batch, "one cache row per batch row");
    for (int64_t b = 0; b < s.batch; ++b)
      TORCH_CHECK(cache_rows[b] >= 0 && cache_rows[b] < keys.size(0), "cache row out of range");
  }
  s.rows = qkv.size(0);
  s.width = s.rows / s.batch;
  s.dim = keys.size(3);
  s.capacity = keys.size(2);
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && qkv.is_contiguous() && s.rows == s.batch * s.width &&
              qkv.size(1) == (heads + 2 * kv_heads) * s.dim, "qkv must be contiguous fp32 (B M, (H + 2 H_kv) D)");
  TORCH_CHECK(keys.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat && keys.is_contiguous() &&
              values.is_contiguous() && values.sizes() == keys.sizes() && keys.size(1) == kv_heads &&
              heads % kv_heads == 0 && s.dim % 32 == 0, "cache (B, H_kv, capacity, D) fp32, D a multiple of 32");
  const int64_t last = *std::max_element(starts.begin(), starts.end()) + s.width;
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous() && cos.size(1) == s.dim && cos.size(0) >= last && sin.size(0) >= last &&
              (ring ? s.width <= s.capacity : last <= s.capacity), "rotary tables or cache too short");
  for (int64_t b = 0; b < s.batch; ++b)
    TORCH_CHECK(starts[b] >= 0 && counts[b] >= 0 && counts[b] <= s.width, "bad count");
  if (tree.empty()) return s;
  const int64_t size = static_cast<int64_t>(tree.size());
  TORCH_CHECK(size > s.rows && tree[0] == s.rows + 1 && tree[s.rows] == size, "tree: B M + 1 offsets first");
  for (int64_t r = 0; r < s.rows; ++r) {
    TORCH_CHECK(tree[r] < tree[r + 1], "tree: an empty entry");
    const int64_t slot = starts[r / s.width] + r % s.width;
    const Visible v = visible_of(tree, r, slot);
    TORCH_CHECK(v.reach >= 0 && (v.count ? v.apart[v.count - 1] == slot : v.reach == slot + 1),
                "tree: a query must attend its own slot last");
    for (int64_t j = 0; j < v.count; ++j)
      TORCH_CHECK(v.apart[j] >= v.reach && (j == 0 || v.apart[j] > v.apart[j - 1]), "tree: slots apart must ascend past reach");
  }
  return s;
}

}  // namespace speclm_common
