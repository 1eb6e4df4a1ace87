// fp32 helpers shared by our C++ kernels (rollout_workers/embedded/csrc/, learner/csrc/; common/native_build.py puts
// this folder on the include path and counts this file in each library's cache digest). Sums run in 8 fixed lanes
// and every element's arithmetic is a fixed sequence of fp32 operations (the build passes -ffp-contract=off), so a
// caller compiled for any ISA, vectorized or not, gets the same bits. Always inlined: each caller compiles them for
// its own target.
#pragma once

#include <cstdint>

#define FP32_INLINE inline __attribute__((always_inline))

namespace fp32_lanes {

FP32_INLINE float dot(const float* __restrict__ a, const float* __restrict__ b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  float total = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

// (restrict allows the two read-only arguments to be the same array)
FP32_INLINE float sum_squares(const float* x, int64_t n) { return dot(x, x, n); }

// exp(x) for x <= 0, Cephes' expf: a degree-6 polynomial on the remainder after n * ln 2, scaled by 2^n through the
// exponent bits (within 2 ulp of expf). Branch-free and call-free, so a loop of it can vectorize where a loop of
// expf calls cannot. The clamp is fmaxf(x, -87) (NaN gives -87) written as a select.
FP32_INLINE float exp_nonpositive(float x) {
  x = x > -87.0f ? x : -87.0f;
  // n = x / ln 2 rounded to the nearest integer (adding and subtracting 1.5 * 2^23 rounds in fp32, branch-free)
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  const float scale = __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
  return y * scale;
}

}  // namespace fp32_lanes
