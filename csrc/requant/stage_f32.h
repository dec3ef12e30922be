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

}  // namespace qdsl

#endif  // QDSL_REQUANT_STAGE_F32_H_
