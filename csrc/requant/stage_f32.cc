// PrepareStageF32 (stage_f32.h): the same constants SingleRowsF32 / ChannelRowsF32
// (output_stage_avx2.cc) compute per call, computed once.
#include "requant/stage_f32.h"

#include <cmath>

namespace qdsl {

bool PrepareStageF32(const OutputStage& stage, int64_t channels, int64_t padded, StageF32* out) {
  out->ok = false;
  const Rescale& rs = stage.rescale;
  if (rs.kind != RescaleKind::kFixedSingle || stage.zero_point < -(1 << 16) || stage.zero_point > (1 << 16)) return false;
  if (rs.channels != 1 && rs.channels != channels) return false;
  for (int64_t c = 0; c < rs.channels; ++c)
    if (rs.shift[c] < 0 || rs.shift[c] > 31) return false;
  out->mf.assign(static_cast<size_t>(padded), 0.0f);
  out->mult.assign(static_cast<size_t>(padded), 0);
  out->shift.assign(static_cast<size_t>(padded), 0);
  for (int64_t c = 0; c < channels; ++c) {
    const int64_t k = rs.channels == 1 ? 0 : c;
    const int32_t m = rs.multiplier[k], right = rs.shift[k];
    out->mult[c] = m;
    out->shift[c] = right;
    out->mf[c] = static_cast<float>(std::ldexp(static_cast<double>(m), -(31 + right)));  // exact, then one rounding
  }
  const int32_t lo = stage.qmin - stage.zero_point, hi = stage.qmax - stage.zero_point;
  const int64_t alo = lo < 0 ? -int64_t{lo} : lo, ahi = hi < 0 ? -int64_t{hi} : hi;
  const double bound = static_cast<double>(alo > ahi ? alo : ahi) + 1.0, u = 1.0 / 16777216.0;  // u = 2^-24
  const double e = bound * (8 * u) + u;
  out->zp = stage.zero_point;
  out->lo = lo;
  out->hi = hi;
  out->lof = static_cast<float>(lo);
  out->hif = static_cast<float>(hi);
  out->thr = static_cast<float>(0.5 - 2 * e - u);
  out->rounding = rs.rounding;
  out->ok = true;
  return true;
}

bool PrepareStageI32Reg(const OutputStage& stage, int64_t channels, int64_t padded, StageI32Reg* out) {
  out->ok = false;
  const Rescale& rs = stage.rescale;
  if (rs.kind == RescaleKind::kFixed || stage.zero_point != 0 || padded % 16 != 0) return false;
  if (rs.channels != 1 && rs.channels != channels) return false;
  for (int64_t c = 0; c < rs.channels; ++c)
    if (rs.shift[c] < -31 || rs.shift[c] > 31) return false;
  const size_t n = static_cast<size_t>(padded);
  out->mult.assign(n, 0);
  out->left.assign(n, 0);
  out->shift.assign(n, 0);
  out->s.assign(n, 0);
  out->h.assign(n, 0);
  out->hm.assign(n, 0);
  out->low.assign(n, -1);
  for (int64_t c = 0; c < channels; ++c) {
    const int64_t k = rs.channels == 1 ? 0 : c;
    const int32_t shift = rs.shift[k];
    const bool pot = rs.kind == RescaleKind::kPot;
    const int32_t left = shift < 0 ? -shift : 0, right = shift > 0 ? shift : 0;
    const int64_t s = pot ? right : 31 + right - left;
    if (pot && left > 30) return false;
    out->mult[c] = pot ? int32_t{1} << left : rs.multiplier[k];
    out->left[c] = left;
    out->shift[c] = shift;
    // channel c of its panel at 64-bit lane (c % 16) / 2 of the even or odd half
    const size_t at = static_cast<size_t>(c / 16 * 16 + (c % 2) * 8 + (c % 16) / 2);
    out->s[at] = s;
    out->h[at] = s > 0 ? int64_t{1} << (s - 1) : 0;
    out->hm[at] = s > 0 ? (int64_t{1} << (s - 1)) - 1 : 0;
    out->low[at] = s > 0 ? (int64_t{1} << s) - 1 : -1;
  }
  out->qmin = stage.qmin;
  out->qmax = stage.qmax;
  out->kind = rs.kind;
  out->rounding = rs.rounding;
  out->ok = true;
  return true;
}

}  // namespace qdsl
