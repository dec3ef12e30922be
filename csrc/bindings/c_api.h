/* The qdsl C ABI: plain pointers, shapes, strides and int status codes.
 *
 * Every function returning int returns 0 on success or a qdsl::StatusCode, and then
 * writes a NUL-terminated message into err[0..errlen).  No function aborts or throws
 * across this boundary.  Loaded from Python with ctypes (qdsl/runtime/_native.py).
 * dtype codes: 0 int8, 1 uint8, 2 int32, 3 float32.  path: 0 = enabled default,
 * else a mask of 1 ref, 2 portable, 4 avx2. */
#ifndef QDSL_BINDINGS_C_API_H_
#define QDSL_BINDINGS_C_API_H_

#include <stdint.h>

#if defined(_WIN32)
#define QDSL_API __declspec(dllexport)
#else
#define QDSL_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

QDSL_API int qdsl_abi_version(void);
QDSL_API uint32_t qdsl_paths(int which); /* 0 compiled, 1 cpu, 2 enabled; 3: 1 when the AVX2 path runs EVEX VNNI (EvexVnniUsable) */
QDSL_API void qdsl_set_enabled_paths(uint32_t mask);
QDSL_API void qdsl_set_num_threads(int n);
QDSL_API int qdsl_get_num_threads(void);

QDSL_API int qdsl_pack_weights(const int8_t* w, int64_t n, int64_t k, int bits, const int32_t* zero_point,
                               void** handle, char* err, int64_t errlen);
QDSL_API void qdsl_free_weights(void* handle);
QDSL_API int64_t qdsl_weights_bytes(const void* handle);
QDSL_API int qdsl_bitpack(const int8_t* a, int64_t m, int64_t k, uint64_t* out, int64_t kwords, char* err,
                          int64_t errlen);
/* mult/shift null => int32 output (out_dtype 2).  a_max: ActView::max_code (255: none). */
QDSL_API int qdsl_gemm(const void* a, int a_dtype, int64_t m, int64_t k, int64_t lda, int32_t a_zp, int32_t a_max,
                       const void* weights, const int32_t* bias, void* out, int out_dtype, int64_t ldo,
                       const int32_t* mult, const int32_t* shift, int64_t channels, int kind, int rounding, int32_t out_zp, int32_t qmin,
                       int32_t qmax, uint32_t path, char* err, int64_t errlen);
// Fast call for the common case (int32 output, no bias or stage, dense rows): the status
// only; callers repeat a failed call through qdsl_gemm for the message.  Eight arguments
// instead of twenty-three: ctypes converts each one on every call (~0.1 us apiece).
QDSL_API int qdsl_gemm_i32(const void* a, int a_dtype, int64_t m, int64_t k, int32_t a_zp, const void* weights,
                           void* out, uint32_t path);
QDSL_API int qdsl_binary_gemm(const uint64_t* a, int64_t m, int64_t lda, const void* weights, const int32_t* bias,
                              void* out, int out_dtype, int64_t ldo, const int32_t* mult, const int32_t* shift,
                              int64_t channels, int kind, int rounding, int32_t out_zp, int32_t qmin, int32_t qmax, uint32_t path, char* err,
                              int64_t errlen);
QDSL_API int qdsl_requantize(const int32_t* acc, int64_t rows, int64_t channels, const int32_t* mult,
                             const int32_t* shift, int64_t stage_channels, int kind, int rounding, int32_t out_zp, int32_t qmin, int32_t qmax,
                             void* out, int out_dtype, uint32_t path, char* err, int64_t errlen);

#ifdef __cplusplus
}
#endif

#endif /* QDSL_BINDINGS_C_API_H_ */

/* ---- graphs ---- */
#ifdef __cplusplus
extern "C" {
#endif
QDSL_API int qdsl_graph_load(const void* data, int64_t size, void** handle, char* err, int64_t errlen);
QDSL_API void qdsl_graph_free(void* handle);
/* which 0 = inputs, 1 = outputs, 2 = ops: returns the count (index < 0) or fills info for
 * one entry: info[0] dtype (ops: opcode), info[1] rank, info[2..10) dims; name into buf.
 * Ops (rank 0) also get what the validator proved and chose: info[2], info[3] the first
 * input's value range, info[4] the AVX2 vpmaddubsw steps of an int conv/linear (-1: not
 * one; 0: the int16 kernel), info[5] 1 when no accumulator can overflow (fast_acc), 0 when
 * one can, -1 for other ops (binary ones included); info[8] for a LINEAR 1 when it runs as
 * one GEMM with the bias and output stage fused (off the reference path), else 0; -1 for
 * other ops; info[10] the images per pass the op ran with in the last run (a segment,
 * runtime/segment.cc), 0 for the whole batch at once; info[11] row bands in the last run
 * (conv::RowBandFused): 1 on a depthwise conv that computed its 1x1 producer's output rows,
 * 2 on that producer, else 0.  info holds 12 entries. */
QDSL_API int64_t qdsl_graph_entry(void* handle, int which, int64_t index, int64_t* info, char* name, int64_t namelen);
QDSL_API int qdsl_graph_run(void* handle, int64_t batch, const void* const* inputs, void* const* outputs, uint32_t path,
                            char* err, int64_t errlen);
QDSL_API void qdsl_graph_overflow(void* handle, int64_t* counts, int64_t n);
#ifdef __cplusplus
}
#endif
