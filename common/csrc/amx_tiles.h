// Intel AMX's tile configuration and Linux's permission for tile data, shared by the kernels that run tiles
// (rollout_workers/embedded/csrc/int8_gemm.cpp: AMX-INT8; lora_gemm.cpp: AMX-BF16). x86-64 with GCC 11 or clang 12
// and later only (AMX_TILES_COMPILER); each kernel adds its own cpuid bits and target attributes.
#pragma once

#if defined(__x86_64__) && ((defined(__clang__) && __clang_major__ >= 12) || \
                            (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define AMX_TILES_COMPILER 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

struct alignas(64) AmxTileConfig {  // the 64-byte operand of LDTILECFG, palette 1
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// LDTILECFG of `config`. The compiler does not see LDTILECFG read the stores that filled it: GCC 12 dropped them as
// dead where the filling function was not inlined (a SIGILL at the first tile instruction), hence the barrier.
__attribute__((target("amx-tile"))) inline void amx_load_config(const AmxTileConfig& config) {
  __asm__ volatile("" : : "m"(config) : "memory");
  _tile_loadconfig(&config);
}

// cpuid leaf 7 EDX has every bit of `edx_bits` (AMX-TILE is bit 24, AMX-INT8 25, AMX-BF16 22), and Linux granted
// this process its tile data (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); refused by a kernel older than
// 5.16). Both asked once a process: a kernel call may ask this, and in a VM each cpuid traps to the hypervisor (asked
// on every LoRA call it cost about 20 us a call).
inline bool amx_available(unsigned edx_bits) {
  static const unsigned permitted_edx = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return 0u;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0 ? edx : 0u;
  }();
  return (permitted_edx & edx_bits) == edx_bits;
}
#endif
