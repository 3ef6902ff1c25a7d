/* y = x @ W.T for GGUF's 4-bit (Q4_1) and 8-bit (Q8_0) weights, and for dense bfloat16 weights, with
 * bfloat16 activations, for decode, verify and prefill passes of int4 and dense bfloat16 models.
 *
 * Built into the same library as tree_attention.c by mtpctl/model/native_build.py; mtpctl/model/native.py
 * lays the weights out (int4_pack, int8_pack): tiles of 4 output rows; tile t, group g (32 inputs) at
 * blob + (t * G + g) * BLOCK bytes. q4 (BLOCK 96): 64 bytes of codes (output j's 16 bytes at 16 j,
 * byte i = q[i] | q[16 + i] << 4), then float32 s[4], z[4]: output j's weights are s[j] * q + z[j].
 * q8 (BLOCK 144): 128 bytes of int8 codes (output j's 32 at 32 j), then float32 s[4]: weights s[j] * q.
 * bf (BLOCK 256): output j's 32 bfloat16 weights at 64 j, read as they are (no dequantization; passes
 * of more than 4 rows read them four rows at a time from the blob, which is already the buffer the
 * quantized kinds build).
 *
 * Arithmetic, the same for every row whatever the pass: each group's 32 weights are dequantized to
 * bfloat16 (q4: s * q + z as one fused multiply-add; q8: s * q; rounded to the nearest bfloat16,
 * ties to even), and the output is a sum over groups, in group order, of bfloat16 dot products
 * accumulated in float32 (AVX512-BF16's VDPBF16PS on 16 lanes, then the lanes added in a fixed
 * order). A row's result therefore does not depend on the other rows of the pass or on the thread
 * count: what lets speculative verification reproduce plain decoding bit for bit. The dequantization
 * is shared by up to 8 rows in registers (4 outputs x 4 rows, or 2 outputs x 8 rows) and, for passes
 * of more than 8 rows, done once per tile into a buffer that every row reads (storing and reloading
 * it costs about two rows' worth of dot products, so it pays only for larger passes), so extra rows cost less than in torch's int4 kernel (prefill
 * of 128 rows about half, BENCHMARKS.md). On a CPU with AVX2 and FMA but no AVX512-BF16 (most x86 CPUs
 * before 2022, AMD's Zen 1-3 among them) the same weights, rounded to bfloat16 alike, meet float32
 * activations in 8-lane fused multiply-adds (INT4_AVX2, below): another rounding of the sums, still
 * the same for every row, and decoding 2.6-3.9x faster there than the plain C below
 * (docs/decisions/avx2-matmul-path.md). Elsewhere the same steps run in portable C (another rounding again, still the same for
 * every row).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"
#ifdef _OPENMP
#include <omp.h>
static inline int thread_index(void) { return omp_get_thread_num(); }
static inline int thread_count(void) { return omp_get_num_threads(); }
#else
static inline int thread_index(void) { return 0; }
static inline int thread_count(void) { return 1; }
#endif
/* y[at] = sum: float32, or bfloat16 (rounded to nearest even) when bf16_out */
static inline void store_sum(void *y, int bf16_out, int64_t at, float sum) {
    if (bf16_out)
        ((uint16_t *)y)[at] = float_to_bf16(sum);
    else
        ((float *)y)[at] = sum;
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define INT4_SIMD 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define INT4_AVX2 1
#endif

#define NT 4           /* output rows per tile */
#define BLOCK_q4 96    /* bytes per (tile, group): 4 x 16 bytes of 4-bit codes, 4 scales, 4 zeros */
#define BLOCK_q8 144   /* 4 x 32 int8 codes, 4 scales */
#define BLOCK_bf 256   /* 4 x 32 bfloat16 weights */
#define PREFETCH_q4 3  /* locality hint of the next tile's prefetch: 3 into L1, 2 into L2 (see TILE) */
#define PREFETCH_q8 3
#define PREFETCH_bf 2
#define AHEAD 4        /* one- and two-row passes ask for the group of the tile this many tiles ahead (see TILE) */
#define CHUNK 4        /* activation rows sharing registers */
#define DIRECT 8       /* passes of up to this many rows dequantize in registers (TILE, TILE_PAIRS) */


/* ask for group g of the tile AHEAD tiles past `tile` (G groups of `block` bytes a tile) into L2: a
 * one- or two-row pass reads its weights once, faster than the hardware's prefetch brings them on some
 * CPUs (TILE). A prefetch never faults, past the blob's end included. */
static inline void prefetch_ahead(const uint8_t *tile, int64_t G, int64_t g, int block) {
    for (int l = 0; l < block; l += 64)
        __builtin_prefetch(tile + (AHEAD * G + g) * block + l, 0, 2);
}

#if defined(INT4_SIMD)
typedef uint16_t xelem; /* what the tiles read of an activation: bfloat16 as given */
#define DENSE_IN_PLACE 1 /* passes of more than CHUNK rows read dense tiles where they are */
typedef __m512bh wvec;
/* output j's 32 weights of one group as bfloat16, via a 16-entry table s * q + z (q = 0..15), held twice
 * (entries 16-31 repeat 0-15) so that a 16-bit index only needs the code in its low 4 bits: vpermw reads
 * the low 5 bits of each index. Words 0-15 take the code bytes as they are (their low nibble, weights
 * 0-15), words 16-31 the same bytes shifted right by 4 (their high nibble, weights 16-31): five vector
 * operations, two fewer than masking and shifting each half and joining them, for the same weights. */
static inline wvec dequant_q4(const uint8_t *block, int j, __m512 iota) {
    const float *sz = (const float *)(block + 64);
    __m512 vals = _mm512_fmadd_ps(iota, _mm512_set1_ps(sz[j]), _mm512_set1_ps(sz[NT + j]));
    __m512i table = (__m512i)_mm512_cvtne2ps_pbh(vals, vals);
    __m512i codes = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(block + 16 * j))));
    const __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    return (wvec)_mm512_permutexvar_epi16(_mm512_srlv_epi16(codes, shifts), table);
}
/* Q8 blocks: output j's 32 int8 codes at 32 j, then float32 s[4]: weights s * q, rounded to bfloat16 */
static inline wvec dequant_q8(const uint8_t *block, int j, __m512 unused) {
    (void)unused;
    __m512 scale = _mm512_set1_ps(((const float *)(block + 128))[j]);
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(block + 32 * j))));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(block + 32 * j + 16))));
    return _mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, scale), _mm512_mul_ps(lo, scale));
}
/* dense blocks: output j's 32 bfloat16 weights as they are */
static inline wvec dequant_bf(const uint8_t *block, int j, __m512 unused) {
    (void)unused;
    return (wvec)_mm512_loadu_si512(block + 64 * j);
}
/* a weight vector from a buffer or a dense blob, which need not be 64-byte aligned */
static inline wvec load_w(const wvec *p) { return (wvec)_mm512_loadu_si512(p); }
typedef __m512 accum;
static inline accum acc_zero(void) { return _mm512_setzero_ps(); }
static inline accum acc_dot(accum a, const uint16_t *x, wvec w) {
    return _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(x), w);
}
static inline float acc_sum(accum a) { return _mm512_reduce_add_ps(a); }
#elif defined(INT4_AVX2)
/* AVX2 and FMA without AVX512-BF16: weights widened to float32 eight at a time (a chunk; q4: s * q + z
 * as one fused multiply-add, q8: s * q, each rounded to bfloat16 as in the other builds; dense:
 * exact), activations widened once per call (x_wide), and every product and sum a float32 fused
 * multiply-add on 8 lanes (a product of two bfloat16 values is exact in float32). A row's sum for an output runs
 * over groups in order and, in a group, over its four chunks in order, into one accumulator, then its 8
 * lanes in a fixed order: the same operations for every row whatever the pass (TILE_AVX2). */
typedef float xelem; /* activations widened to float32 by x_wide, in the order of the kind's chunks */
#define DENSE_IN_PLACE 0 /* dense tiles widen chunk by chunk (a tile in place would be bfloat16) */
#define DIRECT_AVX2 2 /* passes of up to this many rows widen the weights in registers, others once per tile */
typedef struct { __m256 v[4]; } wvec;
/* v rounded to the nearest bfloat16 (ties to even), as float32; float_to_bf16 on 8 lanes (the weights
 * rounded here are finite) */
static inline __m256 round_bf16(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
    return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xffff0000u)));
}
/* q4 chunk c of output j: byte i = q[i] | q[16 + i] << 4, so the low nibbles of bytes 0-7 and 8-15 are
 * weights 0-7 and 8-15, the high ones 16-23 and 24-31: chunks in the group's order */
static inline __m256 chunk_q4(const uint8_t *block, int j, int c) {
    const float *sz = (const float *)(block + 64);
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(block + 16 * j + 8 * (c & 1))));
    __m256i q = c < 2 ? _mm256_and_si256(b, _mm256_set1_epi32(15)) : _mm256_srli_epi32(b, 4);
    return round_bf16(_mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(sz[j]), _mm256_set1_ps(sz[NT + j])));
}
/* q8 chunk c of output j: its int8 codes 8 c .. 8 c + 7, times the scale */
static inline __m256 chunk_q8(const uint8_t *block, int j, int c) {
    __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(block + 32 * j + 8 * c)));
    return round_bf16(_mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(((const float *)(block + 128))[j])));
}
/* bfloat16 widened by interleaving a zero word below each: a 16-weight half's chunks hold weights 0-3
 * and 8-11 (lo), 4-7 and 12-15 (hi); x_wide lays the activations out alike */
static inline __m256 widen_lo(__m256i b) {
    return _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), b));
}
static inline __m256 widen_hi(__m256i b) {
    return _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), b));
}
static inline __m256 chunk_bf(const uint8_t *block, int j, int c) {
    __m256i b = _mm256_loadu_si256((const __m256i *)(block + 64 * j + 32 * (c >> 1)));
    return c & 1 ? widen_hi(b) : widen_lo(b);
}
/* output j's 32 weights of one group, its four chunks (what a tile's buffer holds) */
#define DEQUANT_AVX2(KIND)                                                                                 \
    static inline wvec dequant_##KIND(const uint8_t *block, int j, float unused) {                        \
        (void)unused;                                                                                      \
        wvec w;                                                                                            \
        for (int c = 0; c < 4; c++)                                                                        \
            w.v[c] = chunk_##KIND(block, j, c);                                                            \
        return w;                                                                                          \
    }
DEQUANT_AVX2(q4)
DEQUANT_AVX2(q8)
DEQUANT_AVX2(bf)
/* lanes l and l + 4, then l and l + 2, then 0 and 1 */
static inline float sum8(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
/* x [count] bfloat16 -> out float32, exact: in order for the quantized kinds, in chunk_bf's order of
 * each 16 values for dense weights */
static void x_wide(const uint16_t *x, int64_t count, int dense, float *out) {
    for (int64_t i = 0; i < count; i += 16) {
        __m256i b = _mm256_loadu_si256((const __m256i *)(x + i));
        if (dense) {
            _mm256_storeu_ps(out + i, widen_lo(b));
            _mm256_storeu_ps(out + i + 8, widen_hi(b));
        } else {
            _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm256_castsi256_si128(b)), 16)));
            _mm256_storeu_ps(out + i + 8, _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm256_extracti128_si256(b, 1)), 16)));
        }
    }
}
/* rows m0..m0+R (R = 1, 2) of one tile, the four outputs at once: a chunk's four weight vectors (from
 * the tile's buffer, or widened here) meet each row's activation chunk in 4 x R accumulators */
#define TILE_AVX2(KIND, R)                                                                                 \
    static void tile_##KIND##_##R(const float *x, int64_t K, const uint8_t *tile, const wvec *wbuf,        \
                                  int64_t N, int64_t n0, int64_t m0, void *y, int bf16_out) {              \
        int64_t G = K / 32;                                                                                \
        __m256 acc[NT][R];                                                                                 \
        for (int j = 0; j < NT; j++)                                                                       \
            for (int r = 0; r < R; r++)                                                                    \
                acc[j][r] = _mm256_setzero_ps();                                                           \
        for (int64_t g = 0; g < G; g++) {                                                                  \
            const uint8_t *block = tile + g * BLOCK_##KIND;                                                \
            if (!wbuf)                                                                                     \
                prefetch_ahead(tile, G, g, BLOCK_##KIND);                                                  \
            for (int c = 0; c < 4; c++) {                                                                  \
                __m256 w[NT];                                                                              \
                for (int j = 0; j < NT; j++)                                                               \
                    w[j] = wbuf ? wbuf[g * NT + j].v[c] : chunk_##KIND(block, j, c);                       \
                for (int r = 0; r < R; r++) {                                                              \
                    __m256 xv = _mm256_loadu_ps(x + (m0 + r) * K + g * 32 + 8 * c);                        \
                    for (int j = 0; j < NT; j++)                                                           \
                        acc[j][r] = _mm256_fmadd_ps(xv, w[j], acc[j][r]);                                  \
                }                                                                                          \
            }                                                                                              \
        }                                                                                                  \
        for (int j = 0; j < NT; j++)                                                                       \
            for (int r = 0; r < R; r++)                                                                    \
                store_sum(y, bf16_out, (m0 + r) * N + n0 + j, sum8(acc[j][r]));                            \
    }
/* every row of one tile, two at a time */
#define ROWS(KIND)                                                                                         \
    TILE_AVX2(KIND, 1)                                                                                     \
    TILE_AVX2(KIND, 2)                                                                                     \
    static void rows_##KIND(const xelem *x, int64_t M, int64_t K, const uint8_t *tile, const wvec *wbuf,   \
                            int64_t N, int64_t n0, void *y, int bf16_out, float iota) {                    \
        (void)iota;                                                                                        \
        int64_t m0 = 0;                                                                                    \
        for (; m0 + 2 <= M; m0 += 2)                                                                       \
            tile_##KIND##_2(x, K, tile, wbuf, N, n0, m0, y, bf16_out);                                     \
        if (m0 < M)                                                                                        \
            tile_##KIND##_1(x, K, tile, wbuf, N, n0, m0, y, bf16_out);                                     \
    }
#else
typedef uint16_t xelem;
#define DENSE_IN_PLACE 1
typedef struct { uint16_t v[32]; } wvec;
static inline wvec dequant_q4(const uint8_t *block, int j, float unused) {
    (void)unused;
    const float *sz = (const float *)(block + 64);
    wvec out;
    for (int i = 0; i < 16; i++) {
        uint8_t c = block[16 * j + i];
        out.v[i] = float_to_bf16(fmaf((float)(c & 15), sz[j], sz[NT + j]));
        out.v[16 + i] = float_to_bf16(fmaf((float)(c >> 4), sz[j], sz[NT + j]));
    }
    return out;
}
static inline wvec dequant_q8(const uint8_t *block, int j, float unused) {
    (void)unused;
    float scale = ((const float *)(block + 128))[j];
    wvec out;
    for (int i = 0; i < 32; i++)
        out.v[i] = float_to_bf16((float)(int8_t)block[32 * j + i] * scale);
    return out;
}
static inline wvec dequant_bf(const uint8_t *block, int j, float unused) {
    (void)unused;
    wvec out;
    memcpy(out.v, block + 64 * j, 64);
    return out;
}
static inline wvec load_w(const wvec *p) { return *p; }
typedef struct { float v[16]; } accum;
static inline accum acc_zero(void) { accum a; memset(&a, 0, sizeof a); return a; }
static inline accum acc_dot(accum a, const uint16_t *x, wvec w) {
    for (int l = 0; l < 16; l++)
        a.v[l] += bf16_to_float(x[2 * l]) * bf16_to_float(w.v[2 * l]) + bf16_to_float(x[2 * l + 1]) * bf16_to_float(w.v[2 * l + 1]);
    return a;
}
static inline float acc_sum(accum a) { float s = 0.f; for (int l = 0; l < 16; l++) s += a.v[l]; return s; }
#endif

#ifdef INT4_SIMD
#define IOTA_T __m512
#else
#define IOTA_T float
#endif

/* rows m0..m0+R of one tile, weights dequantized in registers (direct) or read from wbuf. Passes of 3
 * rows or more ask for the next tile's group while they compute this one's (a prefetch, which never
 * faults past the blob's end): with that much arithmetic between loads, the hardware's own prefetch
 * left a whole model's matmuls 4-16% slower at 6-16 rows in int4 and 20% at 16 rows in bfloat16.
 * Dense tiles are prefetched into L2 only, quantized ones into L1 as well: a dense tile is read again
 * for every 4 rows, and the L2 hint took 15-30% off a whole model's dense matmuls at 3-12 rows (5-17%
 * at 16); quantized tiles, read once, went 3-7% slower at 3-8 rows with it (2-3% faster at 12-16).
 * Passes of one or two rows ask for the group AHEAD tiles on, into L2 (prefetch_ahead): on an AMD EPYC
 * the hardware's prefetch alone kept up, but on an Intel Xeon (Sapphire Rapids) a whole SmolLM2-135M's
 * int4 layers, streamed from memory, took 13.0 ms without it and 6.3 ms with it (12 against 6 GB/s;
 * the weights read from L2 take 5.2 ms); docs/decisions/int4-matmul.md. */
#define TILE(KIND, R)                                                                                      \
    static void tile_##KIND##_##R(const xelem *x, int64_t K, const uint8_t *tile, const wvec *wbuf,        \
                                  int64_t N, int64_t n0, int64_t m0, void *y, int bf16_out, IOTA_T iota) { \
        int64_t G = K / 32;                                                                                \
        accum acc[NT][R];                                                                                  \
        for (int j = 0; j < NT; j++)                                                                       \
            for (int r = 0; r < R; r++)                                                                    \
                acc[j][r] = acc_zero();                                                                    \
        for (int64_t g = 0; g < G; g++) {                                                                  \
            if (R > 2)                                                                                     \
                for (int l = 0; l < BLOCK_##KIND; l += 64)                                                 \
                    __builtin_prefetch(tile + (G + g) * BLOCK_##KIND + l, 0, PREFETCH_##KIND);              \
            else                                                                                           \
                prefetch_ahead(tile, G, g, BLOCK_##KIND);                                                  \
            for (int j = 0; j < NT; j++) {                                                                 \
                wvec w = wbuf ? load_w(wbuf + g * NT + j) : dequant_##KIND(tile + g * BLOCK_##KIND, j, iota); \
                for (int r = 0; r < R; r++)                                                                \
                    acc[j][r] = acc_dot(acc[j][r], x + (m0 + r) * K + g * 32, w);                         \
            }                                                                                              \
        }                                                                                                  \
        for (int j = 0; j < NT; j++)                                                                       \
            for (int r = 0; r < R; r++)                                                                    \
                store_sum(y, bf16_out, (m0 + r) * N + n0 + j, acc_sum(acc[j][r]));                         \
    }

/* rows m0..m0+R of one tile for R = 5..8, weights dequantized in registers: two outputs at a time (2 x R
 * accumulators fit the registers where 4 x R do not), each (group, output) dequantized once as in TILE;
 * every sum is taken exactly as there (per output and row, over groups in order), so the same bits */
#define TILE_PAIRS(KIND, R)                                                                                \
    static void tile_##KIND##_p##R(const xelem *x, int64_t K, const uint8_t *tile, int64_t N, int64_t n0,  \
                                   int64_t m0, void *y, int bf16_out, IOTA_T iota) {                        \
        int64_t G = K / 32;                                                                                \
        for (int jp = 0; jp < NT; jp += 2) {                                                               \
            accum acc[2][R];                                                                               \
            for (int j = 0; j < 2; j++)                                                                    \
                for (int r = 0; r < R; r++)                                                                \
                    acc[j][r] = acc_zero();                                                                \
            for (int64_t g = 0; g < G; g++) {                                                              \
                if (jp == 0)                                                                               \
                    for (int l = 0; l < BLOCK_##KIND; l += 64)                                             \
                        __builtin_prefetch(tile + (G + g) * BLOCK_##KIND + l, 0, PREFETCH_##KIND);          \
                for (int j = 0; j < 2; j++) {                                                              \
                    wvec w = dequant_##KIND(tile + g * BLOCK_##KIND, jp + j, iota);                        \
                    for (int r = 0; r < R; r++)                                                            \
                        acc[j][r] = acc_dot(acc[j][r], x + (m0 + r) * K + g * 32, w);                     \
                }                                                                                          \
            }                                                                                              \
            for (int j = 0; j < 2; j++)                                                                    \
                for (int r = 0; r < R; r++)                                                                \
                    store_sum(y, bf16_out, (m0 + r) * N + n0 + jp + j, acc_sum(acc[j][r]));                \
        }                                                                                                  \
    }

/* value n of row m of y (float32, or bfloat16 when bf16) as a float */
static inline float y_at(const void *y, int bf16, int64_t m, int64_t N, int64_t n) {
    return bf16 ? bf16_to_float(((const uint16_t *)y)[m * N + n]) : ((const float *)y)[m * N + n];
}

#ifdef INT4_SIMD
/* values n..n+15 of row m of y as floats */
static inline __m512 y_16(const void *y, int bf16, int64_t m, int64_t N, int64_t n) {
    if (!bf16)
        return _mm512_loadu_ps((const float *)y + m * N + n);
    __m256i b = _mm256_loadu_si256((const __m256i *)((const uint16_t *)y + m * N + n));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}
#endif

/* For each row m of y, over its outputs n0..n1: arg[m] the first index of the largest value, top[m]
 * that value; arg[m] = -2 where a value is NaN or infinite, -1 where the span is empty. Called by each
 * thread on the outputs it has just written, while they are in its cache (greedy decoding's argmax
 * without reading the logits again). */
static void span_best(const void *y, int bf16, int64_t M, int64_t N, int64_t n0, int64_t n1, float *top,
                      int64_t *arg) {
    for (int64_t m = 0; m < M; m++) {
        float best = -INFINITY;
        int64_t at = n1 > n0 ? n0 : -1;
        int64_t n = n0;
#ifdef INT4_SIMD
        __m512 vmax = _mm512_set1_ps(-INFINITY);
        __mmask16 bad = 0;
        for (; n + 16 <= n1; n += 16) {
            __m512 v = y_16(y, bf16, m, N, n);
            bad |= _mm512_fpclass_ps_mask(v, 0x99); /* QNaN, +inf, -inf, SNaN */
            vmax = _mm512_max_ps(vmax, v);
        }
        if (bad) {
            arg[m] = -2;
            continue;
        }
        best = _mm512_reduce_max_ps(vmax);
#endif
        for (; n < n1; n++) { /* the tail (all of it without SIMD) */
            float v = y_at(y, bf16, m, N, n);
            if (!isfinite(v)) {
                at = -2;
                break;
            }
            best = v > best ? v : best;
        }
        if (at != -2 && n1 > n0) { /* the first index holding the largest value */
            at = n0;
#ifdef INT4_SIMD
            __m512 target = _mm512_set1_ps(best);
            for (; at + 16 <= n1; at += 16) {
                __m512 v = y_16(y, bf16, m, N, at);
                __mmask16 hit = _mm512_cmp_ps_mask(v, target, _CMP_EQ_OQ);
                if (hit) {
                    at += __builtin_ctz(hit);
                    break;
                }
            }
#endif
            while (y_at(y, bf16, m, N, at) != best)
                at++;
        }
        top[m] = best;
        arg[m] = at;
    }
}

/* best[m] from each thread's (top, arg) of row m over its span, spans in order: the first index of the
 * largest value of the row, or -1 where any value of the row is NaN or infinite */
static void join_best(int64_t M, int spans, const float *top, const int64_t *arg, int64_t *best) {
    for (int64_t m = 0; m < M; m++) {
        int64_t at = -1;
        float value = -INFINITY;
        for (int s = 0; s < spans; s++) {
            int64_t a = arg[s * M + m];
            if (a == -2) {
                at = -1;
                break;
            }
            if (a >= 0 && (at < 0 || top[s * M + m] > value)) {
                at = a;
                value = top[s * M + m];
            }
        }
        best[m] = at;
    }
}

/* Returns 0, -1 when K is not a multiple of 32 or N not of 4, -2 when a buffer cannot be allocated.
 *   x    [M, K]                 bfloat16, contiguous
 *   blob [N/4, K/32, BLOCK]     the weights (int4_pack / int8_pack)
 *   y    [M, N]                 float32, or bfloat16 (rounded to nearest even) when bf16_out
 *   best [M] or NULL            KIND_matmul_best: each row's argmax over y (the first index of its
 *                               largest value), -1 where the row holds NaN or inf
 * Thread i of T computes the tiles t with i * tiles / T <= t < (i + 1) * tiles / T (each tile's outputs
 * are the same whichever thread computes them). */
#ifndef INT4_AVX2
/* every row of one tile: TILE over CHUNK rows at a time, or TILE_PAIRS for passes of 5 to 8 rows */
#define ROWS(KIND)                                                                                       \
    TILE(KIND, 1)                                                                                          \
    TILE(KIND, 2)                                                                                          \
    TILE(KIND, 3)                                                                                          \
    TILE(KIND, 4)                                                                                          \
    TILE_PAIRS(KIND, 5)                                                                                    \
    TILE_PAIRS(KIND, 6)                                                                                    \
    TILE_PAIRS(KIND, 7)                                                                                    \
    TILE_PAIRS(KIND, 8)                                                                                    \
    static void rows_##KIND(const xelem *x, int64_t M, int64_t K, const uint8_t *tile, const wvec *wbuf,   \
                            int64_t N, int64_t n0, void *y, int bf16_out, IOTA_T iota) {                   \
        switch (wbuf ? 0 : M) {                                                                            \
        case 5: tile_##KIND##_p5(x, K, tile, N, n0, 0, y, bf16_out, iota); return;                         \
        case 6: tile_##KIND##_p6(x, K, tile, N, n0, 0, y, bf16_out, iota); return;                         \
        case 7: tile_##KIND##_p7(x, K, tile, N, n0, 0, y, bf16_out, iota); return;                         \
        case 8: tile_##KIND##_p8(x, K, tile, N, n0, 0, y, bf16_out, iota); return;                         \
        }                                                                                                  \
        int64_t m0 = 0;                                                                                    \
        for (; m0 + CHUNK <= M; m0 += CHUNK)                                                               \
            tile_##KIND##_4(x, K, tile, wbuf, N, n0, m0, y, bf16_out, iota);                               \
        switch (M - m0) {                                                                                  \
        case 3: tile_##KIND##_3(x, K, tile, wbuf, N, n0, m0, y, bf16_out, iota); break;                    \
        case 2: tile_##KIND##_2(x, K, tile, wbuf, N, n0, m0, y, bf16_out, iota); break;                    \
        case 1: tile_##KIND##_1(x, K, tile, wbuf, N, n0, m0, y, bf16_out, iota); break;                    \
        }                                                                                                  \
    }
#define DIRECT_ROWS DIRECT
#else
#define DIRECT_ROWS DIRECT_AVX2
#endif

#define MATMUL(KIND)                                                                                       \
    ROWS(KIND)                                                                                             \
    int KIND##_matmul_best(const uint16_t *x, int64_t M, int64_t K, const uint8_t *blob, int64_t N, void *y, \
                           int bf16_out, int threads, int64_t *best) {                                     \
        if (K <= 0 || K % 32 || N % NT || threads < 1)                                                     \
            return -1;                                                                                     \
        int64_t G = K / 32, tiles = N / NT;                                                                \
        IOTA_T iota = make_iota();                                                                         \
        /* passes of more than DIRECT rows: one dequantized tile per thread (G * NT * 64 bytes); dense    \
         * tiles are read where they are by passes of more than CHUNK rows */                             \
        wvec *buffers = NULL;                                                                              \
        float *top = NULL;                                                                                 \
        int64_t *arg = NULL;                                                                               \
        int buffered = M > DIRECT_ROWS && (BLOCK_##KIND != BLOCK_bf || !DENSE_IN_PLACE);                         \
        if (buffered)                                                                                      \
            buffers = aligned_alloc(64, sizeof(wvec) * (size_t)(G * NT * threads));                        \
        if (best) { /* one (top, arg) per row and thread; at least one, so that M = 0 is no failure */    \
            top = malloc(sizeof(float) * (size_t)((M > 0 ? M : 1) * threads));                             \
            arg = malloc(sizeof(int64_t) * (size_t)((M > 0 ? M : 1) * threads));                           \
        }                                                                                                  \
        const xelem *xs = NULL;                                                                            \
        float *wide = NULL;                                                                                \
        if (!x_widened(x, M * K, BLOCK_##KIND == BLOCK_bf, &xs, &wide) || (buffered && buffers == NULL)     \
            || (best && (!top || !arg))) {                                                                 \
            free(buffers), free(top), free(arg), free(wide);                                               \
            return -2;                                                                                     \
        }                                                                                                  \
        int spans = 1;                                                                                     \
        _Pragma("omp parallel num_threads(threads)")                                                      \
        {                                                                                                  \
            int me = thread_index(), count = thread_count();                                               \
            if (me == 0)                                                                                   \
                spans = count;                                                                             \
            int64_t t0 = tiles * me / count, t1 = tiles * (me + 1) / count;                                \
            wvec *own = buffers ? buffers + me * G * NT : NULL;                                            \
            for (int64_t t = t0; t < t1; t++) {                                                            \
                const uint8_t *tile = blob + t * G * BLOCK_##KIND;                                         \
                if (own)                                                                                   \
                    for (int64_t g = 0; g < G; g++)                                                        \
                        for (int j = 0; j < NT; j++)                                                       \
                            own[g * NT + j] = dequant_##KIND(tile + g * BLOCK_##KIND, j, iota);            \
                const wvec *wbuf = own ? own                                                               \
                    : DENSE_IN_PLACE && BLOCK_##KIND == BLOCK_bf && M > CHUNK ? (const wvec *)tile : NULL;  \
                rows_##KIND(xs, M, K, tile, wbuf, N, t * NT, y, bf16_out, iota);                           \
            }                                                                                              \
            if (best)                                                                                      \
                span_best(y, bf16_out, M, N, t0 * NT, t1 * NT, top + me * M, arg + me * M);                \
        }                                                                                                  \
        if (best)                                                                                          \
            join_best(M, spans, top, arg, best);                                                           \
        free(buffers), free(top), free(arg), free(wide);                                                   \
        return 0;                                                                                          \
    }                                                                                                      \
    int KIND##_matmul(const uint16_t *x, int64_t M, int64_t K, const uint8_t *blob, int64_t N, void *y,    \
                      int bf16_out, int threads) {                                                         \
        return KIND##_matmul_best(x, M, K, blob, N, y, bf16_out, threads, NULL);                           \
    }

/* the activations as the tiles read them (xelem): x itself, or (AVX2) x widened into *wide, which the
 * caller frees; 0 when that buffer cannot be allocated */
static int x_widened(const uint16_t *x, int64_t count, int dense, const xelem **xs, float **wide) {
#ifdef INT4_AVX2
    *wide = malloc(sizeof(float) * (size_t)(count > 0 ? count : 1));
    if (*wide == NULL)
        return 0;
    x_wide(x, count, dense, *wide);
    *xs = *wide;
#else
    (void)count, (void)dense;
    *xs = x, *wide = NULL;
#endif
    return 1;
}

static inline IOTA_T make_iota(void) {
#ifdef INT4_SIMD
    float steps[16];
    for (int i = 0; i < 16; i++)
        steps[i] = (float)i;
    return _mm512_loadu_ps(steps);
#else
    return 0.f;
#endif
}

/* which path this build's matmuls take: 2 AVX512-BF16, 1 AVX2 and FMA, 0 portable C */
int matmul_isa(void) {
#if defined(INT4_SIMD)
    return 2;
#elif defined(INT4_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* q4_matmul: 4-bit codes (Q4_1); q8_matmul: 8-bit codes (Q8_0); bf_matmul: dense bfloat16 weights */
MATMUL(q4)
MATMUL(q8)
MATMUL(bf)
