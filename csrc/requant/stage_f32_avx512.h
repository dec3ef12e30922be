// AVX-512 forms of the prepared output stages (stage_f32.h) on 16 int32 lanes, for the
// implicit-GEMM epilogue that applies them from registers (igemm_u8s8_vnni_avx512.cc).
// Included only by translation units compiled for AVX512F/BW/VL (selected where
// EvexVnniUsable()); internal linkage, like stage_f32_avx2.h, whose exact forms the rare
// recomputes use.
//
// StageF32Codes16: the FIXED_SINGLE stage of one 16-channel row as a float32 estimate with
// the rounding done by the fma that adds a magic constant, checked, exact otherwise.
//   X = fl(x) (vcvtdq2ps), w = X * mf (exact inside the fma), C = 1.5 * 2^23 + zp (an
//   integer in [2^23, 2^24): |zp| <= 2^16), T = fl(w + C) rounded to nearest (HALF_* modes)
//   or down (FLOOR, embedded rounding).  While w + zp lies in (-2^22, 2^22), T is in
//   [2^23, 2^24), where floats are the integers, so T = C + n with n = nearest(w) (ties aside)
//   or floor(w), and T's bit pattern is 0x4B400000 + zp + n: the code before its clamp.
//   rho = w - n = X * mf + (C - T) exactly (C - T is an exact integer), d = fl(rho) by a
//   second fma (FLOOR: d = fl(fl(rho) - 1/2)).  With v = x * M the exact value (M = m /
//   2^(31 + right), mf = fl(M)): |w - v| <= (2u + u^2) |v| (u = 2^-24; no product rounding),
//   so for |w| <= B + 1 (B = max(|lo|, |hi|) + 1, lo/hi = qmin/qmax - zp, |lo|, |hi| < 2^17)
//   |w - v| <= 2.1 u (B + 1) <= 2 E (stage_f32.h's E = 2^-21 B + 2^-24).  A lane counts as
//   decided when fl(d^2 - thr2) < 0 (StageF32EstimateSq's test: then |d| < thr = 1/2 - 2E - u
//   as a float): |rho| < (1/2 - 2E - u/2)(1 + u) <= 1/2 - 2E (FLOOR: |rho - 1/2| < 1/2 - 2E + u
//   with the extra subtraction's 1.5 u), so v lies strictly inside the same (n - 1/2, n + 1/2)
//   (FLOOR: (n, n + 1)) as w, where every rounding mode gives n.  Lanes with |w| > B + 1
//   need no test: v then lies beyond the same clamp bound by more than 1/2, both round past
//   it and the clamp gives that bound.  The clamp runs on T's bit pattern as a signed
//   integer, to [0x4B400000 + qmin, 0x4B400000 + qmax]: monotone in T for T >= 0, and a T
//   outside [2^23, 2^24) (|w + zp| >= 2^22 - 1/2: far past a bound) lands on that bound (T >=
//   2^24 above it; T < 2^23, negative T included, below it).  The low byte of the clamped
//   pattern is the code's (0x4B400000 is a multiple of 256), which vpmovdb keeps: no
//   subtraction of the magic, no packs or shuffles, the same instruction for I8 and U8.
//   Any undecided lane of a call recomputes every row exactly (StageF32Exact).
//
// StageI32Twin: StageI32Reg's rule on 16 lanes, exact: vpmuldq gives the even and odd lanes'
// 64-bit products x * m, vpsravq the rounded shifts; a lane whose x * 2^left leaves int32
// (RescaleOne saturates t there) makes the caller take RescaleVec for that row.
#ifndef QDSL_REQUANT_STAGE_F32_AVX512_H_
#define QDSL_REQUANT_STAGE_F32_AVX512_H_

#include <immintrin.h>

#include <cstdint>

#include "requant/stage_f32.h"
#include "requant/stage_f32_avx2.h"

namespace qdsl {
namespace x86 {
namespace {

constexpr int kRne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
constexpr int kDown = _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC;

struct StageF32Vec512 {
  __m512 c, thr2, half;
  __m512i lo_bits, hi_bits, sign;
  explicit StageF32Vec512(const StageF32& s)
      : c(_mm512_set1_ps(static_cast<float>(12582912 + s.zp))),
        thr2(_mm512_set1_ps(static_cast<float>(double(s.thr) * double(s.thr) * (1.0 - 1.0 / 4194304.0)))),
        half(_mm512_set1_ps(0.5f)),
        lo_bits(_mm512_set1_epi32(0x4B400000 + s.zp + s.lo)),
        hi_bits(_mm512_set1_epi32(0x4B400000 + s.zp + s.hi)),
        sign(_mm512_set1_epi32(INT32_MIN)) {}
};

// The clamped bit patterns of 16 lanes x (channels of mf); *e's sign bits: the decided lanes.
template <Rounding R>
__attribute__((always_inline)) inline __m512i StageF32Codes16(__m512i x, __m512 mf, const StageF32Vec512& v,
                                                              __m512* e) {
  const __m512 xf = _mm512_cvt_roundepi32_ps(x, kRne);
  const __m512 t = R == Rounding::kFloor ? _mm512_fmadd_round_ps(xf, mf, v.c, kDown)
                                         : _mm512_fmadd_round_ps(xf, mf, v.c, kRne);
  __m512 d = _mm512_fmadd_round_ps(xf, mf, _mm512_sub_ps(v.c, t), kRne);
  if (R == Rounding::kFloor) d = _mm512_sub_ps(d, v.half);
  *e = _mm512_fmsub_ps(d, d, v.thr2);
  return _mm512_min_epi32(_mm512_max_epi32(_mm512_castps_si512(t), v.lo_bits), v.hi_bits);
}

// The exact codes (zero point added, clamped) of 16 lanes of channels c0.. (the rare recompute).
template <Rounding R>
__attribute__((noinline)) __m512i StageF32Exact16(__m512i x, const StageF32& s, int64_t c0) {
  const StageF32Vec v(s);
  const __m256i* m = reinterpret_cast<const __m256i*>(s.mult.data() + c0);
  const __m256i* sh = reinterpret_cast<const __m256i*>(s.shift.data() + c0);
  const __m256i lo = StageF32Exact<R>(_mm512_castsi512_si256(x), _mm256_loadu_si256(m), _mm256_loadu_si256(sh), v);
  const __m256i hi =
      StageF32Exact<R>(_mm512_extracti64x4_epi64(x, 1), _mm256_loadu_si256(m + 1), _mm256_loadu_si256(sh + 1), v);
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// StageI32Reg's per-call terms for channels c0..c0+15 (c0 a multiple of 16).
struct StageI32Vec512 {
  __m512i m, m_odd, left, s_e, s_o, h_e, h_o, hm_e, hm_o, low_e, low_o, qmin, qmax;
  StageI32Vec512(const StageI32Reg& r, int64_t c0) {
    auto ld = [](const void* p) { return _mm512_loadu_si512(p); };
    m = ld(r.mult.data() + c0);
    m_odd = _mm512_srli_epi64(m, 32);
    left = ld(r.left.data() + c0);
    s_e = ld(r.s.data() + c0), s_o = ld(r.s.data() + c0 + 8);
    h_e = ld(r.h.data() + c0), h_o = ld(r.h.data() + c0 + 8);
    hm_e = ld(r.hm.data() + c0), hm_o = ld(r.hm.data() + c0 + 8);
    low_e = ld(r.low.data() + c0), low_o = ld(r.low.data() + c0 + 8);
    qmin = _mm512_set1_epi32(r.qmin), qmax = _mm512_set1_epi32(r.qmax);
  }
};

// round(p / 2^s) of eight 64-bit lanes per the rounding (StageI32Reg's rule).
template <Rounding R>
__attribute__((always_inline)) inline __m512i RoundShift64x8(__m512i p, __m512i s, __m512i h, __m512i hm,
                                                             __m512i low) {
  if (R == Rounding::kFloor) return _mm512_srav_epi64(p, s);
  if (R == Rounding::kHalfAway) {
    const __mmask8 neg = _mm512_cmplt_epi64_mask(p, _mm512_setzero_si512());
    return _mm512_srav_epi64(_mm512_add_epi64(p, _mm512_mask_blend_epi64(neg, h, hm)), s);
  }
  const __m512i ph = _mm512_add_epi64(p, h);
  const __m512i q = _mm512_srav_epi64(ph, s);
  if (R == Rounding::kHalfUp) return q;
  // HALF_EVEN: a tie ((p + h) mod 2^s == 0) rounded up to an odd q goes back to even
  const __mmask8 tie = _mm512_testn_epi64_mask(ph, low);
  return _mm512_mask_andnot_epi64(q, tie, _mm512_set1_epi64(1), q);
}

// The int32 stage of 16 lanes; *bad gets the lanes whose x * 2^left leaves int32.
template <Rounding R>
__attribute__((always_inline)) inline __m512i StageI32Twin16(__m512i x, const StageI32Vec512& v, __mmask16* bad) {
  *bad |= _mm512_cmpneq_epi32_mask(_mm512_srav_epi32(_mm512_sllv_epi32(x, v.left), v.left), x);
  const __m512i pe = _mm512_mul_epi32(x, v.m);
  const __m512i po = _mm512_mul_epi32(_mm512_srli_epi64(x, 32), v.m_odd);
  const __m512i qe = RoundShift64x8<R>(pe, v.s_e, v.h_e, v.hm_e, v.low_e);
  const __m512i qo = RoundShift64x8<R>(po, v.s_o, v.h_o, v.hm_o, v.low_o);
  const __m512i q = _mm512_mask_blend_epi32(0xAAAA, qe, _mm512_slli_epi64(qo, 32));
  return _mm512_min_epi32(_mm512_max_epi32(q, v.qmin), v.qmax);
}

// The reference rule for one row of 16 lanes (RescaleVec on each half, then the clamp).
template <Rounding R>
__attribute__((noinline)) __m512i StageI32Slow16(__m512i x, const StageI32Reg& r, int64_t c0) {
  const __m256i* m = reinterpret_cast<const __m256i*>(r.mult.data() + c0);  // (POT: unused)
  const __m256i* sh = reinterpret_cast<const __m256i*>(r.shift.data() + c0);
  const __m256i qmin = _mm256_set1_epi32(r.qmin), qmax = _mm256_set1_epi32(r.qmax);
  __m256i y[2];
  for (int i = 0; i < 2; ++i) {
    const __m256i xi = i == 0 ? _mm512_castsi512_si256(x) : _mm512_extracti64x4_epi64(x, 1);
    const __m256i q = RescaleVec(xi, r.kind, _mm256_loadu_si256(m + i), _mm256_loadu_si256(sh + i), R);
    y[i] = _mm256_min_epi32(_mm256_max_epi32(q, qmin), qmax);
  }
  return _mm512_inserti64x4(_mm512_castsi256_si512(y[0]), y[1], 1);
}

}  // namespace
}  // namespace x86
}  // namespace qdsl

#endif  // QDSL_REQUANT_STAGE_F32_AVX512_H_
