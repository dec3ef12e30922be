// What the two implicit-GEMM conv micro-kernels (igemm_u8s8_6x16_avx2.cc and
// igemm_i16_6x16_avx2.cc: dispatch.h IgemmKernel) share around their inner loops: the store of
// up to 6 rows x 16 int32 sums and the type of a per-row-count kernel.  Included only by AVX2
// translation units (the pragma'd kernel files), whose kernels live in anonymous namespaces,
// so no inline code is shared between files.
#ifndef QDSL_KERNELS_X86_IGEMM_6X16_AVX2_H_
#define QDSL_KERNELS_X86_IGEMM_6X16_AVX2_H_

#include <immintrin.h>

#include <cstdint>

namespace qdsl {
namespace x86 {

// rows r < MR of acc into c[r * ldc + 0..16)
template <int MR>
__attribute__((always_inline)) inline void StoreIgemmRows(const __m256i (*acc)[2], int32_t* c, int64_t ldc) {
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + r * ldc), acc[r][0]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + r * ldc + 8), acc[r][1]);
  }
}

// Kernel<MR> for one row count MR (1..6); the kernel entry points pick from a table of these
// (an indirect call per 6 x 16 strip).
using IgemmRowsFn = void (*)(const uint8_t* const* ind, int64_t taps, int64_t cquads, const uint8_t* panel,
                             int32_t* c, int64_t ldc, const int32_t* init);

}  // namespace x86
}  // namespace qdsl

#endif  // QDSL_KERNELS_X86_IGEMM_6X16_AVX2_H_
