// FP8 (e4m3) W8A8 kernels for the embedded engine: per-token activation quantization onto the e4m3 grid, and a
// GEMM on AVX512-BF16 whose products are exact, with the numerics of quant_sync.quantizers (`fp8`, `fp8_trunc`).
//
// Built once per machine by rollout_workers/embedded/fp8_linear.py with the system C++ compiler and called through
// ctypes (as csrc/int8_gemm.cpp). Compiled with -ffp-contract=off.
//
// Quantization, bit for bit quantize_fp8_rows (and fp8_round_toward_zero for `fp8_trunc`):
//   s_x[m] = max_k |x[m, k]| / 448 (fp32 division), 1 where that is not > 0;  v = clamp(x / s_x, -448, 448);
//   fp8:  q = v rounded to the nearest e4m3 value, ties to even (below 2^-6: to a multiple of 2^-9; above: to 3
//         mantissa bits), as c10's float -> float8_e4m3fn conversion does;
//   fp8_trunc: q = that value, or the next e4m3 value toward zero where |q| > |v| * (1 + 2^-20) in fp32.
// Every e4m3 value has at most 4 significant bits, so it is exact in fp32 and in bf16 (the high half of its fp32
// bits): i8-style integer tricks are not needed for exact operands. The product of two such values has at most 8
// significant bits and is exact in fp32; vdpbf16ps multiplies pairs of bf16 and adds the exact products into fp32
// accumulators, so the GEMM is an fp32 sum of exact products, as the reference `q_x.float() @ q_w.float().t()` is:
// only the summation order differs (results agree to fp32 rounding). Values stay far from fp32 denormals (|q| >=
// 2^-9, products >= 2^-18), where vdpbf16ps would flush.
//   out[m, n] = fl(fl(acc * s_x[m]) * s_w[n]) (+ bias[n]).
//
// Weight layout (f8_pack_bf16): panels of 16 output columns; for each pair of inputs k2, 16 columns x 2
// bf16: packed[((p * (kp / 2) + k2) * 16 + c) * 2 + j] = bf16(w[16 p + c, 2 k2 + j]) (0 beyond N or K).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define F8_X86 1
#define F8_BF16 __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#endif

#define F8_ISA_PORTABLE 0
#define F8_ISA_BF16 1
#define F8_OUT_FP32 0
#define F8_OUT_BF16 1

namespace {

constexpr float kFp8Max = 448.0f;
constexpr float kTruncTolerance = 1.0f + 1.0f / 1048576.0f;  // quant_sync.quantizers.TRUNC_TOLERANCE, exact
constexpr float kSmallestNormal = 1.0f / 64.0f;              // 2^-6: below it e4m3 steps by 2^-9
constexpr float kSubnormalMagic = 16384.0f;                  // 2^14: x + 2^14 rounds x to a multiple of 2^-9
constexpr int kPanel = 16;
constexpr int kRows = 4;    // activation rows per micro-kernel call
constexpr int kPanels = 4;  // panels per micro-kernel call

inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float nonzero_scale(float amax) {
  const float scale = amax / kFp8Max;
  return scale > 0.0f ? scale : 1.0f;
}

// |v| <= 448 onto the e4m3 grid (nearest, ties to even), sign kept; toward zero past the tolerance with `trunc`
inline float e4m3_portable(float v, bool trunc) {
  const uint32_t sign = bits_of(v) & 0x80000000u;
  const float a = std::fabs(v);
  float r;
  if (a < kSmallestNormal) {
    r = (a + kSubnormalMagic) - kSubnormalMagic;  // IEEE: the add rounds (ties to even); the subtraction is exact
  } else {
    const uint32_t b = bits_of(a);
    r = float_of((b + 0x7FFFFu + ((b >> 20) & 1u)) & 0xFFF00000u);
  }
  if (trunc && r > a * kTruncTolerance) r = r <= kSmallestNormal ? r - 1.0f / 512.0f : float_of(bits_of(r) - (1u << 20));
  return float_of(bits_of(r) | sign);
}

void quantize_row_portable(const float* x, int64_t k, bool trunc, int out_kind, void* q, float* scale) {
  float amax = 0.0f;  // NaN once a NaN is seen (torch's amax; nonzero_scale then gives 1 and the NaN stays NaN)
  for (int64_t i = 0; i < k; ++i) amax = std::fabs(x[i]) > amax || std::isnan(x[i]) ? std::fabs(x[i]) : amax;
  const float s = nonzero_scale(amax);
  *scale = s;
  for (int64_t i = 0; i < k; ++i) {
    float v = x[i] / s;
    v = v < -kFp8Max ? -kFp8Max : (v > kFp8Max ? kFp8Max : v);
    const float r = e4m3_portable(v, trunc);
    if (out_kind == F8_OUT_BF16) {
      static_cast<uint16_t*>(q)[i] = static_cast<uint16_t>(bits_of(r) >> 16);
    } else {
      static_cast<float*>(q)[i] = r;
    }
  }
}

#ifdef F8_X86
F8_BF16 inline __m512 e4m3_avx512(__m512 v, bool trunc) {
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(int(0x80000000u)));
  const __m512 a = _mm512_abs_ps(v);
  const __m512i b = _mm512_castps_si512(a);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 20), _mm512_set1_epi32(1));
  const __m512i normal = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFFF)), odd),
                                          _mm512_set1_epi32(int(0xFFF00000u)));
  const __m512 magic = _mm512_set1_ps(kSubnormalMagic);
  const __m512 small = _mm512_sub_ps(_mm512_add_ps(a, magic), magic);
  const __mmask16 is_small = _mm512_cmp_ps_mask(a, _mm512_set1_ps(kSmallestNormal), _CMP_LT_OQ);
  __m512 r = _mm512_mask_blend_ps(is_small, _mm512_castsi512_ps(normal), small);
  if (trunc) {
    const __mmask16 over = _mm512_cmp_ps_mask(r, _mm512_mul_ps(a, _mm512_set1_ps(kTruncTolerance)), _CMP_GT_OQ);
    const __mmask16 low = _mm512_cmp_ps_mask(r, _mm512_set1_ps(kSmallestNormal), _CMP_LE_OQ);
    const __m512 step_low = _mm512_sub_ps(r, _mm512_set1_ps(1.0f / 512.0f));
    const __m512 step_high = _mm512_castsi512_ps(_mm512_sub_epi32(_mm512_castps_si512(r), _mm512_set1_epi32(1 << 20)));
    r = _mm512_mask_blend_ps(over, r, _mm512_mask_blend_ps(low, step_high, step_low));
  }
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(r), sign));
}

F8_BF16 void quantize_row_avx512(const float* x, int64_t k, bool trunc, int out_kind, void* q, float* scale) {
  __m512 amax_v = _mm512_setzero_ps();
  __mmask16 nan = 0;  // vmaxps drops a NaN (it returns its second operand): counted apart, as torch's amax keeps it
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    amax_v = _mm512_max_ps(_mm512_abs_ps(v), amax_v);
  }
  float amax = nan ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(amax_v);
  for (; i < k; ++i) amax = std::fabs(x[i]) > amax || std::isnan(x[i]) ? std::fabs(x[i]) : amax;
  const float s = nonzero_scale(amax);
  *scale = s;
  const __m512 sv = _mm512_set1_ps(s), lo = _mm512_set1_ps(-kFp8Max), hi = _mm512_set1_ps(kFp8Max);
  for (i = 0; i < k; i += 16) {
    const __mmask16 mask = k - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (k - i)) - 1);
    __m512 v = _mm512_div_ps(_mm512_maskz_loadu_ps(mask, x + i), sv);
    v = e4m3_avx512(_mm512_min_ps(hi, _mm512_max_ps(lo, v)), trunc);  // this operand order keeps a NaN
    if (out_kind == F8_OUT_BF16) {
      const __m256i high = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16));
      _mm256_mask_storeu_epi16(static_cast<uint16_t*>(q) + i, mask, high);
    } else {
      _mm512_mask_storeu_ps(static_cast<float*>(q) + i, mask, v);
    }
  }
}

struct Call {  // one product's operands (see f8_linear)
  const uint16_t* q;
  int64_t rows, kp;
  const uint16_t* packed;
  int64_t n;
  const float *sx, *sw, *bias;
  float* out;
  int64_t out_stride;
};

template <int MR, int NR>
F8_BF16 void block_bf16(const Call& a, int64_t m, int64_t p) {
  const uint16_t* q = a.q + m * a.kp;
  const uint16_t* panel = a.packed + p * a.kp * kPanel;
  const int64_t panel_elems = a.kp * kPanel, n0 = p * kPanel;
  __m512 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k2 = 0; k2 < a.kp / 2; ++k2) {
    __m512i w[NR];
    for (int j = 0; j < NR; ++j) w[j] = _mm512_loadu_si512(panel + j * panel_elems + k2 * 32);
    for (int r = 0; r < MR; ++r) {
      int32_t pair;  // q[r, 2 k2] and q[r, 2 k2 + 1] as bf16, in every lane
      std::memcpy(&pair, q + r * a.kp + k2 * 2, 4);
      const __m512i xb = _mm512_set1_epi32(pair);
      for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)w[j], (__m512bh)xb);
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int j = 0; j < NR; ++j) {
      const int64_t col = n0 + kPanel * j, valid = min64(kPanel, a.n - col);
      const __mmask16 mask = valid >= kPanel ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
      __m512 v = _mm512_mul_ps(_mm512_mul_ps(acc[r][j], _mm512_set1_ps(a.sx[m + r])),
                               _mm512_maskz_loadu_ps(mask, a.sw + col));
      if (a.bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, a.bias + col));
      _mm512_mask_storeu_ps(a.out + (m + r) * a.out_stride + col, mask, v);
    }
  }
}

template <int MR, int NR>
F8_BF16 void row_tail(const Call& a, int64_t m, int64_t p, int64_t left) {
  if constexpr (MR > 0) {
    if (left == MR) return block_bf16<MR, NR>(a, m, p);
    row_tail<MR - 1, NR>(a, m, p, left);
  }
}

template <int NR>
F8_BF16 void panel_group(const Call& a, int64_t p) {
  int64_t m = 0;
  for (; m + kRows <= a.rows; m += kRows) block_bf16<kRows, NR>(a, m, p);
  if (m < a.rows) row_tail<kRows - 1, NR>(a, m, p, a.rows - m);
}

template <int NR>
F8_BF16 void panel_tail(const Call& a, int64_t p, int64_t left) {
  if constexpr (NR > 0) {
    if (left == NR) return panel_group<NR>(a, p);
    panel_tail<NR - 1>(a, p, left);
  }
}

F8_BF16 void gemm_bf16(const Call& a, int threads) {
  const int64_t panels = (a.n + kPanel - 1) / kPanel, groups = (panels + kPanels - 1) / kPanels;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t p = g * kPanels, left = min64(kPanels, panels - p);
    if (left == kPanels) {
      panel_group<kPanels>(a, p);
    } else {
      panel_tail<kPanels - 1>(a, p, left);
    }
  }
}
#endif  // F8_X86

bool has_isa(int isa) {
  if (isa == F8_ISA_PORTABLE) return true;
#ifdef F8_X86
  __builtin_cpu_init();
  if (isa == F8_ISA_BF16)
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bf16");
#endif
  return false;
}

void quantize_rows(int isa, const float* x, int64_t rows, int64_t k, int64_t x_stride, bool trunc, int out_kind,
                   void* q, int64_t q_stride, float* scale) {
  const int64_t elem = out_kind == F8_OUT_BF16 ? 2 : 4;
  for (int64_t m = 0; m < rows; ++m) {
    char* qm = static_cast<char*>(q) + m * q_stride * elem;
#ifdef F8_X86
    if (isa == F8_ISA_BF16) {
      quantize_row_avx512(x + m * x_stride, k, trunc, out_kind, qm, scale + m);
    } else
#endif
    {
      quantize_row_portable(x + m * x_stride, k, trunc, out_kind, qm, scale + m);
    }
    std::memset(qm + k * elem, 0, (q_stride - k) * elem);  // padding inputs: zero
  }
}

}  // namespace

extern "C" {

int f8_abi_version(void) { return 2; }

// Whether this CPU runs the path `isa` (F8_ISA_*): the portable one always, AVX512-BF16 (+ F, BW, VL, DQ) by cpuid.
int f8_has_isa(int isa) { return has_isa(isa); }

// q[m, :k] = the reference quantizer's e4m3 row as fp32 (out_kind 0) or bf16 bits (1), zeros to q_stride;
// scale[m] = s_x. `trunc`: fp8_trunc's rounding toward zero.
void f8_quantize_rows(int isa, const float* x, int64_t rows, int64_t k, int64_t x_stride, int trunc, int out_kind,
                      void* q, int64_t q_stride, float* scale) {
  quantize_rows(isa, x, rows, k, x_stride, trunc != 0, out_kind, q, q_stride, scale);
}

// out[m, n] = fl(fl(acc[m, n] * sx[m]) * sw[n]) (+ bias[n]), in place (row stride `stride`).
void f8_scale_output(float* acc, int64_t stride, int64_t rows, int64_t n, const float* sx, const float* sw,
                     const float* bias) {
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t c = 0; c < n; ++c) {
      const float v = acc[m * stride + c] * sx[m] * sw[c];
      acc[m * stride + c] = bias ? v + bias[c] : v;
    }
}

// The fp32 value of each e4m3fn byte code (NaN for 0x7F / 0xFF), exact.
float e4m3_value(uint8_t code) {
  const int exponent = (code >> 3) & 15, mantissa = code & 7;
  if ((code & 0x7F) == 0x7F) return NAN;
  const float magnitude = exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -9)
                                        : std::ldexp(1.0f + static_cast<float>(mantissa) / 8.0f, exponent - 7);
  return code & 0x80 ? -magnitude : magnitude;
}

// w (n x k e4m3fn bytes) -> fp32 values (n x k), exact.
void f8_upcast(const uint8_t* w, int64_t count, float* out) {
  float table[256];
  for (int code = 0; code < 256; ++code) table[code] = e4m3_value(static_cast<uint8_t>(code));
  for (int64_t i = 0; i < count; ++i) out[i] = table[w[i]];
}

// w (n x k e4m3fn bytes) -> the bf16 layout above (kp >= k, even; zero padding). Returns 0, or -1.
int f8_pack_bf16(const uint8_t* w, int64_t n, int64_t k, int64_t kp, uint16_t* packed) {
  if (kp % 2 != 0 || kp < k || n < 0) return -1;
  uint16_t table[256];
  for (int code = 0; code < 256; ++code) table[code] = static_cast<uint16_t>(bits_of(e4m3_value(uint8_t(code))) >> 16);
  const int64_t panels = (n + kPanel - 1) / kPanel;
  uint16_t* out = packed;  // written in order: panel, pair of inputs, column, input within the pair
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t i0 = 0; i0 < kp; i0 += 2)
      for (int64_t row = p * kPanel; row < (p + 1) * kPanel; ++row)
        for (int64_t i = i0; i < i0 + 2; ++i) *out++ = row < n && i < k ? table[w[row * k + i]] : 0;
  return 0;
}

// The fused FP8 linear on AVX512-BF16: quantize x (rows x k) per token, multiply by the packed bf16 weight (n
// columns, kp inputs, kp even) with fp32 accumulation, write fl(fl(acc * s_x) * s_w) (+ bias) to out. Returns 0, or
// -1 for bad arguments or a CPU without the instructions.
int f8_linear(int isa, const float* x, int64_t rows, int64_t k, int64_t x_stride, int trunc, const uint16_t* packed,
              int64_t n, int64_t kp, const float* sw, const float* bias, float* out, int64_t out_stride, int threads) {
  if (isa != F8_ISA_BF16 || !has_isa(isa) || kp % 2 != 0 || kp < k || rows < 0 || n < 0) return -1;
#ifdef F8_X86
  thread_local std::vector<uint16_t> q;
  thread_local std::vector<float> sx;
  q.resize(static_cast<size_t>(rows * kp));
  sx.resize(static_cast<size_t>(rows));
  quantize_rows(isa, x, rows, k, x_stride, trunc != 0, F8_OUT_BF16, q.data(), kp, sx.data());
  const Call call{q.data(), rows, kp, packed, n, sx.data(), sw, bias, out, out_stride};
  gemm_bf16(call, threads);
  return 0;
#else
  return -1;
#endif
}

}  // extern "C"
