// AVX2 ADD (docs/qgraph.md §4.4): t_i = rescale_i((x_i - zp_i) * 2^pre), y = stage(sat32(t_0 + t_1)).
//
// Every parameter combination the format allows runs here (per-tensor rescales, as ADD
// has).  The common case - I8/U8 inputs with pre_shift <= 23 (|x - zp| <= 255 keeps
// (x - zp) * 2^pre in int32), I32 inputs with zero point 0 and pre_shift 0 - forms the
// rescale input in int32 lanes.  Otherwise it is formed in 64-bit lanes exactly as the
// reference does: d = x - zp (int64), d << pre wrapping like numpy's int64 '<<' (a uint64
// shift), then sat32.  POT right shifts in [32, 62] (legal, never exported) round in
// 64-bit lanes (RoundShift64: |x| < 2^31 < 2^62).  The output zero point of an I8/U8
// ADD lies in [-128, 255], so clamping y to +-2^24 first cannot change the result.
// dtype codes are the file's: 2 I8, 3 U8, 4 I32.
#pragma GCC target("avx2,fma,popcnt")
#include <immintrin.h>

#include <cstdint>

#include "kernels/x86/x86_kernels.h"
#include "ref/ref.h"
#include "requant/rescale_avx2.h"

namespace qdsl {
namespace x86 {
namespace {

inline __m256i Load(const void* x, int dtype, int64_t i) {
  if (dtype == 4) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const int32_t*>(x) + i));
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(x) + i));
  return dtype == 2 ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
}

inline int32_t LoadOne(const void* x, int dtype, int64_t i) {
  if (dtype == 4) return static_cast<const int32_t*>(x)[i];
  const uint8_t v = static_cast<const uint8_t*>(x)[i];
  return dtype == 2 ? static_cast<int8_t>(v) : v;
}

// (x - zp) * 2^pre provably fits int32 lanes.
bool NarrowOk(int dtype, int32_t zp, int pre) { return dtype == 4 ? zp == 0 && pre == 0 : pre <= 23; }

// 4 int64 lanes -> 4 saturated int32 in the low 128 bits.
inline __m128i Sat32Pack(__m256i v) {
  const __m256i hi = _mm256_set1_epi64x(INT32_MAX), lo = _mm256_set1_epi64x(INT32_MIN);
  v = _mm256_blendv_epi8(v, hi, _mm256_cmpgt_epi64(v, hi));
  v = _mm256_blendv_epi8(v, lo, _mm256_cmpgt_epi64(lo, v));
  return _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7)));
}

inline __m256i Join(__m128i lo, __m128i hi) { return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1); }

// sat32((x - zp) << pre) in 64-bit lanes (the general case).
inline __m256i PrepWide(const void* x, int dtype, int64_t i, __m256i zp64, __m128i pre) {
  const __m256i v = Load(x, dtype, i);
  const __m256i lo = _mm256_sll_epi64(_mm256_sub_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(v)), zp64), pre);
  const __m256i hi = _mm256_sll_epi64(_mm256_sub_epi64(_mm256_cvtepi32_epi64(_mm256_extracti128_si256(v, 1)), zp64), pre);
  return Join(Sat32Pack(lo), Sat32Pack(hi));
}

// A per-tensor rescale; `wide`: POT right shift in [32, 62], rounded in 64-bit lanes.
struct Rq {
  RescaleKind kind;
  Rounding rounding;
  bool wide, ident;
  __m256i mult, shift, shift64;
  explicit Rq(const Rescale& r)
      : kind(r.kind), rounding(r.rounding), wide(r.kind == RescaleKind::kPot && r.shift[0] > 31),
        ident(r.kind == RescaleKind::kPot && r.shift[0] == 0), mult(_mm256_set1_epi32(r.multiplier[0])),
        shift(_mm256_set1_epi32(r.shift[0])), shift64(_mm256_set1_epi64x(r.shift[0])) {}
  __m256i operator()(__m256i x) const {
    if (ident) return x;
    if (!wide) return RescaleVec(x, kind, mult, shift, rounding);
    const __m128i lo = Sat32Pack(RoundShift64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(x)), shift64, rounding));
    const __m128i hi = Sat32Pack(RoundShift64(_mm256_cvtepi32_epi64(_mm256_extracti128_si256(x, 1)), shift64, rounding));
    return Join(lo, hi);
  }
};

}  // namespace

bool AddAvx2(const void* x0, int dtype0, const void* x1, int dtype1, int64_t n, const OutputStage* in, int pre_shift,
             const OutputStage& out_stage, uint8_t* out, bool out_signed) {
  if (in[0].rescale.channels != 1 || in[1].rescale.channels != 1 || out_stage.rescale.channels != 1) return false;
  if (out_stage.zero_point < -(1 << 16) || out_stage.zero_point > (1 << 16)) return false;  // not an I8/U8 ADD
  const void* xs[2] = {x0, x1};
  const int dts[2] = {dtype0, dtype1};
  __m256i zp[2], zp64[2];
  bool narrow[2];
  const Rq rin[2] = {Rq(in[0].rescale), Rq(in[1].rescale)};
  for (int k = 0; k < 2; ++k) {
    zp[k] = _mm256_set1_epi32(in[k].zero_point);
    zp64[k] = _mm256_set1_epi64x(in[k].zero_point);
    narrow[k] = NarrowOk(dts[k], in[k].zero_point, pre_shift);
  }
  const Rq rout(out_stage.rescale);
  const __m256i ozp = _mm256_set1_epi32(out_stage.zero_point);
  const __m256i qmin = _mm256_set1_epi32(out_stage.qmin), qmax = _mm256_set1_epi32(out_stage.qmax);
  const __m256i lim = _mm256_set1_epi32(1 << 24), nlim = _mm256_set1_epi32(-(1 << 24));
  const __m128i pre = _mm_cvtsi32_si128(pre_shift);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256i t[2];
    for (int k = 0; k < 2; ++k) {
      const __m256i d = narrow[k] ? _mm256_sll_epi32(_mm256_sub_epi32(Load(xs[k], dts[k], i), zp[k]), pre)
                                  : PrepWide(xs[k], dts[k], i, zp64[k], pre);
      t[k] = rin[k](d);
    }
    // saturating int32 add: overflow iff both signs agree and the sum's sign differs
    const __m256i sum = _mm256_add_epi32(t[0], t[1]);
    const __m256i ovf = _mm256_andnot_si256(_mm256_xor_si256(t[0], t[1]), _mm256_xor_si256(t[0], sum));
    const __m256i sat = _mm256_xor_si256(_mm256_srai_epi32(t[0], 31), _mm256_set1_epi32(INT32_MAX));
    const __m256i total = _mm256_blendv_epi8(sum, sat, _mm256_srai_epi32(ovf, 31));
    __m256i y = rout(total);
    y = _mm256_min_epi32(_mm256_max_epi32(y, nlim), lim);
    y = _mm256_min_epi32(_mm256_max_epi32(_mm256_add_epi32(y, ozp), qmin), qmax);
    const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(y), _mm256_extracti128_si256(y, 1));
    const __m128i b = out_signed ? _mm_packs_epi16(w16, w16) : _mm_packus_epi16(w16, w16);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + i), b);
  }
  for (; i < n; ++i) {  // tail: same formula through the out-of-line scalar helpers
    int64_t total = 0;
    for (int k = 0; k < 2; ++k) {
      const int64_t d = static_cast<int64_t>(LoadOne(xs[k], dts[k], i)) - in[k].zero_point;
      // numpy's int64 '<<' wraps; so does a uint64 shift
      total += ref::RescaleOneOutOfLine(static_cast<int64_t>(static_cast<uint64_t>(d) << pre_shift), in[k].rescale);
    }
    out[i] = static_cast<uint8_t>(ref::StageOne(total < INT32_MIN ? INT32_MIN : (total > INT32_MAX ? INT32_MAX : total),
                                                out_stage));
  }
  return true;
}

}  // namespace x86
}  // namespace qdsl
