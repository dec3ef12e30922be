// Scalar reference kernels: the obviously correct definitions every optimized path
// is tested against (ruy reference_mul.h).  No blocking, no packing, no threads.
#ifndef QDSL_REF_REF_H_
#define QDSL_REF_REF_H_

#include <cstdint>

#include "qdsl/gemm.h"

namespace qdsl {
namespace ref {

// acc[m][n] = bias[n] + sum_k (A[m][k] - a_zp) * (W[n][k] - w_zp[n]), wrapping int32.
void Gemm(const ActView& a, const PackedWeights& w, const int32_t* bias, int32_t* acc, int64_t ldc);
// acc[m][n] = bias[n] + K - 2 * popcount(a[m] XOR w[n]).
void BinaryGemm(const uint64_t* a, int64_t m, int64_t lda, const PackedWeights& w, const int32_t* bias,
                int32_t* acc, int64_t ldc);
// ApplyStage(acc, stage, 0), out of line so AVX2 files can call it without compiling it.
int32_t StageOne(int64_t acc, const OutputStage& stage);
// RescaleOne(x, r.kind, r.multiplier[0], r.shift[0], r.rounding), out of line.
int64_t RescaleOneOutOfLine(int64_t x, const Rescale& r);
void Requant(const int32_t* acc, int64_t rows, int64_t cols, int64_t lda, const OutputStage& stage, int64_t c0,
             void* out, int64_t ldo, bool out_signed);

}  // namespace ref
}  // namespace qdsl

#endif  // QDSL_REF_REF_H_
