// int4/int2 weight panels -> VNNI int8 quad layout, four k-quads (256 output bytes) per
// step with AVX-512BW.  Same contract and result as the SSE version in
// gemm_u8s8_6x16_avxvnni.cc (which documents the layouts); the AMX driver widens a panel
// pair per call, so on int4 layers this runs once per 16 weight columns x all of K.
#pragma GCC target("avx512f,avx512bw,avx512vl")
// gcc 12 flags its own AVX-512 intrinsics (_mm512_undefined_* inside them) as uninitialized
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cstdint>

#include "kernels/x86/x86_kernels.h"

namespace qdsl {
namespace x86 {

void UnpackPanelToVnniAvx512(int bits, const uint8_t* src, int64_t quads, uint8_t* dst) {
  int64_t q = 0;
  // Lane l (128 bits) of each zmm holds quad q + l; the unpacks work per 128-bit lane,
  // so the SSE algorithm runs on four quads at once and the results stay in quad order.
  const __m512i m4 = _mm512_set1_epi8(0x0F), h4 = _mm512_set1_epi8(0x08);
  const __m512i m2 = _mm512_set1_epi8(0x03), h2 = _mm512_set1_epi8(0x02);
  // output: quad q's 64 bytes = [b0a | b0b | b1a | b1b] (16 bytes each)
  const __m512i idx_lo = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);   // (a0 a1)(b0 b1) of lanes 0,1
  const __m512i idx_hi = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);  // lanes 2,3
  for (; q + 4 <= quads; q += 4) {
    __m512i b0a, b0b, b1a, b1b;
    if (bits == 4) {
      // quad q is 32 bytes: x0 (pair 2q) then x1 (pair 2q+1); gather x0s and x1s of 4 quads
      const __m512i v0 = _mm512_loadu_si512(src + q * 32);        // quads q, q+1: x0 x1 x0 x1
      const __m512i v1 = _mm512_loadu_si512(src + q * 32 + 64);   // quads q+2, q+3
      const __m512i x0 = _mm512_shuffle_i64x2(v0, v1, _MM_SHUFFLE(2, 0, 2, 0));  // x0 of q..q+3
      const __m512i x1 = _mm512_shuffle_i64x2(v0, v1, _MM_SHUFFLE(3, 1, 3, 1));  // x1 of q..q+3
      auto lo = [&](__m512i x) { return _mm512_sub_epi8(_mm512_xor_si512(_mm512_and_si512(x, m4), h4), h4); };
      auto hi = [&](__m512i x) {
        return _mm512_sub_epi8(_mm512_xor_si512(_mm512_and_si512(_mm512_srli_epi16(x, 4), m4), h4), h4);
      };
      const __m512i l0 = lo(x0), l1 = lo(x1), g0 = hi(x0), g1 = hi(x1);
      b0a = _mm512_unpacklo_epi16(l0, l1);
      b0b = _mm512_unpackhi_epi16(l0, l1);
      b1a = _mm512_unpacklo_epi16(g0, g1);
      b1b = _mm512_unpackhi_epi16(g0, g1);
    } else {
      const __m512i x = _mm512_loadu_si512(src + q * 16);  // 16 bytes per quad
      auto f = [&](int s) {
        return _mm512_sub_epi8(_mm512_xor_si512(_mm512_and_si512(_mm512_srli_epi16(x, s), m2), h2), h2);
      };
      const __m512i f0 = f(0), f1 = f(2), f2 = f(4), f3 = f(6);
      b0a = _mm512_unpacklo_epi16(f0, f2);
      b0b = _mm512_unpackhi_epi16(f0, f2);
      b1a = _mm512_unpacklo_epi16(f1, f3);
      b1b = _mm512_unpackhi_epi16(f1, f3);
    }
    // lane l of (b0a, b0b, b1a, b1b) are quad q+l's four 16-byte pieces: interleave them
    const __m512i ab_lo = _mm512_permutex2var_epi64(b0a, idx_lo, b0b);  // q: b0a b0b | q+1: b0a b0b
    const __m512i cd_lo = _mm512_permutex2var_epi64(b1a, idx_lo, b1b);  // q: b1a b1b | q+1: b1a b1b
    const __m512i ab_hi = _mm512_permutex2var_epi64(b0a, idx_hi, b0b);  // q+2, q+3
    const __m512i cd_hi = _mm512_permutex2var_epi64(b1a, idx_hi, b1b);
    uint8_t* out = dst + q * 64;
    _mm512_storeu_si512(out, _mm512_shuffle_i64x2(ab_lo, cd_lo, _MM_SHUFFLE(1, 0, 1, 0)));        // quad q
    _mm512_storeu_si512(out + 64, _mm512_shuffle_i64x2(ab_lo, cd_lo, _MM_SHUFFLE(3, 2, 3, 2)));   // quad q+1
    _mm512_storeu_si512(out + 128, _mm512_shuffle_i64x2(ab_hi, cd_hi, _MM_SHUFFLE(1, 0, 1, 0)));  // quad q+2
    _mm512_storeu_si512(out + 192, _mm512_shuffle_i64x2(ab_hi, cd_hi, _MM_SHUFFLE(3, 2, 3, 2)));  // quad q+3
  }
  if (q < quads) UnpackPanelToVnni(bits, src + q * (bits == 4 ? 32 : 16), quads - q, dst + q * 64);
}

}  // namespace x86
}  // namespace qdsl
