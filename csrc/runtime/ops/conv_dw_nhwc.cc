// DepthwiseConvNhwc: depthwise convs with O == C (no depth multiplier) and the fast stage
// (ConvParams::dw_nhwc), computed channels-last: per output row, the kernel taps of every
// position as pointers into the NHWC input (padded taps point at a row of zero-point codes,
// ConvParams::dwn_zrow, so no padded copy is made), a DwNhwcKernel sums all channels of the
// row into int32 (the zero point folded into its init, qdsl/gemm.h), and the per-channel
// output stage (the same RequantKernel as every conv: bit-exact with the reference) writes
// the row's bytes once; a FIXED_SINGLE stage prepared at prepare time (dwn_stage) is applied
// by the kernel itself from its registers (DwNhwcStageKernel), storing the codes only; on U8
// codes with int8 weights where vpmaddubsw is exact (ConvParams::dwq, e.g. 7-bit activations)
// the DwNhwcQuadKernel does that with half the shuffles.
//
// Either side may be NCHW (Graph::nhwc says which is not): an NCHW input is transposed a
// band of rows at a time into a thread-local NHWC buffer (halo rows are transposed again by
// the next band), an NCHW output band is written NHWC to a buffer and transposed into the
// planes.  Output rows (image, oy) are split across threads, so a batch of one parallelizes.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "runtime/ops/conv.h"
#include "threads/thread_pool.h"

namespace qdsl {
namespace conv {

namespace {

// Input bytes a band of output rows should transpose or read: about L1's size.
constexpr int64_t kBandBytes = 32 * 1024;

// False when QDSL_DW_QUAD=0 (read once): the int16 kernel runs where the vpmaddubsw one
// would (timing the two in one build).
bool DwQuadEnabled() {
  static const bool on = [] {
    const char* v = std::getenv("QDSL_DW_QUAD");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return on;
}

}  // namespace

Status DepthwiseConvNhwc(Graph* g, const GraphOp& op, int64_t batch, uint32_t path) {
  const ConvParams& p = ParamsOf<ConvParams>(op);
  const Geometry e = Geo(g, op, batch);
  const bool in_nhwc = g->nhwc[op.inputs[0]] != 0, out_nhwc = g->nhwc[op.outputs[0]] != 0;
  const bool x_signed = g->tensors[op.inputs[0]].dtype == kI8;
  const bool out_signed = g->tensors[op.outputs[0]].dtype == kI8;
  const uint8_t* x = g->buffers[op.inputs[0]].data();
  const uint8_t* x_end = x + g->buffers[op.inputs[0]].size();
  uint8_t* y = g->buffers[op.outputs[0]].data();
  const DwNhwcKernel kernel = SelectDwNhwcKernel(path);
  const RequantKernel requant = SelectRequantKernel(path);
  // the stage applied from the kernel's registers (no int32 row) when it was prepared for it
  const DwNhwcStageKernel stage_kernel = p.dwn_stage.ok && RegisterStageEnabled() ? SelectDwNhwcStageKernel(path) : nullptr;
  // the vpmaddubsw kernel (U8 codes, int8 weights, exact for the input's codes: ConvParams::dwq)
  const DwNhwcQuadKernel quad_kernel = p.dwq && stage_kernel != nullptr && DwQuadEnabled() ? SelectDwNhwcQuadKernel(path) : nullptr;
  const int64_t C = e.C, cols = DwNhwcCols(C), taps = p.kh * p.kw, HW = e.H * e.W, P = e.OH * e.OW;
  const int64_t rows = e.n * e.OH;
  const int64_t band = std::clamp<int64_t>(kBandBytes / std::max<int64_t>(1, e.W * C * p.sh), 1, e.OH);
  // work: the MACs, ~16 per output for the stage and pointers, the transposes; times 4 in
  // GEMM MAC equivalents (ParallelFor's threshold): a 3x3 output measured ~2 ns, as long as
  // ~100 AVX2 GEMM MACs, so MobileNetV2's 0.1-0.2 ms 14 x 14 layers ran serially at x1
  const int64_t work = 4 * (e.n * P * C * (taps + 16) + (in_nhwc ? 0 : e.n * HW * C) + (out_nhwc ? 0 : e.n * P * C));
  const int64_t chunk = FineChunk(rows, rows, 1, work);  // kClaimsPerThread row ranges per thread
  const uint8_t* zrow = p.dwn_zrow.data();
  ParallelRanges(rows, chunk, work, [&](int64_t r0, int64_t r1) {
    // thread_local objects are reached through a wrapper call on every use: bind them once
    thread_local std::vector<const uint8_t*> ptrs_tl;
    thread_local AlignedVector<int32_t> acc_tl;
    thread_local std::vector<uint8_t> xb_tl, yb_tl, slack_tl;
    std::vector<const uint8_t*>& ptrs = ptrs_tl;
    AlignedVector<int32_t>& acc = acc_tl;
    std::vector<uint8_t>&xb = xb_tl, &yb = yb_tl, &slack = slack_tl;
    ptrs.resize(static_cast<size_t>(e.OW * taps));
    if (acc.size() < static_cast<size_t>(e.OW * cols)) acc.resize(static_cast<size_t>(e.OW * cols));
    const uint8_t** pt = ptrs.data();
    for (int64_t r = r0; r < r1;) {
      const int64_t b = r / e.OH, oy0 = r % e.OH, oy1 = std::min({e.OH, oy0 + band, oy0 + (r1 - r)});
      r += oy1 - oy0;
      // the input rows the band reads, and where pixel (iy, ix) is: img + ((iy - row0) * W + ix) * C
      const int64_t iy_lo = std::max<int64_t>(0, oy0 * p.sh - p.ph);
      const int64_t iy_hi = std::min(e.H, (oy1 - 1) * p.sh - p.ph + (p.kh - 1) * p.dh + 1);
      const uint8_t* img = x + b * HW * C;
      int64_t row0 = 0;
      const uint8_t* safe_end = x_end;  // a tap pointer q may be read up to q + cols <= safe_end
      if (!in_nhwc) {
        const int64_t nb = std::max<int64_t>(0, iy_hi - iy_lo);
        xb.resize(static_cast<size_t>(nb * e.W * C + cols));
        if (nb > 0) TransposeBytes(x + b * C * HW + iy_lo * e.W, HW, C, nb * e.W, xb.data(), C);
        img = xb.data();
        row0 = iy_lo;
        safe_end = xb.data() + xb.size();
      }
      if (!out_nhwc) yb.resize(static_cast<size_t>((oy1 - oy0) * e.OW * C));
      for (int64_t oy = oy0; oy < oy1; ++oy) {
        for (int64_t ky = 0; ky < p.kh; ++ky) {
          const int64_t iy = oy * p.sh - p.ph + ky * p.dh;
          const bool row_in = iy >= 0 && iy < e.H;
          const uint8_t* irow = row_in ? img + (iy - row0) * e.W * C : nullptr;
          for (int64_t kx = 0; kx < p.kw; ++kx) {
            const uint8_t** q = pt + ky * p.kw + kx;
            int64_t off = 0, lo = e.OW, hi = e.OW;  // columns [lo, hi) read the input (ix = ox * sw + off)
            if (row_in) ValidRange(p, e, kx, &off, &lo, &hi);
            for (int64_t ox = 0; ox < lo; ++ox) q[ox * taps] = zrow;
            for (int64_t ox = lo; ox < hi; ++ox) q[ox * taps] = irow + (ox * p.sw + off) * C;
            for (int64_t ox = hi; ox < e.OW; ++ox) q[ox * taps] = zrow;
          }
        }
        if (C != cols) {  // the kernel reads cols >= C bytes: the last pixels of a buffer go through a copy
          for (int64_t k = 0; k < e.OW * taps; ++k) {
            if (pt[k] == zrow || pt[k] + cols <= safe_end) continue;
            if (slack.size() < static_cast<size_t>(e.OW * taps * cols)) slack.resize(static_cast<size_t>(e.OW * taps * cols));
            std::memcpy(slack.data() + k * cols, pt[k], static_cast<size_t>(C));
            pt[k] = slack.data() + k * cols;
          }
        }
        uint8_t* out = out_nhwc ? y + ((b * e.OH + oy) * e.OW) * C : yb.data() + (oy - oy0) * e.OW * C;
        if (quad_kernel != nullptr) {
          quad_kernel(pt, e.OW, taps, C, p.dwq_w.data(), p.dwq_init.data(), p.dwn_stage, out, C, out_signed);
          continue;
        }
        if (stage_kernel != nullptr) {
          stage_kernel(pt, e.OW, taps, C, x_signed, p.dwn_pairs.data(), p.dwn_init.data(), p.dwn_stage, out, C,
                       out_signed);
          continue;
        }
        kernel(pt, e.OW, taps, C, x_signed, p.dwn_taps.data(), p.dwn_pairs.data(), p.dwn_init.data(),
               acc.data(), cols);
        requant(acc.data(), e.OW, C, cols, p.out.stage, 0, out, C, out_signed);
      }
      if (!out_nhwc) TransposeBytes(yb.data(), C, (oy1 - oy0) * e.OW, C, y + b * C * P + oy0 * e.OW, P);
    }
  });
  return Status::Ok();
}

}  // namespace conv
}  // namespace qdsl
