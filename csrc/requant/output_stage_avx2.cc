// AVX2 output stage: the formula of qdsl/requant.h, eight channels at a time.
//
// SRDHM without 64-bit arithmetic shifts: for ab >= 0 the result is
// floor((ab + 2^30) / 2^31); for ab < 0, trunc((ab + 1 - 2^30) / 2^31) equals
// floor((ab + 1 - 2^30 + 2^31 - 1) / 2^31) = floor((ab + 2^30) / 2^31) as well.  So
// one 64-bit add of 2^30 and taking bits 31..62 (a logical shift gives the same low
// 32 bits as an arithmetic one) is exact; the lone overflow a = b = INT32_MIN is
// patched to INT32_MAX.  Before adding the zero point, y is clamped to +-2^24, which
// cannot change the final clamp because |zero_point| <= 2^16 and [qmin, qmax] lies
// in [-128, 255], and keeps y + zero_point in int32.  POT stages with a shift outside
// [0, 31] (rare: only left shifts and huge right shifts) use the scalar reference.
#pragma GCC target("avx2,fma,popcnt")
#include <immintrin.h>

#include <cstdint>

#include "kernels/x86/x86_kernels.h"
#include "ref/ref.h"

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

}  // namespace

bool RequantAvx2Supports(const OutputStage& stage) {
  const Rescale& r = stage.rescale;
  if (stage.zero_point < -(1 << 16) || stage.zero_point > (1 << 16)) return false;
  if (r.kind == RescaleKind::kFixed) return true;
  for (int64_t c = 0; c < r.channels; ++c) {
    if (r.shift[c] < 0 || r.shift[c] > 31) return false;
  }
  return true;
}

void RequantAvx2(const int32_t* acc, int64_t rows, int64_t cols, int64_t lda, const OutputStage& stage, int64_t c0,
                 void* out, int64_t ldo, bool out_signed) {
  if (!RequantAvx2Supports(stage)) {
    ref::Requant(acc, rows, cols, lda, stage, c0, out, ldo, out_signed);
    return;
  }
  const Rescale& rs = stage.rescale;
  const bool per_tensor = rs.channels == 1;
  const bool fixed = rs.kind == RescaleKind::kFixed;
  const __m256i zp = _mm256_set1_epi32(stage.zero_point);
  const __m256i qmin = _mm256_set1_epi32(stage.qmin), qmax = _mm256_set1_epi32(stage.qmax);
  const __m256i lim = _mm256_set1_epi32(1 << 24), nlim = _mm256_set1_epi32(-(1 << 24));
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t c = 0; c + 8 <= cols; c += 8) {
    __m256i mult, shift;
    if (per_tensor) {
      mult = _mm256_set1_epi32(rs.multiplier[0]);
      shift = _mm256_set1_epi32(rs.shift[0]);
    } else {
      mult = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rs.multiplier + c0 + c));
      shift = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rs.shift + c0 + c));
    }
    const __m256i left = _mm256_max_epi32(_mm256_sub_epi32(zero, shift), zero);
    const __m256i right = _mm256_max_epi32(shift, zero);
    for (int64_t r = 0; r < rows; ++r) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + r * lda + c));
      __m256i y = fixed ? Rdbp(Srdhm(SatShiftLeft(x, left), mult), right) : PotShift(x, shift, rs.rounding);
      y = _mm256_min_epi32(_mm256_max_epi32(y, nlim), lim);
      y = _mm256_min_epi32(_mm256_max_epi32(_mm256_add_epi32(y, zp), qmin), qmax);
      const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(y), _mm256_extracti128_si256(y, 1));
      const __m128i b = out_signed ? _mm_packs_epi16(w16, w16) : _mm_packus_epi16(w16, w16);
      _mm_storel_epi64(reinterpret_cast<__m128i*>(static_cast<uint8_t*>(out) + r * ldo + c), b);
    }
  }
  // Tail columns: the scalar reference (defined in another translation unit, so no
  // AVX2-compiled copy of an inline helper can leak to portable callers).
  const int64_t done = cols / 8 * 8;
  if (done < cols) {
    ref::Requant(acc + done, rows, cols - done, lda, stage, c0 + done,
                 static_cast<uint8_t*>(out) + done, ldo, out_signed);
  }
}

}  // namespace x86
}  // namespace qdsl
