// LoRA's low-rank product for the embedded engine (rollout_workers/embedded/low_rank.py, add_low_rank):
//   low = x A^T          (rows x R: one pass over x for every member of a fused group, A stacked)
//   out[:, cols_i] += s_i * (low[:, ranks_i] bt_i)   (each member into its own output columns, in place)
// in fp32 with AVX-512F register tiles (explicit FMAs; summation order differs from MKL's: ~1e-7 relative).
// bt_i is member i's B^T (rank_i, n_i), unscaled, in panels of 32 columns (the subscriber decodes them so:
// quant_sync/adapter_buffers.py); s_i multiplies each output tile once, as peft scales its output (not B).
// Both halves run on the caller's thread count (the engine's torch threads: a worker's `rollout.threads`), split so
// that each output is summed by one thread in one order: the bits do not depend on the count.
// Plain C ABI for ctypes. lr_apply returns 0 when done, -1 when this CPU lacks AVX-512F (the caller's torch path).
// lr_dequantize_rows and lr_dequantize_panels decode an int8 adapter version into those float32 layouts in one pass
// (any x86-64 CPU): each value is float(q) * s, one rounding, bit for bit torch's `q.float() * s`.
#include <algorithm>
#include <cstdint>
#include <immintrin.h>

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

}  // namespace

extern "C" {

int lr_abi_version(void) { return 5; }

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

}  // extern "C"
