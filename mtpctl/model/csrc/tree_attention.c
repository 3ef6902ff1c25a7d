/* Decode/verify attention over explicit slot lists: one fused pass per (token, KV head).
 *
 * Built and loaded by mtpctl/model/native.py (cc -O3 -march=native -fopenmp -shared). Token i
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
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
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

/* q.k over d values (d a multiple of 16), k at element i of the cache: 16 lanes of partial sums,
 * then a fixed reduction */
static inline float dot(const float *a, const void *k, int64_t i, int64_t d, int bf16) {
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a), load16(k, i, bf16));
    for (int64_t c = LANES; c < d; c += LANES)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + c), load16(k, i + c, bf16), acc);
    return _mm512_reduce_add_ps(acc);
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

/* o[x] = sum_j p[j] * v[slots[j]][x] / total for x < d, summed in list order (64 columns at a time,
 * held in registers) */
static void weighted_sum(float *o, const float *p, const void *v, const int64_t *slots, int64_t count,
                         int64_t d, float total, int bf16) {
    for (int64_t x = 0; x < d; x += 4 * LANES) {
        int64_t width = d - x < 4 * LANES ? (d - x) / LANES : 4;
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int64_t j = 0; j < count; j++) {
            int64_t row = slots[j] * d + x;
            __m512 w = _mm512_set1_ps(p[j]);
            for (int64_t c = 0; c < width; c++)
                acc[c] = _mm512_fmadd_ps(w, load16(v, row + c * LANES, bf16), acc[c]);
        }
        for (int64_t c = 0; c < width; c++)
            _mm512_storeu_ps(o + x + c * LANES, _mm512_div_ps(acc[c], _mm512_set1_ps(total)));
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
        for (int64_t j = 0; j < count; j++)
            for (int64_t h = 0; h < group; h++)
                scores[h * stride + j] = dot(qh + h * d, kh, slots[j] * d, d, kv_bf16) * scale;
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
            weighted_sum(out + (i * heads + g * group + h) * d, s, vh, slots, count, d, total, kv_bf16);
        }
        free(slots);
        free(scores);
    }
    return failed ? -2 : 0;
}
