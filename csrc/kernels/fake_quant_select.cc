// SelectFakeQuantF32Kernel / SelectMinMaxF32Kernel (csrc/kernels/fake_quant.h).  Kept beside
// the kernels rather than in dispatch.cc: the fake-quant kernels serve the Python quantizers,
// not the graph executor.
#include "kernels/fake_quant.h"

#include "qdsl/gemm.h"

namespace qdsl {

FakeQuantF32Kernel SelectFakeQuantF32Kernel(uint32_t path) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (path >= kPathAvx2) return x86::FakeQuantF32Avx2;  // every path from AVX2 up has AVX2
#endif
  (void)path;
  return portable::FakeQuantF32;
}

MinMaxF32Kernel SelectMinMaxF32Kernel(uint32_t path) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (path >= kPathAvx2) return x86::MinMaxF32Avx2;
#endif
  (void)path;
  return portable::MinMaxF32;
}

FakeQuantMinifloatKernel SelectFakeQuantMinifloatKernel(uint32_t path) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (path >= kPathAvx2) return x86::FakeQuantMinifloatAvx2;
#endif
  (void)path;
  return portable::FakeQuantMinifloat;
}

}  // namespace qdsl
