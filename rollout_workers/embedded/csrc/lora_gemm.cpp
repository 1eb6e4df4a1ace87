// LoRA's low-rank product for the embedded engine (rollout_workers/embedded/low_rank.py, add_low_rank):
//   low = x A^T          (rows x R: one pass over x for every member of a fused group, A stacked)
//   out[:, cols_i] += s_i * (low[:, ranks_i] bt_i)   (each member into its own output columns, in place)
// in fp32 with AVX-512F register tiles (explicit FMAs; summation order differs from MKL's: ~1e-7 relative).
// bt_i is member i's B^T (rank_i, n_i), unscaled, in panels of 32 columns (the subscriber decodes them so:
// quant_sync/adapter_buffers.py); s_i multiplies each output tile once, as peft scales its output (not B).
// Both halves run on the caller's thread count (the engine's torch threads: a worker's `rollout.threads`), split so
// that each output is summed by one thread in one order: the bits do not depend on the count.
// On an AMX CPU int8 adapters can run on AMX-BF16 tiles instead (lr_apply_q8_amx, below: "AMX-BF16, int8").
// Plain C ABI for ctypes. lr_apply returns 0 when done, -1 when this CPU lacks AVX-512F (the caller's torch path).
// lr_dequantize_rows and lr_dequantize_panels decode an int8 adapter version into those float32 layouts in one pass
// (any x86-64 CPU): each value is float(q) * s, one rounding, bit for bit torch's `q.float() * s`.
#include <algorithm>
#include <cstdint>
#include <immintrin.h>
#include <vector>

namespace {

bool has_avx512f() { return __builtin_cpu_supports("avx512f"); }

// Sixteen adapter values as fp32: float32 as they are, int8 (published with per-rank scales) converted exactly.
__attribute__((target("avx512f"))) inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f"))) inline __m512 load16(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// The first `count` (< 16) values, zeros after them.
__attribute__((target("avx512f"))) inline __m512 load_first(const float* p, int64_t count) {
    return _mm512_maskz_loadu_ps((__mmask16)((1u << count) - 1u), p);
}
__attribute__((target("avx512f"))) inline __m512 load_first(const int8_t* p, int64_t count) {
    alignas(16) int8_t bytes[16] = {};
    for (int64_t t = 0; t < count; ++t) bytes[t] = p[t];
    return load16(bytes);
}

// low[m, r] = dot(x[m, :k], a[r, :k]) (times sa[r] for int8 A) for a tile of MR rows x NR adapter rows.
template <int MR, int NR, typename T>
__attribute__((target("avx512f"))) void a_tile(const float* x, int64_t xs, const T* a, int64_t k, float* low,
                                               int64_t ls, const float* sa) {
    __m512 acc[MR][NR];
    #pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
        #pragma GCC unroll 8
        for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
    int64_t p = 0;
    for (; p + 16 <= k; p += 16) {
        __m512 av[NR];
        #pragma GCC unroll 8
        for (int j = 0; j < NR; ++j) av[j] = load16(a + j * k + p);
        #pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
            __m512 xv = _mm512_loadu_ps(x + i * xs + p);
            #pragma GCC unroll 8
            for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(xv, av[j], acc[i][j]);
        }
    }
    if (p < k) {
        __m512 av[NR];
        #pragma GCC unroll 8
        for (int j = 0; j < NR; ++j) av[j] = load_first(a + j * k + p, k - p);
        #pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
            __m512 xv = load_first(x + i * xs + p, k - p);
            #pragma GCC unroll 8
            for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(xv, av[j], acc[i][j]);
        }
    }
    #pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
        #pragma GCC unroll 8
        for (int j = 0; j < NR; ++j) {
            const float sum = _mm512_reduce_add_ps(acc[i][j]);
            low[i * ls + j] = sa ? sum * sa[j] : sum;
        }
}

// out[m, c] += s * sum_q low[m, q] * bt[q, c] for a tile of MR rows and the NP panels of 32 columns from column c0
// (the last of them may end past n). bp is bt packed in panels of 32 columns (panel t holds bt[:, 32t : 32t + 32] row
// after row, zero-padded: quant_sync/adapter_buffers.py writes them, or low_rank.py's _panels), so each panel streams
// in order (16 rows of bt read side by side, or masked loads, ran 10-20% slower); columns past n are computed on zeros
// and masked off at the store. For int8 panels `low` already holds B's per-rank scales. Two panels a tile (NP = 2)
// halve the broadcasts of `low` per multiply-add: the B half 0.96 -> 0.82 ms a step at the engine bench's shapes (8
// layers, 32 rows, one Zen 4 thread, hot caches). Every output's sum runs over q in order whatever the tile: the same
// bits for any NP, row tile or thread split.
template <int MR, int NP, typename T>
__attribute__((target("avx512f"))) void b_tile(const float* low, int64_t ls, const T* bp, int64_t rank, int64_t n,
                                               int64_t c0, float s, float* out, int64_t os) {
    const __m512 sv = _mm512_set1_ps(s);
    const T* panel = bp + (c0 / 32) * rank * 32;
    __m512 acc[MR][2 * NP];
    #pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
        #pragma GCC unroll 8
        for (int j = 0; j < 2 * NP; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t q = 0; q < rank; ++q) {
        __m512 b[2 * NP];
        #pragma GCC unroll 8
        for (int t = 0; t < NP; ++t) {
            b[2 * t] = load16(panel + t * rank * 32 + q * 32);
            b[2 * t + 1] = load16(panel + t * rank * 32 + q * 32 + 16);
        }
        #pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
            const __m512 l = _mm512_set1_ps(low[i * ls + q]);
            #pragma GCC unroll 8
            for (int j = 0; j < 2 * NP; ++j) acc[i][j] = _mm512_fmadd_ps(l, b[j], acc[i][j]);
        }
    }
    if (c0 + 32 * NP <= n) {  // out + s * acc, as peft scales its output (not B)
        #pragma GCC unroll 8
        for (int i = 0; i < MR; ++i)
            #pragma GCC unroll 8
            for (int j = 0; j < 2 * NP; ++j) {
                float* o = out + i * os + c0 + 16 * j;
                _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), _mm512_mul_ps(acc[i][j], sv)));
            }
        return;
    }
    #pragma GCC unroll 8
    for (int j = 0; j < 2 * NP; ++j) {  // the last columns, masked
        const int64_t left = n - c0 - 16 * j;
        const __mmask16 m = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1u);
        #pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
            float* o = out + i * os + c0 + 16 * j;
            _mm512_mask_storeu_ps(o, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, o), _mm512_mul_ps(acc[i][j], sv)));
        }
    }
}

// The B half of MR rows over one member's 64-column tiles [t0, t1) (a tile past its 32nd column: two panels).
template <int MR, typename T>
__attribute__((target("avx512f"))) void b_rows(const float* low, int64_t ls, const T* bp, int64_t rank, int64_t n,
                                               int64_t t0, int64_t t1, float s, float* out, int64_t os) {
    for (int64_t t = t0; t < t1; ++t) {
        if (64 * t + 32 < n) b_tile<MR, 2>(low, ls, bp, rank, n, 64 * t, s, out, os);
        else b_tile<MR, 1>(low, ls, bp, rank, n, 64 * t, s, out, os);
    }
}

// The B half of one member over its 64-column tiles [t0, t1): rows outer (4 at a time), columns inner, so that the
// output rows are walked in order (columns outer, rows inner: the adapters of a decode step 2-4% slower).
template <typename T>
__attribute__((target("avx512f"))) void b_block(const float* low, int64_t ls, const T* bp, int64_t rank, int64_t n,
                                                int64_t t0, int64_t t1, int64_t rows, float s, float* out, int64_t os) {
    int64_t m = 0;
    for (; m + 4 <= rows; m += 4) b_rows<4>(low + m * ls, ls, bp, rank, n, t0, t1, s, out + m * os, os);
    for (; m < rows; ++m) b_rows<1>(low + m * ls, ls, bp, rank, n, t0, t1, s, out + m * os, os);
}

// The A half of MR rows for adapter rows [j0, j1), 4 adapter rows at a time.
template <int MR, typename T>
__attribute__((target("avx512f"))) void a_rows(const float* x, int64_t xs, const T* a, int64_t k, int64_t r,
                                               int64_t j0, int64_t j1, float* low, const float* sa) {
    int64_t j = j0;
    for (; j + 4 <= j1; j += 4) a_tile<MR, 4>(x, xs, a + j * k, k, low + j, r, sa ? sa + j : nullptr);
    for (; j < j1; ++j) a_tile<MR, 1>(x, xs, a + j * k, k, low + j, r, sa ? sa + j : nullptr);
}

// The A half for adapter rows [j0, j1): rows outer (4 at a time), adapter rows inner.
template <typename T>
__attribute__((target("avx512f"))) void a_block(const float* x, int64_t xs, const T* a, int64_t k, int64_t r,
                                                int64_t j0, int64_t j1, int64_t rows, float* low, const float* sa) {
    int64_t m = 0;
    for (; m + 4 <= rows; m += 4) a_rows<4>(x + m * xs, xs, a, k, r, j0, j1, low + m * r, sa);
    for (; m < rows; ++m) a_rows<1>(x + m * xs, xs, a, k, r, j0, j1, low + m * r, sa);
}

// Both products of a fused group: float32 adapters (sa, sbs null) or int8 ones with per-rank scales, whose
//   low[m, j] = sa[j] * dot(x[m, :k], float(qa[j, :k])),  out[m, c] += s * sum_q (low[m, q] * sb[q]) * float(qb[q, c])
// equal the float32 products of the dequantized values up to the order of the roundings (the scales are applied to
// each sum, not to each element): a quarter of the adapter bytes a decode step streams, none decoded per version.
// `threads` OpenMP threads split the A half by runs of adapter rows and the B half by runs of each member's 64-column
// tiles: each output is summed by one thread in the same order, so the bits do not depend on `threads`.
template <typename T>
__attribute__((target("avx512f"))) void apply(const float* x, int64_t rows, int64_t k, int64_t xs, const T* a,
                                              const float* sa, int64_t r, float* low, int64_t n_members,
                                              const int64_t* ranks, const int64_t* cols, const T* const* bps,
                                              const float* const* sbs, const float* scalings, float* out, int64_t os,
                                              int threads) {
    const int parts = threads > 1 ? threads : 1;  // one: no OpenMP region at all (a decode step makes 64 calls)
    const int64_t a_groups = (r + 3) / 4;
    auto a_part = [&](int p) {  // a contiguous run of groups of 4 adapter rows
        const int64_t j0 = 4 * (a_groups * p / parts), j1 = std::min(r, 4 * (a_groups * (p + 1) / parts));
        if (j0 < j1) a_block(x, xs, a, k, r, j0, j1, rows, low, sa);
    };
    if (parts == 1) {
        a_part(0);
    } else {
#pragma omp parallel for schedule(static) num_threads(parts)
        for (int p = 0; p < parts; ++p) a_part(p);
    }
    if (sbs) {
        for (int64_t i = 0; i < n_members; ++i) {
            const int64_t r0 = ranks[2 * i], rank = ranks[2 * i + 1] - r0;
            for (int64_t mm = 0; mm < rows; ++mm)
                for (int64_t q = 0; q < rank; ++q) low[mm * r + r0 + q] *= sbs[i][q];
        }
    }
    auto b_part = [&](int64_t i, int p) {  // member i's contiguous run p of its 64-column tiles
        const int64_t r0 = ranks[2 * i], rank = ranks[2 * i + 1] - r0, c0 = cols[2 * i], n = cols[2 * i + 1] - c0;
        const int64_t tiles = (n + 63) / 64, t0 = tiles * p / parts, t1 = tiles * (p + 1) / parts;
        if (t0 < t1) b_block(low + r0, r, bps[i], rank, n, t0, t1, rows, scalings[i], out + c0, os);
    };
    if (parts == 1) {
        for (int64_t i = 0; i < n_members; ++i) b_part(i, 0);
    } else {
#pragma omp parallel for collapse(2) schedule(static) num_threads(parts)
        for (int64_t i = 0; i < n_members; ++i)
            for (int p = 0; p < parts; ++p) b_part(i, p);
    }
}

// out[i, c] = float(q[i, c]) * s[i] for i < rows, c < cols (row-major, contiguous).
void dequantize_rows(const int8_t* q, const float* s, int64_t rows, int64_t cols, float* out) {
    for (int64_t i = 0; i < rows; ++i) {
        const float si = s[i];
        const int8_t* qi = q + i * cols;
        float* oi = out + i * cols;
        for (int64_t c = 0; c < cols; ++c) oi[c] = static_cast<float>(qi[c]) * si;
    }
}

__attribute__((target("avx512f"))) void dequantize_rows_avx512(const int8_t* q, const float* s, int64_t rows,
                                                              int64_t cols, float* out) {
    for (int64_t i = 0; i < rows; ++i) {
        const __m512 sv = _mm512_set1_ps(s[i]);
        const int8_t* qi = q + i * cols;
        float* oi = out + i * cols;
        int64_t c = 0;
        for (; c + 16 <= cols; c += 16) {
            const __m512i wide = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qi + c)));
            _mm512_storeu_ps(oi + c, _mm512_mul_ps(_mm512_cvtepi32_ps(wide), sv));
        }
        for (; c < cols; ++c) oi[c] = static_cast<float>(qi[c]) * s[i];
    }
}

// panels (count, ceil(n / 32), rank, 32) from count B^T matrices q (rank, n) and their scales s (count * rank,).
template <bool AVX512>
void dequantize_panels(const int8_t* q, const float* s, int64_t count, int64_t rank, int64_t n, float* panels);

template <>
void dequantize_panels<false>(const int8_t* q, const float* s, int64_t count, int64_t rank, int64_t n, float* panels) {
    const int64_t n_panels = (n + 31) / 32;
    for (int64_t m = 0; m < count; ++m) {
        for (int64_t t = 0; t < n_panels; ++t) {
            const int64_t c0 = t * 32, width = n - c0 < 32 ? n - c0 : 32;
            float* panel = panels + (m * n_panels + t) * rank * 32;
            for (int64_t j = 0; j < rank; ++j) {
                const float sj = s[m * rank + j];
                const int8_t* qj = q + (m * rank + j) * n + c0;
                float* pj = panel + j * 32;
                for (int64_t c = 0; c < width; ++c) pj[c] = static_cast<float>(qj[c]) * sj;
                for (int64_t c = width; c < 32; ++c) pj[c] = 0.0f;
            }
        }
    }
}

template <>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void dequantize_panels<true>(const int8_t* q, const float* s, int64_t count,
                                                               int64_t rank, int64_t n, float* panels) {
    const int64_t n_panels = (n + 31) / 32;
    for (int64_t m = 0; m < count; ++m) {
        for (int64_t t = 0; t < n_panels; ++t) {
            const int64_t c0 = t * 32, width = n - c0 < 32 ? n - c0 : 32;
            const __mmask16 m0 = width >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << width) - 1u);
            const __mmask16 m1 = width >= 32 ? (__mmask16)0xFFFF : width <= 16 ? (__mmask16)0 : (__mmask16)((1u << (width - 16)) - 1u);
            float* panel = panels + (m * n_panels + t) * rank * 32;
            for (int64_t j = 0; j < rank; ++j) {
                const __m512 sv = _mm512_set1_ps(s[m * rank + j]);
                const int8_t* qj = q + (m * rank + j) * n + c0;
                const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m0, qj)));
                const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m1, qj + 16)));
                _mm512_storeu_ps(panel + j * 32, _mm512_maskz_mul_ps(m0, lo, sv));  // zeros past n
                _mm512_storeu_ps(panel + j * 32 + 16, _mm512_maskz_mul_ps(m1, hi, sv));
            }
        }
    }
}

// ------------------------------------------------------------------------------------------------ AMX-BF16, int8
// lr_apply_q8 on Intel AMX tiles (TDPBF16PS: fp32 accumulators += pairs of bf16 products, each exact in fp32). An
// int8 adapter value is exact in bf16 (8 significant bits), so only the fp32 operand is split, into two bf16 pieces
// x = x1 + x2 + e (x1 = bf16(x), x2 = bf16(x - x1), |e| <= 2^-17 |x|: 500 times below the int8 rounding of the
// adapter values themselves), and each sum runs over k in order, piece by piece, in fp32 (the tiles flush values
// below fp32's normal range). Not the AVX-512 path's bits (its sums are exact products of x, in another order):
// within 2^-14 of each output's sum of absolute products, the same bits for any row count, row split or thread count
// (batch-invariant, as that path). A^T (once a version: lr_amx_pack_a) and each B (once a call, from its int8
// panels) are laid out in the tiles' pair rows (row i: inputs 2i and 2i + 1 of every column side by side); `s` is
// folded into `low` before its split.
#include "amx_tiles.h"
#ifdef AMX_TILES_COMPILER
#define LR_AMX_COMPILER 1
#define LR_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))

constexpr int64_t kTileRows = 16;  // rows of a tile, and columns of an fp32 accumulator tile
constexpr int64_t kTileK = 32;     // bf16 inputs of an operand tile row, at most
constexpr int64_t kRowChunk = 64;  // x rows split at a time (bounds the pieces' scratch)
constexpr int kPieces = 2;

// AVX-512 F/BW and AVX512-BF16 (cpuid leaf 7 subleaf 1 EAX bit 5), AMX-TILE (leaf 7 EDX bit 24) and AMX-BF16 (bit
// 22), and Linux's permission for this process's tile data (amx_tiles.h).
bool has_amx_bf16() {
    static const bool bf16 = [] {
        unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
        return has_avx512f() && __builtin_cpu_supports("avx512bw") && __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) &&
               ((eax >> 5) & 1u);
    }();
    return bf16 && amx_available((1u << 24) | (1u << 22));
}

// Tiles 0-3: fp32 accumulators (rows x 16); 4-5: the fp32 operand's pieces (rows x k bf16); 6-7: int8 values as
// bf16 pairs (k / 2 pair rows x 16 columns), used alternately.
LR_AMX void tiles_configure(int64_t rows, int64_t k) {
    AmxTileConfig config;
    for (int t = 0; t < 4; ++t) config.rows[t] = static_cast<uint8_t>(rows), config.colsb[t] = 64;
    for (int t = 4; t < 6; ++t) config.rows[t] = static_cast<uint8_t>(rows), config.colsb[t] = static_cast<uint16_t>(2 * k);
    for (int t = 6; t < 8; ++t) config.rows[t] = static_cast<uint8_t>(k / 2), config.colsb[t] = 64;
    amx_load_config(config);
}

// Functions of their own: clang outlines an OpenMP region into a function without these target attributes.
LR_AMX void tiles_release() { _tile_release(); }

// bf16 bits of 16 fp32 values (round to nearest even), and those bits back as fp32 (exact).
LR_AMX inline __m256i to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
LR_AMX inline __m512 from_bf16(__m256i b) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)); }

// pieces[p] (rows x k_pad bf16, row-major, plane p at p * rows * k_pad) = piece p of s * src (rows x k, row stride
// ss), zeros past k. (32 values an iteration, one VCVTNE2PS2BF16 a piece, measured no faster.)
LR_AMX void split_pieces(const float* src, int64_t rows, int64_t k, int64_t ss, int64_t k_pad, float s,
                         uint16_t* pieces) {
    const int64_t plane = rows * k_pad;
    const __m512 sv = _mm512_set1_ps(s);
    for (int64_t m = 0; m < rows; ++m) {
        uint16_t* p1 = pieces + m * k_pad;
        for (int64_t c = 0; c < k_pad; c += 16) {
            const int64_t left = k - c;
            const __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1u);
            const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, src + m * ss + c), sv);
            const __m256i b1 = to_bf16(x);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(p1 + c), b1);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(p1 + plane + c), to_bf16(_mm512_sub_ps(x, from_bf16(b1))));
        }
    }
}

// 32 int8 values (the first `count`, zeros after) as 32 bf16 (exact).
LR_AMX inline __m512i bf16_of_int8(const int8_t* p, int64_t count) {
    const __mmask32 mask = count >= 32 ? (__mmask32)0xFFFFFFFFu : count <= 0 ? (__mmask32)0 : (__mmask32)((1u << count) - 1u);
    const __m256i bytes = _mm256_maskz_loadu_epi8(mask, p);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // lo in the low 16 bf16
}

// 16 x 16 32-bit words: r[i][j] -> r[j][i].
LR_AMX inline void transpose16(__m512i* r) {
    __m512i t[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int h = 0; h < 2; ++h)
        for (int i = 0; i < 4; ++i) {
            t[8 * h + i] = _mm512_shuffle_i32x4(r[8 * h + i], r[8 * h + i + 4], 0x88);
            t[8 * h + i + 4] = _mm512_shuffle_i32x4(r[8 * h + i], r[8 * h + i + 4], 0xdd);
        }
    for (int i = 0; i < 8; ++i) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    }
}

// 64 bytes of A^T's layout, written around the caches where aligned (a version's layout is read at its first decode
// step, after the base's weights have streamed through the caches: a store that reads the line first only doubled
// the traffic, 0.80 -> 0.54 ms a version of the `big` model); the caller ends with a store fence.
LR_AMX inline void store_layout(uint32_t* p, __m512i v) {
    if ((reinterpret_cast<uintptr_t>(p) & 63u) == 0) _mm512_stream_si512(reinterpret_cast<__m512i*>(p), v);
    else _mm512_storeu_si512(p, v);
}

// A^T in pair rows: at (k_pad / 2 rows x r_pad columns of 32-bit pairs), pair (i, j) = (a[j, 2i], a[j, 2i + 1]) as
// bf16, zeros past r and k. a is (r, k) int8 row-major.
LR_AMX void pack_a(const int8_t* a, int64_t r, int64_t k, int64_t r_pad, int64_t k_pad, uint32_t* at) {
    for (int64_t j0 = 0; j0 < r_pad; j0 += 16)
        for (int64_t c0 = 0; c0 < k_pad; c0 += kTileK) {
            __m512i rows[16];
            for (int jj = 0; jj < 16; ++jj)
                rows[jj] = j0 + jj < r ? bf16_of_int8(a + (j0 + jj) * k + c0, k - c0) : _mm512_setzero_si512();
            transpose16(rows);  // rows[ii]: pair row c0 / 2 + ii, columns j0 .. j0 + 15
            for (int ii = 0; ii < 16; ++ii) store_layout(at + (c0 / 2 + ii) * r_pad + j0, rows[ii]);
        }
}

// A member's B in pair rows: bv (rank_pad / 2 rows x n_pad columns of 32-bit pairs), pair (i, c) = (B[2i, c],
// B[2i + 1, c]) as bf16, zeros past rank and n. bp: its panels of 32 columns (rank, 32) int8, zero past n.
LR_AMX void pack_b(const int8_t* bp, int64_t rank, int64_t rank_pad, int64_t n_pad, uint32_t* bv) {
    const __m512i lo_index = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                              37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi_index = _mm512_add_epi16(lo_index, _mm512_set1_epi16(16));
    for (int64_t t = 0; t < n_pad / 32; ++t) {
        const int8_t* panel = bp + t * rank * 32;
        for (int64_t i = 0; i < rank_pad / 2; ++i) {
            const __m512i even = 2 * i < rank ? bf16_of_int8(panel + 2 * i * 32, 32) : _mm512_setzero_si512();
            const __m512i odd = 2 * i + 1 < rank ? bf16_of_int8(panel + (2 * i + 1) * 32, 32) : _mm512_setzero_si512();
            _mm512_storeu_si512(bv + i * n_pad + 32 * t, _mm512_permutex2var_epi16(even, lo_index, odd));
            _mm512_storeu_si512(bv + i * n_pad + 32 * t + 16, _mm512_permutex2var_epi16(even, hi_index, odd));
        }
    }
}

inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// This thread's scratch of at least `bytes`, kept across calls, 64-byte aligned.
inline void* aligned_scratch(int64_t bytes) {
    thread_local std::vector<char> held;
    if (static_cast<int64_t>(held.size()) < bytes + 64) held.resize(static_cast<size_t>(bytes + 64));
    const auto address = reinterpret_cast<uintptr_t>(held.data());
    return reinterpret_cast<void*>((address + 63) & ~static_cast<uintptr_t>(63));
}

// Accumulator tile ACC += both pieces (tiles 4, 5) times the pair columns at b (row stride vs words), loaded in tile
// B. A macro: the tile intrinsics paste their tile numbers into the instruction's text (no template parameter).
#define LR_PIECES_TIMES(ACC, B, b, vs)  \
    do {                                \
        _tile_loadd(B, (b), (vs) * 4);  \
        _tile_dpbf16ps(ACC, 4, B);      \
        _tile_dpbf16ps(ACC, 5, B);      \
    } while (0)

// acc[b] (b < 4; 16 x 16 fp32, rows past the configured ones unset) = the product of the configured rows of the
// pieces (from p, row stride ps bf16, the second piece `plane` further) by `count` (<= 4) blocks of 16 pair columns
// of `packed` from b0 (row stride vs words), over `steps` K steps of k_tile inputs (k_tile / 2 pair rows a step), in
// order, piece by piece: the tile product of both halves (pieces in tiles 4-5, the pair columns in 6 and 7 in turn).
LR_AMX void tiles_product(const uint16_t* p, int64_t plane, int64_t ps, int64_t k_tile, int64_t steps,
                          const uint32_t* b0, int64_t vs, int count, float* acc) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t step = 0; step < steps; ++step) {
        _tile_loadd(4, p + step * k_tile, ps * 2);
        _tile_loadd(5, p + plane + step * k_tile, ps * 2);
        const uint32_t* b = b0 + step * (k_tile / 2) * vs;
        LR_PIECES_TIMES(0, 6, b, vs);
        if (count > 1) LR_PIECES_TIMES(1, 7, b + 16, vs);
        if (count > 2) LR_PIECES_TIMES(2, 6, b + 32, vs);
        if (count > 3) LR_PIECES_TIMES(3, 7, b + 48, vs);
    }
    _tile_stored(0, acc, 64);
    _tile_stored(1, acc + 256, 64);
    _tile_stored(2, acc + 512, 64);
    _tile_stored(3, acc + 768, 64);
    __asm__ volatile("" ::: "memory");  // the tile stores wrote acc (the intrinsics are asm without memory operands)
}

// low[m, j0 + 16b + j] (b < count, j0 + 16b + j < j1) = sa[.] * the product of rows [m, m + mr) of the pieces
// (row stride k_pad, plane stride `plane`) by A^T's pair columns from j0, summed over k in order, piece by piece.
LR_AMX void a_block_amx(const uint16_t* pieces, int64_t plane, int64_t k_pad, const uint32_t* at, int64_t r_pad,
                        int64_t j0, int64_t j1, int count, const float* sa, int64_t mr, float* low, int64_t r) {
    alignas(64) float acc[4 * 256];
    tiles_product(pieces, plane, k_pad, kTileK, k_pad / kTileK, at + j0, r_pad, count, acc);
    for (int b = 0; b < count; ++b) {
        const int64_t col = j0 + 16 * b, left = j1 - col;
        const __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
        const __m512 scale = _mm512_maskz_loadu_ps(mask, sa + col);
        for (int64_t i = 0; i < mr; ++i)
            _mm512_mask_storeu_ps(low + i * r + col, mask, _mm512_mul_ps(_mm512_load_ps(acc + b * 256 + i * 16), scale));
    }
}

// low (rows x r) = sa[j] * sum_p x[m, p] a[j, p] on tiles for adapter columns [j0, j1) (j0 a multiple of 16), given
// x's pieces (rows x k_pad a plane, split_pieces).
LR_AMX void a_half_amx(const uint16_t* pieces, int64_t rows, int64_t k_pad, const uint32_t* at, int64_t r_pad,
                       const float* sa, int64_t r, int64_t j0, int64_t j1, float* low) {
    for (int64_t m = 0; m < rows; m += kTileRows) {
        const int64_t mr = std::min(kTileRows, rows - m);
        if (m == 0 || mr != kTileRows) tiles_configure(mr, kTileK);
        for (int64_t j = j0; j < j1; j += 64) {
            const int count = static_cast<int>(std::min<int64_t>(4, (j1 - j + 15) / 16));
            a_block_amx(pieces + m * k_pad, rows * k_pad, k_pad, at, r_pad, j, j1, count, sa, mr, low + m * r, r);
        }
    }
}

// out[m, c] += sum_q low'[m, q] b[q, c] for `count` (<= 4) 16-column blocks from column c (accumulator tiles
// 0..count-1) and rows [m, m + mr) (the configured tile rows): the pieces of low' = s * low (mr x k_pad bf16 a plane,
// K steps of k_tile) by B packed (bv, row stride n_pad words) in tiles (tiles_product), stored
// and added into the output row by row (columns past n masked). Adding in the output's own tiles (a tile load and
// store of 16 strided rows a block) ran 15-20% slower than these row-wise adds.
LR_AMX void b_blocks_amx(const uint16_t* p, int64_t plane, int64_t k_tile, int64_t steps, const uint32_t* bv,
                         int64_t n_pad, int64_t n, int64_t c, int count, int64_t mr, float* o, int64_t os) {
    alignas(64) float acc[4 * 256];
    tiles_product(p, plane, k_tile * steps, k_tile, steps, bv + c, n_pad, count, acc);
    for (int64_t i = 0; i < mr; ++i)
        for (int b = 0; b < count; ++b) {
            const int64_t left = n - c - 16 * b;
            const __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
            float* row = o + i * os + c + 16 * b;
            const __m512 add = _mm512_load_ps(acc + b * 256 + i * 16);
            _mm512_mask_storeu_ps(row, mask, _mm512_add_ps(_mm512_maskz_loadu_ps(mask, row), add));
        }
}

// The B product of one member's 16-column blocks [t0, t1) on tiles (b_blocks_amx), 16 rows at a time.
LR_AMX void b_half_amx(const uint16_t* pieces, int64_t plane, int64_t k_tile, int64_t steps, int64_t rows,
                       const uint32_t* bv, int64_t n_pad, int64_t n, int64_t t0, int64_t t1, float* out, int64_t os) {
    const int64_t k_pad = k_tile * steps;
    for (int64_t m = 0; m < rows; m += kTileRows) {
        const int64_t mr = std::min(kTileRows, rows - m);
        tiles_configure(mr, k_tile);
        const uint16_t* p = pieces + m * k_pad;
        for (int64_t t = t0; t < t1; t += 4) {
            const int count = static_cast<int>(std::min<int64_t>(4, t1 - t));
            b_blocks_amx(p, plane, k_tile, steps, bv, n_pad, n, 16 * t, count, mr, out + m * os, os);
        }
    }
}

// The layouts' sizes in 32-bit words: A^T (k_pad / 2 pair rows x r_pad columns) and a member's B (rank_pad / 2 pair
// rows x n_pad columns; one K step of rank_pad up to 32, else steps of 32).
inline int64_t a_pad_rows(int64_t r) { return round_up(r, 16); }
inline int64_t b_k_tile(int64_t rank) { return rank <= kTileK ? round_up(rank, 16) : kTileK; }
inline int64_t b_rank_pad(int64_t rank) { return round_up(rank, b_k_tile(rank)); }

// This thread's scratch for a member's B laid out (pack_b, once a call), kept across calls.
inline uint32_t* b_scratch(int64_t words) {
    thread_local std::vector<uint32_t> held;
    if (static_cast<int64_t>(held.size()) < words) held.resize(static_cast<size_t>(words));
    return held.data();
}

// lr_apply_q8 on tiles: at is A^T laid out (pack_a, once a version); each member's B is laid out from its int8 panels
// once a call (the int8 panels are half the bytes a step streams: as fast as a layout kept a version, which doubled
// a version's writes); otherwise lr_apply_q8's arguments. Each thread configures its own tiles and gives them back.
LR_AMX void apply_q8_amx(const float* x, int64_t rows, int64_t k, int64_t xs, const uint32_t* at, const float* sa,
                         int64_t r, float* low, int64_t n_members, const int64_t* ranks, const int64_t* cols,
                         const int8_t* const* bps, const float* const* sbs, const float* scalings, float* out,
                         int64_t os, int threads) {
    const int parts = threads > 1 ? threads : 1;
    const int64_t r_pad = a_pad_rows(r), a_blocks = r_pad / 16, k_pad = round_up(k, kTileK);
    // The A half, 64 rows at a time: x's pieces split once (this thread), the threads' runs of adapter columns on them
    for (int64_t m0 = 0; m0 < rows; m0 += kRowChunk) {
        const int64_t chunk = std::min(kRowChunk, rows - m0);
        auto* pieces = static_cast<uint16_t*>(aligned_scratch(kPieces * chunk * k_pad * 2));
        split_pieces(x + m0 * xs, chunk, k, xs, k_pad, 1.0f, pieces);
        __asm__ volatile("" ::: "memory");  // the pieces are in memory before a tile load reads them
        auto a_part = [&](int p) {
            const int64_t j0 = 16 * (a_blocks * p / parts), j1 = std::min(r, 16 * (a_blocks * (p + 1) / parts));
            if (j0 < j1) a_half_amx(pieces, chunk, k_pad, at, r_pad, sa, r, j0, j1, low + m0 * r);
        };
        if (parts == 1) {
            a_part(0);
        } else {
#pragma omp parallel num_threads(parts)
            {
#pragma omp for schedule(static)
                for (int p = 0; p < parts; ++p) a_part(p);
                tiles_release();
            }
        }
    }
    for (int64_t i = 0; i < n_members; ++i) {
        const int64_t r0 = ranks[2 * i], rank = ranks[2 * i + 1] - r0;
        for (int64_t mm = 0; mm < rows; ++mm)
            for (int64_t q = 0; q < rank; ++q) low[mm * r + r0 + q] *= sbs[i][q];
    }
    // Each member: the pieces of s times its low columns, then its 16-column blocks split over the threads.
    for (int64_t i = 0; i < n_members; ++i) {
        const int64_t r0 = ranks[2 * i], rank = ranks[2 * i + 1] - r0, c0 = cols[2 * i], n = cols[2 * i + 1] - c0;
        const int64_t k_tile = b_k_tile(rank), rank_pad = b_rank_pad(rank), steps = rank_pad / k_tile;
        const int64_t n_pad = round_up(n, 32), blocks = (n + 15) / 16;
        auto* pieces = static_cast<uint16_t*>(aligned_scratch(kPieces * rows * rank_pad * 2));
        split_pieces(low + r0, rows, rank, r, rank_pad, scalings[i], pieces);
        uint32_t* bv = b_scratch(rank_pad / 2 * n_pad);
        pack_b(bps[i], rank, rank_pad, n_pad, bv);
        __asm__ volatile("" ::: "memory");  // the pieces and B are in memory before a tile load reads them
        if (parts == 1) {
            b_half_amx(pieces, rows * rank_pad, k_tile, steps, rows, bv, n_pad, n, 0, blocks, out + c0, os);
        } else {
#pragma omp parallel num_threads(parts)
            {
#pragma omp for schedule(static)
                for (int p = 0; p < parts; ++p) {
                    const int64_t t0 = blocks * p / parts, t1 = blocks * (p + 1) / parts;
                    if (t0 < t1) b_half_amx(pieces, rows * rank_pad, k_tile, steps, rows, bv, n_pad, n, t0, t1,
                                            out + c0, os);
                }
                tiles_release();
            }
        }
    }
    if (parts == 1) tiles_release();
}
#endif  // LR_AMX_COMPILER

}  // namespace

extern "C" {

int lr_abi_version(void) { return 6; }

// 1 where lr_apply_q8_amx runs here: AMX-TILE, AMX-BF16 and AVX512-BF16, and Linux's permission for tile data.
int lr_has_amx(void) {
#ifdef LR_AMX_COMPILER
    return has_amx_bf16() ? 1 : 0;
#else
    return 0;
#endif
}

// 32-bit words of lr_amx_pack_a's layout for A (r, k).
int64_t lr_amx_a_words(int64_t r, int64_t k) {
#ifdef LR_AMX_COMPILER
    return round_up(k, kTileK) / 2 * a_pad_rows(r);
#else
    return r * k;
#endif
}
// int8 A (r, k) -> at (lr_amx_a_words): A^T as bf16 pairs (row i: inputs 2i and 2i + 1 of every adapter row), zero
// padded; one pass a version. -1 where lr_has_amx is 0.
int lr_amx_pack_a(const int8_t* a, int64_t r, int64_t k, uint32_t* at) {
#ifdef LR_AMX_COMPILER
    if (!has_amx_bf16()) return -1;
    pack_a(a, r, k, a_pad_rows(r), round_up(k, kTileK), at);
    _mm_sfence();  // the streamed stores are visible before any later read
    return 0;
#else
    (void)a, (void)r, (void)k, (void)at;
    return -1;
#endif
}

// `count` A layouts in one call (a version's, not a call per group): jobs[4 * i ...] = an A's address, r, k and its
// layout's address (lr_amx_pack_a), as int64. -1 where lr_has_amx is 0.
int lr_amx_pack_all(const int64_t* jobs, int64_t count) {
    for (int64_t i = 0; i < count; ++i) {
        const int64_t* job = jobs + 4 * i;
        const int status = lr_amx_pack_a(reinterpret_cast<const int8_t*>(job[0]), job[1], job[2],
                                         reinterpret_cast<uint32_t*>(job[3]));
        if (status != 0) return status;
    }
    return 0;
}

// q (rows, cols) int8, s (rows,) float32 -> out (rows, cols) float32: A (count * r, in), or B^T (count * r, out).
// avx512: 1 lets it use AVX-512F where the CPU has it, 0 runs the portable loop (ASYNCRL_ISA_CAP, tests).
void lr_dequantize_rows(const int8_t* q, const float* s, int64_t rows, int64_t cols, float* out, int avx512) {
    if (avx512 && has_avx512f()) {
        dequantize_rows_avx512(q, s, rows, cols, out);
        return;
    }
    dequantize_rows(q, s, rows, cols, out);
}

// q: count B^T matrices (rank, n) int8 back to back, s (count * rank,) -> panels (count, ceil(n / 32), rank, 32)
// float32: panel t of matrix m holds columns 32t..32t+31 of its rows (the last one zero past n).
void lr_dequantize_panels(const int8_t* q, const float* s, int64_t count, int64_t rank, int64_t n, float* panels,
                          int avx512) {
    if (avx512 && has_avx512f() && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")) {
        dequantize_panels<true>(q, s, count, rank, n, panels);  // masked byte loads: AVX512BW + VL
        return;
    }
    dequantize_panels<false>(q, s, count, rank, n, panels);
}

int lr_has_avx512f(void) { return has_avx512f() ? 1 : 0; }

// x (rows, k) row stride xs; a (R, k) contiguous; low (rows, R) scratch; members: ranks [2 * n_members] (first and
// end row of A), cols [2 * n_members] (first and end output column), bps[i]: member i's B^T (rank_i, n_i) in panels
// (b_tile), scalings[i] its s; out (rows, *) row stride os; `threads` OpenMP threads (1: the calling thread alone).
int lr_apply(const float* x, int64_t rows, int64_t k, int64_t xs, const float* a, int64_t r, float* low,
             int64_t n_members, const int64_t* ranks, const int64_t* cols, const float* const* bps,
             const float* scalings, float* out, int64_t os, int threads) {
    if (!has_avx512f()) return -1;
    apply<float>(x, rows, k, xs, a, nullptr, r, low, n_members, ranks, cols, bps, nullptr, scalings, out, os, threads);
    return 0;
}

// lr_apply on int8 adapters: qa (R, k) int8 rows with scales sa (R,); member i's B^T in int8 panels qbs[i] with
// per-rank scales sbs[i] (rank_i,); otherwise the arguments of lr_apply. `low` is (rows, R) scratch.
int lr_apply_q8(const float* x, int64_t rows, int64_t k, int64_t xs, const int8_t* qa, const float* sa, int64_t r,
                float* low, int64_t n_members, const int64_t* ranks, const int64_t* cols, const int8_t* const* qbs,
                const float* const* sbs, const float* scalings, float* out, int64_t os, int threads) {
    if (!has_avx512f()) return -1;
    apply<int8_t>(x, rows, k, xs, qa, sa, r, low, n_members, ranks, cols, qbs, sbs, scalings, out, os, threads);
    return 0;
}

// lr_apply_q8 on AMX tiles (see "AMX-BF16, int8" above): at from lr_amx_pack_a (this version's A), otherwise
// lr_apply_q8's arguments (B in its int8 panels). -1 where lr_has_amx is 0.
int lr_apply_q8_amx(const float* x, int64_t rows, int64_t k, int64_t xs, const uint32_t* at, const float* sa, int64_t r,
                    float* low, int64_t n_members, const int64_t* ranks, const int64_t* cols, const int8_t* const* qbs,
                    const float* const* sbs, const float* scalings, float* out, int64_t os, int threads) {
#ifdef LR_AMX_COMPILER
    if (!has_amx_bf16()) return -1;
    apply_q8_amx(x, rows, k, xs, at, sa, r, low, n_members, ranks, cols, qbs, sbs, scalings, out, os, threads);
    return 0;
#else
    (void)x, (void)rows, (void)k, (void)xs, (void)at, (void)sa, (void)r, (void)low, (void)n_members, (void)ranks;
    (void)cols, (void)qbs, (void)sbs, (void)scalings, (void)out, (void)os, (void)threads;
    return -1;
#endif
}

}  // extern "C"
