// Causal self-attention of the learner's short rows on CPU in fp32, forward and backward (learner/fused_attention.py).
//
// Layouts (contiguous, row-major): q and out (B, L, H, D); k and v (B, L, KV, D), H a multiple of KV (grouped-query
// heads: head h reads kv head h / (H / KV)); probs (B, H, L, Lp): the forward's softmax rows, saved for the backward
// (zeros right of the diagonal; Lp = L rounded up to kCols). One work item is a batch row's kv head with its query
// heads, so threads never write the same memory. Every product runs as register tiles (kRows rows at a time against
// kCols score columns or all D features), and each output element is one fixed sequence of fused multiply-adds: over
// the features for a score, over the keys for an output row, over (head, query) for a key's or value's gradient; the
// softmax and row sums run in 8 fixed lanes (common/csrc/fp32_lanes.h): the same bits with any thread count. One path,
// AVX-512F with FMA: the tiles hold 16 zmm accumulators. On AVX2 the same tiles spill (2.4x slower than on AVX-512,
// with narrower tiles slower still, on Zen 4) and were not measured against torch's kernel on an AVX2 machine, so
// there the caller runs torch's attention (ta_isa() returns 0).
//
//   forward:  s = (q . k) * scale over keys j <= i;  p = softmax(s);  out_i = sum_j p_ij v_j
//   backward: dp_ij = do_i . v_j;  d_i = do_i . out_i;  ds_ij = p_ij (dp_ij - d_i) * scale
//             dq_i = sum_j ds_ij k_j;  dk_j = sum_h sum_i ds_ij q_i;  dv_j = sum_h sum_i p_ij do_i
#include <cstdint>
#include <vector>

#include "fp32_lanes.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif

#define TA_INLINE inline __attribute__((always_inline))
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TA_X86 1
#define TA_AVX512 __attribute__((target("avx512f,fma")))
#endif

namespace {

constexpr int64_t kCols = 32;  // probability rows are padded to a multiple of this (the widest score tile)
constexpr int kRows = 4;       // query (or key) rows of a tile

struct Tiles {
  static constexpr int cols = 32;      // score columns of a tile
  static constexpr int features = 64;  // output features of a tile
};

// out[r][c] = sum_{k < count} a[r * lda + k * ka] * b[k * ldb + c] for r < rows, c < W, added to what out holds
// with `accumulate`: the rank-1 updates of a register tile. The scores (k over features, b the transposed keys), the
// outputs (k over keys, b the values) and the key and value gradients (k over queries, a a column of p or ds, one
// call per head) are all this product. K > 0: count is K, known when compiling (the scores' head size: with a
// run-time count there the kernel ran a few percent slower); KA > 0: ka is KA.
template <int W, int K = 0, int KA = 1>
TA_INLINE void tile_rank1(const float* __restrict__ a, int64_t lda, int64_t ka, int rows, const float* __restrict__ b,
                          int64_t ldb, int64_t count, float* __restrict__ out, int64_t ldo, bool accumulate) {
  const int64_t steps = K > 0 ? K : count, a_step = KA > 0 ? KA : ka;
  float acc[kRows][W];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < W; ++c) acc[r][c] = accumulate && r < rows ? out[r * ldo + c] : 0.0f;
  const float* arow[kRows];
  for (int r = 0; r < kRows; ++r) arow[r] = a + (r < rows ? r : rows - 1) * lda;
  for (int64_t k = 0; k < steps; ++k) {
    const float* bk = b + k * ldb;
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      const float x = arow[r][k * a_step];
#pragma GCC unroll 32
      for (int c = 0; c < W; ++c) acc[r][c] = __builtin_fmaf(x, bk[c], acc[r][c]);
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < W; ++c) out[r * ldo + c] = acc[r][c];
}

// out[r][j0 + c] = sum_d a[r][d] * bt[d][j0 + c], the score columns j0..j0+kCols-1 of rows r < rows (bt: D rows of
// ldb >= j0 + kCols floats), in tiles of T::cols columns
template <int D, class T>
TA_INLINE void scores(const float* a, int64_t lda, int rows, const float* bt, int64_t ldb, int64_t j0, float* out,
                      int64_t ldo) {
  for (int64_t c0 = j0; c0 < j0 + kCols; c0 += T::cols)
    tile_rank1<T::cols, D>(a, lda, 1, rows, bt + c0, ldb, D, out + c0, ldo, false);
}

// out[r][:] = sum_{j < n} p[r][j] * v[j][:] for r < rows (p: rows of ldp floats; v: rows of ldv floats, D features),
// T::features at a time
template <int D, class T>
TA_INLINE void mix(const float* p, int64_t ldp, int rows, const float* v, int64_t ldv, int64_t n, float* out,
                   int64_t ldo) {
  constexpr int F = T::features < D ? T::features : D;
  for (int f = 0; f < D; f += F) tile_rank1<F>(p, ldp, 1, rows, v + f, ldv, n, out + f, ldo, false);
}

// out[r][:] = sum_h sum_{i >= j0} w_h[i][j0 + r] * x_h[i][:] for r < rows: the transposed product (dv from p, dk
// from ds), heads in order, then queries in order, T::features at a time
template <int D, class T>
TA_INLINE void mix_t(const float* const* w, int64_t ldw, const float* const* x, int64_t ldx, int heads, int64_t j0,
                     int rows, int64_t len, float* out, int64_t ldo) {
  constexpr int F = T::features < D ? T::features : D;
  for (int f = 0; f < D; f += F)
    for (int h = 0; h < heads; ++h)
      tile_rank1<F, 0, 0>(w[h] + j0 * ldw + j0, 1, ldw, rows, x[h] + j0 * ldx + f, ldx, len - j0, out + f, ldo, h > 0);
}

TA_INLINE float lane_sum(const float* p, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int u = 0; u < 8; ++u) acc[u] += p[i + u];
  float total = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) total += p[i];
  return total;
}

TA_INLINE float lane_dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int u = 0; u < 8; ++u) acc[u] = __builtin_fmaf(a[i + u], b[i + u], acc[u]);
  float total = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) total = __builtin_fmaf(a[i], b[i], total);
  return total;
}

// rows[d][j] = src[j][d] for j < len, 0 up to padded (src rows of ld floats)
template <int D>
TA_INLINE void transposed(const float* src, int64_t ld, int64_t len, int64_t padded, float* rows) {
  for (int64_t d = 0; d < D; ++d) {
    for (int64_t j = 0; j < len; ++j) rows[d * padded + j] = src[j * ld + d];
    for (int64_t j = len; j < padded; ++j) rows[d * padded + j] = 0.0f;
  }
}

struct Shape {
  int64_t batch, len, padded, heads, kv_heads;
  float scale;
};

// One batch row's kv head g: its query heads' probabilities (softmax rows) and outputs.
template <int D, class T>
TA_INLINE void forward_group(const float* q, const float* k, const float* v, float* out, float* probs,
                             const Shape& s, int64_t b, int64_t g, float* kt) {
  const int64_t rep = s.heads / s.kv_heads, ldq = s.heads * D, ldk = s.kv_heads * D, L = s.len, Lp = s.padded;
  const float* vb = v + b * L * ldk + g * D;
  transposed<D>(k + b * L * ldk + g * D, ldk, L, Lp, kt);
  for (int64_t head = g * rep; head < (g + 1) * rep; ++head) {
    float* ph = probs + (b * s.heads + head) * L * Lp;
    for (int64_t i0 = 0; i0 < L; i0 += kRows) {
      const int rows = L - i0 < kRows ? static_cast<int>(L - i0) : kRows;
      const int64_t keys = i0 + rows;  // causal: the tile's rows read keys 0..keys-1
      const float* qi = q + (b * L + i0) * ldq + head * D;
      float* pi = ph + i0 * Lp;
      for (int64_t j0 = 0; j0 < keys; j0 += kCols) scores<D, T>(qi, ldq, rows, kt, Lp, j0, pi, Lp);
      for (int r = 0; r < rows; ++r) {
        float* p = pi + r * Lp;
        const int64_t n = i0 + r + 1;
        for (int64_t j = 0; j < n; ++j) p[j] *= s.scale;
        float top = p[0];
        for (int64_t j = 1; j < n; ++j) top = p[j] > top ? p[j] : top;
        for (int64_t j = 0; j < n; ++j) p[j] = fp32_lanes::exp_nonpositive(p[j] - top);
        const float inv = 1.0f / lane_sum(p, n);
        for (int64_t j = 0; j < n; ++j) p[j] *= inv;
        for (int64_t j = n; j < Lp; ++j) p[j] = 0.0f;
      }
      mix<D, T>(pi, Lp, rows, vb, ldk, keys, out + (b * L + i0) * ldq + head * D, ldq);
    }
  }
}

// One batch row's kv head g: dq of its query heads, dk and dv of the kv head (summed over those heads).
template <int D, class T>
TA_INLINE void backward_group(const float* q, const float* k, const float* v, const float* out, const float* probs,
                              const float* grad, float* dq, float* dk, float* dv, const Shape& s, int64_t b,
                              int64_t g, float* vt, float* ds) {
  const int64_t rep = s.heads / s.kv_heads, ldq = s.heads * D, ldk = s.kv_heads * D, L = s.len, Lp = s.padded;
  transposed<D>(v + b * L * ldk + g * D, ldk, L, Lp, vt);
  const float* kb = k + b * L * ldk + g * D;
  std::vector<const float*> p_heads(rep), ds_heads(rep), grad_heads(rep), q_heads(rep);
  for (int64_t r = 0; r < rep; ++r) {
    const int64_t head = g * rep + r;
    const float* ph = probs + (b * s.heads + head) * L * Lp;
    const float* gh = grad + b * L * ldq + head * D;
    const float* oh = out + b * L * ldq + head * D;
    float* dsh = ds + r * L * Lp;
    for (int64_t i0 = 0; i0 < L; i0 += kRows) {
      const int rows = L - i0 < kRows ? static_cast<int>(L - i0) : kRows;
      const int64_t keys = i0 + rows;
      for (int64_t j0 = 0; j0 < keys; j0 += kCols) scores<D, T>(gh + i0 * ldq, ldq, rows, vt, Lp, j0, dsh + i0 * Lp, Lp);
      for (int row = 0; row < rows; ++row) {
        const int64_t i = i0 + row;
        const float di = lane_dot(gh + i * ldq, oh + i * ldq, D);
        float* dsi = dsh + i * Lp;
        const float* pi = ph + i * Lp;
        for (int64_t j = 0; j <= i; ++j) dsi[j] = (pi[j] * (dsi[j] - di)) * s.scale;
        for (int64_t j = i + 1; j < Lp; ++j) dsi[j] = 0.0f;
      }
      mix<D, T>(dsh + i0 * Lp, Lp, rows, kb, ldk, keys, dq + (b * L + i0) * ldq + head * D, ldq);
    }
    p_heads[r] = ph, ds_heads[r] = dsh, grad_heads[r] = gh, q_heads[r] = q + b * L * ldq + head * D;
  }
  const int heads = static_cast<int>(rep);
  for (int64_t j0 = 0; j0 < L; j0 += kRows) {
    const int rows = L - j0 < kRows ? static_cast<int>(L - j0) : kRows;
    const int64_t at = (b * L + j0) * ldk + g * D;
    mix_t<D, T>(p_heads.data(), Lp, grad_heads.data(), ldq, heads, j0, rows, L, dv + at, ldk);
    mix_t<D, T>(ds_heads.data(), Lp, q_heads.data(), ldq, heads, j0, rows, L, dk + at, ldk);
  }
}

inline int team(int threads, int64_t items) { return threads > 1 && items > 1 ? threads : 1; }

#ifdef TA_X86
#define TA_PATH(FN, DIM, ...) [&]() TA_AVX512 { FN<DIM, Tiles>(__VA_ARGS__); }();
#else
#define TA_PATH(FN, DIM, ...) FN<DIM, Tiles>(__VA_ARGS__);
#endif

#define TA_BY_HEAD_DIM(D_VAR, CALL_T) \
  switch (D_VAR) {                    \
    case 32: CALL_T(32); break;       \
    case 64: CALL_T(64); break;       \
    case 128: CALL_T(128); break;     \
    default: break;                   \
  }

// ta_rope (kBackward false) and ta_rope_backward (true): each (row, head) pair of halves read, then written.
template <bool kBackward>
void rope_rows(const float* x, const float* cos, const float* sin, float* out, int64_t batch, int64_t len,
               int64_t heads, int64_t head_dim, int64_t cs_batch, int threads) {
  const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) num_threads(team(threads, batch * len))
  for (int64_t row = 0; row < batch * len; ++row) {
    const int64_t b = row / len, l = row % len;
    const float* c = cos + b * cs_batch + l * head_dim;
    const float* s = sin + b * cs_batch + l * head_dim;
    for (int64_t h = 0; h < heads; ++h) {
      const float* xr = x + (row * heads + h) * head_dim;
      float* o = out + (row * heads + h) * head_dim;
      for (int64_t d = 0; d < half; ++d) {
        const float x1 = xr[d], x2 = xr[d + half];
        const float lo = kBackward ? x1 * c[d] + x2 * s[d + half] : x1 * c[d] + (-x2) * s[d];
        const float hi = kBackward ? x2 * c[d + half] + (-(x1 * s[d])) : x2 * c[d + half] + x1 * s[d + half];
        o[d] = lo;
        o[d + half] = hi;
      }
    }
  }
}

}  // namespace

extern "C" {

int ta_abi_version(void) { return 2; }

// 1 where this CPU runs the kernels' path (AVX-512F and FMA), else 0 (the caller runs torch's attention).
int ta_isa(void) {
#ifdef TA_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma")) return 1;
#endif
  return 0;
}

// Whether a head size has a path (the tiles' feature width is a template argument).
int ta_head_dim_supported(int64_t head_dim) { return head_dim == 32 || head_dim == 64 || head_dim == 128; }

// The padded width of a probability row for len keys.
int64_t ta_padded(int64_t len) { return (len + kCols - 1) / kCols * kCols; }

// Floats of the backward's scratch per thread: a transposed v and the ds rows of one kv head's query heads.
int64_t ta_backward_scratch(int64_t len, int64_t heads, int64_t kv_heads, int64_t head_dim) {
  return head_dim * ta_padded(len) + (heads / kv_heads) * len * ta_padded(len);
}

void ta_forward(const float* q, const float* k, const float* v, float* out, float* probs, int64_t batch,
                int64_t len, int64_t heads, int64_t kv_heads, int64_t head_dim, float scale, int threads) {
  const Shape s{batch, len, ta_padded(len), heads, kv_heads, scale};
#pragma omp parallel num_threads(team(threads, batch * kv_heads))
  {
    std::vector<float> kt(head_dim * s.padded);
#pragma omp for schedule(static)
    for (int64_t item = 0; item < batch * kv_heads; ++item) {
      const int64_t b = item / kv_heads, g = item % kv_heads;
#define TA_FORWARD(DIM) TA_PATH(forward_group, DIM, q, k, v, out, probs, s, b, g, kt.data())
      TA_BY_HEAD_DIM(head_dim, TA_FORWARD)
#undef TA_FORWARD
    }
  }
}

void ta_backward(const float* q, const float* k, const float* v, const float* out, const float* probs,
                 const float* grad, float* dq, float* dk, float* dv, int64_t batch, int64_t len, int64_t heads,
                 int64_t kv_heads, int64_t head_dim, float scale, int threads) {
  const Shape s{batch, len, ta_padded(len), heads, kv_heads, scale};
#pragma omp parallel num_threads(team(threads, batch * kv_heads))
  {
    std::vector<float> scratch(ta_backward_scratch(len, heads, kv_heads, head_dim));
    float* vt = scratch.data();
    float* ds = vt + head_dim * s.padded;
#pragma omp for schedule(static)
    for (int64_t item = 0; item < batch * kv_heads; ++item) {
      const int64_t b = item / kv_heads, g = item % kv_heads;
#define TA_BACKWARD(DIM) \
  TA_PATH(backward_group, DIM, q, k, v, out, probs, grad, dq, dk, dv, s, b, g, vt, ds)
      TA_BY_HEAD_DIM(head_dim, TA_BACKWARD)
#undef TA_BACKWARD
    }
  }
}

// Rotary position embedding of rows x (B, L, H, D) into out (same layout), as transformers' apply_rotary_pos_emb:
// out = x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2, x1) over the halves of D, each product rounded
// and then added (no fused multiply-adds: -ffp-contract=off), so the bits are torch's. cos and sin are (B or 1, L, D)
// with rows of D contiguous, batch row b at b * cs_batch floats (0: one row for every batch row). out may be x.
void ta_rope(const float* x, const float* cos, const float* sin, float* out, int64_t batch, int64_t len,
             int64_t heads, int64_t head_dim, int64_t cs_batch, int threads) {
  rope_rows<false>(x, cos, sin, out, batch, len, heads, head_dim, cs_batch, threads);
}

// The gradient of ta_rope's input from the gradient g of its output (same layouts), as autograd computes it through
// transformers' ops: dx1 = g1 * cos1 + g2 * sin2, dx2 = g2 * cos2 - g1 * sin1 (each product rounded). out may be g.
void ta_rope_backward(const float* g, const float* cos, const float* sin, float* out, int64_t batch, int64_t len,
                      int64_t heads, int64_t head_dim, int64_t cs_batch, int threads) {
  rope_rows<true>(g, cos, sin, out, batch, len, heads, head_dim, cs_batch, threads);
}

}  // extern "C"
