// Requantization output stage: int32 accumulator -> int8/uint8 (gemmlowp/ruy form).
//
// Exact integer formula, per output channel c (per-tensor stages repeat one value):
//
//   SRDHM(a, b)   = a == b == INT32_MIN ? INT32_MAX
//                   : trunc_toward_zero((int64(a)*b + (a*b >= 0 ? 2^30 : 1 - 2^30)) / 2^31)
//   RDBP(x, e)    = (x >> e) + ((x & (2^e - 1)) > ((2^e - 1) >> 1) + (x < 0)) ? 1 : 0)
//                   (round half away from zero; e in [0, 31])
//   if multiplier[c] != 0:                     (float scale: multiplier in [2^30, 2^31))
//       l = max(shift[c], 0), r = max(-shift[c], 0)
//       y = RDBP(SRDHM(wrap32(acc * 2^l), multiplier[c]), r)
//   else:                                      (power-of-two scale, exact)
//       y = shift[c] >= 0 ? wrap32(acc * 2^shift[c]) : RDBP(acc, -shift[c])
//   out = clamp(y + zero_point, qmin, qmax)   (y + zero_point computed in int64)
//
// `shift` is a left shift when positive (TFLite convention).  This is the same math as
// qdsl/export/requant.py; the tests compare both on random and corner values.
#ifndef QDSL_REQUANT_H_
#define QDSL_REQUANT_H_

#include <cstdint>

namespace qdsl {

struct OutputStage {
  const int32_t* multiplier = nullptr;  // [channels]
  const int32_t* shift = nullptr;       // [channels]
  int64_t channels = 0;                 // 1 = per-tensor
  int32_t zero_point = 0;
  int32_t qmin = -128, qmax = 127;  // fused relu/clamp narrows these
};

inline int32_t SaturatingRoundingDoublingHighMul(int32_t a, int32_t b) {
  if (a == INT32_MIN && b == INT32_MIN) return INT32_MAX;
  const int64_t ab = static_cast<int64_t>(a) * static_cast<int64_t>(b);
  const int64_t nudge = ab >= 0 ? (int64_t{1} << 30) : (1 - (int64_t{1} << 30));
  return static_cast<int32_t>((ab + nudge) / (int64_t{1} << 31));  // C++ '/' truncates
}

inline int32_t RoundingDivideByPOT(int32_t x, int exponent) {
  const int32_t mask = static_cast<int32_t>((int64_t{1} << exponent) - 1);
  const int32_t remainder = x & mask;
  const int32_t threshold = (mask >> 1) + (x < 0 ? 1 : 0);
  return (x >> exponent) + (remainder > threshold ? 1 : 0);
}

inline int32_t WrapShiftLeft(int32_t x, int s) {
  return static_cast<int32_t>(static_cast<uint32_t>(x) << s);
}

inline int32_t RequantizeOne(int32_t acc, int32_t multiplier, int32_t shift, int32_t zero_point,
                             int32_t qmin, int32_t qmax) {
  int32_t y;
  if (multiplier != 0) {
    const int l = shift > 0 ? shift : 0, r = shift < 0 ? -shift : 0;
    y = RoundingDivideByPOT(SaturatingRoundingDoublingHighMul(WrapShiftLeft(acc, l), multiplier), r);
  } else {
    y = shift >= 0 ? WrapShiftLeft(acc, shift) : RoundingDivideByPOT(acc, -shift);
  }
  int64_t v = static_cast<int64_t>(y) + zero_point;
  if (v < qmin) v = qmin;
  if (v > qmax) v = qmax;
  return static_cast<int32_t>(v);
}

}  // namespace qdsl

#endif  // QDSL_REQUANT_H_
