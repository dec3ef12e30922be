// The NHWC depthwise quad kernel's body (DwNhwcQuadKernel in dispatch.h), compiled once per
// target: AVX2 (vpmaddubsw, dwconv_nhwc_u8s8_avx2.cc, which describes the layouts) and
// AVX512-VNNI (EVEX vpdpbusd on ymm, dwconv_nhwc_u8s8_vnni_avx512.cc).  Only the step that
// adds a register of per-channel quads times their weight bytes differs, so the including
// file, after its target pragma, defines in qdsl::x86's anonymous namespace
//
//   __m256i QuadStep(__m256i s, __m256i q, __m256i w);
//
// (always_inline: s plus, in each int32 lane, the sum of the four u8 x s8 products of q's and
// w's bytes in that lane, exact where ConvParams::dwq holds: every pair sum within int16),
// and QDSL_DW_NHWC_QUAD (the entry point's name, declared in x86_kernels.h); then includes
// this file once.  Everything but the entry point lives in the anonymous namespace of that
// translation unit, so each target has its own copy.
#include <immintrin.h>

#include <cstdint>

#include "kernels/x86/x86_kernels.h"
#include "requant/stage_f32_avx2.h"

namespace qdsl {
namespace x86 {
namespace {

template <bool kHalf>
inline __m256i Load32(const uint8_t* p) {
  // a 16-channel last block reads 16 bytes (the pointers are readable for DwNhwcCols(C));
  // its high lane then holds zeros, whose sums are never stored
  if (kHalf) return _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

inline __m256i LoadW(const uint8_t* p) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(p)); }

// The sums of channels c0..c0+31 at one position (a0: c0..c0+7, b0: +8..15, a1: +16..23,
// b1: +24..31), from the block's weights w (DwNhwcQuadSteps(ntaps) steps of 128 bytes) and
// init (32 int32 in the q_r order: r * 8 + L * 4 + i).
template <int kTaps, bool kHalf>
__attribute__((always_inline)) inline void Sums32(const uint8_t* const* pt, int64_t ntaps_rt, int64_t c0,
                                                  const uint8_t* w, const int32_t* init, __m256i* a0, __m256i* b0,
                                                  __m256i* a1, __m256i* b1) {
  const int64_t ntaps = kTaps > 0 ? kTaps : ntaps_rt;
  const __m256i zero = _mm256_setzero_si256();
  __m256i s0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(init));
  __m256i s1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(init + 8));
  __m256i s2 = _mm256_load_si256(reinterpret_cast<const __m256i*>(init + 16));
  __m256i s3 = _mm256_load_si256(reinterpret_cast<const __m256i*>(init + 24));
  int64_t t = 0;
  for (; t + 2 <= ntaps; t += 4, w += 128) {
    // a missing third / fourth tap reads the last one (its weights are 0)
    const int64_t t2 = t + 2 < ntaps ? t + 2 : ntaps - 1, t3 = t + 3 < ntaps ? t + 3 : ntaps - 1;
    const __m256i x0 = Load32<kHalf>(pt[t] + c0), x1 = Load32<kHalf>(pt[t + 1] + c0);
    const __m256i x2 = Load32<kHalf>(pt[t2] + c0), x3 = Load32<kHalf>(pt[t3] + c0);
    const __m256i l01 = _mm256_unpacklo_epi8(x0, x1), h01 = _mm256_unpackhi_epi8(x0, x1);
    const __m256i l23 = _mm256_unpacklo_epi8(x2, x3), h23 = _mm256_unpackhi_epi8(x2, x3);
    const __m256i q0 = _mm256_unpacklo_epi16(l01, l23), q1 = _mm256_unpackhi_epi16(l01, l23);
    const __m256i q2 = _mm256_unpacklo_epi16(h01, h23), q3 = _mm256_unpackhi_epi16(h01, h23);
    s0 = QuadStep(s0, q0, LoadW(w));
    s1 = QuadStep(s1, q1, LoadW(w + 32));
    s2 = QuadStep(s2, q2, LoadW(w + 64));
    s3 = QuadStep(s3, q3, LoadW(w + 96));
  }
  if (t < ntaps) {  // one tap left: codes as int32 lanes (high halves 0) times (w, 0)
    const __m256i x = Load32<kHalf>(pt[t] + c0);
    const __m256i l = _mm256_unpacklo_epi8(x, zero), h = _mm256_unpackhi_epi8(x, zero);
    s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_unpacklo_epi16(l, zero), LoadW(w)));
    s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_unpackhi_epi16(l, zero), LoadW(w + 32)));
    s2 = _mm256_add_epi32(s2, _mm256_madd_epi16(_mm256_unpacklo_epi16(h, zero), LoadW(w + 64)));
    s3 = _mm256_add_epi32(s3, _mm256_madd_epi16(_mm256_unpackhi_epi16(h, zero), LoadW(w + 96)));
  }
  // s_r holds channels 4r..4r+3 (low lane) and 16+4r..16+4r+3 (high lane)
  *a0 = _mm256_permute2x128_si256(s0, s1, 0x20);
  *b0 = _mm256_permute2x128_si256(s2, s3, 0x20);
  *a1 = _mm256_permute2x128_si256(s0, s1, 0x31);
  *b1 = _mm256_permute2x128_si256(s2, s3, 0x31);
}

template <int kTaps, Rounding R>
void DwQuad(const uint8_t* const* ptrs, int64_t n, int64_t ntaps_rt, int64_t C, const uint8_t* w,
            const int32_t* init, const StageF32& st, uint8_t* out, int64_t ldo, bool out_signed) {
  const int64_t ntaps = kTaps > 0 ? kTaps : ntaps_rt;
  const int64_t block = DwNhwcQuadSteps(ntaps) * 128;  // weight bytes per 32 channels
  const StageF32Vec v(st);
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* const* pt = ptrs + i * ntaps;
    uint8_t* o = out + i * ldo;
    int64_t c0 = 0;
    for (; c0 + 32 <= C; c0 += 32) {
      __m256i a0, b0, a1, b1;
      Sums32<kTaps, false>(pt, ntaps, c0, w + (c0 / 32) * block, init + c0, &a0, &b0, &a1, &b1);
      const __m256i codes = StageF32Codes32<R>(a0, b0, a1, b1, st, c0, c0 + 16, v, out_signed);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c0), codes);
    }
    if (c0 < C) {
      __m256i a0, b0, a1, b1;
      alignas(32) uint8_t buf[32];
      if (c0 + 16 < C) {  // 17..31 channels left: a whole block (the pointers reach c0 + 32)
        Sums32<kTaps, false>(pt, ntaps, c0, w + (c0 / 32) * block, init + c0, &a0, &b0, &a1, &b1);
        _mm256_store_si256(reinterpret_cast<__m256i*>(buf),
                           StageF32Codes32<R>(a0, b0, a1, b1, st, c0, c0 + 16, v, out_signed));
      } else {  // at most 16: the low lanes, staged as both halves
        Sums32<kTaps, true>(pt, ntaps, c0, w + (c0 / 32) * block, init + c0, &a0, &b0, &a1, &b1);
        _mm256_store_si256(reinterpret_cast<__m256i*>(buf),
                           StageF32Codes32<R>(a0, b0, a0, b0, st, c0, c0, v, out_signed));
      }
      for (int64_t k = 0; c0 + k < C; ++k) o[c0 + k] = buf[k];
    }
  }
}

template <Rounding R>
void DwQuadTaps(const uint8_t* const* ptrs, int64_t n, int64_t ntaps, int64_t C, const uint8_t* w,
                const int32_t* init, const StageF32& st, uint8_t* out, int64_t ldo, bool out_signed) {
  switch (ntaps) {
    case 9: return DwQuad<9, R>(ptrs, n, ntaps, C, w, init, st, out, ldo, out_signed);
    case 25: return DwQuad<25, R>(ptrs, n, ntaps, C, w, init, st, out, ldo, out_signed);
    default: return DwQuad<0, R>(ptrs, n, ntaps, C, w, init, st, out, ldo, out_signed);
  }
}

}  // namespace

void QDSL_DW_NHWC_QUAD(const uint8_t* const* ptrs, int64_t n, int64_t ntaps, int64_t C, const uint8_t* w,
                       const int32_t* init, const StageF32& st, uint8_t* out, int64_t ldo, bool out_signed) {
  switch (st.rounding) {
    case Rounding::kHalfEven: return DwQuadTaps<Rounding::kHalfEven>(ptrs, n, ntaps, C, w, init, st, out, ldo, out_signed);
    case Rounding::kFloor: return DwQuadTaps<Rounding::kFloor>(ptrs, n, ntaps, C, w, init, st, out, ldo, out_signed);
    case Rounding::kHalfUp: return DwQuadTaps<Rounding::kHalfUp>(ptrs, n, ntaps, C, w, init, st, out, ldo, out_signed);
    default: return DwQuadTaps<Rounding::kHalfAway>(ptrs, n, ntaps, C, w, init, st, out, ldo, out_signed);
  }
}

}  // namespace x86
}  // namespace qdsl

#undef QDSL_DW_NHWC_QUAD
