// Requantization: an int32 value times a real factor, in integers (docs/qgraph.md §4.1).
//
// Exact formulas (the same as qdsl/graph/requant.py; tests compare both):
//   sat32(v)   = clamp(v, -2^31, 2^31 - 1)
//   SRDHM(a,b) = a == b == INT32_MIN ? INT32_MAX
//                : trunc_toward_zero((a*b + (a*b >= 0 ? 2^30 : 1 - 2^30)) / 2^31)   (int64)
//   RDBP(x,e)  = (x >> e) + ((x & (2^e-1)) > ((2^e-1) >> 1) + (x < 0) ? 1 : 0)      (half away)
//   Rescale(x), x first saturated to int32:
//     FIXED (m in [0, 2^31-1], s in [-31, 31], factor m * 2^(-31-s)):
//        t = sat32(x * 2^max(-s,0));  r = RDBP(SRDHM(t, m), max(s,0))
//     FIXED_SINGLE (kind 2; m, s as FIXED, one rounding with the stated mode):
//        t = sat32(x * 2^max(-s,0));  r = sat32(RoundShift(t * m, 31 + max(s,0)))   (t*m exact in int64)
//     POT (s in [-31, 62], factor 2^-s):
//        s <= 0: r = sat32(x * 2^-s)
//        s > 0:  r = sat32(RoundShift(x, s)), where RoundShift(v, s): f = v >> s, rem = v - (f << s),
//                h = 2^(s-1); HALF_AWAY f + (rem > h || (rem == h && v >= 0));
//                HALF_EVEN f + (rem > h || (rem == h && f odd)); FLOOR f; HALF_UP f + (rem >= h)
//   OutputStage: y = clamp(Rescale(acc) + zero_point, qmin, qmax)   (zero point after the rescale;
//   RescaleOneWide below for an accumulator wider than 32 bits)
#ifndef QDSL_REQUANT_H_
#define QDSL_REQUANT_H_

#include <cstdint>

namespace qdsl {

enum class RescaleKind : int32_t { kFixed = 0, kPot = 1, kFixedSingle = 2 };
enum class Rounding : int32_t { kHalfAway = 0, kHalfEven = 1, kFloor = 2, kHalfUp = 3 };

struct Rescale {
  RescaleKind kind = RescaleKind::kFixed;
  const int32_t* multiplier = nullptr;  // [channels]
  const int32_t* shift = nullptr;       // [channels]
  int64_t channels = 1;                 // 1 = per tensor
  Rounding rounding = Rounding::kHalfAway;
};

struct OutputStage {
  Rescale rescale;
  int32_t zero_point = 0;
  int32_t qmin = -128, qmax = 127;  // within the output dtype; fused relu/clamp narrow them
};

inline int64_t Sat32(int64_t v) { return v < INT32_MIN ? INT32_MIN : (v > INT32_MAX ? INT32_MAX : v); }

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

// v / 2^s rounded per `rounding` (docs/qgraph.md §4.1, POT rule), for int64 (s in [1, 62])
// and, for wide accumulators, Int128 values.  rem is taken with a mask, in [0, 2^s): no
// left shift of a negative value (undefined before C++20).
template <typename T>
inline T RoundShiftT(T v, int s, Rounding rounding) {
  const T f = v >> s;  // arithmetic (flooring) shift
  const T rem = v & ((T{1} << s) - 1);
  const T h = T{1} << (s - 1);
  bool up = false;
  switch (rounding) {
    case Rounding::kHalfAway: up = rem > h || (rem == h && v >= 0); break;
    case Rounding::kHalfEven: up = rem > h || (rem == h && (f & 1)); break;
    case Rounding::kFloor: up = false; break;
    case Rounding::kHalfUp: up = rem >= h; break;
  }
  return f + (up ? 1 : 0);
}

inline int64_t RoundShift(int64_t v, int s, Rounding rounding) { return RoundShiftT<int64_t>(v, s, rounding); }

inline int64_t RescaleOne(int64_t x, RescaleKind kind, int32_t m, int32_t s, Rounding rounding) {
  x = Sat32(x);
  if (kind != RescaleKind::kPot) {
    const int left = s < 0 ? -s : 0, right = s > 0 ? s : 0;
    const int32_t t = static_cast<int32_t>(Sat32(x * (int64_t{1} << left)));
    if (kind == RescaleKind::kFixedSingle) return Sat32(RoundShift(static_cast<int64_t>(t) * m, 31 + right, rounding));
    return RoundingDivideByPOT(SaturatingRoundingDoublingHighMul(t, m), right);
  }
  if (s <= 0) return Sat32(x * (int64_t{1} << -s));  // |x| <= 2^31, -s <= 31: no int64 overflow
  return Sat32(RoundShift(x, s, rounding));
}

// Wide rescale, for accumulators of acc_bits > 32 (docs/qgraph.md §4.3): the int64 value x
// is not saturated to int32 first, so a sum beyond int32 still rescales exactly.
//   POT, s <= 0: as RescaleOne (a factor >= 1 saturates any |x| >= 2^31 anyway)
//   POT, s > 0:  sat32(RoundShift(x, s))
//   FIXED/FIXED_SINGLE: t = left > 0 ? sat32(x * 2^left) : x   (left > 0 means a factor >= 1)
//     FIXED:        r = sat32(RDBP(floor((t*m + 2^30) / 2^31), right))
//     FIXED_SINGLE: r = sat32(RoundShift(t*m, 31 + right))
//   with t*m exact (up to 94 bits: a 128-bit integer).  For x in the int32 range every line
//   equals RescaleOne (floor((t*m + 2^30) / 2^31) is SRDHM(t, m) for m >= 0), so the wide
//   form extends the int32 one.  Needs a compiler with __int128 (GCC, Clang); elsewhere the
//   runtime refuses acc_bits > 32 when it loads the graph (kHasWideRescale).
#if defined(__SIZEOF_INT128__)
constexpr bool kHasWideRescale = true;
__extension__ typedef __int128 Int128;

inline int64_t RescaleOneWide(int64_t x, RescaleKind kind, int32_t m, int32_t s, Rounding rounding) {
  if (kind == RescaleKind::kPot) return s <= 0 ? RescaleOne(x, kind, m, s, rounding) : Sat32(RoundShift(x, s, rounding));
  const int left = s < 0 ? -s : 0, right = s > 0 ? s : 0;
  const int64_t t = left > 0 ? Sat32(Sat32(x) * (int64_t{1} << left)) : x;
  const Int128 p = static_cast<Int128>(t) * m;
  if (kind == RescaleKind::kFixedSingle) {
    const Int128 r = RoundShiftT<Int128>(p, 31 + right, rounding);
    return r < INT32_MIN ? INT32_MIN : (r > INT32_MAX ? INT32_MAX : static_cast<int64_t>(r));
  }
  const int64_t u = static_cast<int64_t>((p + (Int128{1} << 30)) >> 31);  // |u| < 2^63
  return Sat32(right > 0 ? RoundShift(u, right, Rounding::kHalfAway) : u);
}
#else
constexpr bool kHasWideRescale = false;
inline int64_t RescaleOneWide(int64_t x, RescaleKind kind, int32_t m, int32_t s, Rounding rounding) {
  return RescaleOne(x, kind, m, s, rounding);  // never reached: acc_bits > 32 is refused
}
#endif

inline int32_t ApplyStage(int64_t acc, const OutputStage& st, int64_t channel, bool wide = false) {
  const Rescale& r = st.rescale;
  const int64_t c = r.channels == 1 ? 0 : channel;
  int64_t v = (wide ? RescaleOneWide(acc, r.kind, r.multiplier[c], r.shift[c], r.rounding)
                    : RescaleOne(acc, r.kind, r.multiplier[c], r.shift[c], r.rounding)) + st.zero_point;
  if (v < st.qmin) v = st.qmin;
  if (v > st.qmax) v = st.qmax;
  return static_cast<int32_t>(v);
}

}  // namespace qdsl

#endif  // QDSL_REQUANT_H_
