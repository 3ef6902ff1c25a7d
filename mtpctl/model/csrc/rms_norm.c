/* RMSNorm of decode and verify passes (Zhang & Sennrich 2019), one row at a time.
 *
 * Built into the same library as tree_attention.c by mtpctl/model/native_build.py. A row's result is a
 * deterministic function of that row alone (its sum of squares is taken in a fixed order: 16
 * partial sums over the row, then added in lane order; no -ffast-math), so a token normed inside a
 * verify pass gets bit for bit what it gets alone in plain decoding. One call replaces the six to
 * eight torch ops of mtpctl.model.decoder._rms_norm (~17 us a call on this project's CPU, ~3 us here).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

#define PARTS 16
#define MAX_DIM 16384

/* Returns 0, or -1 when dim is not a multiple of 16 or above MAX_DIM.
 *   x, out [rows, dim]  bfloat16 (bf16 != 0) or float32, contiguous
 *   w      [dim]        in x's dtype (weight_f32 == 0) or float32 (weight_f32 != 0)
 * weight_f32 == 0 (Llama): out = w * to_dtype(h * r), the product rounded to the dtype;
 * weight_f32 != 0 (Gemma's 1 + w): out = to_dtype(h * r * w);
 * where h is the row in float32 and r = 1 / sqrt(mean(h^2) + eps). */
int rms_norm(const void *x, const void *w, void *out, int64_t rows, int64_t dim, float eps, int bf16,
             int weight_f32) {
    if (dim <= 0 || dim % PARTS || dim > MAX_DIM)
        return -1;
    float h[MAX_DIM];
    for (int64_t r = 0; r < rows; r++) {
        if (bf16) {
            const uint16_t *xr = (const uint16_t *)x + r * dim;
            for (int64_t i = 0; i < dim; i++)
                h[i] = bf16_to_float(xr[i]);
        } else {
            memcpy(h, (const float *)x + r * dim, (size_t)dim * sizeof(float));
        }
        float acc[PARTS] = {0};
        for (int64_t i = 0; i < dim; i += PARTS)
            for (int j = 0; j < PARTS; j++)
                acc[j] += h[i + j] * h[i + j];
        float total = 0.f;
        for (int j = 0; j < PARTS; j++)
            total += acc[j];
        float inv = 1.0f / sqrtf(total / (float)dim + eps);
        if (weight_f32) {
            const float *wf = (const float *)w;
            if (bf16) {
                uint16_t *o = (uint16_t *)out + r * dim;
                for (int64_t i = 0; i < dim; i++)
                    o[i] = float_to_bf16(h[i] * inv * wf[i]);
            } else {
                float *o = (float *)out + r * dim;
                for (int64_t i = 0; i < dim; i++)
                    o[i] = h[i] * inv * wf[i];
            }
        } else if (bf16) {
            const uint16_t *wb = (const uint16_t *)w;
            uint16_t *o = (uint16_t *)out + r * dim;
            for (int64_t i = 0; i < dim; i++)
                o[i] = float_to_bf16(bf16_to_float(wb[i]) * bf16_to_float(float_to_bf16(h[i] * inv)));
        } else {
            const float *wf = (const float *)w;
            float *o = (float *)out + r * dim;
            for (int64_t i = 0; i < dim; i++)
                o[i] = wf[i] * (h[i] * inv);
        }
    }
    return 0;
}
