/* The native kernels' entry points, for the sources that call one another (layer_stack.c). Each is
 * documented beside its definition. */
#ifndef MTPCTL_KERNELS_H
#define MTPCTL_KERNELS_H
#include <stdint.h>

int rms_norm(const void *x, const void *w, void *out, int64_t rows, int64_t dim, float eps, int bf16, int weight_f32);
int rope_write(const void *qkv, int64_t n, int64_t stride, int64_t heads, int64_t kv_heads, int64_t d,
               const void *cos, const void *sin, int bf16, float *q_out, const int64_t *kv, int64_t layer,
               const int64_t *dest, int kv_bf16);
int tree_attention(const float *q, const int64_t *kv, int64_t layer, const int64_t *starts, const int64_t *ends,
                   const int64_t *paths, int64_t path_len, int64_t n, int64_t heads, int64_t kv_heads, int64_t d,
                   float scale, float *out, int threads, int kv_bf16);
int q4_matmul(const uint16_t *x, int64_t M, int64_t K, const uint8_t *blob, int64_t N, void *y, int bf16_out,
              int threads);
int q8_matmul(const uint16_t *x, int64_t M, int64_t K, const uint8_t *blob, int64_t N, void *y, int bf16_out,
              int threads);
int bf_matmul(const uint16_t *x, int64_t M, int64_t K, const uint8_t *blob, int64_t N, void *y, int bf16_out,
              int threads);
#endif
