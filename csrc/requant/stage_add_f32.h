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
// q = x * B + K, z = p0 + q), clamp it to [qmin - zp, qmax - zp] and round it; the lane is
// exact when the clamped estimate is more than E + e from a rounding boundary, e the float
// error: for |p0| <= Pmax = bound + P1 + |K| + 1 (bound = max(|qmin - zp|, |qmax - zp|) + 1,
// P1 = max |x| |B|), |z| <= Pmax + P1 + |K| and each of the seven float roundings (A_c, B, K,
// acc's conversion, the product, the fma, the sum) is within u = 2^-24 of its magnitude:
// e <= 16 u (Pmax + P1 + |K| + 1).  An int32 other input (another conv's int32 stage) has no
// code range: P1 = Qmax + |K| with Qmax = 2 bound, and lanes with |q| > Qmax are recomputed.
// A lane is recomputed exactly (StageAddOne) when |p0| > Pmax or |xf - round(xf)| > thr = 1/2 - 2 (E + e) - u (xf the clamped estimate).  A value clamped
// in float is one the exact rule clamps too (beyond the bound by more than E + e).
// PrepareStageAddF32 checks that no intermediate saturates or wraps while |p0| <= Pmax (each
// stays below 2^30).
#ifndef QDSL_REQUANT_STAGE_ADD_F32_H_
#define QDSL_REQUANT_STAGE_ADD_F32_H_

#include <cstdint>

#include "qdsl/aligned.h"
#include "qdsl/requant.h"

namespace qdsl {

struct StageAddF32 {
  AlignedVector<float> a;  // A_c per channel, zeros past the channels (padded)
  float b = 0, k = 0, pmax = 0, qmax = 0, lof = 0, hif = 0, thr = 0;
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
