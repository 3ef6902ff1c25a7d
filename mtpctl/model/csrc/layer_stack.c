/* Every decoder layer of a decode, verify or prefill pass of an int4 or dense bfloat16 Llama-family
 * model in one call.
 *
 * Built into the same library as tree_attention.c by mtpctl/model/native_build.py. A pass through the
 * layers one by one from Python runs about a dozen kernel calls and tensor ops per layer (norms, the
 * four matmuls, RoPE with the cache write, attention, SiLU, residual adds), each with its Python and
 * ctypes dispatch: about a fifth of an int4 decode step on this project's CPU. This file runs the
 * same kernels in the same order from C, with the rest of the block written here:
 *
 *   h = rms_norm(x);  qkv = h @ Wqkv;  q = rope_write(qkv) (keys and values to the cache)
 *   a = bf16(tree_attention(q));  x = bf16(x + a @ Wo)
 *   h = rms_norm(x);  [g, u] = h @ Wgate_up;  x = bf16(x + bf16(bf16(silu(g)) * u) @ Wdown)
 *
 * and the final norm of the last layer's output. Every value depends on its own token's row alone
 * (the kernels are batch-invariant; SiLU and the residual adds are elementwise), so a verify pass
 * gives each token bit for bit what plain decoding of it gives. SiLU uses its own exponential (a
 * polynomial, below), not libm's or torch's: results agree with the layer-by-layer path to rounding,
 * not bit for bit.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "kernels.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* one layer's weights: addresses (and the bytes per tile of a blob, which names its kernel), as the
 * 64-bit integers of a row of mtpctl.model.native.stack_weights' table */
struct layer_weights {
    int64_t input_norm, post_attention_norm; /* [hidden] bfloat16 */
    int64_t qkv, o_proj, gate_up, down;      /* int4_pack / int8_pack blobs */
    int64_t qkv_block, o_proj_block, gate_up_block, down_block; /* 96: 4-bit codes, 144: 8-bit, 256: bfloat16 */
};

static int matmul(const uint16_t *x, int64_t m, int64_t k, int64_t blob, int64_t block, int64_t n, uint16_t *y,
                  int threads) {
    const uint8_t *w = (const uint8_t *)(intptr_t)blob;
    if (block == 96)
        return q4_matmul(x, m, k, w, n, y, 1, threads);
    if (block == 144)
        return q8_matmul(x, m, k, w, n, y, 1, threads);
    if (block == 256)
        return bf_matmul(x, m, k, w, n, y, 1, threads);
    return -1;
}

/* exp(x) on [-88, 88] (x outside is clamped): x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its Taylor
 * polynomial to r^7 (relative error below 2e-7), times 2^n. The same operations in the same order in
 * both versions below, so each is a fixed function of x. */
#define EXP_LN2_HI 0.693145751953125f
#define EXP_LN2_LO 1.428606765330187e-06f
static const float EXP_COEF[8] = {1.f, 1.f, 0.5f, 1.f / 6, 1.f / 24, 1.f / 120, 1.f / 720, 1.f / 5040};

#if defined(__AVX512F__)
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.f)), _mm512_set1_ps(88.f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_COEF[7]);
    for (int i = 6; i >= 0; i--)
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_COEF[i]));
    return _mm512_scalef_ps(p, n);
}
#else
static inline float exp1(float x) {
    x = fminf(fmaxf(x, -88.f), 88.f);
    float n = nearbyintf(x * 1.44269504f);
    float r = fmaf(-n, EXP_LN2_HI, x);
    r = fmaf(-n, EXP_LN2_LO, r);
    float p = EXP_COEF[7];
    for (int i = 6; i >= 0; i--)
        p = fmaf(p, r, EXP_COEF[i]);
    return ldexpf(p, (int)n);
}
#endif

/* act[i] = bf16(bf16(silu(g[i])) * u[i]) for the gate g and up u halves of one row of [g, u]; silu(g) =
 * g / (1 + exp(-g)) (a NaN or infinite gate stays non-finite) */
static void silu_mul(const uint16_t *gu, int64_t inter, uint16_t *act) {
#if defined(__AVX512F__)
    for (int64_t i = 0; i < inter; i += 16) {
        int64_t count = inter - i < 16 ? inter - i : 16;
        __mmask16 lanes = (__mmask16)((1u << count) - 1u);
        __m512 g = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, gu + i)), 16));
        __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        float sv[16];
        _mm512_storeu_ps(sv, s);
        for (int64_t l = 0; l < count; l++)
            act[i + l] = float_to_bf16(bf16_round(sv[l]) * bf16_to_float(gu[inter + i + l]));
    }
#else
    for (int64_t i = 0; i < inter; i++) {
        float g = bf16_to_float(gu[i]);
        act[i] = float_to_bf16(bf16_round(g / (1.f + exp1(-g))) * bf16_to_float(gu[inter + i]));
    }
#endif
}

/* x[i] = bf16(x[i] + y[i]) over n values (torch's bfloat16 add: the float sum rounded) */
static void add_into(uint16_t *x, const uint16_t *y, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        x[i] = float_to_bf16(bf16_to_float(x[i]) + bf16_to_float(y[i]));
}

/* Returns 0, -1 for a shape a kernel does not take (or a blob kind other than 96 / 144), -2 when
 * memory fails.
 *   x       [n, hidden]        bfloat16, the embeddings in, the last layer's residual stream out
 *   weights [layers]           struct layer_weights
 *   shape   [6]                layers, hidden, intermediate, heads, kv_heads, head_dim
 *   final_norm [hidden]        bfloat16
 *   cos,sin [n, head_dim]      bfloat16, each token's rotation
 *   kv, dest, kv_bf16          each token's cache and slot (rope_write, tree_attention)
 *   starts, ends, paths        each token's slot list (tree_attention), the same for every layer
 *   out     [n, hidden]        bfloat16, the final norm of the last layer's output */
int layer_stack(uint16_t *x, int64_t n, const int64_t *weights, const int64_t *shape, float eps, float scale,
                const uint16_t *final_norm, const uint16_t *cos, const uint16_t *sin, const int64_t *kv,
                const int64_t *dest, int kv_bf16, const int64_t *starts, const int64_t *ends, const int64_t *paths,
                int64_t path_len, uint16_t *out, int threads) {
    int64_t layers = shape[0], hidden = shape[1], inter = shape[2], heads = shape[3], kv_heads = shape[4];
    int64_t d = shape[5], q_size = heads * d, qkv_size = (heads + 2 * kv_heads) * d;
    size_t halves = (size_t)n * (size_t)(hidden + qkv_size + q_size + hidden + 2 * inter + inter);
    size_t floats = (size_t)n * (size_t)(2 * q_size);
    float *fbuf = malloc(floats * sizeof(float) + halves * sizeof(uint16_t));
    if (fbuf == NULL)
        return -2;
    float *q = fbuf, *attn = q + n * q_size;
    uint16_t *h = (uint16_t *)(attn + n * q_size), *qkv = h + n * hidden, *attn_bf = qkv + n * qkv_size;
    uint16_t *proj = attn_bf + n * q_size, *gu = proj + n * hidden, *act = gu + n * 2 * inter;
    int rc = 0;
    for (int64_t l = 0; l < layers && rc == 0; l++) {
        const struct layer_weights *w = (const struct layer_weights *)(weights + l * 10);
        rc = rms_norm(x, (const void *)(intptr_t)w->input_norm, h, n, hidden, eps, 1, 0);
        rc = rc ? rc : matmul(h, n, hidden, w->qkv, w->qkv_block, qkv_size, qkv, threads);
        rc = rc ? rc : rope_write(qkv, n, qkv_size, heads, kv_heads, d, cos, sin, 1, q, kv, l, dest, kv_bf16);
        rc = rc ? rc : tree_attention(q, kv, l, starts, ends, paths, path_len, n, heads, kv_heads, d, scale, attn,
                                      threads, kv_bf16);
        if (rc)
            break;
        for (int64_t i = 0; i < n * q_size; i++)
            attn_bf[i] = float_to_bf16(attn[i]);
        rc = matmul(attn_bf, n, q_size, w->o_proj, w->o_proj_block, hidden, proj, threads);
        if (rc)
            break;
        add_into(x, proj, n * hidden);
        rc = rms_norm(x, (const void *)(intptr_t)w->post_attention_norm, h, n, hidden, eps, 1, 0);
        rc = rc ? rc : matmul(h, n, hidden, w->gate_up, w->gate_up_block, 2 * inter, gu, threads);
        if (rc)
            break;
        for (int64_t i = 0; i < n; i++)
            silu_mul(gu + i * 2 * inter, inter, act + i * inter);
        rc = matmul(act, n, inter, w->down, w->down_block, hidden, proj, threads);
        if (rc == 0)
            add_into(x, proj, n * hidden);
    }
    if (rc == 0)
        rc = rms_norm(x, final_norm, out, n, hidden, eps, 1, 0);
    free(fbuf);
    return rc;
}
