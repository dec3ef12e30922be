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
#include <cstring>

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

// Channel ch's stage as a one-channel stage (ref::StageOne applies channel 0).
inline OutputStage ChannelStage(const OutputStage& stage, int64_t ch) {
  OutputStage one = stage;
  if (stage.rescale.channels != 1) {
    one.rescale.multiplier += ch;
    one.rescale.shift += ch;
    one.rescale.channels = 1;
  }
  return one;
}

// I32 output stage per column (channel c0 + c) over a [rows][cols] block, zero point 0:
// the implicit-GEMM conv's [positions][channels] tiles.  Tail columns: the scalar rule.
template <RescaleKind K, Rounding R, bool kIdent = false>
struct I32ColRows {
  static void Run(const int32_t* acc, int64_t rows, int64_t cols, int64_t lda, const OutputStage& stage, int64_t c0,
                  int32_t* out, int64_t ldo) {
    const Rescale& rs = stage.rescale;
    const bool per_tensor = rs.channels == 1;
    const __m256i mult1 = _mm256_set1_epi32(rs.multiplier[0]), shift1 = _mm256_set1_epi32(rs.shift[0]);
    const __m256i qmin = _mm256_set1_epi32(stage.qmin), qmax = _mm256_set1_epi32(stage.qmax);
    for (int64_t r = 0; r < rows; ++r) {
      const int32_t* a = acc + r * lda;
      int32_t* o = out + r * ldo;
      int64_t c = 0;
      for (; c + 8 <= cols; c += 8) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + c));
        __m256i y = x;
        if (!kIdent) {
          const __m256i mult =
              per_tensor ? mult1 : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rs.multiplier + c0 + c));
          const __m256i shift =
              per_tensor ? shift1 : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rs.shift + c0 + c));
          y = RescaleVec(x, K, mult, shift, R);
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c), _mm256_min_epi32(_mm256_max_epi32(y, qmin), qmax));
      }
      for (; c < cols; ++c) o[c] = ref::StageOne(a[c], ChannelStage(stage, c0 + c));
    }
  }
};

// FIXED_SINGLE, one channel per call (the conv paths stage one channel row or plane per
// call), right shift >= 0: a float32 estimate, checked, with the exact integer form as the
// fallback.  The result is bit-exact; the proof:
//   x = t * M exactly, M = m / 2^s (s = 31 + right in [31, 62], t the int32 accumulator);
//   the estimate is xf = fl(fl(t) * fl(M)) (each fl rounds to nearest float32, relative
//   error u = 2^-24; no underflow: M >= 2^-62 or M = 0), so |xf - x| <= 3.1u |x|.  FLOOR
//   rounds x' = x - 1/2 to nearest instead (floor(x) = nearest(x - 1/2) unless x is an
//   integer, i.e. x' a tie), one more rounding of at most u |xf'|.  The stage's output
//   range is [lo, hi] = [qmin - zp, qmax - zp] (integers, |lo|, |hi| < 2^17 since
//   |zp| <= 2^16), B = max(|lo|, |hi|) + 1, and E = 2^-21 B + 2^-24 bounds |xf' - x'|
//   whenever xf' lies in [lo - 1/2, hi + 1/2].
//   * xf' clamped to xc in [lo, hi]: rounding commutes with a clamp to integer bounds
//     (it is monotone and fixes integers), so clamp(round(x')) is wanted.
//   * xc = hi < xf': then x' > hi - 1/2 (the relative error cannot bridge 1/2 at < 2^17), so
//     round(x') >= hi, and the clamp gives hi = xc.  The same for lo.
//   * otherwise xc = xf' and |x' - xc| <= E: with r = nearest(xc) (exact: |xc| < 2^22) and
//     d = |xc - r| (exact), d <= thr < 1/2 - 2E puts the nearest half-integer at least 2E
//     from xc, so x' lies strictly between the same two half-integers: every rounding mode
//     gives r (a tie is never inside the band).  Lanes with d > thr (ties and near-ties,
//     about 4E of all values, ~0.05 % for 8-bit outputs) flag their vector, which is then
//     recomputed with FixedSingle, the exact integer form.
inline __m256i LoadI32(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

template <Rounding R>
void SingleRowsF32(const int32_t* acc, int64_t rows, int64_t cols, int64_t lda, int32_t addend,
                   const OutputStage& stage, uint8_t* out, int64_t ldo, bool out_signed) {
  const int32_t m = stage.rescale.multiplier[0], right = stage.rescale.shift[0];
  const int32_t lo = stage.qmin - stage.zero_point, hi = stage.qmax - stage.zero_point;
  // plain arithmetic, no std:: templates: an AVX2-compiled copy of an inline function could
  // be the one the linker keeps for portable callers (powers of two divide exactly)
  const int64_t alo = lo < 0 ? -int64_t{lo} : lo, ahi = hi < 0 ? -int64_t{hi} : hi;
  const double bound = double(alo > ahi ? alo : ahi) + 1.0, u = 1.0 / 16777216.0;  // u = 2^-24
  const double e = bound * (8 * u) + u;
  const __m256 mf = _mm256_set1_ps(static_cast<float>(double(m) / 2147483648.0 / double(int64_t{1} << right)));
  const __m256 thr = _mm256_set1_ps(static_cast<float>(0.5 - 2 * e - u));
  const __m256 lof = _mm256_set1_ps(float(lo)), hif = _mm256_set1_ps(float(hi));
  const __m256 half = _mm256_set1_ps(0.5f), sign = _mm256_set1_ps(-0.0f);
  const __m256i zp = _mm256_set1_epi32(stage.zero_point);
  const __m256i loi = _mm256_set1_epi32(lo), hii = _mm256_set1_epi32(hi);
  const __m256i mult = _mm256_set1_epi32(m), shift = _mm256_set1_epi32(right);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256i add = _mm256_set1_epi32(addend);
  // the accumulators plus the addend (a conv's bias; the caller guarantees no overflow)
  auto at = [&](const int32_t* p) { return _mm256_add_epi32(LoadI32(p), add); };
  // codes of 8 lanes; `flag` collects the lanes the estimate cannot decide
  auto estimate = [&](__m256i x, __m256& flag) {
    __m256 xf = _mm256_mul_ps(_mm256_cvtepi32_ps(x), mf);
    if (R == Rounding::kFloor) xf = _mm256_sub_ps(xf, half);
    xf = _mm256_min_ps(_mm256_max_ps(xf, lof), hif);
    const __m256 rf = _mm256_round_ps(xf, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    flag = _mm256_or_ps(flag, _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_sub_ps(xf, rf)), thr, _CMP_GT_OQ));
    return _mm256_add_epi32(_mm256_cvtps_epi32(rf), zp);  // rf is integral: the conversion is exact
  };
  auto exact = [&](__m256i x) {
    const __m256i r = FixedSingle(x, mult, shift, R);
    return _mm256_add_epi32(_mm256_min_epi32(_mm256_max_epi32(r, loi), hii), zp);
  };
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t* a = acc + r * lda;
    uint8_t* o = out + r * ldo;
    int64_t c = 0;
    for (; c + 32 <= cols; c += 32) {
      __m256 flag = _mm256_setzero_ps();
      __m256i y0 = estimate(at(a + c), flag), y1 = estimate(at(a + c + 8), flag);
      __m256i y2 = estimate(at(a + c + 16), flag), y3 = estimate(at(a + c + 24), flag);
      if (!_mm256_testz_ps(flag, flag)) {
        y0 = exact(at(a + c));
        y1 = exact(at(a + c + 8));
        y2 = exact(at(a + c + 16));
        y3 = exact(at(a + c + 24));
      }
      // codes are within [-128, 255]: both packs are exact; the permute undoes the lane split
      const __m256i w01 = _mm256_packs_epi32(y0, y1), w23 = _mm256_packs_epi32(y2, y3);
      const __m256i b = out_signed ? _mm256_packs_epi16(w01, w23) : _mm256_packus_epi16(w01, w23);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c), _mm256_permutevar8x32_epi32(b, order));
    }
    // the rest in blocks of 8 (one 8-byte store each), the last partial one through a
    // masked load and byte stores (no scalar tail; no memcpy calls: on 7 x 7 planes the
    // tails were most of a row)
    for (; c < cols; c += 8) {
      const int64_t n = cols - c < 8 ? cols - c : 8;
      __m256i x;
      if (n == 8) {
        x = at(a + c);
      } else {  // masked lanes read as 0 and do not touch memory
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(n)),
                                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        x = _mm256_add_epi32(_mm256_maskload_epi32(a + c, mask), add);
      }
      __m256 flag = _mm256_setzero_ps();
      __m256i y = estimate(x, flag);
      if (!_mm256_testz_ps(flag, flag)) y = exact(x);
      const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(y), _mm256_extracti128_si256(y, 1));
      const __m128i b = out_signed ? _mm_packs_epi16(w16, w16) : _mm_packus_epi16(w16, w16);
      if (n == 8) {
        _mm_storel_epi64(reinterpret_cast<__m128i*>(o + c), b);
      } else {
        alignas(16) uint8_t codes[16];
        _mm_store_si128(reinterpret_cast<__m128i*>(codes), b);
        for (int64_t i = 0; i < n; ++i) o[c + i] = codes[i];
      }
    }
  }
}

// SingleRowsF32's estimate with a multiplier and right shift per column (FIXED_SINGLE with
// per-channel parameters, column c is channel c0 + c: the NHWC depthwise conv's rows of
// pixels).  The proof above is per lane (lo, hi and zp are the stage's), so it carries over
// with M the lane's multiplier.  The channel parameters are copied in chunks of kChunk into
// aligned arrays padded with zeros (a partial last vector then reads no past-the-end
// memory).  false: some right shift < 0, nothing written (the caller takes the integer form).
// 2^-(31 + right) for right in [0, 31]: multiplying by it equals SingleRowsF32's division
// by 2^31 and 2^right bit for bit (powers of two scale exactly), without a division per
// channel and call (this stage runs once per pixel row).
constexpr double kInvPow2[32] = {
    0x1p-31, 0x1p-32, 0x1p-33, 0x1p-34, 0x1p-35, 0x1p-36, 0x1p-37, 0x1p-38, 0x1p-39, 0x1p-40, 0x1p-41,
    0x1p-42, 0x1p-43, 0x1p-44, 0x1p-45, 0x1p-46, 0x1p-47, 0x1p-48, 0x1p-49, 0x1p-50, 0x1p-51, 0x1p-52,
    0x1p-53, 0x1p-54, 0x1p-55, 0x1p-56, 0x1p-57, 0x1p-58, 0x1p-59, 0x1p-60, 0x1p-61, 0x1p-62};

template <Rounding R>
bool ChannelRowsF32(const int32_t* acc, int64_t rows, int64_t cols, int64_t lda, const OutputStage& stage, int64_t c0,
                    uint8_t* out, int64_t ldo, bool out_signed) {
  constexpr int64_t kChunk = 256;
  const Rescale& rs = stage.rescale;
  for (int64_t c = 0; c < cols; ++c)
    if (rs.shift[c0 + c] < 0 || rs.shift[c0 + c] > 31) return false;
  const int32_t lo = stage.qmin - stage.zero_point, hi = stage.qmax - stage.zero_point;
  const int64_t alo = lo < 0 ? -int64_t{lo} : lo, ahi = hi < 0 ? -int64_t{hi} : hi;
  const double bound = double(alo > ahi ? alo : ahi) + 1.0, u = 1.0 / 16777216.0;  // u = 2^-24
  const double e = bound * (8 * u) + u;
  const __m256 thr = _mm256_set1_ps(static_cast<float>(0.5 - 2 * e - u));
  const __m256 lof = _mm256_set1_ps(float(lo)), hif = _mm256_set1_ps(float(hi));
  const __m256 half = _mm256_set1_ps(0.5f), sign = _mm256_set1_ps(-0.0f);
  const __m256i zp = _mm256_set1_epi32(stage.zero_point);
  const __m256i loi = _mm256_set1_epi32(lo), hii = _mm256_set1_epi32(hi);
  alignas(32) float mfs[kChunk];
  alignas(32) int32_t mults[kChunk], shifts[kChunk];
  for (int64_t cb = 0; cb < cols; cb += kChunk) {
    const int64_t nc = cols - cb < kChunk ? cols - cb : kChunk, padded = (nc + 7) / 8 * 8;
    for (int64_t i = 0; i < padded; ++i) {
      const int32_t m = i < nc ? rs.multiplier[c0 + cb + i] : 0, right = i < nc ? rs.shift[c0 + cb + i] : 0;
      mults[i] = m;
      shifts[i] = right;
      mfs[i] = static_cast<float>(double(m) * kInvPow2[right]);  // = m / 2^(31 + right), exactly
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int32_t* a = acc + r * lda + cb;
      uint8_t* o = out + r * ldo + cb;
      for (int64_t c = 0; c < nc; c += 8) {
        const int64_t n = nc - c < 8 ? nc - c : 8;
        __m256i x;
        if (n == 8) {
          x = LoadI32(a + c);
        } else {  // masked lanes read as 0 and do not touch memory
          const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(n)),
                                                  _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
          x = _mm256_maskload_epi32(a + c, mask);
        }
        __m256 xf = _mm256_mul_ps(_mm256_cvtepi32_ps(x), _mm256_load_ps(mfs + c));
        if (R == Rounding::kFloor) xf = _mm256_sub_ps(xf, half);
        xf = _mm256_min_ps(_mm256_max_ps(xf, lof), hif);
        const __m256 rf = _mm256_round_ps(xf, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256 flag = _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_sub_ps(xf, rf)), thr, _CMP_GT_OQ);
        __m256i y = _mm256_add_epi32(_mm256_cvtps_epi32(rf), zp);  // rf is integral: exact
        if (!_mm256_testz_ps(flag, flag)) {
          const __m256i q = FixedSingle(x, _mm256_load_si256(reinterpret_cast<const __m256i*>(mults + c)),
                                        _mm256_load_si256(reinterpret_cast<const __m256i*>(shifts + c)), R);
          y = _mm256_add_epi32(_mm256_min_epi32(_mm256_max_epi32(q, loi), hii), zp);
        }
        const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(y), _mm256_extracti128_si256(y, 1));
        const __m128i b = out_signed ? _mm_packs_epi16(w16, w16) : _mm_packus_epi16(w16, w16);
        if (n == 8) {
          _mm_storel_epi64(reinterpret_cast<__m128i*>(o + c), b);
        } else {
          alignas(16) uint8_t codes[16];
          _mm_store_si128(reinterpret_cast<__m128i*>(codes), b);
          for (int64_t i = 0; i < n; ++i) o[c + i] = codes[i];
        }
      }
    }
  }
  return true;
}

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
  if (rs.kind == RescaleKind::kFixedSingle && rs.channels == 1 && rs.shift[0] >= 0) {
    uint8_t* o = static_cast<uint8_t*>(out);
    switch (rs.rounding) {
      case Rounding::kHalfEven: SingleRowsF32<Rounding::kHalfEven>(acc, rows, cols, lda, 0, stage, o, ldo, out_signed); break;
      case Rounding::kFloor: SingleRowsF32<Rounding::kFloor>(acc, rows, cols, lda, 0, stage, o, ldo, out_signed); break;
      case Rounding::kHalfUp: SingleRowsF32<Rounding::kHalfUp>(acc, rows, cols, lda, 0, stage, o, ldo, out_signed); break;
      default: SingleRowsF32<Rounding::kHalfAway>(acc, rows, cols, lda, 0, stage, o, ldo, out_signed); break;
    }
    return;
  }
  if (rs.kind == RescaleKind::kFixedSingle && rs.channels > 1) {
    uint8_t* o = static_cast<uint8_t*>(out);
    bool done = false;
    switch (rs.rounding) {
      case Rounding::kHalfEven: done = ChannelRowsF32<Rounding::kHalfEven>(acc, rows, cols, lda, stage, c0, o, ldo, out_signed); break;
      case Rounding::kFloor: done = ChannelRowsF32<Rounding::kFloor>(acc, rows, cols, lda, stage, c0, o, ldo, out_signed); break;
      case Rounding::kHalfUp: done = ChannelRowsF32<Rounding::kHalfUp>(acc, rows, cols, lda, stage, c0, o, ldo, out_signed); break;
      default: done = ChannelRowsF32<Rounding::kHalfAway>(acc, rows, cols, lda, stage, c0, o, ldo, out_signed); break;
    }
    if (done) return;
  }
  Pick<RequantRows>(rs)(acc, rows, cols, lda, stage, c0, static_cast<uint8_t*>(out), ldo, out_signed);
  // Tail columns: the scalar reference (defined in another translation unit, so no
  // AVX2-compiled copy of an inline helper can leak to portable callers).
  const int64_t done = cols / 8 * 8;
  if (done < cols) {
    ref::Requant(acc + done, rows, cols - done, lda, stage, c0 + done,
                 static_cast<uint8_t*>(out) + done, ldo, out_signed);
  }
}

void RequantAddAvx2(const int32_t* acc, int64_t rows, int64_t cols, int64_t lda, int32_t addend,
                    const OutputStage& one, void* out, int64_t ldo, bool out_signed) {
  const Rescale& rs = one.rescale;
  if (rs.kind == RescaleKind::kFixedSingle && rs.shift[0] >= 0 && RequantAvx2Supports(one)) {
    uint8_t* o = static_cast<uint8_t*>(out);
    switch (rs.rounding) {
      case Rounding::kHalfEven: SingleRowsF32<Rounding::kHalfEven>(acc, rows, cols, lda, addend, one, o, ldo, out_signed); break;
      case Rounding::kFloor: SingleRowsF32<Rounding::kFloor>(acc, rows, cols, lda, addend, one, o, ldo, out_signed); break;
      case Rounding::kHalfUp: SingleRowsF32<Rounding::kHalfUp>(acc, rows, cols, lda, addend, one, o, ldo, out_signed); break;
      default: SingleRowsF32<Rounding::kHalfAway>(acc, rows, cols, lda, addend, one, o, ldo, out_signed); break;
    }
    return;
  }
  // other stages: the sums in blocks of a few hundred through a buffer (still in L1)
  alignas(32) int32_t buf[512];
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c0 = 0; c0 < cols; c0 += 512) {
      const int64_t n = cols - c0 < 512 ? cols - c0 : 512;
      for (int64_t i = 0; i < n; ++i) buf[i] = acc[r * lda + c0 + i] + addend;
      RequantAvx2(buf, 1, n, n, one, 0, static_cast<uint8_t*>(out) + r * ldo + c0, n, out_signed);
    }
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

void StageI32RowsAvx2(const int32_t* acc, int64_t rows, int64_t cols, int64_t lda, const OutputStage& stage,
                      int64_t c0, int32_t* out, int64_t ldo) {
  const Rescale& rs = stage.rescale;
  if (!RequantAvx2Supports(stage) || stage.zero_point != 0) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        out[r * ldo + c] = ref::StageOne(acc[r * lda + c], ChannelStage(stage, c0 + c));
    return;
  }
  bool ident = rs.kind == RescaleKind::kPot;  // POT shift 0 on every channel: a clamped copy
  for (int64_t c = 0; ident && c < (rs.channels == 1 ? 1 : cols); ++c)
    ident = rs.shift[rs.channels == 1 ? 0 : c0 + c] == 0;
  if (ident) {
    I32ColRows<RescaleKind::kPot, Rounding::kHalfAway, true>::Run(acc, rows, cols, lda, stage, c0, out, ldo);
    return;
  }
  Pick<I32ColRows>(rs)(acc, rows, cols, lda, stage, c0, out, ldo);
}

}  // namespace x86
}  // namespace qdsl
