/* bfloat16 <-> float32 for the native kernels (included by the .c files beside it). */
#ifndef MTPCTL_BF16_H
#define MTPCTL_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* round to the nearest bfloat16 (ties to even), as torch's float -> bfloat16; NaN stays NaN */
static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* f rounded to the nearest bfloat16 value, as a float */
static inline float bf16_round(float f) {
    return bf16_to_float(float_to_bf16(f));
}
#endif
