// QUANTIZE_DYNAMIC's rule (docs/qgraph.md; the reference's _qparams and _round_f), shared by
// the op itself (dynamic.cc) and the dynamic recurrent ops that quantize their input and
// hidden state per step the same way (recurrent_dynamic.cc), so the two cannot drift apart.
// binary32 as the reference: no expression here has a multiply feeding an add, so contraction
// (FMA) cannot change a result whatever the including file's fp-contract setting.
#ifndef QDSL_RUNTIME_OPS_DYNAMIC_QUANT_H_
#define QDSL_RUNTIME_OPS_DYNAMIC_QUANT_H_

#include <cmath>
#include <cstdint>
#include <cstring>

namespace qdsl {
namespace dynq {

constexpr float kTiny = 1e-12f;  // the smallest scale (qdsl.quantizers.range_search)

// The codes' range and rule of one dynamically quantized tensor.
struct Rule {
  int32_t qmin = 0, qmax = 255;
  bool symmetric = false;
  int rounding = 1;
};

// A binary32 attribute stored as its bits.
inline float BitsF32(int64_t bits) {
  const int32_t b = static_cast<int32_t>(bits);
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// The reference's _round_f (as QUANTIZE): 1 half even (default FE_TONEAREST), 0 half away,
// 3 half up, else floor.
inline double RoundF(double v, int mode) {
  switch (mode) {
    case 1: return std::nearbyint(v);
    case 0: return v < 0 ? -std::floor(-v + 0.5) : (v > 0 ? std::floor(v + 0.5) : v);
    case 3: return std::floor(v + 0.5);
    default: return std::floor(v);
  }
}

// Min and max of the finite values of x[0..n), folded into *lo, *hi ([0, 0] when none).
inline void FiniteRange(const float* x, int64_t n, float* lo, float* hi, bool* any) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    if (!std::isfinite(v)) continue;
    if (!*any || v < *lo) *lo = v;
    if (!*any || v > *hi) *hi = v;
    *any = true;
  }
}

// Scale and zero point of the range [lo, hi] (the reference's _qparams).
inline void QParams(float lo, float hi, bool any, const Rule& p, float* scale, float* zp) {
  if (!any) lo = hi = 0.f;
  lo = lo < 0.f ? lo : 0.f;
  hi = hi > 0.f ? hi : 0.f;
  if (p.symmetric) {
    const float amax = p.qmin < 0 ? (-lo > hi ? -lo : hi) : (hi > 0.f ? hi : -lo);
    const float s = amax / static_cast<float>(p.qmax);
    *scale = s > kTiny ? s : kTiny;
    *zp = 0.f;
  } else {
    const float s = (hi - lo) / static_cast<float>(p.qmax - p.qmin);
    *scale = s > kTiny ? s : kTiny;
    const float z = static_cast<float>(p.qmin) - std::nearbyint(lo / *scale);
    *zp = z < p.qmin ? static_cast<float>(p.qmin) : (z > p.qmax ? static_cast<float>(p.qmax) : z);
  }
}

// y[i] = clamp(round(x[i] · (1 / scale)) + zp) (NaN -> zp), as uint8 bytes (I8/U8 codes) or int32.
template <typename T>
inline void QuantizeRow(const float* x, int64_t n, float scale, float zpf, const Rule& p, T* y) {
  const float inv = 1.0f / scale;
  const int64_t zp = static_cast<int64_t>(zpf), lo = p.qmin, hi = p.qmax;
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i] * inv;  // binary32 multiply, as the reference
    int64_t q;
    if (std::isnan(v)) {
      q = zp;
    } else {
      const double r = RoundF(static_cast<double>(v), p.rounding) + static_cast<double>(zp);
      q = r < static_cast<double>(lo) ? lo : (r > static_cast<double>(hi) ? hi : static_cast<int64_t>(r));
    }
    y[i] = static_cast<T>(q);
  }
}

}  // namespace dynq
}  // namespace qdsl

#endif  // QDSL_RUNTIME_OPS_DYNAMIC_QUANT_H_
