// AVX2 binary popcount kernel: pc[m][n] = popcount(a[m] XOR w[n]) over K bits,
// 2 rows x 4 weight rows per block, 256 bits per step.
//
// AVX2 has no vector popcount, so each byte is counted with two vpshufb lookups
// (low and high nibble, Mula's method).  Byte counters are at most 8 per step, so
// they are widened with vpsadbw every 31 steps (31 * 8 = 248 < 256) before they can
// wrap.  Words past the last full 256-bit step use scalar popcnt.  Padding bits are 0
// in both operands (csrc/pack), so they XOR to 0 and never count.
#pragma GCC target("avx2,fma,popcnt")
#include <immintrin.h>

#include <cstdint>

#include "kernels/x86/x86_kernels.h"

namespace qdsl {
namespace x86 {
namespace {

template <int MR, int NR>
void Block(const uint64_t* a, int64_t lda, const uint64_t* w, int64_t ldw, int64_t kwords, int32_t* pc,
           int64_t ldc) {
  const __m256i lut = _mm256_setr_epi8(0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4, 0, 1, 1, 2, 1, 2, 2, 3, 1, 2,
                                       2, 3, 2, 3, 3, 4);
  const __m256i low = _mm256_set1_epi8(0x0f);
  __m256i wide[MR][NR];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NR; ++c) wide[r][c] = _mm256_setzero_si256();
  const int64_t steps = kwords / 4;
  for (int64_t s0 = 0; s0 < steps; s0 += 31) {
    const int64_t s1 = s0 + 31 < steps ? s0 + 31 : steps;
    __m256i bytes[MR][NR];
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < NR; ++c) bytes[r][c] = _mm256_setzero_si256();
    for (int64_t s = s0; s < s1; ++s) {
      __m256i av[MR], wv[NR];
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) av[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + r * lda + 4 * s));
#pragma GCC unroll 4
      for (int c = 0; c < NR; ++c) wv[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * ldw + 4 * s));
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
        for (int c = 0; c < NR; ++c) {
          const __m256i x = _mm256_xor_si256(av[r], wv[c]);
          const __m256i lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(x, low));
          const __m256i hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(x, 4), low));
          bytes[r][c] = _mm256_add_epi8(bytes[r][c], _mm256_add_epi8(lo, hi));
        }
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < NR; ++c)
        wide[r][c] = _mm256_add_epi64(wide[r][c], _mm256_sad_epu8(bytes[r][c], _mm256_setzero_si256()));
  }
  for (int r = 0; r < MR; ++r) {
    for (int c = 0; c < NR; ++c) {
      alignas(32) uint64_t lanes[4];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), wide[r][c]);
      uint64_t total = lanes[0] + lanes[1] + lanes[2] + lanes[3];
      for (int64_t j = steps * 4; j < kwords; ++j) total += _mm_popcnt_u64(a[r * lda + j] ^ w[c * ldw + j]);
      pc[r * ldc + c] = static_cast<int32_t>(total);
    }
  }
}

template <int MR>
void Row(const uint64_t* a, int64_t lda, const uint64_t* w, int64_t n, int64_t ldw, int64_t kwords, int32_t* pc,
         int64_t ldc) {
  int64_t c = 0;
  for (; c + 4 <= n; c += 4) Block<MR, 4>(a, lda, w + c * ldw, ldw, kwords, pc + c, ldc);
  switch (n - c) {
    case 3: Block<MR, 3>(a, lda, w + c * ldw, ldw, kwords, pc + c, ldc); break;
    case 2: Block<MR, 2>(a, lda, w + c * ldw, ldw, kwords, pc + c, ldc); break;
    case 1: Block<MR, 1>(a, lda, w + c * ldw, ldw, kwords, pc + c, ldc); break;
    default: break;
  }
}

}  // namespace

void BinaryPopcountAvx2(const uint64_t* a, int64_t m, int64_t lda, const uint64_t* w, int64_t n, int64_t ldw,
                        int64_t kwords, int32_t* pc, int64_t ldc) {
  int64_t r = 0;
  for (; r + 2 <= m; r += 2) Row<2>(a + r * lda, lda, w, n, ldw, kwords, pc + r * ldc, ldc);
  if (r < m) Row<1>(a + r * lda, lda, w, n, ldw, kwords, pc + r * ldc, ldc);
}

}  // namespace x86
}  // namespace qdsl
