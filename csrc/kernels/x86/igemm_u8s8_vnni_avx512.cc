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

#include "kernels/x86/igemm_6x16_avx2.h"
#include "kernels/x86/x86_kernels.h"
#include "requant/stage_f32_avx2.h"

namespace qdsl {
namespace x86 {
namespace {

// The sums of MR rows (registers once inlined): acc[r][0] channels 0..7, acc[r][1] 8..15.
template <int MR>
__attribute__((always_inline)) inline void AccumulateVnni(const uint8_t* const* rows, int64_t taps, int64_t cquads,
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

template <int MR>
void Kernel(const uint8_t* const* rows, int64_t taps, int64_t cquads, const uint8_t* panel, int32_t* c, int64_t ldc,
            const int32_t* init) {
  __m256i acc[MR][2];
  AccumulateVnni<MR>(rows, taps, cquads, panel, c, ldc, init, acc);
  StoreIgemmRows<MR>(acc, c, ldc);
}

// The register stage of igemm_u8s8_6x16_avx2.cc's KernelStage on these sums.
template <int MR, Rounding R>
void KernelStage(const uint8_t* const* rows, int64_t taps, int64_t cquads, const uint8_t* panel, const int32_t* init,
                 const StageF32& st, int64_t c0, int cols, uint8_t* out, int64_t ldo, bool out_signed) {
  __m256i acc[MR][2];
  AccumulateVnni<MR>(rows, taps, cquads, panel, nullptr, 0, init, acc);
  const StageF32Vec v(st);
#pragma GCC unroll 3
  for (int r = 0; r < MR; r += 2) {
    const int r1 = r + 1 < MR ? r + 1 : r;
    const __m256i codes = StageF32Codes32<R>(acc[r][0], acc[r][1], acc[r1][0], acc[r1][1], st, c0, c0, v, out_signed);
    if (cols == 16) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + r * ldo), _mm256_castsi256_si128(codes));
      if (r1 != r) _mm_storeu_si128(reinterpret_cast<__m128i*>(out + r1 * ldo), _mm256_extracti128_si256(codes, 1));
    } else {
      alignas(32) uint8_t buf[32];
      _mm256_store_si256(reinterpret_cast<__m256i*>(buf), codes);
      for (int i = 0; i < cols; ++i) out[r * ldo + i] = buf[i];
      if (r1 != r)
        for (int i = 0; i < cols; ++i) out[r1 * ldo + i] = buf[16 + i];
    }
  }
}

template <Rounding R>
void StageRows(int rows, const uint8_t* const* ind, int64_t taps, int64_t cquads, const uint8_t* panel,
               const int32_t* init, const StageF32& st, int64_t c0, int cols, uint8_t* out, int64_t ldo,
               bool out_signed) {
  switch (rows) {
    case 1: return KernelStage<1, R>(ind, taps, cquads, panel, init, st, c0, cols, out, ldo, out_signed);
    case 2: return KernelStage<2, R>(ind, taps, cquads, panel, init, st, c0, cols, out, ldo, out_signed);
    case 3: return KernelStage<3, R>(ind, taps, cquads, panel, init, st, c0, cols, out, ldo, out_signed);
    case 4: return KernelStage<4, R>(ind, taps, cquads, panel, init, st, c0, cols, out, ldo, out_signed);
    case 5: return KernelStage<5, R>(ind, taps, cquads, panel, init, st, c0, cols, out, ldo, out_signed);
    default: return KernelStage<6, R>(ind, taps, cquads, panel, init, st, c0, cols, out, ldo, out_signed);
  }
}

}  // namespace

void IgemmU8S8StageAvx512Vnni(int rows, const uint8_t* const* ind, int64_t taps, int64_t cquads, const uint8_t* panel,
                              const int32_t* init, const StageF32& st, int64_t c0, int cols, uint8_t* out,
                              int64_t ldo, bool out_signed) {
  switch (st.rounding) {
    case Rounding::kHalfEven: return StageRows<Rounding::kHalfEven>(rows, ind, taps, cquads, panel, init, st, c0, cols, out, ldo, out_signed);
    case Rounding::kFloor: return StageRows<Rounding::kFloor>(rows, ind, taps, cquads, panel, init, st, c0, cols, out, ldo, out_signed);
    case Rounding::kHalfUp: return StageRows<Rounding::kHalfUp>(rows, ind, taps, cquads, panel, init, st, c0, cols, out, ldo, out_signed);
    default: return StageRows<Rounding::kHalfAway>(rows, ind, taps, cquads, panel, init, st, c0, cols, out, ldo, out_signed);
  }
}

void IgemmU8S8Avx512Vnni(int rows, const uint8_t* const* ind, int64_t taps, int64_t cquads, const uint8_t* panel,
                         int32_t* c, int64_t ldc, const int32_t* init) {
  static constexpr IgemmRowsFn kRows[6] = {Kernel<1>, Kernel<2>, Kernel<3>, Kernel<4>, Kernel<5>, Kernel<6>};
  kRows[(rows < 6 ? rows : 6) - 1](ind, taps, cquads, panel, c, ldc, init);
}

}  // namespace x86
}  // namespace qdsl
