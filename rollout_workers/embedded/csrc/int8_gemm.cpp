// Exact W8A8 INT8 kernels for the embedded engine: per-token activation quantization, an int8 x int8 -> int32 GEMM
// (AMX-INT8, AVX512-VNNI, AVX-VNNI, AVX2, ARM i8mm / dotprod, or portable C++) and the fp32 epilogue, with the numerics of
// quant_sync's quantized_linear.
//
// Built once per machine by rollout_workers/embedded/native_build.py with the system C++ compiler (no torch headers:
// 2 s idle, up to 25 s on a loaded 2-core machine; `asyncrl up` builds it before the workers start) and called
// through ctypes from int8_linear.py. Plain C ABI; every pointer is to contiguous memory. Compiled with
// -ffp-contract=off: every fp32 product and sum below is rounded on its own, as the torch reference rounds it. Each
// ISA's code carries its own target attribute and runs only where cpuid has it (i8_has_isa), so one build serves
// every x86 CPU.
//
// Numerics, bit for bit those of the reference (quantize_int8_rows, int8_matmul, quantized_linear):
//   s_x[m] = max_k |x[m, k]| / 127 (fp32 division), 1 where that is not > 0;
//   q[m, k] = clamp(nearbyint(x[m, k] / s_x[m]), -127, 127)   (fp32 division, round half to even);
//   acc[m, n] = sum_k q[m, k] * w[n, k]                           (exact, int32);
//   out[m, n] = fl(fl(float(acc) * s_x[m]) * s_w[n]) (+ bias[n], rounded once more).
// Non-finite activations give an unspecified row (the reference's is unspecified too: a NaN cast to int8).
//
// The AVX2 product (ISA 1) needs no VNNI and no saturating step: both operands are widened to int16 (activations
// by the quantizer, weights by vpmovsxbw as they are loaded) and vpmaddwd sums pairs of int16 products into int32
// lanes (at most 2 * 128 * 128 = 2^15 each), which vpaddd accumulates: exact for any int8 operands and any
// K < 2^31 / 2^14 = 131072. (vpmaddubsw, the other AVX2 route, saturates int16 pair sums and needs llama.cpp's
// |w| x (x * sign(w)) trick to stay exact; measured on Zen 4, both run at the same speed and this one has fewer
// caveats. Per 16 multiply-accumulates both issue one multiply-pipe instruction.)
//
// The ARM path (ISA 3, Armv8.2 dotprod: Neoverse, Graviton 2+, Apple M1+) multiplies signed int8 by signed int8
// with sdot (vdotq_s32: four products of int8 pairs summed into each int32 lane, exact), on the VNNI layout without
// the +128 offset. Untested: written to Arm's documented intrinsics and compile-checked for aarch64, but no ARM
// machine runs this project's tests; it is admitted only after int8_linear.py's exactness self-test.
//
// The AVX-VNNI path (ISA 4: VEX-encoded 256-bit vpdpbusd, _mm256_dpbusd_avx_epi32, on CPUs with AVX-VNNI but no
// AVX-512: Intel Alder Lake and later client cores, Zen 5 with AVX-512 off) runs the VNNI path's arithmetic on
// 8-lane vectors: the same packed layout (w + 128 in groups of 4) and the same 128 * sum(q) compensation, one panel
// of 16 columns (two vectors) by 4 rows per micro-kernel: 8 accumulators and 3 operands in the 16 ymm registers
// (such CPUs have no zmm registers). Untested on such a CPU (none here): written to Intel's documented intrinsic
// and compile-checked (gcc 12, clang); it is admitted only where cpuid has AVX-VNNI (leaf 7, subleaf 1, EAX bit 4)
// and int8_linear.py's exactness self-test passes. ISA 5 runs the very same micro-kernel with vpdpbusd emulated by
// AVX2 (both operands widened to int16, vpmaddwd on even and odd bytes, exact) so that its layout, tails,
// compensation and epilogue are tested bit for bit here; it is a test path only.
//
// The ARM i8mm path (ISA 6, Armv8.6 I8MM: Neoverse V1/N2, Graviton 3+, Apple M2+) multiplies 2 activation rows by
// 2 weight columns over 8 inputs per smmla (vmmlaq_s32: a 2x8 by 8x2 int8 product added to a 2x2 int32 block,
// exact), on its own layout: K padded to a multiple of 8, and per panel of 16 columns and group of 8 inputs k8, the
// 8 column pairs j, each 16 bytes (column 2j's 8 inputs, then column 2j + 1's):
//   packed[((p * (kp / 8) + k8) * 8 + j) * 16 + h * 8 + i] = w[16 p + 2 j + h, 8 k8 + i]   (0 beyond N or K).
// Untested: written to Arm's documented intrinsic and compile-checked for aarch64 (clang), never run (no ARM machine
// here); admitted only where HWCAP2_I8MM is set and the self-test passes. ISA 7 runs the same layout, row pairing
// and epilogue with smmla emulated in portable C++ (a test path), bit for bit against the reference here.
//
// Packed weight layout of the AVX2 and portable paths (i8_pack): N padded to a multiple of 16 ("panels" of 16 output columns), K
// padded with zeros to a multiple of 4 (kp); panel p holds, for each pair of inputs k2, 16 columns x 2 bytes:
//   packed[((p * (kp / 2) + k2) * 16 + c) * 2 + j] = w[16 p + c, 2 k2 + j]   (0 beyond N or K).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define I8_X86 1
#define I8_AVX2 __attribute__((target("avx2,fma")))
#define I8_VNNI __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")))
#include <cpuid.h>
#if defined(__clang__)
#if __clang_major__ >= 12
#define I8_AVXVNNI_COMPILER 1
#endif
#elif defined(__GNUC__) && __GNUC__ >= 11
#define I8_AVXVNNI_COMPILER 1  // GCC 11 brought -mavxvnni and _mm256_dpbusd_avx_epi32
#endif
#ifdef I8_AVXVNNI_COMPILER
#define I8_AVXVNNI __attribute__((target("avx2,fma,avxvnni")))
#endif
#include "amx_tiles.h"
#ifdef AMX_TILES_COMPILER
#define I8_AMX_COMPILER 1  // GCC 11 and clang 12 brought -mamx-tile / -mamx-int8 and their intrinsics
#define I8_AMX __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")))
#endif
#endif

#if defined(__aarch64__)
#include <arm_neon.h>
#include <sys/auxv.h>
#define I8_ARM 1
#if defined(__clang__)
#define I8_DOTPROD __attribute__((target("dotprod")))
#else
#define I8_DOTPROD __attribute__((target("+dotprod")))
#endif
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#if defined(__clang__)
#define I8_I8MM __attribute__((target("i8mm")))
#else
#define I8_I8MM __attribute__((target("+i8mm")))
#endif
#ifndef HWCAP2_I8MM
#define HWCAP2_I8MM (1 << 13)
#endif
#endif

#define I8_ISA_PORTABLE 0
#define I8_ISA_AVX2 1
#define I8_ISA_VNNI 2
#define I8_ISA_DOTPROD 3
#define I8_ISA_AVXVNNI 4
#define I8_ISA_AVXVNNI_EMULATED 5  // ISA 4's micro-kernel with vpdpbusd emulated by AVX2: a test path
#define I8_ISA_I8MM 6
#define I8_ISA_I8MM_EMULATED 7  // ISA 6's layout and epilogue with smmla emulated in portable C++: a test path
#define I8_ISA_AMX 8  // Intel AMX-INT8 tiles on the VNNI layout (K padded to 64), the VNNI kernel below AMX rows

inline bool mmla_layout(int isa) { return isa == I8_ISA_I8MM || isa == I8_ISA_I8MM_EMULATED; }

inline bool vnni_layout(int isa) {  // w + 128 in groups of 4 inputs, a 128 * sum(q) compensation
  return isa == I8_ISA_VNNI || isa == I8_ISA_AVXVNNI || isa == I8_ISA_AVXVNNI_EMULATED || isa == I8_ISA_AMX;
}

namespace {

constexpr float kInt8Max = 127.0f;
constexpr int kPanel = 16;    // output columns per packed panel (two 8-lane int32 vectors)
constexpr int kRowBlock = 4;  // activation rows per micro-kernel call

inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// A decode step reads every weight once, and a model's int8 weights outgrow L3 (101 MB for the ~100M decode shape of
// `asyncrl bench e2e`), so they stream from DRAM. Each micro-kernel call prefetches the weights of the call after it
// into L2 (prefetcht1; locality 2) while it computes: on Zen 4 (one thread, 9 layers' linears, 16 rows) 10.7-11.0 ->
// 9.3-9.5 ms a decode step; also 6% at 1 row and 8% at 32. Same bits (a hint changes no value).
inline void prefetch_l2(const void* address) { __builtin_prefetch(address, 0, 2); }

inline float nonzero_scale(float amax) {
  const float scale = amax / kInt8Max;
  return scale > 0.0f ? scale : 1.0f;  // NaN and 0 -> 1, like torch.where(scale > 0, scale, 1)
}

inline int quantize_one(float x, float scale) {
  float q = std::nearbyint(x / scale);
  q = q < -kInt8Max ? -kInt8Max : (q > kInt8Max ? kInt8Max : q);
  return static_cast<int>(q);
}

// Stores a quantized value: int8 (+ offset, 0 or 128, as the byte's bit pattern) or int16.
inline void put(int8_t* q, int64_t i, int value, int offset) {
  q[i] = static_cast<int8_t>(static_cast<uint8_t>(value + offset));
}
inline void put(int16_t* q, int64_t i, int value, int) { q[i] = static_cast<int16_t>(value); }

// ------------------------------------------------------------------------------------------------ portable
float row_scale_portable(const float* x, int64_t k) {
  float amax = 0.0f;
  for (int64_t i = 0; i < k; ++i) amax = std::fabs(x[i]) > amax ? std::fabs(x[i]) : amax;
  return nonzero_scale(amax);
}

template <typename Q>
void quantize_row_portable(const float* x, int64_t k, float scale, int offset, Q* q) {
  for (int64_t i = 0; i < k; ++i) put(q, i, quantize_one(x[i], scale), offset);
}

inline int32_t packed_at(const int8_t* panel, int64_t k, int64_t c) {
  return panel[((k >> 1) * kPanel + c) * 2 + (k & 1)];
}

// acc[m, c] = exact dot product of q row m (int16, row stride kp) and panel column c, for c < cols
void panel_rows_portable(const int16_t* q, int64_t rows, int64_t kp, const int8_t* panel, int64_t cols, int32_t* acc,
                         int64_t acc_stride) {
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t c = 0; c < cols; ++c) {
      int32_t sum = 0;
      for (int64_t k = 0; k < kp; ++k) sum += static_cast<int32_t>(q[m * kp + k]) * packed_at(panel, k, c);
      acc[m * acc_stride + c] = sum;
    }
  }
}

#ifdef I8_X86
// ------------------------------------------------------------------------------------------------ AVX2
I8_AVX2 float row_scale_avx2(const float* x, int64_t k) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 amax = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) amax = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask), amax);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, amax);
  float result = 0.0f;
  for (float lane : lanes) result = lane > result ? lane : result;
  for (; i < k; ++i) result = std::fabs(x[i]) > result ? std::fabs(x[i]) : result;
  return nonzero_scale(result);
}

// 8 quantized values as int32 lanes: clamp(nearbyint(x / s), -127, 127), exact integers
I8_AVX2 inline __m256i quantize8_avx2(const float* x, __m256 s) {
  const __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x), s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-kInt8Max)), _mm256_set1_ps(kInt8Max)));
}

I8_AVX2 void quantize_row_avx2(const float* x, int64_t k, float scale, int offset, int8_t* q) {
  const __m256 s = _mm256_set1_ps(scale);
  const __m256i off = _mm256_set1_epi32(offset), order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) {
    __m256i v[4];
    for (int j = 0; j < 4; ++j) v[j] = _mm256_add_epi32(quantize8_avx2(x + i + 8 * j, s), off);
    const __m256i words_lo = _mm256_packs_epi32(v[0], v[1]), words_hi = _mm256_packs_epi32(v[2], v[3]);
    // -127..127 fit signed bytes; with the offset, 1..255 fit unsigned ones: neither pack saturates
    const __m256i bytes = offset ? _mm256_packus_epi16(words_lo, words_hi) : _mm256_packs_epi16(words_lo, words_hi);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), _mm256_permutevar8x32_epi32(bytes, order));
  }
  for (; i < k; ++i) put(q, i, quantize_one(x[i], scale), offset);
}

I8_AVX2 void quantize_row_avx2(const float* x, int64_t k, float scale, int, int16_t* q) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    const __m256i words = _mm256_packs_epi32(quantize8_avx2(x + i, s), quantize8_avx2(x + i + 8, s));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), _mm256_permute4x64_epi64(words, 0xD8));  // lane order
  }
  for (; i < k; ++i) put(q, i, quantize_one(x[i], scale), 0);
}

// acc[r][h] = the int32 dot products of MR int16 activation rows (row stride kp) with one panel's 16 columns;
// `next` (the next panel, or null) is prefetched into L2 on the way (see prefetch_l2).
template <int MR>
I8_AVX2 inline void micro_avx2(const int16_t* q, int64_t kp, const int8_t* panel, const int8_t* next,
                               __m256i acc[MR][2]) {
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  for (int64_t k2 = 0; k2 < kp / 2; ++k2) {
    if (next && (k2 & 1) == 0) prefetch_l2(next + k2 * 32);
    const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + k2 * 32)));
    const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + k2 * 32 + 16)));
    for (int r = 0; r < MR; ++r) {
      int32_t pair;  // q[r, 2 k2] and q[r, 2 k2 + 1], in every lane
      std::memcpy(&pair, q + r * kp + k2 * 2, 4);
      const __m256i xb = _mm256_set1_epi32(pair);
      acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(xb, w0));
      acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(xb, w1));
    }
  }
}

// out[r, c] = fl(fl(float(acc) * s_x[r]) * s_w[c]) (+ bias[c]) for one panel's `cols` valid columns;
// with out_s32, the raw accumulators instead.
template <int MR>
I8_AVX2 void block_avx2(const int16_t* q, int64_t kp, const int8_t* panel, const int8_t* next, const float* sx,
                        const float* sw, const float* bias, int64_t cols, float* out, int32_t* out_s32,
                        int64_t out_stride) {
  __m256i acc[MR][2];
  micro_avx2<MR>(q, kp, panel, next, acc);
  for (int r = 0; r < MR; ++r) {
    alignas(32) int32_t lanes[kPanel];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc[r][0]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes + 8), acc[r][1]);
    if (out_s32) {
      std::memcpy(out_s32 + r * out_stride, lanes, cols * sizeof(int32_t));
      continue;
    }
    const __m256 s = _mm256_set1_ps(sx[r]);
    if (cols == kPanel) {
      for (int h = 0; h < 2; ++h) {
        __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][h]), s), _mm256_loadu_ps(sw + 8 * h));
        if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + 8 * h));
        _mm256_storeu_ps(out + r * out_stride + 8 * h, v);
      }
    } else {
      for (int64_t c = 0; c < cols; ++c) {
        const float v = static_cast<float>(lanes[c]) * sx[r] * sw[c];
        out[r * out_stride + c] = bias ? v + bias[c] : v;
      }
    }
  }
}

I8_AVX2 void panel_rows_avx2(const int16_t* q, int64_t rows, int64_t kp, const int8_t* panel, const int8_t* next,
                             const float* sx, const float* sw, const float* bias, int64_t cols, float* out,
                             int32_t* out_s32, int64_t out_stride) {
  int64_t m = 0;
  for (; m + kRowBlock <= rows; m += kRowBlock) {
    block_avx2<kRowBlock>(q + m * kp, kp, panel, next, sx + m, sw, bias, cols, out ? out + m * out_stride : nullptr,
                          out_s32 ? out_s32 + m * out_stride : nullptr, out_stride);
  }
  const int64_t left = rows - m;
  const int16_t* qm = q + m * kp;
  float* om = out ? out + m * out_stride : nullptr;
  int32_t* sm = out_s32 ? out_s32 + m * out_stride : nullptr;
  if (left == 3) block_avx2<3>(qm, kp, panel, next, sx + m, sw, bias, cols, om, sm, out_stride);
  if (left == 2) block_avx2<2>(qm, kp, panel, next, sx + m, sw, bias, cols, om, sm, out_stride);
  if (left == 1) block_avx2<1>(qm, kp, panel, next, sx + m, sw, bias, cols, om, sm, out_stride);
}

// ------------------------------------------------------------------------------------------------ AVX512-VNNI
// vpdpbusd multiplies unsigned by signed bytes, sums each group of 4 products into an int32 lane and adds it to
// the accumulator, without saturation. The weight is the unsigned operand, stored as w + 128 (0..255), the
// activation the signed one (any int8, broadcast 4 bytes at a time), so acc' = sum (w + 128) x = acc + 128 sum x:
// the caller passes comp[m] = 128 * sum_k q[m, k] and the epilogue subtracts it, in int32 (exact).
// Layout (i8_pack): panels of 16 columns as above, each group of 4 inputs k4 one 64-byte vector:
//   packed[((p * (kp / 4) + k4) * 16 + c) * 4 + j] = w[16 p + c, 4 k4 + j] + 128   (128 beyond N or K).
#ifndef I8_VNNI_ROWS
#define I8_VNNI_ROWS 12
#endif
#ifndef I8_VNNI_PANELS
#define I8_VNNI_PANELS 2
#endif
constexpr int kVnniRows = I8_VNNI_ROWS;      // activation rows per micro-kernel call
constexpr int kVnniPanels = I8_VNNI_PANELS;  // panels (of 16 columns) per micro-kernel call

struct VnniCall {  // one product's operands (see i8_linear); out or out_s32 is null
  const int8_t* q;
  int64_t rows, kp;
  const uint8_t* packed;
  int64_t n;
  const int32_t* comp;
  const float *sx, *sw, *bias;
  float* out;
  int32_t* out_s32;
  int64_t out_stride;
};

// rows [m, m + MR) against panels [p, p + NR): the whole K loop in registers, then the epilogue.
// The accumulators are named variables (c<row>_<panel>), not an array: GCC 12 kept an array of __m512i accumulators
// in a second set of registers and copied each one before and after its vpdpbusd (docs/kernels.md). The macros name
// up to 16 x 4 of them; if constexpr keeps the tile's MR x NR.
#define I8_VNNI_EACH_ROW(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11) M(12) M(13) M(14) M(15)
#define I8_VNNI_DECL(r) __m512i c##r##_0 = zero, c##r##_1 = zero, c##r##_2 = zero, c##r##_3 = zero;
#define I8_VNNI_ACC(r, j) \
  if constexpr (MR > r && NR > j) c##r##_##j = _mm512_dpbusd_epi32(c##r##_##j, w##j, x);
#define I8_VNNI_ROW(r)                                                        \
  if constexpr (MR > r) {                                                     \
    int32_t four;                                                             \
    std::memcpy(&four, qk + r * 4, 4);                                        \
    const __m512i x = _mm512_set1_epi32(four);                                \
    I8_VNNI_ACC(r, 0) I8_VNNI_ACC(r, 1) I8_VNNI_ACC(r, 2) I8_VNNI_ACC(r, 3) \
  }
#define I8_VNNI_OUT(r) \
  if constexpr (MR > r) acc[r][0] = c##r##_0, acc[r][1] = c##r##_1, acc[r][2] = c##r##_2, acc[r][3] = c##r##_3;
template <int MR, int NR>
I8_VNNI void block_vnni(const VnniCall& a, int64_t m, int64_t p) {
  static_assert(MR >= 1 && MR <= 16 && NR >= 1 && NR <= 4, "block_vnni names at most 16 x 4 accumulators");
  const int8_t* q = a.q + m * a.kp;  // the block's rows, interleaved (interleave_rows)
  const uint8_t* panel = a.packed + p * a.kp * kPanel;
  const int64_t panel_bytes = a.kp * kPanel, n0 = p * kPanel;
  // the next group of panels (the next call's weights), prefetched into L2 on the way: see prefetch_l2
  const int64_t next_panels = min64(kVnniPanels, (a.n + kPanel - 1) / kPanel - p - kVnniPanels);
  const uint8_t* next = next_panels > 0 ? panel + kVnniPanels * panel_bytes : panel;  // never past the buffer
  const __m512i zero = _mm512_setzero_si512();
  I8_VNNI_EACH_ROW(I8_VNNI_DECL)
  for (int64_t k4 = 0; k4 < a.kp / 4; ++k4) {
    const __m512i w0 = _mm512_loadu_si512(panel + k4 * 64);
    const __m512i w1 = NR > 1 ? _mm512_loadu_si512(panel + panel_bytes + k4 * 64) : zero;
    const __m512i w2 = NR > 2 ? _mm512_loadu_si512(panel + 2 * panel_bytes + k4 * 64) : zero;
    const __m512i w3 = NR > 3 ? _mm512_loadu_si512(panel + 3 * panel_bytes + k4 * 64) : zero;
    for (int64_t j = 0; j < next_panels; ++j) prefetch_l2(next + j * panel_bytes + k4 * 64);
    const int8_t* qk = q + k4 * MR * 4;  // group k4's MR x 4 activation bytes
    I8_VNNI_EACH_ROW(I8_VNNI_ROW)
  }
  __m512i acc[MR][4];
  I8_VNNI_EACH_ROW(I8_VNNI_OUT)
  for (int r = 0; r < MR; ++r) {
    const __m512i offset = _mm512_set1_epi32(a.comp[m + r]);
    for (int j = 0; j < NR; ++j) {
      const int64_t col = n0 + kPanel * j, valid = min64(kPanel, a.n - col);
      const __mmask16 mask = valid >= kPanel ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
      const __m512i exact = _mm512_sub_epi32(acc[r][j], offset);
      if (a.out_s32) {
        _mm512_mask_storeu_epi32(a.out_s32 + (m + r) * a.out_stride + col, mask, exact);
        continue;
      }
      __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(exact), _mm512_set1_ps(a.sx[m + r]));
      v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(mask, a.sw + col));
      if (a.bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, a.bias + col));
      _mm512_mask_storeu_ps(a.out + (m + r) * a.out_stride + col, mask, v);
    }
  }
}

template <int MR, int NR>
I8_VNNI void row_tail_vnni(const VnniCall& a, int64_t m, int64_t p, int64_t left) {
  if constexpr (MR > 0) {
    if (left == MR) return block_vnni<MR, NR>(a, m, p);
    row_tail_vnni<MR - 1, NR>(a, m, p, left);
  }
}

template <int NR>
I8_VNNI void panel_group_vnni(const VnniCall& a, int64_t p) {
  int64_t m = 0;
  for (; m + kVnniRows <= a.rows; m += kVnniRows) block_vnni<kVnniRows, NR>(a, m, p);
  if (m < a.rows) row_tail_vnni<kVnniRows - 1, NR>(a, m, p, a.rows - m);
}

template <int NR>
I8_VNNI void panel_tail_vnni(const VnniCall& a, int64_t p, int64_t left) {
  if constexpr (NR > 0) {
    if (left == NR) return panel_group_vnni<NR>(a, p);
    panel_tail_vnni<NR - 1>(a, p, left);
  }
}

// q (rows x kp, row-major) -> blocked: each block of kVnniRows rows (the last one: what is left) as groups of 4
// inputs, the block's rows side by side: blocked[m kp + (k4 R + r) 4 + j] = q[(m + r) kp + 4 k4 + j], R the block's
// rows. block_vnni then reads a group's broadcasts at one address plus constants: with a row pointer each, GCC ran
// out of general registers from 8 rows and moved addresses through vector registers in the loop.
void interleave_rows(const int8_t* q, int64_t rows, int64_t kp, int8_t* blocked) {
  for (int64_t m = 0; m < rows; m += kVnniRows) {
    const int64_t block_rows = min64(kVnniRows, rows - m);
    int8_t* out = blocked + m * kp;
    for (int64_t k4 = 0; k4 < kp / 4; ++k4)
      for (int64_t r = 0; r < block_rows; ++r)
        std::memcpy(out + (k4 * block_rows + r) * 4, q + (m + r) * kp + k4 * 4, 4);
  }
}

I8_VNNI void gemm_vnni(const VnniCall& rows_call, int threads) {
  thread_local std::vector<int8_t> blocked;
  blocked.resize(static_cast<size_t>(rows_call.rows * rows_call.kp));
  interleave_rows(rows_call.q, rows_call.rows, rows_call.kp, blocked.data());
  VnniCall a = rows_call;
  a.q = blocked.data();
  const int64_t panels = (a.n + kPanel - 1) / kPanel, groups = (panels + kVnniPanels - 1) / kVnniPanels;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t p = g * kVnniPanels, left = min64(kVnniPanels, panels - p);
    if (left == kVnniPanels) {
      panel_group_vnni<kVnniPanels>(a, p);
    } else {
      panel_tail_vnni<kVnniPanels - 1>(a, p, left);
    }
  }
}
// ------------------------------------------------------------------------------------------------ AMX-INT8
// Intel AMX (Sapphire Rapids and later Xeons): eight tile registers of up to 16 rows x 64 bytes and TDPBSUD, which
// multiplies a tile of signed bytes (activations, rows x 64 inputs) by a tile of unsigned bytes laid out in groups
// of 4 inputs (16 groups x 16 columns x 4 bytes) and adds each group's 4 products into the int32 accumulator tile
// (rows x 16 columns), exactly and without saturation, like vpdpbusd. The VNNI layout's panel is that B operand as
// it stands: its groups of 4 inputs of 16 columns are 64 contiguous bytes, so a tile of 64 inputs is 1 KB of the
// panel at stride 64. The weights stay w + 128 and the epilogue subtracts the same 128 * sum(q) compensation.
// K is padded to a multiple of 64 (a whole tile; the padding's weights are 128 against zero activations).
// Tiles: 0-3 accumulators (4 panels = 64 columns), 4 activations, 6 and 7 weights (alternating, so that a load can
// start while the previous product still reads the other). A block of up to 16 rows runs the whole K loop in tiles,
// then stores the accumulators for the VNNI epilogue. Below kAmxMinRows rows a TDPBSUD does the work of 16 rows
// for fewer, and i8_linear runs the VNNI kernel on the same layout (as fast at 1-4 rows, slower from 6: on an AMX
// Xeon, one thread, a decode step's 63 linears at 6 rows 8.5 ms in tiles against 10.4; docs/kernels.md).
// Linux hands out the tile state only after arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) (has_amx).
#ifdef I8_AMX_COMPILER
constexpr int kAmxRows = 16;    // rows of an activation / accumulator tile
constexpr int kAmxK = 64;       // inputs of an activation tile row (bytes)
constexpr int kAmxPanels = 4;   // accumulator tiles: panels per block
#ifndef I8_AMX_MIN_ROWS
#define I8_AMX_MIN_ROWS 6
#endif
constexpr int64_t kAmxMinRows = I8_AMX_MIN_ROWS;

I8_AMX void amx_configure(int rows) {
  AmxTileConfig config;
  for (int t = 0; t < kAmxPanels; ++t) config.rows[t] = static_cast<uint8_t>(rows), config.colsb[t] = 64;
  config.rows[4] = static_cast<uint8_t>(rows), config.colsb[4] = kAmxK;
  for (int t = 6; t < 8; ++t) config.rows[t] = kAmxK / 4, config.colsb[t] = 64;
  amx_load_config(config);
}

// A function of its own, like amx_configure: clang outlines an OpenMP region into a function without this file's
// target attributes, where a tile instruction written inline cannot be compiled
I8_AMX void amx_release() { _tile_release(); }

// rows [m, m + mr) (mr <= 16, the configured tile rows) against panels [p, p + NR)
template <int NR>
I8_AMX void block_amx(const VnniCall& a, int64_t m, int64_t p, int mr) {
  const int8_t* q = a.q + m * a.kp;
  const uint8_t* panel = a.packed + p * a.kp * kPanel;
  const int64_t panel_bytes = a.kp * kPanel;
  _tile_zero(0);
  if constexpr (NR > 1) _tile_zero(1);
  if constexpr (NR > 2) _tile_zero(2);
  if constexpr (NR > 3) _tile_zero(3);
  for (int64_t k0 = 0; k0 < a.kp; k0 += kAmxK) {
    const uint8_t* b = panel + k0 * kPanel;  // groups k0 / 4 .. k0 / 4 + 15 of the first panel: 1 KB
    _tile_loadd(4, q + k0, a.kp);
    _tile_loadd(6, b, 64);
    _tile_dpbsud(0, 4, 6);
    if constexpr (NR > 1) {
      _tile_loadd(7, b + panel_bytes, 64);
      _tile_dpbsud(1, 4, 7);
    }
    if constexpr (NR > 2) {
      _tile_loadd(6, b + 2 * panel_bytes, 64);
      _tile_dpbsud(2, 4, 6);
    }
    if constexpr (NR > 3) {
      _tile_loadd(7, b + 3 * panel_bytes, 64);
      _tile_dpbsud(3, 4, 7);
    }
  }
  alignas(64) int32_t acc[kAmxPanels][kAmxRows][kPanel];
  _tile_stored(0, acc[0], 64);
  if constexpr (NR > 1) _tile_stored(1, acc[1], 64);
  if constexpr (NR > 2) _tile_stored(2, acc[2], 64);
  if constexpr (NR > 3) _tile_stored(3, acc[3], 64);
  __asm__ volatile("" ::: "memory");  // the tile stores wrote acc (the intrinsics are asm without memory operands)
  // The VNNI block's epilogue, on the stored tiles. Kept a copy: with one helper for both (always_inline, the rows
  // a template or a runtime count) the VNNI kernel ran 2-6% slower at 16-32 rows (2026-12-06, two alternated pairs).
  const int64_t n0 = p * kPanel;
  for (int r = 0; r < mr; ++r) {
    const __m512i offset = _mm512_set1_epi32(a.comp[m + r]);
    for (int j = 0; j < NR; ++j) {
      const int64_t col = n0 + kPanel * j, valid = min64(kPanel, a.n - col);
      const __mmask16 mask = valid >= kPanel ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
      const __m512i exact = _mm512_sub_epi32(_mm512_load_si512(acc[j][r]), offset);
      if (a.out_s32) {
        _mm512_mask_storeu_epi32(a.out_s32 + (m + r) * a.out_stride + col, mask, exact);
        continue;
      }
      __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(exact), _mm512_set1_ps(a.sx[m + r]));
      v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(mask, a.sw + col));
      if (a.bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, a.bias + col));
      _mm512_mask_storeu_ps(a.out + (m + r) * a.out_stride + col, mask, v);
    }
  }
}

I8_AMX void group_amx(const VnniCall& a, int64_t m, int64_t p, int mr) {
  const int64_t left = min64(kAmxPanels, (a.n + kPanel - 1) / kPanel - p);
  if (left == 4) return block_amx<4>(a, m, p, mr);
  if (left == 3) return block_amx<3>(a, m, p, mr);
  if (left == 2) return block_amx<2>(a, m, p, mr);
  block_amx<1>(a, m, p, mr);
}

// Each thread configures its own tiles: every whole block of 16 rows over its groups of panels, then the last rows
// (one more configuration) over the same groups, and gives the tile state back.
I8_AMX void gemm_amx(const VnniCall& a, int threads) {
  const int64_t panels = (a.n + kPanel - 1) / kPanel, groups = (panels + kAmxPanels - 1) / kAmxPanels;
  const int64_t full = a.rows / kAmxRows * kAmxRows;
  const int tail = static_cast<int>(a.rows - full);
  __asm__ volatile("" ::: "memory");  // the quantized rows are in memory before a tile load reads them
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    if (full > 0) {
      amx_configure(kAmxRows);
#pragma omp for schedule(static) nowait
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t m = 0; m < full; m += kAmxRows) group_amx(a, m, g * kAmxPanels, kAmxRows);
    }
    if (tail > 0) {
      amx_configure(tail);
#pragma omp for schedule(static) nowait
      for (int64_t g = 0; g < groups; ++g) group_amx(a, full, g * kAmxPanels, tail);
    }
    amx_release();
  }
}

// AMX-TILE (cpuid leaf 7 EDX bit 24) and AMX-INT8 (bit 25), the VNNI path (for the small-row calls and the
// epilogue), and Linux's permission for this process's tile data (amx_tiles.h).
bool has_amx(bool vnni) { return vnni && amx_available((1u << 24) | (1u << 25)); }
#endif  // I8_AMX_COMPILER

// ------------------------------------------------------------------------------------------------ AVX-VNNI
// One row's 16 exact sums (acc - comp) through the epilogue: raw int32 (out_s32) or fl(fl(float * s_x) * s_w)
// (+ bias), for the `valid` leading columns of the panel starting at column col.
I8_AVX2 inline void row_epilogue_avx2(const VnniCall& a, int64_t row, int64_t col, const __m256i sums[2]) {
  const int64_t valid = min64(kPanel, a.n - col);
  const __m256i offset = _mm256_set1_epi32(a.comp[row]);
  alignas(32) int32_t exact[kPanel];
  _mm256_store_si256(reinterpret_cast<__m256i*>(exact), _mm256_sub_epi32(sums[0], offset));
  _mm256_store_si256(reinterpret_cast<__m256i*>(exact + 8), _mm256_sub_epi32(sums[1], offset));
  if (a.out_s32) {
    std::memcpy(a.out_s32 + row * a.out_stride + col, exact, valid * sizeof(int32_t));
    return;
  }
  float* out = a.out + row * a.out_stride + col;
  if (valid == kPanel) {
    const __m256 s = _mm256_set1_ps(a.sx[row]);
    for (int h = 0; h < 2; ++h) {
      const __m256i e = _mm256_load_si256(reinterpret_cast<const __m256i*>(exact + 8 * h));
      __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(e), s), _mm256_loadu_ps(a.sw + col + 8 * h));
      if (a.bias) v = _mm256_add_ps(v, _mm256_loadu_ps(a.bias + col + 8 * h));
      _mm256_storeu_ps(out + 8 * h, v);
    }
    return;
  }
  for (int64_t c = 0; c < valid; ++c) {
    const float v = static_cast<float>(exact[c]) * a.sx[row] * a.sw[col + c];
    out[c] = a.bias ? v + a.bias[col + c] : v;
  }
}

// vpdpbusd on AVX2 alone: acc + the sums of each lane's 4 products (unsigned bytes of u) x (signed bytes of s).
// Exact: the even and odd bytes are widened to int16 lanes and vpmaddwd sums pairs of their products in int32
// (at most 2 x 255 x 128 = 65,280 in magnitude), so no step saturates.
I8_AVX2 inline __m256i dpbusd_emulated(__m256i acc, __m256i u, __m256i s) {
  const __m256i low_bytes = _mm256_set1_epi16(0x00FF);
  const __m256i u_even = _mm256_and_si256(u, low_bytes), u_odd = _mm256_srli_epi16(u, 8);
  const __m256i s_even = _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8), s_odd = _mm256_srai_epi16(s, 8);
  const __m256i pairs = _mm256_add_epi32(_mm256_madd_epi16(u_even, s_even), _mm256_madd_epi16(u_odd, s_odd));
  return _mm256_add_epi32(acc, pairs);
}

// rows [m, m + MR) against panel p: the whole K loop in 2 * MR accumulators (columns 0-7, 8-15), then the epilogue.
// AVXVNNI_BLOCK(name, target, dot) defines the micro-kernel once per dot product (the real VEX vpdpbusd, with its
// own target attribute, or the AVX2 emulation), so that each is compiled only for the ISA it runs on.
#define I8_AVXVNNI_BLOCK(NAME, TARGET, DOT)                                                              \
  template <int MR>                                                                                      \
  TARGET void NAME(const VnniCall& a, int64_t m, int64_t p) {                                            \
    const int8_t* q = a.q + m * a.kp;                                                                    \
    const uint8_t* panel = a.packed + p * a.kp * kPanel;                                                 \
    const uint8_t* next = p + 1 < (a.n + kPanel - 1) / kPanel ? panel + a.kp * kPanel : nullptr;         \
    __m256i acc[MR][2];                                                                                  \
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();                         \
    for (int64_t k4 = 0; k4 < a.kp / 4; ++k4) {                                                          \
      if (next) prefetch_l2(next + k4 * 64);                                                             \
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + k4 * 64));         \
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + k4 * 64 + 32));    \
      for (int r = 0; r < MR; ++r) {                                                                     \
        int32_t four;                                                                                    \
        std::memcpy(&four, q + r * a.kp + k4 * 4, 4);                                                    \
        const __m256i xb = _mm256_set1_epi32(four);                                                      \
        acc[r][0] = DOT(acc[r][0], w0, xb);                                                              \
        acc[r][1] = DOT(acc[r][1], w1, xb);                                                              \
      }                                                                                                  \
    }                                                                                                    \
    for (int r = 0; r < MR; ++r) row_epilogue_avx2(a, m + r, p * kPanel, acc[r]);                       \
  }

#ifdef I8_AVXVNNI
I8_AVXVNNI_BLOCK(block_avxvnni, I8_AVXVNNI, _mm256_dpbusd_avx_epi32)
#endif
I8_AVXVNNI_BLOCK(block_avxvnni_emulated, I8_AVX2, dpbusd_emulated)
#undef I8_AVXVNNI_BLOCK

using AvxVnniBlock = void (*)(const VnniCall&, int64_t, int64_t);

// every panel (split over OpenMP threads) in row blocks of 4, then the 1-3 rows left, with one micro-kernel family
void gemm_avxvnni(const VnniCall& a, int threads, const AvxVnniBlock blocks[5]) {
  const int64_t panels = (a.n + kPanel - 1) / kPanel;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t p = 0; p < panels; ++p) {
    int64_t m = 0;
    for (; m + 4 <= a.rows; m += 4) blocks[4](a, m, p);
    if (m < a.rows) blocks[a.rows - m](a, m, p);
  }
}

const AvxVnniBlock kAvxVnniEmulated[5] = {nullptr, block_avxvnni_emulated<1>, block_avxvnni_emulated<2>,
                                          block_avxvnni_emulated<3>, block_avxvnni_emulated<4>};
#ifdef I8_AVXVNNI
const AvxVnniBlock kAvxVnni[5] = {nullptr, block_avxvnni<1>, block_avxvnni<2>, block_avxvnni<3>, block_avxvnni<4>};
#endif

bool has_avx_vnni() {  // cpuid leaf 7, subleaf 1: EAX bit 4
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) && ((eax >> 4) & 1u);
}

// The product of a VNNI-layout ISA (2, 4 or 5) on int8 q with its compensation: fp32 outputs or raw int32
void gemm_vnni_layout(int isa, const VnniCall& a, int threads, bool tiles_always = false) {
#ifdef I8_AMX_COMPILER
  if (isa == I8_ISA_AMX && (tiles_always || a.rows >= kAmxMinRows)) return gemm_amx(a, threads);
#endif
  if (isa == I8_ISA_VNNI || isa == I8_ISA_AMX) return gemm_vnni(a, threads);
#ifdef I8_AVXVNNI
  if (isa == I8_ISA_AVXVNNI) return gemm_avxvnni(a, threads, kAvxVnni);
#endif
  gemm_avxvnni(a, threads, kAvxVnniEmulated);
}
#endif  // I8_X86

#ifdef I8_ARM
// rows [m, m + MR) against panel p (16 columns as four int32x4 accumulators per row): sdot over groups of 4 inputs
// (the packed panel holds, per group, 16 columns x 4 inputs: vector v = columns 4v..4v+3, 4 bytes each), then the
// epilogue of the reference (float(acc) * s_x, then * s_w, then + bias, each rounded).
template <int MR>
I8_DOTPROD void block_dotprod(const int8_t* q, int64_t m, int64_t kp, const int8_t* panel, int64_t n0, int64_t n,
                              const float* sx, const float* sw, const float* bias, float* out, int32_t* out_s32,
                              int64_t out_stride) {
  int32x4_t acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = vdupq_n_s32(0);
  for (int64_t k4 = 0; k4 < kp / 4; ++k4) {
    int8x16_t w[4];
    for (int v = 0; v < 4; ++v) w[v] = vld1q_s8(panel + k4 * 64 + v * 16);
    for (int r = 0; r < MR; ++r) {
      int32_t four;
      std::memcpy(&four, q + (m + r) * kp + k4 * 4, 4);
      const int8x16_t xb = vreinterpretq_s8_s32(vdupq_n_s32(four));
      for (int v = 0; v < 4; ++v) acc[r][v] = vdotq_s32(acc[r][v], w[v], xb);
    }
  }
  const int64_t valid = min64(kPanel, n - n0);
  for (int r = 0; r < MR; ++r) {
    alignas(16) int32_t exact[kPanel];
    for (int v = 0; v < 4; ++v) vst1q_s32(exact + 4 * v, acc[r][v]);
    if (out_s32) {
      std::memcpy(out_s32 + (m + r) * out_stride + n0, exact, valid * 4);
      continue;
    }
    for (int64_t c = 0; c < valid; ++c) {
      const float v = static_cast<float>(exact[c]) * sx[m + r] * sw[n0 + c];
      out[(m + r) * out_stride + n0 + c] = bias ? v + bias[n0 + c] : v;
    }
  }
}

I8_DOTPROD void gemm_dotprod(const int8_t* q, int64_t rows, int64_t kp, const int8_t* packed, int64_t n,
                             const float* sx, const float* sw, const float* bias, float* out, int32_t* out_s32,
                             int64_t out_stride, int threads) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t p = 0; p < panels; ++p) {
    const int8_t* panel = packed + p * kp * kPanel;
    int64_t m = 0;
    for (; m + 4 <= rows; m += 4)
      block_dotprod<4>(q, m, kp, panel, p * kPanel, n, sx, sw, bias, out, out_s32, out_stride);
    for (; m < rows; ++m) block_dotprod<1>(q, m, kp, panel, p * kPanel, n, sx, sw, bias, out, out_s32, out_stride);
  }
}
#endif  // I8_ARM

// ------------------------------------------------------------------------------------------------ i8mm layout
struct MmlaCall {  // one product's operands (see i8_linear); out or out_s32 is null
  const int8_t* q;
  int64_t rows, kp;
  const int8_t* packed;
  int64_t n;
  const float *sx, *sw, *bias;
  float* out;
  int32_t* out_s32;
  int64_t out_stride;
};

// acc[j] = pair j's 2x2 block (rows m, m + 1 by columns 2j, 2j + 1 of panel p) through the epilogue, for the
// `row_count` (1 or 2) real rows and the columns below n
inline void mmla_epilogue(const MmlaCall& a, int64_t m, int64_t p, const int32_t acc[8][4], int row_count) {
  for (int r = 0; r < row_count; ++r)
    for (int j = 0; j < 8; ++j)
      for (int h = 0; h < 2; ++h) {
        const int64_t col = p * kPanel + 2 * j + h;
        if (col >= a.n) continue;
        const int32_t exact = acc[j][2 * r + h];
        if (a.out_s32) {
          a.out_s32[(m + r) * a.out_stride + col] = exact;
        } else {
          const float v = static_cast<float>(exact) * a.sx[m + r] * a.sw[col];
          a.out[(m + r) * a.out_stride + col] = a.bias ? v + a.bias[col] : v;
        }
      }
}

// smmla in portable C++: acc[2 i + j] += sum_k a[8 i + k] * b[8 j + k]
inline void smmla_emulated(int32_t acc[4], const int8_t a[16], const int8_t b[16]) {
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j) {
      int32_t sum = 0;
      for (int k = 0; k < 8; ++k) sum += static_cast<int32_t>(a[8 * i + k]) * b[8 * j + k];
      acc[2 * i + j] += sum;
    }
}

// rows m (and m + 1 where row_count is 2; a zero row stands in otherwise) against panel p
void block_mmla_emulated(const MmlaCall& a, int64_t m, int64_t p, int row_count) {
  int32_t acc[8][4] = {};
  const int8_t* panel = a.packed + p * a.kp * kPanel;
  const int8_t* row0 = a.q + m * a.kp;
  for (int64_t k8 = 0; k8 < a.kp / 8; ++k8) {
    int8_t rows2[16] = {};
    std::memcpy(rows2, row0 + k8 * 8, 8);
    if (row_count > 1) std::memcpy(rows2 + 8, row0 + a.kp + k8 * 8, 8);
    for (int j = 0; j < 8; ++j) smmla_emulated(acc[j], rows2, panel + (k8 * 8 + j) * 16);
  }
  mmla_epilogue(a, m, p, acc, row_count);
}

#ifdef I8_ARM
I8_I8MM void block_i8mm(const MmlaCall& a, int64_t m, int64_t p, int row_count) {
  int32x4_t acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = vdupq_n_s32(0);
  const int8_t* panel = a.packed + p * a.kp * kPanel;
  const int8_t* row0 = a.q + m * a.kp;
  for (int64_t k8 = 0; k8 < a.kp / 8; ++k8) {
    const int8x8_t high = row_count > 1 ? vld1_s8(row0 + a.kp + k8 * 8) : vdup_n_s8(0);
    const int8x16_t rows2 = vcombine_s8(vld1_s8(row0 + k8 * 8), high);
    for (int j = 0; j < 8; ++j) acc[j] = vmmlaq_s32(acc[j], rows2, vld1q_s8(panel + (k8 * 8 + j) * 16));
  }
  alignas(16) int32_t lanes[8][4];
  for (int j = 0; j < 8; ++j) vst1q_s32(lanes[j], acc[j]);
  mmla_epilogue(a, m, p, lanes, row_count);
}
#endif

void gemm_mmla(int isa, const MmlaCall& a, int threads) {
  const int64_t panels = (a.n + kPanel - 1) / kPanel;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t m = 0; m < a.rows; m += 2) {
      const int row_count = a.rows - m >= 2 ? 2 : 1;
#ifdef I8_ARM
      if (isa == I8_ISA_I8MM) {
        block_i8mm(a, m, p, row_count);
        continue;
      }
#endif
      block_mmla_emulated(a, m, p, row_count);
    }
}

bool has_isa(int isa) {
  if (isa == I8_ISA_PORTABLE || isa == I8_ISA_I8MM_EMULATED) return true;
#ifdef I8_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == I8_ISA_AVX2) return avx2;
  const bool vnni = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                    __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  if (isa == I8_ISA_VNNI) return vnni;
#ifdef I8_AMX_COMPILER
  if (isa == I8_ISA_AMX) return has_amx(vnni);
#endif
#ifdef I8_AVXVNNI
  if (isa == I8_ISA_AVXVNNI) return avx2 && has_avx_vnni();
#endif
  if (isa == I8_ISA_AVXVNNI_EMULATED) return avx2;
#endif
#ifdef I8_ARM
  if (isa == I8_ISA_DOTPROD) return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
  if (isa == I8_ISA_I8MM) return (getauxval(AT_HWCAP2) & HWCAP2_I8MM) != 0;
#endif
  return false;
}

template <typename Q>
void quantize_rows(int isa, const float* x, int64_t rows, int64_t k, int64_t x_stride, int offset, Q* q,
                   int64_t q_stride, float* scale) {
  for (int64_t m = 0; m < rows; ++m) {
    const float* xm = x + m * x_stride;
    Q* qm = q + m * q_stride;
#ifdef I8_X86
    if (isa != I8_ISA_PORTABLE) {  // the VNNI path quantizes with AVX2 too
      scale[m] = row_scale_avx2(xm, k);
      quantize_row_avx2(xm, k, scale[m], offset, qm);
    } else
#endif
    {
      scale[m] = row_scale_portable(xm, k);
      quantize_row_portable(xm, k, scale[m], offset, qm);
    }
    for (int64_t i = k; i < q_stride; ++i) qm[i] = 0;  // padding inputs: zero (the packed weight is zero there too)
  }
}

int32_t row_sum(const int8_t* q, int64_t k) {
  int32_t sum = 0;
  for (int64_t i = 0; i < k; ++i) sum += q[i];
  return sum;
}

void scale_output(const int32_t* acc, int64_t acc_stride, int64_t rows, int64_t n, const float* sx, const float* sw,
                  const float* bias, float* out, int64_t out_stride) {
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t c = 0; c < n; ++c) {
      const float v = static_cast<float>(acc[m * acc_stride + c]) * sx[m] * sw[c];
      out[m * out_stride + c] = bias ? v + bias[c] : v;
    }
}

// Every panel of the product of q (rows x kp int16) and the packed weight: fp32 outputs (out) or raw int32 (out_s32)
void gemm(int isa, const int16_t* q, int64_t rows, int64_t kp, const int8_t* packed, int64_t n, const float* sx,
          const float* sw, const float* bias, float* out, int32_t* out_s32, int64_t out_stride, int threads) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t n0 = p * kPanel, cols = min64(kPanel, n - n0);
    const int8_t* panel = packed + p * kp * kPanel;
    const float* bias_p = bias ? bias + n0 : nullptr;
    const float* sw_p = sw ? sw + n0 : nullptr;
    float* out_p = out ? out + n0 : nullptr;
    int32_t* s32_p = out_s32 ? out_s32 + n0 : nullptr;
#ifdef I8_X86
    if (isa == I8_ISA_AVX2) {
      const int8_t* next = p + 1 < panels ? panel + kp * kPanel : nullptr;
      panel_rows_avx2(q, rows, kp, panel, next, sx, sw_p, bias_p, cols, out_p, s32_p, out_stride);
      continue;
    }
#endif
    std::vector<int32_t> acc(static_cast<size_t>(rows * kPanel));
    panel_rows_portable(q, rows, kp, panel, cols, acc.data(), kPanel);
    if (s32_p) {
      for (int64_t m = 0; m < rows; ++m) std::memcpy(s32_p + m * out_stride, acc.data() + m * kPanel, cols * 4);
    } else {
      scale_output(acc.data(), kPanel, rows, cols, sx, sw_p, bias_p, out_p, out_stride);
    }
  }
}

}  // namespace

extern "C" {

int i8_abi_version(void) { return 6; }

// Whether this CPU runs the path `isa` (I8_ISA_*): the portable one always, AVX2 (+ FMA), AVX512-VNNI (+ F, BW,
// VL) and AVX-VNNI (where the compiler could build it) by cpuid, the emulated AVX-VNNI path wherever AVX2 runs, ARM
// dotprod and i8mm by the kernel's HWCAP_ASIMDDP and HWCAP2_I8MM, the emulated i8mm path everywhere.
int i8_has_isa(int isa) { return has_isa(isa); }

// q[m, :k] = the reference quantizer's int8 row (+ offset: 0, or 128 for oneDNN's unsigned input), zeros to
// q_stride; scale[m] = s_x. x rows are x_stride floats apart.
void i8_quantize_rows(int isa, const float* x, int64_t rows, int64_t k, int64_t x_stride, int offset, int8_t* q,
                      int64_t q_stride, float* scale) {
  quantize_rows(isa, x, rows, k, x_stride, offset, q, q_stride, scale);
}

// out[m, n] = fl(fl(acc[m, n] * sx[m]) * sw[n]) (+ bias[n]) for an fp32 (`acc_is_int32` = 0) or int32 accumulator
// holding exact integers; out may be acc (fp32, in place). Row strides in elements.
void i8_scale_output(const void* acc, int acc_is_int32, int64_t acc_stride, int64_t rows, int64_t n, const float* sx,
                     const float* sw, const float* bias, float* out, int64_t out_stride) {
  if (acc_is_int32) {
    scale_output(static_cast<const int32_t*>(acc), acc_stride, rows, n, sx, sw, bias, out, out_stride);
    return;
  }
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t c = 0; c < n; ++c) {
      const float v = static_cast<const float*>(acc)[m * acc_stride + c] * sx[m] * sw[c];
      out[m * out_stride + c] = bias ? v + bias[c] : v;
    }
}

// The fused W8A8 linear: quantize x (rows x k, row stride x_stride) per token, multiply by the packed weight (n
// columns, kp inputs, see the layout above) exactly, and write fl(fl(acc * s_x) * s_w) (+ bias) to out (row stride
// out_stride). `threads` > 1 splits the panels over OpenMP threads. Returns 0, or -1 for bad arguments.
int i8_linear(int isa, const float* x, int64_t rows, int64_t k, int64_t x_stride, const int8_t* packed, int64_t n,
              int64_t kp, const float* sw, const float* bias, float* out, int64_t out_stride, int threads) {
  if (kp % 4 != 0 || kp < k || rows < 0 || n < 0 || !has_isa(isa) || (mmla_layout(isa) && kp % 8 != 0) ||
      (isa == I8_ISA_AMX && kp % 64 != 0))
    return -1;
  thread_local std::vector<float> sx;
  sx.resize(static_cast<size_t>(rows));
  if (mmla_layout(isa)) {
    thread_local std::vector<int8_t> q8;
    q8.resize(static_cast<size_t>(rows * kp));
    quantize_rows(I8_ISA_PORTABLE, x, rows, k, x_stride, 0, q8.data(), kp, sx.data());
    const MmlaCall call{q8.data(), rows, kp, packed, n, sx.data(), sw, bias, out, nullptr, out_stride};
    gemm_mmla(isa, call, threads);
    return 0;
  }
#ifdef I8_X86
  if (vnni_layout(isa)) {
    thread_local std::vector<int8_t> q8;
    thread_local std::vector<int32_t> comp;
    q8.resize(static_cast<size_t>(rows * kp));
    comp.resize(static_cast<size_t>(rows));
    quantize_rows(isa, x, rows, k, x_stride, 0, q8.data(), kp, sx.data());
    for (int64_t m = 0; m < rows; ++m) comp[m] = 128 * row_sum(q8.data() + m * kp, kp);
    const VnniCall call{q8.data(), rows, kp, reinterpret_cast<const uint8_t*>(packed), n, comp.data(), sx.data(),
                        sw, bias, out, nullptr, out_stride};
    gemm_vnni_layout(isa, call, threads);
    return 0;
  }
#endif
#ifdef I8_ARM
  if (isa == I8_ISA_DOTPROD) {
    thread_local std::vector<int8_t> q8;
    q8.resize(static_cast<size_t>(rows * kp));
    quantize_rows(I8_ISA_PORTABLE, x, rows, k, x_stride, 0, q8.data(), kp, sx.data());
    gemm_dotprod(q8.data(), rows, kp, packed, n, sx.data(), sw, bias, out, nullptr, out_stride, threads);
    return 0;
  }
#endif
  thread_local std::vector<int16_t> q;
  q.resize(static_cast<size_t>(rows * kp));
  quantize_rows(isa, x, rows, k, x_stride, 0, q.data(), kp, sx.data());
  gemm(isa, q.data(), rows, kp, packed, n, sx.data(), sw, bias, out, nullptr, out_stride, threads);
  return 0;
}

// Lay the int8 weight w (n x k, row-major) out for `isa` (see the layouts above): pairs of inputs per column for
// the AVX2 and portable paths, groups of 4 as w + 128 for VNNI and AVX-VNNI and as w for ARM dotprod, groups of 8
// by column pairs for i8mm; padding columns and inputs hold zero weights.
// packed holds ceil(n / 16) * 16 * kp bytes; kp >= k, a multiple of 4 (of 8 for i8mm). Returns 0, or -1 for bad
// arguments.
int i8_pack(int isa, const int8_t* w, int64_t n, int64_t k, int64_t kp, uint8_t* packed) {
  if (kp % 4 != 0 || kp < k || n < 0 || (mmla_layout(isa) && kp % 8 != 0) ||
      (isa == I8_ISA_AMX && kp % 64 != 0))
    return -1;
  if (mmla_layout(isa)) {  // panel, group of 8 inputs, column pair, column of the pair, input within the group
    uint8_t* out = packed;
    for (int64_t p = 0; p < (n + kPanel - 1) / kPanel; ++p)
      for (int64_t i0 = 0; i0 < kp; i0 += 8)
        for (int64_t row = p * kPanel; row < (p + 1) * kPanel; ++row)
          for (int64_t i = i0; i < i0 + 8; ++i) *out++ = static_cast<uint8_t>(row < n && i < k ? w[row * k + i] : 0);
    return 0;
  }
  const int64_t group = vnni_layout(isa) || isa == I8_ISA_DOTPROD ? 4 : 2;
  const int offset = vnni_layout(isa) ? 128 : 0;
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const uint32_t flip = offset ? 0x80808080u : 0u;  // (w + 128) as a byte is w's byte with its top bit flipped
  uint8_t* out = packed;  // written in order: panel, group of inputs, column, input within the group
  for (int64_t p = 0; p < panels; ++p) {
    const bool full_panel = (p + 1) * kPanel <= n;
    for (int64_t i0 = 0; i0 < kp; i0 += group) {
      if (full_panel && i0 + group <= k) {  // no padding: each column's group is one copy (the 16 rows' cache
        for (int64_t row = p * kPanel; row < (p + 1) * kPanel; ++row, out += group) {  // lines serve 16 groups)
          if (group == 4) {
            uint32_t four;
            std::memcpy(&four, w + row * k + i0, 4);
            four ^= flip;
            std::memcpy(out, &four, 4);
          } else {
            std::memcpy(out, w + row * k + i0, 2);  // group 2: the AVX2 and portable layouts, no offset
          }
        }
        continue;
      }
      for (int64_t row = p * kPanel; row < (p + 1) * kPanel; ++row)
        for (int64_t i = i0; i < i0 + group; ++i) *out++ = static_cast<uint8_t>((row < n && i < k ? w[row * k + i] : 0) + offset);
    }
  }
  return 0;
}

// The exact integer product alone, for tests: acc[m, n] = sum_k q[m, k] * w[n, k] (int32) for any int8 q (rows x
// kp, zero padding) and the weight packed as above.
int i8_gemm_s32(int isa, const int8_t* q, int64_t rows, int64_t kp, const int8_t* packed, int64_t n, int32_t* acc,
                int64_t acc_stride) {
  if (kp % 4 != 0 || rows < 0 || n < 0 || !has_isa(isa) || (mmla_layout(isa) && kp % 8 != 0) ||
      (isa == I8_ISA_AMX && kp % 64 != 0))
    return -1;
  if (mmla_layout(isa)) {
    const MmlaCall call{q, rows, kp, packed, n, nullptr, nullptr, nullptr, nullptr, acc, acc_stride};
    gemm_mmla(isa, call, 1);
    return 0;
  }
#ifdef I8_X86
  if (vnni_layout(isa)) {
    std::vector<int32_t> comp(static_cast<size_t>(rows));
    for (int64_t m = 0; m < rows; ++m) comp[m] = 128 * row_sum(q + m * kp, kp);
    const VnniCall call{q,       rows,    kp,      reinterpret_cast<const uint8_t*>(packed), n, comp.data(), nullptr,
                        nullptr, nullptr, nullptr, acc, acc_stride};
    gemm_vnni_layout(isa, call, 1, /*tiles_always=*/true);
    return 0;
  }
#endif
#ifdef I8_ARM
  if (isa == I8_ISA_DOTPROD) {
    gemm_dotprod(q, rows, kp, packed, n, nullptr, nullptr, nullptr, nullptr, acc, acc_stride, 1);
    return 0;
  }
#endif
  const std::vector<int16_t> wide(q, q + rows * kp);
  gemm(isa, wide.data(), rows, kp, packed, n, nullptr, nullptr, nullptr, nullptr, acc, acc_stride, 1);
  return 0;
}

}  // extern "C"
