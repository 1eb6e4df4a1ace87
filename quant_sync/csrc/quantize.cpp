// The publication's int8 quantizer on CPU: symmetric per-row int8 of an fp32 weight (what quant_sync publishes each
// step) and its squared error against the weight (norm_quant_err), one pass over a row each where torch's ops make
// six and five (abs, amax, divide, round, clamp, cast; dequantize, subtract, square, sum, and the weight's squares).
//
// Built and loaded by quant_sync/native.py (common/native_build.py compiles it: plain C ABI, no torch headers).
// Pointers are to contiguous row-major memory. Each loop is one inline body compiled for AVX-512F, AVX2 and the
// baseline ISA (function-level target attributes); the caller picks with `isa` (qs_isa() or lower). Rows are
// independent, so any thread count gives the same bits.
//
// qs_int8_rows gives torch's bits (quant_sync.quantizers.quantize_int8_rows): scale = max|w| / 127 in fp32 (1 where
// that is not > 0), q = rint(w / scale) (an fp32 division, ties to even) clamped to [-127, 127]. A row holding a NaN
// or an infinity is left to torch (the count of such rows is returned; torch's NaN semantics are its own).
// qs_int8_error sums each row's (q * scale - w)^2 and w^2 in 8 fixed fp32 lanes (the build passes
// -ffp-contract=off), as double per row: a metric, in another summation order than torch's.
#include <cstdint>

#include "isa_variants.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")  // the selects below become vector max and blend instructions
#endif

#define QS_INLINE inline __attribute__((always_inline))

namespace {

constexpr float kInt8Max = 127.0f;
constexpr int64_t kParallelMin = 1 << 16;  // elements below which a call runs on one thread
constexpr int kErrorBlock = 64;            // elements of a row_error block

typedef uint32_t __attribute__((may_alias)) bits32;

// max |w| of a row; false where it holds a NaN or an infinity. Without its sign bit a float's bits order as the
// float does (an unsigned max vectorizes where a float select may not), and every NaN and infinity is at or above
// the bits of infinity.
QS_INLINE bool row_amax(const float* __restrict__ w, int64_t n, float* amax) {
  const bits32* bits = reinterpret_cast<const bits32*>(w);
  uint32_t top = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = bits[i] & 0x7fffffffu;
    top = b > top ? b : top;
  }
  if (top >= 0x7f800000u) return false;
  __builtin_memcpy(amax, &top, sizeof(top));
  return true;
}

QS_INLINE void row_int8(const float* __restrict__ w, int64_t n, float scale, int8_t* __restrict__ q) {
  for (int64_t i = 0; i < n; ++i) {
    float r = __builtin_rintf(w[i] / scale);
    r = r < -kInt8Max ? -kInt8Max : r;
    r = r > kInt8Max ? kInt8Max : r;
    q[i] = static_cast<int8_t>(static_cast<int>(r));
  }
}

typedef float v8f __attribute__((vector_size(32)));  // 8 fp32 lanes: ymm, or two xmm on the baseline

QS_INLINE float lanes_total(v8f a) { return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])); }

// (sum of (q * scale - w)^2, sum of w^2) of a row, each in 8 fp32 lanes.
QS_INLINE void row_error(const float* __restrict__ w, const int8_t* __restrict__ q, int64_t n, float scale,
                         double* err, double* norm) {
  v8f e = {0, 0, 0, 0, 0, 0, 0, 0}, s = {0, 0, 0, 0, 0, 0, 0, 0};
  float deq[kErrorBlock];  // the block's q * scale, converted in a loop of its own (it vectorizes)
  int64_t i = 0;
  for (; i + kErrorBlock <= n; i += kErrorBlock) {
    for (int k = 0; k < kErrorBlock; ++k) deq[k] = static_cast<float>(q[i + k]) * scale;
    for (int k = 0; k < kErrorBlock; k += 8) {
      v8f v, d;
      __builtin_memcpy(&v, w + i + k, sizeof(v));
      __builtin_memcpy(&d, deq + k, sizeof(d));
      d -= v;
      e += d * d;
      s += v * v;
    }
  }
  float te = lanes_total(e), ts = lanes_total(s);
  for (; i < n; ++i) {
    const float v = w[i], d = static_cast<float>(q[i]) * scale - v;
    te += d * d;
    ts += v * v;
  }
  *err = te;
  *norm = ts;
}

// One row: its scale and int8 values; false (nothing written) where it holds a NaN or an infinity.
QS_INLINE bool int8_row(const float* w, int64_t cols, int8_t* q, float* scale) {
  float amax;
  if (!row_amax(w, cols, &amax)) return false;
  const float s = amax / kInt8Max;
  *scale = s > 0.0f ? s : 1.0f;
  row_int8(w, cols, *scale, q);
  return true;
}

inline int team(int threads, int64_t work) { return threads > 1 && work >= kParallelMin ? threads : 1; }

}  // namespace

extern "C" {

int qs_abi_version() { return 1; }

// The best vector path this CPU runs: 2 AVX-512F, 1 AVX2, 0 the baseline.
int qs_isa() { return isa_variants_best(); }

// Rows of `w` (rows x cols) to int8 `q` and `scale` (rows,); returns the rows left unwritten (a NaN or infinity).
int64_t qs_int8_rows(int isa, const float* w, int64_t rows, int64_t cols, int8_t* q, float* scale, int threads) {
  int64_t poisoned = 0;
#pragma omp parallel for schedule(static) num_threads(team(threads, rows * cols)) reduction(+ : poisoned)
  for (int64_t r = 0; r < rows; ++r) {
    bool ok = true;
    ISA_VARIANTS(ok = int8_row(w + r * cols, cols, q + r * cols, scale + r))
    poisoned += ok ? 0 : 1;
  }
  return poisoned;
}

// Per row of `w`: err = sum (q * scale - w)^2, norm = sum w^2.
void qs_int8_error(int isa, const float* w, const int8_t* q, const float* scale, int64_t rows, int64_t cols,
                   double* err, double* norm, int threads) {
#pragma omp parallel for schedule(static) num_threads(team(threads, rows * cols))
  for (int64_t r = 0; r < rows; ++r) {
    ISA_VARIANTS(row_error(w + r * cols, q + r * cols, cols, scale[r], err + r, norm + r))
  }
}

}  // extern "C"
