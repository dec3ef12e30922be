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

// One element through the out-of-line scalar helpers (the tails).
uint8_t ScalarAdd(const void* x0, int dtype0, const void* x1, int dtype1, int64_t i, const OutputStage* in,
                  int pre_shift, const OutputStage& out_stage) {
  int64_t total = 0;
  for (int k = 0; k < 2; ++k) {
    const int64_t d = static_cast<int64_t>(LoadOne(k == 0 ? x0 : x1, k == 0 ? dtype0 : dtype1, i)) - in[k].zero_point;
    // numpy's int64 '<<' wraps; so does a uint64 shift
    total += ref::RescaleOneOutOfLine(static_cast<int64_t>(static_cast<uint64_t>(d) << pre_shift), in[k].rescale);
  }
  return static_cast<uint8_t>(
      ref::StageOne(total < INT32_MIN ? INT32_MIN : (total > INT32_MAX ? INT32_MAX : total), out_stage));
}

// The fast loop for what exporters emit: each input either the identity (an I32 residual
// accumulator: zero point 0, pre_shift 0, POT shift 0) or a narrow input with a POT
// (shift in [-31, 31]) or FIXED_SINGLE rescale, and a POT or FIXED_SINGLE output stage, all
// rounding alike.  Modes, kinds and rounding are template parameters: in the general loop
// below their branches and per-input arrays kept GCC from holding the loop in registers
// (about 60 cycles per 8 elements on Zen 3).
enum class InMode { kIdent = 0, kPot = 1, kFixedSingle = 2 };

struct FastArgs {
  const void* x[2];
  int dtype[2];
  __m256i zp[2], mult[2], shift[2];
  __m128i pre;
  __m256i omult, oshift, ozp, qmin, qmax;
  int64_t n;
  uint8_t* out;
  bool out_signed;
};

template <InMode M, Rounding R>
inline __m256i FastIn(const void* x, int dtype, __m256i zp, __m128i pre, __m256i mult, __m256i shift, int64_t i) {
  if constexpr (M == InMode::kIdent) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const int32_t*>(x) + i));
  } else {
    const __m256i d = _mm256_sll_epi32(_mm256_sub_epi32(Load(x, dtype, i), zp), pre);
    return RescaleVec(d, M == InMode::kPot ? RescaleKind::kPot : RescaleKind::kFixedSingle, mult, shift, R);
  }
}

template <InMode M0, InMode M1, RescaleKind KO, Rounding R>
void FastLoop(const FastArgs& a) {
  // every parameter in a local: the uint8_t stores below may alias anything, so fields read
  // through `a` would be reloaded after each one
  const void* const x0 = a.x[0];
  const void* const x1 = a.x[1];
  const int d0 = a.dtype[0], d1 = a.dtype[1];
  const __m256i zp0 = a.zp[0], zp1 = a.zp[1], m0 = a.mult[0], m1 = a.mult[1], s0 = a.shift[0], s1 = a.shift[1];
  const __m128i pre = a.pre;
  const __m256i omult = a.omult, oshift = a.oshift, ozp = a.ozp, qmin = a.qmin, qmax = a.qmax;
  const int64_t n = a.n;
  uint8_t* const out = a.out;
  const bool out_signed = a.out_signed;
  for (int64_t i = 0; i + 8 <= n; i += 8) {
    const __m256i t0 = FastIn<M0, R>(x0, d0, zp0, pre, m0, s0, i), t1 = FastIn<M1, R>(x1, d1, zp1, pre, m1, s1, i);
    StoreCodes8(RescaleVec(SatAdd32(t0, t1), KO, omult, oshift, R), ozp, qmin, qmax, out_signed, out + i);
  }
}

using FastFn = void (*)(const FastArgs&);

template <InMode M0, InMode M1, RescaleKind KO>
FastFn PickRounding(Rounding r) {
  switch (r) {
    case Rounding::kHalfEven: return FastLoop<M0, M1, KO, Rounding::kHalfEven>;
    case Rounding::kFloor: return FastLoop<M0, M1, KO, Rounding::kFloor>;
    case Rounding::kHalfUp: return FastLoop<M0, M1, KO, Rounding::kHalfUp>;
    default: return FastLoop<M0, M1, KO, Rounding::kHalfAway>;
  }
}

template <InMode M0, InMode M1>
FastFn PickOut(RescaleKind k, Rounding r) {
  return k == RescaleKind::kPot ? PickRounding<M0, M1, RescaleKind::kPot>(r)
                                : PickRounding<M0, M1, RescaleKind::kFixedSingle>(r);
}

// m0 <= m1 (the caller orders the inputs: the sum is symmetric)
FastFn PickFast(InMode m0, InMode m1, RescaleKind k, Rounding r) {
  using M = InMode;
  if (m0 == M::kIdent) {
    return m1 == M::kIdent ? PickOut<M::kIdent, M::kIdent>(k, r)
                           : (m1 == M::kPot ? PickOut<M::kIdent, M::kPot>(k, r) : PickOut<M::kIdent, M::kFixedSingle>(k, r));
  }
  if (m0 == M::kPot) return m1 == M::kPot ? PickOut<M::kPot, M::kPot>(k, r) : PickOut<M::kPot, M::kFixedSingle>(k, r);
  return PickOut<M::kFixedSingle, M::kFixedSingle>(k, r);
}

// A rescale's shifts lie in [-31, 31] (POT may reach 62: those take the general loop).
bool ShortShift(const Rescale& r) { return r.shift[0] >= -31 && r.shift[0] <= 31; }

}  // namespace

bool AddAvx2(const void* x0, int dtype0, const void* x1, int dtype1, int64_t n, const OutputStage* in, int pre_shift,
             const OutputStage& out_stage, uint8_t* out, bool out_signed) {
  if (in[0].rescale.channels != 1 || in[1].rescale.channels != 1 || out_stage.rescale.channels != 1) return false;
  if (out_stage.zero_point < -(1 << 16) || out_stage.zero_point > (1 << 16)) return false;  // not an I8/U8 ADD
  const void* xs[2] = {x0, x1};
  const int dts[2] = {dtype0, dtype1};
  {  // the fast loop when every part fits it (FastLoop)
    const Rescale& ro = out_stage.rescale;
    const Rounding rnd = ro.rounding;
    bool ok = ro.kind != RescaleKind::kFixed && ShortShift(ro);
    InMode mode[2] = {InMode::kIdent, InMode::kIdent};
    for (int k = 0; k < 2 && ok; ++k) {
      const Rescale& r = in[k].rescale;
      if (dts[k] == 4 && in[k].zero_point == 0 && pre_shift == 0 && r.kind == RescaleKind::kPot && r.shift[0] == 0) {
        mode[k] = InMode::kIdent;
      } else {
        ok = NarrowOk(dts[k], in[k].zero_point, pre_shift) && r.kind != RescaleKind::kFixed && ShortShift(r) &&
             r.rounding == rnd;
        mode[k] = r.kind == RescaleKind::kPot ? InMode::kPot : InMode::kFixedSingle;
      }
    }
    if (ok) {
      const int first = mode[0] <= mode[1] ? 0 : 1;  // (t0 + t1 is symmetric)
      FastArgs a;
      for (int j = 0; j < 2; ++j) {
        const int k = j == 0 ? first : 1 - first;
        a.x[j] = xs[k];
        a.dtype[j] = dts[k];
        a.zp[j] = _mm256_set1_epi32(in[k].zero_point);
        a.mult[j] = _mm256_set1_epi32(in[k].rescale.multiplier[0]);
        a.shift[j] = _mm256_set1_epi32(in[k].rescale.shift[0]);
      }
      a.pre = _mm_cvtsi32_si128(pre_shift);
      a.omult = _mm256_set1_epi32(ro.multiplier[0]);
      a.oshift = _mm256_set1_epi32(ro.shift[0]);
      a.ozp = _mm256_set1_epi32(out_stage.zero_point);
      a.qmin = _mm256_set1_epi32(out_stage.qmin);
      a.qmax = _mm256_set1_epi32(out_stage.qmax);
      a.n = n;
      a.out = out;
      a.out_signed = out_signed;
      PickFast(mode[first], mode[1 - first], ro.kind, rnd)(a);
      for (int64_t i = n / 8 * 8; i < n; ++i) out[i] = ScalarAdd(x0, dtype0, x1, dtype1, i, in, pre_shift, out_stage);
      return true;
    }
  }
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
  const __m128i pre = _mm_cvtsi32_si128(pre_shift);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256i t[2];
    for (int k = 0; k < 2; ++k) {
      const __m256i d = narrow[k] ? _mm256_sll_epi32(_mm256_sub_epi32(Load(xs[k], dts[k], i), zp[k]), pre)
                                  : PrepWide(xs[k], dts[k], i, zp64[k], pre);
      t[k] = rin[k](d);
    }
    StoreCodes8(rout(SatAdd32(t[0], t[1])), ozp, qmin, qmax, out_signed, out + i);
  }
  for (; i < n; ++i) out[i] = ScalarAdd(x0, dtype0, x1, dtype1, i, in, pre_shift, out_stage);
  return true;
}

}  // namespace x86
}  // namespace qdsl
