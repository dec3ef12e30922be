// AVX2 LAYERNORM row passes (LayernormKernels in csrc/dispatch.h; the formula and its bounds
// are in csrc/runtime/ops/layernorm.cc), eight int32 lanes at a time:
//   sum:    the saturating pair sum (an overflow flips the sign of both addends' common
//           sign: the lane takes INT32_MIN or INT32_MAX by the addend's sign), int32 min/max,
//           and Σ v in int64 lanes (|Σ| < 40000 · 2^31).
//   center: k == 0: |n·v - sum| < 2^24, so the int32 products and difference, computed
//           modulo 2^32, are exact.  k > 0: n·v - sum in binary64 (n·v < 2^53 and the
//           difference below 2^52 are integers, exact); |c|·2^-k + 1/2 needs at most
//           bitlen(c) + 1 <= 53 significant bits, so floor of it is round_half_away(|c| / 2^k)
//           exactly.  Σ d² (d² <= 2^48) in int64 lanes (vpmuldq).
#pragma GCC target("avx2,fma,popcnt")
#include <immintrin.h>

#include <cstdint>

#include "kernels/x86/x86_kernels.h"
#include "qdsl/requant.h"

namespace qdsl {
namespace x86 {
namespace {

inline int64_t HSum64(__m256i v) {
  const __m128i s = _mm_add_epi64(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  return _mm_cvtsi128_si64(s) + _mm_extract_epi64(s, 1);
}

inline int32_t HMin32(__m256i v) {
  __m128i s = _mm_min_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_min_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_min_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

inline int32_t HMax32(__m256i v) {
  __m128i s = _mm_max_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_max_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_max_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// The squares of the eight int32 lanes of d summed into two int64 accumulators.
inline void AddSquares(__m256i d, __m256i* w0, __m256i* w1) {
  *w0 = _mm256_add_epi64(*w0, _mm256_mul_epi32(d, d));  // even lanes
  const __m256i odd = _mm256_srli_epi64(d, 32);
  *w1 = _mm256_add_epi64(*w1, _mm256_mul_epi32(odd, odd));
}

// round_half_away((n·v - sum) / 2^k), k > 0, for four lanes (see the file comment).
inline __m128i CenterShift4(__m128i v, __m256d n, __m256d sum, __m256d scale) {
  const __m256d sign = _mm256_set1_pd(-0.0), half = _mm256_set1_pd(0.5);
  const __m256d c = _mm256_sub_pd(_mm256_mul_pd(_mm256_cvtepi32_pd(v), n), sum);
  const __m256d a = _mm256_floor_pd(_mm256_add_pd(_mm256_mul_pd(_mm256_andnot_pd(sign, c), scale), half));
  return _mm256_cvttpd_epi32(_mm256_or_pd(a, _mm256_and_pd(sign, c)));  // |result| <= 2^24: exact
}

}  // namespace

void LayernormSumAvx2(const int32_t* t0, const int32_t* t1, int64_t n, int32_t* v, int64_t* sum, int32_t* lo,
                      int32_t* hi) {
  __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
  __m256i mn = _mm256_set1_epi32(INT32_MAX), mx = _mm256_set1_epi32(INT32_MIN);
  const __m256i big = _mm256_set1_epi32(INT32_MAX);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t0 + i));
    if (t1 != nullptr) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t1 + i));
      const __m256i s = _mm256_add_epi32(x, b);
      // overflow: s's sign differs from both addends'; then INT32_MAX ^ (x >> 31) is the bound
      const __m256i ovf = _mm256_and_si256(_mm256_xor_si256(s, x), _mm256_xor_si256(s, b));
      const __m256i sat = _mm256_xor_si256(_mm256_srai_epi32(x, 31), big);
      x = _mm256_castps_si256(
          _mm256_blendv_ps(_mm256_castsi256_ps(s), _mm256_castsi256_ps(sat), _mm256_castsi256_ps(ovf)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(v + i), x);
    }
    mn = _mm256_min_epi32(mn, x);
    mx = _mm256_max_epi32(mx, x);
    s0 = _mm256_add_epi64(s0, _mm256_cvtepi32_epi64(_mm256_castsi256_si128(x)));
    s1 = _mm256_add_epi64(s1, _mm256_cvtepi32_epi64(_mm256_extracti128_si256(x, 1)));
  }
  int64_t total = HSum64(_mm256_add_epi64(s0, s1));
  int32_t l = HMin32(mn), h = HMax32(mx);
  for (; i < n; ++i) {
    int32_t x = t0[i];
    if (t1 != nullptr) v[i] = x = static_cast<int32_t>(Sat32(static_cast<int64_t>(x) + t1[i]));
    total += x;
    l = x < l ? x : l;
    h = x > h ? x : h;
  }
  *sum = total;
  *lo = l;
  *hi = h;
}

int64_t LayernormCenterAvx2(const int32_t* v, int64_t n, int64_t sum, int k, int32_t* d) {
  __m256i w0 = _mm256_setzero_si256(), w1 = _mm256_setzero_si256();
  int64_t i = 0;
  if (k == 0) {
    // modulo 2^32: exact, the result is below 2^24 in magnitude
    const __m256i vn = _mm256_set1_epi32(static_cast<int32_t>(n));
    const __m256i vs = _mm256_set1_epi32(static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint64_t>(sum))));
    for (; i + 8 <= n; i += 8) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + i));
      const __m256i c = _mm256_sub_epi32(_mm256_mullo_epi32(x, vn), vs);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i), c);
      AddSquares(c, &w0, &w1);
    }
  } else {
    const __m256d vn = _mm256_set1_pd(static_cast<double>(n)), vs = _mm256_set1_pd(static_cast<double>(sum)),
                  scale = _mm256_set1_pd(1.0 / static_cast<double>(int64_t{1} << k));
    for (; i + 8 <= n; i += 8) {
      const __m128i a = CenterShift4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + i)), vn, vs, scale);
      const __m128i b = CenterShift4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + i + 4)), vn, vs, scale);
      const __m256i c = _mm256_set_m128i(b, a);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i), c);
      AddSquares(c, &w0, &w1);
    }
  }
  int64_t w = HSum64(_mm256_add_epi64(w0, w1));
  const int64_t half = k > 0 ? int64_t{1} << (k - 1) : 0;
  for (; i < n; ++i) {
    const int64_t c = n * v[i] - sum;
    const int64_t a = ((c < 0 ? -c : c) + half) >> k;
    d[i] = static_cast<int32_t>(c < 0 ? -a : a);
    w += a * a;
  }
  return w;
}

}  // namespace x86
}  // namespace qdsl
