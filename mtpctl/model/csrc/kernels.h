/* Every entry point of the native kernels' library, declared once. Each source includes this header,
 * so the compiler holds each definition to its declaration here, and mtpctl/model/native.py binds the
 * library from the declarations between the two marker comments below (the ctypes result and argument
 * types of each function): Python calls what the C side defines, by construction. Each function is
 * documented beside its definition.
 *
 * Between the markers the bindings' parser takes blank lines and declarations
 *     int NAME(TYPE NAME, TYPE NAME, ...);        or        int NAME(void);
 * only, each of which may wrap over several lines; a TYPE is int, int64_t or float, or a pointer
 * (const or not) to void, float, uint8_t, uint16_t or int64_t. It refuses anything else. */
#ifndef MTPCTL_KERNELS_H
#define MTPCTL_KERNELS_H
#include <stdint.h>

/* entry points: begin */
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

int q4_matmul_best(const uint16_t *x, int64_t M, int64_t K, const uint8_t *blob, int64_t N, void *y, int bf16_out,
                   int threads, int64_t *best);
int q8_matmul_best(const uint16_t *x, int64_t M, int64_t K, const uint8_t *blob, int64_t N, void *y, int bf16_out,
                   int threads, int64_t *best);
int bf_matmul_best(const uint16_t *x, int64_t M, int64_t K, const uint8_t *blob, int64_t N, void *y, int bf16_out,
                   int threads, int64_t *best);

int matmul_isa(void);

int layer_stack(uint16_t *x, int64_t n, const int64_t *weights, const int64_t *shape, float eps, float scale,
                const uint16_t *final_norm, const uint16_t *cos, const uint16_t *sin, const int64_t *kv,
                const int64_t *dest, int kv_bf16, const int64_t *starts, const int64_t *ends, const int64_t *paths,
                int64_t path_len, uint16_t *out, int threads);
/* entry points: end */
#endif
