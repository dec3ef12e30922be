// Portable (plain C++) optimized kernels, same signatures as csrc/kernels/x86.
#ifndef QDSL_KERNELS_PORTABLE_PORTABLE_KERNELS_H_
#define QDSL_KERNELS_PORTABLE_PORTABLE_KERNELS_H_

#include <cstdint>

#include "qdsl/gemm.h"

namespace qdsl {
namespace portable {

void GemmI16(int rows, const int16_t* a, int64_t lda, const uint8_t* panel, int64_t kpairs, int32_t* c, int64_t ldc,
             bool accumulate);
void GemmI4(int rows, const int16_t* a, int64_t lda, const uint8_t* panel, int64_t kpairs, int32_t* c, int64_t ldc,
            bool accumulate);
void GemmI2(int rows, const int16_t* a, int64_t lda, const uint8_t* panel, int64_t kpairs, int32_t* c, int64_t ldc,
            bool accumulate);
void BinaryPopcount(const uint64_t* a, int64_t m, int64_t lda, const uint64_t* w, int64_t n, int64_t ldw,
                    int64_t kwords, int32_t* pc, int64_t ldc);
// The portable output stage is the scalar reference (it is already branch-light).
void Requant(const int32_t* acc, int64_t rows, int64_t cols, int64_t lda, const OutputStage& stage, int64_t c0,
             void* out, int64_t ldo, bool out_signed);

// Depthwise conv of one plane (DwConvKernel in dispatch.h): any stride and dilation.
void DwConv(const int16_t* plane, int64_t ldp, const DwConvShape& s, const int32_t* taps, const int32_t* pairs,
            int32_t init, int32_t* acc, int64_t lda);
// Depthwise conv in NHWC (DwNhwcKernel in dispatch.h): tap-major loops over the channels.
void DwConvNhwc(const uint8_t* const* ptrs, int64_t n, int64_t ntaps, int64_t C, bool x_signed, const int32_t* taps,
                const int32_t* pairs, const int32_t* init, int32_t* acc, int64_t ldc);

// LAYERNORM's row passes (LayernormKernels in dispatch.h).
void LayernormSum(const int32_t* t0, const int32_t* t1, int64_t n, int32_t* v, int64_t* sum, int32_t* lo,
                  int32_t* hi);
int64_t LayernormCenter(const int32_t* v, int64_t n, int64_t sum, int k, int32_t* d);
void LayernormNormalize(const int32_t* d, int64_t n, int s, int64_t r, const int32_t* gamma, const int32_t* beta,
                        int32_t* acc);

}  // namespace portable
}  // namespace qdsl

#endif  // QDSL_KERNELS_PORTABLE_PORTABLE_KERNELS_H_
