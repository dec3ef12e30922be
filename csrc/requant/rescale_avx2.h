// AVX2 building blocks of the rescale formulas (qdsl/requant.h), eight int32 lanes at a
// time.  Included only by AVX2-compiled translation units; everything here has internal
// linkage, so no AVX2 code can be picked up by portable callers.
#ifndef QDSL_REQUANT_RESCALE_AVX2_H_
#define QDSL_REQUANT_RESCALE_AVX2_H_

#include <immintrin.h>

#include <cstdint>

#include "qdsl/requant.h"

namespace qdsl {
namespace x86 {
namespace {

inline __m256i Srdhm(__m256i a, __m256i b) {
  const __m256i nudge = _mm256_set1_epi64x(int64_t{1} << 30);
  const __m256i even = _mm256_add_epi64(_mm256_mul_epi32(a, b), nudge);
  const __m256i odd = _mm256_add_epi64(_mm256_mul_epi32(_mm256_srli_epi64(a, 32), _mm256_srli_epi64(b, 32)), nudge);
  const __m256i res = _mm256_blend_epi32(_mm256_srli_epi64(even, 31), _mm256_slli_epi64(odd, 1), 0xAA);
  const __m256i minv = _mm256_set1_epi32(INT32_MIN);
  const __m256i both = _mm256_and_si256(_mm256_cmpeq_epi32(a, minv), _mm256_cmpeq_epi32(b, minv));
  return _mm256_blendv_epi8(res, _mm256_set1_epi32(INT32_MAX), both);
}

inline __m256i Rdbp(__m256i x, __m256i e) {
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i mask = _mm256_sub_epi32(_mm256_sllv_epi32(one, e), one);
  const __m256i rem = _mm256_and_si256(x, mask);
  const __m256i neg = _mm256_cmpgt_epi32(_mm256_setzero_si256(), x);
  const __m256i threshold = _mm256_sub_epi32(_mm256_srli_epi32(mask, 1), neg);
  return _mm256_sub_epi32(_mm256_srav_epi32(x, e), _mm256_cmpgt_epi32(rem, threshold));
}

// Saturating per-lane left shift by l in [0, 31]: overflow iff shifting back differs.
inline __m256i SatShiftLeft(__m256i x, __m256i l) {
  const __m256i y = _mm256_sllv_epi32(x, l);
  const __m256i ok = _mm256_cmpeq_epi32(_mm256_srav_epi32(y, l), x);
  const __m256i sat = _mm256_blendv_epi8(_mm256_set1_epi32(INT32_MAX), _mm256_set1_epi32(INT32_MIN), _mm256_srai_epi32(x, 31));
  return _mm256_blendv_epi8(sat, y, ok);
}

// POT right shift by s in [1, 31] (s = 0 passes through) with the stage's rounding.
inline __m256i PotShift(__m256i x, __m256i s, Rounding rounding) {
  const __m256i one = _mm256_set1_epi32(1), zero = _mm256_setzero_si256();
  const __m256i f = _mm256_srav_epi32(x, s);
  const __m256i rem = _mm256_and_si256(x, _mm256_sub_epi32(_mm256_sllv_epi32(one, s), one));
  const __m256i h = _mm256_srli_epi32(_mm256_sllv_epi32(one, s), 1);  // 2^(s-1); 0 when s = 0
  const __m256i gt = _mm256_cmpgt_epi32(rem, h), eq = _mm256_cmpeq_epi32(rem, h);
  __m256i up;
  switch (rounding) {
    case Rounding::kHalfAway:
      up = _mm256_or_si256(gt, _mm256_andnot_si256(_mm256_cmpgt_epi32(zero, x), eq));
      break;
    case Rounding::kHalfEven:
      up = _mm256_or_si256(gt, _mm256_and_si256(eq, _mm256_cmpeq_epi32(_mm256_and_si256(f, one), one)));
      break;
    case Rounding::kHalfUp: up = _mm256_or_si256(gt, eq); break;
    default: up = zero; break;
  }
  up = _mm256_andnot_si256(_mm256_cmpeq_epi32(s, zero), up);  // s = 0: exact, never round
  return _mm256_sub_epi32(f, up);
}


// FIXED_SINGLE on four 64-bit lanes: r = round(p / 2^s) for p = t * m and s = 31 + right
// in [31, 62], taken as floor((p + bias) / 2^s) with the rounding in the bias (2^(s-1) for
// the half modes, minus 1 for negative p in HALF_AWAY) and, for HALF_EVEN, bit 0 cleared on
// exact ties.  AVX2 has no 64-bit arithmetic shift: the floor is taken on p + bias + 2^62,
// which is in (0, 2^64) as an unsigned number (|p| < 2^62), with a logical shift, and
// 2^(62 - s) is subtracted (2^62 is a multiple of 2^s, so the low s bits are unchanged).
// No sat32 is needed: t is an int32 and m in [0, 2^31) (validated), so |p| / 2^s <=
// (2^31 - 1)^2 / 2^31 < 2^31 - 1.5 and p / 2^s >= -m > -2^31: every rounding fits int32.
// (The ADD's POT right shifts in [32, 62] use it on int32 values p too: |p / 2^s| <= 1.)
// The per-channel terms (2^s, 2^(s-1), 2^(62-s)) depend on s only: callers' loops over
// rows hoist them.
inline __m256i RoundShift64(__m256i p, __m256i s, Rounding rounding) {
  const __m256i one = _mm256_set1_epi64x(1);
  const __m256i big = _mm256_set1_epi64x(int64_t{1} << 62);
  const __m256i pow = _mm256_sllv_epi64(one, s);
  const __m256i off = _mm256_srlv_epi64(big, s);
  __m256i x = _mm256_add_epi64(p, big);
  if (rounding != Rounding::kFloor) x = _mm256_add_epi64(x, _mm256_srli_epi64(pow, 1));
  if (rounding == Rounding::kHalfAway) x = _mm256_add_epi64(x, _mm256_cmpgt_epi64(_mm256_setzero_si256(), p));
  __m256i q = _mm256_sub_epi64(_mm256_srlv_epi64(x, s), off);
  if (rounding == Rounding::kHalfEven) {  // a tie rounded up to an odd q goes back to even
    const __m256i tie = _mm256_cmpeq_epi64(_mm256_and_si256(x, _mm256_sub_epi64(pow, one)), _mm256_setzero_si256());
    q = _mm256_andnot_si256(_mm256_and_si256(tie, one), q);
  }
  return q;
}

inline __m256i FixedSingle(__m256i t, __m256i m, __m256i right, Rounding rounding) {
  const __m256i low32 = _mm256_set1_epi64x(0xFFFFFFFFll), c31 = _mm256_set1_epi64x(31);
  const __m256i s_even = _mm256_add_epi64(_mm256_and_si256(right, low32), c31);
  const __m256i s_odd = _mm256_add_epi64(_mm256_srli_epi64(right, 32), c31);
  const __m256i even = RoundShift64(_mm256_mul_epi32(t, m), s_even, rounding);
  const __m256i odd = RoundShift64(_mm256_mul_epi32(_mm256_srli_epi64(t, 32), _mm256_srli_epi64(m, 32)), s_odd, rounding);
  return _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
}

// Rescale of int32 lanes with per-lane multiplier and shift (FIXED, FIXED_SINGLE), or POT
// with shifts in [-31, 31] (callers check); equals RescaleOne for int32 inputs.
inline __m256i RescaleVec(__m256i x, RescaleKind kind, __m256i mult, __m256i shift, Rounding rounding) {
  const __m256i zero = _mm256_setzero_si256();
  const __m256i left = _mm256_max_epi32(_mm256_sub_epi32(zero, shift), zero);
  const __m256i right = _mm256_max_epi32(shift, zero);
  const __m256i t = _mm256_testz_si256(left, left) ? x : SatShiftLeft(x, left);  // left shifts are rare
  if (kind == RescaleKind::kFixed) return Rdbp(Srdhm(t, mult), right);
  if (kind == RescaleKind::kFixedSingle) return FixedSingle(t, mult, right, rounding);
  return PotShift(t, right, rounding);
}

// sat32(a + b): overflow iff both signs agree and the sum's sign differs.
inline __m256i SatAdd32(__m256i a, __m256i b) {
  const __m256i sum = _mm256_add_epi32(a, b);
  const __m256i ovf = _mm256_andnot_si256(_mm256_xor_si256(a, b), _mm256_xor_si256(a, sum));
  const __m256i sat = _mm256_xor_si256(_mm256_srai_epi32(a, 31), _mm256_set1_epi32(INT32_MAX));
  return _mm256_blendv_epi8(sum, sat, _mm256_srai_epi32(ovf, 31));
}

// The end of an I8/U8 output stage on eight rescaled lanes y: clamp(y + zp, qmin, qmax)
// stored as 8 bytes.  y is clamped to +-2^24 first, which cannot change the result
// (|zp| <= 2^16 and [qmin, qmax] lies in [-128, 255]) and keeps y + zp in int32.
inline void StoreCodes8(__m256i y, __m256i zp, __m256i qmin, __m256i qmax, bool out_signed, uint8_t* out) {
  y = _mm256_min_epi32(_mm256_max_epi32(y, _mm256_set1_epi32(-(1 << 24))), _mm256_set1_epi32(1 << 24));
  y = _mm256_min_epi32(_mm256_max_epi32(_mm256_add_epi32(y, zp), qmin), qmax);
  const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(y), _mm256_extracti128_si256(y, 1));
  const __m128i b = out_signed ? _mm_packs_epi16(w16, w16) : _mm_packus_epi16(w16, w16);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), b);
}

}  // namespace
}  // namespace x86
}  // namespace qdsl

#endif  // QDSL_REQUANT_RESCALE_AVX2_H_
