// AVX2 implicit-GEMM micro-kernel of the NHWC conv (conv_igemm.cc): u8 activation rows
// read in place through an indirection table, times s8 weight panels of 16 output
// channels, into int32.
//
//   c[r][n] (+)= sum_t sum_j sum_b rows[r * taps + t][4j + b] * panel[((t * cquads + j) * 16 + n) * 4 + b]
//
// Row r is an output position, tap t a kernel tap: rows[r * taps + t] points at that tap's
// cquads * 4 input channels in the NHWC image (or at a zero-point row for padding).  The
// instruction sequence is the S == 1 one of gemm_u8s8_6x16_avx2.cc (vpbroadcastd of the
// position's 4 bytes, vpmaddubsw against the 16-channel panel, vpmaddwd(ones), vpaddd),
// exact when the weights' pair bound allows one int16 pair sum (MaddubsStepsFor >= 1,
// checked when the conv is prepared).  What differs is that each of the 6 rows has its
// own base pointer per tap, so no activation panel is gathered or packed.
#pragma GCC target("avx2,fma")
#include <immintrin.h>

#include <cstdint>

namespace qdsl {
namespace x86 {
namespace {

// One position row of one k-quad (the same asm block as gemm_u8s8_6x16_avx2.cc's RowS1:
// the compiler can neither hoist the broadcast nor spill the accumulators in between).
__attribute__((always_inline)) inline void Row(const uint8_t* row, __m256i b0, __m256i b1, __m256i ones,
                                               __m256i* c0, __m256i* c1) {
  const int32_t& bytes = *reinterpret_cast<const int32_t*>(row);
  asm("vpbroadcastd %[a], %%ymm14\n\t"
      "vpmaddubsw %[b0], %%ymm14, %%ymm15\n\t"
      "vpmaddwd %[ones], %%ymm15, %%ymm15\n\t"
      "vpaddd %%ymm15, %[c0], %[c0]\n\t"
      "vpmaddubsw %[b1], %%ymm14, %%ymm15\n\t"
      "vpmaddwd %[ones], %%ymm15, %%ymm15\n\t"
      "vpaddd %%ymm15, %[c1], %[c1]\n\t"
      : [c0] "+x"(*c0), [c1] "+x"(*c1)
      : [a] "m"(bytes), [b0] "x"(b0), [b1] "x"(b1), [ones] "x"(ones)
      : "xmm14", "xmm15");
}

// The same with the ones read from memory: with six rows, 12 accumulators, the two panel
// halves and ymm14/15 take all 16 registers.
alignas(32) const int16_t kOnesMem[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
__attribute__((always_inline)) inline void RowMem(const uint8_t* row, __m256i b0, __m256i b1, __m256i* c0,
                                                  __m256i* c1) {
  const int32_t& bytes = *reinterpret_cast<const int32_t*>(row);
  const __m256i& ones = *reinterpret_cast<const __m256i*>(kOnesMem);
  asm("vpbroadcastd %[a], %%ymm14\n\t"
      "vpmaddubsw %[b0], %%ymm14, %%ymm15\n\t"
      "vpmaddwd %[ones], %%ymm15, %%ymm15\n\t"
      "vpaddd %%ymm15, %[c0], %[c0]\n\t"
      "vpmaddubsw %[b1], %%ymm14, %%ymm15\n\t"
      "vpmaddwd %[ones], %%ymm15, %%ymm15\n\t"
      "vpaddd %%ymm15, %[c1], %[c1]\n\t"
      : [c0] "+x"(*c0), [c1] "+x"(*c1)
      : [a] "m"(bytes), [b0] "x"(b0), [b1] "x"(b1), [ones] "m"(ones)
      : "xmm14", "xmm15");
}

// The sums of MR rows into acc (registers once inlined).
template <int MR>
__attribute__((always_inline)) inline void Accumulate(const uint8_t* const* rows, int64_t taps, int64_t cquads,
                                                      const uint8_t* panel, const int32_t* c, int64_t ldc,
                                                      const int32_t* init, __m256i (&acc)[MR][2]) {
  // the start values: one row shared by every position (the conv's bias - z * rowsum, so
  // the caller need not copy it into each row of c first), or c's own values
  for (int r = 0; r < MR; ++r) {
    const int32_t* from = init != nullptr ? init : c + r * ldc;
    acc[r][0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from));
    acc[r][1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + 8));
  }
  if (MR == 6) {  // named variables (an array operand would be stored back every step)
    __m256i c00 = acc[0][0], c01 = acc[0][1], c10 = acc[1][0], c11 = acc[1][1], c20 = acc[2][0], c21 = acc[2][1];
    __m256i c30 = acc[3][0], c31 = acc[3][1], c40 = acc[4][0], c41 = acc[4][1], c50 = acc[5][0], c51 = acc[5][1];
    for (int64_t t = 0; t < taps; ++t) {
      const uint8_t *p0 = rows[t], *p1 = rows[taps + t], *p2 = rows[2 * taps + t];
      const uint8_t *p3 = rows[3 * taps + t], *p4 = rows[4 * taps + t], *p5 = rows[5 * taps + t];
      const uint8_t* pt = panel + t * cquads * 64;
      for (int64_t j = 0; j < cquads; ++j) {
        const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pt + j * 64));
        const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pt + j * 64 + 32));
        RowMem(p0 + 4 * j, b0, b1, &c00, &c01);
        RowMem(p1 + 4 * j, b0, b1, &c10, &c11);
        RowMem(p2 + 4 * j, b0, b1, &c20, &c21);
        RowMem(p3 + 4 * j, b0, b1, &c30, &c31);
        RowMem(p4 + 4 * j, b0, b1, &c40, &c41);
        RowMem(p5 + 4 * j, b0, b1, &c50, &c51);
      }
    }
    acc[0][0] = c00, acc[0][1] = c01, acc[1][0] = c10, acc[1][1] = c11, acc[2][0] = c20, acc[2][1] = c21;
    acc[3][0] = c30, acc[3][1] = c31, acc[4][0] = c40, acc[4][1] = c41, acc[5][0] = c50, acc[5][1] = c51;
  } else {  // edge strips: one asm block per row, a register holds the ones
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i z = _mm256_setzero_si256();
    __m256i c00 = acc[0][0], c01 = acc[0][1], c10 = MR > 1 ? acc[1 % MR][0] : z, c11 = MR > 1 ? acc[1 % MR][1] : z;
    __m256i c20 = MR > 2 ? acc[2 % MR][0] : z, c21 = MR > 2 ? acc[2 % MR][1] : z;
    __m256i c30 = MR > 3 ? acc[3 % MR][0] : z, c31 = MR > 3 ? acc[3 % MR][1] : z;
    __m256i c40 = MR > 4 ? acc[4 % MR][0] : z, c41 = MR > 4 ? acc[4 % MR][1] : z;
    for (int64_t t = 0; t < taps; ++t) {
      const uint8_t* p[5];
      for (int r = 0; r < MR && r < 5; ++r) p[r] = rows[r * taps + t];
      const uint8_t* pt = panel + t * cquads * 64;
      for (int64_t j = 0; j < cquads; ++j) {
        const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pt + j * 64));
        const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pt + j * 64 + 32));
        Row(p[0] + 4 * j, b0, b1, ones, &c00, &c01);
        if (MR > 1) Row(p[1 % MR] + 4 * j, b0, b1, ones, &c10, &c11);
        if (MR > 2) Row(p[2 % MR] + 4 * j, b0, b1, ones, &c20, &c21);
        if (MR > 3) Row(p[3 % MR] + 4 * j, b0, b1, ones, &c30, &c31);
        if (MR > 4) Row(p[4 % MR] + 4 * j, b0, b1, ones, &c40, &c41);
      }
    }
    acc[0][0] = c00, acc[0][1] = c01;
    if (MR > 1) acc[1 % MR][0] = c10, acc[1 % MR][1] = c11;
    if (MR > 2) acc[2 % MR][0] = c20, acc[2 % MR][1] = c21;
    if (MR > 3) acc[3 % MR][0] = c30, acc[3 % MR][1] = c31;
    if (MR > 4) acc[4 % MR][0] = c40, acc[4 % MR][1] = c41;
  }
}

}  // namespace
}  // namespace x86
}  // namespace qdsl

// Kernel, KernelStage and the entry points around Accumulate: igemm_u8s8_6x16_drive.h.
#define QDSL_IGEMM_U8S8 IgemmU8S8Avx2
#define QDSL_IGEMM_U8S8_STAGE IgemmU8S8StageAvx2
#include "kernels/x86/igemm_u8s8_6x16_drive.h"
