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

// The stage's scalars broadcast once per kernel call.
struct StageF32Vec {
  __m256 lof, hif, thr, half, sign;
  __m256i zp, loi, hii;
  explicit StageF32Vec(const StageF32& s)
      : lof(_mm256_set1_ps(s.lof)), hif(_mm256_set1_ps(s.hif)), thr(_mm256_set1_ps(s.thr)),
        half(_mm256_set1_ps(0.5f)), sign(_mm256_set1_ps(-0.0f)), zp(_mm256_set1_epi32(s.zp)),
        loi(_mm256_set1_epi32(s.lo)), hii(_mm256_set1_epi32(s.hi)) {}
};

// Codes (zero point added, clamped) of accumulators x for channels with estimate
// multipliers mf; lanes the estimate cannot decide set bits of *flag (SingleRowsF32's proof).
template <Rounding R>
__attribute__((always_inline)) inline __m256i StageF32Estimate(__m256i x, __m256 mf, const StageF32Vec& v,
                                                               __m256* flag) {
  __m256 xf = _mm256_mul_ps(_mm256_cvtepi32_ps(x), mf);
  if (R == Rounding::kFloor) xf = _mm256_sub_ps(xf, v.half);
  xf = _mm256_min_ps(_mm256_max_ps(xf, v.lof), v.hif);
  const __m256 rf = _mm256_round_ps(xf, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  *flag = _mm256_or_ps(*flag, _mm256_cmp_ps(_mm256_andnot_ps(v.sign, _mm256_sub_ps(xf, rf)), v.thr, _CMP_GT_OQ));
  return _mm256_add_epi32(_mm256_cvtps_epi32(rf), v.zp);  // rf is integral: the conversion is exact
}

// The exact integer form (qdsl/requant.h's FIXED_SINGLE), clamped, zero point added.
template <Rounding R>
inline __m256i StageF32Exact(__m256i x, __m256i mult, __m256i shift, const StageF32Vec& v) {
  const __m256i q = FixedSingle(x, mult, shift, R);
  return _mm256_add_epi32(_mm256_min_epi32(_mm256_max_epi32(q, v.loi), v.hii), v.zp);
}

// 16 channels c0..c0+15 of one position (a = channels 0..7, b = 8..15) as 16 codes, in order.
template <Rounding R>
__attribute__((always_inline)) inline __m128i StageF32Codes16(__m256i a, __m256i b, const StageF32& s, int64_t c0,
                                                              const StageF32Vec& v, bool out_signed) {
  __m256 flag = _mm256_setzero_ps();
  __m256i ya = StageF32Estimate<R>(a, _mm256_loadu_ps(s.mf.data() + c0), v, &flag);
  __m256i yb = StageF32Estimate<R>(b, _mm256_loadu_ps(s.mf.data() + c0 + 8), v, &flag);
  if (__builtin_expect(!_mm256_testz_ps(flag, flag), 0)) {
    const int32_t* m = s.mult.data() + c0;
    const int32_t* sh = s.shift.data() + c0;
    ya = StageF32Exact<R>(a, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m)),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sh)), v);
    yb = StageF32Exact<R>(b, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + 8)),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sh + 8)), v);
  }
  // codes are within [-128, 255]: both packs are exact
  const __m128i wa = _mm_packs_epi32(_mm256_castsi256_si128(ya), _mm256_extracti128_si256(ya, 1));
  const __m128i wb = _mm_packs_epi32(_mm256_castsi256_si128(yb), _mm256_extracti128_si256(yb, 1));
  return out_signed ? _mm_packs_epi16(wa, wb) : _mm_packus_epi16(wa, wb);
}

}  // namespace
}  // namespace x86
}  // namespace qdsl

#endif  // QDSL_REQUANT_STAGE_F32_AVX2_H_
