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

// One 256-bit step of the 2 x 4 block in asm: GCC kept the byte counters, the partial
// sums and the operands in 24 registers for 16 and spilled inside the loop (437 stack
// accesses in the block), which cost a third of the rate.  ymm11/12: the two activation
// rows, ymm13: a weight row, ymm14/15: the nibble counts.
#define QDSL_BIN_ROW(arow, acc)                      \
  "vpxor %%ymm13, " arow ", %%ymm14\n\t"              \
  "vpsrlw $4, %%ymm14, %%ymm15\n\t"                   \
  "vpand %[low], %%ymm14, %%ymm14\n\t"                \
  "vpand %[low], %%ymm15, %%ymm15\n\t"                \
  "vpshufb %%ymm14, %[lut], %%ymm14\n\t"              \
  "vpshufb %%ymm15, %[lut], %%ymm15\n\t"              \
  "vpaddb %%ymm14, " acc ", " acc "\n\t"               \
  "vpaddb %%ymm15, " acc ", " acc "\n\t"
#define QDSL_BIN_COL(waddr, acc0, acc1) \
  "vmovdqu " waddr ", %%ymm13\n\t" QDSL_BIN_ROW("%%ymm11", acc0) QDSL_BIN_ROW("%%ymm12", acc1)

// One 256-bit step of the 2 x 4 block into the byte counters b00..b13 (named variables in
// the caller; lut, low, lda and ldw_bytes too): rows a0 and a0 + lda, weight rows w0,
// w0 + ldw, w0 + 2 ldw and w3.
#define QDSL_BIN_STEP(a0_, w0_, w3_)                                                                         \
  asm volatile("vmovdqu (%[a0]), %%ymm11\n\t"                                                                \
               "vmovdqu (%[a0],%[lda]), %%ymm12\n\t" QDSL_BIN_COL("(%[w0])", "%[b00]", "%[b10]")            \
                   QDSL_BIN_COL("(%[w0],%[ldw])", "%[b01]", "%[b11]")                                          \
                       QDSL_BIN_COL("(%[w0],%[ldw],2)", "%[b02]", "%[b12]")                                    \
                           QDSL_BIN_COL("(%[w3])", "%[b03]", "%[b13]")                                         \
               : [b00] "+x"(b00), [b01] "+x"(b01), [b02] "+x"(b02), [b03] "+x"(b03), [b10] "+x"(b10),          \
                 [b11] "+x"(b11), [b12] "+x"(b12), [b13] "+x"(b13)                                             \
               : [a0] "r"(a0_), [lda] "r"(lda * 8), [w0] "r"(w0_), [w3] "r"(w3_), [ldw] "r"(ldw_bytes),        \
                 [lut] "x"(lut), [low] "x"(low)                                                                \
               : "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "memory")

// The four totals of four u64x4 vectors (each < 2^31) as int32 lanes.
inline __m128i Sums4(__m256i s0, __m256i s1, __m256i s2, __m256i s3) {
  const __m256i t01 = _mm256_or_si256(s0, _mm256_slli_epi64(s1, 32));  // [s0_i, s1_i] per 64-bit lane
  const __m256i t23 = _mm256_or_si256(s2, _mm256_slli_epi64(s3, 32));
  const __m256i x01 = _mm256_add_epi32(t01, _mm256_shuffle_epi32(t01, 0x4E));  // lanes 0+1, 2+3
  const __m256i x23 = _mm256_add_epi32(t23, _mm256_shuffle_epi32(t23, 0x4E));
  const __m256i v = _mm256_unpacklo_epi64(x01, x23);  // [s0, s1, s2, s3] per 128-bit half
  return _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
}

template <int MR, int NR>
void Block(const uint64_t* a, int64_t lda, const uint64_t* w, int64_t ldw, int64_t kwords, int32_t* pc,
           int64_t ldc) {
  const __m256i lut = _mm256_setr_epi8(0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4, 0, 1, 1, 2, 1, 2, 2, 3, 1, 2,
                                       2, 3, 2, 3, 3, 4);
  const __m256i low = _mm256_set1_epi8(0x0f);
  __m256i wide[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) wide[r][c] = _mm256_setzero_si256();
  const int64_t steps = kwords / 4;
  for (int64_t s0 = 0; s0 < steps; s0 += 31) {
    const int64_t s1 = s0 + 31 < steps ? s0 + 31 : steps;
    __m256i bytes[MR][NR];
    if (MR == 2 && NR == 4) {
      __m256i b00 = _mm256_setzero_si256(), b01 = b00, b02 = b00, b03 = b00, b10 = b00, b11 = b00, b12 = b00,
              b13 = b00;
      const uint64_t* w3 = w + 3 * ldw;
      const int64_t ldw_bytes = ldw * 8;
      for (int64_t s = s0; s < s1; ++s) {
        QDSL_BIN_STEP(a + 4 * s, w + 4 * s, w3 + 4 * s);
      }
      bytes[0][0] = b00, bytes[0][1] = b01, bytes[0][2] = b02, bytes[0][3] = b03;
      bytes[MR - 1][0] = b10, bytes[MR - 1][1] = b11, bytes[MR - 1][2] = b12, bytes[MR - 1][NR - 1] = b13;
    } else {
      for (int r = 0; r < MR; ++r)
        for (int c = 0; c < NR; ++c) bytes[r][c] = _mm256_setzero_si256();
      for (int64_t s = s0; s < s1; ++s) {
        for (int r = 0; r < MR; ++r) {
          const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + r * lda + 4 * s));
          for (int c = 0; c < NR; ++c) {
            const __m256i x =
                _mm256_xor_si256(av, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * ldw + 4 * s)));
            const __m256i lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(x, low));
            const __m256i hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(x, 4), low));
            bytes[r][c] = _mm256_add_epi8(bytes[r][c], _mm256_add_epi8(lo, hi));
          }
        }
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < NR; ++c)
        wide[r][c] = _mm256_add_epi64(wide[r][c], _mm256_sad_epu8(bytes[r][c], _mm256_setzero_si256()));
  }
  for (int r = 0; r < MR; ++r) {
    if (NR == 4) {  // vector totals straight into pc (a store, then scalar reloads, stalled)
      __m128i sum = Sums4(wide[r][0], wide[r][NR > 1 ? 1 : 0], wide[r][NR > 2 ? 2 : 0], wide[r][NR - 1]);
      if (steps * 4 < kwords) {
        alignas(16) int32_t tail[4] = {0, 0, 0, 0};
        for (int c = 0; c < NR; ++c)
          for (int64_t j = steps * 4; j < kwords; ++j)
            tail[c] += static_cast<int32_t>(_mm_popcnt_u64(a[r * lda + j] ^ w[c * ldw + j]));
        sum = _mm_add_epi32(sum, _mm_load_si128(reinterpret_cast<const __m128i*>(tail)));
      }
      _mm_storeu_si128(reinterpret_cast<__m128i*>(pc + r * ldc), sum);
      continue;
    }
    for (int c = 0; c < NR; ++c) {
      alignas(32) uint64_t lanes[4];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), wide[r][c]);
      uint64_t total = lanes[0] + lanes[1] + lanes[2] + lanes[3];
      for (int64_t j = steps * 4; j < kwords; ++j) total += _mm_popcnt_u64(a[r * lda + j] ^ w[c * ldw + j]);
      pc[r * ldc + c] = static_cast<int32_t>(total);
    }
  }
}

// The common case in one loop: 2 rows x (4 * nblocks) columns, K a whole number of
// 256-bit steps (<= 31, so the byte counters never wrap): no partial-sum arrays, the
// counters go straight through vpsadbw into pc (the general Block's bookkeeping was a
// third of the time at K = 1024).
void Rows2Short(const uint64_t* a, int64_t lda, const uint64_t* w, int64_t nblocks, int64_t ldw, int64_t steps,
                int32_t* pc, int64_t ldc) {
  const __m256i lut = _mm256_setr_epi8(0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4, 0, 1, 1, 2, 1, 2, 2, 3, 1, 2,
                                       2, 3, 2, 3, 3, 4);
  const __m256i low = _mm256_set1_epi8(0x0f);
  const int64_t ldw_bytes = ldw * 8;
  for (int64_t cb = 0; cb < nblocks; ++cb) {
    const uint64_t* wb = w + 4 * cb * ldw;
    const uint64_t* w3 = wb + 3 * ldw;
    __m256i b00 = _mm256_setzero_si256(), b01 = b00, b02 = b00, b03 = b00, b10 = b00, b11 = b00, b12 = b00, b13 = b00;
    for (int64_t s = 0; s < steps; ++s) {
      QDSL_BIN_STEP(a + 4 * s, wb + 4 * s, w3 + 4 * s);
    }
    const __m256i z = _mm256_setzero_si256();
    _mm_storeu_si128(reinterpret_cast<__m128i*>(pc + 4 * cb),
                     Sums4(_mm256_sad_epu8(b00, z), _mm256_sad_epu8(b01, z), _mm256_sad_epu8(b02, z),
                           _mm256_sad_epu8(b03, z)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(pc + ldc + 4 * cb),
                     Sums4(_mm256_sad_epu8(b10, z), _mm256_sad_epu8(b11, z), _mm256_sad_epu8(b12, z),
                           _mm256_sad_epu8(b13, z)));
  }
}

template <int MR>
void Row(const uint64_t* a, int64_t lda, const uint64_t* w, int64_t n, int64_t ldw, int64_t kwords, int32_t* pc,
         int64_t ldc) {
  int64_t c = 0;
  if (MR == 2 && kwords % 4 == 0 && kwords / 4 <= 31 && n >= 4) {
    Rows2Short(a, lda, w, n / 4, ldw, kwords / 4, pc, ldc);
    c = n / 4 * 4;
  }
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

namespace {

// Nibble-split operands (SplitNibbles): every byte is already < 16, so a popcount is one
// vpshufb: per 256 bits, 2 vpxor + 2 vpshufb + 2 vpaddb instead of 8 ops (the and/shift/and
// moved to packing: once per weight, once per activation row instead of once per pair).
// ymm11..14: a0 lo/hi, a1 lo/hi; ymm15: a weight half; ymm10: the XOR, then its counts.
#define QDSL_SPLIT_ROW(arow, acc)              \
  "vpxor %%ymm15, " arow ", %%ymm10\n\t"       \
  "vpshufb %%ymm10, %[lut], %%ymm10\n\t"       \
  "vpaddb %%ymm10, " acc ", " acc "\n\t"
#define QDSL_SPLIT_COL(wlo, whi, acc0, acc1)                                            \
  "vmovdqu " wlo ", %%ymm15\n\t" QDSL_SPLIT_ROW("%%ymm11", acc0) QDSL_SPLIT_ROW("%%ymm13", acc1) \
  "vmovdqu " whi ", %%ymm15\n\t" QDSL_SPLIT_ROW("%%ymm12", acc0) QDSL_SPLIT_ROW("%%ymm14", acc1)

// 2 rows x 4 columns over `steps` (<= 31) groups of 2 x 256 bits; pc gets the counts.
void Split2x4(const uint64_t* a, int64_t lda, const uint64_t* w, int64_t ldw, int64_t steps, int32_t* pc,
              int64_t ldc, __m256i lut) {
  __m256i b00 = _mm256_setzero_si256(), b01 = b00, b02 = b00, b03 = b00, b10 = b00, b11 = b00, b12 = b00, b13 = b00;
  const uint64_t* w3 = w + 3 * ldw;
  for (int64_t s = 0; s < steps; ++s) {
    asm volatile("vmovdqu (%[a0]), %%ymm11\n\t"
                 "vmovdqu 32(%[a0]), %%ymm12\n\t"
                 "vmovdqu (%[a0],%[lda]), %%ymm13\n\t"
                 "vmovdqu 32(%[a0],%[lda]), %%ymm14\n\t"
                 QDSL_SPLIT_COL("(%[w0])", "32(%[w0])", "%[b00]", "%[b10]")
                 QDSL_SPLIT_COL("(%[w0],%[ldw])", "32(%[w0],%[ldw])", "%[b01]", "%[b11]")
                 QDSL_SPLIT_COL("(%[w0],%[ldw],2)", "32(%[w0],%[ldw],2)", "%[b02]", "%[b12]")
                 QDSL_SPLIT_COL("(%[w3])", "32(%[w3])", "%[b03]", "%[b13]")
                 : [b00] "+x"(b00), [b01] "+x"(b01), [b02] "+x"(b02), [b03] "+x"(b03), [b10] "+x"(b10),
                   [b11] "+x"(b11), [b12] "+x"(b12), [b13] "+x"(b13)
                 : [a0] "r"(a + 8 * s), [lda] "r"(lda * 8), [w0] "r"(w + 8 * s), [w3] "r"(w3 + 8 * s),
                   [ldw] "r"(ldw * 8), [lut] "x"(lut)
                 : "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "memory");
  }
  const __m256i z = _mm256_setzero_si256();
  _mm_storeu_si128(reinterpret_cast<__m128i*>(pc),
                   Sums4(_mm256_sad_epu8(b00, z), _mm256_sad_epu8(b01, z), _mm256_sad_epu8(b02, z),
                         _mm256_sad_epu8(b03, z)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(pc + ldc),
                   Sums4(_mm256_sad_epu8(b10, z), _mm256_sad_epu8(b11, z), _mm256_sad_epu8(b12, z),
                         _mm256_sad_epu8(b13, z)));
}

}  // namespace

// a, w: nibble-split rows (2 * kwords words, row strides lda / ldw in words), kwords % 4 == 0.
void BinaryPopcountSplitAvx2(const uint64_t* a, int64_t m, int64_t lda, const uint64_t* w, int64_t n, int64_t ldw,
                             int64_t kwords, int32_t* pc, int64_t ldc) {
  const __m256i lut = _mm256_setr_epi8(0, 1, 1, 2, 1, 2, 2, 3, 1, 2, 2, 3, 2, 3, 3, 4, 0, 1, 1, 2, 1, 2, 2, 3, 1, 2,
                                       2, 3, 2, 3, 3, 4);
  const int64_t steps = kwords / 4, words = 2 * kwords;
  int64_t r = 0;
  if (steps <= 31) {
    for (; r + 2 <= m; r += 2)
      for (int64_t c = 0; c + 4 <= n; c += 4)
        Split2x4(a + r * lda, lda, w + c * ldw, ldw, steps, pc + r * ldc + c, ldc, lut);
  }
  // edges (odd row, last columns) and K past 31 steps (the driver does not send those):
  // scalar popcounts of the split words
  for (int64_t rr = 0; rr < m; ++rr)
    for (int64_t c = (rr < r ? n / 4 * 4 : 0); c < n; ++c) {
      int64_t total = 0;
      for (int64_t j = 0; j < words; ++j) total += _mm_popcnt_u64(a[rr * lda + j] ^ w[c * ldw + j]);
      pc[rr * ldc + c] = static_cast<int32_t>(total);
    }
}

}  // namespace x86
}  // namespace qdsl
