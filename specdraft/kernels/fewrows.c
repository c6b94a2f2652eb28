/* Native kernels for decode and verification steps of a small model on a CPU (AVX2 + FMA):
 *
 *   fewrows_f32 / fewrows_bf16  y = x W^T for a few rows of x, W in torch's (N, K) layout
 *   packed_bf16                 the same for bf16 W in a packed (N/16, K, 16) layout (faster)
 *   rope_attend                 RoPE + KV-cache write + causal attention for a few new tokens
 *   rope_attend_window          the same with a sliding window and a given score scale (Gemma 3)
 *   rmsnorm_f32                 RMSNorm of a few rows
 *   rope_attend_tree            the same for a token-tree step (each node sees its ancestors)
 *   rope_attend16, rope_attend_tree16   the same over fp16 key/value caches
 *   decode_layers               every decoder layer of such a step in one call, built from the above
 *   decode_layers_tree          the same for a token-tree step
 *
 * All keep each row's result independent of the other rows (see each kernel). The ctypes wrappers
 * are in __init__.py; build.py compiles this file with the source hash it exports.
 *
 * ---- y = x W^T, row-dot form ------------------------------------------------------------------
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
#pragma GCC target("avx2,fma,f16c") /* F16C: the fp16 caches (every AVX2 CPU has it) */
#include <immintrin.h>
#include <omp.h>
#include <math.h>
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>

#define MB 8   /* x rows per tile (at most) */
#define PF 128 /* prefetch distance in elements */

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

/* The largest of x[0 .. n) (n a multiple of 8), 8 lanes at a time: a max is exact in any order (the
 * one choice it leaves, +0 or -0, gives the same exp(x - m)), and the scalar loop's dependency
 * chain cost ~5% of a decode step's attention. */
static inline float hmax(const float *x, long n) {
    __m256 v = _mm256_set1_ps(-INFINITY);
    for (long i = 0; i < n; i += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(x + i));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
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

/* ---- bf16 weights in a packed layout: one outer-product tile per 16 output columns ----------
 *
 *   Wp: (N / 16, K, 16) bf16: block j holds columns 16j..16j+15 of W^T, k-major, so a tile streams
 *   one contiguous panel. Within a block, stored position p holds column PACK_PERM[p] =
 *   p / 2 + 8 (p % 2): a 32-bit lane's low half is column i and its high half column 8 + i, so a
 *   shift and a mask widen 16 columns to two fp32 vectors in column order.
 *
 * A tile keeps R rows x 16 C columns of y in registers (2 R C accumulators) and, per k, loads
 * 16 C weights once and broadcasts R values of x: up to 12 FMAs per 32 bytes of weights, against
 * 8 FMAs and 9 loads per 8 weights in the row-dot kernel above. M = 1 takes 4 blocks at a time
 * (8 accumulators hide FMA latency), M = 2 two, M >= 3 one block of up to 6 rows; more rows run
 * in balanced groups of <= 6 over K chunks of at most KC (K split evenly: 576 -> 2 x 288, 1536 ->
 * 5 x 308), the chunk's panel staying in L1 between groups. While the groups work on one chunk
 * from cache, the first two passes prefetch the next chunk into L2, half each (the weight stream
 * then keeps flowing during the passes that read no new weights; before, DRAM idled while later
 * groups ran, and a short last chunk stalled the stream). SmolLM2's linears alone, 2 threads,
 * interleaved (a throwaway C harness over the model's 121 weight shapes): 8 rows 25.8-26.2 ms ->
 * 20.1-21.3 ms, 1 row unchanged (12.6-14.4 ms); the whole forward with the native layers below, both
 * kernels loaded in one process and alternated (60 rounds, two runs): 8 tokens 18.3 -> 16.5-17.4 ms,
 * 1 token unchanged (~12 ms).
 * Whole SmolLM2 forward at a 200-token context, 2 threads, against the row-dot tiles in the same
 * run (benchmarks/bench_linear.py): T1 26.6 -> 23.4 ms, T4 30.5 -> 23.6 ms, T8 43.2 -> 29.8 ms
 * (before the next-chunk prefetch).
 *
 * Every y[m, n] is one fp32 FMA chain over k = 0..K-1 in order (partial sums between K chunks go
 * through y, exactly), whatever M, the tile shape or the thread: rows stay independent. */
#define KC 320  /* largest K chunk when rows take several groups */
#define PPF 2048 /* prefetch distance in packed elements (128 k ahead, 4 KB: DRAM latency at FMA speed) */

/* Named accumulators (gcc keeps an array of 12+ vectors in memory): a<r><c>l / a<r><c>h hold
 * row r, columns 16c..16c+7 / 16c+8..16c+15 of the tile. */
#define DECL(r, c)                                                                                \
    __m256 a##r##c##l = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + (r) * N + 16 * (c)),    \
           a##r##c##h = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + (r) * N + 16 * (c) + 8);
#define WLOAD(c)                                                                                  \
    __m256i v##c = _mm256_loadu_si256((const __m256i *)(wp + (c) * ps + (long)k * 16));           \
    _mm_prefetch((const char *)(wp + (c) * ps + (long)k * 16 + PPF), _MM_HINT_T0);                 \
    __m256 l##c = _mm256_castsi256_ps(_mm256_slli_epi32(v##c, 16));                               \
    __m256 h##c = _mm256_castsi256_ps(_mm256_and_si256(v##c, _mm256_set1_epi32((int)0xFFFF0000u)));
#define BCAST(r) __m256 b##r = _mm256_broadcast_ss(x + (r) * K + k);
#define FMA(r, c)                                                                                 \
    a##r##c##l = _mm256_fmadd_ps(b##r, l##c, a##r##c##l);                                         \
    a##r##c##h = _mm256_fmadd_ps(b##r, h##c, a##r##c##h);
#define STORE(r, c)                                                                               \
    _mm256_storeu_ps(y + (r) * N + 16 * (c), a##r##c##l);                                         \
    _mm256_storeu_ps(y + (r) * N + 16 * (c) + 8, a##r##c##h);
#define MICRO(NAME, ACCS, LOADS, BODY)                                                            \
    static void NAME(const float *x, long K, const uint16_t *wp, long ps, float *y, long N, int k0, \
                     int k1, int first) {                                                         \
        ACCS(DECL)                                                                                \
        for (int k = k0; k < k1; k++) {                                                           \
            LOADS                                                                                 \
            BODY                                                                                  \
        }                                                                                         \
        ACCS(STORE)                                                                               \
    }
#define A14(M) M(0, 0) M(0, 1) M(0, 2) M(0, 3)
#define A22(M) M(0, 0) M(0, 1) M(1, 0) M(1, 1)
#define A11(M) M(0, 0)
#define A21(M) A11(M) M(1, 0)
#define A31(M) A21(M) M(2, 0)
#define A41(M) A31(M) M(3, 0)
#define A51(M) A41(M) M(4, 0)
#define A61(M) A51(M) M(5, 0)
#define ROW1(r) BCAST(r) FMA(r, 0)
/* One block of 16 columns for up to 6 rows; the prefetch goes to pf + ps (k - k0), into L2: PPF
 * elements ahead in the panel (ps = 16) for a single row group, a half of the next K chunk (ps = 8)
 * in the first two passes of row groups (later passes point it at the current chunk, cached). */
#define WLOADG                                                                                    \
    __m256i v0 = _mm256_loadu_si256((const __m256i *)(wp + (long)k * 16));                        \
    _mm_prefetch((const char *)(pf + (long)(k - k0) * pstep), _MM_HINT_T1);                       \
    __m256 l0 = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16));                                   \
    __m256 h0 = _mm256_castsi256_ps(_mm256_and_si256(v0, _mm256_set1_epi32((int)0xFFFF0000u)));
#define MICROG(NAME, ACCS, BODY)                                                                  \
    static void NAME(const float *x, long K, const uint16_t *wp, float *y, long N, int k0, int k1, \
                     int first, const uint16_t *pf, long pstep) {                                 \
        ACCS(DECL)                                                                                \
        for (int k = k0; k < k1; k++) {                                                           \
            WLOADG                                                                                \
            BODY                                                                                  \
        }                                                                                         \
        ACCS(STORE)                                                                               \
    }
MICRO(micro_1_4, A14, WLOAD(0) WLOAD(1) WLOAD(2) WLOAD(3), BCAST(0) FMA(0, 0) FMA(0, 1) FMA(0, 2) FMA(0, 3))
MICRO(micro_2_2, A22, WLOAD(0) WLOAD(1), BCAST(0) BCAST(1) FMA(0, 0) FMA(0, 1) FMA(1, 0) FMA(1, 1))
MICROG(group_1, A11, ROW1(0))
MICROG(group_2, A21, ROW1(0) ROW1(1))
MICROG(group_3, A31, ROW1(0) ROW1(1) ROW1(2))
MICROG(group_4, A41, ROW1(0) ROW1(1) ROW1(2) ROW1(3))
MICROG(group_5, A51, ROW1(0) ROW1(1) ROW1(2) ROW1(3) ROW1(4))
MICROG(group_6, A61, ROW1(0) ROW1(1) ROW1(2) ROW1(3) ROW1(4) ROW1(5))

static void group_tile(int R, const float *x, long K, const uint16_t *wp, float *y, long N, int k0, int k1, int first,
                       const uint16_t *pf, long pstep) {
    switch (R) {
    case 1: group_1(x, K, wp, y, N, k0, k1, first, pf, pstep); break;
    case 2: group_2(x, K, wp, y, N, k0, k1, first, pf, pstep); break;
    case 3: group_3(x, K, wp, y, N, k0, k1, first, pf, pstep); break;
    case 4: group_4(x, K, wp, y, N, k0, k1, first, pf, pstep); break;
    case 5: group_5(x, K, wp, y, N, k0, k1, first, pf, pstep); break;
    default: group_6(x, K, wp, y, N, k0, k1, first, pf, pstep);
    }
}

static void packed_tile(int R, int C, const float *x, long K, const uint16_t *wp, long ps, float *y,
                        long N, int k0, int k1, int first) {
    if (C == 4) micro_1_4(x, K, wp, ps, y, N, k0, k1, first);
    else if (C == 2) micro_2_2(x, K, wp, ps, y, N, k0, k1, first);
    else group_tile(R, x, K, wp, y, N, k0, k1, first, wp + (long)k0 * 16 + PPF, 16);
}

/* Column blocks [b0, b1) of y. */
static void packed_blocks(const float *x, const uint16_t *wp, float *y, int M, int K, int N, int b0, int b1) {
    const long ps = (long)K * 16;
    const int C = M == 1 ? 4 : M == 2 ? 2 : 1;
    const int groups = (M + 5) / 6;
    if (groups > 1) { /* one block at a time; K in even chunks of <= KC, row groups in turn */
        const int kc = (K + (K + KC - 1) / KC - 1) / ((K + KC - 1) / KC);
        for (int b = b0; b < b1; b++) {
            const uint16_t *wb = wp + (long)b * ps;
            for (int k0 = 0; k0 < K; k0 += kc) {
                const int k1 = k0 + kc < K ? k0 + kc : K;
                for (int q = 0, m0 = 0; q < groups; q++) { /* passes 0 and 1 prefetch the next chunk, half each */
                    const int rows = (M - m0) / (groups - q);
                    group_tile(rows, x + (long)m0 * K, K, wb, y + (long)m0 * N + b * 16, N, k0, k1, k0 == 0,
                               wb + (q < 2 ? (long)k1 * 16 + (long)q * (k1 - k0) * 8 : (long)k0 * 16), 8);
                    m0 += rows;
                }
            }
        }
        return;
    }
    for (int b = b0; b < b1;) {
        const int cc = b + C <= b1 ? C : 1;
        const uint16_t *wb = wp + (long)b * ps;
        packed_tile(M, cc, x, K, wb, ps, y + b * 16, N, 0, K, 1);
        b += cc;
    }
}

/* y (M, N) = x (M, K) W^T with W packed as above (N a multiple of 16). */
void packed_bf16(const float *x, const uint16_t *wp, float *y, int M, int K, int N, int threads) {
    const int nb = N / 16;
    if (threads <= 1) {
        packed_blocks(x, wp, y, M, K, N, 0, nb);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), T = omp_get_num_threads();
        int a = (int)((long)nb * t / T), b = (int)((long)nb * (t + 1) / T);
        if (a < b) packed_blocks(x, wp, y, M, K, N, a, b);
    }
}

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

/* ---- decode attention: RoPE, KV-cache write and causal attention in one call --------------------
 *
 * For a few new tokens per row (decode and verification steps), torch spends most of an attention
 * block's time in per-op overhead (views, the RoPE's six ops, two cache writes, a boolean mask and
 * SDPA's math path for T > 1). Here, with fp32 throughout:
 *
 *   qkv  (B, T, (H + 2G) D): the qkv projection's output (queries, keys, values per token)
 *   pos  (B, T) int64: each token's position (= its cache slot)
 *   cosT, sinT (n, D): RoPE tables (half-split, as transformers' Llama: x cos + rotate_half(x) sin)
 *   kc, vc (B, G, cap, D): the caches; the new keys (rotated) and values are written at pos
 *   out  (B, T, H D): attention output, already in the layout the output projection reads
 *
 * A query at position p attends to slots 0..p (the causal rule of the runtime), with scale
 * 1/sqrt(D) and a max-subtracted softmax. rope_attend_window takes the scale and a window W > 0:
 * the query then attends to slots p - W + 1..p only (transformers' sliding-window rule). Every (row, token, head) is computed by one fixed
 * sequence of operations over slots 0..p whatever T, B or the thread, so a (k+1)-token
 * verification gives bit-identical outputs to k+1 one-token steps. */

/* e^x for x in [-88, 88] (Cephes' expf polynomial, ~1 ulp), 8 lanes. */
static inline __m256 exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f)); /* e^-87 > FLT_MIN: no denormals */
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

/* dst = RoPE(src) at table row p (D floats, D a multiple of 16). */
static inline void rope(const float *src, const float *c, const float *s, float *dst, int D) {
    const int h = D / 2;
    for (int i = 0; i < h; i += 8) {
        __m256 x1 = _mm256_loadu_ps(src + i), x2 = _mm256_loadu_ps(src + h + i);
        _mm256_storeu_ps(dst + i, _mm256_sub_ps(_mm256_mul_ps(x1, _mm256_loadu_ps(c + i)),
                                                _mm256_mul_ps(x2, _mm256_loadu_ps(s + i))));
        _mm256_storeu_ps(dst + h + i, _mm256_add_ps(_mm256_mul_ps(x2, _mm256_loadu_ps(c + h + i)),
                                                    _mm256_mul_ps(x1, _mm256_loadu_ps(s + h + i))));
    }
}

/* The horizontal sums of 8 vectors as one vector: lane i = ((a_i0 + a_i1) + (a_i2 + a_i3)) +
 * ((a_i4 + a_i5) + (a_i6 + a_i7)), the same order for every lane. */
static inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
    __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

/* Token trees (tree.py): the new tokens of row b are a root at slot lo[b] - 1 and nodes at their own
 * slots (slot[b T + t]), each at position p = root + depth. A node sees the committed slots, the
 * root and its ancestors: the same p + 1 keys a chain step over its path sees, with the "virtual"
 * slots lo[b] + i (i < depth) read from slot vmap[(b T + t) W + i] (its ancestor at depth i + 1; W
 * the map's row width, at least the most virtual slots a query reads). Keys past lo[b] are gathered into a scratch block in virtual order and values are read through
 * the map, so a node's operations are exactly a chain step's over its path (bit-identical). */
static inline long vslot(long s, long lo, const int64_t *m) { return s < lo ? s : m[s - lo]; }

/* The caches hold fp32, or fp16 (h16: rope_attend16 and rope_attend_tree16, the quantized runtime's
 * cache, as llama.cpp keeps it: half the bytes a step reads at long contexts). An fp16 key or value
 * is rounded once, when written (to nearest even, F16C), and widened exactly when read, so every
 * query reads the same fp32 values from it whatever the step: the results stay per row and per
 * query as below, only with the cache's values rounded. */
#define AI __attribute__((always_inline))
static inline AI __m256 kv_load(const void *c, long i, int h16) { /* 8 floats from element i */
    return h16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)c + i)))
               : _mm256_loadu_ps((const float *)c + i);
}
static inline AI void kv_store(void *c, long i, __m256 v, int h16) {
    if (h16)
        _mm_storeu_si128((__m128i *)((uint16_t *)c + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    else
        _mm256_storeu_ps((float *)c + i, v);
}

/* One score vector: 8 slots' keys from element k0 of c (fp32 scratch or the cache), one FMA chain
 * each over D and a fixed horizontal sum. */
static inline AI __m256 score8(const float *qj, const void *c, long k0, int D, int h16) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int i = 0; i < D; i += 8) {
        const __m256 qv = _mm256_load_ps(qj + i);
        a0 = _mm256_fmadd_ps(qv, kv_load(c, k0 + i, h16), a0);
        a1 = _mm256_fmadd_ps(qv, kv_load(c, k0 + D + i, h16), a1);
        a2 = _mm256_fmadd_ps(qv, kv_load(c, k0 + 2 * D + i, h16), a2);
        a3 = _mm256_fmadd_ps(qv, kv_load(c, k0 + 3 * D + i, h16), a3);
        a4 = _mm256_fmadd_ps(qv, kv_load(c, k0 + 4 * D + i, h16), a4);
        a5 = _mm256_fmadd_ps(qv, kv_load(c, k0 + 5 * D + i, h16), a5);
        a6 = _mm256_fmadd_ps(qv, kv_load(c, k0 + 6 * D + i, h16), a6);
        a7 = _mm256_fmadd_ps(qv, kv_load(c, k0 + 7 * D + i, h16), a7);
    }
    return hsum8(a0, a1, a2, a3, a4, a5, a6, a7);
}

static inline AI void attend_kv(const float *qkv, const int64_t *pos, const int64_t *slot, const int64_t *lo_row,
                                const int64_t *vmap, int W, const float *cosT, const float *sinT, void *kc, void *vc,
                                float *out, int B, int T, int H, int G, int D, int cap, int window, float scale,
                                int threads, int h16) {
    const long row = (long)(H + 2 * G) * D;
    /* keys and values of every new token first: a query may see the other new tokens */
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            const long p = pos[b * T + t], w = slot ? slot[b * T + t] : p;
            const float *src = qkv + (b * (long)T + t) * row;
            for (int g = 0; g < G; g++) {
                const long at = (((long)b * G + g) * cap + w) * D;
                float key[D];
                rope(src + (long)(H + g) * D, cosT + p * D, sinT + p * D, key, D);
                for (int i = 0; i < D; i += 8) {
                    kv_store(kc, at + i, _mm256_loadu_ps(key + i), h16);
                    kv_store(vc, at + i, _mm256_loadu_ps(src + (long)(H + G + g) * D + i), h16);
                }
            }
        }
    /* Work items: (row b, KV head g, block of up to TB tokens): the rep = H / G query heads of
     * those tokens share the item's K and V, which are then read once per item, slot block by
     * slot block (SB slots, L1-sized), instead of once per query. With fewer than two items per
     * thread (a batch-1 decode step: G = 3 items on 2 threads left one thread a third idle) each
     * item takes one query head instead (hs = rep items per KV head, reading its K and V rep
     * times, from L2 after the first). A query's operations are the same either way. */
    enum { TB = 4, SB = 32 };
    const int rep = H / G, tblocks = (T + TB - 1) / TB;
    const int hs = B * G * tblocks < 2 * threads ? rep : 1, hper = rep / hs, items = B * G * tblocks * hs;
    const __m256 vscale = _mm256_set1_ps(scale);
    int maxp = 0;
    for (int i = 0; i < B * T; i++) maxp = pos[i] > maxp ? (int)pos[i] : maxp;
    const long ld = ((long)maxp + 16) / 8 * 8; /* score row stride: >= n rounded up to 8 */
#pragma omp parallel num_threads(threads)
    {
        const int qmax = rep * TB;
        float *sc = (float *)aligned_alloc(32, (size_t)qmax * ld * sizeof(float));
        float *q = (float *)aligned_alloc(32, (size_t)qmax * D * sizeof(float));
        float *kg = (float *)aligned_alloc(32, (size_t)8 * D * sizeof(float)); /* gathered tree keys */
        float inv[qmax];
        long nq_slots[qmax], lo_slot[qmax];
        float *oq[qmax];
        const int64_t *mq[qmax]; /* each query's vmap row */
#pragma omp for schedule(static)
        for (int it = 0; it < items; it++) {
            const int hi = it % hs, rest = it / hs; /* item: query heads g rep + hi hper .. + hper - 1 */
            const int tb = rest % tblocks, g = (rest / tblocks) % G, b = rest / (tblocks * G);
            const int t0 = tb * TB, t1 = t0 + TB < T ? t0 + TB : T, nq = (t1 - t0) * hper;
            const long kvb = ((long)b * G + g) * cap * D; /* element of this row and KV head's slot 0 */
            const long lo = vmap ? lo_row[b] : LONG_MAX; /* virtual slots from lo on are mapped */
            long nmax = 0;
            for (int j = 0; j < nq; j++) { /* query j: token t0 + j / hper, head g rep + hi hper + j % hper */
                const int t = t0 + j / hper, h = g * rep + hi * hper + j % hper;
                const long bt = (long)b * T + t, p = pos[bt];
                nq_slots[j] = p + 1; /* a query at position p sees slots 0..p, or p - W + 1..p */
                lo_slot[j] = window > 0 && p + 1 > window ? p + 1 - window : 0;
                nmax = p + 1 > nmax ? p + 1 : nmax;
                rope(qkv + bt * row + (long)h * D, cosT + p * D, sinT + p * D, q + (long)j * D, D);
                oq[j] = out + bt * (long)H * D + (long)h * D;
                mq[j] = vmap ? vmap + bt * W : NULL;
            }
            /* scores: each is one FMA chain over D and a fixed horizontal sum */
            for (long s0 = 0; s0 < nmax; s0 += SB)
                for (int j = 0; j < nq; j++) {
                    const long s1 = s0 + SB < nq_slots[j] ? s0 + SB : nq_slots[j];
                    const float *qj = q + (long)j * D;
                    float *scj = sc + j * ld;
                    long s = s0 > lo_slot[j] ? s0 : lo_slot[j];
                    for (; s + 8 <= s1; s += 8) { /* 8 slots: 8 chains, sums in one vector */
                        __m256 sum;
                        if (s + 8 > lo) { /* tree slots: their keys in virtual order, widened into kg */
                            for (int u = 0; u < 8; u++)
                                for (int i = 0; i < D; i += 8)
                                    _mm256_store_ps(kg + u * D + i, kv_load(kc, kvb + vslot(s + u, lo, mq[j]) * D + i, h16));
                            sum = score8(qj, kg, 0, D, 0);
                        } else {
                            sum = score8(qj, kc, kvb + s * D, D, h16);
                        }
                        _mm256_storeu_ps(scj + s, _mm256_mul_ps(sum, vscale));
                    }
                    for (; s < s1; s++) { /* the same chain and sum order, one slot */
                        __m256 a = _mm256_setzero_ps();
                        const long ks = kvb + vslot(s, lo, mq[j]) * D;
                        for (int i = 0; i < D; i += 8) a = _mm256_fmadd_ps(_mm256_load_ps(qj + i), kv_load(kc, ks + i, h16), a);
                        scj[s] = _mm256_cvtss_f32(_mm256_mul_ps(hsum8(a, a, a, a, a, a, a, a), vscale));
                    }
                }
            /* softmax numerators in place; lanes past n are zero */
            for (int j = 0; j < nq; j++) {
                float *scj = sc + j * ld;
                const long n = nq_slots[j], n8 = (n + 7) / 8 * 8, lo = lo_slot[j], lo8 = lo / 8 * 8;
                for (long s = n; s < n8; s++) scj[s] = -INFINITY;
                for (long s = lo8; s < lo; s++) scj[s] = -INFINITY;
                const float m = hmax(scj + lo8, n8 - lo8);
                __m256 vm = _mm256_set1_ps(m), vsum = _mm256_setzero_ps();
                for (long s = lo8; s < n8; s += 8) {
                    __m256 x = _mm256_loadu_ps(scj + s);
                    __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(x, vm)),
                                             _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ));
                    _mm256_storeu_ps(scj + s, e);
                    vsum = _mm256_add_ps(vsum, e);
                }
                inv[j] = 1.0f / hsum(vsum);
                for (int i = 0; i < D; i += 8) _mm256_storeu_ps(oq[j] + i, _mm256_setzero_ps());
            }
            /* output: per 8 columns one FMA chain over slots 0..n-1 in order (carried through out
             * between slot blocks, exactly), then the 1 / sum scale */
            for (long s0 = 0; s0 < nmax; s0 += SB)
                for (int j = 0; j < nq; j++) {
                    const long s1 = s0 + SB < nq_slots[j] ? s0 + SB : nq_slots[j];
                    const float *scj = sc + j * ld;
                    const long s2 = s0 > lo_slot[j] ? s0 : lo_slot[j];
                    float *o = oq[j];
                    int i = 0;
                    for (; i + 64 <= D; i += 64) {
                        __m256 c0 = _mm256_loadu_ps(o + i), c1 = _mm256_loadu_ps(o + i + 8);
                        __m256 c2 = _mm256_loadu_ps(o + i + 16), c3 = _mm256_loadu_ps(o + i + 24);
                        __m256 c4 = _mm256_loadu_ps(o + i + 32), c5 = _mm256_loadu_ps(o + i + 40);
                        __m256 c6 = _mm256_loadu_ps(o + i + 48), c7 = _mm256_loadu_ps(o + i + 56);
                        for (long s = s2; s < s1; s++) {
                            const __m256 e = _mm256_broadcast_ss(scj + s);
                            const long vr = kvb + vslot(s, lo, mq[j]) * D + i;
                            c0 = _mm256_fmadd_ps(e, kv_load(vc, vr, h16), c0);
                            c1 = _mm256_fmadd_ps(e, kv_load(vc, vr + 8, h16), c1);
                            c2 = _mm256_fmadd_ps(e, kv_load(vc, vr + 16, h16), c2);
                            c3 = _mm256_fmadd_ps(e, kv_load(vc, vr + 24, h16), c3);
                            c4 = _mm256_fmadd_ps(e, kv_load(vc, vr + 32, h16), c4);
                            c5 = _mm256_fmadd_ps(e, kv_load(vc, vr + 40, h16), c5);
                            c6 = _mm256_fmadd_ps(e, kv_load(vc, vr + 48, h16), c6);
                            c7 = _mm256_fmadd_ps(e, kv_load(vc, vr + 56, h16), c7);
                        }
                        _mm256_storeu_ps(o + i, c0), _mm256_storeu_ps(o + i + 8, c1);
                        _mm256_storeu_ps(o + i + 16, c2), _mm256_storeu_ps(o + i + 24, c3);
                        _mm256_storeu_ps(o + i + 32, c4), _mm256_storeu_ps(o + i + 40, c5);
                        _mm256_storeu_ps(o + i + 48, c6), _mm256_storeu_ps(o + i + 56, c7);
                    }
                    for (; i < D; i += 16) {
                        __m256 c0 = _mm256_loadu_ps(o + i), c1 = _mm256_loadu_ps(o + i + 8);
                        for (long s = s2; s < s1; s++) {
                            const __m256 e = _mm256_broadcast_ss(scj + s);
                            const long vr = kvb + vslot(s, lo, mq[j]) * D + i;
                            c0 = _mm256_fmadd_ps(e, kv_load(vc, vr, h16), c0);
                            c1 = _mm256_fmadd_ps(e, kv_load(vc, vr + 8, h16), c1);
                        }
                        _mm256_storeu_ps(o + i, c0), _mm256_storeu_ps(o + i + 8, c1);
                    }
                }
            for (int j = 0; j < nq; j++)
                for (int i = 0; i < D; i += 8)
                    _mm256_storeu_ps(oq[j] + i, _mm256_mul_ps(_mm256_loadu_ps(oq[j] + i), _mm256_set1_ps(inv[j])));
        }
        free(sc);
        free(q);
        free(kg);
    }
}

/* attend_kv compiled once per cache kind (h16 a constant in each). */
static void attend(const float *qkv, const int64_t *pos, const int64_t *slot, const int64_t *lo_row,
                   const int64_t *vmap, int W, const float *cosT, const float *sinT, float *kc, float *vc, float *out, int B,
                   int T, int H, int G, int D, int cap, int window, float scale, int threads) {
    attend_kv(qkv, pos, slot, lo_row, vmap, W, cosT, sinT, kc, vc, out, B, T, H, G, D, cap, window, scale, threads, 0);
}
static void attend16(const float *qkv, const int64_t *pos, const int64_t *slot, const int64_t *lo_row,
                     const int64_t *vmap, int W, const float *cosT, const float *sinT, uint16_t *kc, uint16_t *vc,
                     float *out, int B, int T, int H, int G, int D, int cap, int window, float scale, int threads) {
    attend_kv(qkv, pos, slot, lo_row, vmap, W, cosT, sinT, kc, vc, out, B, T, H, G, D, cap, window, scale, threads, 1);
}

void rope_attend_window(const float *qkv, const int64_t *pos, const float *cosT, const float *sinT, float *kc,
                        float *vc, float *out, int B, int T, int H, int G, int D, int cap, int window, float scale,
                        int threads) {
    attend(qkv, pos, NULL, NULL, NULL, 0, cosT, sinT, kc, vc, out, B, T, H, G, D, cap, window, scale, threads);
}

/* rope_attend_window over a token tree step (see attend): slot (B, T) where each new token's key and
 * value go, lo (B,) and vmap (B, T, W) the virtual slots of each query past the committed ones. */
void rope_attend_tree(const float *qkv, const int64_t *pos, const int64_t *slot, const int64_t *lo,
                      const int64_t *vmap, int W, const float *cosT, const float *sinT, float *kc, float *vc,
                      float *out, int B, int T, int H, int G, int D, int cap, int window, float scale, int threads) {
    attend(qkv, pos, slot, lo, vmap, W, cosT, sinT, kc, vc, out, B, T, H, G, D, cap, window, scale, threads);
}

void rope_attend(const float *qkv, const int64_t *pos, const float *cosT, const float *sinT, float *kc, float *vc,
                 float *out, int B, int T, int H, int G, int D, int cap, int threads) {
    rope_attend_window(qkv, pos, cosT, sinT, kc, vc, out, B, T, H, G, D, cap, 0, 1.0f / sqrtf((float)D), threads);
}

/* rope_attend and rope_attend_tree over fp16 caches (kv_load: the quantized runtime's). */
void rope_attend16(const float *qkv, const int64_t *pos, const float *cosT, const float *sinT, uint16_t *kc,
                   uint16_t *vc, float *out, int B, int T, int H, int G, int D, int cap, int threads) {
    attend16(qkv, pos, NULL, NULL, NULL, 0, cosT, sinT, kc, vc, out, B, T, H, G, D, cap, 0, 1.0f / sqrtf((float)D),
             threads);
}

void rope_attend_tree16(const float *qkv, const int64_t *pos, const int64_t *slot, const int64_t *lo,
                        const int64_t *vmap, int W, const float *cosT, const float *sinT, uint16_t *kc, uint16_t *vc,
                        float *out, int B, int T, int H, int G, int D, int cap, int window, float scale, int threads) {
    attend16(qkv, pos, slot, lo, vmap, W, cosT, sinT, kc, vc, out, B, T, H, G, D, cap, window, scale, threads);
}

/* ---- the decoder layers of a decode / verification step in one call ----------------------------
 *
 * For a step of a few new tokens per row, the layers' arithmetic is ~14 ms on this project's CPU and
 * the Python and torch per-op overhead around it (output allocations, argument checks, residual
 * adds, SiLU, ~12 calls per layer) was another 6-9 ms. This runs the layer loop natively with the
 * kernels above: per layer
 *
 *   h = rmsnorm(x); qkv = h Wqkv^T; att = rope_attend(qkv); x += att Wo^T;
 *   h = rmsnorm(x); [g | u] = h Wgu^T; x += (silu(g) * u) Wdown^T
 *
 * with bf16 weights in the packed layout, fp32 activations, no biases (Llama, Mistral, SmolLM2).
 * x (M = B T rows of C floats) is updated in place. Every operation is row by row in a fixed order,
 * so rows stay independent of each other as in the kernels it calls. silu(g) = g / (1 + e^-g) with
 * exp256 above. */
void decode_layers_tree(float *x, const int64_t *pos, const int64_t *slot, const int64_t *lo, const int64_t *vmap,
                        int W, int B, int T, int C, int H, int G, int D, int F, int cap, float eps, int L,
                        const float *const *attn_norm, const uint16_t *const *wqkv, const uint16_t *const *wo,
                        const float *const *mlp_norm, const uint16_t *const *wgu, const uint16_t *const *wdown,
                        float *const *kc, float *const *vc, const float *cosT, const float *sinT, int threads) {
    const int M = B * T, Q = (H + 2 * G) * D;
    float *h = (float *)aligned_alloc(32, sizeof(float) * (size_t)M * (C > F ? C : F) + 32);
    float *qkv = (float *)aligned_alloc(32, sizeof(float) * (size_t)M * Q + 32);
    float *att = (float *)aligned_alloc(32, sizeof(float) * (size_t)M * H * D + 32);
    float *gu = (float *)aligned_alloc(32, sizeof(float) * (size_t)M * 2 * F + 32);
    float *y = (float *)aligned_alloc(32, sizeof(float) * (size_t)M * C + 32);
    for (int l = 0; l < L; l++) {
        rmsnorm_f32(x, attn_norm[l], h, M, C, eps);
        packed_bf16(h, wqkv[l], qkv, M, C, Q, threads);
        attend(qkv, pos, slot, lo, vmap, W, cosT, sinT, kc[l], vc[l], att, B, T, H, G, D, cap, 0, 1.0f / sqrtf((float)D),
               threads);
        packed_bf16(att, wo[l], y, M, H * D, C, threads);
        for (long i = 0; i < (long)M * C; i += 8)
            _mm256_storeu_ps(x + i, _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
        rmsnorm_f32(x, mlp_norm[l], h, M, C, eps);
        packed_bf16(h, wgu[l], gu, M, C, 2 * F, threads);
        for (int m = 0; m < M; m++) {
            const float *g = gu + (long)m * 2 * F, *u = g + F;
            float *a = h + (long)m * F;
            for (int j = 0; j < F; j += 8) {
                const __m256 gv = _mm256_loadu_ps(g + j);
                const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
                _mm256_storeu_ps(a + j, _mm256_mul_ps(s, _mm256_loadu_ps(u + j)));
            }
        }
        packed_bf16(h, wdown[l], y, M, F, C, threads);
        for (long i = 0; i < (long)M * C; i += 8)
            _mm256_storeu_ps(x + i, _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    }
    free(h), free(qkv), free(att), free(gu), free(y);
}

/* decode_layers_tree for a causal step (slot, lo and vmap NULL: every token at its position). */
void decode_layers(float *x, const int64_t *pos, int B, int T, int C, int H, int G, int D, int F, int cap, float eps,
                   int L, const float *const *attn_norm, const uint16_t *const *wqkv, const uint16_t *const *wo,
                   const float *const *mlp_norm, const uint16_t *const *wgu, const uint16_t *const *wdown,
                   float *const *kc, float *const *vc, const float *cosT, const float *sinT, int threads) {
    decode_layers_tree(x, pos, NULL, NULL, NULL, 0, B, T, C, H, G, D, F, cap, eps, L, attn_norm, wqkv, wo, mlp_norm, wgu,
                       wdown, kc, vc, cosT, sinT, threads);
}
