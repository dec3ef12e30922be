// AVX2 exact row division for SOFTMAX and LAYERNORM (csrc/runtime/ops/last_axis.h):
//   q[i] = floor((v[i] * scale + add) / b),  four lanes at a time in binary64.
//
// Exact under the contract of FloorDivScaledKernel (csrc/dispatch.h): a = v*scale + add is an
// integer that a double holds exactly (scale a power of two, so v*scale is exact, and the fused
// add rounds only an exact value), b an integer below 2^52, quotients below 2^31.  The
// estimate floor(a * (1/b)) has a relative error of a few ulp, so it is within 1 of the
// quotient; the remainder a - q*b is an integer of magnitude < 2b < 2^53, so the fused
// multiply-add computes it exactly, and one step (+1 when r >= b, -1 when r < 0) gives floor.
// LayernormNormalizeAvx2 runs the same division on |d| (LayernormKernels::normalize in
// csrc/dispatch.h), then restores d's sign and takes Z·gamma + beta in int32 lanes.
#pragma GCC target("avx2,fma,popcnt")
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "kernels/x86/x86_kernels.h"

namespace qdsl {
namespace x86 {
namespace {

inline __m128i FloorDiv4(__m128i v, __m256d scale, __m256d add, __m256d b, __m256d nb, __m256d inv) {
  const __m256d one = _mm256_set1_pd(1.0), zero = _mm256_setzero_pd();
  const __m256d a = _mm256_fmadd_pd(_mm256_cvtepi32_pd(v), scale, add);
  __m256d q = _mm256_floor_pd(_mm256_mul_pd(a, inv));
  const __m256d r = _mm256_fmadd_pd(q, nb, a);  // a - q*b, exact
  q = _mm256_add_pd(q, _mm256_and_pd(_mm256_cmp_pd(r, b, _CMP_GE_OQ), one));
  q = _mm256_sub_pd(q, _mm256_and_pd(_mm256_cmp_pd(r, zero, _CMP_LT_OQ), one));
  return _mm256_cvttpd_epi32(q);  // integer-valued, below 2^31: exact
}

}  // namespace

void FloorDivScaledAvx2(const int32_t* v, int64_t n, double scale, double add, double b, int32_t* q) {
  const __m256d vs = _mm256_set1_pd(scale), va = _mm256_set1_pd(add), vb = _mm256_set1_pd(b),
                nb = _mm256_set1_pd(-b), inv = _mm256_set1_pd(1.0 / b);
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v + i));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), FloorDiv4(x, vs, va, vb, nb, inv));
  }
  if (i < n) {  // the tail through a zero-padded quad
    int32_t in[4] = {0, 0, 0, 0}, out[4];
    std::memcpy(in, v + i, static_cast<size_t>(n - i) * 4);
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), FloorDiv4(x, vs, va, vb, nb, inv));
    std::memcpy(q + i, out, static_cast<size_t>(n - i) * 4);
  }
}

void LayernormNormalizeAvx2(const int32_t* d, int64_t n, int s, int64_t r, const int32_t* gamma, const int32_t* beta,
                            int32_t* acc) {
  const double b = 2.0 * static_cast<double>(r);
  const __m256d vs = _mm256_set1_pd(static_cast<double>(int64_t{1} << s)), va = _mm256_set1_pd(static_cast<double>(r)),
                vb = _mm256_set1_pd(b), nb = _mm256_set1_pd(-b), inv = _mm256_set1_pd(1.0 / b);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + i));
    const __m256i m = _mm256_abs_epi32(x);
    const __m128i q0 = FloorDiv4(_mm256_castsi256_si128(m), vs, va, vb, nb, inv);
    const __m128i q1 = FloorDiv4(_mm256_extracti128_si256(m, 1), vs, va, vb, nb, inv);
    const __m256i z = _mm256_sign_epi32(_mm256_set_m128i(q1, q0), x);  // d = 0 gives quotient 0 anyway
    const __m256i g = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gamma + i));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(beta + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + i), _mm256_add_epi32(_mm256_mullo_epi32(z, g), c));
  }
  for (; i < n; ++i) {  // the tail through a zero-padded quad
    const int32_t m = d[i] < 0 ? -d[i] : d[i];
    int32_t in[4] = {m, 0, 0, 0}, out[4];
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                     FloorDiv4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in)), vs, va, vb, nb, inv));
    acc[i] = (d[i] < 0 ? -out[0] : out[0]) * gamma[i] + beta[i];
  }
}

}  // namespace x86
}  // namespace qdsl
