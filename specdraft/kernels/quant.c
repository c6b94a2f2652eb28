/* Quantized matmuls over GGUF weight blocks, for a few rows of activations (AVX2, run-time chosen):
 *
 *   quant_quantize   fp32 rows -> 8-bit activation blocks of 32 (one fp32 scale per block, per row)
 *   quant_matmul     y = x W^T with W in GGUF blocks (Q4_0, Q4_1, Q8_0), x as activation blocks
 *   quant_dequant    chosen rows of W back to fp32 (the embedding lookup)
 *   quant_layers     the decoder layers of a Llama-family step in one call (quantized matmuls,
 *                    fewrows.c's rope_attend and rmsnorm_f32 passed in as function pointers)
 *
 * ---- block layouts, exactly as ggml stores them in a GGUF file (QK = 32 weights per block) -----
 *
 *   Q4_0: fp16 d, 16 bytes qs       w[i] = d (nib[i] - 8); nib[i] = qs[i] & 15 (i < 16),
 *                                    qs[i - 16] >> 4 (i >= 16)
 *   Q4_1: fp16 d, fp16 m, 16 bytes  w[i] = d nib[i] + m
 *   Q8_0: fp16 d, 32 int8 qs        w[i] = d qs[i]
 *
 * A weight row of K values is K / 32 consecutive blocks; the matrix (N, K) is N such rows (the
 * GGUF file's bytes, read in place through a memory map: there is no de-quantized copy).
 *
 * Activations (a8 blocks): per row and per 32 values, d = max |x| / 127, q = round(x / d) in
 * [-127, 127], and s = d sum(q) (for Q4_1's m term). So each row is quantized on its own.
 *
 * ---- dot products and the order of operations ---------------------------------------------------
 *
 * Per block, the integer products of the 32 weight and activation bytes are summed exactly in
 * eight int32 lanes (lane j: bytes 4j..4j+3; AVX2 vpmaddubsw then vpmaddwd with ones; Q4_0 and Q8_0
 * take the sign trick of vpsignb so the unsigned operand is |w|); each lane is converted to float
 * and accumulated as acc_j = fma(d_w d_a, lane_j, acc_j), block by block in order. The result is
 * ((acc0 + acc4) + (acc1 + acc5)) + ((acc2 + acc6) + (acc3 + acc7)), plus, for Q4_1, the m term
 * summed separately in block order: mins = fma(m, s_a, mins). The scalar reference functions do
 * exactly these float operations, so they and the AVX2 code agree bit for bit (tests compare them).
 *
 * Every y[m, n] is that one sequence whatever the number of rows, the tile or the thread, so each
 * output row depends on its own input row only: a (k + 1)-token verification gives bit-identical
 * logits to k + 1 one-token steps (tests check 1..64 rows).
 *
 * Threads: OpenMP over blocks of output columns, as in fewrows.c (the same libgomp as torch's).
 */
#pragma GCC target("avx2,fma,f16c")
#pragma GCC optimize("fp-contract=off") /* float operations exactly as written (scalar == AVX2) */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 32
enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q8_0 = 8 }; /* ggml type ids */
enum { V_REF = 0, V_AVX2 = 1 };             /* kernel variants */
#define MR 4                                /* activation rows per tile */

typedef struct {
    float d, s; /* scale, d * sum(qs) */
    int8_t qs[QK];
} block_a8;

/* One weight matrix (N, K) in GGUF blocks; output column n is written at omap[n] (NULL: n), which
 * is how the runtime undoes the GGUF llama converter's row permutation of q and k. */
typedef struct {
    const uint8_t *w;
    int type, rows, cols;
    long row_bytes;
    const int32_t *omap;
} qmat;

static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

int quant_block_bytes(int type) {
    return type == T_Q4_0 ? 18 : type == T_Q4_1 ? 20 : type == T_Q8_0 ? 34 : 0;
}

void quant_quantize(const float *x, block_a8 *a, int M, int K) {
    const int nb = K / QK;
    for (long m = 0; m < M; m++)
        for (int b = 0; b < nb; b++) {
            const float *xb = x + m * K + (long)b * QK;
            block_a8 *ab = a + m * nb + b;
            float amax = 0.0f;
            for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(xb[i]));
            const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            int sum = 0;
            for (int i = 0; i < QK; i++) {
                long q = lrintf(xb[i] * id);
                q = q > 127 ? 127 : q < -127 ? -127 : q;
                ab->qs[i] = (int8_t)q;
                sum += (int)q;
            }
            ab->d = d;
            ab->s = d * (float)sum;
        }
}

/* The 32 integer weights of block b (Q4_0: nib - 8, Q4_1: nib, Q8_0: qs), its d and m. */
static inline void unpack_ref(int type, const uint8_t *row, int b, int8_t *q, float *d, float *m) {
    const uint8_t *blk = row + (long)b * quant_block_bytes(type);
    *d = f16(blk);
    *m = 0.0f;
    if (type == T_Q8_0) {
        memcpy(q, blk + 2, QK);
        return;
    }
    const uint8_t *qs = blk + (type == T_Q4_1 ? 4 : 2);
    const int off = type == T_Q4_0 ? 8 : 0;
    if (type == T_Q4_1) *m = f16(blk + 2);
    for (int i = 0; i < 16; i++) {
        q[i] = (int8_t)((qs[i] & 15) - off);
        q[i + 16] = (int8_t)((qs[i] >> 4) - off);
    }
}

static inline float hsum_ref(const float *a) { return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7])); }

static float dot_ref(int type, const uint8_t *row, const block_a8 *a, int nb) {
    float acc[8] = {0}, mins = 0.0f;
    for (int b = 0; b < nb; b++) {
        int8_t q[QK];
        float d, m;
        unpack_ref(type, row, b, q, &d, &m);
        const float scale = d * a[b].d;
        for (int j = 0; j < 8; j++) {
            int s = 0;
            for (int e = 4 * j; e < 4 * j + 4; e++) s += q[e] * a[b].qs[e];
            acc[j] = fmaf(scale, (float)s, acc[j]);
        }
        if (type == T_Q4_1) mins = fmaf(m, a[b].s, mins);
    }
    return hsum_ref(acc) + mins;
}

static inline float hsum(__m256 v) { /* ((a0 + a4) + (a1 + a5)) + ((a2 + a6) + (a3 + a7)) */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

/* R activation rows (R <= MR, a compile-time constant after inlining) against one weight row. */
static inline __attribute__((always_inline)) void dot_avx2(int type, const uint8_t *row, const block_a8 *a, long as,
                                                           int nb, int R, float *out) {
    __m256 acc[MR];
    float mins[MR];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps(), mins[r] = 0.0f;
    const int bb = quant_block_bytes(type);
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(15), eight = _mm256_set1_epi8(8);
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + (long)b * bb;
        const float d = f16(blk);
        __m256i wq;
        float m = 0.0f;
        if (type == T_Q8_0) {
            wq = _mm256_loadu_si256((const __m256i *)(blk + 2));
        } else {
            const __m128i t = _mm_loadu_si128((const __m128i *)(blk + (type == T_Q4_1 ? 4 : 2)));
            wq = _mm256_and_si256(_mm256_insertf128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1), low);
            if (type == T_Q4_0) wq = _mm256_sub_epi8(wq, eight);
            else m = f16(blk + 2);
        }
        const __m256i aw = type == T_Q4_1 ? wq : _mm256_sign_epi8(wq, wq); /* |w| (Q4_1: already >= 0) */
        for (int r = 0; r < R; r++) {
            const block_a8 *ab = a + r * as + b;
            __m256i av = _mm256_loadu_si256((const __m256i *)ab->qs);
            if (type != T_Q4_1) av = _mm256_sign_epi8(av, wq); /* a sign(w): |w| a sign(w) = w a */
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, av), ones);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * ab->d), _mm256_cvtepi32_ps(p), acc[r]);
            if (type == T_Q4_1) mins[r] = fmaf(m, ab->s, mins[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum(acc[r]) + mins[r];
}

#define DOT_ROWS(TYPE)                                                                          \
    switch (R) {                                                                                \
    case 4: dot_avx2(TYPE, row, a, nb, nb, 4, out); break;                                      \
    case 3: dot_avx2(TYPE, row, a, nb, nb, 3, out); break;                                      \
    case 2: dot_avx2(TYPE, row, a, nb, nb, 2, out); break;                                      \
    default: dot_avx2(TYPE, row, a, nb, nb, 1, out);                                            \
    }

static void tile_avx2(int type, const uint8_t *row, const block_a8 *a, int nb, int R, float *out) {
    if (type == T_Q4_0) {
        DOT_ROWS(T_Q4_0)
    } else if (type == T_Q4_1) {
        DOT_ROWS(T_Q4_1)
    } else {
        DOT_ROWS(T_Q8_0)
    }
}

static void matmul_range(const qmat *W, const block_a8 *a, int M, float *y, long ldy, int n0, int n1, int variant) {
    const int nb = W->cols / QK;
    for (int n = n0; n < n1; n++) {
        const uint8_t *row = W->w + (long)n * W->row_bytes;
        const long col = W->omap ? W->omap[n] : n;
        if (variant == V_REF) {
            for (long m = 0; m < M; m++) y[m * ldy + col] = dot_ref(W->type, row, a + m * nb, nb);
            continue;
        }
        for (int m0 = 0; m0 < M; m0 += MR) {
            const int R = M - m0 < MR ? M - m0 : MR;
            float out[MR];
            tile_avx2(W->type, row, a + (long)m0 * nb, nb, R, out);
            for (int r = 0; r < R; r++) y[(long)(m0 + r) * ldy + col] = out[r];
        }
    }
}

/* y[m * ldy + col(n)] = (row m of the activations) . (row n of W) for m < M, n < W->rows. */
static void matmul(const qmat *W, const block_a8 *a, int M, float *y, long ldy, int variant, int threads) {
    const int N = W->rows;
    if (threads <= 1) {
        matmul_range(W, a, M, y, ldy, 0, N, variant);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int per = (N + T - 1) / T, n0 = t * per, n1 = n0 + per < N ? n0 + per : N;
        if (n0 < n1) matmul_range(W, a, M, y, ldy, n0, n1, variant);
    }
}

int quant_supported(int type) { return quant_block_bytes(type) != 0; }

/* y (M, ldy) = quantize(x (M, K)) W^T, K = W->cols, for tests and single matmuls. */
void quant_matmul(const qmat *W, const float *x, float *y, int M, long ldy, int variant, int threads) {
    block_a8 *a = (block_a8 *)malloc(sizeof(block_a8) * (size_t)M * (W->cols / QK) + 1);
    quant_quantize(x, a, M, W->cols);
    matmul(W, a, M, y, ldy, variant, threads);
    free(a);
}

/* out (n, K) = rows ids[0..n-1] of W, de-quantized: the exact values d q (+ m) in fp32. */
void quant_dequant(const qmat *W, const int64_t *ids, int n, float *out) {
    const int K = W->cols, nb = K / QK;
    for (int i = 0; i < n; i++) {
        const uint8_t *row = W->w + ids[i] * W->row_bytes;
        for (int b = 0; b < nb; b++) {
            int8_t q[QK];
            float d, m;
            unpack_ref(W->type, row, b, q, &d, &m);
            for (int e = 0; e < QK; e++) out[(long)i * K + b * QK + e] = W->type == T_Q4_1 ? fmaf(d, (float)q[e], m) : d * (float)q[e];
        }
    }
}

/* ---- the decoder layers of a step --------------------------------------------------------------
 *
 *   h = rmsnorm(x); qkv = h [Wq | Wk | Wv]^T; att = rope_attend(qkv); x += att Wo^T;
 *   h = rmsnorm(x); g = h Wg^T, u = h Wu^T; x += (silu(g) u) Wdown^T
 *
 * Every step is row by row in a fixed order (each matmul quantizes its input rows first), so rows
 * stay independent as in the kernels called. rope_attend and rmsnorm_f32 come from fewrows.c. */

typedef struct {
    const float *attn_norm, *ffn_norm;
    qmat q, k, v, o, gate, up, down;
} qlayer;

typedef void (*rope_attend_fn)(const float *, const int64_t *, const float *, const float *, float *, float *, float *,
                               int, int, int, int, int, int, int);
typedef void (*rmsnorm_fn)(const float *, const float *, float *, int, int, float);

/* e^x for x in [-88, 88] (Cephes' expf polynomial, ~1 ulp), 8 lanes: as exp256 in fewrows.c. */
static inline __m256 exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
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

static void add_rows(float *x, const float *y, long n) {
    for (long i = 0; i < n; i += 8) _mm256_storeu_ps(x + i, _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
}

void quant_layers(float *x, const int64_t *pos, int B, int T, int C, int H, int G, int D, int F, int cap, float eps,
                  int L, const qlayer *layers, float *const *kc, float *const *vc, const float *cosT, const float *sinT,
                  void *rope_attend, void *rmsnorm, int variant, int threads) {
    const rope_attend_fn attend = (rope_attend_fn)rope_attend;
    const rmsnorm_fn norm = (rmsnorm_fn)rmsnorm;
    const int M = B * T, HD = H * D, GD = G * D, Q = HD + 2 * GD;
    const int widest = C > F ? (C > HD ? C : HD) : (F > HD ? F : HD);
    float *h = (float *)aligned_alloc(32, sizeof(float) * (size_t)M * widest + 32);
    block_a8 *a = (block_a8 *)malloc(sizeof(block_a8) * (size_t)M * (widest / QK) + 1);
    float *qkv = (float *)aligned_alloc(32, sizeof(float) * (size_t)M * Q + 32);
    float *att = (float *)aligned_alloc(32, sizeof(float) * (size_t)M * HD + 32);
    float *gu = (float *)aligned_alloc(32, sizeof(float) * (size_t)M * 2 * F + 32);
    float *y = (float *)aligned_alloc(32, sizeof(float) * (size_t)M * C + 32);
    for (int l = 0; l < L; l++) {
        const qlayer *ly = layers + l;
        norm(x, ly->attn_norm, h, M, C, eps);
        quant_quantize(h, a, M, C);
        matmul(&ly->q, a, M, qkv, Q, variant, threads);
        matmul(&ly->k, a, M, qkv + HD, Q, variant, threads);
        matmul(&ly->v, a, M, qkv + HD + GD, Q, variant, threads);
        attend(qkv, pos, cosT, sinT, kc[l], vc[l], att, B, T, H, G, D, cap, threads);
        quant_quantize(att, a, M, HD);
        matmul(&ly->o, a, M, y, C, variant, threads);
        add_rows(x, y, (long)M * C);
        norm(x, ly->ffn_norm, h, M, C, eps);
        quant_quantize(h, a, M, C);
        matmul(&ly->gate, a, M, gu, 2 * F, variant, threads);
        matmul(&ly->up, a, M, gu + F, 2 * F, variant, threads);
        for (long m = 0; m < M; m++) {
            const float *g = gu + m * 2 * F, *u = g + F;
            float *o = h + m * F;
            for (int j = 0; j < F; j += 8) {
                const __m256 gv = _mm256_loadu_ps(g + j);
                const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
                _mm256_storeu_ps(o + j, _mm256_mul_ps(s, _mm256_loadu_ps(u + j)));
            }
        }
        quant_quantize(h, a, M, F);
        matmul(&ly->down, a, M, y, C, variant, threads);
        add_rows(x, y, (long)M * C);
    }
    free(h), free(a), free(qkv), free(att), free(gu), free(y);
}
