// AVX2 u8 x s8 GEMM micro-kernels on VNNI-layout panels, exact by a pack-time bound.
//
// vpmaddubsw multiplies adjacent u8 x s8 byte pairs and adds each pair into a SATURATING
// int16: with u8 codes up to 255 it clips as soon as 255 * (w0 + w1) > 32767 for a pair
// of same-sign weights (onnxruntime's and fbgemm's AVX2 int8 kernels clip real data this
// way: benchmarks/kernels.py prints their error).  But the bound depends on the weights
// only: with P = max over weight pairs of 255 * max(w0+ + w1+, -(w0- + w1-)) (the largest
// magnitude one pair can reach for ANY activations), a layer with P <= 32767 never
// saturates, and S = floor(32767 / P) pair sums can even be added in int16 before they
// are widened.  The packer computes S per weight matrix (MaddubsStepsFor, csrc/pack):
//   S = 0       some pair can saturate (e.g. uniform int8 weights): the int16 vpmaddwd
//               kernel runs instead (gemm_i16_6x16_avx2.cc);
//   S = 1       int8 weights whose pairs stay within 128 in magnitude (7-bit weights, or
//               trained weights without a large same-sign neighbour): vpmaddubsw +
//               vpmaddwd(ones) + vpaddd, 32 MACs per two multiply uops, int32 accumulators
//               in registers (onnxruntime's instruction sequence, but exact);
//   S = 2..8    small weights, e.g. int4 (P = 255 * 16 = 4080, S = 8): vpmaddubsw + vpaddw
//               per 32 MACs, one vpmaddwd(ones) per S steps; the int32 sums live in a
//               small block in L1.  ~1.5x the int16 kernel's rate on this path.
// Every sum stays exact, so the result is the reference's wrapping int32 sum.
//
// The 6-row bodies are inline asm: GCC hoists the six broadcasts of a step ahead of the
// multiplies and then spills accumulators (33 stack accesses per step measured), which
// cost 30 % here.  Fewer rows (edge strips: 64 channels are strips of 6, ..., 5, 5) use one
// asm block per row on named accumulators (their intrinsics spilled every step too: 5-row
// strips ran at 0.6x the 6-row rate).
// Panels and zero points as in the AVX-VNNI file: 16 columns x 4 bytes per k-quad.
#pragma GCC target("avx2,fma")
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "kernels/x86/x86_kernels.h"

namespace qdsl {
namespace x86 {
namespace {

// AT&T: "vpmaddubsw s, u, d" is d = maddubs(unsigned u, signed s).
#define QDSL_MADDUBS_U "vpmaddubsw %%ymm12, %%ymm14, %%ymm15\n\t"
#define QDSL_MADDUBS_U1 "vpmaddubsw %%ymm13, %%ymm14, %%ymm15\n\t"
#define QDSL_MADDUBS_S "vpmaddubsw %%ymm14, %%ymm12, %%ymm15\n\t"
#define QDSL_MADDUBS_S1 "vpmaddubsw %%ymm14, %%ymm13, %%ymm15\n\t"

// S >= 2: one k-quad of 6 rows into int16 accumulators h[6][2] (ymm12/13 panel halves,
// ymm14 the broadcast row, ymm15 the pair sums).
#define QDSL_ROW16(M0, M1, addr, h0, h1) \
  "vpbroadcastd " addr ", %%ymm14\n\t" M0 "vpaddw %%ymm15, " h0 ", " h0 "\n\t" M1 "vpaddw %%ymm15, " h1 ", " h1 "\n\t"
#define QDSL_QUAD16(M0, M1)                                                                              \
  asm volatile("vmovdqu (%[pj]), %%ymm12\n\t"                                                            \
               "vmovdqu 32(%[pj]), %%ymm13\n\t" QDSL_ROW16(M0, M1, "(%[a0])", "%[h00]", "%[h01]")        \
                   QDSL_ROW16(M0, M1, "(%[a0],%[ld])", "%[h10]", "%[h11]")                               \
                       QDSL_ROW16(M0, M1, "(%[a0],%[ld],2)", "%[h20]", "%[h21]")                         \
                           QDSL_ROW16(M0, M1, "(%[a3])", "%[h30]", "%[h31]")                             \
                               QDSL_ROW16(M0, M1, "(%[a3],%[ld])", "%[h40]", "%[h41]")                   \
                                   QDSL_ROW16(M0, M1, "(%[a3],%[ld],2)", "%[h50]", "%[h51]")             \
               : [h00] "+x"(h00), [h01] "+x"(h01), [h10] "+x"(h10), [h11] "+x"(h11),     \
                 [h20] "+x"(h20), [h21] "+x"(h21), [h30] "+x"(h30), [h31] "+x"(h31),     \
                 [h40] "+x"(h40), [h41] "+x"(h41), [h50] "+x"(h50), [h51] "+x"(h51)      \
               : [pj] "r"(panel + j * 64), [a0] "r"(a + 4 * j), [a3] "r"(a + 3 * lda + 4 * j), [ld] "r"(lda) \
               : "xmm12", "xmm13", "xmm14", "xmm15", "memory")

// S == 1: one k-quad of 6 rows into int32 accumulators (ones from memory).
#define QDSL_ROW32(M0, M1, addr, c0, c1)                                                              \
  "vpbroadcastd " addr ", %%ymm14\n\t" M0 "vpmaddwd (%[ones]), %%ymm15, %%ymm15\n\t"                   \
  "vpaddd %%ymm15, " c0 ", " c0 "\n\t" M1 "vpmaddwd (%[ones]), %%ymm15, %%ymm15\n\t" "vpaddd %%ymm15, " c1 \
  ", " c1 "\n\t"
#define QDSL_QUAD32(M0, M1)                                                                              \
  asm volatile("vmovdqu (%[pj]), %%ymm12\n\t"                                                            \
               "vmovdqu 32(%[pj]), %%ymm13\n\t" QDSL_ROW32(M0, M1, "(%[a0])", "%[c00]", "%[c01]")        \
                   QDSL_ROW32(M0, M1, "(%[a0],%[ld])", "%[c10]", "%[c11]")                               \
                       QDSL_ROW32(M0, M1, "(%[a0],%[ld],2)", "%[c20]", "%[c21]")                         \
                           QDSL_ROW32(M0, M1, "(%[a3])", "%[c30]", "%[c31]")                             \
                               QDSL_ROW32(M0, M1, "(%[a3],%[ld])", "%[c40]", "%[c41]")                   \
                                   QDSL_ROW32(M0, M1, "(%[a3],%[ld],2)", "%[c50]", "%[c51]")             \
               : [c00] "+x"(c00), [c01] "+x"(c01), [c10] "+x"(c10),                    \
                 [c11] "+x"(c11), [c20] "+x"(c20), [c21] "+x"(c21),                    \
                 [c30] "+x"(c30), [c31] "+x"(c31), [c40] "+x"(c40),                    \
                 [c41] "+x"(c41), [c50] "+x"(c50), [c51] "+x"(c51)                     \
               : [pj] "r"(panel + j * 64), [a0] "r"(a + 4 * j), [a3] "r"(a + 3 * lda + 4 * j), [ld] "r"(lda), \
                 [ones] "r"(ones16)                                                                      \
               : "xmm12", "xmm13", "xmm14", "xmm15", "memory")

// One row of one k-quad into int32 accumulators c0 (columns 0..7) and c1 (8..15): the
// broadcast, two vpmaddubsw, two vpmaddwd(ones), two adds in one asm block, so that the
// compiler can neither hoist the broadcasts nor spill the accumulators in between.
template <bool kU>
__attribute__((always_inline)) inline void RowS1(const uint8_t* row, __m256i b0, __m256i b1, __m256i ones,
                                                 __m256i* c0, __m256i* c1) {
  const int32_t& bytes = *reinterpret_cast<const int32_t*>(row);
  if (kU) {  // maddubs(unsigned row, signed panel)
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
  } else {  // maddubs(unsigned panel, signed row)
    asm("vpbroadcastd %[a], %%ymm14\n\t"
        "vpmaddubsw %%ymm14, %[b0], %%ymm15\n\t"
        "vpmaddwd %[ones], %%ymm15, %%ymm15\n\t"
        "vpaddd %%ymm15, %[c0], %[c0]\n\t"
        "vpmaddubsw %%ymm14, %[b1], %%ymm15\n\t"
        "vpmaddwd %[ones], %%ymm15, %%ymm15\n\t"
        "vpaddd %%ymm15, %[c1], %[c1]\n\t"
        : [c0] "+x"(*c0), [c1] "+x"(*c1)
        : [a] "m"(bytes), [b0] "x"(b0), [b1] "x"(b1), [ones] "x"(ones)
        : "xmm14", "xmm15");
  }
}

// The same into int16 pair-sum accumulators (KernelSteps: S pair sums fit int16).
template <bool kU>
__attribute__((always_inline)) inline void RowS16(const uint8_t* row, __m256i b0, __m256i b1, __m256i* h0,
                                                  __m256i* h1) {
  const int32_t& bytes = *reinterpret_cast<const int32_t*>(row);
  if (kU) {
    asm("vpbroadcastd %[a], %%ymm14\n\t"
        "vpmaddubsw %[b0], %%ymm14, %%ymm15\n\t"
        "vpaddw %%ymm15, %[h0], %[h0]\n\t"
        "vpmaddubsw %[b1], %%ymm14, %%ymm15\n\t"
        "vpaddw %%ymm15, %[h1], %[h1]\n\t"
        : [h0] "+x"(*h0), [h1] "+x"(*h1)
        : [a] "m"(bytes), [b0] "x"(b0), [b1] "x"(b1)
        : "xmm14", "xmm15");
  } else {
    asm("vpbroadcastd %[a], %%ymm14\n\t"
        "vpmaddubsw %%ymm14, %[b0], %%ymm15\n\t"
        "vpaddw %%ymm15, %[h0], %[h0]\n\t"
        "vpmaddubsw %%ymm14, %[b1], %%ymm15\n\t"
        "vpaddw %%ymm15, %[h1], %[h1]\n\t"
        : [h0] "+x"(*h0), [h1] "+x"(*h1)
        : [a] "m"(bytes), [b0] "x"(b0), [b1] "x"(b1)
        : "xmm14", "xmm15");
  }
}

alignas(32) const int16_t ones16[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};

template <int MR, bool kU>
void KernelS1(const uint8_t* a, int64_t lda, const uint8_t* panel, int64_t kquads, int32_t* c, int64_t ldc,
              bool accumulate) {
  __m256i acc[MR][2];
  for (int r = 0; r < MR; ++r) {
    acc[r][0] = accumulate ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + r * ldc)) : _mm256_setzero_si256();
    acc[r][1] =
        accumulate ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + r * ldc + 8)) : _mm256_setzero_si256();
  }
  if (MR == 6) {  // named variables: an array operand would be stored back every step
    __m256i c00 = acc[0][0], c01 = acc[0][1], c10 = acc[1][0], c11 = acc[1][1], c20 = acc[2][0], c21 = acc[2][1];
    __m256i c30 = acc[3][0], c31 = acc[3][1], c40 = acc[4][0], c41 = acc[4][1], c50 = acc[5][0], c51 = acc[5][1];
    for (int64_t j = 0; j < kquads; ++j) {
      if (kU) {
        QDSL_QUAD32(QDSL_MADDUBS_U, QDSL_MADDUBS_U1);
      } else {
        QDSL_QUAD32(QDSL_MADDUBS_S, QDSL_MADDUBS_S1);
      }
    }
    acc[0][0] = c00, acc[0][1] = c01, acc[1][0] = c10, acc[1][1] = c11, acc[2][0] = c20, acc[2][1] = c21;
    acc[3][0] = c30, acc[3][1] = c31, acc[4][0] = c40, acc[4][1] = c41, acc[5][0] = c50, acc[5][1] = c51;
  } else {
    // one asm block per row (the intrinsics spilled the accumulators every step: 58 stack
    // accesses in the 5-row loop); with <= 5 rows a register holds the ones
    // (named variables, as above: an array kept the accumulators in memory)
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i z = _mm256_setzero_si256();
    __m256i c00 = acc[0][0], c01 = acc[0][1], c10 = MR > 1 ? acc[1 % MR][0] : z, c11 = MR > 1 ? acc[1 % MR][1] : z;
    __m256i c20 = MR > 2 ? acc[2 % MR][0] : z, c21 = MR > 2 ? acc[2 % MR][1] : z;
    __m256i c30 = MR > 3 ? acc[3 % MR][0] : z, c31 = MR > 3 ? acc[3 % MR][1] : z;
    __m256i c40 = MR > 4 ? acc[4 % MR][0] : z, c41 = MR > 4 ? acc[4 % MR][1] : z;
    for (int64_t j = 0; j < kquads; ++j) {
      const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + j * 64));
      const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + j * 64 + 32));
      const uint8_t* aj = a + 4 * j;
      RowS1<kU>(aj, b0, b1, ones, &c00, &c01);
      if (MR > 1) RowS1<kU>(aj + lda, b0, b1, ones, &c10, &c11);
      if (MR > 2) RowS1<kU>(aj + 2 * lda, b0, b1, ones, &c20, &c21);
      if (MR > 3) RowS1<kU>(aj + 3 * lda, b0, b1, ones, &c30, &c31);
      if (MR > 4) RowS1<kU>(aj + 4 * lda, b0, b1, ones, &c40, &c41);
    }
    acc[0][0] = c00, acc[0][1] = c01;
    if (MR > 1) acc[1 % MR][0] = c10, acc[1 % MR][1] = c11;
    if (MR > 2) acc[2 % MR][0] = c20, acc[2 % MR][1] = c21;
    if (MR > 3) acc[3 % MR][0] = c30, acc[3 % MR][1] = c31;
    if (MR > 4) acc[4 % MR][0] = c40, acc[4 % MR][1] = c41;
  }
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + r * ldc), acc[r][0]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + r * ldc + 8), acc[r][1]);
  }
}

template <int MR, int S, bool kU>
void KernelSteps(const uint8_t* a, int64_t lda, const uint8_t* panel, int64_t kquads, int32_t* c, int64_t ldc,
                 bool accumulate) {
  alignas(32) int32_t sum[MR][16];  // the int32 sums: L1, touched once per S steps
  for (int r = 0; r < MR; ++r) {
    if (accumulate) {
      std::memcpy(sum[r], c + r * ldc, 64);
    } else {
      std::memset(sum[r], 0, 64);
    }
  }
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t q0 = 0; q0 < kquads; q0 += S) {
    const int64_t q1 = q0 + S < kquads ? q0 + S : kquads;
    __m256i h[MR][2];
    for (int r = 0; r < MR; ++r) h[r][0] = h[r][1] = _mm256_setzero_si256();
    if (MR == 6) {
      __m256i h00 = h[0][0], h01 = h00, h10 = h00, h11 = h00, h20 = h00, h21 = h00;
      __m256i h30 = h00, h31 = h00, h40 = h00, h41 = h00, h50 = h00, h51 = h00;
      for (int64_t j = q0; j < q1; ++j) {
        if (kU) {
          QDSL_QUAD16(QDSL_MADDUBS_U, QDSL_MADDUBS_U1);
        } else {
          QDSL_QUAD16(QDSL_MADDUBS_S, QDSL_MADDUBS_S1);
        }
      }
      h[0][0] = h00, h[0][1] = h01, h[1][0] = h10, h[1][1] = h11, h[2][0] = h20, h[2][1] = h21;
      h[3][0] = h30, h[3][1] = h31, h[4][0] = h40, h[4][1] = h41, h[5][0] = h50, h[5][1] = h51;
    } else {  // named variables and one asm block per row, as in KernelS1
      const __m256i z = h[0][0];
      __m256i h00 = z, h01 = z, h10 = z, h11 = z, h20 = z, h21 = z, h30 = z, h31 = z, h40 = z, h41 = z;
      for (int64_t j = q0; j < q1; ++j) {
        const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + j * 64));
        const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + j * 64 + 32));
        const uint8_t* aj = a + 4 * j;
        RowS16<kU>(aj, b0, b1, &h00, &h01);
        if (MR > 1) RowS16<kU>(aj + lda, b0, b1, &h10, &h11);
        if (MR > 2) RowS16<kU>(aj + 2 * lda, b0, b1, &h20, &h21);
        if (MR > 3) RowS16<kU>(aj + 3 * lda, b0, b1, &h30, &h31);
        if (MR > 4) RowS16<kU>(aj + 4 * lda, b0, b1, &h40, &h41);
      }
      h[0][0] = h00, h[0][1] = h01;
      if (MR > 1) h[1 % MR][0] = h10, h[1 % MR][1] = h11;
      if (MR > 2) h[2 % MR][0] = h20, h[2 % MR][1] = h21;
      if (MR > 3) h[3 % MR][0] = h30, h[3 % MR][1] = h31;
      if (MR > 4) h[4 % MR][0] = h40, h[4 % MR][1] = h41;
    }
    for (int r = 0; r < MR; ++r) {
      __m256i* s = reinterpret_cast<__m256i*>(sum[r]);
      _mm256_store_si256(s, _mm256_add_epi32(_mm256_load_si256(s), _mm256_madd_epi16(h[r][0], ones)));
      _mm256_store_si256(s + 1, _mm256_add_epi32(_mm256_load_si256(s + 1), _mm256_madd_epi16(h[r][1], ones)));
    }
  }
  for (int r = 0; r < MR; ++r) std::memcpy(c + r * ldc, sum[r], 64);
}

template <int S, bool kU>
void Dispatch(int rows, const uint8_t* a, int64_t lda, const uint8_t* panel, int64_t kquads, int32_t* c, int64_t ldc,
              bool accumulate) {
#define QDSL_CASE(MR)                                             \
  case MR:                                                        \
    if (S == 1) return KernelS1<MR, kU>(a, lda, panel, kquads, c, ldc, accumulate); \
    return KernelSteps<MR, S, kU>(a, lda, panel, kquads, c, ldc, accumulate);
  switch (rows) {
    QDSL_CASE(1)
    QDSL_CASE(2)
    QDSL_CASE(3)
    QDSL_CASE(4)
    QDSL_CASE(5)
    default:
      QDSL_CASE(6)
  }
#undef QDSL_CASE
}

}  // namespace

#define QDSL_DEFINE(S)                                                                                           \
  void GemmU8S8Avx2S##S(int rows, const uint8_t* a, int64_t lda, const uint8_t* panel, int64_t kquads, int32_t* c, \
                        int64_t ldc, bool accumulate) {                                                          \
    Dispatch<S, true>(rows, a, lda, panel, kquads, c, ldc, accumulate);                                          \
  }                                                                                                              \
  void GemmS8U8Avx2S##S(int rows, const uint8_t* w, int64_t ldw, const uint8_t* panel, int64_t kquads, int32_t* c, \
                        int64_t ldc, bool accumulate) {                                                          \
    Dispatch<S, false>(rows, w, ldw, panel, kquads, c, ldc, accumulate);                                         \
  }
QDSL_DEFINE(1)
QDSL_DEFINE(2)
QDSL_DEFINE(4)
QDSL_DEFINE(8)
#undef QDSL_DEFINE

}  // namespace x86
}  // namespace qdsl

// Panel conversions shared by the AVX2, AVX-VNNI and AMX paths (SSE/AVX2 only).
namespace qdsl {
namespace x86 {

// Converts `quads` k-quads of a 16-column int4 (kI4) or int2 (kI2) panel into the VNNI
// int8 quad layout (64 bytes per quad), sign-extending fields with (v ^ h) - h.
//   kI4: k-pair j is 16 bytes, byte i = B0[i] | B1[i] << 4, slot i = column i/2, k = 2j + i%2;
//        quad q = pairs 2q, 2q+1, so columns 0..7 are unpacklo/hi_epi16(lo(X0), lo(X1)).
//   kI2: 16 bytes per quad, fields f0..f3 = B0_j, B1_j, B0_j+1, B1_j+1.
// The driver runs this once per panel block and reuses it for every row strip, so the
// weights stay 4-bit (2-bit) in memory.
void UnpackPanelToVnni(int bits, const uint8_t* src, int64_t quads, uint8_t* dst) {
  const __m128i m4 = _mm_set1_epi8(0x0F), h4 = _mm_set1_epi8(0x08);
  const __m128i m2 = _mm_set1_epi8(0x03), h2 = _mm_set1_epi8(0x02);
  for (int64_t q = 0; q < quads; ++q) {
    __m128i b0a, b0b, b1a, b1b;  // columns 0..3, 4..7 (B0) and 8..11, 12..15 (B1)
    if (bits == 4) {
      const __m128i x0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + q * 32));
      const __m128i x1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + q * 32 + 16));
      auto lo = [&](__m128i x) { return _mm_sub_epi8(_mm_xor_si128(_mm_and_si128(x, m4), h4), h4); };
      auto hi = [&](__m128i x) {
        return _mm_sub_epi8(_mm_xor_si128(_mm_and_si128(_mm_srli_epi16(x, 4), m4), h4), h4);
      };
      const __m128i l0 = lo(x0), l1 = lo(x1), g0 = hi(x0), g1 = hi(x1);
      b0a = _mm_unpacklo_epi16(l0, l1);
      b0b = _mm_unpackhi_epi16(l0, l1);
      b1a = _mm_unpacklo_epi16(g0, g1);
      b1b = _mm_unpackhi_epi16(g0, g1);
    } else {
      const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + q * 16));
      auto f = [&](int s) {
        return _mm_sub_epi8(_mm_xor_si128(_mm_and_si128(_mm_srli_epi16(x, s), m2), h2), h2);
      };
      const __m128i f0 = f(0), f1 = f(2), f2 = f(4), f3 = f(6);
      b0a = _mm_unpacklo_epi16(f0, f2);
      b0b = _mm_unpackhi_epi16(f0, f2);
      b1a = _mm_unpacklo_epi16(f1, f3);
      b1b = _mm_unpackhi_epi16(f1, f3);
    }
    __m128i* out = reinterpret_cast<__m128i*>(dst + q * 64);
    _mm_storeu_si128(out, b0a);
    _mm_storeu_si128(out + 1, b0b);
    _mm_storeu_si128(out + 2, b1a);
    _mm_storeu_si128(out + 3, b1b);
  }
}

}  // namespace x86
}  // namespace qdsl

namespace qdsl {
namespace x86 {

// u8 activation rows [k][ld] (k = 4 * kquads rows) -> VNNI panels of 16 positions, each
// panel_quads >= kquads quads long (zero filled past kquads):
// panel q, quad j: 64 bytes, position i's four bytes are rows 4j..4j+3 at column 16q + i
// (a 4 x 16 byte transpose with two rounds of unpacks).
void PackU8QuadPanels(const uint8_t* rows, int64_t ld, int64_t kquads, int64_t npanels, int64_t panel_quads,
                      uint8_t* panels) {
  for (int64_t q = 0; q < npanels; ++q) {
    for (int64_t j = 0; j < kquads; ++j) {
      const uint8_t* r = rows + 4 * j * ld + 16 * q;
      const __m128i r0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r));
      const __m128i r1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + ld));
      const __m128i r2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 2 * ld));
      const __m128i r3 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 3 * ld));
      const __m128i a_lo = _mm_unpacklo_epi8(r0, r1), a_hi = _mm_unpackhi_epi8(r0, r1);
      const __m128i b_lo = _mm_unpacklo_epi8(r2, r3), b_hi = _mm_unpackhi_epi8(r2, r3);
      __m128i* out = reinterpret_cast<__m128i*>(panels + (q * panel_quads + j) * 64);
      _mm_storeu_si128(out, _mm_unpacklo_epi16(a_lo, b_lo));      // positions 0..3
      _mm_storeu_si128(out + 1, _mm_unpackhi_epi16(a_lo, b_lo));  // 4..7
      _mm_storeu_si128(out + 2, _mm_unpacklo_epi16(a_hi, b_hi));  // 8..11
      _mm_storeu_si128(out + 3, _mm_unpackhi_epi16(a_hi, b_hi));  // 12..15
    }
    // quads past K (AMX pads each panel to whole 16-quad tiles) are zero
    std::memset(panels + (q * panel_quads + kquads) * 64, 0, static_cast<size_t>((panel_quads - kquads) * 64));
  }
}

namespace {

// How one panel's 16 position offsets are loaded: as runs of consecutive bytes (one run
// of 16 for positions inside one output row; a panel crossing row ends has one run per
// row piece), each run one unaligned 16-byte load placed so that lane i reads a[po[i]],
// the runs merged with byte blends; more than kMaxRuns runs (or positions that do not
// increase, the padding columns of the last panel) gather bytes.  A run starting at lane
// i0 loads a + po[i0] - i0 .. + 15: with increasing positions those bytes lie within
// [a + po[0], a + po[15]], which the panel reads anyway.
constexpr int kMaxRuns = 4;
struct PanelLoad {
  int runs = 0;  // 0: byte gather
  int64_t off[kMaxRuns];
  __m128i mask[kMaxRuns];  // lanes >= the run's first lane
};

inline void PlanPanel(const int64_t* po, PanelLoad* pl) {
  int runs = 1;
  int first[16] = {0};
  for (int i = 1; i < 16; ++i) {
    if (po[i] <= po[i - 1]) {
      pl->runs = 0;
      return;
    }
    if (po[i] != po[i - 1] + 1) {
      if (runs == kMaxRuns) {
        pl->runs = 0;
        return;
      }
      first[runs++] = i;
    }
  }
  pl->runs = runs;
  for (int r = 0; r < runs; ++r) {
    pl->off[r] = po[first[r]] - first[r];
    pl->mask[r] = _mm_cmpgt_epi8(_mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                 _mm_set1_epi8(static_cast<char>(first[r] - 1)));
  }
}

// The 16 bytes a[po[i]] of one tap row at a panel's positions.
inline __m128i LoadPositions(const uint8_t* a, const int64_t* po, const PanelLoad& pl) {
  if (pl.runs == 1) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + pl.off[0]));
  if (pl.runs > 1) {
    __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + pl.off[0]));
    for (int r = 1; r < pl.runs; ++r)
      v = _mm_blendv_epi8(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + pl.off[r])), pl.mask[r]);
    return v;
  }
  alignas(16) uint8_t g[16];
  for (int i = 0; i < 16; ++i) g[i] = a[po[i]];
  return _mm_load_si128(reinterpret_cast<const __m128i*>(g));
}

// Panels are gathered kGroup at a time with the k loop outside: consecutive panels read
// consecutive bytes of each tap row, so a row's cache line serves them all while it is in
// L1 (one panel at a time fetched each line again per panel).
constexpr int64_t kGroup = 8;

}  // namespace

// int16 pair panels of 16 columns for GemmI16Avx2 (the activation operand of the int16
// convs): panel q, pair j = 32 int16, slot 2i / 2i + 1 = tap rows 2j / 2j + 1 at position
// 16q + i, minus the zero point's code `zu`, gathered from padded images: byte i of tap
// row k for panel q is base[tap[k] + pos[16q + i]] (PanelLoad: runs of positions load as
// vectors); then one byte interleave and two widenings per 32 values.
void PackI16PanelsGather(const uint8_t* base, const int64_t* tap, int64_t kpairs, const int64_t* pos,
                         int64_t npanels, uint8_t zu, int16_t* panels) {
  const __m256i z = _mm256_set1_epi16(zu);
  PanelLoad pl[kGroup];
  for (int64_t g0 = 0; g0 < npanels; g0 += kGroup) {
    const int64_t ng = npanels - g0 < kGroup ? npanels - g0 : kGroup;
    for (int64_t q = 0; q < ng; ++q) PlanPanel(pos + 16 * (g0 + q), &pl[q]);
    for (int64_t j = 0; j < kpairs; ++j) {
      const uint8_t* t0 = base + tap[2 * j];
      const uint8_t* t1 = base + tap[2 * j + 1];
      for (int64_t q = 0; q < ng; ++q) {
        const int64_t* po = pos + 16 * (g0 + q);
        const __m128i r0 = LoadPositions(t0, po, pl[q]);
        const __m128i r1 = LoadPositions(t1, po, pl[q]);
        const __m256i b0 = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_unpacklo_epi8(r0, r1)), z);
        const __m256i b1 = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_unpackhi_epi8(r0, r1)), z);
        __m256i* out = reinterpret_cast<__m256i*>(panels + ((g0 + q) * kpairs + j) * 32);
        _mm256_storeu_si256(out, b0);
        _mm256_storeu_si256(out + 1, b1);
      }
    }
  }
}

// PackU8QuadPanels' layout gathered from padded images (the u8 convs): byte i of tap row k
// for panel q is base[tap[k] + pos[16q + i]]; quad j's 64 bytes hold position i's four
// taps 4j..4j+3 (PanelLoad: runs of positions load as vectors).
void PackU8QuadPanelsGather(const uint8_t* base, const int64_t* tap, int64_t kquads, const int64_t* pos,
                            int64_t npanels, uint8_t* panels) {
  PanelLoad pl[kGroup];
  for (int64_t g0 = 0; g0 < npanels; g0 += kGroup) {
    const int64_t ng = npanels - g0 < kGroup ? npanels - g0 : kGroup;
    for (int64_t q = 0; q < ng; ++q) PlanPanel(pos + 16 * (g0 + q), &pl[q]);
    for (int64_t j = 0; j < kquads; ++j) {
      const uint8_t* t[4] = {base + tap[4 * j], base + tap[4 * j + 1], base + tap[4 * j + 2], base + tap[4 * j + 3]};
      for (int64_t q = 0; q < ng; ++q) {
        const int64_t* po = pos + 16 * (g0 + q);
        __m128i r[4];
        for (int u = 0; u < 4; ++u) r[u] = LoadPositions(t[u], po, pl[q]);
        const __m128i a_lo = _mm_unpacklo_epi8(r[0], r[1]), a_hi = _mm_unpackhi_epi8(r[0], r[1]);
        const __m128i b_lo = _mm_unpacklo_epi8(r[2], r[3]), b_hi = _mm_unpackhi_epi8(r[2], r[3]);
        __m128i* out = reinterpret_cast<__m128i*>(panels + ((g0 + q) * kquads + j) * 64);
        _mm_storeu_si128(out, _mm_unpacklo_epi16(a_lo, b_lo));
        _mm_storeu_si128(out + 1, _mm_unpackhi_epi16(a_lo, b_lo));
        _mm_storeu_si128(out + 2, _mm_unpacklo_epi16(a_hi, b_hi));
        _mm_storeu_si128(out + 3, _mm_unpackhi_epi16(a_hi, b_hi));
      }
    }
  }
}

}  // namespace x86
}  // namespace qdsl
