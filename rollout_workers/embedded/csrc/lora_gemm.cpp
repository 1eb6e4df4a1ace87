// LoRA's low-rank product for the embedded engine (rollout_workers/embedded/low_rank.py, add_low_rank):
//   low = x A^T          (rows x R: one pass over x for every member of a fused group, A stacked)
//   out[:, cols_i] += s_i * (low[:, ranks_i] bt_i)   (each member into its own output columns, in place)
// in fp32 with AVX-512F register tiles (explicit FMAs; summation order differs from MKL's: ~1e-7 relative).
// bt_i is member i's B^T (rank_i, n_i), unscaled, in panels of 32 columns (the subscriber decodes them so:
// quant_sync/adapter_buffers.py); s_i multiplies each output tile once, as peft scales its output (not B).
// Plain C ABI for ctypes. lr_apply returns 0 when done, -1 when this CPU lacks AVX-512F (the caller's torch path).
// lr_dequantize_rows and lr_dequantize_panels decode an int8 adapter version into those float32 layouts in one pass
// (any x86-64 CPU): each value is float(q) * s, one rounding, bit for bit torch's `q.float() * s`.
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
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
    int64_t p = 0;
    for (; p + 16 <= k; p += 16) {
        __m512 av[NR];
        for (int j = 0; j < NR; ++j) av[j] = load16(a + j * k + p);
        for (int i = 0; i < MR; ++i) {
            __m512 xv = _mm512_loadu_ps(x + i * xs + p);
            for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(xv, av[j], acc[i][j]);
        }
    }
    if (p < k) {
        __m512 av[NR];
        for (int j = 0; j < NR; ++j) av[j] = load_first(a + j * k + p, k - p);
        for (int i = 0; i < MR; ++i) {
            __m512 xv = load_first(x + i * xs + p, k - p);
            for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(xv, av[j], acc[i][j]);
        }
    }
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) {
            const float sum = _mm512_reduce_add_ps(acc[i][j]);
            low[i * ls + j] = sa ? sum * sa[j] : sum;
        }
}

template <int MR, typename T>
__attribute__((target("avx512f"))) void a_rows(const float* x, int64_t xs, const T* a, int64_t k, int64_t r,
                                               float* low, int64_t ls, const float* sa) {
    int64_t j = 0;
    for (; j + 4 <= r; j += 4) a_tile<MR, 4>(x, xs, a + j * k, k, low + j, ls, sa ? sa + j : nullptr);
    for (; j < r; ++j) a_tile<MR, 1>(x, xs, a + j * k, k, low + j, ls, sa ? sa + j : nullptr);
}

// out[m, c] += s * sum_q low[m, q] * bt[q, c] for a tile of MR rows, over all n columns. bp is bt packed in panels
// of 32 columns (panel t holds bt[:, 32t : 32t + 32] row after row, zero-padded: quant_sync/adapter_buffers.py
// writes them, or low_rank.py's _panels), so each panel streams in order (16 rows of bt read side by side, or
// masked loads, ran 10-20% slower); the last panel's columns past n are computed on zeros and masked off at the
// store. For int8 panels `low` already holds B's per-rank scales.
template <int MR, typename T>
__attribute__((target("avx512f"))) void b_rows(const float* low, int64_t ls, const T* bp, int64_t rank, int64_t n,
                                               float s, float* out, int64_t os) {
    const __m512 sv = _mm512_set1_ps(s);
    for (int64_t c = 0; c < n; c += 32) {
        const T* panel = bp + (c / 32) * rank * 32;
        __m512 acc[MR][2];
        for (int i = 0; i < MR; ++i) {
            acc[i][0] = _mm512_setzero_ps();
            acc[i][1] = _mm512_setzero_ps();
        }
        for (int64_t q = 0; q < rank; ++q) {
            __m512 b0 = load16(panel + q * 32), b1 = load16(panel + q * 32 + 16);
            for (int i = 0; i < MR; ++i) {
                __m512 l = _mm512_set1_ps(low[i * ls + q]);
                acc[i][0] = _mm512_fmadd_ps(l, b0, acc[i][0]);
                acc[i][1] = _mm512_fmadd_ps(l, b1, acc[i][1]);
            }
        }
        const int64_t left = n - c;
        const __mmask16 m0 = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
        const __mmask16 m1 = left >= 32 ? (__mmask16)0xFFFF : left <= 16 ? (__mmask16)0 : (__mmask16)((1u << (left - 16)) - 1u);
        for (int i = 0; i < MR; ++i) {  // out + s * acc, as peft scales its output (not B)
            float* o = out + i * os + c;
            _mm512_mask_storeu_ps(o, m0, _mm512_add_ps(_mm512_maskz_loadu_ps(m0, o), _mm512_mul_ps(acc[i][0], sv)));
            _mm512_mask_storeu_ps(o + 16, m1, _mm512_add_ps(_mm512_maskz_loadu_ps(m1, o + 16), _mm512_mul_ps(acc[i][1], sv)));
        }
    }
}

// Both products of a fused group: float32 adapters (sa, sbs null) or int8 ones with per-rank scales, whose
//   low[m, j] = sa[j] * dot(x[m, :k], float(qa[j, :k])),  out[m, c] += s * sum_q (low[m, q] * sb[q]) * float(qb[q, c])
// equal the float32 products of the dequantized values up to the order of the roundings (the scales are applied to
// each sum, not to each element): a quarter of the adapter bytes a decode step streams, none decoded per version.
template <typename T>
__attribute__((target("avx512f"))) void apply(const float* x, int64_t rows, int64_t k, int64_t xs, const T* a,
                                              const float* sa, int64_t r, float* low, int64_t n_members,
                                              const int64_t* ranks, const int64_t* cols, const T* const* bps,
                                              const float* const* sbs, const float* scalings, float* out, int64_t os) {
    int64_t m = 0;
    for (; m + 4 <= rows; m += 4) a_rows<4>(x + m * xs, xs, a, k, r, low + m * r, r, sa);
    for (; m < rows; ++m) a_rows<1>(x + m * xs, xs, a, k, r, low + m * r, r, sa);
    if (sbs) {
        for (int64_t i = 0; i < n_members; ++i) {
            const int64_t r0 = ranks[2 * i], rank = ranks[2 * i + 1] - r0;
            for (int64_t mm = 0; mm < rows; ++mm)
                for (int64_t q = 0; q < rank; ++q) low[mm * r + r0 + q] *= sbs[i][q];
        }
    }
    for (int64_t i = 0; i < n_members; ++i) {
        const int64_t r0 = ranks[2 * i], rank = ranks[2 * i + 1] - r0, c0 = cols[2 * i], n = cols[2 * i + 1] - c0;
        int64_t mm = 0;
        for (; mm + 4 <= rows; mm += 4)
            b_rows<4>(low + mm * r + r0, r, bps[i], rank, n, scalings[i], out + mm * os + c0, os);
        for (; mm < rows; ++mm) b_rows<1>(low + mm * r + r0, r, bps[i], rank, n, scalings[i], out + mm * os + c0, os);
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

int lr_abi_version(void) { return 4; }

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
// (b_rows), scalings[i] its s; out (rows, *) row stride os.
int lr_apply(const float* x, int64_t rows, int64_t k, int64_t xs, const float* a, int64_t r, float* low,
             int64_t n_members, const int64_t* ranks, const int64_t* cols, const float* const* bps,
             const float* scalings, float* out, int64_t os) {
    if (!has_avx512f()) return -1;
    apply<float>(x, rows, k, xs, a, nullptr, r, low, n_members, ranks, cols, bps, nullptr, scalings, out, os);
    return 0;
}

// lr_apply on int8 adapters: qa (R, k) int8 rows with scales sa (R,); member i's B^T in int8 panels qbs[i] with
// per-rank scales sbs[i] (rank_i,); otherwise the arguments of lr_apply. `low` is (rows, R) scratch.
int lr_apply_q8(const float* x, int64_t rows, int64_t k, int64_t xs, const int8_t* qa, const float* sa, int64_t r,
                float* low, int64_t n_members, const int64_t* ranks, const int64_t* cols, const int8_t* const* qbs,
                const float* const* sbs, const float* scalings, float* out, int64_t os) {
    if (!has_avx512f()) return -1;
    apply<int8_t>(x, rows, k, xs, qa, sa, r, low, n_members, ranks, cols, qbs, sbs, scalings, out, os);
    return 0;
}

}  // extern "C"
