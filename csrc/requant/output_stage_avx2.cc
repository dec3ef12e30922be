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
#include "requant/rescale_avx2.h"
#include "ref/ref.h"

namespace qdsl {
namespace x86 {
namespace {

// The rows of one call with the rescale kind and rounding fixed at compile time (their
// branches would otherwise run per vector).  Rows outer: the accumulator rows are read in
// order (a column-block walk down rows lda apart maps every row to the same L1 set when
// lda is a multiple of 1 KiB: 1.7x slower for FIXED_SINGLE on 64 x 1024).
template <RescaleKind K, Rounding R>
struct RequantRows {
  static void Run(const int32_t* acc, int64_t rows, int64_t cols, int64_t lda, const OutputStage& stage, int64_t c0,
                  uint8_t* out, int64_t ldo, bool out_signed) {
    const Rescale& rs = stage.rescale;
    const bool per_tensor = rs.channels == 1;
    const __m256i zp = _mm256_set1_epi32(stage.zero_point);
    const __m256i qmin = _mm256_set1_epi32(stage.qmin), qmax = _mm256_set1_epi32(stage.qmax);
    const __m256i mult1 = _mm256_set1_epi32(rs.multiplier[0]), shift1 = _mm256_set1_epi32(rs.shift[0]);
    for (int64_t r = 0; r < rows; ++r) {
      const int32_t* a = acc + r * lda;
      uint8_t* o = out + r * ldo;
      for (int64_t c = 0; c + 8 <= cols; c += 8) {
        const __m256i mult =
            per_tensor ? mult1 : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rs.multiplier + c0 + c));
        const __m256i shift = per_tensor ? shift1 : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rs.shift + c0 + c));
        const __m256i y = RescaleVec(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + c)), K, mult, shift, R);
        StoreCodes8(y, zp, qmin, qmax, out_signed, o + c);
      }
    }
  }
};

// I32 output stage rows (one channel, zero point 0): y = clamp(rescale(acc), qmin, qmax);
// kIdent: a POT shift of 0 (the exporter's residual accumulators), a clamped copy.
template <RescaleKind K, Rounding R, bool kIdent = false>
struct I32Rows {
  static void Run(const int32_t* acc, int64_t rows, int64_t cols, int64_t lda, const OutputStage& one, int32_t* out,
                  int64_t ldo) {
    const Rescale& rs = one.rescale;
    const __m256i mult = _mm256_set1_epi32(rs.multiplier[0]), shift = _mm256_set1_epi32(rs.shift[0]);
    const __m256i qmin = _mm256_set1_epi32(one.qmin), qmax = _mm256_set1_epi32(one.qmax);
    for (int64_t r = 0; r < rows; ++r) {
      const int32_t* a = acc + r * lda;
      int32_t* o = out + r * ldo;
      int64_t i = 0;
      for (; i + 8 <= cols; i += 8) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + i));
        const __m256i y = kIdent ? x : RescaleVec(x, K, mult, shift, R);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i), _mm256_min_epi32(_mm256_max_epi32(y, qmin), qmax));
      }
      for (; i < cols; ++i) o[i] = ref::StageOne(a[i], one);
    }
  }
};

// F<K, R>::Run for a run-time kind and rounding (FIXED rounds half away only).
template <template <RescaleKind, Rounding, bool...> class F>
auto Pick(const Rescale& rs) -> decltype(&F<RescaleKind::kFixed, Rounding::kHalfAway>::Run) {
  using K = RescaleKind;
  using R = Rounding;
  if (rs.kind == K::kFixed) return F<K::kFixed, R::kHalfAway>::Run;
  const bool pot = rs.kind == K::kPot;
  switch (rs.rounding) {
    case R::kHalfEven: return pot ? F<K::kPot, R::kHalfEven>::Run : F<K::kFixedSingle, R::kHalfEven>::Run;
    case R::kFloor: return pot ? F<K::kPot, R::kFloor>::Run : F<K::kFixedSingle, R::kFloor>::Run;
    case R::kHalfUp: return pot ? F<K::kPot, R::kHalfUp>::Run : F<K::kFixedSingle, R::kHalfUp>::Run;
    default: return pot ? F<K::kPot, R::kHalfAway>::Run : F<K::kFixedSingle, R::kHalfAway>::Run;
  }
}

}  // namespace

bool RequantAvx2Supports(const OutputStage& stage) {
  const Rescale& r = stage.rescale;
  if (stage.zero_point < -(1 << 16) || stage.zero_point > (1 << 16)) return false;
  if (r.kind != RescaleKind::kPot) return true;  // FIXED / FIXED_SINGLE shifts are in [-31, 31]
  for (int64_t c = 0; c < r.channels; ++c) {
    if (r.shift[c] < -31 || r.shift[c] > 31) return false;
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
  Pick<RequantRows>(rs)(acc, rows, cols, lda, stage, c0, static_cast<uint8_t*>(out), ldo, out_signed);
  // Tail columns: the scalar reference (defined in another translation unit, so no
  // AVX2-compiled copy of an inline helper can leak to portable callers).
  const int64_t done = cols / 8 * 8;
  if (done < cols) {
    ref::Requant(acc + done, rows, cols - done, lda, stage, c0 + done,
                 static_cast<uint8_t*>(out) + done, ldo, out_signed);
  }
}

void RequantI32Avx2(const int32_t* acc, int64_t n, const OutputStage& one, int32_t* out) {
  RequantI32RowsAvx2(acc, 1, n, n, one, out, n);
}

// The same over `rows` runs of `cols` (acc rows lda apart, out rows ldo apart), one
// channel: the conv's images of one output channel in one call instead of one per image.
void RequantI32RowsAvx2(const int32_t* acc, int64_t rows, int64_t cols, int64_t lda, const OutputStage& one,
                        int32_t* out, int64_t ldo) {
  const Rescale& rs = one.rescale;
  if (!RequantAvx2Supports(one) || one.zero_point != 0) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < cols; ++i) out[r * ldo + i] = ref::StageOne(acc[r * lda + i], one);
    return;
  }
  if (rs.kind == RescaleKind::kPot && rs.shift[0] == 0) {
    I32Rows<RescaleKind::kPot, Rounding::kHalfAway, true>::Run(acc, rows, cols, lda, one, out, ldo);
    return;
  }
  Pick<I32Rows>(rs)(acc, rows, cols, lda, one, out, ldo);
}

}  // namespace x86
}  // namespace qdsl
