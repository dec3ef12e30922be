// AVX2 implicit-GEMM micro-kernel of the NHWC conv (conv_igemm.cc) for full-range 8-bit
// activations: int16 activation rows (the u8 codes widened once per conv by the driver) read
// in place through the same row-pointer table as the vpmaddubsw kernel
// (igemm_u8s8_6x16_avx2.cc), times int16 weight panels of 16 output channels with vpmaddwd,
// into int32.  Exact for any u8 code and |W| <= 511: a vpmaddwd pair sum is at most
// 2 * 255 * 511 < 2^31 (vpmaddubsw's int16 pair sum is not: 2 * 255 * 127 > 32767), and the
// int32 sums wrap exactly as the caller's start values expect (ConvParams::ig_cinit).
//
//   c[r][n] (+)= sum_t sum_j sum_b rows[r * taps + t][4j + b] * w[t][4j + b][n]
//
// Per channel pair of a position: vpbroadcastd of its two int16 codes, vpmaddwd against the
// panel's two 8-channel vectors, vpaddd: the instruction sequence of gemm_i16_6x16_avx2.cc.
// Why the rows are widened by the driver and not in this kernel's loads (vpbroadcastd +
// vpmovzxbw + vpshufd on u8 rows, tried first): the two shuffles per position and k-quad are
// repeated for every 16-channel panel and made the kernel 10-20% slower than the gathered-panel
// conv on ResNet-18's 3x3 convs (benchmarks/igemm_convs.py --bits 8), while the widening pass
// reads each input byte once per conv.
#pragma GCC target("avx2,fma")
#include <immintrin.h>

#include <cstdint>

#include "kernels/x86/igemm_6x16_avx2.h"
#include "kernels/x86/x86_kernels.h"

namespace qdsl {
namespace x86 {
namespace {

// One position row of one channel pair (an asm block, as in igemm_u8s8_6x16_avx2.cc: the
// compiler can neither hoist the broadcast nor spill the accumulators in between).
__attribute__((always_inline)) inline void Row(const uint8_t* row, __m256i b0, __m256i b1, __m256i* c0,
                                               __m256i* c1) {
  const int32_t& pair = *reinterpret_cast<const int32_t*>(row);
  asm("vpbroadcastd %[a], %%ymm14\n\t"
      "vpmaddwd %[b0], %%ymm14, %%ymm15\n\t"
      "vpaddd %%ymm15, %[c0], %[c0]\n\t"
      "vpmaddwd %[b1], %%ymm14, %%ymm15\n\t"
      "vpaddd %%ymm15, %[c1], %[c1]\n\t"
      : [c0] "+x"(*c0), [c1] "+x"(*c1)
      : [a] "m"(pair), [b0] "x"(b0), [b1] "x"(b1)
      : "xmm14", "xmm15");
}

template <int MR>
void Kernel(const uint8_t* const* rows, int64_t taps, int64_t cquads, const uint8_t* panel, int32_t* c, int64_t ldc,
            const int32_t* init) {
  // the start values: one row shared by every position (the conv's bias - z * rowsum), or
  // c's own values.  Named variables: an array operand would be stored back every step.
  auto load = [&](int r, int half) {
    if (r >= MR) return _mm256_setzero_si256();
    const int32_t* from = init != nullptr ? init : c + r * ldc;
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + 8 * half));
  };
  __m256i c00 = load(0, 0), c01 = load(0, 1), c10 = load(1, 0), c11 = load(1, 1), c20 = load(2, 0),
          c21 = load(2, 1);
  __m256i c30 = load(3, 0), c31 = load(3, 1), c40 = load(4, 0), c41 = load(4, 1), c50 = load(5, 0),
          c51 = load(5, 1);
  const int64_t pairs = cquads * 2;
  for (int64_t t = 0; t < taps; ++t) {
    const uint8_t* p[6];
    for (int r = 0; r < 6; ++r) p[r] = rows[(r < MR ? r : 0) * taps + t];
    const uint8_t* pt = panel + t * pairs * 64;
    for (int64_t j = 0; j < pairs; ++j) {  // pair j: bytes 4j.. of the int16 rows, panel bytes 64j..
      const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pt + j * 64));
      const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pt + j * 64 + 32));
      Row(p[0] + 4 * j, b0, b1, &c00, &c01);
      if (MR > 1) Row(p[1] + 4 * j, b0, b1, &c10, &c11);
      if (MR > 2) Row(p[2] + 4 * j, b0, b1, &c20, &c21);
      if (MR > 3) Row(p[3] + 4 * j, b0, b1, &c30, &c31);
      if (MR > 4) Row(p[4] + 4 * j, b0, b1, &c40, &c41);
      if (MR > 5) Row(p[5] + 4 * j, b0, b1, &c50, &c51);
    }
  }
  const __m256i out[6][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
  StoreIgemmRows<MR>(out, c, ldc);
}

}  // namespace

void IgemmU8I16Avx2(int rows, const uint8_t* const* ind, int64_t taps, int64_t cquads, const uint8_t* panel,
                    int32_t* c, int64_t ldc, const int32_t* init) {
  static constexpr IgemmRowsFn kRows[6] = {Kernel<1>, Kernel<2>, Kernel<3>, Kernel<4>, Kernel<5>, Kernel<6>};
  kRows[(rows < 6 ? rows : 6) - 1](ind, taps, cquads, panel, c, ldc, init);
}

}  // namespace x86
}  // namespace qdsl
