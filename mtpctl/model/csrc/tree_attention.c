/* Decode/verify attention over explicit slot lists: one fused pass per (token, KV head).
 *
 * Built by mtpctl/model/native_build.py (cc -O3 -march=native -fopenmp -shared), bound by native.py. Token i
 * attends, in this order, to the committed cache slots [starts[i], ends[i]) and then to the slots in
 * paths[i] (its draft-tree ancestors root first, then itself; -1 pads the row). Every output value is
 * a deterministic function of the token's query and of the keys and values of its slot list, in
 * list order (C semantics: no -ffast-math, every reduction in a fixed order): a token scored inside
 * a verify pass gets bit for bit what plain decoding of its path gets, because plain decoding lists
 * the same slots (the path committed by then) in the same order. No result depends on the other
 * tokens of the pass, on the thread count or on the list's split between committed range and path.
 * Keys and values are float32 or bfloat16 in the cache; either way they are read as float32 (a
 * bfloat16 value widened exactly), so a bfloat16 cache of values that are bfloat16 already (those of
 * a bfloat16 model) gives bit for bit what a float32 cache of them gives, reading half the bytes.
 * With AVX-512, slots go 16 at a time (keys widened once for the group's heads, 16 dot products
 * reduced together by the same lane tree) and values are widened once for up to 4 heads: the same
 * sums in the same order as one slot and one head at a time.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define LANES 16
#define MAX_HEAD_DIM 512
#define MAX_GROUP 16

#ifdef __AVX512F__
/* 16 cache values from element i of x (float32, or bfloat16 widened exactly) */
static inline __m512 load16(const void *x, int64_t i, int bf16) {
    if (!bf16)
        return _mm512_loadu_ps((const float *)x + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* out[t] = the sum of a[t]'s 16 lanes for t < 16, each added in _mm512_reduce_add_ps's order (lanes l
 * and l + 8, then l and l + 4, l and l + 2, l and l + 1), two accumulators to a register per level */
static inline void sum16(const __m512 *a, float *out) {
    __m512 v1[8], v2[4], v3[2];
    for (int p = 0; p < 8; p++) /* a[2p] in elements 0-7, a[2p + 1] in 8-15 */
        v1[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0x44),
                              _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0xEE));
    for (int r = 0; r < 4; r++) /* a[4r + c] in 128-bit lane c */
        v2[r] = _mm512_add_ps(_mm512_shuffle_f32x4(v1[2 * r], v1[2 * r + 1], 0x88),
                              _mm512_shuffle_f32x4(v1[2 * r], v1[2 * r + 1], 0xDD));
    for (int h = 0; h < 2; h++) /* lane c: two partial sums of a[8h + c], then two of a[8h + 4 + c] */
        v3[h] = _mm512_add_ps(_mm512_shuffle_ps(v2[2 * h], v2[2 * h + 1], 0x44),
                              _mm512_shuffle_ps(v2[2 * h], v2[2 * h + 1], 0xEE));
    /* element 4c + e: the sum of a[4e + c] */
    __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(v3[0], v3[1], 0x88), _mm512_shuffle_ps(v3[0], v3[1], 0xDD));
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    _mm512_storeu_ps(out, _mm512_permutexvar_ps(order, sums));
}

/* scores[h * stride + j] = (q_h . k[slots[j]]) * scale for the group's heads h (q [group, d]): per
 * head and slot, 16 lanes of products over the d values (a multiply, then fused multiply-adds in
 * order) added up in a fixed order. Sixteen slots at a time: their keys widened to float32 once for
 * every head, and their 16 sums taken together (sum16). */
static void head_scores(const float *q, int64_t group, const void *k, const int64_t *slots, int64_t count,
                        int64_t d, float scale, float *scores, int64_t stride, int bf16) {
    float keys[LANES * MAX_HEAD_DIM];
    for (int64_t j0 = 0; j0 < count; j0 += LANES) {
        int64_t m = count - j0 < LANES ? count - j0 : LANES;
        for (int64_t t = 0; t < LANES; t++)
            for (int64_t c = 0; c < d; c += LANES)
                _mm512_storeu_ps(keys + t * d + c, t < m ? load16(k, slots[j0 + t] * d + c, bf16) : _mm512_setzero_ps());
        for (int64_t h = 0; h < group; h++) {
            const float *qh = q + h * d;
            __m512 acc[LANES], qc = _mm512_loadu_ps(qh);
            float sums[LANES];
            for (int t = 0; t < LANES; t++)
                acc[t] = _mm512_mul_ps(qc, _mm512_loadu_ps(keys + t * d));
            for (int64_t c = LANES; c < d; c += LANES) {
                qc = _mm512_loadu_ps(qh + c);
                for (int t = 0; t < LANES; t++)
                    acc[t] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(keys + t * d + c), acc[t]);
            }
            sum16(acc, sums);
            for (int64_t t = 0; t < m; t++)
                scores[h * stride + j0 + t] = sums[t] * scale;
        }
    }
}

/* s[j] = exp(s[j] - top) for j < count (s holds room for count rounded up to 16), within 2 ulp:
 * 2^k * p(r) with r = x - k ln 2, |r| <= ln 2 / 2, p the degree-6 Taylor polynomial; terms below
 * exp(-87) (1.6e-38) come out as that tiny value, which no softmax sum feels */
static void exp_shifted(float *s, int64_t count, float top) {
    const __m512 lo = _mm512_set1_ps(-87.0f), shift = _mm512_set1_ps(top);
    for (int64_t j = 0; j < count; j += LANES) {
        __m512 x = _mm512_max_ps(_mm512_sub_ps(_mm512_loadu_ps(s + j), shift), lo);
        __m512 k = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
        __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145752f), x);
        r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.42860677e-6f), r);
        __m512 p = _mm512_set1_ps(1.38888892e-3f);
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.33333377e-3f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.16666679e-2f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.66666672e-1f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
        __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
        _mm512_storeu_ps(s + j, _mm512_mul_ps(p, _mm512_castsi512_ps(e)));
    }
}

/* o_h[x] = sum_j p_h[j] * v[slots[j]][x] / totals[h] for the group's heads h (p_h at scores + h * stride,
 * o_h at o + h * d), summed in list order; each slot's values widened once for up to four heads, 64
 * columns at a time held in registers */
static void head_sums(float *o, const float *scores, int64_t stride, const float *totals, int64_t group,
                      const void *v, const int64_t *slots, int64_t count, int64_t d, int bf16) {
    for (int64_t h0 = 0; h0 < group; h0 += 4) {
        int64_t heads = group - h0 < 4 ? group - h0 : 4;
        for (int64_t x = 0; x < d; x += 4 * LANES) {
            int64_t width = d - x < 4 * LANES ? (d - x) / LANES : 4;
            __m512 acc[4][4];
            for (int h = 0; h < 4; h++)
                for (int c = 0; c < 4; c++)
                    acc[h][c] = _mm512_setzero_ps();
            for (int64_t j = 0; j < count; j++) {
                int64_t row = slots[j] * d + x;
                __m512 vals[4];
                for (int c = 0; c < 4; c++)
                    vals[c] = c < width ? load16(v, row + c * LANES, bf16) : _mm512_setzero_ps();
                for (int h = 0; h < 4; h++) {
                    if (h >= heads)
                        break;
                    __m512 w = _mm512_set1_ps(scores[(h0 + h) * stride + j]);
                    for (int c = 0; c < 4; c++)
                        acc[h][c] = _mm512_fmadd_ps(w, vals[c], acc[h][c]);
                }
            }
            for (int64_t h = 0; h < heads; h++)
                for (int64_t c = 0; c < width; c++)
                    _mm512_storeu_ps(o + (h0 + h) * d + x + c * LANES,
                                     _mm512_div_ps(acc[h][c], _mm512_set1_ps(totals[h0 + h])));
        }
    }
}
#else
/* The same three steps in portable C (vectorized by the compiler where it can do so exactly). */
static inline float cached(const void *x, int64_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

static inline float dot(const float *a, const void *k, int64_t i, int64_t d, int bf16) {
    float acc[LANES] = {0};
    for (int64_t c = 0; c < d; c += LANES)
        for (int l = 0; l < LANES; l++)
            acc[l] += a[c + l] * cached(k, i + c + l, bf16);
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++)
            acc[l] += acc[l + w];
    return acc[0];
}

static void exp_shifted(float *s, int64_t count, float top) {
    for (int64_t j = 0; j < count; j++)
        s[j] = expf(s[j] - top);
}

static void weighted_sum(float *o, const float *p, const void *v, const int64_t *slots, int64_t count,
                         int64_t d, float total, int bf16) {
    float acc[MAX_HEAD_DIM] = {0};
    for (int64_t j = 0; j < count; j++)
        for (int64_t x = 0; x < d; x++)
            acc[x] += p[j] * cached(v, slots[j] * d + x, bf16);
    for (int64_t x = 0; x < d; x++)
        o[x] = acc[x] / total;
}

static void head_scores(const float *q, int64_t group, const void *k, const int64_t *slots, int64_t count,
                        int64_t d, float scale, float *scores, int64_t stride, int bf16) {
    for (int64_t j = 0; j < count; j++)
        for (int64_t h = 0; h < group; h++)
            scores[h * stride + j] = dot(q + h * d, k, slots[j] * d, d, bf16) * scale;
}

static void head_sums(float *o, const float *scores, int64_t stride, const float *totals, int64_t group,
                      const void *v, const int64_t *slots, int64_t count, int64_t d, int bf16) {
    for (int64_t h = 0; h < group; h++)
        weighted_sum(o + h * d, scores + h * stride, v, slots, count, d, totals[h], bf16);
}
#endif

/* Returns 0, -1 when d or the GQA group exceed the kernel's limits, or -2 when scratch memory fails.
 *   q      [n, heads, d]          float32, contiguous
 *   kv     [n, 4]                 where token i's sequence keeps its KV cache: the addresses of its
 *                                 keys and values (layer 0, [layers][kv_heads][slots][d], float32, or
 *                                 bfloat16 when kv_bf16), the
 *                                 elements between two layers, and slots per KV head; the tokens of a
 *                                 pass may come from different sequences, each with its own cache
 *   layer  the layer whose keys and values are read
 *   starts [n]                    first committed slot each token attends to
 *   ends   [n]                    committed slots of token i's sequence: it reads [starts[i], ends[i])
 *   paths  [n, path_len]          slots after the committed range, -1 padded
 *   out    [n, heads, d]          float32
 */
int tree_attention(const float *q, const int64_t *kv, int64_t layer, const int64_t *starts, const int64_t *ends,
                   const int64_t *paths, int64_t path_len, int64_t n, int64_t heads, int64_t kv_heads, int64_t d,
                   float scale, float *out, int threads, int kv_bf16) {
    if (kv_heads <= 0 || heads % kv_heads || d % LANES || d > MAX_HEAD_DIM || heads / kv_heads > MAX_GROUP)
        return -1;
    int64_t group = heads / kv_heads;
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(| : failed)
    for (int64_t unit = 0; unit < n * kv_heads; unit++) {
        int64_t i = unit / kv_heads, g = unit % kv_heads;
        const int64_t *path = paths + i * path_len;
        const int64_t *where = kv + i * 4;
        int64_t size = kv_bf16 ? 2 : 4; /* bytes per cached value */
        const char *k = (const char *)(intptr_t)where[0] + layer * where[2] * size;
        const char *v = (const char *)(intptr_t)where[1] + layer * where[2] * size;
        int64_t cap = where[3];
        int64_t committed = ends[i] - starts[i], extra = 0;
        while (extra < path_len && path[extra] >= 0)
            extra++;
        int64_t count = committed + extra;
        int64_t stride = (count + LANES - 1) / LANES * LANES; /* score rows padded for exp_shifted */
        float *scores = malloc(sizeof(float) * (size_t)(group * stride));
        int64_t *slots = malloc(sizeof(int64_t) * (size_t)(count + 1));
        if (!scores || !slots) {
            free(scores);
            free(slots);
            failed = 1;
            continue;
        }
        for (int64_t j = 0; j < count; j++)
            slots[j] = j < committed ? starts[i] + j : path[j - committed];
        const char *kh = k + g * cap * d * size, *vh = v + g * cap * d * size;
        const float *qh = q + (i * heads + g * group) * d;
        float totals[MAX_GROUP];
        head_scores(qh, group, kh, slots, count, d, scale, scores, stride, kv_bf16);
        for (int64_t h = 0; h < group; h++) {
            float *s = scores + h * stride, top = -INFINITY, part[LANES] = {0}, total = 0.0f;
            for (int64_t j = 0; j < count; j++)
                top = s[j] > top ? s[j] : top;
            for (int64_t j = count; j < stride; j++)
                s[j] = top; /* padding, never summed */
            exp_shifted(s, count, top);
            for (int64_t j = 0; j < count; j++) /* 16 running sums in list order, then added up */
                part[j % LANES] += s[j];
            for (int l = 0; l < LANES; l++)
                total += part[l];
            totals[h] = total;
        }
        head_sums(out + (i * heads + g * group) * d, scores, stride, totals, group, vh, slots, count, d, kv_bf16);
        free(slots);
        free(scores);
    }
    return failed ? -2 : 0;
}
