// The FIXED_SINGLE output stage as a float32 estimate with an exact integer recompute near
// ties (the proof is at SingleRowsF32 in output_stage_avx2.cc), prepared once per op: the
// per-channel float multipliers, the integer multipliers and shifts for the recompute, and
// the band threshold, in the padded channel layout a kernel's epilogue loads directly, so
// the stage applied from registers has no per-call setup (range checks, tables).
#ifndef QDSL_REQUANT_STAGE_F32_H_
#define QDSL_REQUANT_STAGE_F32_H_

#include <cstdint>

#include "qdsl/aligned.h"
#include "qdsl/requant.h"

namespace qdsl {

// Channel c's estimate multiplier mf[c] = m_c / 2^(31 + right_c) (exact in double, then
// rounded once to float32), with mult/shift the integer form; zeros past the channels.
// lo, hi = qmin - zp, qmax - zp; thr = 1/2 - 2E - u (E from the output range bound).
struct StageF32 {
  AlignedVector<float> mf;
  AlignedVector<int32_t> mult, shift;
  int32_t zp = 0, lo = 0, hi = 0;
  float lof = 0, hif = 0, thr = 0;
  Rounding rounding = Rounding::kHalfAway;
  bool ok = false;  // prepared (else the caller applies the stage another way)
};

// Fills *out for `stage` over `channels` output channels (padded with zero channels to
// `padded`); false (out->ok false) unless the stage is FIXED_SINGLE with every right shift
// in [0, 31] and |zero_point| <= 2^16, the conditions of the proof.
bool PrepareStageF32(const OutputStage& stage, int64_t channels, int64_t padded, StageF32* out);

// An int32 output stage (zero point 0: a conv's I32 output, e.g. the twin a residual ADD
// reads) in the form an AVX-512 epilogue applies to the sums in registers, exactly:
// per channel y = clamp(round(x * m / 2^s), qmin, qmax), the product in 64 bits, valid while
// x * 2^left stays in int32 (else the kernel takes the reference rule for that call).
//   FIXED_SINGLE (m, shift): left = max(-shift, 0), s = 31 + max(shift, 0) - left, which is
//     RescaleOne's t = x * 2^left, round(t * m / 2^(31 + right)) when t does not saturate;
//   POT (shift): m = 2^left, left = max(-shift, 0) <= 30, s = max(shift, 0).
// round is RoundShift's rule of the stage's rounding as floor((p + add) / 2^s): add = h =
// 2^(s-1) (0 when s = 0) for HALF_UP / HALF_EVEN, h or hm = h - 1 (0 when s = 0) for
// p >= 0 / p < 0 in HALF_AWAY, 0 for FLOOR; HALF_EVEN clears bit 0 of a result whose
// (p + h) mod 2^s is 0 (a tie; low = 2^s - 1, or -1 when s = 0, which leaves no ties).
// The int64 per-channel terms are stored per 16-channel panel as 8 even then 8 odd
// channels, the order of vpmuldq's even and odd products.  |round(...)| < 2^31 (|t| <
// 2^31, m < 2^31, s >= 31 - left), so the low 32 bits of each 64-bit result are the value.
struct StageI32Reg {
  AlignedVector<int32_t> mult, left, shift;  // shift: the stage's own (the reference rule)
  AlignedVector<int64_t> s, h, hm, low;       // [panel][even 8, odd 8]
  int32_t qmin = 0, qmax = 0;
  RescaleKind kind = RescaleKind::kFixedSingle;
  Rounding rounding = Rounding::kHalfAway;
  bool ok = false;
};

// Fills *out for an int32 `stage` (zero point 0) over `channels` (padded to `padded`, a
// multiple of 16); false (out->ok false) for FIXED stages, shifts outside [-31, 31], POT
// shifts below -30 or a zero point.
bool PrepareStageI32Reg(const OutputStage& stage, int64_t channels, int64_t padded, StageI32Reg* out);

}  // namespace qdsl

#endif  // QDSL_REQUANT_STAGE_F32_H_
