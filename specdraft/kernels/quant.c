/* Quantized matmuls over GGUF weight blocks, for a few rows of activations (AVX2 or VNNI, run-time chosen):
 *
 *   quant_quantize   fp32 rows -> 8-bit activation blocks of 32 (one fp32 scale per block, per row)
 *   quant_matmul     y = x W^T with W in GGUF blocks (Q4_0, Q4_1, Q8_0), x as activation blocks
 *   quant_dequant    chosen rows of W back to fp32 (the embedding lookup)
 *   quant_layers     the decoder layers of a Llama-family step in one call (quantized matmuls,
 *                    fewrows.c's rope_attend16 (fp16 caches) and rmsnorm_f32 passed in as function pointers);
 *                    a ragged step packs each row's own tokens, with no padding (attend_step);
 *                    a token-tree step attends through fewrows.c's rope_attend_tree16 (tree_attend)
 *
 * ---- block layouts, exactly as ggml stores them in a GGUF file (QK = 32 weights per block) -----
 *
 *   Q4_0: fp16 d, 16 bytes qs       w[i] = d (nib[i] - 8); nib[i] = qs[i] & 15 (i < 16),
 *                                    qs[i - 16] >> 4 (i >= 16)
 *   Q4_1: fp16 d, fp16 m, 16 bytes  w[i] = d nib[i] + m
 *   Q8_0: fp16 d, 32 int8 qs        w[i] = d qs[i]
 *
 * A weight row of K values is K / 32 consecutive blocks; the matrix (N, K) is N such rows (the
 * GGUF file's bytes, read in place through a memory map: there is no de-quantized copy). The runtime
 * multiplies by an x8 copy instead (quant_repack, once at load: the same blocks, rows interleaved
 * by groups of 8, the same bytes in all; see "the x8 layout"); every kernel takes either layout.
 *
 * Activations (a8 blocks): per row and per 32 values, d = max |x| / 127, q = round(x / d) in
 * [-127, 127], and s = d sum(q) (for Q4_1's m term). So each row is quantized on its own.
 *
 * ---- dot products and the order of operations ---------------------------------------------------
 *
 * Per block, the integer products of the 32 weight and activation bytes are summed exactly in two
 * halves (elements 0..15 and 16..31: a Q4 block's low and high nibbles; AVX2 vpmaddubsw, vpmaddwd
 * with ones and integer adds; Q4_0 and Q8_0 take the sign trick of vpsignb so the unsigned operand
 * is |w|). Each half sum is converted to float (exact: |sum| < 2^24) and accumulated in its own
 * chain, lo = fma(d_w d_a, sum_lo, lo) and hi = fma(d_w d_a, sum_hi, hi), block by block in order.
 * The result is (lo + hi) + mins, mins the Q4_1 m term summed separately in block order:
 * mins = fma(m, s_a, mins). The scalar reference (dot_ref) does exactly these float operations, so
 * it and the AVX2 code agree bit for bit (tests compare them). Integer sums are exact in any order,
 * so the AVX2 tiles form them however is cheapest (see "the AVX2 tiles"); only the float chain is
 * fixed, and it is 3 vector operations per 4 columns x 32 weights.
 *
 * Every y[m, n] is that one sequence whatever the number of rows, the tile or the thread, so each
 * output row depends on its own input row only: a (k + 1)-token verification gives bit-identical
 * logits to k + 1 one-token steps (tests check 1..64 rows).
 *
 * Tiles (AVX2): 4 weight rows x up to 3 activation rows; each unpacked weight block serves every
 * row; see "the AVX2 tiles". An x8 matrix: 8 weight rows x up to 2 activation rows, no unpacking
 * beyond the nibble split (group_rows): on a Xeon (AVX512-VNNI), 2 threads, a 1-token step took 0.86x
 * (avx2) and 0.76x (avxvnni) the time of avx2 on the file layout, a 64-token one 0.95x and 0.69x
 * (results/quant-2026-12-03/variants.txt).
 *
 * Variants (run-time choice, quant.py's variants()): ref (the scalar dot_ref), avx2, and where the
 * CPU has them avxvnni / avx512vnni: the AVX2 tiles with the integer products summed by one vpdpbusd
 * instead of vpmaddubsw + vpmaddwd + adds (see dpbusd). The integer sums are exact either way and the
 * float chain is the same, so every variant gives the same bits.
 *
 * Why hand-written: BLAS and oneDNN int8 GEMMs (and llama.cpp's own llamafile / repacked GEMMs)
 * choose their blocking, and so their float summation order, by the number of rows, so a row's
 * result changes with the batch it is in; no library offers a per-row-deterministic product of
 * GGUF blocks with 8-bit activation blocks, which bit-identical speculative verification needs.
 *
 * Threads: OpenMP over output columns (the same libgomp as torch's); quant_layers opens one
 * parallel region per decoder layer (plus the attention's), not one per matmul.
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
enum { V_REF = 0, V_AVX2 = 1, V_AVXVNNI = 2, V_AVX512VNNI = 3 }; /* kernel variants (`isa` below) */
#define MR 3                                 /* activation rows per tile, at most */
#define PF 2048                              /* prefetch distance in bytes */
#define KT 768 /* rows up to KT wide take the lane-transposed tiles (their activations stay in L1) */

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
    int x8; /* rows 0 .. 8 floor(N / 8) - 1 in the x8 layout (quant_repack), the rest as the file has them */
} qmat;

static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline int block_bytes(int type) {
    return type == T_Q4_0 ? 18 : type == T_Q4_1 ? 20 : type == T_Q8_0 ? 34 : 0;
}

int quant_block_bytes(int type) { return block_bytes(type); }

/* Blocks [b0, b1) of each of M rows (row stride K) -> a (M, K / 32), per block:
 *   amax = max |x|, d = amax / 127, q = round(x / d) (x (1 / d), to nearest even, as lrintf),
 *   clamped to [-127, 127], s = d sum(q).
 * The max is exact in any order and the sum is of integers, so the 8-lane form below is the
 * scalar definition, value for value. */
static void quantize_blocks(const float *x, block_a8 *a, int M, int K, int b0, int b1) {
    const int nb = K / QK;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (long m = 0; m < M; m++)
        for (int b = b0; b < b1; b++) {
            const float *xb = x + m * K + (long)b * QK;
            block_a8 *ab = a + m * nb + b;
            __m256 v[4], mx = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                v[i] = _mm256_loadu_ps(xb + 8 * i);
                mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
            }
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_movehdup_ps(h));
            const float d = _mm_cvtss_f32(h) / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            const __m256i lim = _mm256_set1_epi32(127), nlim = _mm256_set1_epi32(-127);
            __m256i q[4], sum = _mm256_setzero_si256();
            for (int i = 0; i < 4; i++) {
                q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id))); /* MXCSR: nearest even */
                q[i] = _mm256_max_epi32(_mm256_min_epi32(q[i], lim), nlim);
                sum = _mm256_add_epi32(sum, q[i]);
            }
            const __m256i q16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xd8); /* x 0..15 */
            const __m256i q16b = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xd8);
            const __m256i q8 = _mm256_permute4x64_epi64(_mm256_packs_epi16(q16, q16b), 0xd8);
            _mm256_storeu_si256((__m256i *)ab->qs, q8);
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
            ab->d = d;
            ab->s = d * (float)_mm_cvtsi128_si32(s4);
        }
}

void quant_quantize(const float *x, block_a8 *a, int M, int K) { quantize_blocks(x, a, M, K, 0, K / QK); }

/* The 32 integer weights of block b (Q4_0: nib - 8, Q4_1: nib, Q8_0: qs), its d and m. */
static inline void unpack_ref(int type, const uint8_t *row, int b, int8_t *q, float *d, float *m) {
    const uint8_t *blk = row + (long)b * block_bytes(type);
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

/* ---- the x8 layout ----------------------------------------------------------------------------
 *
 * quant_repack rewrites a matrix's rows in groups of 8 (the first 8 floor(N / 8) rows; the rest stay
 * as the file has them), in the same bytes per group: per block b of the group, the 8 rows' d (fp16),
 * for Q4_1 their 8 m, then their weights interleaved by groups of 4: for j = 0..3 (Q4: qs bytes 4j..4j+3,
 * whose low nibbles are elements 4j..4j+3 and high nibbles 16 + 4j..) or j = 0..7 (Q8_0: elements
 * 4j..4j+3), 32 bytes [row 0's 4 bytes, row 1's, ..., row 7's]. One vpdpbusd of such a vector with
 * an activation group broadcast adds that group's products of 8 rows in 8 lanes, so the half sums
 * of 8 rows come without any horizontal add or transposition (group_rows). Each row's integer half
 * sums and float chain are dot_ref's, so the layout changes no result. */
#define HDR(type) ((type) == T_Q4_1 ? 32 : 16) /* bytes of the 8 d (and 8 m) before a group's weights */

/* Where block b of row n starts in the file's layout, or (x8 rows) in its group (*c: n's lane). */
static inline const uint8_t *block_of(const qmat *W, long n, int b, int *c) {
    const int bb = block_bytes(W->type);
    *c = -1;
    if (W->x8 && n < W->rows / 8 * 8) {
        *c = (int)(n % 8);
        return W->w + (n / 8) * 8 * W->row_bytes + (long)b * 8 * bb;
    }
    return W->w + n * W->row_bytes + (long)b * bb;
}

/* Block b of row n as the file stores it (d, [m], qs), from either layout: out (block_bytes). */
static void file_block(const qmat *W, long n, int b, uint8_t *out) {
    int c;
    const uint8_t *blk = block_of(W, n, b, &c);
    const int bb = block_bytes(W->type), hdr = HDR(W->type), qoff = W->type == T_Q4_1 ? 4 : 2;
    if (c < 0) {
        memcpy(out, blk, bb);
        return;
    }
    memcpy(out, blk + 2 * c, 2);
    if (W->type == T_Q4_1) memcpy(out + 2, blk + 16 + 2 * c, 2);
    for (int j = 0; j < (bb - qoff) / 4; j++) memcpy(out + qoff + 4 * j, blk + hdr + 32 * j + 4 * c, 4);
}

/* The file's rows [0, 8 floor(N / 8)) of W (its own layout) into out in the x8 layout. */
void quant_repack(const qmat *W, uint8_t *out) {
    const int bb = block_bytes(W->type), nb = W->cols / QK, hdr = HDR(W->type), qoff = W->type == T_Q4_1 ? 4 : 2;
    for (long g = 0; g < W->rows / 8; g++)
        for (int b = 0; b < nb; b++) {
            uint8_t *o = out + g * 8 * W->row_bytes + (long)b * 8 * bb;
            for (int c = 0; c < 8; c++) {
                const uint8_t *src = W->w + (g * 8 + c) * W->row_bytes + (long)b * bb;
                memcpy(o + 2 * c, src, 2);
                if (W->type == T_Q4_1) memcpy(o + 16 + 2 * c, src + 2, 2);
                for (int j = 0; j < (bb - qoff) / 4; j++) memcpy(o + hdr + 32 * j + 4 * c, src + qoff + 4 * j, 4);
            }
        }
}

/* Rows ids[0..n-1] of W in the file's layout, whichever W's: out (n, row_bytes). */
void quant_file_rows(const qmat *W, const int64_t *ids, int n, uint8_t *out) {
    const int bb = block_bytes(W->type), nb = W->cols / QK;
    for (int i = 0; i < n; i++)
        for (int b = 0; b < nb; b++) file_block(W, ids[i], b, out + (long)i * W->row_bytes + (long)b * bb);
}

/* The dot product of a weight row and an activation row: per block b, the exact integer sums of
 * its two halves (elements 0..15 and 16..31, the low and high nibbles of a Q4 block), each
 * converted to float and accumulated in its own chain, lo = fma(d_w d_a, sum_lo, lo) and
 * hi = fma(d_w d_a, sum_hi, hi), block by block in order; then (lo + hi) + mins (Q4_1's m term). */
static float dot_ref(const qmat *W, long n, const block_a8 *a, int nb) {
    const int type = W->type;
    float lo = 0.0f, hi = 0.0f, mins = 0.0f;
    for (int b = 0; b < nb; b++) {
        int8_t q[QK];
        float d, m;
        uint8_t blk[34];
        file_block(W, n, b, blk);
        unpack_ref(type, blk, 0, q, &d, &m);
        int s[2] = {0, 0};
        for (int e = 0; e < QK; e++) s[e / 16] += q[e] * a[b].qs[e];
        const float scale = d * a[b].d;
        lo = fmaf(scale, (float)s[0], lo);
        hi = fmaf(scale, (float)s[1], hi);
        if (type == T_Q4_1) mins = fmaf(m, a[b].s, mins);
    }
    return (lo + hi) + mins;
}

/* The 32 integer weights of a block (Q4_0: nib - 8, Q4_1: nib, Q8_0: qs). The nibbles: the 16
 * bytes in both halves (a load), the high half shifted right by 4, both masked to 4 bits. */
static inline __m256i unpack_avx2(int type, const uint8_t *blk) {
    if (type == T_Q8_0) return _mm256_loadu_si256((const __m256i *)(blk + 2));
    const __m256i t =
        _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(blk + (type == T_Q4_1 ? 4 : 2))));
    const __m256i wq =
        _mm256_and_si256(_mm256_srlv_epi64(t, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(15));
    return type == T_Q4_0 ? _mm256_sub_epi8(wq, _mm256_set1_epi8(8)) : wq;
}

#define NC 4 /* weight rows (output columns) per tile */

/* Block b's scales of NC = 4 consecutive weight rows (p: the first row's block, rs: row stride):
 * d in both halves, [d0 d1 d2 d3 d0 d1 d2 d3]; for Q4_1 also *m4 = [m0 m1 m2 m3]. */
static inline __m256 scales4(int type, const uint8_t *p, long rs, __m128 *m4) {
    if (type == T_Q4_1) {
        uint32_t h[4];
        for (int c = 0; c < 4; c++) memcpy(h + c, p + c * rs, 4);
        const __m256 dm = _mm256_cvtph_ps(_mm_setr_epi32((int)h[0], (int)h[1], (int)h[2], (int)h[3]));
        *m4 = _mm256_castps256_ps128(_mm256_permutevar8x32_ps(dm, _mm256_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7)));
        return _mm256_permutevar8x32_ps(dm, _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6));
    }
    uint16_t h[4];
    for (int c = 0; c < 4; c++) memcpy(h + c, p + c * rs, 2);
    const __m128i v = _mm_setr_epi16((short)h[0], (short)h[1], (short)h[2], (short)h[3], 0, 0, 0, 0);
    *m4 = _mm_setzero_ps();
    return _mm256_cvtph_ps(_mm_unpacklo_epi64(v, v));
}

/* ---- the AVX2 tiles ----------------------------------------------------------------------------
 *
 * A tile is NC = 4 consecutive weight rows (output columns) against R <= 3 activation rows. Per
 * block and activation row, the 4 columns' half sums are one int32 vector
 * [lo(c0) lo(c1) lo(c2) lo(c3) | hi(c0) .. hi(c3)] (integer sums: exact in any order, so they are
 * formed however is cheapest), and one conversion and one fma with [d_w(c0..3) d_w(c0..3)] d_a
 * advance the 8 chains of dot_ref (lo and hi of 4 columns); at the end lo + hi + mins, 4 columns at
 * once. So each output is dot_ref's sequence of float operations (scalar == AVX2, whatever the
 * tile or the number of rows), and the float work is 3 vector operations per 4 x 32 weights.
 *
 * With few rows (use_direct) a tile reads the file's blocks directly (tile_direct); with more, it
 * unpacks its 4 rows once (tile_unpack: 4 K int8 weights, the scales as floats) and each group of
 * <= 3 rows runs over that copy in L1 (tile_rows), so the nibbles are split, the scales gathered
 * and converted once per tile, not once per row group. For rows up to KT wide the copy has its 8-lane
 * groups transposed (lanes k and k + 4 of the 4 columns in one vector) and the activations are
 * laid out alike once per matmul: the 4 products of a block then sum to the half-sum vector with
 * plain adds (16-bit adds for Q4 weights, whose pair products stay below 2^15 / 4), no horizontal
 * adds; wider rows (ffn_down, K = 1536) keep the by-column copy (tile_rows_cols), as the 4x larger
 * transposed activations no longer stay in L1 there. */

#define AI __attribute__((always_inline))

/* acc + per int32 lane the sum of its 4 byte products u s (u unsigned, s signed): vpdpbusd with VNNI
 * (VEX-encoded for AVX-VNNI, EVEX for AVX512-VNNI + VL, on the same 256-bit registers), else AVX2's
 * vpmaddubsw, vpmaddwd with ones and vpaddd. Every use here has |u| <= 127 and |s| <= 127, so
 * vpmaddubsw's 16-bit pair sums (<= 2 127 127 < 2^15) never saturate and both forms give the same
 * exact integers: a VNNI variant computes bit for bit what the AVX2 one does, in fewer instructions.
 * Inline assembly because this file is compiled for AVX2 only (the VNNI intrinsics would need their
 * target on every function they are inlined into, and the compiler could then emit VNNI in the AVX2
 * variant); which form runs is the caller's `isa`, chosen at run time (quant.py's variants()). */
static inline AI __m256i dpbusd(int isa, __m256i acc, __m256i u, __m256i s) {
    if (isa == V_AVXVNNI)
        __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u), "x"(s));
    else if (isa == V_AVX512VNNI)
        __asm__("%{evex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u), "x"(s));
    else
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
    return acc;
}

/* The half sums [lo(c0) .. lo(c3) | hi(c0) .. hi(c3)] of 4 columns from their pair products p[c]
 * (vpmaddubsw: 16-bit lanes 0-7 elements 0..15, lanes 8-15 elements 16..31). Q4 weights: horizontal
 * adds in 16 bits (|w a + w' a'| <= 2 15 127, eight of them < 2^15), then pairs widened to 32 bits;
 * Q8_0: widened first, then 32-bit horizontal adds. VNNI: p[c] are dpbusd's sums of 4 products
 * (lanes 0-3 elements 0..15, 4-7 16..31), added horizontally in 32 bits. */
static inline AI __m256i halves4(int isa, int type, const __m256i *p) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (isa != V_AVX2) /* p[c]: the 4-product sums already (dpbusd) */
        return _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    if (type != T_Q8_0)
        return _mm256_madd_epi16(
            _mm256_hadd_epi16(_mm256_hadd_epi16(p[0], p[1]), _mm256_hadd_epi16(p[2], p[3])), ones);
    __m256i q[NC];
#pragma GCC unroll 4
    for (int c = 0; c < NC; c++) q[c] = _mm256_madd_epi16(p[c], ones);
    return _mm256_hadd_epi32(_mm256_hadd_epi32(q[0], q[1]), _mm256_hadd_epi32(q[2], q[3]));
}

/* Block b of R activation rows against 4 columns' integer weights wq (aw: |wq|, or wq for Q4_1)
 * with scales dw (as scales4) and Q4_1 mins m4: acc[r] and mins[r] advanced by one block. */
static inline AI void block_cols(int isa, int type, const __m256i *wq, const __m256i *aw, __m256 dw, __m128 m4,
                                 const block_a8 *a, long as, int b, int R, __m256 *acc, __m128 *mins) {
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        const block_a8 *ab = a + r * as + b;
        const __m256i av = _mm256_loadu_si256((const __m256i *)ab->qs);
        __m256i p[NC];
#pragma GCC unroll 4
        for (int c = 0; c < NC; c++) { /* a sign(w): |w| a sign(w) = w a (Q4_1: w >= 0 already) */
            const __m256i sa = type == T_Q4_1 ? av : _mm256_sign_epi8(av, wq[c]);
            p[c] = isa == V_AVX2 ? _mm256_maddubs_epi16(aw[c], sa) : dpbusd(isa, _mm256_setzero_si256(), aw[c], sa);
        }
        const __m256 sc = _mm256_mul_ps(dw, _mm256_broadcast_ss(&ab->d));
        acc[r] = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(halves4(isa, type, p)), acc[r]);
        if (type == T_Q4_1) mins[r] = _mm_fmadd_ps(m4, _mm_broadcast_ss(&ab->s), mins[r]);
    }
}

/* out[r * NC + c] = (lo + hi) + mins of column c, row r. */
static inline AI void finish4(const __m256 *acc, const __m128 *mins, int R, float *out) {
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        const __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
        _mm_storeu_ps(out + r * NC, _mm_add_ps(s, mins[r]));
    }
}

/* A tile's 4 weight rows unpacked with their lanes transposed: for block b and k < 4, q[b, k] is
 * the 32 bytes [g(0, k) g(1, k) g(2, k) g(3, k) | g(0, k + 4) ... g(3, k + 4)], g(c, j) the 4
 * weights of lane j of column c (|w| for Q4_0 and Q8_0, whose signs are in s[b, k], the same
 * layout of w); d (nb, 8) the scales as scales4 returns them, m (nb, 4) the Q4_1 mins. With the
 * activation bytes laid out alike (a4: lane k of a block four times, then lane k + 4 four times),
 * the products of q[b, 0..3] sum to the half-sum vector of the 4 columns. */
typedef struct {
    int8_t *q, *s;
    float *d, *m;
} unpacked;

static inline AI void transpose4(__m256i *v) { /* 4 x 8 dwords */
    const __m256i t0 = _mm256_unpacklo_epi32(v[0], v[1]), t1 = _mm256_unpacklo_epi32(v[2], v[3]);
    const __m256i t2 = _mm256_unpackhi_epi32(v[0], v[1]), t3 = _mm256_unpackhi_epi32(v[2], v[3]);
    v[0] = _mm256_unpacklo_epi64(t0, t1), v[1] = _mm256_unpackhi_epi64(t0, t1);
    v[2] = _mm256_unpacklo_epi64(t2, t3), v[3] = _mm256_unpackhi_epi64(t2, t3);
}

/* Block b's scales of the tile into u (d, and m for Q4_1); returns the block's address. */
static inline AI const uint8_t *unpack_scales(int type, const uint8_t *w, long rs, int b, const unpacked *u) {
    const int bb = block_bytes(type);
    const uint8_t *blk = w + (long)b * bb;
    for (int o = 0; o < NC * bb; o += 64)
        _mm_prefetch((const char *)(w + PF + (long)b * NC * bb + o), _MM_HINT_T0);
    __m128 m4;
    _mm256_store_ps(u->d + 8 * b, scales4(type, blk, rs, &m4));
    _mm_store_ps(u->m + 4 * b, m4);
    return blk;
}

static inline AI void tile_unpack(int type, const uint8_t *w, long rs, int nb, const unpacked *u) {
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = unpack_scales(type, w, rs, b, u);
        __m256i v[NC], aw[NC];
#pragma GCC unroll 4
        for (int c = 0; c < NC; c++) {
            v[c] = unpack_avx2(type, blk + c * rs);
            aw[c] = type == T_Q4_1 ? v[c] : _mm256_sign_epi8(v[c], v[c]);
        }
        transpose4(aw);
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) _mm256_store_si256((__m256i *)(u->q + (b * 4 + k) * QK), aw[k]);
        if (type != T_Q4_1) {
            transpose4(v);
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) _mm256_store_si256((__m256i *)(u->s + (b * 4 + k) * QK), v[k]);
        }
    }
}

/* The activation bytes of M rows in the transposed layout: a4 (M, nb, 4, 32). */
static void acts_transposed(const block_a8 *a, int M, int nb, int8_t *a4) {
    for (long i = 0; i < (long)M * nb; i++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)a[i].qs);
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            const __m256i lanes = _mm256_setr_epi32(k, k, k, k, k + 4, k + 4, k + 4, k + 4);
            _mm256_store_si256((__m256i *)(a4 + (i * 4 + k) * QK), _mm256_permutevar8x32_epi32(q, lanes));
        }
    }
}

/* Block b of R activation rows (a4: their transposed bytes) against 4 columns' transposed weights
 * aw[k] (|w|, or w for Q4_1) with signs sg[k] (Q4_0, Q8_0), scales dw (as scales4) and Q4_1 mins
 * m4: acc[r] and mins[r] advanced by one block. The 4 pair-product vectors add up in 16 bits for Q4
 * weights (|w a + w' a'| <= 3810, four of them < 2^15), in 32 bits for Q8_0; with VNNI, 4 dpbusd. */
static inline AI void block_rows(int isa, int type, const __m256i *aw, const __m256i *sg, __m256 dw, __m128 m4,
                                 const block_a8 *a, const int8_t *a4, long as, int b, int R, __m256 *acc,
                                 __m128 *mins) {
    const __m256i ones = _mm256_set1_epi16(1);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        const block_a8 *ab = a + r * as + b;
        __m256i p[4], v = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            __m256i av = _mm256_load_si256((const __m256i *)(a4 + ((r * as + b) * 4 + k) * QK));
            if (type != T_Q4_1) av = _mm256_sign_epi8(av, sg[k]);
            if (isa != V_AVX2) /* VNNI: lane k's 4 products of each column straight into the sums */
                v = dpbusd(isa, v, aw[k], av);
            else
                p[k] = _mm256_maddubs_epi16(aw[k], av);
        }
        if (isa == V_AVX2 && type == T_Q8_0)
            v = _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(p[0], ones), _mm256_madd_epi16(p[1], ones)),
                                 _mm256_add_epi32(_mm256_madd_epi16(p[2], ones), _mm256_madd_epi16(p[3], ones)));
        else if (isa == V_AVX2)
            v = _mm256_madd_epi16(
                _mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3])), ones);
        const __m256 sc = _mm256_mul_ps(dw, _mm256_broadcast_ss(&ab->d));
        acc[r] = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(v), acc[r]);
        if (type == T_Q4_1) mins[r] = _mm_fmadd_ps(m4, _mm_broadcast_ss(&ab->s), mins[r]);
    }
}

/* R activation rows against a transposed unpacked tile: out[r * NC + c], dot_ref's operations. */
static inline AI void tile_rows(int isa, int type, const unpacked *u, const block_a8 *a, const int8_t *a4, long as,
                                int nb, int R, float *out) {
    __m256 acc[MR];
    __m128 mins[MR];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps(), mins[r] = _mm_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m256i aw[4], sg[4];
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            aw[k] = _mm256_load_si256((const __m256i *)(u->q + (b * 4 + k) * QK));
            if (type != T_Q4_1) sg[k] = _mm256_load_si256((const __m256i *)(u->s + (b * 4 + k) * QK));
        }
        const __m256 dw = _mm256_load_ps(u->d + 8 * b);
        block_rows(isa, type, aw, sg, dw, _mm_load_ps(u->m + 4 * b), a, a4, as, b, R, acc, mins);
    }
    finish4(acc, mins, R, out);
}

/* R activation rows against weight rows w, w + rs, ..., w + 3 rs, from the file's blocks:
 * out[r * NC + c]. With a4 (the rows' transposed bytes) each block's 4 columns are transposed in
 * registers (block_rows), else their half sums come by horizontal adds (block_cols): in a 1-thread
 * A/B the first is 0.85x for 2 rows of Q4 weights, 1.04-1.07x for 1 row and for Q8_0 (direct_a4).
 * The weights PF bytes ahead are prefetched as the tile streams its own. */
static inline AI void tile_direct(int isa, int type, const uint8_t *w, long rs, const block_a8 *a, const int8_t *a4,
                                  long as, int nb, int R, float *out) {
    __m256 acc[MR];
    __m128 mins[MR];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps(), mins[r] = _mm_setzero_ps();
    const int bb = block_bytes(type);
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = w + (long)b * bb;
        for (int o = 0; o < NC * bb; o += 64)
            _mm_prefetch((const char *)(w + PF + (long)b * NC * bb + o), _MM_HINT_T0);
        __m128 m4;
        const __m256 dw = scales4(type, blk, rs, &m4);
        __m256i sg[NC], aw[NC];
#pragma GCC unroll 4
        for (int c = 0; c < NC; c++) {
            sg[c] = unpack_avx2(type, blk + c * rs);
            aw[c] = type == T_Q4_1 ? sg[c] : _mm256_sign_epi8(sg[c], sg[c]);
        }
        if (!a4) {
            block_cols(isa, type, sg, aw, dw, m4, a, as, b, R, acc, mins);
            continue;
        }
        transpose4(aw);
        if (type != T_Q4_1) transpose4(sg);
        block_rows(isa, type, aw, sg, dw, m4, a, a4, as, b, R, acc, mins);
    }
    finish4(acc, mins, R, out);
}

/* The same by columns, for wide rows (K > KT): q (nb, NC, 32) the integer weights of the 4 columns,
 * d and m as above; the activations as they are. */
static inline AI void tile_unpack_cols(int type, const uint8_t *w, long rs, int nb, const unpacked *u) {
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = unpack_scales(type, w, rs, b, u);
#pragma GCC unroll 4
        for (int c = 0; c < NC; c++)
            _mm256_store_si256((__m256i *)(u->q + (b * NC + c) * QK), unpack_avx2(type, blk + c * rs));
    }
}

/* R activation rows against a by-column unpacked tile: out[r * NC + c], dot_ref's operations. */
static inline AI void tile_rows_cols(int isa, int type, const unpacked *u, const block_a8 *a, long as, int nb, int R,
                                     float *out) {
    __m256 acc[MR];
    __m128 mins[MR];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps(), mins[r] = _mm_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m256i wq[NC], aw[NC];
#pragma GCC unroll 4
        for (int c = 0; c < NC; c++) {
            wq[c] = _mm256_load_si256((const __m256i *)(u->q + (b * NC + c) * QK));
            aw[c] = type == T_Q4_1 ? wq[c] : _mm256_sign_epi8(wq[c], wq[c]);
        }
        const __m256 dw = _mm256_load_ps(u->d + 8 * b);
        block_cols(isa, type, wq, aw, dw, _mm_load_ps(u->m + 4 * b), a, as, b, R, acc, mins);
    }
    finish4(acc, mins, R, out);
}

/* One weight row at a time (the rows left over from the 4-row tiles): dot_ref's operations, the
 * half sums reduced from the vector lanes. */
static inline AI void dot_avx2(int isa, int type, const uint8_t *row, const block_a8 *a, long as, int nb, int R,
                               float *out) {
    float lo[MR], hi[MR], mins[MR];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) lo[r] = hi[r] = mins[r] = 0.0f;
    const int bb = block_bytes(type);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = row + (long)b * bb;
        const float d = f16(blk), m = type == T_Q4_1 ? f16(blk + 2) : 0.0f;
        const __m256i wq = unpack_avx2(type, blk);
        const __m256i aw = type == T_Q4_1 ? wq : _mm256_sign_epi8(wq, wq);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const block_a8 *ab = a + r * as + b;
            __m256i av = _mm256_loadu_si256((const __m256i *)ab->qs);
            if (type != T_Q4_1) av = _mm256_sign_epi8(av, wq);
            __m256i p = isa == V_AVX2 ? _mm256_madd_epi16(_mm256_maddubs_epi16(aw, av), ones)
                                      : dpbusd(isa, _mm256_setzero_si256(), aw, av);
            p = _mm256_hadd_epi32(p, p);
            p = _mm256_hadd_epi32(p, p); /* lane 0: elements 0..15, lane 4: 16..31 */
            const float scale = d * ab->d;
            lo[r] = fmaf(scale, (float)_mm256_extract_epi32(p, 0), lo[r]);
            hi[r] = fmaf(scale, (float)_mm256_extract_epi32(p, 4), hi[r]);
            if (type == T_Q4_1) mins[r] = fmaf(m, ab->s, mins[r]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) out[r] = (lo[r] + hi[r]) + mins[r];
}

/* An x8 group's 8 rows (g: its first block) against R <= 2 activation rows: out[r * 8 + c], dot_ref's
 * operations. Per block, group j of the 8 rows' weights is one vector (the x8 layout), and its
 * products with row r's group j (broadcast) add up in dpbusd's lanes: 4 groups give the low half sums
 * of the 8 rows, the other 4 the high ones (AVX2: pair products added in 16 bits for Q4 weights, as
 * block_rows does, then widened). Q4_0 and Q8_0 take the sign trick (|w|, a sign(w)). */
static inline AI void group_rows(int isa, int type, const uint8_t *g, const block_a8 *a, long as, int nb, int R,
                                 float *out) {
    const int gb = 8 * block_bytes(type), hdr = HDR(type);
    const __m256i nib = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    __m256 lo[2], hi[2], mins[2];
#pragma GCC unroll 2
    for (int r = 0; r < R; r++) lo[r] = hi[r] = mins[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = g + (long)b * gb;
        for (int o = 0; o < gb; o += 64) _mm_prefetch((const char *)(blk + PF + o), _MM_HINT_T0);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        const __m256 mw = type == T_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16))) : dw;
        __m256i sl[2], sh[2], pl[2][4], ph[2][4];
#pragma GCC unroll 2
        for (int r = 0; r < R; r++) sl[r] = sh[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            __m256i wl, wh; /* groups j and j + 4 of the 8 rows */
            if (type == T_Q8_0) {
                wl = _mm256_loadu_si256((const __m256i *)(blk + hdr + 32 * j));
                wh = _mm256_loadu_si256((const __m256i *)(blk + hdr + 32 * (j + 4)));
            } else {
                const __m256i t = _mm256_loadu_si256((const __m256i *)(blk + hdr + 32 * j));
                wl = _mm256_and_si256(t, nib), wh = _mm256_and_si256(_mm256_srli_epi16(t, 4), nib);
                if (type == T_Q4_0) wl = _mm256_sub_epi8(wl, _mm256_set1_epi8(8)), wh = _mm256_sub_epi8(wh, _mm256_set1_epi8(8));
            }
            const __m256i ul = type == T_Q4_1 ? wl : _mm256_sign_epi8(wl, wl);
            const __m256i uh = type == T_Q4_1 ? wh : _mm256_sign_epi8(wh, wh);
#pragma GCC unroll 2
            for (int r = 0; r < R; r++) {
                const block_a8 *ab = a + r * as + b;
                int32_t gl, gh;
                memcpy(&gl, ab->qs + 4 * j, 4), memcpy(&gh, ab->qs + 16 + 4 * j, 4);
                __m256i al = _mm256_set1_epi32(gl), ah = _mm256_set1_epi32(gh);
                if (type != T_Q4_1) al = _mm256_sign_epi8(al, wl), ah = _mm256_sign_epi8(ah, wh);
                if (isa != V_AVX2) {
                    sl[r] = dpbusd(isa, sl[r], ul, al), sh[r] = dpbusd(isa, sh[r], uh, ah);
                } else {
                    pl[r][j] = _mm256_maddubs_epi16(ul, al), ph[r][j] = _mm256_maddubs_epi16(uh, ah);
                }
            }
        }
#pragma GCC unroll 2
        for (int r = 0; r < R; r++) {
            const block_a8 *ab = a + r * as + b;
            if (isa == V_AVX2 && type == T_Q8_0) {
                for (int j = 0; j < 4; j++)
                    sl[r] = _mm256_add_epi32(sl[r], _mm256_madd_epi16(pl[r][j], ones)),
                    sh[r] = _mm256_add_epi32(sh[r], _mm256_madd_epi16(ph[r][j], ones));
            } else if (isa == V_AVX2) { /* Q4: |w a + w' a'| <= 3810, four of them < 2^15 */
                sl[r] = _mm256_madd_epi16(
                    _mm256_add_epi16(_mm256_add_epi16(pl[r][0], pl[r][1]), _mm256_add_epi16(pl[r][2], pl[r][3])), ones);
                sh[r] = _mm256_madd_epi16(
                    _mm256_add_epi16(_mm256_add_epi16(ph[r][0], ph[r][1]), _mm256_add_epi16(ph[r][2], ph[r][3])), ones);
            }
            const __m256 sc = _mm256_mul_ps(dw, _mm256_broadcast_ss(&ab->d));
            lo[r] = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(sl[r]), lo[r]);
            hi[r] = _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(sh[r]), hi[r]);
            if (type == T_Q4_1) mins[r] = _mm256_fmadd_ps(mw, _mm256_broadcast_ss(&ab->s), mins[r]);
        }
    }
#pragma GCC unroll 2
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + 8 * r, _mm256_add_ps(_mm256_add_ps(lo[r], hi[r]), mins[r]));
}

/* y[r, col(n + c)] = out[r, c], or y + out (add: the residual x += ...). */
static inline void store_out(const qmat *W, const float *out, int R, int n, int cols, float *y, long ldy,
                             int add) {
    for (int r = 0; r < R; r++)
        for (int c = 0; c < cols; c++) {
            float *o = y + r * ldy + (W->omap ? W->omap[n + c] : n + c);
            *o = add ? *o + out[r * cols + c] : out[r * cols + c];
        }
}

/* Whether M rows of a type-`type` matrix take tile_direct (the file's blocks, groups of <= 3 rows)
 * rather than an unpacked tile: 1-2 rows (too few to pay for the unpacked copy), and Q8_0 at any
 * M (its blocks need no nibble split, and its transposed copy carries the signs apart). In-model
 * A/B, 1 thread, CPU time, min of 7, against direct for M <= 3 only: T2 0.93-1.0x, T5 0.93x, T9 0.93x
 * (the Q8_0 head), T3 1.0x. */
static inline int use_direct(int type, int M) { return M <= 2 || type == T_Q8_0; }

/* Whether a direct tile transposes its blocks in registers (tile_direct) for these M rows. */
static inline int direct_a4(int type, int M) { return M == 2 && type != T_Q8_0; }

/* R rows (R <= 3) of a tile: tile_direct from w, or tile_rows / tile_rows_cols from the unpacked
 * copy u (a4: the transposed activations, NULL for the by-column copy). */
static inline AI void tile_group(int isa, int type, int direct, const uint8_t *w, long rs, const unpacked *u,
                                 const block_a8 *a, const int8_t *a4, int nb, int R, float *out) {
    if (direct && R == 3)
        tile_direct(isa, type, w, rs, a, a4, nb, nb, 3, out);
    else if (direct && R == 2)
        tile_direct(isa, type, w, rs, a, a4, nb, nb, 2, out);
    else if (direct)
        tile_direct(isa, type, w, rs, a, a4, nb, nb, 1, out);
    else if (!a4 && R == 3) /* unpacked: M >= 3 rows, so balanced groups of 2 or 3 */
        tile_rows_cols(isa, type, u, a, nb, nb, 3, out);
    else if (!a4)
        tile_rows_cols(isa, type, u, a, nb, nb, 2, out);
    else if (R == 3)
        tile_rows(isa, type, u, a, a4, nb, nb, 3, out);
    else
        tile_rows(isa, type, u, a, a4, nb, nb, 2, out);
}

/* All M rows against weight rows [n0, n1) of an x8 matrix: each whole group in range against the
 * rows two at a time (its blocks stay in L1 between the pairs); other rows one by one (dot_avx2 for
 * the rows left in the file's layout, dot_ref for a group cut by the range, which no caller makes). */
static inline AI void range_x8(int isa, int type, const qmat *W, const block_a8 *a, int M, float *y, long ldy,
                               int n0, int n1, int add) {
    const int nb = W->cols / QK, N8 = W->rows / 8 * 8;
    float out[2 * 8];
    for (int n = n0; n < n1;) {
        if (n % 8 == 0 && n + 8 <= n1 && n + 8 <= N8) {
            const uint8_t *g = W->w + (long)(n / 8) * 8 * W->row_bytes;
            for (int m0 = 0; m0 < M; m0 += 2) {
                const int R = M - m0 < 2 ? M - m0 : 2;
                if (R == 2)
                    group_rows(isa, type, g, a + (long)m0 * nb, nb, nb, 2, out);
                else
                    group_rows(isa, type, g, a + (long)m0 * nb, nb, nb, 1, out);
                store_out(W, out, R, n, 8, y + (long)m0 * ldy, ldy, add);
            }
            n += 8;
            continue;
        }
        for (long m = 0; m < M; m++) {
            if (n < N8)
                out[0] = dot_ref(W, n, a + m * nb, nb);
            else
                dot_avx2(isa, type, W->w + n * W->row_bytes, a + m * nb, nb, nb, 1, out);
            store_out(W, out, 1, n, 1, y + m * ldy, ldy, add);
        }
        n++;
    }
}

/* All M rows against weight rows [n0, n1): 4-row tiles, direct or unpacked once (use_direct), each
 * run in balanced groups of <= 3 rows (8 rows as 3 + 3 + 2), then the rows left over one at a time. */
static inline AI void range_avx2(int isa, int type, const qmat *W, const block_a8 *a, int M, float *y, long ldy,
                                 int n0, int n1, int add, const unpacked *u, const int8_t *a4) {
    if (W->x8) {
        range_x8(isa, type, W, a, M, y, ldy, n0, n1, add);
        return;
    }
    const int nb = W->cols / QK, groups = (M + MR - 1) / MR, direct = use_direct(type, M);
    const long rs = W->row_bytes;
    float out[MR * NC];
    int n = n0;
    for (; n + NC <= n1; n += NC) {
        const uint8_t *w = W->w + n * rs;
        if (!direct && a4)
            tile_unpack(type, w, rs, nb, u);
        else if (!direct)
            tile_unpack_cols(type, w, rs, nb, u);
        for (int g = 0, m0 = 0; g < groups; g++) {
            const int R = (M - m0 + groups - g - 1) / (groups - g);
            const int8_t *a4m = a4 ? a4 + (long)m0 * nb * 4 * QK : NULL;
            tile_group(isa, type, direct, w, rs, u, a + (long)m0 * nb, a4m, nb, R, out);
            store_out(W, out, R, n, NC, y + (long)m0 * ldy, ldy, add);
            m0 += R;
        }
    }
    for (; n < n1; n++)
        for (int m0 = 0; m0 < M; m0 += 2) {
            const int R = M - m0 < 2 ? M - m0 : 2;
            if (R == 2)
                dot_avx2(isa, type, W->w + n * rs, a + (long)m0 * nb, nb, nb, 2, out);
            else
                dot_avx2(isa, type, W->w + n * rs, a + (long)m0 * nb, nb, nb, 1, out);
            store_out(W, out, R, n, 1, y + (long)m0 * ldy, ldy, add);
        }
}

/* range_avx2 for W's type, each (isa, type) pair compiled on its own (constants inlined). */
static inline AI void range_types(int isa, const qmat *W, const block_a8 *a, int M, float *y, long ldy, int n0,
                                  int n1, int add, const unpacked *u, const int8_t *a4) {
    if (W->type == T_Q4_0)
        range_avx2(isa, T_Q4_0, W, a, M, y, ldy, n0, n1, add, u, a4);
    else if (W->type == T_Q4_1)
        range_avx2(isa, T_Q4_1, W, a, M, y, ldy, n0, n1, add, u, a4);
    else
        range_avx2(isa, T_Q8_0, W, a, M, y, ldy, n0, n1, add, u, a4);
}

/* Weight rows [n0, n1) of y = x W^T (add: y += x W^T) for all M rows. */
static void matmul_range(const qmat *W, const block_a8 *a, int M, float *y, long ldy, int n0, int n1, int add,
                         int variant) {
    const int nb = W->cols / QK;
    if (variant == V_REF) {
        for (int n = n0; n < n1; n++)
            for (long m = 0; m < M; m++) {
                const float out = dot_ref(W, n, a + m * nb, nb);
                store_out(W, &out, 1, n, 1, y + m * ldy, ldy, add);
            }
        return;
    }
    unpacked u = {NULL, NULL, NULL, NULL};
    int8_t *a4 = NULL;
    const int direct = use_direct(W->type, M);
    const size_t tile = direct ? 0 : ((size_t)nb * (2 * 4 * QK + 48) + 31) / 32 * 32;
    const int transposed = direct ? direct_a4(W->type, M) : W->cols <= KT; /* the tiles read a4 */
    const size_t acts = transposed ? (size_t)M * nb * 4 * QK : 0;
    if (n0 + NC <= n1 && tile + acts && !W->x8) { /* q, s, d, m of an unpacked tile, then the activations' a4 */
        u.q = (int8_t *)aligned_alloc(32, tile + acts);
        if (tile) {
            u.s = u.q + (size_t)nb * 4 * QK, u.d = (float *)(u.s + (size_t)nb * 4 * QK);
            u.m = u.d + 8 * nb;
        }
        if (acts) a4 = u.q + tile, acts_transposed(a, M, nb, a4);
    }
    if (variant == V_AVXVNNI)
        range_types(V_AVXVNNI, W, a, M, y, ldy, n0, n1, add, &u, a4);
    else if (variant == V_AVX512VNNI)
        range_types(V_AVX512VNNI, W, a, M, y, ldy, n0, n1, add, &u, a4);
    else
        range_types(V_AVX2, W, a, M, y, ldy, n0, n1, add, &u, a4);
    free(u.q);
}

/* y[m * ldy + col(n)] = (row m of the activations) . (row n of W) for m < M, n < W->rows. */
static void matmul(const qmat *W, const block_a8 *a, int M, float *y, long ldy, int variant, int threads) {
    const int N = W->rows;
    if (threads <= 1) {
        matmul_range(W, a, M, y, ldy, 0, N, 0, variant);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int per = ((N + T - 1) / T + 7) / 8 * 8, n0 = t * per,
                  n1 = n0 + per < N ? n0 + per : N; /* whole tiles */
        if (n0 < n1) matmul_range(W, a, M, y, ldy, n0, n1, 0, variant);
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
    for (int i = 0; i < n; i++)
        for (int b = 0; b < nb; b++) {
            int8_t q[QK];
            float d, m;
            uint8_t blk[34];
            file_block(W, ids[i], b, blk);
            unpack_ref(W->type, blk, 0, q, &d, &m);
            for (int e = 0; e < QK; e++)
                out[(long)i * K + b * QK + e] = W->type == T_Q4_1 ? fmaf(d, (float)q[e], m) : d * (float)q[e];
        }
}

/* ---- the decoder layers of a step --------------------------------------------------------------
 *
 *   h = rmsnorm(x); qkv = h [Wq | Wk | Wv]^T; att = rope_attend(qkv); x += att Wo^T;
 *   h = rmsnorm(x); g = h Wg^T, u = h Wu^T; x += (silu(g) u) Wdown^T
 *
 * Every step is row by row in a fixed order (each matmul quantizes its input rows first), so rows
 * stay independent as in the kernels called. rope_attend16 and rmsnorm_f32 come from fewrows.c. */

typedef struct {
    const float *attn_norm, *ffn_norm;
    qmat q, k, v, o, gate, up, down;
} qlayer;

/* fewrows.c's rope_attend (fp32 caches) or rope_attend16 (fp16: the runtime's default, quant.py's
 * KV_DTYPE); the caches are passed through untyped, row offsets in bytes of kv_bytes per value. */
typedef void (*rope_attend_fn)(const float *, const int64_t *, const float *, const float *, void *, void *, float *,
                               int, int, int, int, int, int, int);
typedef void (*rmsnorm_fn)(const float *, const float *, float *, int, int, float);

/* A token-tree step's attention: fewrows.c's rope_attend_tree and its arguments (each new token's
 * slot, and per row the first slot read through the per-query slot map vmap of row width W; see
 * TreeAttention in quant.py). Each query's operations are rope_attend's over a chain's slots. */
typedef void (*rope_attend_tree_fn)(const float *, const int64_t *, const int64_t *, const int64_t *,
                                    const int64_t *, int, const float *, const float *, void *, void *, float *,
                                    int, int, int, int, int, int, int, float, int);
typedef struct {
    void *fn;
    const int64_t *slot, *lo, *vmap;
    int W;
} tree_attend;

/* e^x for x in [-88, 88] (Cephes' expf polynomial, ~1 ulp), 8 lanes: as exp256 in fewrows.c. */
static inline __m256 exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 fx =
        _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
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

/* This thread's share [n0, n1) of n columns: whole tiles of `unit` columns, in thread order. */
static inline void share(int n, int unit, int t, int T, int *n0, int *n1) {
    const int per = (n + T - 1) / T, u = (per + unit - 1) / unit * unit;
    *n0 = t * u < n ? t * u : n, *n1 = (t + 1) * u < n ? (t + 1) * u : n;
}

/* Columns [lo, hi) of the concatenation [W0 | W1 | ...] (each W's columns written at y + its
 * offset in it, row stride ldy): the part of each matrix inside the range. */
static void matmul_cols(const qmat *const *Ws, int nw, const block_a8 *a, int M, float *y, long ldy, int lo,
                        int hi, int add, int variant) {
    for (int i = 0, base = 0; i < nw; base += Ws[i]->rows, i++) {
        const int n0 = lo > base ? lo - base : 0, n1 = hi - base < Ws[i]->rows ? hi - base : Ws[i]->rows;
        if (n0 < n1) matmul_range(Ws[i], a, M, y + base, ldy, n0, n1, add, variant);
    }
}

/* silu(g) u for columns [j0, j1) of each row of gu (M, 2F: [g | u]) -> h (M, F). */
static void silu_mul(const float *gu, float *h, int M, int F, int j0, int j1) {
    for (long m = 0; m < M; m++) {
        const float *g = gu + m * 2 * F, *u = g + F;
        float *o = h + m * F;
        for (int j = j0; j < j1; j += 8) {
            const __m256 gv = _mm256_loadu_ps(g + j);
            const __m256 s = _mm256_div_ps(
                gv, _mm256_add_ps(_mm256_set1_ps(1.0f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
            _mm256_storeu_ps(o + j, _mm256_mul_ps(s, _mm256_loadu_ps(u + j)));
        }
    }
}

/* Row b of a ragged step (attend_step) through rope_attend on nt threads. */
static inline void attend_row(rope_attend_fn attend, const int64_t *off, const float *qkv, const int64_t *pos,
                              const float *cosT, const float *sinT, char *kc, char *vc, float *att, int b, long Q,
                              long cache_row, int H, int G, int D, int cap, int nt) {
    const int n = (int)(off[b + 1] - off[b]); /* cache_row: bytes */
    if (n > 0)
        attend(qkv + off[b] * Q, pos + off[b], cosT, sinT, kc + b * cache_row, vc + b * cache_row,
               att + off[b] * (long)H * D, 1, n, H, G, D, cap, nt);
}

/* A step's attention: all B rows of T tokens in one call (a token-tree step, tree non-NULL, through
 * its kernel; a tree step is never ragged), or for a ragged step (off non-NULL: row b's tokens are
 * packed rows off[b] .. off[b + 1] - 1 of qkv and att) one call per row over its own tokens,
 * positions and cache row (rope_attend with one row). A query's operations are the same
 * either way (rope_attend's contract), so a ragged step's rows are bit for bit one-token steps.
 * With at least two rows per thread the rows share one parallel region, a row per thread at a time
 * (rope_attend then runs on that thread alone), instead of opening one region per row. */
static void attend_step(rope_attend_fn attend, const tree_attend *tree, const int64_t *off, const float *qkv,
                        const int64_t *pos, const float *cosT, const float *sinT, char *kc, char *vc, float *att,
                        int B, int T, int H, int G, int D, int cap, int kv_bytes, int nt) {
    if (tree) {
        ((rope_attend_tree_fn)tree->fn)(qkv, pos, tree->slot, tree->lo, tree->vmap, tree->W, cosT, sinT, kc, vc,
                                        att, B, T, H, G, D, cap, 0, 1.0f / sqrtf((float)D), nt);
        return;
    }
    if (!off) {
        attend(qkv, pos, cosT, sinT, kc, vc, att, B, T, H, G, D, cap, nt);
        return;
    }
    const long Q = (long)(H + 2 * G) * D, cache_row = (long)G * cap * D * kv_bytes;
    if (B < 2 * nt) {
        /* Outside any omp construct: inside a "parallel for ... if (0)", libgomp made rope_attend's
         * region a nested team, created anew per call (a ragged 2-row step took 10-25x as long). */
        for (int b = 0; b < B; b++)
            attend_row(attend, off, qkv, pos, cosT, sinT, kc, vc, att, b, Q, cache_row, H, G, D, cap, nt);
        return;
    }
#pragma omp parallel for schedule(dynamic) num_threads(nt)
    for (int b = 0; b < B; b++)
        attend_row(attend, off, qkv, pos, cosT, sinT, kc, vc, att, b, Q, cache_row, H, G, D, cap, 1);
}

/* Threads: one parallel region per layer plus rope_attend's own, instead of one per matmul. In a
 * region each thread takes its share of a matmul's output columns and writes them (the residual
 * matmuls add into x directly: x + y, the same float operation as a separate add); barriers stand
 * between the matmuls. What every thread needs whole (RMSNorm of full rows, the 8-bit activation
 * blocks of x and of the attention output) each thread computes for itself, in its own buffers,
 * with the same operations, so no thread waits for it; the SiLU product and its activation blocks
 * are split by the gate/up share (columns j of g and u go to the same thread). */
void quant_layers(float *x, const int64_t *pos, const int64_t *off, int B, int T, int C, int H, int G, int D,
                  int F, int cap, float eps, int L, const qlayer *layers, void *const *kc, void *const *vc,
                  const float *cosT, const float *sinT, void *rope_attend, const tree_attend *tree,
                  void *rmsnorm, int variant, int threads, int kv_bytes) {
    const rope_attend_fn attend = (rope_attend_fn)rope_attend;
    const rmsnorm_fn norm = (rmsnorm_fn)rmsnorm;
    const int M = off ? (int)off[B] : B * T, HD = H * D, GD = G * D, Q = HD + 2 * GD, nt = threads > 1 ? threads : 1;
    const int widest = C > HD ? C : HD;
    float *hs = (float *)aligned_alloc(32, sizeof(float) * (size_t)nt * M * widest + 32);     /* per thread */
    block_a8 *as = (block_a8 *)malloc(sizeof(block_a8) * (size_t)nt * M * (widest / QK) + 1); /* per thread */
    block_a8 *af = (block_a8 *)malloc(sizeof(block_a8) * (size_t)M * (F / QK) + 1); /* silu(g) u, shared */
    float *qkv = (float *)aligned_alloc(32, sizeof(float) * (size_t)M * Q + 32);
    float *att = (float *)aligned_alloc(32, sizeof(float) * (size_t)M * HD + 32);
    float *gu = (float *)aligned_alloc(32, sizeof(float) * (size_t)M * 2 * F + 32);
    float *hf = (float *)aligned_alloc(32, sizeof(float) * (size_t)M * F + 32);
    /* per layer: [o, +x | norm | gate, up, silu | down, +x | norm, next layer's q k v]; attention */
    for (int l = -1; l < L; l++) {
#pragma omp parallel num_threads(nt)
        {
            const int t = omp_get_thread_num(), nth = omp_get_num_threads();
            float *h = hs + (size_t)t * M * widest;
            block_a8 *a = as + (size_t)t * M * (widest / QK);
            int lo, hi;
            if (l >= 0) {
                const qlayer *ly = layers + l;
                const qmat *o[1] = {&ly->o}, *gate_up[2] = {&ly->gate, &ly->up}, *down[1] = {&ly->down};
                quant_quantize(att, a, M, HD);
                share(C, 8, t, nth, &lo, &hi);
                matmul_cols(o, 1, a, M, x, C, lo, hi, 1, variant);
#pragma omp barrier
                norm(x, ly->ffn_norm, h, M, C, eps);
                quant_quantize(h, a, M, C);
                share(F, QK, t, nth, &lo, &hi); /* columns j of g and of u */
                matmul_cols(gate_up, 1, a, M, gu, 2 * F, lo, hi, 0, variant);
                matmul_cols(gate_up + 1, 1, a, M, gu + F, 2 * F, lo, hi, 0, variant);
                silu_mul(gu, hf, M, F, lo, hi);
                quantize_blocks(hf, af, M, F, lo / QK, hi / QK);
#pragma omp barrier
                share(C, 8, t, nth, &lo, &hi);
                matmul_cols(down, 1, af, M, x, C, lo, hi, 1, variant);
            }
            if (l + 1 < L) {
                const qlayer *ly = layers + l + 1;
                const qmat *qkv3[3] = {&ly->q, &ly->k, &ly->v};
                if (l >= 0) {
#pragma omp barrier
                }
                norm(x, ly->attn_norm, h, M, C, eps);
                quant_quantize(h, a, M, C);
                share(Q, 8, t, nth, &lo, &hi);
                matmul_cols(qkv3, 3, a, M, qkv, Q, lo, hi, 0, variant);
            }
        }
        if (l + 1 < L)
            attend_step(attend, tree, off, qkv, pos, cosT, sinT, kc[l + 1], vc[l + 1], att, B, T, H, G, D, cap,
                        kv_bytes, nt);
    }
    free(hs), free(as), free(af), free(qkv), free(att), free(gu), free(hf);
}
