// AVX512-VNNI form of the implicit-GEMM conv micro-kernels (dispatch.h IgemmKernel and
// IgemmStageKernel): the same contract, panels, row pointers and register stage as
// igemm_u8s8_6x16_avx2.cc, with each k-quad's vpmaddubsw + vpmaddwd(ones) + vpaddd replaced
// by one vpdpbusd on 256-bit registers (EVEX: AVX512_VNNI + AVX512VL, e.g. Zen 4, which has
// no VEX AVX-VNNI, so kPathAvxVnni / kPathAvx512 stay off there and the AVX2 path runs).
//
// vpdpbusd adds the four u8 x s8 products of a channel's quad to its int32 lane with no
// intermediate saturation (the non-"s" form wraps only the int32 sum), so its sums are the
// exact sums mod 2^32; the AVX2 sequence gives the same where it is exact (one int16 pair
// sum: MaddubsStepsFor >= 1, which the driver requires before choosing either kernel).  The
// results are therefore bit-identical, and the multiply uops per quad and row halve (2
// instead of 4 for 16 channels).  Selected by SelectIgemmKernel / SelectIgemmStageKernel
// on the AVX2 path when the CPU has AVX512_VNNI and AVX512VL (QDSL_IGEMM_VNNI=0: off).
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")
#include <immintrin.h>

#include <cstdint>

namespace qdsl {
namespace x86 {
namespace {

// The sums of MR rows (registers once inlined): acc[r][0] channels 0..7, acc[r][1] 8..15.
template <int MR>
__attribute__((always_inline)) inline void Accumulate(const uint8_t* const* rows, int64_t taps, int64_t cquads,
                                                      const uint8_t* panel, const int32_t* c, int64_t ldc,
                                                      const int32_t* init, __m256i (&acc)[MR][2]) {
  for (int r = 0; r < MR; ++r) {
    const int32_t* from = init != nullptr ? init : c + r * ldc;
    acc[r][0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from));
    acc[r][1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + 8));
  }
  for (int64_t t = 0; t < taps; ++t) {
    const uint8_t* p[MR];
    for (int r = 0; r < MR; ++r) p[r] = rows[r * taps + t];
    const uint8_t* pt = panel + t * cquads * 64;
    for (int64_t j = 0; j < cquads; ++j) {
      const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pt + j * 64));
      const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pt + j * 64 + 32));
#pragma GCC unroll 6
      for (int r = 0; r < MR; ++r) {
        int32_t q;
        __builtin_memcpy(&q, p[r] + 4 * j, 4);
        const __m256i a = _mm256_set1_epi32(q);
        acc[r][0] = _mm256_dpbusd_epi32(acc[r][0], a, b0);
        acc[r][1] = _mm256_dpbusd_epi32(acc[r][1], a, b1);
      }
    }
  }
}

}  // namespace
}  // namespace x86
}  // namespace qdsl

// Kernel, KernelStage and the entry points around Accumulate: igemm_u8s8_6x16_drive.h.
#define QDSL_IGEMM_U8S8 IgemmU8S8Avx512Vnni
#define QDSL_IGEMM_U8S8_STAGE IgemmU8S8StageAvx512Vnni
#include "kernels/x86/igemm_u8s8_6x16_drive.h"
