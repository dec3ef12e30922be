// PrepareStageAddF32 and StageAddOne (stage_add_f32.h): the constants of the estimate and
// the range conditions of its proof, computed once per conv; the exact chain per element.
#include "requant/stage_add_f32.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace qdsl {
namespace {

constexpr double kLimit = 1073741824.0;  // 2^30: every intermediate stays below it

// Rescale r's real factor for channel c, and its left shift (a factor >= 1 shifts first).
double Factor(const Rescale& r, int64_t c, int* left) {
  const int64_t k = r.channels == 1 ? 0 : c;
  const int32_t s = r.shift[k];
  *left = s < 0 ? -s : 0;
  if (r.kind == RescaleKind::kPot) return std::ldexp(1.0, -s);
  return std::ldexp(static_cast<double>(r.multiplier[k]), -(31 + s));
}

}  // namespace

bool PrepareStageAddF32(const OutputStage& conv, int64_t channels, int64_t padded, const OutputStage& in_conv,
                        const OutputStage& in_other, int pre, const OutputStage& out, bool other_signed, bool other_i32,
                        bool y_signed, StageAddF32* s) {
  s->ok = false;
  // the final step must be one rounding of t * f_out; the conv's int32 output unclamped
  const Rescale& ro = out.rescale;
  const bool single = ro.kind == RescaleKind::kFixedSingle || (ro.kind == RescaleKind::kPot && ro.shift[0] > 0);
  if (!single || ro.channels != 1 || in_conv.rescale.channels != 1 || in_other.rescale.channels != 1) return false;
  if (conv.qmin != INT32_MIN || conv.qmax != INT32_MAX || pre < 0 || pre > 20) return false;
  if (conv.rescale.channels != 1 && conv.rescale.channels != channels) return false;
  if (out.zero_point < -(1 << 16) || out.zero_point > (1 << 16)) return false;
  int left_s = 0, left_o = 0, left_out = 0;
  const double fs = Factor(in_conv.rescale, 0, &left_s) * std::ldexp(1.0, pre);
  const double fx = Factor(in_other.rescale, 0, &left_o) * std::ldexp(1.0, pre);
  const double fo = Factor(ro, 0, &left_out);
  if (!(fs > 0 && fo > 0)) return false;
  const double b = fx * fo;
  const double k = ((static_cast<double>(conv.zero_point) - in_conv.zero_point) * fs - in_other.zero_point * fx) * fo;
  const double lo = static_cast<double>(out.qmin) - out.zero_point, hi = static_cast<double>(out.qmax) - out.zero_point;
  const double bound = std::max(std::fabs(lo), std::fabs(hi)) + 1;
  const double u = std::ldexp(1.0, -24);
  const double e_int = (fs + 2) * fo;
  const double thr = 0.5 - 2 * e_int - 16 * u * std::fabs(k) - u;
  if (thr < 0.25 || std::fabs(k) >= (1 << 20) || (other_i32 && !(std::fabs(b) > 0))) return false;
  // the conv's channels: A_c; the largest smax (a power of two, 2^20 down to the clamp's
  // bound) with no saturation or wrap while |p0| + |q| <= smax
  std::vector<double> fc(static_cast<size_t>(channels));
  std::vector<int> left_c(static_cast<size_t>(channels));
  for (int64_t c = 0; c < channels; ++c) {
    fc[c] = Factor(conv.rescale, c, &left_c[c]);
    if (!(fc[c] > 0)) return false;
  }
  auto fits = [&](double smax) {
    // the other input: |x B| <= |q| + |K| (an int32 input) or its code range
    const double xmax = other_i32 ? (smax + std::fabs(k)) / std::fabs(b) : (other_signed ? 128 : 255);
    if ((xmax + std::fabs(static_cast<double>(in_other.zero_point))) * std::ldexp(1.0, pre + left_o) >= kLimit) return false;
    if ((smax + std::fabs(k) + 2) / fo * std::ldexp(1.0, left_out) >= kLimit) return false;  // t
    for (int64_t c = 0; c < channels; ++c) {
      const double accmax = smax / (fc[c] * fs * fo);  // |p0| <= smax
      if ((accmax + 1) * std::ldexp(1.0, left_c[c]) >= kLimit) return false;
      const double vmax = accmax * fc[c] + std::fabs(static_cast<double>(conv.zero_point)) + 1;
      if ((vmax + std::fabs(static_cast<double>(in_conv.zero_point))) * std::ldexp(1.0, pre + left_s) >= kLimit)
        return false;
    }
    return true;
  };
  double smax = 1 << 20;
  while (smax >= 2 * bound && !fits(smax)) smax /= 2;
  if (smax < 2 * bound) return false;
  s->a.assign(static_cast<size_t>(padded), 0.0f);
  for (int64_t c = 0; c < channels; ++c) s->a[c] = static_cast<float>(fc[c] * fs * fo);
  s->b = static_cast<float>(b);
  s->k = static_cast<float>(k);
  s->smax = static_cast<float>(smax);
  s->eps = static_cast<float>(16 * u);
  s->lof = static_cast<float>(lo);
  s->hif = static_cast<float>(hi);
  s->thr = static_cast<float>(thr);
  s->zp = out.zero_point;
  s->rounding = ro.rounding;
  s->other_signed = other_signed;
  s->other_i32 = other_i32;
  s->y_signed = y_signed;
  s->conv = conv;
  s->in_conv = in_conv;
  s->in_other = in_other;
  s->out = out;
  s->pre = pre;
  s->ok = true;
  return true;
}

int32_t StageAddOne(const StageAddF32& s, int32_t acc, int64_t c, int32_t x) {
  const int64_t v = ApplyStage(acc, s.conv, c);
  int64_t t = 0;
  const OutputStage* in[2] = {&s.in_conv, &s.in_other};
  const int64_t val[2] = {v, x};
  for (int i = 0; i < 2; ++i) {  // AddRef's rule (runtime/ops/add.cc)
    const Rescale& r = in[i]->rescale;
    const int64_t d = val[i] - in[i]->zero_point;
    const int64_t w = static_cast<int64_t>(static_cast<uint64_t>(d) << s.pre);
    t += RescaleOne(w, r.kind, r.multiplier[0], r.shift[0], r.rounding);
  }
  return ApplyStage(Sat32(t), s.out, 0);
}

}  // namespace qdsl
