// AVX-512 binary popcount kernel: pc[m][n] = popcount(a[m] XOR w[n]), 2 rows x 4 weight
// rows per block, 512 bits per step with VPOPCNTQ (one xor + one popcount + one add per
// 512 bit-products, against ~8 uops per 256 bits for the AVX2 nibble-lookup kernel).
// Words past the last full 512-bit step use scalar popcnt; padding bits are 0 in both
// operands.  Selected only when the CPU has AVX512F/BW/VL + VPOPCNTDQ (kPathAvx512).
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vpopcntdq,avx2,popcnt")
// gcc 12 flags its own AVX-512 intrinsics (_mm512_undefined_* inside them) as uninitialized
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
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

namespace qdsl {
namespace x86 {
namespace {

// Column form: weights transposed to wt[j][n] (word j of every weight row, contiguous),
// so one 512-bit load holds word j of 8 weight rows and one broadcast of a[r][j] against
// it accumulates 8 outputs with no horizontal reduction at all (short K costs nothing
// extra).  MR rows x NV vectors of 8 columns; `valid` masks the columns of the last vector.
template <int MR, int NV>
void ColBlock(const uint64_t* a, int64_t lda, const uint64_t* wt, int64_t ldwt, int64_t kwords, int32_t* pc,
              int64_t ldc, __mmask8 last_mask) {
  __m512i acc[MR][NV];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_si512();
  for (int64_t j = 0; j < kwords; ++j) {
    __m512i wv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) wv[v] = _mm512_loadu_si512(wt + j * ldwt + 8 * v);
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const __m512i ab = _mm512_set1_epi64(static_cast<long long>(a[r * lda + j]));
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_add_epi64(acc[r][v], _mm512_popcnt_epi64(_mm512_xor_si512(ab, wv[v])));
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) {
      const __m256i p32 = _mm512_cvtepi64_epi32(acc[r][v]);
      _mm256_mask_storeu_epi32(pc + r * ldc + 8 * v, v == NV - 1 ? last_mask : static_cast<__mmask8>(0xFF), p32);
    }
}

template <int MR>
void ColRows(const uint64_t* a, int64_t lda, const uint64_t* wt, int64_t n, int64_t ldwt, int64_t kwords, int32_t* pc,
             int64_t ldc) {
  int64_t c = 0;
  for (; c + 32 <= n; c += 32) ColBlock<MR, 4>(a, lda, wt + c, ldwt, kwords, pc + c, ldc, 0xFF);
  const int64_t rest = n - c;
  if (rest <= 0) return;
  const int nv = static_cast<int>((rest + 7) / 8);
  const int tail = static_cast<int>(rest - 8 * (nv - 1));
  const __mmask8 mask = static_cast<__mmask8>((1u << tail) - 1);
  switch (nv) {
    case 1: ColBlock<MR, 1>(a, lda, wt + c, ldwt, kwords, pc + c, ldc, mask); break;
    case 2: ColBlock<MR, 2>(a, lda, wt + c, ldwt, kwords, pc + c, ldc, mask); break;
    case 3: ColBlock<MR, 3>(a, lda, wt + c, ldwt, kwords, pc + c, ldc, mask); break;
    default: ColBlock<MR, 4>(a, lda, wt + c, ldwt, kwords, pc + c, ldc, mask); break;
  }
}

}  // namespace

void BinaryPopcountColsAvx512(const uint64_t* a, int64_t m, int64_t lda, const uint64_t* wt, int64_t n,
                              int64_t ldwt, int64_t kwords, int32_t* pc, int64_t ldc) {
  int64_t r = 0;
  for (; r + 4 <= m; r += 4) ColRows<4>(a + r * lda, lda, wt, n, ldwt, kwords, pc + r * ldc, ldc);
  switch (m - r) {
    case 3: ColRows<3>(a + r * lda, lda, wt, n, ldwt, kwords, pc + r * ldc, ldc); break;
    case 2: ColRows<2>(a + r * lda, lda, wt, n, ldwt, kwords, pc + r * ldc, ldc); break;
    case 1: ColRows<1>(a + r * lda, lda, wt, n, ldwt, kwords, pc + r * ldc, ldc); break;
    default: break;
  }
}

}  // namespace x86
}  // namespace qdsl
