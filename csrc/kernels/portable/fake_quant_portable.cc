// Scalar fake quantization and min/max (csrc/kernels/fake_quant.h gives the formula).  It is
// also the reference the AVX2 kernel is tested against, through the C ABI's path argument.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/fake_quant.h"

namespace qdsl {
namespace portable {
namespace {

inline float One(float x, float s, float inv, float lo, float hi) {
  // nearbyint rounds half to even in the default rounding mode, as torch.round does
  float r = std::nearbyint(x * inv);
  if (r < lo) r = lo;
  if (r > hi) r = hi;
  if (r != r) r = 0.0f;
  return r * s;
}

}  // namespace

void FakeQuantF32(const float* x, float* y, int64_t outer, int64_t channels, int64_t inner, const FakeQuantParams& p) {
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t c = 0; c < channels; ++c) {
      const float s = p.s[c], inv = p.inv[c];
      const float lo = p.lo ? p.lo[c] : p.lo0, hi = p.hi ? p.hi[c] : p.hi0;
      const int64_t base = (o * channels + c) * inner;
      for (int64_t i = 0; i < inner; ++i) y[base + i] = One(x[base + i], s, inv, lo, hi);
    }
  }
}

void MinMaxF32(const float* x, int64_t n, float* lo, float* hi) {
  float a = x[0], b = x[0];
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    nan |= v != v;
    a = v < a ? v : a;
    b = v > b ? v : b;
  }
  *lo = nan ? NAN : a;
  *hi = nan ? NAN : b;
}

void FakeQuantMinifloat(const float* x, float* y, int64_t n, const MinifloatParams& p) {
  for (int64_t i = 0; i < n; ++i) {
    float v = x[i] / p.s;
    if (v != v) {
      uint32_t b;
      std::memcpy(&b, &v, 4);
      b = (b & 0x80000000u) | p.nan_bits;
      std::memcpy(&v, &b, 4);
      y[i] = v * p.s;
      continue;
    }
    if (v < -p.top) v = -p.top;
    if (v > p.top) v = p.top;
    int e;
    std::frexp(v, &e);  // |v| = m * 2^e, m in [0.5, 1): binade e - 1 (0 for v == 0: emin)
    const int k = (v == 0.0f || e - 1 < p.emin ? p.emin : e - 1) - p.mantissa;
    const float q = std::ldexp(std::nearbyint(std::ldexp(v, -k)), k);
    y[i] = q * p.s;
  }
}

}  // namespace portable
}  // namespace qdsl
