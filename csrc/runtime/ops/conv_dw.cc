// DepthwiseConv: int convs with groups == C (ConvParams::depthwise), one input plane per
// output channel (O = m * C, output channel c*m + k reads input channel c).
//
// The general conv paths treat each group as a GEMM with K = kh * kw and one output row,
// which spends its time gathering panels.  Here each task takes whole NCHW planes: the
// input plane minus the zero point is written once as int16 into a buffer with the padding
// as zeros (so padded taps add 0, exactly as the reference's in_zp padding), then for each
// of the plane's m output channels a DwConvKernel sums the taps into an int32 plane (the
// bias as its start value when no overflow is possible), and the output stage runs on it
// vectorized.  Sums are exact in int32 (ConvParams::int32_exact bounds every partial sum);
// when an overflow of the acc_bits accumulator is possible (not fast_acc) each sum goes
// through Emit (bias in int64, wrap/saturate, overflow count) like the other conv paths.
// Planes (image, channel) are split across threads, so a batch of one still parallelizes.
// The layout is NCHW: PlanNhwc keeps NHWC tensors only between AMX convs (groups 1) and ADDs.
#include <algorithm>
#include <vector>

#include "runtime/ops/conv.h"
#include "threads/thread_pool.h"

namespace qdsl {
namespace conv {

namespace {

// The interior of a padded int16 plane: row r is input row r - ph, column q input column
// q - pw, minus zp (the rest of the buffer stays zero: every plane of a task has the same
// padding, so it is zeroed once per task, not per plane).
template <typename T>
void FillInterior(const T* x, int64_t H, int64_t W, int64_t ph, int64_t pw, int64_t rows, int64_t ldp, int32_t zp,
                  int16_t* xp) {
  const int64_t end = std::min(rows, ph + H);
  for (int64_t r = std::min(ph, rows); r < end; ++r) {
    int16_t* dst = xp + r * ldp + pw;
    const T* src = x + (r - ph) * W;
    for (int64_t i = 0; i < W; ++i) dst[i] = static_cast<int16_t>(static_cast<int32_t>(src[i]) - zp);
  }
}

}  // namespace

Status DepthwiseConv(Graph* g, const GraphOp& op, int64_t batch, uint32_t path, int64_t* overflow) {
  const ConvParams& p = ParamsOf<ConvParams>(op);
  const Geometry e = Geo(g, op, batch);
  const bool x_signed = g->tensors[op.inputs[0]].dtype == kI8;
  const int out_dtype = g->tensors[op.outputs[0]].dtype;
  const uint8_t* x = g->buffers[op.inputs[0]].data();
  uint8_t* y = g->buffers[op.outputs[0]].data();
  const DwConvShape s{e.OH, e.OW, p.kh, p.kw, p.sh, p.sw, p.dh, p.dw};
  const DwConvKernel kernel = SelectDwConvKernel(s, path);
  const DwFillKernel fill = SelectDwFillKernel(path);
  const RequantKernel requant = SelectRequantKernel(path);
  const StageI32Kernel stage_i32 = SelectStageI32Kernel(path);
  const int64_t m = e.og, P = e.OH * e.OW, taps = p.kh * p.kw, npairs = (p.kw + 1) / 2;
  // the padded rows the windows reach (every row of the padded image or fewer)
  const int64_t rows = (e.OH - 1) * p.sh + (p.kh - 1) * p.dh + 1;
  const int64_t ldp = (std::max(DwConvPlaneCols(s), e.W + 2 * p.pw) + 15) / 16 * 16;
  const int64_t planes = e.n * e.C;
  // work: the MACs, ~64 per output for the stage, and the plane copies
  const int64_t work = e.n * e.O * P * (taps + 64) + planes * rows * ldp;
  // several tasks per thread, so uneven finishing balances
  const int64_t chunk = FineChunk(planes, planes, 1, work);
  std::vector<int64_t> counts(static_cast<size_t>((planes + chunk - 1) / chunk), 0);
  // this op's output and its twins' (ConvParams::twins: same sums, own stage; fast_acc only)
  struct Out {
    const StageData* sd;
    int dtype;
    uint8_t* data;
  };
  std::vector<Out> outs{{&p.out, out_dtype, y}};
  for (int32_t j : p.twins) {
    const GraphOp& t = g->ops[j];
    outs.push_back({&ParamsOf<ConvParams>(t).out, g->tensors[t.outputs[0]].dtype, g->buffers[t.outputs[0]].data()});
    g->fused_done[j] = 1;
  }
  ParallelRanges(planes, chunk, work, [&](int64_t i0, int64_t i1) {
    thread_local AlignedVector<int16_t> xp;
    thread_local AlignedVector<int32_t> acc;
    xp.assign(static_cast<size_t>(rows * ldp), 0);
    // the sums of a channel as one contiguous plane (lda = OW, see DwConvShape), so the output
    // stage runs vectorized over all OH * OW values, not per row with a scalar row tail
    // grow only: resize() zero-fills every element past the current size, so shrinking for
    // a small op made the next large one clear its whole buffer (every sum is written)
    const size_t acc_n = static_cast<size_t>((e.OH - 1) * e.OW + DwConvAccCols(s));
    if (acc.size() < acc_n) acc.resize(acc_n);
    int64_t* count = &counts[static_cast<size_t>(i0 / chunk)];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / e.C, c = i % e.C;
      const uint8_t* xplane = x + i * e.H * e.W;
      if (fill != nullptr && ldp >= p.pw + e.W + 16) {
        fill(xplane, x_signed, e.H, e.W, p.ph, p.pw, rows, ldp, p.in_zp, xp.data());
      } else if (x_signed) {
        FillInterior(reinterpret_cast<const int8_t*>(xplane), e.H, e.W, p.ph, p.pw, rows, ldp, p.in_zp, xp.data());
      } else {
        FillInterior(xplane, e.H, e.W, p.ph, p.pw, rows, ldp, p.in_zp, xp.data());
      }
      for (int64_t k = 0; k < m; ++k) {
        const int64_t oc = c * m + k;
        const int64_t first = (b * e.O + oc) * P;  // the output plane's first element
        const bool bias_in = p.fast_acc && !p.bias.empty();
        kernel(xp.data(), ldp, s, p.dw_taps.data() + oc * taps, p.dw_pairs.data() + oc * p.kh * npairs,
               bias_in ? p.bias[oc] : 0, acc.data(), e.OW);
        if (!p.fast_acc) {
          for (int64_t t = 0; t < P; ++t) Emit(acc[t], p, oc, y, out_dtype == kI32, first + t, count);
          continue;
        }
        for (const Out& o : outs) {
          const Rescale& r = o.sd->stage.rescale;
          OutputStage one = o.sd->stage;
          const int64_t ch = r.channels == 1 ? 0 : oc;
          one.rescale.multiplier = r.multiplier + ch;
          one.rescale.shift = r.shift + ch;
          one.rescale.channels = 1;
          if (o.dtype != kI32) {
            requant(acc.data(), 1, P, P, one, 0, o.data + first, P, o.dtype == kI8);
          } else {
            stage_i32(acc.data(), P, one, reinterpret_cast<int32_t*>(o.data) + first);
          }
        }
      }
    }
  });
  for (int64_t v : counts) *overflow += v;
  return Status::Ok();
}

}  // namespace conv
}  // namespace qdsl
