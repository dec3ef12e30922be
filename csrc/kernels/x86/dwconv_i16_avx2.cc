// AVX2 depthwise conv of one channel plane (DwConvShape in qdsl/gemm.h), stride 1 or 2,
// dilation 1 along rows, any kernel size and vertical stride / dilation.
//
// vpmaddwd multiplies int16 pairs and adds each pair into an int32 lane.  With the taps of
// a kernel row paired as (2j, 2j + 1), output ox needs the pair of input columns
// (ox*sw + 2j, ox*sw + 2j + 1):
//   stride 2: consecutive outputs step by one pair, so one unaligned load at column
//     2*ox0 + 2j holds the pairs of 8 outputs ox0..ox0+7: madd with the broadcast tap pair.
//   stride 1: even outputs ox0 + 2i read the pair at column ox0 + 2i + 2j (one load at
//     ox0 + 2j), odd outputs the pair at ox0 + 2i + 1 + 2j (one load at ox0 + 1 + 2j); the
//     even and odd sums are interleaved once at the end.
// An odd kw pairs its last tap with a zero tap, which reads a finite (padded) column.  Each
// block of 16 outputs takes kh * ceil(kw / 2) * 2 loads and madds, no shuffles in the loop.
// Rows of at most 8 outputs (7x7 planes) take the same steps on 128-bit vectors (a 16-output
// block would compute 16 for 7).
#pragma GCC target("avx2,fma,popcnt")
#include <immintrin.h>

#include <cstdint>

#include "kernels/x86/x86_kernels.h"

namespace qdsl {
namespace x86 {
namespace {

inline __m256i Load(const int16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m128i Load8(const int16_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

// ow <= 8: one block of 8 outputs per row; stride 2: a0 = outputs 0..3, a1 = 4..7;
// stride 1: a0 even, a1 odd outputs (unpacking them gives the order: no lane crossing).
template <int S, int NP>
void DwPlane8(const int16_t* plane, int64_t ldp, const DwConvShape& s, const int32_t* pairs, int32_t init,
              int32_t* acc, int64_t lda) {
  const int np = NP > 0 ? NP : static_cast<int>((s.kw + 1) / 2);
  const __m128i vinit = _mm_set1_epi32(init);
  const int64_t row_step = s.dh * ldp;
  for (int64_t oy = 0; oy < s.oh; ++oy) {
    __m128i a0 = vinit, a1 = vinit;
    const int16_t* r = plane + oy * s.sh * ldp;
    const int32_t* w = pairs;
    for (int64_t ky = 0; ky < s.kh; ++ky, r += row_step, w += np) {
      for (int j = 0; j < np; ++j) {
        const __m128i wv = _mm_set1_epi32(w[j]);
        a0 = _mm_add_epi32(a0, _mm_madd_epi16(Load8(r + 2 * j), wv));
        a1 = _mm_add_epi32(a1, _mm_madd_epi16(Load8(r + (S == 2 ? 8 : 1) + 2 * j), wv));
      }
    }
    if (S == 1) {
      const __m128i lo = _mm_unpacklo_epi32(a0, a1), hi = _mm_unpackhi_epi32(a0, a1);
      a0 = lo;
      a1 = hi;
    }
    int32_t* out = acc + oy * lda;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), a0);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 4), a1);
  }
}

// NP > 0: compile-time pairs per kernel row (3x3: 2, 5x5: 3); NP == 0: s.kw at run time.
template <int S, int NP>
void DwPlane(const int16_t* plane, int64_t ldp, const DwConvShape& s, const int32_t* pairs, int32_t init,
             int32_t* acc, int64_t lda) {
  const int np = NP > 0 ? NP : static_cast<int>((s.kw + 1) / 2);
  const __m256i vinit = _mm256_set1_epi32(init);
  const int64_t ow16 = DwConvAccCols(s), row_step = s.dh * ldp;
  for (int64_t oy = 0; oy < s.oh; ++oy) {
    const int16_t* top = plane + oy * s.sh * ldp;
    int32_t* out = acc + oy * lda;
    for (int64_t ox = 0; ox < ow16; ox += 16) {
      // stride 2: a0 = outputs ox..ox+7, a1 = ox+8..ox+15; stride 1: a0 even, a1 odd outputs
      __m256i a0 = vinit, a1 = vinit;
      const int16_t* r = top + S * ox;
      const int32_t* w = pairs;
      for (int64_t ky = 0; ky < s.kh; ++ky, r += row_step, w += np) {
        for (int j = 0; j < np; ++j) {
          const __m256i wv = _mm256_set1_epi32(w[j]);
          a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(Load(r + 2 * j), wv));
          a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(Load(r + (S == 2 ? 16 : 1) + 2 * j), wv));
        }
      }
      if (S == 1) {  // e0 o0 e1 o1 | e4 o4 e5 o5 and e2 o2 e3 o3 | e6 o6 e7 o7 -> outputs in order
        const __m256i lo = _mm256_unpacklo_epi32(a0, a1), hi = _mm256_unpackhi_epi32(a0, a1);
        a0 = _mm256_permute2x128_si256(lo, hi, 0x20);
        a1 = _mm256_permute2x128_si256(lo, hi, 0x31);
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + ox), a0);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + ox + 8), a1);
    }
  }
}

// 3x3 (kh 3, two pairs per kernel row), the MobileNet case: the six tap pairs broadcast once
// per plane into registers (the general loop re-broadcast them for every block of 16) and
// the kernel rows unrolled.
template <int S>
void DwPlane3x3(const int16_t* plane, int64_t ldp, const DwConvShape& s, const int32_t* pairs, int32_t init,
                int32_t* acc, int64_t lda) {
  const __m256i vinit = _mm256_set1_epi32(init);
  const __m256i w0 = _mm256_set1_epi32(pairs[0]), w1 = _mm256_set1_epi32(pairs[1]);
  const __m256i w2 = _mm256_set1_epi32(pairs[2]), w3 = _mm256_set1_epi32(pairs[3]);
  const __m256i w4 = _mm256_set1_epi32(pairs[4]), w5 = _mm256_set1_epi32(pairs[5]);
  const int64_t ow16 = DwConvAccCols(s), row_step = s.dh * ldp;
  constexpr int kOdd = S == 2 ? 16 : 1;  // the second vector's offset (see DwPlane)
  for (int64_t oy = 0; oy < s.oh; ++oy) {
    const int16_t* top = plane + oy * s.sh * ldp;
    int32_t* out = acc + oy * lda;
    for (int64_t ox = 0; ox < ow16; ox += 16) {
      const int16_t* r0 = top + S * ox;
      const int16_t* r1 = r0 + row_step;
      const int16_t* r2 = r1 + row_step;
      __m256i a0 = _mm256_add_epi32(vinit, _mm256_madd_epi16(Load(r0), w0));
      __m256i a1 = _mm256_add_epi32(vinit, _mm256_madd_epi16(Load(r0 + kOdd), w0));
      __m256i b0 = _mm256_madd_epi16(Load(r0 + 2), w1);
      __m256i b1 = _mm256_madd_epi16(Load(r0 + kOdd + 2), w1);
      a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(Load(r1), w2));
      a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(Load(r1 + kOdd), w2));
      b0 = _mm256_add_epi32(b0, _mm256_madd_epi16(Load(r1 + 2), w3));
      b1 = _mm256_add_epi32(b1, _mm256_madd_epi16(Load(r1 + kOdd + 2), w3));
      a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(Load(r2), w4));
      a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(Load(r2 + kOdd), w4));
      b0 = _mm256_add_epi32(b0, _mm256_madd_epi16(Load(r2 + 2), w5));
      b1 = _mm256_add_epi32(b1, _mm256_madd_epi16(Load(r2 + kOdd + 2), w5));
      a0 = _mm256_add_epi32(a0, b0);  // int32 sums are exact (no overflow): any order
      a1 = _mm256_add_epi32(a1, b1);
      if (S == 1) {
        const __m256i lo = _mm256_unpacklo_epi32(a0, a1), hi = _mm256_unpackhi_epi32(a0, a1);
        a0 = _mm256_permute2x128_si256(lo, hi, 0x20);
        a1 = _mm256_permute2x128_si256(lo, hi, 0x31);
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + ox), a0);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + ox + 8), a1);
    }
  }
}

template <int S>
void DwPlaneStride(const int16_t* plane, int64_t ldp, const DwConvShape& s, const int32_t* pairs, int32_t init,
                   int32_t* acc, int64_t lda) {
  if (s.ow <= 8) {
    switch ((s.kw + 1) / 2) {
      case 2: return DwPlane8<S, 2>(plane, ldp, s, pairs, init, acc, lda);
      case 3: return DwPlane8<S, 3>(plane, ldp, s, pairs, init, acc, lda);
      default: return DwPlane8<S, 0>(plane, ldp, s, pairs, init, acc, lda);
    }
  }
  if (s.kh == 3 && s.kw == 3) return DwPlane3x3<S>(plane, ldp, s, pairs, init, acc, lda);
  switch ((s.kw + 1) / 2) {
    case 1: return DwPlane<S, 1>(plane, ldp, s, pairs, init, acc, lda);
    case 2: return DwPlane<S, 2>(plane, ldp, s, pairs, init, acc, lda);
    case 3: return DwPlane<S, 3>(plane, ldp, s, pairs, init, acc, lda);
    case 4: return DwPlane<S, 4>(plane, ldp, s, pairs, init, acc, lda);
    default: return DwPlane<S, 0>(plane, ldp, s, pairs, init, acc, lda);
  }
}

}  // namespace

void DwConvAvx2(const int16_t* plane, int64_t ldp, const DwConvShape& s, const int32_t* taps, const int32_t* pairs,
                int32_t init, int32_t* acc, int64_t lda) {
  (void)taps;
  if (s.sw == 2) {
    DwPlaneStride<2>(plane, ldp, s, pairs, init, acc, lda);
  } else {
    DwPlaneStride<1>(plane, ldp, s, pairs, init, acc, lda);
  }
}

// The interior of a padded int16 plane (conv_dw.cc FillInterior's contract): rows
// [ph, min(rows, ph + H)) get input row r - ph minus zp at columns [pw, pw + W), 16 values
// per step.  A row's last step (and whole rows narrower than 16: 7 x 7 and 14 x 14 planes)
// stores its 16 lanes with the ones past W set to 0, the padding's value: the caller's row
// pitch ldp >= pw + 16 + (W rounded down to 16) (DwConvPlaneCols), and those columns must
// hold 0 anyway.  Loads never pass the plane's end (the last 16 bytes go through a copy).
void DwFillPlaneAvx2(const uint8_t* x, bool x_signed, int64_t H, int64_t W, int64_t ph, int64_t pw, int64_t rows,
                     int64_t ldp, int32_t zp, int16_t* xp) {
  const __m256i z = _mm256_set1_epi16(static_cast<int16_t>(zp));
  const __m256i idx = _mm256_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const uint8_t* end = x + H * W;
  auto widen = [&](__m128i b) { return _mm256_sub_epi16(x_signed ? _mm256_cvtepi8_epi16(b) : _mm256_cvtepu8_epi16(b), z); };
  const int64_t last = rows < ph + H ? rows : ph + H;
  for (int64_t r = ph < rows ? ph : rows; r < last; ++r) {
    int16_t* dst = xp + r * ldp + pw;
    const uint8_t* src = x + (r - ph) * W;
    int64_t i = 0;
    for (; i + 16 <= W; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
    if (i < W) {
      const int64_t n = W - i;
      __m128i b;
      if (end - (src + i) >= 16) {
        b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      } else {
        alignas(16) uint8_t tmp[16] = {0};
        for (int64_t j = 0; j < n; ++j) tmp[j] = src[i + j];
        b = _mm_load_si128(reinterpret_cast<const __m128i*>(tmp));
      }
      const __m256i keep = _mm256_cmpgt_epi16(_mm256_set1_epi16(static_cast<int16_t>(n)), idx);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_and_si256(widen(b), keep));
    }
  }
}

}  // namespace x86
}  // namespace qdsl
