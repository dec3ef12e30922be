// AVX-VNNI int GEMM micro-kernels: 6 rows x 16 columns, u8 x s8 -> int32 via vpdpbusd.
//
// vpdpbusd multiplies four u8 x s8 pairs and adds them to an int32 lane with no
// intermediate rounding or saturation (the non-"s" form wraps only the int32 sum), so
// unlike vpmaddubsw it is exact for every int8 input.  Zero points are handled by
// offsets: with unsigned codes a_u (s8 activations are shifted by +128) and the signed
// weights w' = W - w_zp (which must fit int8; otherwise the packer leaves this format
// out and the int16 AVX2 kernel runs),
//   sum_k (a_u - z_u) w' = sum_k a_u w' - z_u * sum_k w'
// and the driver subtracts the precomputed column (or row) sum; everything is mod 2^32,
// exactly as the reference's wrapping int32 arithmetic.  32 MACs per multiply uop, twice
// the int16 vpmaddwd kernel.
//
// Two forms: GemmU8S8 broadcasts 4 activation bytes per row against s8 weight panels
// (linear layers, the kernel API); GemmS8U8 broadcasts 4 weight bytes per output channel
// against u8 activation panels (convs, whose output is then NCHW).  Panels hold, per
// k-quad, 16 columns x 4 bytes (columns 0..7 then 8..15).  No STL here (see the AVX2 file).
#pragma GCC target("avx2,fma,avxvnni")
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "kernels/x86/x86_kernels.h"

namespace qdsl {
namespace x86 {
namespace {

template <int MR, bool kBroadcastUnsigned>
void Kernel(const uint8_t* a, int64_t lda, const uint8_t* panel, int64_t kquads, int32_t* c, int64_t ldc,
            bool accumulate) {
  __m256i acc[MR][2];
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    if (accumulate) {
      acc[r][0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + r * ldc));
      acc[r][1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + r * ldc + 8));
    } else {
      acc[r][0] = _mm256_setzero_si256();
      acc[r][1] = _mm256_setzero_si256();
    }
  }
  int64_t q = 0;
  if (MR <= 2) {
    // Few rows: vpdpbusd accumulates in place (latency ~5 cycles), so two accumulators per
    // row would serialize; odd k-quads go to a second set, summed at the end.
    __m256i odd[MR][2];
#pragma GCC unroll 2
    for (int r = 0; r < MR; ++r) odd[r][0] = odd[r][1] = _mm256_setzero_si256();
    for (; q + 2 <= kquads; q += 2) {
      const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + q * 64));
      const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + q * 64 + 32));
      const __m256i c0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + q * 64 + 64));
      const __m256i c1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + q * 64 + 96));
#pragma GCC unroll 2
      for (int r = 0; r < MR; ++r) {
        int32_t quad0, quad1;
        std::memcpy(&quad0, a + r * lda + 4 * q, 4);
        std::memcpy(&quad1, a + r * lda + 4 * q + 4, 4);
        const __m256i a0 = _mm256_set1_epi32(quad0), a1 = _mm256_set1_epi32(quad1);
        if (kBroadcastUnsigned) {
          acc[r][0] = _mm256_dpbusd_avx_epi32(acc[r][0], a0, b0);
          acc[r][1] = _mm256_dpbusd_avx_epi32(acc[r][1], a0, b1);
          odd[r][0] = _mm256_dpbusd_avx_epi32(odd[r][0], a1, c0);
          odd[r][1] = _mm256_dpbusd_avx_epi32(odd[r][1], a1, c1);
        } else {
          acc[r][0] = _mm256_dpbusd_avx_epi32(acc[r][0], b0, a0);
          acc[r][1] = _mm256_dpbusd_avx_epi32(acc[r][1], b1, a0);
          odd[r][0] = _mm256_dpbusd_avx_epi32(odd[r][0], c0, a1);
          odd[r][1] = _mm256_dpbusd_avx_epi32(odd[r][1], c1, a1);
        }
      }
    }
#pragma GCC unroll 2
    for (int r = 0; r < MR; ++r) {
      acc[r][0] = _mm256_add_epi32(acc[r][0], odd[r][0]);
      acc[r][1] = _mm256_add_epi32(acc[r][1], odd[r][1]);
    }
  }
  for (; q < kquads; ++q) {
    const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + q * 64));
    const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + q * 64 + 32));
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      int32_t quad;
      std::memcpy(&quad, a + r * lda + 4 * q, 4);
      const __m256i av = _mm256_set1_epi32(quad);
      if (kBroadcastUnsigned) {  // broadcast u8 activations, s8 weight panel
        acc[r][0] = _mm256_dpbusd_avx_epi32(acc[r][0], av, b0);
        acc[r][1] = _mm256_dpbusd_avx_epi32(acc[r][1], av, b1);
      } else {  // broadcast s8 weights, u8 activation panel
        acc[r][0] = _mm256_dpbusd_avx_epi32(acc[r][0], b0, av);
        acc[r][1] = _mm256_dpbusd_avx_epi32(acc[r][1], b1, av);
      }
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + r * ldc), acc[r][0]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + r * ldc + 8), acc[r][1]);
  }
}

template <bool U>
void Dispatch(int rows, const uint8_t* a, int64_t lda, const uint8_t* panel, int64_t kquads, int32_t* c, int64_t ldc,
              bool accumulate) {
  switch (rows) {
    case 1: return Kernel<1, U>(a, lda, panel, kquads, c, ldc, accumulate);
    case 2: return Kernel<2, U>(a, lda, panel, kquads, c, ldc, accumulate);
    case 3: return Kernel<3, U>(a, lda, panel, kquads, c, ldc, accumulate);
    case 4: return Kernel<4, U>(a, lda, panel, kquads, c, ldc, accumulate);
    case 5: return Kernel<5, U>(a, lda, panel, kquads, c, ldc, accumulate);
    default: return Kernel<6, U>(a, lda, panel, kquads, c, ldc, accumulate);
  }
}

}  // namespace

void GemmU8S8AvxVnni(int rows, const uint8_t* a, int64_t lda, const uint8_t* panel, int64_t kquads, int32_t* c,
                     int64_t ldc, bool accumulate) {
  Dispatch<true>(rows, a, lda, panel, kquads, c, ldc, accumulate);
}

void GemmS8U8AvxVnni(int rows, const uint8_t* w, int64_t ldw, const uint8_t* panel, int64_t kquads, int32_t* c,
                     int64_t ldc, bool accumulate) {
  Dispatch<false>(rows, w, ldw, panel, kquads, c, ldc, accumulate);
}

}  // namespace x86
}  // namespace qdsl

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

}  // namespace x86
}  // namespace qdsl
