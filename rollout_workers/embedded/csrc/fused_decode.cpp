// Fused fp32 ops of the embedded engine's decode step on CPU: RMSNorm (with the residual add before it), decode
// attention (q/k norms, RoPE, appending the new key and value to the cache, attention over it), one call each
// instead of the 7-30 torch ops they take (each op costs microseconds of dispatch: that, not arithmetic, bounds a
// small model's decode step), a batch-invariant fp32 linear on a transposed weight, and a whole decode step's layers
// on int8 weights in one call (fd_decode_layers: the ops above, SiLU x up, and int8_gemm.cpp's i8_linear through a
// function pointer).
//
// Built and loaded by rollout_workers/embedded/fused_decode.py (rollout_workers/embedded/native.py builds it:
// plain C ABI, no torch headers). Pointers are to contiguous row-major fp32 memory unless a stride is given.
// Hot loops are compiled for AVX-512, AVX2 and the baseline ISA (target_clones: the loader picks at run time).
// Multiplies and adds round separately (the build passes -ffp-contract=off), like torch's ops: RMSNorm and RoPE
// give HF's values; sums (norms' mean, attention's dot products and softmax) differ from torch's in order only.
#include <cmath>
#include <cstdint>

#include "fp32_lanes.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FD_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define FD_CLONES
#endif

namespace {

// Helpers are plain inline functions: each FD_CLONES caller inlines them compiled for its own ISA (sum_squares,
// dot and exp_nonpositive, the exp of the softmax after subtracting the row's max, come from fp32_lanes.h).
using fp32_lanes::dot;
using fp32_lanes::exp_nonpositive;
using fp32_lanes::sum_squares;

// out[d] = sum_t weights[t] * values[t, d]: 8 columns at a time, their sums held in registers over t.
inline void weighted_sum(const float* __restrict__ weights, const float* __restrict__ values, int64_t span,
                         int64_t dim, float* __restrict__ out) {
  int64_t d0 = 0;
  for (; d0 + 8 <= dim; d0 += 8) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t t = 0; t < span; ++t)
      for (int l = 0; l < 8; ++l) acc[l] += weights[t] * values[t * dim + d0 + l];
    for (int l = 0; l < 8; ++l) out[d0 + l] = acc[l];
  }
  for (; d0 < dim; ++d0) {
    float acc = 0.0f;
    for (int64_t t = 0; t < span; ++t) acc += weights[t] * values[t * dim + d0];
    out[d0] = acc;
  }
}

inline float inv_rms(const float* x, int64_t dim, float eps) {
  return 1.0f / std::sqrt(sum_squares(x, dim) / static_cast<float>(dim) + eps);
}

// HF's LlamaRMSNorm in fp32: out = weight * (x * rsqrt(mean(x^2) + eps)); out may be x.
inline void norm_into(const float* x, const float* weight, float eps, float* out, int64_t dim) {
  const float s = inv_rms(x, dim, eps);
  for (int64_t d = 0; d < dim; ++d) out[d] = weight[d] * (x[d] * s);
}

// x (D) -> x * cos + rotate_half(x) * sin, with rotate_half(x) * sin = roll(x, D / 2) * sin_rotate (sin's first
// half negated): HF's products and sum, rounded like its ops. `scratch` holds D floats.
inline void rope(float* x, const float* cos, const float* sin_rotate, int64_t dim, float* scratch) {
  const int64_t half = dim / 2;
  for (int64_t d = 0; d < dim; ++d) scratch[d] = x[d];
  for (int64_t d = 0; d < half; ++d) x[d] = scratch[d] * cos[d] + scratch[d + half] * sin_rotate[d];
  for (int64_t d = half; d < dim; ++d) x[d] = scratch[d] * cos[d] + scratch[d - half] * sin_rotate[d];
}

struct Attention {
  const float* qkv;
  int64_t qkv_stride, heads, kv_heads, head_dim;
  const int64_t* positions;
  const float *cos, *sin_rotate, *q_norm, *k_norm;
  float norm_eps;
  float *keys, *values;
  int64_t max_len;
  float* out;
  int64_t rows;  // the call's rows (n)
};

inline int64_t scratch_floats(int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t max_len) {
  const int64_t group = heads / kv_heads;
  return head_dim + group * (head_dim + max_len);
}

// Row i: for each KV head, its new key (norm, RoPE) and value into cache slot i at position p; then the group of
// query heads it serves (norm, RoPE, scaled by 1/sqrt(D)) over positions 0..p, each key and value read once for
// the whole group.
FD_CLONES void attend_row(const Attention& a, int64_t i, float* scratch) {
  const int64_t D = a.head_dim, p = a.positions[i], group = a.heads / a.kv_heads, span = p + 1;
  const float* row = a.qkv + i * a.qkv_stride;
  const float *cos = a.cos + p * D, *sin_rotate = a.sin_rotate + p * D;
  float* tmp = scratch;                     // D
  float* q = scratch + D;                   // group x D
  float* scores = scratch + D + group * D;  // group x max_len
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  for (int64_t h = 0; h < a.kv_heads; ++h) {
    float* keys = a.keys + (i * a.kv_heads + h) * a.max_len * D;
    float* values = a.values + (i * a.kv_heads + h) * a.max_len * D;
    const float *k_in = row + (a.heads + h) * D, *v_in = row + (a.heads + a.kv_heads + h) * D;
    for (int64_t d = 0; d < D; ++d) keys[p * D + d] = k_in[d], values[p * D + d] = v_in[d];
    if (a.k_norm != nullptr) norm_into(keys + p * D, a.k_norm, a.norm_eps, keys + p * D, D);
    rope(keys + p * D, cos, sin_rotate, D, tmp);
    for (int64_t j = 0; j < group; ++j) {
      float* qj = q + j * D;
      for (int64_t d = 0; d < D; ++d) qj[d] = row[(h * group + j) * D + d];
      if (a.q_norm != nullptr) norm_into(qj, a.q_norm, a.norm_eps, qj, D);
      rope(qj, cos, sin_rotate, D, tmp);
      for (int64_t d = 0; d < D; ++d) qj[d] = qj[d] * scale;
    }
    for (int64_t t = 0; t < span; ++t)
      for (int64_t j = 0; j < group; ++j) scores[j * a.max_len + t] = dot(q + j * D, keys + t * D, D);
    for (int64_t j = 0; j < group; ++j) {
      float* s = scores + j * a.max_len;
      float total = 0.0f, lanes[8] = {s[0], s[0], s[0], s[0], s[0], s[0], s[0], s[0]};
      int64_t t0 = 0;
      for (; t0 + 8 <= span; t0 += 8)
        for (int l = 0; l < 8; ++l) lanes[l] = __builtin_fmaxf(lanes[l], s[t0 + l]);
      for (; t0 < span; ++t0) lanes[0] = __builtin_fmaxf(lanes[0], s[t0]);
      float top = lanes[0];
      for (int l = 1; l < 8; ++l) top = __builtin_fmaxf(top, lanes[l]);
      for (int64_t t = 0; t < span; ++t) s[t] = exp_nonpositive(s[t] - top);
      for (int64_t t = 0; t < span; ++t) total += s[t];
      const float inv_total = 1.0f / total;
      for (int64_t t = 0; t < span; ++t) s[t] = s[t] * inv_total;
    }
    for (int64_t j = 0; j < group; ++j)
      weighted_sum(scores + j * a.max_len, values, span, D, a.out + (i * a.heads + h * group + j) * D);
  }
}


// Row i's new key and value into the cache, and its group of queries (norm, RoPE, scaled by 1/sqrt(D)) into q
// (group x D), for KV head h: the part of attend_row every variant shares.
inline void prepare_head(const Attention& a, int64_t i, int64_t h, float* q, float* tmp) {
  const int64_t D = a.head_dim, p = a.positions[i], group = a.heads / a.kv_heads;
  const float* row = a.qkv + i * a.qkv_stride;
  const float *cos = a.cos + p * D, *sin_rotate = a.sin_rotate + p * D;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  float* keys = a.keys + (i * a.kv_heads + h) * a.max_len * D;
  float* values = a.values + (i * a.kv_heads + h) * a.max_len * D;
  const float *k_in = row + (a.heads + h) * D, *v_in = row + (a.heads + a.kv_heads + h) * D;
  for (int64_t d = 0; d < D; ++d) keys[p * D + d] = k_in[d], values[p * D + d] = v_in[d];
  if (a.k_norm != nullptr) norm_into(keys + p * D, a.k_norm, a.norm_eps, keys + p * D, D);
  rope(keys + p * D, cos, sin_rotate, D, tmp);
  for (int64_t j = 0; j < group; ++j) {
    float* qj = q + j * D;
    for (int64_t d = 0; d < D; ++d) qj[d] = row[(h * group + j) * D + d];
    if (a.q_norm != nullptr) norm_into(qj, a.q_norm, a.norm_eps, qj, D);
    rope(qj, cos, sin_rotate, D, tmp);
    for (int64_t d = 0; d < D; ++d) qj[d] = qj[d] * scale;
  }
}

// s[0..span) -> softmax(s) in place (exp of s - max, over the sum).
inline void softmax_in_place(float* s, int64_t span) {
  float total = 0.0f, lanes[8] = {s[0], s[0], s[0], s[0], s[0], s[0], s[0], s[0]};
  int64_t t0 = 0;
  for (; t0 + 8 <= span; t0 += 8)
    for (int l = 0; l < 8; ++l) lanes[l] = __builtin_fmaxf(lanes[l], s[t0 + l]);
  for (; t0 < span; ++t0) lanes[0] = __builtin_fmaxf(lanes[0], s[t0]);
  float top = lanes[0];
  for (int l = 1; l < 8; ++l) top = __builtin_fmaxf(top, lanes[l]);
  for (int64_t t = 0; t < span; ++t) s[t] = exp_nonpositive(s[t] - top);
  for (int64_t t = 0; t < span; ++t) total += s[t];
  const float inv_total = 1.0f / total;
  for (int64_t t = 0; t < span; ++t) s[t] = s[t] * inv_total;
}

// The keys and values a row's kv head h reads next after its own (the row's next head, or the next row's first):
// the vector forms prefetch them into L2 while they work on this head, a cache line for each of this head's
// positions, so that the next head's stream does not start cold (a decode step's cache outgrows L3 beside the
// weights: one layer of 16 rows at 78 positions, 9 layers in turn, 0.29-0.36 -> 0.18-0.20 ms a call on Zen 4).
// span 0 (no next row) prefetches nothing. A hint: the results are unchanged.
struct NextHead {
  const float *keys, *values;
  int64_t span;
};

inline NextHead next_head(const Attention& a, int64_t i, int64_t h) {
  const int64_t row = h + 1 < a.kv_heads ? i : i + 1;
  if (row >= a.rows) return {nullptr, nullptr, 0};
  const int64_t offset = (row * a.kv_heads + (h + 1) % a.kv_heads) * a.max_len * a.head_dim;
  return {a.keys + offset, a.values + offset, a.positions[row] + 1};
}

// Prefetch position t's cache lines: this head's values (read after the softmax) and keys a few positions ahead
// (within its span) into L1, the next head's keys and values into L2. always_inline: as a plain inline function
// GCC 12 compiled the vector forms' calls without their prefetches.
__attribute__((always_inline)) inline void prefetch_position(const float* keys, const float* values, int64_t span,
                                                             const NextHead& next, int64_t t, int64_t D) {
  constexpr int64_t kAhead = 4;
  for (int64_t c = 0; c < D; c += 16) {
    __builtin_prefetch(values + t * D + c, 0, 3);
    if (t + kAhead < span) __builtin_prefetch(keys + (t + kAhead) * D + c, 0, 3);
    if (t < next.span) {
      __builtin_prefetch(next.keys + t * D + c, 0, 2);
      __builtin_prefetch(next.values + t * D + c, 0, 2);
    }
  }
}

#if defined(__x86_64__)
// The vector variants (head_dim a multiple of the vector width; fd_decode_attention picks them): the scores of a
// position are one vector of products reduced once, the weighted sum of values runs over two interleaved partial
// sums per column block (even and odd positions), so neither waits on a chain of dependent adds. Every row is still
// computed alone: results do not depend on the batch (they differ from the portable form's in summation order only).
// exp_nonpositive on 16 lanes: the same operations in the same order (no fused multiply-adds), so each lane
// equals the scalar function's result.
__attribute__((target("avx512f"))) inline __m512 exp_nonpositive16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 magic = _mm512_set1_ps(12582912.0f);
  const __m512 n = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), magic), magic);
  __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
  r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_add_ps(_mm512_mul_ps(y, r), _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_add_ps(_mm512_mul_ps(y, r), _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_add_ps(_mm512_mul_ps(y, r), _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_add_ps(_mm512_mul_ps(y, r), _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_add_ps(_mm512_mul_ps(y, r), _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(y, _mm512_mul_ps(r, r)), r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
}

// softmax_in_place on 16 lanes at a time (the tail masked): max, exp, a vector of partial sums, scale.
__attribute__((target("avx512f"))) void softmax_avx512(float* s, int64_t span) {
  __m512 top = _mm512_set1_ps(s[0]);
  for (int64_t t0 = 0; t0 < span; t0 += 16) {
    const __mmask16 mask = span - t0 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (span - t0)) - 1u);
    top = _mm512_mask_max_ps(top, mask, top, _mm512_maskz_loadu_ps(mask, s + t0));
  }
  const __m512 peak = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512 total = _mm512_setzero_ps();
  for (int64_t t0 = 0; t0 < span; t0 += 16) {
    const __mmask16 mask = span - t0 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (span - t0)) - 1u);
    const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + t0), peak));
    _mm512_mask_storeu_ps(s + t0, mask, e);
    total = _mm512_mask_add_ps(total, mask, total, e);
  }
  const __m512 inv_total = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
  for (int64_t t0 = 0; t0 < span; t0 += 16) {
    const __mmask16 mask = span - t0 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (span - t0)) - 1u);
    _mm512_mask_storeu_ps(s + t0, mask, _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, s + t0), inv_total));
  }
}

__attribute__((target("avx512f,fma"))) void attend_row_avx512(const Attention& a, int64_t i, float* scratch) {
  const int64_t D = a.head_dim, group = a.heads / a.kv_heads, span = a.positions[i] + 1;
  float* tmp = scratch;
  float* q = scratch + D;
  float* scores = scratch + D + group * D;
  for (int64_t h = 0; h < a.kv_heads; ++h) {
    prepare_head(a, i, h, q, tmp);
    const float* keys = a.keys + (i * a.kv_heads + h) * a.max_len * D;
    const float* values = a.values + (i * a.kv_heads + h) * a.max_len * D;
    const NextHead next = next_head(a, i, h);
    for (int64_t t = 0; t < span; ++t) {
      prefetch_position(keys, values, span, next, t, D);
      for (int64_t j = 0; j < group; ++j) {
        const float *qj = q + j * D, *k = keys + t * D;
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qj), _mm512_loadu_ps(k));
        for (int64_t d = 16; d < D; d += 16)
          acc = _mm512_fmadd_ps(_mm512_loadu_ps(qj + d), _mm512_loadu_ps(k + d), acc);
        scores[j * a.max_len + t] = _mm512_reduce_add_ps(acc);
      }
    }
    for (int64_t j = 0; j < group; ++j) {
      const float* w = scores + j * a.max_len;
      softmax_avx512(scores + j * a.max_len, span);
      float* out = a.out + (i * a.heads + h * group + j) * D;
      for (int64_t d0 = 0; d0 < D; d0 += 64) {
        const int blocks = static_cast<int>((D - d0) / 16 < 4 ? (D - d0) / 16 : 4);
        __m512 even[4], odd[4];
        for (int c = 0; c < 4; ++c) even[c] = _mm512_setzero_ps(), odd[c] = _mm512_setzero_ps();
        int64_t t = 0;
        for (; t + 2 <= span; t += 2) {
          const __m512 w0 = _mm512_set1_ps(w[t]), w1 = _mm512_set1_ps(w[t + 1]);
          for (int c = 0; c < blocks; ++c) {
            even[c] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(values + t * D + d0 + 16 * c), even[c]);
            odd[c] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(values + (t + 1) * D + d0 + 16 * c), odd[c]);
          }
        }
        if (t < span) {
          const __m512 w0 = _mm512_set1_ps(w[t]);
          for (int c = 0; c < blocks; ++c)
            even[c] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(values + t * D + d0 + 16 * c), even[c]);
        }
        for (int c = 0; c < blocks; ++c) _mm512_storeu_ps(out + d0 + 16 * c, _mm512_add_ps(even[c], odd[c]));
      }
    }
  }
}

__attribute__((target("avx2,fma"))) inline float reduce_add256(__m256 v) {
  const __m128 sum4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 sum2 = _mm_add_ps(sum4, _mm_movehl_ps(sum4, sum4));
  return _mm_cvtss_f32(_mm_add_ss(sum2, _mm_movehdup_ps(sum2)));
}

// exp_nonpositive on 8 lanes (AVX2): the scalar function's operations in its order, lane by lane.
__attribute__((target("avx2"))) inline __m256 exp_nonpositive8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 magic = _mm256_set1_ps(12582912.0f);
  const __m256 n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), magic), magic);
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(y, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

// softmax_in_place with 8 lanes for whole groups of 8 positions, the tail (< 8) scalar.
__attribute__((target("avx2,fma"))) void softmax_avx2(float* s, int64_t span) {
  const int64_t whole = span / 8 * 8;
  __m256 top8 = _mm256_set1_ps(s[0]);
  for (int64_t t0 = 0; t0 < whole; t0 += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(s + t0));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top8);
  float top = lanes[0];
  for (int l = 1; l < 8; ++l) top = __builtin_fmaxf(top, lanes[l]);
  for (int64_t t = whole; t < span; ++t) top = __builtin_fmaxf(top, s[t]);
  const __m256 peak = _mm256_set1_ps(top);
  __m256 total8 = _mm256_setzero_ps();
  for (int64_t t0 = 0; t0 < whole; t0 += 8) {
    const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(s + t0), peak));
    _mm256_storeu_ps(s + t0, e);
    total8 = _mm256_add_ps(total8, e);
  }
  float total = reduce_add256(total8);
  for (int64_t t = whole; t < span; ++t) total += (s[t] = exp_nonpositive(s[t] - top));
  const float inv_total = 1.0f / total;
  for (int64_t t = 0; t < span; ++t) s[t] = s[t] * inv_total;
}

__attribute__((target("avx2,fma"))) void attend_row_avx2(const Attention& a, int64_t i, float* scratch) {
  const int64_t D = a.head_dim, group = a.heads / a.kv_heads, span = a.positions[i] + 1;
  float* tmp = scratch;
  float* q = scratch + D;
  float* scores = scratch + D + group * D;
  for (int64_t h = 0; h < a.kv_heads; ++h) {
    prepare_head(a, i, h, q, tmp);
    const float* keys = a.keys + (i * a.kv_heads + h) * a.max_len * D;
    const float* values = a.values + (i * a.kv_heads + h) * a.max_len * D;
    const NextHead next = next_head(a, i, h);
    for (int64_t t = 0; t < span; ++t) {
      prefetch_position(keys, values, span, next, t, D);
      for (int64_t j = 0; j < group; ++j) {
        const float *qj = q + j * D, *k = keys + t * D;
        __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(qj), _mm256_loadu_ps(k));
        for (int64_t d = 8; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qj + d), _mm256_loadu_ps(k + d), acc);
        scores[j * a.max_len + t] = reduce_add256(acc);
      }
    }
    for (int64_t j = 0; j < group; ++j) {
      const float* w = scores + j * a.max_len;
      softmax_avx2(scores + j * a.max_len, span);
      float* out = a.out + (i * a.heads + h * group + j) * D;
      for (int64_t d0 = 0; d0 < D; d0 += 32) {  // 16 registers: 4 column blocks x 2 partial sums, 2 weights
        const int blocks = static_cast<int>((D - d0) / 8 < 4 ? (D - d0) / 8 : 4);
        __m256 even[4], odd[4];
        for (int c = 0; c < 4; ++c) even[c] = _mm256_setzero_ps(), odd[c] = _mm256_setzero_ps();
        int64_t t = 0;
        for (; t + 2 <= span; t += 2) {
          const __m256 w0 = _mm256_set1_ps(w[t]), w1 = _mm256_set1_ps(w[t + 1]);
          for (int c = 0; c < blocks; ++c) {
            even[c] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(values + t * D + d0 + 8 * c), even[c]);
            odd[c] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(values + (t + 1) * D + d0 + 8 * c), odd[c]);
          }
        }
        if (t < span) {
          const __m256 w0 = _mm256_set1_ps(w[t]);
          for (int c = 0; c < blocks; ++c)
            even[c] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(values + t * D + d0 + 8 * c), even[c]);
        }
        for (int c = 0; c < blocks; ++c) _mm256_storeu_ps(out + d0 + 8 * c, _mm256_add_ps(even[c], odd[c]));
      }
    }
  }
}
#endif

FD_CLONES void norm_rows(const float* x, int64_t rows, int64_t dim, const float* weight, float eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) norm_into(x + r * dim, weight, eps, out + r * dim, dim);
}

FD_CLONES void add_norm_rows(float* x, const float* delta, int64_t rows, int64_t dim, const float* weight, float eps,
                             float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    float* xr = x + r * dim;
    const float* dr = delta + r * dim;
    for (int64_t d = 0; d < dim; ++d) xr[d] = xr[d] + dr[d];
    norm_into(xr, weight, eps, out + r * dim, dim);
  }
}

// ---- batch-invariant fp32 linear on a transposed weight: out (rows, N) = x (rows, K) @ wt (K, ldw) [+ bias].
// Every output is one fused multiply-add chain over k = 0..K-1 in order, whatever the rows, the block it falls in
// or the ISA (AVX-512, AVX2 and the scalar loop give the same bits): a sequence's logits do not depend on its batch.
struct LinearT {
  const float* x;
  int64_t rows, K;
  const float* wt;
  int64_t ldw, N;
  const float* bias;
  float* out;
};

#if defined(__x86_64__)
template <int MB, int NB>
__attribute__((target("avx512f,fma"))) void lin_block512(const LinearT& p, int64_t m0, int64_t n0) {
  __m512 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < p.K; ++k) {
    __m512 w[NB];
    for (int j = 0; j < NB; ++j) w[j] = _mm512_loadu_ps(p.wt + k * p.ldw + n0 + 16 * j);
    for (int m = 0; m < MB; ++m) {
      const __m512 xb = _mm512_set1_ps(p.x[(m0 + m) * p.K + k]);
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_fmadd_ps(xb, w[j], acc[m][j]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) {
      const int64_t n = n0 + 16 * j, valid = p.N - n < 16 ? p.N - n : 16;
      if (valid <= 0) continue;
      __m512 v = acc[m][j];
      if (p.bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << valid) - 1u), p.bias + n));
      _mm512_mask_storeu_ps(p.out + (m0 + m) * p.N + n, static_cast<__mmask16>((1u << valid) - 1u), v);
    }
}

template <int MB, int NB>
__attribute__((target("avx2,fma"))) void lin_block256(const LinearT& p, int64_t m0, int64_t n0) {
  __m256 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < p.K; ++k) {
    __m256 w[NB];
    for (int j = 0; j < NB; ++j) w[j] = _mm256_loadu_ps(p.wt + k * p.ldw + n0 + 8 * j);
    for (int m = 0; m < MB; ++m) {
      const __m256 xb = _mm256_set1_ps(p.x[(m0 + m) * p.K + k]);
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm256_fmadd_ps(xb, w[j], acc[m][j]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) {
      alignas(32) float lane[8];
      _mm256_store_ps(lane, acc[m][j]);
      for (int l = 0; l < 8 && n0 + 8 * j + l < p.N; ++l) {
        const int64_t n = n0 + 8 * j + l;
        p.out[(m0 + m) * p.N + n] = p.bias ? lane[l] + p.bias[n] : lane[l];
      }
    }
}
#endif

void lin_reference(const LinearT& p, int64_t m0, int64_t rows, int64_t n0, int64_t cols) {
  for (int64_t m = m0; m < m0 + rows; ++m)
    for (int64_t n = n0; n < n0 + cols && n < p.N; ++n) {
      float acc = 0.0f;
      for (int64_t k = 0; k < p.K; ++k) acc = std::fma(p.x[m * p.K + k], p.wt[k * p.ldw + n], acc);
      p.out[m * p.N + n] = p.bias ? acc + p.bias[n] : acc;
    }
}

// Columns n0..n0+63 for every row of x, in blocks of 4 rows (then single rows).
void lin_columns(const LinearT& p, int isa, int64_t n0) {
  int64_t m = 0;
#if defined(__x86_64__)
  if (isa == 2) {
    for (; m + 4 <= p.rows; m += 4) lin_block512<4, 4>(p, m, n0);
    for (; m < p.rows; ++m) lin_block512<1, 4>(p, m, n0);
    return;
  }
  if (isa == 1) {  // 16 registers: 4 rows x 16 columns at a time
    for (int64_t sub = n0; sub < n0 + 64 && sub < p.N; sub += 16) {
      int64_t r = 0;
      for (; r + 4 <= p.rows; r += 4) lin_block256<4, 2>(p, r, sub);
      for (; r < p.rows; ++r) lin_block256<1, 2>(p, r, sub);
    }
    return;
  }
#endif
  lin_reference(p, 0, p.rows, n0, 64);
}

// out[r, j] = silu(gu[r, j]) * gu[r, I + j] for j < I (gu rows: gate_proj's I outputs, then up_proj's): silu(x) =
// x / (1 + exp(-x)) for x >= 0 and x * e / (1 + e), e = exp(x), below (torch's formula where exp(-x) cannot
// overflow, the same value to rounding where it could), each operation rounded.
FD_CLONES void silu_mul_rows(const float* gu, int64_t rows, int64_t inter, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = gu + r * 2 * inter;
    const float* up = gate + inter;
    float* o = out + r * inter;
    for (int64_t j = 0; j < inter; ++j) {
      const float x = gate[j];
      const float e = exp_nonpositive(x >= 0.0f ? -x : x);
      const float silu = x >= 0.0f ? x / (1.0f + e) : (x * e) / (1.0f + e);
      o[j] = silu * up[j];
    }
  }
}

// Every row of `a` (see fd_decode_attention), over `threads` OpenMP threads with their own slices of `scratch`.
void attend_rows(const Attention& a, float* scratch, int threads, int isa) {
  const int64_t per_thread = scratch_floats(a.heads, a.kv_heads, a.head_dim, a.max_len), n = a.rows;
  const bool parallel = threads > 1 && n > 1;
#pragma omp parallel for schedule(static) num_threads(threads > 1 ? threads : 1) if (parallel)
  for (int64_t i = 0; i < n; ++i) {
    int worker = 0;
#ifdef _OPENMP
    worker = omp_get_thread_num();
#endif
    float* mine = scratch + worker * per_thread;
#if defined(__x86_64__)
    if (isa >= 2 && a.head_dim % 16 == 0) {
      attend_row_avx512(a, i, mine);
      continue;
    }
    if (isa >= 1 && a.head_dim % 8 == 0) {
      attend_row_avx2(a, i, mine);
      continue;
    }
#endif
    attend_row(a, i, mine);
  }
}

// One int8 linear of fd_decode_layers, as int8_gemm.cpp's i8_linear takes it (packed by
// rollout_workers/embedded/int8_linear.py for the kernel `isa`); bias may be null.
struct FdInt8Linear {
  const int8_t* packed;
  int64_t out_features, in_features, padded_in;
  const float *scale, *bias;
};

// A LoRA adapter on one linear of fd_decode_layers, as lora_gemm.cpp's lr_apply (a_scale null: fp32 matrices) or
// lr_apply_q8 (int8 matrices with per-rank scales) takes it (packed by rollout_workers/embedded/low_rank.py).
struct FdLora {
  const void* a;
  const float* a_scale;
  int64_t rank, members;
  const int64_t *ranks, *cols;
  const void* const* bs;
  const float* const* b_scales;
  const float* scalings;
};

// One decoder layer of fd_decode_layers (q_norm and k_norm: Qwen3's, or null; an adapter: null for none).
struct FdLayer {
  FdInt8Linear qkv, o_proj, gate_up, down;
  const float *input_norm, *post_norm, *q_norm, *k_norm;
  const FdLora *qkv_lora, *o_lora, *gate_up_lora, *down_lora;
};

// int8_gemm.cpp's i8_linear (see there)
using I8LinearFn = int (*)(int isa, const float* x, int64_t rows, int64_t k, int64_t x_stride, const int8_t* packed,
                           int64_t n, int64_t kp, const float* sw, const float* bias, float* out, int64_t out_stride,
                           int threads);

// lora_gemm.cpp's lr_apply and lr_apply_q8 (see there)
using LrApplyFn = int (*)(const float* x, int64_t rows, int64_t k, int64_t xs, const float* a, int64_t r, float* low,
                          int64_t n_members, const int64_t* ranks, const int64_t* cols, const float* const* bps,
                          const float* scalings, float* out, int64_t os, int threads);
using LrApplyQ8Fn = int (*)(const float* x, int64_t rows, int64_t k, int64_t xs, const int8_t* qa, const float* sa,
                            int64_t r, float* low, int64_t n_members, const int64_t* ranks, const int64_t* cols,
                            const int8_t* const* qbs, const float* const* sbs, const float* scalings, float* out,
                            int64_t os, int threads);

// The linears' kernels: int8_gemm.cpp's i8_linear, and lora_gemm.cpp's two adapter products (null where no adapter
// comes), with the adapters' (rows, rank) scratch.
struct Kernels {
  I8LinearFn i8_linear;
  int i8_isa, threads;
  LrApplyFn lr_apply;
  LrApplyQ8Fn lr_apply_q8;
  float* low;
};

// out = x W^T (+ bias) (+ s * B (A x) where `lora` is not null); 0 or the failing kernel's status.
int linear_with_adapter(const Kernels& kern, const FdInt8Linear& w, const FdLora* lora, const float* x, int64_t rows,
                        float* out) {
  const int status = kern.i8_linear(kern.i8_isa, x, rows, w.in_features, w.in_features, w.packed, w.out_features,
                                    w.padded_in, w.scale, w.bias, out, w.out_features, kern.threads);
  if (status != 0 || lora == nullptr) return status;
  const int64_t k = w.in_features, n = w.out_features;
  if (lora->a_scale != nullptr)
    return kern.lr_apply_q8(x, rows, k, k, static_cast<const int8_t*>(lora->a), lora->a_scale, lora->rank, kern.low,
                            lora->members, lora->ranks, lora->cols, reinterpret_cast<const int8_t* const*>(lora->bs),
                            lora->b_scales, lora->scalings, out, n, kern.threads);
  return kern.lr_apply(x, rows, k, k, static_cast<const float*>(lora->a), lora->rank, kern.low, lora->members,
                       lora->ranks, lora->cols, reinterpret_cast<const float* const*>(lora->bs), lora->scalings, out, n,
                       kern.threads);
}

}  // namespace

extern "C" {

int fd_abi_version(void) { return 4; }

// Which path fd_linear_t runs here: 2 AVX-512, 1 AVX2 + FMA, 0 the scalar loop (all give the same bits).
int fd_linear_isa(void) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma")) return 2;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
#endif
  return 0;
}

// out (rows, N) = x (rows, K) @ wt (K, ldw)[:, :N] (+ bias): wt is the weight transposed, ldw >= N a multiple of
// 64 (columns beyond N are zeros). Batch-invariant (see LinearT). `isa` from fd_linear_isa (or lower).
void fd_linear_t(int isa, const float* x, int64_t rows, int64_t K, const float* wt, int64_t ldw, int64_t N,
                 const float* bias, float* out, int threads) {
  const LinearT p{x, rows, K, wt, ldw, N, bias, out};
  const int64_t blocks = (N + 63) / 64;
  const bool parallel = threads > 1 && rows * N * K >= (int64_t{1} << 18);
#pragma omp parallel for schedule(static) num_threads(threads > 1 ? threads : 1) if (parallel)
  for (int64_t b = 0; b < blocks; ++b) lin_columns(p, isa, b * 64);
}

// Floats of scratch one thread of fd_decode_attention needs.
int64_t fd_scratch_floats(int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t max_len) {
  return scratch_floats(heads, kv_heads, head_dim, max_len);
}

// out[r] = weight * (x[r] * rsqrt(mean(x[r]^2) + eps)), r < rows; out may be x.
void fd_rms_norm(const float* x, int64_t rows, int64_t dim, const float* weight, float eps, float* out) {
  norm_rows(x, rows, dim, weight, eps, out);
}

// x[r] += delta[r] (the residual stream, in place), then out[r] = rms_norm(x[r]).
void fd_add_rms_norm(float* x, const float* delta, int64_t rows, int64_t dim, const float* weight, float eps,
                     float* out) {
  add_norm_rows(x, delta, rows, dim, weight, eps, out);
}

// Decode attention for rows i < n, row i living in cache slot i at position positions[i] (< max_len):
// qkv row i = [q heads | k heads | v heads] (each head_dim wide; qkv_stride floats apart); q_norm / k_norm
// (head_dim, or null) are Qwen3's per-head RMSNorms; cos / sin_rotate (max_len, head_dim) the RoPE tables; keys /
// values one layer of the cache, (slots, kv_heads, max_len, head_dim); out (n, heads * head_dim).
// `scratch` holds threads x fd_scratch_floats(...) floats. `isa` (fd_linear_isa or lower) picks the AVX-512 (2) or
// AVX2 (1) form where head_dim is a multiple of its vector width, else the portable one.
// Returns 0, or -1 for a position out of range.
int fd_decode_attention(const float* qkv, int64_t qkv_stride, int64_t n, int64_t heads, int64_t kv_heads,
                        int64_t head_dim, const int64_t* positions, const float* cos, const float* sin_rotate,
                        const float* q_norm, const float* k_norm, float norm_eps, float* keys, float* values,
                        int64_t max_len, float* out, float* scratch, int threads, int isa) {
  for (int64_t i = 0; i < n; ++i)
    if (positions[i] < 0 || positions[i] >= max_len) return -1;
  if (heads % kv_heads != 0) return -1;
  const Attention a{qkv, qkv_stride, heads, kv_heads, head_dim, positions, cos, sin_rotate, q_norm, k_norm,
                    norm_eps, keys, values, max_len, out, n};
  attend_rows(a, scratch, threads, isa);
  return 0;
}

// Floats of fd_decode_layers' `work` for n rows.
int64_t fd_decode_layers_work_floats(int64_t n, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                     int64_t intermediate) {
  return n * ((heads + 2 * kv_heads) * head_dim + heads * head_dim + hidden + 3 * intermediate);
}

// The decoder layers of one decode step on int8 weights, every op of the step between the embedding and the LM head
// in one call: rows i < n (cache slot i, position positions[i]) of the residual stream x (n, hidden; updated in
// place) through each layer as rollout_workers/embedded/model.py runs it (RMSNorm, the qkv linear, decode
// attention, o_proj, the residual add with the post-attention RMSNorm, gate_up, SiLU x up, down, the residual add
// with the next layer's RMSNorm or `final_norm`), and h (n, hidden) = final_norm(x). Linears: `i8_linear` (the
// address of int8_gemm.cpp's) with `i8_isa`; attention as fd_decode_attention with `attn_isa`, on layer l of the
// cache keys / values (layers, slots, kv_heads, max_len, head_dim). `work`: fd_decode_layers_work_floats floats;
// `attn_scratch`: threads x fd_scratch_floats (`threads` run the attention's rows, `linear_threads` each linear's
// columns). A layer's LoRA adapters run after their linears on `lr_apply` / `lr_apply_q8` (lora_gemm.cpp's, by
// address; null where none comes) with `low`, n x the largest rank floats. Returns 0, -1 for a position out of range or heads not a multiple
// of kv_heads, or a linear's nonzero status.
int fd_decode_layers(void* i8_linear, int i8_isa, const FdLayer* layers, int64_t num_layers, const float* final_norm,
                     float* x, float* h, int64_t n, int64_t hidden, int64_t heads, int64_t kv_heads,
                     int64_t head_dim, int64_t intermediate, const int64_t* positions, const float* cos,
                     const float* sin_rotate, float eps, float* keys, float* values, int64_t slots, int64_t max_len,
                     float* work, float* attn_scratch, int threads, int attn_isa, int linear_threads,
                     void* lr_apply, void* lr_apply_q8, float* low) {
  for (int64_t i = 0; i < n; ++i)
    if (positions[i] < 0 || positions[i] >= max_len) return -1;
  if (kv_heads < 1 || heads % kv_heads != 0) return -1;
  const Kernels kern{reinterpret_cast<I8LinearFn>(i8_linear), i8_isa, linear_threads,
                     reinterpret_cast<LrApplyFn>(lr_apply), reinterpret_cast<LrApplyQ8Fn>(lr_apply_q8), low};
  const int64_t qkv_width = (heads + 2 * kv_heads) * head_dim, layer_floats = slots * kv_heads * max_len * head_dim;
  float* qkv = work;
  float* attn = qkv + n * qkv_width;
  float* delta = attn + n * heads * head_dim;
  float* gu = delta + n * hidden;
  float* act = gu + n * 2 * intermediate;
  norm_rows(x, n, hidden, layers[0].input_norm, eps, h);
  for (int64_t l = 0; l < num_layers; ++l) {
    const FdLayer& layer = layers[l];
    const float* next_norm = l + 1 < num_layers ? layers[l + 1].input_norm : final_norm;
    int status = linear_with_adapter(kern, layer.qkv, layer.qkv_lora, h, n, qkv);
    if (status != 0) return status;
    const Attention a{qkv, qkv_width, heads, kv_heads, head_dim, positions, cos, sin_rotate, layer.q_norm,
                      layer.k_norm, eps, keys + l * layer_floats, values + l * layer_floats, max_len, attn, n};
    attend_rows(a, attn_scratch, threads, attn_isa);
    if ((status = linear_with_adapter(kern, layer.o_proj, layer.o_lora, attn, n, delta)) != 0) return status;
    add_norm_rows(x, delta, n, hidden, layer.post_norm, eps, h);
    if ((status = linear_with_adapter(kern, layer.gate_up, layer.gate_up_lora, h, n, gu)) != 0) return status;
    silu_mul_rows(gu, n, intermediate, act);
    if ((status = linear_with_adapter(kern, layer.down, layer.down_lora, act, n, delta)) != 0) return status;
    add_norm_rows(x, delta, n, hidden, next_norm, eps, h);
  }
  return 0;
}

}  // extern "C"
