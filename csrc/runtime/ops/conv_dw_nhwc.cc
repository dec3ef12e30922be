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
//
// Row bands (ConvParams::band_producer, RowBandFused): when the input is the output of the
// 1x1 implicit-GEMM conv just before this one (MobileNetV2's expansion convs), that conv's
// rows are computed here, as a band needs them, into a ring of the rows the band reads
// (rows of the last band that the next one reads again stay in it), so its output, 1.2 MB
// per image at MobileNetV2's 112 x 112 expansion, is never written whole and read back.
// The rows are the bytes the 1x1 conv would store: the same IgemmStageKernel on the same
// row pointers, weights, start values and register stage as IgemmConv (conv_igemm.cc), so
// the result is bit-identical to the two ops run one after the other.
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

// False when QDSL_ROW_BAND=0 (read once): the 1x1 conv and the depthwise conv run as two ops.
bool RowBandEnabled() {
  static const bool on = [] {
    const char* v = std::getenv("QDSL_ROW_BAND");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return on;
}

// The 1x1 producer's inputs for computing rows of its output (RowBandFused), and the
// computation: output row iy of image b as IgemmConv writes it (from_regs: NHWC codes).
struct BandProducer {
  const ConvParams* p = nullptr;
  const uint8_t* x = nullptr;  // its input tensor (NHWC when direct, else NCHW or unpadded NHWC)
  bool x_nhwc = false, direct = false, out_signed = false;
  int64_t cin = 0, cp = 0, H = 0, W = 0, O = 0, panel_bytes = 0;
  uint8_t zu = 0, flip = 0;
  IgemmStageKernel kernel = nullptr;

  // row iy of image b into dst (W * O codes); pin/ind: the thread's scratch
  void Row(int64_t b, int64_t iy, uint8_t* dst, std::vector<uint8_t>* pin, std::vector<const uint8_t*>* ind) const {
    const uint8_t* base;
    int64_t step = cp;
    if (direct) {
      base = x + ((b * H + iy) * W) * cin;
    } else {  // the row as IgemmConv's copy holds it: u8 codes, channels padded to cp with zu
      pin->resize(static_cast<size_t>(W * cp));
      uint8_t* d = pin->data();
      if (x_nhwc) {
        for (int64_t i = 0; i < W; ++i) std::memcpy(d + i * cp, x + ((b * H + iy) * W + i) * cin, static_cast<size_t>(cin));
      } else {
        TransposeBytes(x + b * cin * H * W + iy * W, H * W, cin, W, d, cp);
      }
      if (cp != cin)
        for (int64_t i = 0; i < W; ++i) std::memset(d + i * cp + cin, zu, static_cast<size_t>(cp - cin));
      if (flip != 0)
        for (int64_t i = 0; i < W * cp; ++i) d[i] ^= flip;
      base = d;
    }
    ind->resize(static_cast<size_t>(W));
    const uint8_t** r = ind->data();
    for (int64_t i = 0; i < W; ++i) r[i] = base + i * step;
    for (int64_t np = 0; np < p->ig_panels; ++np) {
      const uint8_t* w = p->ig_w.data() + np * panel_bytes;
      const int64_t c0 = np * 16;
      const int cols = static_cast<int>(std::min<int64_t>(16, O - c0));
      for (int64_t s = 0; s < W; s += 6)
        kernel(static_cast<int>(std::min<int64_t>(6, W - s)), r + s, 1, cp / 4, w, p->ig_cinit.data() + c0,
               p->ig_stage, c0, cols, dst + s * O + c0, O, out_signed);
    }
  }
};

}  // namespace

bool RowBandFused(const Graph* g, const GraphOp& dw, uint32_t path) {
  const ConvParams& d = ParamsOf<ConvParams>(dw);
  if (d.band_producer < 0 || path == kPathRef || !RowBandEnabled() || !RegisterStageEnabled()) return false;
  const GraphOp& prod = g->ops[d.band_producer];
  const ConvParams& c = ParamsOf<ConvParams>(prod);
  const uint32_t t = dw.inputs[0];
  if (t >= g->nhwc.size() || !g->nhwc[t] || !d.dw_nhwc || !d.dwn_stage.ok) return false;
  // the producer as RunConv runs it: IgemmConv (not AMX), the register stage (from_regs)
  if (c.amx_conv && c.fast_acc && SelectAmxGatherKernel(path) != nullptr) return false;
  return RunsNhwc(c, path) && !c.ig_int16 && c.ig_stage.ok && SelectIgemmStageKernel(path) != nullptr &&
         SelectDwNhwcStageKernel(path) != nullptr;
}

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
  // the 1x1 conv whose output rows this conv computes (row bands), and the ring they go to:
  // ring_rows >= the rows one band reads, so a band's rows never share a slot
  BandProducer prod;
  int64_t ring_rows = 0;
  if (RowBandFused(g, op, path)) {
    const GraphOp& pop = g->ops[p.band_producer];
    prod.p = &ParamsOf<ConvParams>(pop);
    const uint32_t xt = pop.inputs[0];
    prod.x = g->buffers[xt].data();
    prod.x_nhwc = g->nhwc[xt] != 0;
    prod.cin = prod.p->cin;
    prod.cp = prod.p->ig_cp;
    prod.H = e.H, prod.W = e.W, prod.O = C;
    prod.panel_bytes = (prod.cp / 4) * 64;
    prod.flip = g->tensors[xt].dtype == kI8 ? 0x80 : 0;
    prod.zu = static_cast<uint8_t>(prod.p->in_zp + (prod.flip != 0 ? 128 : 0));
    prod.direct = prod.x_nhwc && prod.cp == prod.cin && prod.flip == 0;
    prod.out_signed = x_signed;
    prod.kernel = SelectIgemmStageKernel(path);
    ring_rows = std::min(e.H, (band - 1) * p.sh + (p.kh - 1) * p.dh + 1);
  }
  // work: the MACs, ~16 per output for the stage and pointers, the transposes; times 4 in
  // GEMM MAC equivalents (ParallelFor's threshold): a 3x3 output measured ~2 ns, as long as
  // ~100 AVX2 GEMM MACs, so MobileNetV2's 0.1-0.2 ms 14 x 14 layers ran serially at x1; with
  // row bands the 1x1 conv's MACs and stage too
  const int64_t work = 4 * (e.n * P * C * (taps + 16) + (in_nhwc ? 0 : e.n * HW * C) + (out_nhwc ? 0 : e.n * P * C)) +
                       (ring_rows > 0 ? e.n * HW * C * (prod.cp + 16) : 0);
  // kClaimsPerThread row ranges per thread; with row bands at least 8 rows each (a range
  // computes the 1x1 conv's rows its first band reads again: its halo)
  const int64_t chunk = FineChunk(rows, rows, ring_rows > 0 ? 8 : 1, work);
  const uint8_t* zrow = p.dwn_zrow.data();
  ParallelRanges(rows, chunk, work, [&](int64_t r0, int64_t r1) {
    // thread_local objects are reached through a wrapper call on every use: bind them once
    thread_local std::vector<const uint8_t*> ptrs_tl;
    thread_local AlignedVector<int32_t> acc_tl;
    thread_local std::vector<uint8_t> xb_tl, yb_tl, slack_tl;
    std::vector<const uint8_t*>& ptrs = ptrs_tl;
    AlignedVector<int32_t>& acc = acc_tl;
    thread_local std::vector<uint8_t> pin_tl;
    thread_local std::vector<const uint8_t*> pind_tl;
    std::vector<uint8_t>&xb = xb_tl, &yb = yb_tl, &slack = slack_tl;
    // row bands: the ring holds the 1x1 conv's rows [have_lo, have_hi) of image have_b
    int64_t have_b = -1, have_hi = 0;
    if (ring_rows > 0) xb.resize(static_cast<size_t>(ring_rows * e.W * C + cols));
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
      if (ring_rows > 0) {  // the rows not in the ring yet, computed into their slots
        if (b != have_b) have_b = b, have_hi = iy_lo;
        for (int64_t iy = std::max(iy_lo, have_hi); iy < iy_hi; ++iy)
          prod.Row(b, iy, xb.data() + (iy % ring_rows) * e.W * C, &pin_tl, &pind_tl);
        have_hi = std::max(have_hi, iy_hi);
        img = xb.data();
        safe_end = xb.data() + xb.size();
      } else if (!in_nhwc) {
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
          const uint8_t* irow =
              !row_in ? nullptr : img + (ring_rows > 0 ? iy % ring_rows : iy - row0) * e.W * C;
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
