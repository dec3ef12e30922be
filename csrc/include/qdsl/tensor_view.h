// Non-owning views of the integer matrices the kernels read and write.
//
// Kernels take row-major matrices with an explicit leading dimension (stride of a
// row, in elements), so callers can pass sub-matrices without copies.
#ifndef QDSL_TENSOR_VIEW_H_
#define QDSL_TENSOR_VIEW_H_

#include <cstdint>

namespace qdsl {

enum class DType : int32_t {
  kInt8 = 0,
  kUInt8 = 1,
  kInt32 = 2,
  kFloat32 = 3,
};

inline int DTypeSize(DType t) { return (t == DType::kInt32 || t == DType::kFloat32) ? 4 : 1; }

// Activations of a GEMM: M rows of K int8 or uint8 values, zero point `zero_point`.
struct ActView {
  const void* data = nullptr;
  DType dtype = DType::kUInt8;  // kInt8 or kUInt8
  int64_t rows = 0, cols = 0, ld = 0;
  int32_t zero_point = 0;
  // An upper bound of every activation code as the u8 kernels see it (uint8: the value,
  // int8: the value + 128), e.g. 127 for 7-bit or 15 for 4-bit unsigned activations.
  // Below 255 it lets AVX2 run the exact vpmaddubsw kernel for wider weights (MaddubsStepsFor);
  // Gemm checks the bound when it relies on it and rejects activations above it.
  int32_t max_code = 255;
  int32_t At(int64_t r, int64_t c) const {
    const int64_t i = r * ld + c;
    return dtype == DType::kInt8 ? static_cast<const int8_t*>(data)[i]
                                 : static_cast<const uint8_t*>(data)[i];
  }
};

}  // namespace qdsl

#endif  // QDSL_TENSOR_VIEW_H_
