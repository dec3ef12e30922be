/* The C ABI of the one-pass fake quantization (csrc/kernels/fake_quant.h gives the formula
 * and the layout), loaded with ctypes by qdsl/quantizers/native_fq.py.  Return 0 on success,
 * else a qdsl::StatusCode (bad shape, or a forced path that cannot run here); nothing is
 * written then.  path: as in c_api.h (0 = the enabled default). */
#ifndef QDSL_BINDINGS_C_API_FQ_H_
#define QDSL_BINDINGS_C_API_FQ_H_

#include <stdint.h>

#include "bindings/c_api.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One scale, one pair of bounds over n values: ctypes passes the four floats by value. */
QDSL_API int qdsl_fake_quant_f32(const float* x, float* y, int64_t n, float s, float inv, float lo, float hi,
                                 uint32_t path);
/* Per channel: s, inv [channels]; lo, hi [channels] or null (then lo0, hi0). */
QDSL_API int qdsl_fake_quant_f32_channels(const float* x, float* y, int64_t outer, int64_t channels, int64_t inner,
                                          const float* s, const float* inv, const float* lo, const float* hi,
                                          float lo0, float hi0, uint32_t path);
/* A minifloat grid with one scale (kernels/fake_quant.h MinifloatParams). */
QDSL_API int qdsl_fake_quant_minifloat_f32(const float* x, float* y, int64_t n, float s, float top, int32_t emin,
                                           int32_t mantissa, uint32_t nan_bits, uint32_t path);
/* out[0] = min, out[1] = max of n >= 1 values (both NaN when one is NaN). */
QDSL_API int qdsl_minmax_f32(const float* x, int64_t n, float* out, uint32_t path);

#ifdef __cplusplus
}
#endif

#endif /* QDSL_BINDINGS_C_API_FQ_H_ */
