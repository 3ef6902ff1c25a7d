/* Rotary position embedding (Su et al. 2021, RoFormer) of a decode or verify pass, fused with the
 * KV cache write and the query layout the attention kernel reads.
 *
 * Built into the same library as tree_attention.c by mtpctl/model/native_build.py. For each token it
 * rotates the query and key heads of its qkv row as mtpctl.model.decoder._rotate does
 * (x * cos + rotate_half(x) * sin, each product and the sum rounded to the model's dtype), writes
 * the queries to q_out in float32 and the keys and values to their cache slot, in float32 or in
 * bfloat16 (kv_bf16: exact for a bfloat16 model, whose keys and values are bfloat16 values). Every value
 * depends on its own token's row alone, so the result is batch-invariant. One call replaces the
 * rotation (cat, two products, a sum), the cache write and the query's float copy: about ten torch
 * ops per layer.
 */
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

static inline float load(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* one head of d values at x (element offset), rotated with the token's cos/sin rows, into out; the
 * two products are rounded before the sum (no fused multiply-add), as torch's separate ops round them */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
__attribute__((optimize("fp-contract=off")))
#endif
static void rotate_head(const void *x, int64_t at, const void *cos, const void *sin, int64_t c, int64_t d,
                        int bf16, float *out) {
    int64_t half = d / 2;
    for (int64_t j = 0; j < d; j++) {
        float v = load(x, at + j, bf16);
        float r = j < half ? -load(x, at + j + half, bf16) : load(x, at + j - half, bf16);
        float a = v * load(cos, c + j, bf16), b = r * load(sin, c + j, bf16);
        out[j] = bf16 ? bf16_round(bf16_round(a) + bf16_round(b)) : a + b;
    }
}

/* the d values of one head into a cache slot, as float32 or (kv_bf16) bfloat16 */
static void store(void *slot, const float *x, int64_t d, int kv_bf16) {
    for (int64_t j = 0; j < d; j++)
        if (kv_bf16)
            ((uint16_t *)slot)[j] = float_to_bf16(x[j]);
        else
            ((float *)slot)[j] = x[j];
}

/* Returns 0, or -1 when d is odd (or above 512) or a slot lies outside its cache.
 *   qkv    [n, stride]              model dtype (bf16 != 0: bfloat16, else float32), rows contiguous:
 *                                   heads queries, kv_heads keys, kv_heads values of d values each
 *   cos,sin [n, d]                  model dtype, contiguous (each token's rotation)
 *   q_out  [n, heads, d]            float32
 *   kv     [n, 4]                   where token i's sequence keeps its KV cache (as in tree_attention.c:
 *                                   keys and values addresses at layer 0, elements between layers,
 *                                   slots per KV head); float32, or bfloat16 when kv_bf16
 *   layer  the layer written
 *   dest   [n]                      token i's key and value go to slot dest[i] of its cache */
int rope_write(const void *qkv, int64_t n, int64_t stride, int64_t heads, int64_t kv_heads, int64_t d,
               const void *cos, const void *sin, int bf16, float *q_out, const int64_t *kv, int64_t layer,
               const int64_t *dest, int kv_bf16) {
    if (d % 2 || d > 512 || stride < (heads + 2 * kv_heads) * d)
        return -1;
    for (int64_t i = 0; i < n; i++)
        if (dest[i] < 0 || dest[i] >= kv[i * 4 + 3])
            return -1;
    for (int64_t i = 0; i < n; i++) {
        int64_t row = i * stride, c = i * d, cap = kv[i * 4 + 3], size = kv_bf16 ? 2 : 4;
        char *k = (char *)(intptr_t)kv[i * 4] + layer * kv[i * 4 + 2] * size;
        char *v = (char *)(intptr_t)kv[i * 4 + 1] + layer * kv[i * 4 + 2] * size;
        float head[512];
        for (int64_t h = 0; h < heads; h++)
            rotate_head(qkv, row + h * d, cos, sin, c, d, bf16, q_out + (i * heads + h) * d);
        for (int64_t g = 0; g < kv_heads; g++) {
            int64_t slot = (g * cap + dest[i]) * d * size;
            rotate_head(qkv, row + (heads + g) * d, cos, sin, c, d, bf16, head);
            store(k + slot, head, d, kv_bf16);
            for (int64_t j = 0; j < d; j++)
                head[j] = load(qkv, row + (heads + kv_heads + g) * d + j, bf16);
            store(v + slot, head, d, kv_bf16);
        }
    }
    return 0;
}
