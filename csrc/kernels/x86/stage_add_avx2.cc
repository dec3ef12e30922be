// AVX2 form of the fused conv stage + residual ADD (StageAddRowsKernel; the estimate and its
// proof in requant/stage_add_f32.h): eight channels per step, the flagged lanes recomputed
// by the exact chain.
#pragma GCC target("avx2,fma")
#include <immintrin.h>

#include <cstdint>

#include "kernels/x86/x86_kernels.h"
#include "requant/stage_add_f32.h"

namespace qdsl {
namespace x86 {
namespace {

// The other input's kind: u8 codes, s8 codes, int32 values.
enum Other { kU8 = 0, kS8 = 1, kI32 = 2 };

template <int kOther>
inline __m256 Values8(const uint8_t* x, int64_t i) {
  if (kOther == kI32) return _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 4 * i)));
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(x + i));
  return _mm256_cvtepi32_ps(kOther == kS8 ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
}

template <int kOther>
inline int32_t Value(const uint8_t* x, int64_t i) {
  if (kOther == kI32) return reinterpret_cast<const int32_t*>(x)[i];
  return kOther == kS8 ? static_cast<int8_t>(x[i]) : x[i];
}

struct Consts {
  __m256 b, k, smax, eps, lof, hif, thr, half, sign;
  __m256i zp;
  explicit Consts(const StageAddF32& s)
      : b(_mm256_set1_ps(s.b)), k(_mm256_set1_ps(s.k)), smax(_mm256_set1_ps(s.smax)), eps(_mm256_set1_ps(s.eps)),
        lof(_mm256_set1_ps(s.lof)), hif(_mm256_set1_ps(s.hif)), thr(_mm256_set1_ps(s.thr)),
        half(_mm256_set1_ps(0.5f)), sign(_mm256_set1_ps(-0.0f)), zp(_mm256_set1_epi32(s.zp)) {}
};

// Eight codes (zero point added, as int32) of channels c..c+7 of one position; *flag gets
// the lanes the estimate cannot decide.
template <int kOther, bool kFloor>
__attribute__((always_inline)) inline __m256i Estimate8(const int32_t* acc, const float* a, const uint8_t* x,
                                                        int64_t i, const Consts& v, __m256* flag) {  // (sets *flag)
  const __m256 p0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc))),
                                  _mm256_loadu_ps(a));
  const __m256 q = _mm256_fmadd_ps(Values8<kOther>(x, i), v.b, v.k);
  __m256 z = _mm256_add_ps(p0, q);
  if (kFloor) z = _mm256_sub_ps(z, v.half);
  z = _mm256_min_ps(_mm256_max_ps(z, v.lof), v.hif);
  const __m256 r = _mm256_round_ps(z, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // |p0| + |q|: the float error's scale and the saturation guard
  const __m256 mag = _mm256_add_ps(_mm256_andnot_ps(v.sign, p0), _mm256_andnot_ps(v.sign, q));
  const __m256 dist = _mm256_fmadd_ps(mag, v.eps, _mm256_andnot_ps(v.sign, _mm256_sub_ps(z, r)));
  *flag = _mm256_or_ps(_mm256_cmp_ps(dist, v.thr, _CMP_GT_OQ), _mm256_cmp_ps(mag, v.smax, _CMP_GT_OQ));
  return _mm256_add_epi32(_mm256_cvtps_epi32(r), v.zp);
}

template <int kOther, bool kFloor>
void Rows(const int32_t* acc, int64_t rows, int64_t cols, int64_t lda, const StageAddF32& s, int64_t c0,
          const uint8_t* other, int64_t ldo, uint8_t* y, int64_t ldy) {
  const Consts v(s);
  const int64_t esize = kOther == kI32 ? 4 : 1;
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t* ar = acc + r * lda;
    const uint8_t* xr = other + r * ldo * esize;
    uint8_t* yr = y + r * ldy;
    int64_t c = 0;
    for (; c + 16 <= cols; c += 16) {
      __m256 f0, f1;
      const __m256i lo = Estimate8<kOther, kFloor>(ar + c, s.a.data() + c0 + c, xr, c, v, &f0);
      const __m256i hi = Estimate8<kOther, kFloor>(ar + c + 8, s.a.data() + c0 + c + 8, xr, c + 8, v, &f1);
      // codes within [-128, 255]: both packs are exact
      const __m128i wl = _mm_packs_epi32(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1));
      const __m128i wh = _mm_packs_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(yr + c),
                       s.y_signed ? _mm_packs_epi16(wl, wh) : _mm_packus_epi16(wl, wh));
      unsigned bits = static_cast<unsigned>(_mm256_movemask_ps(f0)) | (static_cast<unsigned>(_mm256_movemask_ps(f1)) << 8);
      while (__builtin_expect(bits != 0, 0)) {  // the flagged lanes
        const int64_t i = c + __builtin_ctz(bits);
        bits &= bits - 1;
        yr[i] = static_cast<uint8_t>(StageAddOne(s, ar[i], c0 + i, Value<kOther>(xr, i)));
      }
    }
    if (c + 8 <= cols) {  // (24 channels: MobileNetV2's narrowest projections)
      __m256 f0;
      const __m256i lo = Estimate8<kOther, kFloor>(ar + c, s.a.data() + c0 + c, xr, c, v, &f0);
      const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(yr + c), s.y_signed ? _mm_packs_epi16(w, w) : _mm_packus_epi16(w, w));
      for (unsigned bits = static_cast<unsigned>(_mm256_movemask_ps(f0)); bits != 0; bits &= bits - 1) {
        const int64_t i = c + __builtin_ctz(bits);
        yr[i] = static_cast<uint8_t>(StageAddOne(s, ar[i], c0 + i, Value<kOther>(xr, i)));
      }
      c += 8;
    }
    for (; c < cols; ++c)  // (a panel past the last channel)
      yr[c] = static_cast<uint8_t>(StageAddOne(s, ar[c], c0 + c, Value<kOther>(xr, c)));
  }
}

template <int kOther>
void RowsFor(const int32_t* acc, int64_t rows, int64_t cols, int64_t lda, const StageAddF32& s, int64_t c0,
             const uint8_t* other, int64_t ldo, uint8_t* y, int64_t ldy) {
  if (s.rounding == Rounding::kFloor) {
    Rows<kOther, true>(acc, rows, cols, lda, s, c0, other, ldo, y, ldy);
  } else {
    Rows<kOther, false>(acc, rows, cols, lda, s, c0, other, ldo, y, ldy);
  }
}

}  // namespace

void StageAddRowsAvx2(const int32_t* acc, int64_t rows, int64_t cols, int64_t lda, const StageAddF32& s, int64_t c0,
                      const uint8_t* other, int64_t ldo, uint8_t* y, int64_t ldy) {
  if (s.other_i32) return RowsFor<kI32>(acc, rows, cols, lda, s, c0, other, ldo, y, ldy);
  if (s.other_signed) return RowsFor<kS8>(acc, rows, cols, lda, s, c0, other, ldo, y, ldy);
  RowsFor<kU8>(acc, rows, cols, lda, s, c0, other, ldo, y, ldy);
}

}  // namespace x86
}  // namespace qdsl
