// AVX-512 binary popcount kernel: pc[m][n] = popcount(a[m] XOR w[n]), 2 rows x 4 weight
// rows per block, 512 bits per step with VPOPCNTQ (one xor + one popcount + one add per
// 512 bit-products, against ~8 uops per 256 bits for the AVX2 nibble-lookup kernel).
// Words past the last full 512-bit step use scalar popcnt; padding bits are 0 in both
// operands.  Selected only when the CPU has AVX512F + AVX512VPOPCNTDQ (kPathAvx512).
#pragma GCC target("avx512f,avx512bw,avx512vpopcntdq,avx2,popcnt")
#include <immintrin.h>

#include <cstdint>

#include "kernels/x86/x86_kernels.h"

namespace qdsl {
namespace x86 {
namespace {

template <int MR, int NR>
void Block(const uint64_t* a, int64_t lda, const uint64_t* w, int64_t ldw, int64_t kwords, int32_t* pc,
           int64_t ldc) {
  __m512i acc[MR][NR];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < NR; ++c) acc[r][c] = _mm512_setzero_si512();
  const int64_t steps = kwords / 8;
  for (int64_t s = 0; s < steps; ++s) {
    __m512i av[MR], wv[NR];
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) av[r] = _mm512_loadu_si512(a + r * lda + 8 * s);
#pragma GCC unroll 4
    for (int c = 0; c < NR; ++c) wv[c] = _mm512_loadu_si512(w + c * ldw + 8 * s);
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < NR; ++c)
        acc[r][c] = _mm512_add_epi64(acc[r][c], _mm512_popcnt_epi64(_mm512_xor_si512(av[r], wv[c])));
  }
  for (int r = 0; r < MR; ++r) {
    for (int c = 0; c < NR; ++c) {
      uint64_t total = static_cast<uint64_t>(_mm512_reduce_add_epi64(acc[r][c]));
      for (int64_t j = steps * 8; j < kwords; ++j) total += _mm_popcnt_u64(a[r * lda + j] ^ w[c * ldw + j]);
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

void BinaryPopcountAvx512(const uint64_t* a, int64_t m, int64_t lda, const uint64_t* w, int64_t n, int64_t ldw,
                          int64_t kwords, int32_t* pc, int64_t ldc) {
  int64_t r = 0;
  for (; r + 2 <= m; r += 2) Row<2>(a + r * lda, lda, w, n, ldw, kwords, pc + r * ldc, ldc);
  if (r < m) Row<1>(a + r * lda, lda, w, n, ldw, kwords, pc + r * ldc, ldc);
}

}  // namespace x86
}  // namespace qdsl
