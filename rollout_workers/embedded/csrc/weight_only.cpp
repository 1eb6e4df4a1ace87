// Fused dequantize-and-multiply for the weight-only schemes (w8a16, w4a16): out = x @ dequant(W)^T (+ bias).
//
// Built once per machine by rollout_workers/embedded/weight_only.py with the system C++ compiler (no torch
// headers: a few seconds) and called through ctypes. Plain C ABI; every pointer is to contiguous memory.
//
// Weights (N rows of K inputs), quantized per row and group of `group` input columns (quant_sync's
// quantize_weight_only), each row padded with zero weights to a multiple of 64 inputs (`kp`):
//   bits 8: int8 row-major, row stride kp bytes;
//   bits 4: kp / 2 bytes a row; each block of 64 inputs is 32 bytes, byte j holding input j in its low nibble
//           and input j + 32 in its high nibble, as (q + 8) in 0..15;
//   bits 32: fp32 rows (kp * 4 bytes), scale 1 in one group: the engine's batch-invariant fp32 linear (below).
// scale: (N, groups) float32, groups = ceil(K / group), group a multiple of 64.
//
// Numerics: out[m, r] = sum over groups g of s[r, g] * (sum over the group's inputs k of x[m, k] * q[r, k]), all in
// fp32 (each q converted exactly). The reference `x @ dequant(W)^T` sums x * fl(q * s) instead: the two agree to
// fp32 rounding (~1e-7 relative per term); the group form saves one multiply per weight, which is what bounds
// these kernels at one row (measured on Zen 4: 15-20% faster than multiplying each weight by its scale).
// Paths: avx512 (AVX512F/BW/VL/DQ), avx2 (AVX2 + FMA), reference (portable scalar C++, the same formula), chosen by
// the caller; wo_has_isa says what the CPU runs. Rows of x are processed in blocks of up to 4 against each block of
// 4 weight rows, so the weights stream from memory once per call whatever the batch.
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define WO_X86 1
#endif

#define WO_ISA_REFERENCE 0
#define WO_ISA_AVX2 1
#define WO_ISA_AVX512 2

namespace {

constexpr int kRowBlock = 4;  // weight rows per block

inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

struct Problem {
  const float* x;
  int64_t rows, in_features, x_stride;
  const uint8_t* w;
  int64_t w_stride;  // bytes per weight row
  const float* scale;
  int64_t groups, group;
  const float* bias;
  float* out;
  int64_t out_features, out_stride;
};

// ---------------------------------------------------------------- portable reference
inline float weight_at(int bits, const uint8_t* row, int64_t k) {
  if (bits == 32) return reinterpret_cast<const float*>(row)[k];
  if (bits == 8) return static_cast<int8_t>(row[k]);
  const uint8_t byte = row[(k >> 6) * 32 + (k & 31)];
  return ((k & 63) < 32 ? (byte & 15) : (byte >> 4)) - 8;
}

void reference_rows(const Problem& p, int bits, int64_t r_begin, int64_t r_end) {
  for (int64_t r = r_begin; r < r_end; ++r) {
    const uint8_t* row = p.w + r * p.w_stride;
    for (int64_t m = 0; m < p.rows; ++m) {
      const float* xm = p.x + m * p.x_stride;
      float acc = 0.0f;
      for (int64_t g = 0; g < p.groups; ++g) {
        float group_sum = 0.0f;
        const int64_t end = min64((g + 1) * p.group, p.in_features);
        for (int64_t k = g * p.group; k < end; ++k) group_sum += xm[k] * weight_at(bits, row, k);
        acc += group_sum * p.scale[r * p.groups + g];
      }
      p.out[m * p.out_stride + r] = acc + (p.bias ? p.bias[r] : 0.0f);
    }
  }
}

#ifdef WO_X86
// How far ahead of the current block each weight row is prefetched, into L2. Measured on Zen 4 at one row, weights
// streaming from DRAM: without it the kernel's compute and its memory reads hardly overlap (0.7 ms for a 1024 x 5632
// int8 matrix); into L1 at 4 KiB ahead 0.65 ms; into L2 at 8-16 KiB ahead 0.32 ms (fp32 `F.linear`: 1.5 ms).
#ifndef WO_PREFETCH_BYTES
#define WO_PREFETCH_BYTES 8192
#endif

// Each ISA's kernel computes a block of R weight rows against MB rows of x, 64 inputs (one weight block) at a
// time; FULL blocks lie wholly inside in_features, the last one (if in_features % 64) loads x under a mask. Weight
// loads always read whole blocks: packed rows are padded with zero weights to a multiple of 64 inputs.
struct Block {
  const uint8_t* w[kRowBlock];  // the block's weight rows, at input 0
  const float* x[4];            // the MB rows of x
};

// ---------------------------------------------------------------- AVX-512 (F, BW, VL, DQ)
#define WO_T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))

WO_T512 inline __m512 x512(const float* ptr, int64_t valid) {
  if (valid >= 16) return _mm512_loadu_ps(ptr);
  if (valid <= 0) return _mm512_setzero_ps();
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << valid) - 1u), ptr);
}

WO_T512 inline __m512 bytes_to_ps512(__m128i bytes) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)); }

// Chunk c (16 inputs) of a 64-input block as int8: read from the row (bits 8) or taken from its unpacked nibbles.
template <int BITS>
WO_T512 inline __m128i chunk512(const uint8_t* row, int64_t k, const __m256i nibbles[2], int c) {
  if constexpr (BITS == 8) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k + 16 * c));
  return (c & 1) ? _mm256_extracti128_si256(nibbles[c / 2], 1) : _mm256_castsi256_si128(nibbles[c / 2]);
}

// One 64-input block: every (weight row, x row) pair's group sum gains its 64 products. Chunk by chunk, so that
// each x chunk is loaded once for all R weight rows and each converted weight chunk used for all MB x rows.
template <int BITS, int R, int MB, bool FULL>
WO_T512 inline void step512(const Block& b, int64_t k, int64_t K, __m512 acc[R][MB]) {
  __m256i nibbles[R][2];  // bits 4: inputs k + 0..31 (low nibbles) and k + 32..63 (high), as int8
  for (int r = 0; r < R; ++r) {
    _mm_prefetch(reinterpret_cast<const char*>(b.w[r] + k * BITS / 8 + WO_PREFETCH_BYTES), _MM_HINT_T1);
    if constexpr (BITS == 4) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.w[r] + k / 2));
      const __m256i low4 = _mm256_set1_epi8(0x0F), eight = _mm256_set1_epi8(8);
      nibbles[r][0] = _mm256_sub_epi8(_mm256_and_si256(v, low4), eight);
      nibbles[r][1] = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), eight);
    }
  }
  for (int c = 0; c < 4; ++c) {
    __m512 xv[MB];
    for (int m = 0; m < MB; ++m)
      xv[m] = FULL ? _mm512_loadu_ps(b.x[m] + k + 16 * c) : x512(b.x[m] + k + 16 * c, K - k - 16 * c);
    for (int r = 0; r < R; ++r) {
      __m512 wv;
      if constexpr (BITS == 32) wv = _mm512_loadu_ps(reinterpret_cast<const float*>(b.w[r]) + k + 16 * c);
      else wv = bytes_to_ps512(chunk512<BITS>(b.w[r], k, nibbles[r], c));
      for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_fmadd_ps(xv[m], wv, acc[r][m]);
    }
  }
}

template <int BITS, int R, int MB>
WO_T512 void block512(const Problem& p, const Block& b0, int64_t r0, float* out_rows[4]) {
  Block b = b0;
  const int64_t K = p.in_features, groups = p.groups, group = p.group, full_end = K & ~int64_t{63};
  __m512 acc[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm512_set1_ps(p.scale[(r0 + r) * groups + g]);
    const int64_t begin = g * group, end = min64(begin + group, K), full = min64(end, full_end);
    int64_t k = begin;
    if constexpr (BITS == 32) {  // fp32: one group of scale 1 (0 + sum * 1 = sum): sum straight into acc
      for (; k < full; k += 64) step512<BITS, R, MB, true>(b, k, K, acc);
      if (k < end) step512<BITS, R, MB, false>(b, k, K, acc);
      continue;
    }
    __m512 gacc[R][MB];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) gacc[r][m] = _mm512_setzero_ps();
    for (; k < full; k += 64) step512<BITS, R, MB, true>(b, k, K, gacc);
    if (k < end) step512<BITS, R, MB, false>(b, k, K, gacc);
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_fmadd_ps(gacc[r][m], s[r], acc[r][m]);
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m)
      out_rows[m][r0 + r] = _mm512_reduce_add_ps(acc[r][m]) + (p.bias ? p.bias[r0 + r] : 0.0f);
}

// ---------------------------------------------------------------- AVX2 + FMA
#define WO_T256 __attribute__((target("avx2,fma")))

WO_T256 inline __m256 x256(const float* ptr, int64_t valid) {
  if (valid >= 8) return _mm256_loadu_ps(ptr);
  if (valid <= 0) return _mm256_setzero_ps();
  const __m256i ramp = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_maskload_ps(ptr, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(valid)), ramp));
}

WO_T256 inline __m256 bytes_to_ps256(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)); }

WO_T256 inline float hsum256(__m256 v) {
  const __m128 sum4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 sum2 = _mm_add_ps(sum4, _mm_movehl_ps(sum4, sum4));
  return _mm_cvtss_f32(_mm_add_ss(sum2, _mm_movehdup_ps(sum2)));
}

// The 64 weights of row `row` at input k as 4 x 16 int8 (in input order; each converted 8 at a time).
template <int BITS>
WO_T256 inline void unpack64_256(const uint8_t* row, int64_t k, __m128i out[4]) {
  if constexpr (BITS == 8) {
    for (int c = 0; c < 4; ++c) out[c] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k + 16 * c));
    return;
  }
  const __m128i v0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k / 2));
  const __m128i v1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k / 2 + 16));
  const __m128i low4 = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
  out[0] = _mm_sub_epi8(_mm_and_si128(v0, low4), eight);
  out[1] = _mm_sub_epi8(_mm_and_si128(v1, low4), eight);
  out[2] = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(v0, 4), low4), eight);
  out[3] = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(v1, 4), low4), eight);
}

template <int BITS, int R, int MB, bool FULL>
WO_T256 inline void step256(const Block& b, int64_t k, int64_t K, __m256 acc[R][MB]) {
  for (int r = 0; r < R; ++r) {
    _mm_prefetch(reinterpret_cast<const char*>(b.w[r] + k * BITS / 8 + WO_PREFETCH_BYTES), _MM_HINT_T1);
    __m128i q[4];
    if constexpr (BITS != 32) unpack64_256<BITS>(b.w[r], k, q);
    for (int c = 0; c < 8; ++c) {
      __m256 wv;
      if constexpr (BITS == 32) wv = _mm256_loadu_ps(reinterpret_cast<const float*>(b.w[r]) + k + 8 * c);
      else wv = bytes_to_ps256((c & 1) ? _mm_srli_si128(q[c / 2], 8) : q[c / 2]);
      for (int m = 0; m < MB; ++m) {
        const __m256 xv = FULL ? _mm256_loadu_ps(b.x[m] + k + 8 * c) : x256(b.x[m] + k + 8 * c, K - k - 8 * c);
        acc[r][m] = _mm256_fmadd_ps(xv, wv, acc[r][m]);
      }
    }
  }
}

template <int BITS, int R, int MB>
WO_T256 void block256(const Problem& p, const Block& b0, int64_t r0, float* out_rows[4]) {
  Block b = b0;
  const int64_t K = p.in_features, groups = p.groups, group = p.group, full_end = K & ~int64_t{63};
  __m256 acc[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256 s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm256_set1_ps(p.scale[(r0 + r) * groups + g]);
    const int64_t begin = g * group, end = min64(begin + group, K), full = min64(end, full_end);
    int64_t k = begin;
    if constexpr (BITS == 32) {  // fp32: one group of scale 1 (0 + sum * 1 = sum): sum straight into acc
      for (; k < full; k += 64) step256<BITS, R, MB, true>(b, k, K, acc);
      if (k < end) step256<BITS, R, MB, false>(b, k, K, acc);
      continue;
    }
    __m256 gacc[R][MB];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) gacc[r][m] = _mm256_setzero_ps();
    for (; k < full; k += 64) step256<BITS, R, MB, true>(b, k, K, gacc);
    if (k < end) step256<BITS, R, MB, false>(b, k, K, gacc);
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_fmadd_ps(gacc[r][m], s[r], acc[r][m]);
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) out_rows[m][r0 + r] = hsum256(acc[r][m]) + (p.bias ? p.bias[r0 + r] : 0.0f);
}

// ---------------------------------------------------------------- dispatch over row blocks and rows of x
// Runs the rows of x in blocks of up to MB_MAX (2 or 4) against R weight rows, all from the same weight block
// while it is in L1: the weights stream from memory once per call.
template <int ISA, int BITS, int R>
inline void run_rows(const Problem& p, int64_t r0) {
  Block b{};
  for (int r = 0; r < R; ++r) b.w[r] = p.w + (r0 + r) * p.w_stride;
  constexpr int kMbMax = ISA == WO_ISA_AVX512 ? 4 : 2;
  int64_t m = 0;
  while (m < p.rows) {
    const int mb = static_cast<int>(min64(p.rows - m, kMbMax));
    float* out_rows[4];
    for (int i = 0; i < mb; ++i) {
      b.x[i] = p.x + (m + i) * p.x_stride;
      out_rows[i] = p.out + (m + i) * p.out_stride;
    }
    if (ISA == WO_ISA_AVX512) {
      if (mb == 4) block512<BITS, R, kMbMax>(p, b, r0, out_rows);
      else if (mb >= 2) block512<BITS, R, 2>(p, b, r0, out_rows);
      else block512<BITS, R, 1>(p, b, r0, out_rows);
    } else {
      if (mb >= 2) block256<BITS, R, 2>(p, b, r0, out_rows);
      else block256<BITS, R, 1>(p, b, r0, out_rows);
    }
    m += mb >= 4 ? 4 : (mb >= 2 ? 2 : 1);
  }
}

template <int ISA, int BITS>
void isa_rows(const Problem& p, int64_t r_begin, int64_t r_end) {
  int64_t r = r_begin;
  for (; r + kRowBlock <= r_end; r += kRowBlock) run_rows<ISA, BITS, kRowBlock>(p, r);
  for (; r < r_end; ++r) run_rows<ISA, BITS, 1>(p, r);
}
#endif  // WO_X86

}  // namespace

extern "C" {

int wo_abi_version(void) { return 1; }

// Whether this CPU runs the path `isa` (WO_ISA_*): the reference always, the others by cpuid.
int wo_has_isa(int isa) {
  if (isa == WO_ISA_REFERENCE) return 1;
#ifdef WO_X86
  __builtin_cpu_init();
  if (isa == WO_ISA_AVX2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == WO_ISA_AVX512)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma");
#endif
  return 0;
}

// out[m, r] = sum_g scale[r, g] * sum_{k in group g} x[m, k] * q[r, k] (+ bias[r]), m < rows, r < out_features.
// Runs on up to `threads` OpenMP threads (torch's, when loaded into a torch process: the same libgomp), split
// over blocks of weight rows. Returns 0, or -1 for an argument the kernels do not take.
int wo_linear(int isa, int bits, const float* x, int64_t rows, int64_t in_features, int64_t x_stride,
              const uint8_t* w, int64_t w_stride, const float* scale, int64_t groups, int64_t group,
              const float* bias, float* out, int64_t out_features, int64_t out_stride, int threads) {
  if ((bits != 8 && bits != 4 && bits != 32) || group <= 0 || group % 64 != 0 || groups * group < in_features) return -1;
  const Problem p{x, rows, in_features, x_stride, w, w_stride, scale, groups, group, bias, out, out_features,
                  out_stride};
  const int64_t blocks = (out_features + kRowBlock - 1) / kRowBlock;
  const bool parallel = threads > 1 && rows * out_features * in_features >= (int64_t{1} << 18);
#pragma omp parallel for schedule(static) num_threads(threads > 1 ? threads : 1) if (parallel)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t r_begin = b * kRowBlock, r_end = min64(r_begin + kRowBlock, out_features);
#ifdef WO_X86
    if (isa == WO_ISA_AVX512 || isa == WO_ISA_AVX2) {
      if (isa == WO_ISA_AVX512) {
        if (bits == 32) isa_rows<WO_ISA_AVX512, 32>(p, r_begin, r_end);
        else bits == 8 ? isa_rows<WO_ISA_AVX512, 8>(p, r_begin, r_end) : isa_rows<WO_ISA_AVX512, 4>(p, r_begin, r_end);
      } else {
        if (bits == 32) isa_rows<WO_ISA_AVX2, 32>(p, r_begin, r_end);
        else bits == 8 ? isa_rows<WO_ISA_AVX2, 8>(p, r_begin, r_end) : isa_rows<WO_ISA_AVX2, 4>(p, r_begin, r_end);
      }
      continue;
    }
#endif
    reference_rows(p, bits, r_begin, r_end);
  }
  return 0;
}

}  // extern "C"
