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

namespace qdsl {
namespace x86 {
namespace {

template <bool kSigned>
inline __m256i Widen(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return kSigned ? _mm256_cvtepi8_epi16(b) : _mm256_cvtepu8_epi16(b);
}

inline __m256i Load(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// kTaps > 0: the tap count at compile time (3x3: 9, 5x5: 25), so the tap loop unrolls.
template <bool kSigned, int kTaps>
void DwNhwc(const uint8_t* const* ptrs, int64_t n, int64_t ntaps_rt, int64_t C, const int32_t* pairs,
            const int32_t* init, int32_t* acc, int64_t ldc) {
  const int64_t ntaps = kTaps > 0 ? kTaps : ntaps_rt;
  const int64_t cols = DwNhwcCols(C);
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* const* pt = ptrs + i * ntaps;
    int32_t* out = acc + i * ldc;
    const int32_t* w = pairs;
    for (int64_t c0 = 0; c0 < cols; c0 += 16) {
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
        w += 16;
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c0), _mm256_permute2x128_si256(lo, hi, 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c0 + 8), _mm256_permute2x128_si256(lo, hi, 0x31));
    }
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
