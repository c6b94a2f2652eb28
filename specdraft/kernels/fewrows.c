/* y = x W^T for a few rows of x: the decode / verification matmul of a small model on a CPU.
 *
 *   x: (M, K) float32, row-major      W: (N, K) float32 or bfloat16, row-major (torch's layout)
 *   y: (M, N) float32                 K a multiple of 8
 *
 * With M <= ~16 rows the work is dominated by streaming W from memory once, and BLAS libraries
 * tuned for large GEMMs handle that shape poorly (MKL took ~3.4x a 1-row product for 8 rows on
 * this project's AVX2 CPU). Here each tile streams one row of W once over K, multiplying each
 * 8-wide slice into up to MB rows of x at once (MB accumulators); W is prefetched PF elements
 * ahead. 1 W row x 8 x rows was fastest on this CPU among 3x4, 2x4, 2x6, 1x4, 1x6 and 1x8
 * (whole-model linears with bf16 weights, 2 threads: 1 row 20 ms, 8 rows 32 ms, against 25 and 40
 * ms for 3x4): one weight stream per thread prefetches best, and 8 accumulators cover FMA latency.
 *
 * Every output y[m, n] is the same sequence of float operations whatever M is and whichever
 * tile or thread computes it (8 lanes over K in order, then a fixed horizontal sum), so a row's
 * result does not depend on the other rows: a (k+1)-token verification gives bit-identical
 * logits to k+1 one-token steps. bf16 weights are widened exactly (a 16-bit shift), so the
 * arithmetic is fp32 throughout.
 *
 * Threads: OpenMP over blocks of output rows. Linked against libgomp.so.1, which at run time
 * is the copy torch has already loaded, so torch's ops and these share one thread pool.
 */
#include <immintrin.h>
#include <omp.h>
#include <math.h>
#include <stdint.h>

#define MB 8   /* x rows per tile (at most) */
#define PF 128 /* prefetch distance in elements */

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

static inline __m256 load_f32(const float *p) { return _mm256_loadu_ps(p); }

static inline __m256 load_bf16(const uint16_t *p) {
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

/* One tile: rows [0, MB_) of x (MB_ compile-time) against one row wr of W -> y[i * N]. */
#define TILE(NAME, WT, LOAD, MB_)                                                               \
    static inline void NAME##_tile##MB_(const float *x, const WT *wr, float *y, int K, int N) {  \
        __m256 acc[MB_];                                                                          \
        for (int i = 0; i < MB_; i++) acc[i] = _mm256_setzero_ps();                               \
        for (int k = 0; k < K; k += 8) {                                                          \
            __m256 wv = LOAD(wr + k);                                                             \
            _mm_prefetch((const char *)(wr + k + PF), _MM_HINT_T0);                               \
            for (int i = 0; i < MB_; i++)                                                         \
                acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(x + (long)i * K + k), wv, acc[i]);       \
        }                                                                                         \
        for (int i = 0; i < MB_; i++) y[(long)i * N] = hsum(acc[i]);                              \
    }

#define KERNEL(NAME, WT, LOAD)                                                                    \
    TILE(NAME, WT, LOAD, 1)                                                                       \
    TILE(NAME, WT, LOAD, 2)                                                                       \
    TILE(NAME, WT, LOAD, 3)                                                                       \
    TILE(NAME, WT, LOAD, 4)                                                                       \
    TILE(NAME, WT, LOAD, 5)                                                                       \
    TILE(NAME, WT, LOAD, 6)                                                                       \
    TILE(NAME, WT, LOAD, 7)                                                                       \
    TILE(NAME, WT, LOAD, 8)                                                                       \
    static void NAME##_rows(const float *x, const WT *w, float *y, int M, int K, int N, int o0,  \
                            int o1) {                                                             \
        for (int o = o0; o < o1; o++) {                                                           \
            const WT *wr = w + (long)o * K;                                                       \
            for (int m0 = 0; m0 < M; m0 += MB) {                                                  \
                const float *xm = x + (long)m0 * K;                                               \
                float *ym = y + (long)m0 * N + o;                                                 \
                switch (M - m0 < MB ? M - m0 : MB) {                                              \
                case 8: NAME##_tile8(xm, wr, ym, K, N); break;                                    \
                case 7: NAME##_tile7(xm, wr, ym, K, N); break;                                    \
                case 6: NAME##_tile6(xm, wr, ym, K, N); break;                                    \
                case 5: NAME##_tile5(xm, wr, ym, K, N); break;                                    \
                case 4: NAME##_tile4(xm, wr, ym, K, N); break;                                    \
                case 3: NAME##_tile3(xm, wr, ym, K, N); break;                                    \
                case 2: NAME##_tile2(xm, wr, ym, K, N); break;                                    \
                default: NAME##_tile1(xm, wr, ym, K, N);                                          \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    void NAME(const float *x, const WT *w, float *y, int M, int K, int N, int threads) {          \
        if (threads <= 1) {                                                                       \
            NAME##_rows(x, w, y, M, K, N, 0, N);                                                  \
            return;                                                                               \
        }                                                                                         \
        _Pragma("omp parallel num_threads(threads)") {                                            \
            int t = omp_get_thread_num(), T = omp_get_num_threads();                              \
            int per = (N + T - 1) / T;                                                            \
            int a = t * per, b = a + per < N ? a + per : N;                                       \
            if (a < b) NAME##_rows(x, w, y, M, K, N, a, b);                                       \
        }                                                                                         \
    }

KERNEL(fewrows_f32, float, load_f32)
KERNEL(fewrows_bf16, uint16_t, load_bf16)

/* RMSNorm of M rows of K floats (K a multiple of 8): y = x / sqrt(mean(x^2) + eps) * w.
 * One row at a time, in a fixed order, so a row's result does not depend on the other rows. */
void rmsnorm_f32(const float *x, const float *w, float *y, int M, int K, float eps) {
    for (int m = 0; m < M; m++) {
        const float *xr = x + (long)m * K;
        float *yr = y + (long)m * K;
        __m256 acc = _mm256_setzero_ps();
        for (int k = 0; k < K; k += 8) {
            __m256 v = _mm256_loadu_ps(xr + k);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        __m256 s = _mm256_set1_ps(1.0f / sqrtf(hsum(acc) / (float)K + eps));
        for (int k = 0; k < K; k += 8)
            _mm256_storeu_ps(yr + k, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + k), s), _mm256_loadu_ps(w + k)));
    }
}
