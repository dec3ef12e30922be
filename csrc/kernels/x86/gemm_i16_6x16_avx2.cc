// AVX2 int GEMM micro-kernels: 6 rows x 16 columns, int16 x int16 -> int32 via vpmaddwd.
//
// Why vpmaddwd on int16 instead of the usual u8 x s8 vpmaddubsw:
//   vpmaddubsw adds two u8*s8 products into a SATURATING int16; 255*127 + 255*127 =
//   64770 > 32767 (and 255*-128*2 = -65280 < -32768), so it silently clips real int8
//   data.  Restricting weights to [-127, 127] does not help; splitting u8 into 7-bit
//   halves doubles the multiplies.  vpmaddwd multiplies int16 pairs and adds them into
//   an int32: with operands (A - a_zp) in [-255, 255] and (W - w_zp) in [-383, 382]
//   every product and pair sum is exact, zero points of both sides are subtracted
//   before the multiply (no column-sum correction), and the only remaining rounding
//   is int32 wrap-around, which the reference reproduces.  Throughput: the maddubsw
//   path needs vpmaddubsw + vpmaddwd(ones) for 32 MACs, i.e. 16 MACs per multiply uop,
//   exactly what one vpmaddwd gives, so on CPUs with two vector multiply ports the
//   exact path has the same multiply-port peak (it issues one add per 16 MACs instead
//   of one per 32).
//
// Weights arrive in 16-column panels (csrc/pack/pack_weights.cc): int16, or int4/int2
// fields that are sign-extended with vpmovsxbw and split with arithmetic shifts in
// registers (3 shifts per k-pair for int4, 7 per two k-pairs for int2).
//
// This file is compiled for AVX2 with a pragma and uses no STL, so no COMDAT
// (inline/template) function compiled here can leak AVX2 code into portable callers.
#pragma GCC target("avx2,fma,popcnt")
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "kernels/x86/x86_kernels.h"

namespace qdsl {
namespace x86 {
namespace {

template <int MR>
struct Acc {
  __m256i v[MR][2];
};

template <int MR>
__attribute__((always_inline)) inline void Step(Acc<MR>& acc, const int16_t* a, int64_t lda, int64_t k,
                                                __m256i b0, __m256i b1) {
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    int32_t pair;
    std::memcpy(&pair, a + r * lda + k, 4);
    const __m256i av = _mm256_set1_epi32(pair);
    acc.v[r][0] = _mm256_add_epi32(acc.v[r][0], _mm256_madd_epi16(av, b0));
    acc.v[r][1] = _mm256_add_epi32(acc.v[r][1], _mm256_madd_epi16(av, b1));
  }
}

template <int F, int MR>
void Kernel(const int16_t* a, int64_t lda, const uint8_t* panel, int64_t kpairs, int32_t* c, int64_t ldc,
            bool accumulate) {
  Acc<MR> acc;
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    if (accumulate) {
      acc.v[r][0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + r * ldc));
      acc.v[r][1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + r * ldc + 8));
    } else {
      acc.v[r][0] = _mm256_setzero_si256();
      acc.v[r][1] = _mm256_setzero_si256();
    }
  }
  if (F == 0) {  // kI16
    for (int64_t j = 0; j < kpairs; ++j) {
      const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + j * 64));
      const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + j * 64 + 32));
      Step<MR>(acc, a, lda, 2 * j, b0, b1);
    }
  } else if (F == 1) {  // kI4
    for (int64_t j = 0; j < kpairs; ++j) {
      const __m256i x = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + j * 16)));
      const __m256i b0 = _mm256_srai_epi16(_mm256_slli_epi16(x, 12), 12);
      const __m256i b1 = _mm256_srai_epi16(x, 4);
      Step<MR>(acc, a, lda, 2 * j, b0, b1);
    }
  } else {  // kI2: kpairs is even
    for (int64_t j = 0; j < kpairs; j += 2) {
      const __m256i x = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + j * 8)));
      Step<MR>(acc, a, lda, 2 * j, _mm256_srai_epi16(_mm256_slli_epi16(x, 14), 14),
               _mm256_srai_epi16(_mm256_slli_epi16(x, 12), 14));
      Step<MR>(acc, a, lda, 2 * j + 2, _mm256_srai_epi16(_mm256_slli_epi16(x, 10), 14), _mm256_srai_epi16(x, 6));
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + r * ldc), acc.v[r][0]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + r * ldc + 8), acc.v[r][1]);
  }
}

template <int F>
void Dispatch(int rows, const int16_t* a, int64_t lda, const uint8_t* panel, int64_t kpairs, int32_t* c,
              int64_t ldc, bool accumulate) {
  switch (rows) {
    case 1: return Kernel<F, 1>(a, lda, panel, kpairs, c, ldc, accumulate);
    case 2: return Kernel<F, 2>(a, lda, panel, kpairs, c, ldc, accumulate);
    case 3: return Kernel<F, 3>(a, lda, panel, kpairs, c, ldc, accumulate);
    case 4: return Kernel<F, 4>(a, lda, panel, kpairs, c, ldc, accumulate);
    case 5: return Kernel<F, 5>(a, lda, panel, kpairs, c, ldc, accumulate);
    default: return Kernel<F, 6>(a, lda, panel, kpairs, c, ldc, accumulate);
  }
}

}  // namespace

void GemmI16Avx2(int rows, const int16_t* a, int64_t lda, const uint8_t* panel, int64_t kpairs, int32_t* c,
                 int64_t ldc, bool accumulate) {
  Dispatch<0>(rows, a, lda, panel, kpairs, c, ldc, accumulate);
}
void GemmI4Avx2(int rows, const int16_t* a, int64_t lda, const uint8_t* panel, int64_t kpairs, int32_t* c,
                int64_t ldc, bool accumulate) {
  Dispatch<1>(rows, a, lda, panel, kpairs, c, ldc, accumulate);
}
void GemmI2Avx2(int rows, const int16_t* a, int64_t lda, const uint8_t* panel, int64_t kpairs, int32_t* c,
                int64_t ldc, bool accumulate) {
  Dispatch<2>(rows, a, lda, panel, kpairs, c, ldc, accumulate);
}

}  // namespace x86
}  // namespace qdsl
