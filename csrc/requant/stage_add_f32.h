// A conv's int32 output stage followed by the residual ADD it feeds (ConvParams::fused_add),
// as one float32 estimate per element with an exact integer recompute near rounding
// boundaries, prepared once per conv: the kernels' epilogue turns an accumulator and the
// ADD's other input code into the ADD's output code without the int32 value in between.
//
// The exact chain (qdsl/requant.h, AddRef in runtime/ops/add.cc), for channel c, accumulator
// acc and the other input's code x:
//   v = ApplyStage(acc, conv, c)                                   (int32 output: no clamp)
//   t = Rescale_s((v - zp_s) << pre) + Rescale_o((x - zp_o) << pre)  (the ADD's input stages)
//   y = clamp(Rescale_out(sat32(t)) + zp, qmin, qmax)
// With f the real factor of a rescale, every rescale with a rounding step is within 1 of
// x * f (FIXED: SRDHM's and RDBP's halves; FIXED_SINGLE/POT: one rounding), and a final
// single rounding step (FIXED_SINGLE, or POT with s > 0) rounds t * f_out.  So, while no
// value saturates,
//   t * f_out = z + d,  z = acc * A_c + x * B + K,  |d| <= E = (2^pre f_s + 2) f_out
//   A_c = f_c 2^pre f_s f_out,  B = 2^pre f_o f_out,  K = ((zp_c - zp_s) 2^pre f_s - zp_o 2^pre f_o) f_out
// (zp_c: the conv stage's zero point).  The kernels compute z in float32 (p0 = acc * A_c,
// q = x * B + K, z = p0 + q), clamp it to [qmin - zp, qmax - zp] (integers) and round it.
// The float roundings (A_c, B, K, the conversions of acc and x, the product, the fma, the
// sum; u = 2^-24 each) put z within e = 8 u (|p0| + |q|) + 4 u |K| of its real value.  A lane
// is exact when the clamped estimate xf is more than E + e from a rounding boundary; with a
// factor 2 of margin it is recomputed by the exact chain (StageAddOne) when
//   |xf - round(xf)| + 16 u (|p0| + |q|) > thr = 1/2 - 2 E - 16 u |K| - u,
// or when |p0| + |q| > smax, the largest bound (<= 2^20) for which PrepareStageAddF32 proves
// that no intermediate saturates or wraps (each stays below 2^30).  A value clamped in float
// is one the exact rule clamps too (the bounds are integers: beyond them by less than 1/2,
// both round to the bound or past it).
#ifndef QDSL_REQUANT_STAGE_ADD_F32_H_
#define QDSL_REQUANT_STAGE_ADD_F32_H_

#include <cstdint>

#include "qdsl/aligned.h"
#include "qdsl/requant.h"

namespace qdsl {

struct StageAddF32 {
  AlignedVector<float> a;  // A_c per channel, zeros past the channels (padded)
  float b = 0, k = 0, smax = 0, lof = 0, hif = 0, thr = 0, eps = 0;  // eps = 16 u
  int32_t zp = 0;
  Rounding rounding = Rounding::kHalfAway;
  bool other_signed = false, other_i32 = false, y_signed = false;
  // the exact rule (StageAddOne): the conv's stage, the ADD's input stages (conv's, other's), its output stage
  OutputStage conv, in_conv, in_other, out;
  int pre = 0;
  bool ok = false;
};

// Fills *s for a conv of `channels` output channels (padded to `padded`) with int32 stage
// `conv`, feeding an ADD with input stages in_conv (its slot) and in_other, pre_shift `pre`
// and output stage `out`; the other input's dtype (8-bit signed or not, or int32) and the
// output's (8-bit, signed or not).
// false (s->ok false) when the conditions above do not hold for these parameters.
bool PrepareStageAddF32(const OutputStage& conv, int64_t channels, int64_t padded, const OutputStage& in_conv,
                        const OutputStage& in_other, int pre, const OutputStage& out, bool other_signed, bool other_i32,
                        bool y_signed, StageAddF32* s);

// The exact chain for one element: the ADD's output code for accumulator acc of channel c
// and the other input's value x.
int32_t StageAddOne(const StageAddF32& s, int32_t acc, int64_t c, int32_t x);

}  // namespace qdsl

#endif  // QDSL_REQUANT_STAGE_ADD_F32_H_
