// AVX2 QUANTIZE of float input (docs/qgraph.md §4.4), eight lanes at a time:
// v = x * inv (binary32, as the reference), q = clamp(round(v) + zp, qmin, qmax).
//
// Every rounding is taken on the exact float v without a float addition that could round:
// with f = floor(v), v - f is exact (f and v share the exponent range, Sterbenz), so
// HALF_UP = f + (v - f >= 1/2) and HALF_AWAY = sign(v) * HALF_UP(|v|); HALF_EVEN and FLOOR
// are roundps modes.  r + zp is exact while |r| < 2^24 and, beyond that, far outside
// [qmin, qmax] in [-128, 255] either way, so the clamp in float is exact; +-inf clamp,
// NaN lanes take clamp(zp, qmin, qmax).
#pragma GCC target("avx2,fma,popcnt")
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "kernels/x86/x86_kernels.h"

namespace qdsl {
namespace x86 {
namespace {

inline __m256 HalfUp(__m256 v) {
  const __m256 f = _mm256_round_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m256 up = _mm256_cmp_ps(_mm256_sub_ps(v, f), _mm256_set1_ps(0.5f), _CMP_GE_OQ);
  return _mm256_add_ps(f, _mm256_and_ps(up, _mm256_set1_ps(1.0f)));
}

inline __m256 Round(__m256 v, int mode) {
  switch (mode) {
    case 1: return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    case 2: return _mm256_round_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    case 3: return HalfUp(v);
    default: {  // half away: sign(v) * floor(|v| + 1/2)
      const __m256 sign = _mm256_set1_ps(-0.0f);
      const __m256 a = _mm256_andnot_ps(sign, v);
      return _mm256_or_ps(HalfUp(a), _mm256_and_ps(sign, v));
    }
  }
}

// Scalar: the same formula (the reference's double rounding of a float is exact).
inline int32_t One(float x, float inv, int32_t zp, int32_t lo, int32_t hi, int mode) {
  const float v = x * inv;
  if (std::isnan(v)) return zp < lo ? lo : (zp > hi ? hi : zp);
  const double d = v;
  double r;
  switch (mode) {
    case 1: r = std::nearbyint(d); break;
    case 2: r = std::floor(d); break;
    case 3: r = std::floor(d + 0.5); break;
    default: r = d < 0 ? -std::floor(-d + 0.5) : std::floor(d + 0.5); break;
  }
  r += zp;
  return r < lo ? lo : (r > hi ? hi : static_cast<int32_t>(r));
}

}  // namespace

void QuantizeF32Avx2(const float* x, int64_t n, float inv, int32_t zp, int32_t qmin, int32_t qmax, int rounding,
                     uint8_t* out, bool out_signed) {
  const __m256 vinv = _mm256_set1_ps(inv), vzp = _mm256_set1_ps(static_cast<float>(zp));
  const __m256 lo = _mm256_set1_ps(static_cast<float>(qmin)), hi = _mm256_set1_ps(static_cast<float>(qmax));
  const int32_t zc = zp < qmin ? qmin : (zp > qmax ? qmax : zp);
  const __m256 nan_val = _mm256_set1_ps(static_cast<float>(zc));
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), vinv);
    __m256 q = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(Round(v, rounding), vzp), lo), hi);
    q = _mm256_blendv_ps(q, nan_val, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256i y = _mm256_cvttps_epi32(q);
    const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(y), _mm256_extracti128_si256(y, 1));
    const __m128i b = out_signed ? _mm_packs_epi16(w16, w16) : _mm_packus_epi16(w16, w16);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + i), b);
  }
  for (; i < n; ++i) out[i] = static_cast<uint8_t>(One(x[i], inv, zp, qmin, qmax, rounding));
}

}  // namespace x86
}  // namespace qdsl
