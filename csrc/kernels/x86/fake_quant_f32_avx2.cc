// AVX2 fake quantization and min/max, eight lanes at a time (csrc/kernels/fake_quant.h gives
// the formula).  Each step is the instruction torch's AVX2 kernel uses for it: mulps,
// roundps(nearest), then maxps(lo, r) / minps(hi, r), which return their second operand r
// when the two are equal or r is NaN (torch's vec clamp with scalar bounds has the same
// operand order, so the sign of a zero and a NaN pass through as there); a NaN lane becomes
// +0.0 and is multiplied by s.  No FMA: every operation rounds once, as in torch.
#pragma GCC target("avx2,fma,popcnt")
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "kernels/fake_quant.h"

namespace qdsl {
namespace x86 {
namespace {

inline __m256 Fq(__m256 x, __m256 s, __m256 inv, __m256 lo, __m256 hi) {
  __m256 r = _mm256_round_ps(_mm256_mul_ps(x, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  r = _mm256_min_ps(hi, _mm256_max_ps(lo, r));
  r = _mm256_andnot_ps(_mm256_cmp_ps(r, r, _CMP_UNORD_Q), r);
  return _mm256_mul_ps(r, s);
}

// mask of the first n (< 8) lanes
inline __m256i Head(int64_t n) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), idx);
}

// n values sharing one set of parameters
void Run(const float* x, float* y, int64_t n, float s0, float inv0, float lo0, float hi0) {
  const __m256 s = _mm256_set1_ps(s0), inv = _mm256_set1_ps(inv0);
  const __m256 lo = _mm256_set1_ps(lo0), hi = _mm256_set1_ps(hi0);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
    const __m256 c = _mm256_loadu_ps(x + i + 16), d = _mm256_loadu_ps(x + i + 24);
    _mm256_storeu_ps(y + i, Fq(a, s, inv, lo, hi));
    _mm256_storeu_ps(y + i + 8, Fq(b, s, inv, lo, hi));
    _mm256_storeu_ps(y + i + 16, Fq(c, s, inv, lo, hi));
    _mm256_storeu_ps(y + i + 24, Fq(d, s, inv, lo, hi));
  }
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, Fq(_mm256_loadu_ps(x + i), s, inv, lo, hi));
  if (i < n) {
    const __m256i m = Head(n - i);
    _mm256_maskstore_ps(y + i, m, Fq(_mm256_maskload_ps(x + i, m), s, inv, lo, hi));
  }
}

// one row of `channels` values, parameters varying along it (inner == 1: channels_last, last axis)
void Row(const float* x, float* y, int64_t channels, const qdsl::FakeQuantParams& p) {
  const __m256 lo0 = _mm256_set1_ps(p.lo0), hi0 = _mm256_set1_ps(p.hi0);
  int64_t c = 0;
  for (; c + 8 <= channels; c += 8) {
    const __m256 lo = p.lo ? _mm256_loadu_ps(p.lo + c) : lo0, hi = p.hi ? _mm256_loadu_ps(p.hi + c) : hi0;
    _mm256_storeu_ps(y + c, Fq(_mm256_loadu_ps(x + c), _mm256_loadu_ps(p.s + c), _mm256_loadu_ps(p.inv + c), lo, hi));
  }
  if (c < channels) {
    const __m256i m = Head(channels - c);
    // masked-off lanes load 0.0 parameters: their results are never stored
    const __m256 lo = p.lo ? _mm256_maskload_ps(p.lo + c, m) : lo0, hi = p.hi ? _mm256_maskload_ps(p.hi + c, m) : hi0;
    _mm256_maskstore_ps(y + c, m,
                        Fq(_mm256_maskload_ps(x + c, m), _mm256_maskload_ps(p.s + c, m),
                           _mm256_maskload_ps(p.inv + c, m), lo, hi));
  }
}

}  // namespace

void FakeQuantF32Avx2(const float* x, float* y, int64_t outer, int64_t channels, int64_t inner,
                      const FakeQuantParams& p) {
  if (inner == 1 && channels > 1) {
    for (int64_t o = 0; o < outer; ++o) Row(x + o * channels, y + o * channels, channels, p);
    return;
  }
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t c = 0; c < channels; ++c) {
      const int64_t base = (o * channels + c) * inner;
      Run(x + base, y + base, inner, p.s[c], p.inv[c], p.lo ? p.lo[c] : p.lo0, p.hi ? p.hi[c] : p.hi0);
    }
  }
}

void MinMaxF32Avx2(const float* x, int64_t n, float* lo, float* hi) {
  // minps/maxps drop a NaN in one operand order; the NaN lanes are tracked separately.  Four
  // independent min/max chains keep the loads in flight.
  __m256 a0 = _mm256_set1_ps(x[0]), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
  __m256 nan0 = _mm256_setzero_ps(), nan1 = nan0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
    const __m256 v2 = _mm256_loadu_ps(x + i + 16), v3 = _mm256_loadu_ps(x + i + 24);
    a0 = _mm256_min_ps(a0, v0);
    a1 = _mm256_min_ps(a1, v1);
    a2 = _mm256_min_ps(a2, v2);
    a3 = _mm256_min_ps(a3, v3);
    b0 = _mm256_max_ps(b0, v0);
    b1 = _mm256_max_ps(b1, v1);
    b2 = _mm256_max_ps(b2, v2);
    b3 = _mm256_max_ps(b3, v3);
    nan0 = _mm256_or_ps(nan0, _mm256_cmp_ps(v0, v1, _CMP_UNORD_Q));
    nan1 = _mm256_or_ps(nan1, _mm256_cmp_ps(v2, v3, _CMP_UNORD_Q));
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    a0 = _mm256_min_ps(a0, v);
    b0 = _mm256_max_ps(b0, v);
    nan0 = _mm256_or_ps(nan0, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  const __m256 a = _mm256_min_ps(_mm256_min_ps(a0, a1), _mm256_min_ps(a2, a3));
  const __m256 b = _mm256_max_ps(_mm256_max_ps(b0, b1), _mm256_max_ps(b2, b3));
  alignas(32) float ta[8], tb[8];
  _mm256_store_ps(ta, a);
  _mm256_store_ps(tb, b);
  bool has_nan = _mm256_movemask_ps(_mm256_or_ps(nan0, nan1)) != 0;
  float l = ta[0], h = tb[0];
  for (int k = 1; k < 8; ++k) {
    l = ta[k] < l ? ta[k] : l;
    h = tb[k] > h ? tb[k] : h;
  }
  for (; i < n; ++i) {
    const float v = x[i];
    has_nan |= v != v;
    l = v < l ? v : l;
    h = v > h ? v : h;
  }
  has_nan |= x[0] != x[0];
  *lo = has_nan ? NAN : l;
  *hi = has_nan ? NAN : h;
}

void FakeQuantMinifloatAvx2(const float* x, float* y, int64_t n, const MinifloatParams& p) {
  const __m256 s = _mm256_set1_ps(p.s), top = _mm256_set1_ps(p.top), ntop = _mm256_set1_ps(-p.top);
  const __m256 sign = _mm256_set1_ps(-0.0f), nanv = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(p.nan_bits)));
  const __m256i emin = _mm256_set1_epi32(p.emin + 127), man = _mm256_set1_epi32(p.mantissa);
  const __m256i two54 = _mm256_set1_epi32(254);
  int64_t i = 0;
  auto one = [&](__m256 xv) {
    __m256 v = _mm256_div_ps(xv, s);
    const __m256 isnan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    v = _mm256_min_ps(top, _mm256_max_ps(ntop, v));  // r itself when NaN, as torch.clamp
    // biased exponent of |v| (0 for zeros and float32 subnormals), at least emin's
    const __m256i be = _mm256_max_epi32(_mm256_srli_epi32(_mm256_castps_si256(_mm256_andnot_ps(sign, v)), 23), emin);
    const __m256i k = _mm256_sub_epi32(be, man);  // biased exponent of the grid step
    const __m256 step = _mm256_castsi256_ps(_mm256_slli_epi32(k, 23));
    const __m256 inv = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(two54, k), 23));  // 2^-(k-127)
    const __m256 r = _mm256_round_ps(_mm256_mul_ps(v, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 q = _mm256_mul_ps(r, step);
    q = _mm256_blendv_ps(q, _mm256_or_ps(_mm256_and_ps(sign, v), nanv), isnan);
    return _mm256_mul_ps(q, s);
  };
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, one(_mm256_loadu_ps(x + i)));
  if (i < n) {
    const __m256i m = Head(n - i);
    _mm256_maskstore_ps(y + i, m, one(_mm256_maskload_ps(x + i, m)));
  }
}

}  // namespace x86
}  // namespace qdsl
