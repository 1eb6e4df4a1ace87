// One call compiled for each vector path and run on the one `isa` picks (2 AVX-512F, 1 AVX2, 0 the baseline): the
// callee's always-inline helpers inherit each lambda's target (learner/csrc/train_ops.cpp,
// quant_sync/csrc/quantize.cpp). Needs an int `isa` in scope. GCC on x86-64 only; elsewhere the baseline call.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ISA_VARIANTS(CALL)                              \
  if (isa >= 2) {                                       \
    [&]() __attribute__((target("avx512f"))) { CALL; }(); \
  } else if (isa >= 1) {                                \
    [&]() __attribute__((target("avx2"))) { CALL; }();    \
  } else {                                              \
    CALL;                                               \
  }
#else
#define ISA_VARIANTS(CALL) CALL;
#endif

// The best of those paths this CPU runs: 2 AVX-512F, 1 AVX2, 0 the baseline.
inline int isa_variants_best() {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return 2;
  if (__builtin_cpu_supports("avx2")) return 1;
#endif
  return 0;
}
