// AVX2 depthwise conv in NHWC (DwNhwcKernel contract in qdsl/gemm.h): 16 channels per step,
// the kernel taps as the loop, through an indirection of tap pointers (padded taps point at
// a zero-point row, so there are no padded copies and no border cases here).
//
// A step widens 16 codes of taps t and t + 1 to int16 and interleaves them (vpunpcklwd:
// channels 0-3 | 8-11, vpunpckhwd: 4-7 | 12-15, each channel's pair (x_t, x_t+1) adjacent),
// so one vpmaddwd with that lane order's weight pairs (kDwNhwcLane) adds w_t*x_t +
// w_t+1*x_t+1 per channel into int32: |w| <= 511 and |x| <= 255 keep every product and pair
// sum exact, and int32 adds wrap, which is exact for a total that fits (the zero point is
// folded into init).  An odd tap count pairs the last tap with zeros.  The 128-bit lane
// permutes at the start and end put init and the sums in channel order.
#pragma GCC target("avx2,fma,popcnt")
#include <immintrin.h>

#include <cstdint>

#include "kernels/x86/x86_kernels.h"
#include "requant/stage_f32_avx2.h"

namespace qdsl {
namespace x86 {
namespace {

template <bool kSigned>
inline __m256i Widen(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return kSigned ? _mm256_cvtepi8_epi16(b) : _mm256_cvtepu8_epi16(b);
}

inline __m256i Load(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// The sums of channels c0..c0+15 at one position (taps pt, weight pairs w of that channel
// block), in channel order: *a = channels 0-7, *b = 8-15.
template <bool kSigned, int kTaps>
__attribute__((always_inline)) inline void Sums16(const uint8_t* const* pt, int64_t ntaps_rt, int64_t c0,
                                                  const int32_t* w, const int32_t* init, __m256i* a_out,
                                                  __m256i* b_out) {
  const int64_t ntaps = kTaps > 0 ? kTaps : ntaps_rt;
  const __m256i zero = _mm256_setzero_si256();
  const __m256i i0 = Load(init + c0), i1 = Load(init + c0 + 8);
  __m256i lo = _mm256_permute2x128_si256(i0, i1, 0x20), hi = _mm256_permute2x128_si256(i0, i1, 0x31);
  int64_t t = 0;
  for (; t + 1 < ntaps; t += 2, w += 16) {
    const __m256i a = Widen<kSigned>(pt[t] + c0), b = Widen<kSigned>(pt[t + 1] + c0);
    lo = _mm256_add_epi32(lo, _mm256_madd_epi16(_mm256_unpacklo_epi16(a, b), Load(w)));
    hi = _mm256_add_epi32(hi, _mm256_madd_epi16(_mm256_unpackhi_epi16(a, b), Load(w + 8)));
  }
  if (t < ntaps) {
    const __m256i a = Widen<kSigned>(pt[t] + c0);
    lo = _mm256_add_epi32(lo, _mm256_madd_epi16(_mm256_unpacklo_epi16(a, zero), Load(w)));
    hi = _mm256_add_epi32(hi, _mm256_madd_epi16(_mm256_unpackhi_epi16(a, zero), Load(w + 8)));
  }
  *a_out = _mm256_permute2x128_si256(lo, hi, 0x20);
  *b_out = _mm256_permute2x128_si256(lo, hi, 0x31);
}

// kTaps > 0: the tap count at compile time (3x3: 9, 5x5: 25), so the tap loop unrolls.
template <bool kSigned, int kTaps>
void DwNhwc(const uint8_t* const* ptrs, int64_t n, int64_t ntaps_rt, int64_t C, const int32_t* pairs,
            const int32_t* init, int32_t* acc, int64_t ldc) {
  const int64_t ntaps = kTaps > 0 ? kTaps : ntaps_rt, np = (ntaps + 1) / 2;
  const int64_t cols = DwNhwcCols(C);
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* const* pt = ptrs + i * ntaps;
    int32_t* out = acc + i * ldc;
    for (int64_t c0 = 0; c0 < cols; c0 += 16) {
      __m256i a, b;
      Sums16<kSigned, kTaps>(pt, ntaps, c0, pairs + (c0 / 16) * np * 16, init, &a, &b);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c0), a);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c0 + 8), b);
    }
  }
}

// The same sums with the prepared stage applied from registers (DwNhwcStageKernel): C
// codes per position at out + i * ldo.  Channel blocks go two at a time through
// StageF32Codes32 (a lone last block as both halves; the stage's arrays are padded to
// DwNhwcCols(C), so block c0 + 16 < C reads within them).
template <bool kSigned, int kTaps, Rounding R>
void DwNhwcStage(const uint8_t* const* ptrs, int64_t n, int64_t ntaps_rt, int64_t C, const int32_t* pairs,
                 const int32_t* init, const StageF32& st, uint8_t* out, int64_t ldo, bool out_signed) {
  const int64_t ntaps = kTaps > 0 ? kTaps : ntaps_rt, np = (ntaps + 1) / 2;
  const StageF32Vec v(st);
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* const* pt = ptrs + i * ntaps;
    uint8_t* o = out + i * ldo;
    for (int64_t c0 = 0; c0 < C; c0 += 32) {
      const int64_t c1 = c0 + 16 < C ? c0 + 16 : c0;
      __m256i a0, b0, a1, b1;
      Sums16<kSigned, kTaps>(pt, ntaps, c0, pairs + (c0 / 16) * np * 16, init, &a0, &b0);
      if (c1 != c0) {
        Sums16<kSigned, kTaps>(pt, ntaps, c1, pairs + (c1 / 16) * np * 16, init, &a1, &b1);
      } else {
        a1 = a0, b1 = b0;
      }
      const __m256i codes = StageF32Codes32<R>(a0, b0, a1, b1, st, c0, c1, v, out_signed);
      if (c0 + 32 <= C) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c0), codes);
      } else {
        alignas(32) uint8_t buf[32];
        _mm256_store_si256(reinterpret_cast<__m256i*>(buf), codes);
        for (int64_t k = 0; c0 + k < C; ++k) o[c0 + k] = buf[k];
      }
    }
  }
}

template <bool kSigned, Rounding R>
void DwNhwcStageTaps(const uint8_t* const* ptrs, int64_t n, int64_t ntaps, int64_t C, const int32_t* pairs,
                     const int32_t* init, const StageF32& st, uint8_t* out, int64_t ldo, bool out_signed) {
  switch (ntaps) {
    case 9: return DwNhwcStage<kSigned, 9, R>(ptrs, n, ntaps, C, pairs, init, st, out, ldo, out_signed);
    case 25: return DwNhwcStage<kSigned, 25, R>(ptrs, n, ntaps, C, pairs, init, st, out, ldo, out_signed);
    default: return DwNhwcStage<kSigned, 0, R>(ptrs, n, ntaps, C, pairs, init, st, out, ldo, out_signed);
  }
}

template <Rounding R>
void DwNhwcStageSigned(const uint8_t* const* ptrs, int64_t n, int64_t ntaps, int64_t C, bool x_signed,
                       const int32_t* pairs, const int32_t* init, const StageF32& st, uint8_t* out, int64_t ldo,
                       bool out_signed) {
  if (x_signed) {
    DwNhwcStageTaps<true, R>(ptrs, n, ntaps, C, pairs, init, st, out, ldo, out_signed);
  } else {
    DwNhwcStageTaps<false, R>(ptrs, n, ntaps, C, pairs, init, st, out, ldo, out_signed);
  }
}

template <bool kSigned>
void DwNhwcTaps(const uint8_t* const* ptrs, int64_t n, int64_t ntaps, int64_t C, const int32_t* pairs,
                const int32_t* init, int32_t* acc, int64_t ldc) {
  switch (ntaps) {
    case 9: return DwNhwc<kSigned, 9>(ptrs, n, ntaps, C, pairs, init, acc, ldc);
    case 25: return DwNhwc<kSigned, 25>(ptrs, n, ntaps, C, pairs, init, acc, ldc);
    default: return DwNhwc<kSigned, 0>(ptrs, n, ntaps, C, pairs, init, acc, ldc);
  }
}

}  // namespace

void DwConvNhwcStageAvx2(const uint8_t* const* ptrs, int64_t n, int64_t ntaps, int64_t C, bool x_signed,
                         const int32_t* pairs, const int32_t* init, const StageF32& st, uint8_t* out, int64_t ldo,
                         bool out_signed) {
  switch (st.rounding) {
    case Rounding::kHalfEven: return DwNhwcStageSigned<Rounding::kHalfEven>(ptrs, n, ntaps, C, x_signed, pairs, init, st, out, ldo, out_signed);
    case Rounding::kFloor: return DwNhwcStageSigned<Rounding::kFloor>(ptrs, n, ntaps, C, x_signed, pairs, init, st, out, ldo, out_signed);
    case Rounding::kHalfUp: return DwNhwcStageSigned<Rounding::kHalfUp>(ptrs, n, ntaps, C, x_signed, pairs, init, st, out, ldo, out_signed);
    default: return DwNhwcStageSigned<Rounding::kHalfAway>(ptrs, n, ntaps, C, x_signed, pairs, init, st, out, ldo, out_signed);
  }
}

void DwConvNhwcAvx2(const uint8_t* const* ptrs, int64_t n, int64_t ntaps, int64_t C, bool x_signed,
                    const int32_t* taps, const int32_t* pairs, const int32_t* init, int32_t* acc, int64_t ldc) {
  (void)taps;
  if (x_signed) {
    DwNhwcTaps<true>(ptrs, n, ntaps, C, pairs, init, acc, ldc);
  } else {
    DwNhwcTaps<false>(ptrs, n, ntaps, C, pairs, init, acc, ldc);
  }
}

}  // namespace x86
}  // namespace qdsl
