// The 6 x 16 vpdpbusd micro-kernels' body, compiled twice: VEX-encoded (AVX-VNNI,
// gemm_u8s8_6x16_avxvnni.cc) and EVEX-encoded on ymm registers (AVX512-VNNI + AVX512VL,
// gemm_u8s8_6x16_vnni_avx512.cc: CPUs such as Zen 4 have the EVEX form but not the VEX one).
// The including file sets the target pragma and defines QDSL_DPBUSD (the intrinsic) and
// QDSL_VNNI_U8S8 / QDSL_VNNI_S8U8 (the entry points' names).  See the AVX-VNNI file for
// the layouts and the zero-point arithmetic.  No STL (see the AVX2 file).
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "kernels/x86/x86_kernels.h"

namespace qdsl {
namespace x86 {
namespace {

template <int MR, bool kBroadcastUnsigned>
void Kernel(const uint8_t* a, int64_t lda, const uint8_t* panel, int64_t kquads, int32_t* c, int64_t ldc,
            bool accumulate, const int32_t* init = nullptr) {
  __m256i acc[MR][2];
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    if (accumulate) {
      acc[r][0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + r * ldc));
      acc[r][1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + r * ldc + 8));
    } else if (init != nullptr) {  // every row starts from the same 16 values
      acc[r][0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(init));
      acc[r][1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(init + 8));
    } else {
      acc[r][0] = _mm256_setzero_si256();
      acc[r][1] = _mm256_setzero_si256();
    }
  }
  int64_t q = 0;
  if (MR <= 2) {
    // Few rows: vpdpbusd accumulates in place (latency ~5 cycles), so two accumulators per
    // row would serialize; odd k-quads go to a second set, summed at the end.
    __m256i odd[MR][2];
#pragma GCC unroll 2
    for (int r = 0; r < MR; ++r) odd[r][0] = odd[r][1] = _mm256_setzero_si256();
    for (; q + 2 <= kquads; q += 2) {
      const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + q * 64));
      const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + q * 64 + 32));
      const __m256i c0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + q * 64 + 64));
      const __m256i c1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + q * 64 + 96));
#pragma GCC unroll 2
      for (int r = 0; r < MR; ++r) {
        int32_t quad0, quad1;
        std::memcpy(&quad0, a + r * lda + 4 * q, 4);
        std::memcpy(&quad1, a + r * lda + 4 * q + 4, 4);
        const __m256i a0 = _mm256_set1_epi32(quad0), a1 = _mm256_set1_epi32(quad1);
        if (kBroadcastUnsigned) {
          acc[r][0] = QDSL_DPBUSD(acc[r][0], a0, b0);
          acc[r][1] = QDSL_DPBUSD(acc[r][1], a0, b1);
          odd[r][0] = QDSL_DPBUSD(odd[r][0], a1, c0);
          odd[r][1] = QDSL_DPBUSD(odd[r][1], a1, c1);
        } else {
          acc[r][0] = QDSL_DPBUSD(acc[r][0], b0, a0);
          acc[r][1] = QDSL_DPBUSD(acc[r][1], b1, a0);
          odd[r][0] = QDSL_DPBUSD(odd[r][0], c0, a1);
          odd[r][1] = QDSL_DPBUSD(odd[r][1], c1, a1);
        }
      }
    }
#pragma GCC unroll 2
    for (int r = 0; r < MR; ++r) {
      acc[r][0] = _mm256_add_epi32(acc[r][0], odd[r][0]);
      acc[r][1] = _mm256_add_epi32(acc[r][1], odd[r][1]);
    }
  }
  for (; q < kquads; ++q) {
    const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + q * 64));
    const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + q * 64 + 32));
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      int32_t quad;
      std::memcpy(&quad, a + r * lda + 4 * q, 4);
      const __m256i av = _mm256_set1_epi32(quad);
      if (kBroadcastUnsigned) {  // broadcast u8 activations, s8 weight panel
        acc[r][0] = QDSL_DPBUSD(acc[r][0], av, b0);
        acc[r][1] = QDSL_DPBUSD(acc[r][1], av, b1);
      } else {  // broadcast s8 weights, u8 activation panel
        acc[r][0] = QDSL_DPBUSD(acc[r][0], b0, av);
        acc[r][1] = QDSL_DPBUSD(acc[r][1], b1, av);
      }
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + r * ldc), acc[r][0]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + r * ldc + 8), acc[r][1]);
  }
}

template <bool U>
void Dispatch(int rows, const uint8_t* a, int64_t lda, const uint8_t* panel, int64_t kquads, int32_t* c, int64_t ldc,
              bool accumulate, const int32_t* init = nullptr) {
  switch (rows) {
    case 1: return Kernel<1, U>(a, lda, panel, kquads, c, ldc, accumulate, init);
    case 2: return Kernel<2, U>(a, lda, panel, kquads, c, ldc, accumulate, init);
    case 3: return Kernel<3, U>(a, lda, panel, kquads, c, ldc, accumulate, init);
    case 4: return Kernel<4, U>(a, lda, panel, kquads, c, ldc, accumulate, init);
    case 5: return Kernel<5, U>(a, lda, panel, kquads, c, ldc, accumulate, init);
    default: return Kernel<6, U>(a, lda, panel, kquads, c, ldc, accumulate, init);
  }
}

}  // namespace

void QDSL_VNNI_U8S8(int rows, const uint8_t* a, int64_t lda, const uint8_t* panel, int64_t kquads, int32_t* c,
                     int64_t ldc, bool accumulate) {
  Dispatch<true>(rows, a, lda, panel, kquads, c, ldc, accumulate);
}

#ifdef QDSL_VNNI_U8S8_INIT
void QDSL_VNNI_U8S8_INIT(int rows, const uint8_t* a, int64_t lda, const uint8_t* panel, int64_t kquads, int32_t* c,
                          int64_t ldc, bool accumulate, const int32_t* init) {
  Dispatch<true>(rows, a, lda, panel, kquads, c, ldc, accumulate, init);
}
#endif

void QDSL_VNNI_S8U8(int rows, const uint8_t* w, int64_t ldw, const uint8_t* panel, int64_t kquads, int32_t* c,
                     int64_t ldc, bool accumulate) {
  Dispatch<false>(rows, w, ldw, panel, kquads, c, ldc, accumulate);
}

}  // namespace x86
}  // namespace qdsl
