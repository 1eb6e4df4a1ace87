// Fused fp32 ops of the learner's forward and backward on CPU: RMSNorm and SwiGLU (silu(gate) * up), each one
// pass over its rows instead of the 5-9 torch ops (each a pass over memory) autograd runs for HF's modules; and the
// transposed copy of a matrix that oneDNN's weight gradient reads (to_transpose: a copy, no arithmetic); and the
// float64 sums norm_update reads of one parameter's update (to_update_sums).
//
// Built and loaded by learner/fused_ops.py (common/native_build.py compiles it: plain C ABI, no torch headers).
// Pointers are to contiguous row-major fp32 memory. Each op's loops are one inline body compiled three times, for
// AVX-512F, AVX2 and the baseline ISA (function-level target attributes); the caller picks with `isa` (to_isa() or
// lower). Every sum runs in 8 fixed lanes and every element's arithmetic is the same sequence of fp32 operations
// (the build passes -ffp-contract=off), so the three give the same bits, with any thread count. Values differ from
// torch's ops in rounding only: the norms' sums run in another order, and the sigmoid's exp is Cephes' expf
// polynomial (within 2 ulp of expf; common/csrc/fp32_lanes.h, shared with the engine's kernels).
#include <cstdint>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "fp32_lanes.h"
#include "isa_variants.h"
#ifdef _OPENMP
#include <omp.h>
#endif

// Branch-free selects (x < a ? a : x) must become vector blends: that needs no-trapping-math (GCC otherwise keeps
// the branch, and the loop stays scalar).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif

#define TO_INLINE inline __attribute__((always_inline))
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TO_X86 1
#define TO_AVX2 __attribute__((target("avx2")))
#endif

namespace {

using fp32_lanes::exp_nonpositive;
using fp32_lanes::sum_squares;

constexpr int64_t kChunk = 8192;      // elements of an elementwise op per OpenMP iteration
constexpr int64_t kNormBlock = 64;    // rows of RMSNorm's backward per partial weight-gradient row
constexpr int64_t kParallelMin = 1 << 15;  // elements below which an op runs on one thread
constexpr int64_t kTile = 64;         // to_transpose: a tile of 64 x 64 floats (16 KB each side) stays in L1/L2
constexpr int64_t kBlock = 8;         // to_transpose: the 8 x 8 blocks a tile is copied in
constexpr int64_t kSumChunk = 1 << 16;  // to_update_sums: elements per partial (its sums do not depend on threads)

// sigmoid(x) = 1 / (1 + exp(-x)), from exp(-|x|) <= 1 (no overflow for either sign).
TO_INLINE float sigmoid(float x) {
  const float ax = x < 0.0f ? -x : x;
  const float e = exp_nonpositive(-ax);
  const float inv = 1.0f / (1.0f + e);
  return x >= 0.0f ? inv : e * inv;
}

// sum_i grad[i] * weight[i] * x[i] (the row's dot of the normalized input and its gradient, before the 1/rms)
TO_INLINE float dot3(const float* __restrict__ a, const float* __restrict__ b, const float* __restrict__ c, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += (a[i + j] * b[i + j]) * c[i + j];
  float total = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) total += (a[i] * b[i]) * c[i];
  return total;
}

TO_INLINE void swiglu_span(const float* __restrict__ gate, const float* __restrict__ up, float* __restrict__ out,
                           int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = (g * sigmoid(g)) * up[i];
  }
}

// d silu(g) / dg = s (1 + g (1 - s)), s = sigmoid(g)
TO_INLINE void swiglu_backward_span(const float* __restrict__ grad, const float* __restrict__ gate,
                                    const float* __restrict__ up, float* __restrict__ grad_gate,
                                    float* __restrict__ grad_up, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i], d = grad[i];
    const float s = sigmoid(g);
    grad_up[i] = d * (g * s);
    grad_gate[i] = (d * up[i]) * (s * (1.0f + g * (1.0f - s)));
  }
}

TO_INLINE void norm_rows(const float* __restrict__ x, int64_t lo, int64_t hi, int64_t dim,
                         const float* __restrict__ weight, float eps, float* __restrict__ out,
                         float* __restrict__ rstd) {
  for (int64_t r = lo; r < hi; ++r) {
    const float* xr = x + r * dim;
    float* yr = out + r * dim;
    const float scale = 1.0f / __builtin_sqrtf(sum_squares(xr, dim) / static_cast<float>(dim) + eps);
    rstd[r] = scale;
    for (int64_t c = 0; c < dim; ++c) yr[c] = weight[c] * (xr[c] * scale);
  }
}

// Rows lo..hi-1: grad_x, and their sum of grad * x_hat into grad_w_row (zeroed here).
// y = w * x_hat, x_hat = x * rstd:  dx = rstd * (g w - x_hat * mean(g w x_hat)),  dw = sum_rows g * x_hat.
TO_INLINE void norm_backward_rows(const float* __restrict__ grad, const float* __restrict__ x,
                                  const float* __restrict__ weight, const float* __restrict__ rstd, int64_t lo,
                                  int64_t hi, int64_t dim, float* __restrict__ grad_x,
                                  float* __restrict__ grad_w_row) {
  for (int64_t c = 0; c < dim; ++c) grad_w_row[c] = 0.0f;
  for (int64_t r = lo; r < hi; ++r) {
    const float* gr = grad + r * dim;
    const float* xr = x + r * dim;
    float* dxr = grad_x + r * dim;
    const float scale = rstd[r];
    const float mean = (dot3(gr, weight, xr, dim) * scale) / static_cast<float>(dim);
    for (int64_t c = 0; c < dim; ++c) {
      const float x_hat = xr[c] * scale;
      dxr[c] = scale * (gr[c] * weight[c] - x_hat * mean);
      grad_w_row[c] += gr[c] * x_hat;
    }
  }
}

// An 8 x 8 block transposed: dst row j = src column j (each side's rows `ld` floats apart). The portable form
// goes through a local array; the AVX2 form (also the AVX-512 path's: 8-float rows are one ymm) in registers, 8
// loads, 24 shuffles and 8 stores (unpack pairs of rows, shuffle pairs of pairs, swap 128-bit halves).
inline void block8_portable(const float* __restrict__ src, int64_t ld_src, float* __restrict__ dst, int64_t ld_dst) {
  float block[kBlock][kBlock];
  for (int64_t i = 0; i < kBlock; ++i)
    for (int64_t j = 0; j < kBlock; ++j) block[j][i] = src[i * ld_src + j];
  for (int64_t j = 0; j < kBlock; ++j)
    for (int64_t i = 0; i < kBlock; ++i) dst[j * ld_dst + i] = block[j][i];
}

#ifdef TO_X86
TO_AVX2 inline void block8_avx2(const float* __restrict__ src, int64_t ld_src, float* __restrict__ dst,
                                int64_t ld_dst) {
  __m256 r[8], t[8], u[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * ld_src);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int j = 0; j < 4; ++j) {
    _mm256_storeu_ps(dst + j * ld_dst, _mm256_permute2f128_ps(u[j], u[j + 4], 0x20));
    _mm256_storeu_ps(dst + (j + 4) * ld_dst, _mm256_permute2f128_ps(u[j], u[j + 4], 0x31));
  }
}
#endif

// dst[c][r] = src[r][c] for the tile's rows r0..r1-1 and columns c0..c1-1 (src rows x cols, dst cols x rows): 8 x 8
// blocks (`block8_*`; `vector`: the AVX2 form), so that both sides move in runs of 8 consecutive floats.
inline void transpose_tile(const float* __restrict__ src, int64_t rows, int64_t cols, float* __restrict__ dst,
                           int64_t r0, int64_t r1, int64_t c0, int64_t c1, bool vector) {
  for (int64_t c = c0; c < c1; c += kBlock) {
    const int64_t cn = c1 - c < kBlock ? c1 - c : kBlock;
    for (int64_t r = r0; r < r1; r += kBlock) {
      const int64_t rn = r1 - r < kBlock ? r1 - r : kBlock;
      if (cn == kBlock && rn == kBlock) {
#ifdef TO_X86
        if (vector) {
          block8_avx2(src + r * cols + c, cols, dst + c * rows + r, rows);
          continue;
        }
#endif
        block8_portable(src + r * cols + c, cols, dst + c * rows + r, rows);
      } else {
        for (int64_t j = 0; j < cn; ++j)
          for (int64_t i = 0; i < rn; ++i) dst[(c + j) * rows + r + i] = src[(r + i) * cols + c + j];
      }
    }
  }
}

// (sum (now - old)^2, sum old^2) of n elements in float64: 8 fixed lanes, each element's double operations in one
// order (-ffp-contract=off: no fused multiply-add), so every vector path gives the same bits.
TO_INLINE void update_sums_span(const float* __restrict__ now, const float* __restrict__ old, int64_t n,
                                double* __restrict__ out) {
  double delta2[8] = {0, 0, 0, 0, 0, 0, 0, 0}, old2[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) {
      const double prior = old[i + j], delta = static_cast<double>(now[i + j]) - prior;
      delta2[j] += delta * delta;
      old2[j] += prior * prior;
    }
  double d = ((delta2[0] + delta2[1]) + (delta2[2] + delta2[3])) + ((delta2[4] + delta2[5]) + (delta2[6] + delta2[7]));
  double o = ((old2[0] + old2[1]) + (old2[2] + old2[3])) + ((old2[4] + old2[5]) + (old2[6] + old2[7]));
  for (; i < n; ++i) {
    const double prior = old[i], delta = static_cast<double>(now[i]) - prior;
    d += delta * delta;
    o += prior * prior;
  }
  out[0] = d, out[1] = o;
}

inline int team(int threads, int64_t work) { return threads > 1 && work >= kParallelMin ? threads : 1; }

}  // namespace

extern "C" {

int to_abi_version(void) { return 4; }

// The best vector path here for `isa`: 2 AVX-512F, 1 AVX2, 0 the baseline (all give the same bits).
int to_isa(void) { return isa_variants_best(); }

// out[i] = silu(gate[i]) * up[i], i < n.
void to_swiglu(int isa, const float* gate, const float* up, float* out, int64_t n, int threads) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) num_threads(team(threads, n))
  for (int64_t k = 0; k < chunks; ++k) {
    const int64_t lo = k * kChunk, len = n - lo < kChunk ? n - lo : kChunk;
    ISA_VARIANTS(swiglu_span(gate + lo, up + lo, out + lo, len))
  }
}

// grad_gate = grad * up * silu'(gate), grad_up = grad * silu(gate), i < n.
void to_swiglu_backward(int isa, const float* grad, const float* gate, const float* up, float* grad_gate,
                        float* grad_up, int64_t n, int threads) {
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) num_threads(team(threads, n))
  for (int64_t k = 0; k < chunks; ++k) {
    const int64_t lo = k * kChunk, len = n - lo < kChunk ? n - lo : kChunk;
    ISA_VARIANTS(swiglu_backward_span(grad + lo, gate + lo, up + lo, grad_gate + lo, grad_up + lo, len))
  }
}

// out[r] = weight * (x[r] * rstd[r]), rstd[r] = 1 / sqrt(mean(x[r]^2) + eps), r < rows (HF's RMSNorm order).
void to_rms_norm(int isa, const float* x, int64_t rows, int64_t dim, const float* weight, float eps, float* out,
                 float* rstd, int threads) {
  const int64_t blocks = (rows + kNormBlock - 1) / kNormBlock;
#pragma omp parallel for schedule(static) num_threads(team(threads, rows * dim))
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = b * kNormBlock, hi = lo + kNormBlock < rows ? lo + kNormBlock : rows;
    ISA_VARIANTS(norm_rows(x, lo, hi, dim, weight, eps, out, rstd))
  }
}

// Rows of to_rms_norm_backward's grad_w_partial: one row of dim floats per block of kNormBlock rows.
int64_t to_norm_partial_rows(int64_t rows) { return (rows + kNormBlock - 1) / kNormBlock; }

// grad_x (rows, dim) and grad_w_partial (to_norm_partial_rows(rows), dim): the weight's gradient is the sum of its
// rows (the caller sums them), a partial per fixed block of rows, so the value does not depend on the threads.
void to_rms_norm_backward(int isa, const float* grad, const float* x, const float* weight, const float* rstd,
                          int64_t rows, int64_t dim, float* grad_x, float* grad_w_partial, int threads) {
  const int64_t blocks = to_norm_partial_rows(rows);
#pragma omp parallel for schedule(static) num_threads(team(threads, rows * dim))
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t lo = b * kNormBlock, hi = lo + kNormBlock < rows ? lo + kNormBlock : rows;
    ISA_VARIANTS(norm_backward_rows(grad, x, weight, rstd, lo, hi, dim, grad_x, grad_w_partial + b * dim))
  }
}

// dst (cols, rows) = src (rows, cols) transposed, both contiguous row-major: a copy in 64 x 64 tiles, split over
// threads by tile, each 8 x 8 block in AVX2 registers where `isa` >= 1. torch's `t().contiguous()` moved 3-9 GB/s at
// the learner's shapes here; the local-array blocks (isa 0) about 2-3x that, the AVX2 blocks 4-6x (Zen 4).
void to_transpose(int isa, const float* src, int64_t rows, int64_t cols, float* dst, int threads) {
  const int64_t row_tiles = (rows + kTile - 1) / kTile, col_tiles = (cols + kTile - 1) / kTile;
#pragma omp parallel for schedule(static) num_threads(team(threads, rows * cols))
  for (int64_t t = 0; t < row_tiles * col_tiles; ++t) {
    const int64_t r0 = (t % row_tiles) * kTile, c0 = (t / row_tiles) * kTile;
    transpose_tile(src, rows, cols, dst, r0, r0 + kTile < rows ? r0 + kTile : rows, c0,
                   c0 + kTile < cols ? c0 + kTile : cols, isa >= 1);
  }
}

// The chunks of to_update_sums over n elements: its partials hold one (delta^2, old^2) pair per chunk.
int64_t to_update_sum_chunks(int64_t n) { return (n + kSumChunk - 1) / kSumChunk; }

// out[0] = sum (now[i] - old[i])^2, out[1] = sum old[i]^2 over i < n, in float64; partials (2 x to_update_sum_chunks
// doubles, the caller's) hold each chunk's pair, added in chunk order here: the same bits at any thread count.
void to_update_sums(int isa, const float* now, const float* old, int64_t n, double* partials, double* out,
                    int threads) {
  const int64_t chunks = to_update_sum_chunks(n);
#pragma omp parallel for schedule(static) num_threads(team(threads, n))
  for (int64_t k = 0; k < chunks; ++k) {
    const int64_t lo = k * kSumChunk, len = n - lo < kSumChunk ? n - lo : kSumChunk;
    ISA_VARIANTS(update_sums_span(now + lo, old + lo, len, partials + 2 * k))
  }
  double d = 0.0, o = 0.0;
  for (int64_t k = 0; k < chunks; ++k) d += partials[2 * k], o += partials[2 * k + 1];
  out[0] = d, out[1] = o;
}

}  // extern "C"
