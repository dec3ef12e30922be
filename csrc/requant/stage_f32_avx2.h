// AVX2 form of the prepared FIXED_SINGLE stage (stage_f32.h) on eight int32 lanes, for
// kernels that apply the output stage from registers.  Included only by AVX2-compiled
// translation units; internal linkage (no AVX2 code can reach portable callers).
#ifndef QDSL_REQUANT_STAGE_F32_AVX2_H_
#define QDSL_REQUANT_STAGE_F32_AVX2_H_

#include <immintrin.h>

#include <cstdint>

#include "requant/rescale_avx2.h"
#include "requant/stage_f32.h"

namespace qdsl {
namespace x86 {
namespace {

// The stage's scalars broadcast once per kernel call.  thr2 (StageF32EstimateSq's test) is
// a float below thr^2, so d^2 < thr2 implies |d| < thr: thr^2 is exact in double (24-bit
// factors), scaled by 1 - 2^-22, then rounded in double and to float (each at most 2^-53 and
// 2^-24 up, relative).
struct StageF32Vec {
  __m256 lof, hif, thr2, half, sign;
  __m256i zp, loi, hii;
  explicit StageF32Vec(const StageF32& s)
      : lof(_mm256_set1_ps(s.lof)), hif(_mm256_set1_ps(s.hif)),
        thr2(_mm256_set1_ps(static_cast<float>(double(s.thr) * double(s.thr) * (1.0 - 1.0 / 4194304.0)))),
        half(_mm256_set1_ps(0.5f)), sign(_mm256_set1_ps(-0.0f)), zp(_mm256_set1_epi32(s.zp)),
        loi(_mm256_set1_epi32(s.lo)), hii(_mm256_set1_epi32(s.hi)) {}
};

// The exact integer form (qdsl/requant.h's FIXED_SINGLE), clamped, zero point added.
template <Rounding R>
inline __m256i StageF32Exact(__m256i x, __m256i mult, __m256i shift, const StageF32Vec& v) {
  const __m256i q = FixedSingle(x, mult, shift, R);
  return _mm256_add_epi32(_mm256_min_epi32(_mm256_max_epi32(q, v.loi), v.hii), v.zp);
}

// Codes (zero point added, clamped) of accumulators x for channels with estimate
// multipliers mf (SingleRowsF32's estimate in output_stage_avx2.cc), with the lanes the
// estimate cannot decide as the sign bits of *e: d = xc - r is exact (SingleRowsF32's
// proof), and *e = fl(d * d - thr2) (one fused rounding, which keeps the sign of the exact
// value, a zero counting as undecided) is negative only when d^2 < thr2 < thr^2, i.e.
// |d| < thr: the lanes the estimate decides.  Two ops per vector for the test (vsubps,
// vfmsubps; a mask took vsubps, vandnps, vcmpps, vorps), and the sign bits of several
// vectors combine with vandps into one vtestps.
template <Rounding R>
__attribute__((always_inline)) inline __m256i StageF32EstimateSq(__m256i x, __m256 mf, const StageF32Vec& v,
                                                                 __m256* e) {
  __m256 xf = _mm256_mul_ps(_mm256_cvtepi32_ps(x), mf);
  if (R == Rounding::kFloor) xf = _mm256_sub_ps(xf, v.half);
  xf = _mm256_min_ps(_mm256_max_ps(xf, v.lof), v.hif);
  const __m256 rf = _mm256_round_ps(xf, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 d = _mm256_sub_ps(xf, rf);
  *e = _mm256_fmsub_ps(d, d, v.thr2);
  return _mm256_add_epi32(_mm256_cvtps_epi32(rf), v.zp);
}

// Two groups of 16 channels as 32 codes: group 0 (a0 = channels c0..c0+7, b0 = c0+8..c0+15)
// in the low 128 bits, group 1 (a1, b1 from channel c1) in the high 128 bits, each in
// channel order: two rows of one 16-channel panel (igemm), or two channel blocks of one
// position (depthwise).  One flag test for all 32 lanes (any undecided lane recomputes all
// four vectors exactly), and the packs run on 256 bits: vpackssdw twice, one vpackuswb /
// vpacksswb, then vpermq and vpshufb put each group's bytes in order (five ops per 32 codes;
// packing each 16 on 128 bits took five).
template <Rounding R>
__attribute__((always_inline)) inline __m256i StageF32Codes32(__m256i a0, __m256i b0, __m256i a1, __m256i b1,
                                                              const StageF32& s, int64_t c0, int64_t c1,
                                                              const StageF32Vec& v, bool out_signed) {
  __m256 e0, e1, e2, e3;
  const float* mf = s.mf.data();
  __m256i y0 = StageF32EstimateSq<R>(a0, _mm256_loadu_ps(mf + c0), v, &e0);
  __m256i y1 = StageF32EstimateSq<R>(b0, _mm256_loadu_ps(mf + c0 + 8), v, &e1);
  __m256i y2 = StageF32EstimateSq<R>(a1, _mm256_loadu_ps(mf + c1), v, &e2);
  __m256i y3 = StageF32EstimateSq<R>(b1, _mm256_loadu_ps(mf + c1 + 8), v, &e3);
  // all sign bits set (every lane decided): vtestps's carry flag
  const __m256 all = _mm256_and_ps(_mm256_and_ps(e0, e1), _mm256_and_ps(e2, e3));
  if (__builtin_expect(!_mm256_testc_ps(all, v.sign), 0)) {
    const __m256i* m = reinterpret_cast<const __m256i*>(s.mult.data());
    const __m256i* sh = reinterpret_cast<const __m256i*>(s.shift.data());
    const int64_t k0 = c0 / 8, k1 = c1 / 8;  // (c0, c1: multiples of 16)
    y0 = StageF32Exact<R>(a0, _mm256_loadu_si256(m + k0), _mm256_loadu_si256(sh + k0), v);
    y1 = StageF32Exact<R>(b0, _mm256_loadu_si256(m + k0 + 1), _mm256_loadu_si256(sh + k0 + 1), v);
    y2 = StageF32Exact<R>(a1, _mm256_loadu_si256(m + k1), _mm256_loadu_si256(sh + k1), v);
    y3 = StageF32Exact<R>(b1, _mm256_loadu_si256(m + k1 + 1), _mm256_loadu_si256(sh + k1 + 1), v);
  }
  // codes are within [-128, 255]: every pack is exact.  Per 128-bit lane the int16 packs
  // hold [a0..a3 b0..b3 | a4..a7 b4..b7], the byte pack [g0 lo | g1 lo], [g0 hi | g1 hi]
  // (8 bytes each); vpermq(0, 2, 1, 3) gathers each group in its lane as a0-3 b0-3 a4-7
  // b4-7, and vpshufb makes that a0-7 b0-7.
  const __m256i p0 = _mm256_packs_epi32(y0, y1), p1 = _mm256_packs_epi32(y2, y3);
  const __m256i q = out_signed ? _mm256_packs_epi16(p0, p1) : _mm256_packus_epi16(p0, p1);
  const __m256i order = _mm256_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15,  //
                                         0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15);
  return _mm256_shuffle_epi8(_mm256_permute4x64_epi64(q, 0xD8), order);
}

}  // namespace
}  // namespace x86
}  // namespace qdsl

#endif  // QDSL_REQUANT_STAGE_F32_AVX2_H_
