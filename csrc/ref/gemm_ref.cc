// Reference int GEMM, binary GEMM and output stage: straight loops over the raw
// (unpacked) weights.  Accumulation is done in uint32 so int32 overflow wraps (two's
// complement) instead of being undefined behaviour, matching vpaddd.
#include <cstdint>

#include "ref/ref.h"

namespace qdsl {
namespace ref {

void Gemm(const ActView& a, const PackedWeights& w, const int32_t* bias, int32_t* acc, int64_t ldc) {
  for (int64_t m = 0; m < a.rows; ++m) {
    for (int64_t n = 0; n < w.n; ++n) {
      uint32_t sum = bias ? static_cast<uint32_t>(bias[n]) : 0u;
      for (int64_t k = 0; k < w.k; ++k) {
        const int32_t x = a.At(m, k) - a.zero_point;
        const int32_t y = w.raw[n * w.k + k];
        sum += static_cast<uint32_t>(x * y);  // |x*y| <= 255*512, never overflows
      }
      acc[m * ldc + n] = static_cast<int32_t>(sum);
    }
  }
}

void BinaryGemm(const uint64_t* a, int64_t m, int64_t lda, const PackedWeights& w, const int32_t* bias,
                int32_t* acc, int64_t ldc) {
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t n = 0; n < w.n; ++n) {
      int64_t pc = 0;
      for (int64_t j = 0; j < w.kwords; ++j) pc += __builtin_popcountll(a[i * lda + j] ^ w.bits_rows[n * w.kwords + j]);
      const int64_t dot = w.k - 2 * pc;  // matches: +1 agree, -1 disagree
      acc[i * ldc + n] = static_cast<int32_t>(static_cast<uint32_t>(dot) + (bias ? static_cast<uint32_t>(bias[n]) : 0u));
    }
  }
}

int32_t StageOne(int64_t acc, const OutputStage& stage) { return ApplyStage(acc, stage, 0); }

int64_t RescaleOneOutOfLine(int64_t x, const Rescale& r) {
  return RescaleOne(x, r.kind, r.multiplier[0], r.shift[0], r.rounding);
}

void Requant(const int32_t* acc, int64_t rows, int64_t cols, int64_t lda, const OutputStage& stage, int64_t c0,
             void* out, int64_t ldo, bool out_signed) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const int32_t v = ApplyStage(acc[r * lda + c], stage, c0 + c);
      if (out_signed) {
        static_cast<int8_t*>(out)[r * ldo + c] = static_cast<int8_t>(v);
      } else {
        static_cast<uint8_t*>(out)[r * ldo + c] = static_cast<uint8_t>(v);
      }
    }
  }
}

}  // namespace ref
}  // namespace qdsl
