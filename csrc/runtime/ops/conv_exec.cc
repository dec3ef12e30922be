// Execution of CONV1D/CONV2D/LINEAR and BCONV1D/BCONV2D/BLINEAR (docs/qgraph.md §4.3-4.4).
//
// Int ops: im2col per group (padding reads in_zp, so it contributes 0), then the packed
// GEMM into int32 (exact by the bound checked in conv_prepare.cc), or exact int64 loops
// when that bound fails or the reference path is forced.  Binary ops: im2col of +-1
// values with padding +1, bit-packing, popcount GEMM, then for windows that touch the
// padding the padded taps' contribution (+1 * w) is subtracted again, so padding taps are
// skipped exactly as the reference does.  Then bias (int64), acc_bits wrap/saturate with
// overflow counting, and the output stage (the wide rescale when acc_bits > 32) or the sign
// for BIN outputs.
#include <cstring>

#include "ref/ref.h"
#include "runtime/ops/conv.h"

namespace qdsl {
namespace conv {

// LINEAR with no overflow possible: bias and output stage inside the GEMM, vectorized on
// the task's block while it is in cache (the per-element path of RunConv cost 3x the GEMM
// on wide layers).  I32 outputs (a transformer's wide residual branch) take the int32
// stage: with no overflow possible it equals Emit's (the wide rescale of an int32 sum is
// the int32 one).
bool LinearFusedGemm(const Graph* g, const GraphOp& op) {
  const ConvParams& p = ParamsOf<ConvParams>(op);
  const int out_dtype = g->tensors[op.outputs[0]].dtype;
  return op.opcode == kLinear && p.spatial == 0 && p.groups == 1 && p.fast_acc && !p.bin_out &&
         g->tensors[op.inputs[0]].dtype != kBin && (out_dtype == kI8 || out_dtype == kU8 || out_dtype == kI32);
}

Status RunConv(Graph* g, const GraphOp& op, int64_t batch, uint32_t path, int64_t* overflow) {
  const ConvParams& p = ParamsOf<ConvParams>(op);
  if (p.spatial > 0 && p.amx_conv && p.fast_acc) {
    if (const AmxGatherKernel amx = SelectAmxGatherKernel(path)) return AmxConvImplicit(g, op, batch, path, amx);
  }
  if (RunsNhwc(p, path)) return IgemmConv(g, op, batch, path, SelectIgemmKernel(path, p.ig_int16));  // (AMX: above)
  if (p.depthwise && path != kPathRef) {
    // channels-last when PlanNhwc allows it (dw_nhwc) and a neighbour keeps NHWC tensors, or
    // on small output planes (at most 8 x 8: the plane kernel's rows of 16-output blocks are
    // mostly empty there; channels-last with the transposes in and out measured faster on
    // lone convs, and no slower inside MobileNetV2);
    // between NCHW tensors on larger planes the transposes cost more than the plane kernel
    // saves.  (Graph::nhwc alone is not enough: a one-channel depthwise conv is also a
    // groups-1 conv, whose tensors the AMX plan may mark for AMX runs only.)
    const std::vector<int64_t>& od = g->tensors[op.outputs[0]].dims;
    int64_t plane = 1;
    for (size_t i = 2; i < od.size(); ++i) plane *= od[i];
    if (p.dw_nhwc && (g->nhwc[op.inputs[0]] || g->nhwc[op.outputs[0]] || plane <= 64))
      return DepthwiseConvNhwc(g, op, batch, path);
    return DepthwiseConv(g, op, batch, path, overflow);
  }
  if (p.spatial > 0 && !p.w16.empty() && path != kPathRef) return IntConvFast(g, op, batch, path, overflow);
  const Geometry e = Geo(g, op, batch);
  const int out_dtype = g->tensors[op.outputs[0]].dtype;
  if (path != kPathRef && LinearFusedGemm(g, op)) {
    const ActView av = conv::Int8Rows(g->buffers[op.inputs[0]].data(), g->tensors[op.inputs[0]].dtype, e.n, e.kdim,
                                      p.in_zp, p.in_max_code);
    GemmOutput o;
    o.data = g->buffers[op.outputs[0]].data();
    o.dtype = out_dtype == kI8 ? DType::kInt8 : (out_dtype == kU8 ? DType::kUInt8 : DType::kInt32);
    o.ld = e.og;
    o.stage = &p.out.stage;
    return Gemm(av, p.packed[0], p.bias.empty() ? nullptr : p.bias.data(), o, path);
  }
  const GraphTensor& xt = g->tensors[op.inputs[0]];
  const uint8_t* x = g->buffers[op.inputs[0]].data();
  uint8_t* y = g->buffers[op.outputs[0]].data();
  const int64_t sp = e.OH * e.OW, M = e.n * sp;
  const bool binary = xt.dtype == kBin;
  const bool is_linear = p.spatial == 0;
  const bool wide = g->tensors[op.outputs[0]].dtype == kI32;
  std::vector<uint8_t> rows;
  std::vector<int32_t> acc(static_cast<size_t>(M * e.og));
  for (int64_t gi = 0; gi < p.groups; ++gi) {
    const uint8_t* a = x;
    if (!is_linear) {
      rows.resize(static_cast<size_t>(M * e.kdim));
      Im2col(x, p, e, gi, binary ? 1 : static_cast<uint8_t>(p.in_zp), rows.data());
      a = rows.data();
    }
    if (binary) {
      const int64_t kwords = (e.kdim + 63) / 64;
      std::vector<uint64_t> bits(static_cast<size_t>(M * kwords + 4));
      QDSL_RETURN_IF_ERROR(BitpackSigns(reinterpret_cast<const int8_t*>(a), M, e.kdim, e.kdim, bits.data(), kwords));
      GemmOutput o;
      o.data = acc.data();
      o.ld = e.og;
      QDSL_RETURN_IF_ERROR(BinaryGemm(bits.data(), M, kwords, p.packed[gi], nullptr, o, path));
    } else if (p.int32_exact && path != kPathRef) {
      const ActView av = conv::Int8Rows(a, xt.dtype, M, e.kdim, p.in_zp, p.in_max_code);
      GemmOutput o;
      o.data = acc.data();
      o.ld = e.og;
      QDSL_RETURN_IF_ERROR(Gemm(av, p.packed[gi], nullptr, o, path));
    }
    const bool exact64 = !binary && !(p.int32_exact && path != kPathRef);
    const std::vector<int32_t>& wv = exact64 ? p.w_int[gi] : std::vector<int32_t>();
    for (int64_t m = 0; m < M; ++m) {
      const int64_t b = m / sp, s_ = m % sp, oy = s_ / e.OW, ox = s_ % e.OW;
      bool border = false;
      if (binary && !is_linear) {
        for (int64_t ky = 0; ky < p.kh && !border; ++ky)
          for (int64_t kx = 0; kx < p.kw && !border; ++kx) {
            int64_t iy, ix;
            border = !Tap(p, e, oy, ox, ky, kx, &iy, &ix);
          }
      }
      for (int64_t o = 0; o < e.og; ++o) {
        const int64_t oc = gi * e.og + o;
        int64_t s;
        if (exact64) {  // exact int64 dot product over the im2col row
          s = 0;
          const uint8_t* row = a + m * e.kdim;
          const int32_t* wr = wv.data() + o * e.kdim;
          for (int64_t k = 0; k < e.kdim; ++k) {
            const int32_t xv = xt.dtype == kU8 ? row[k] : static_cast<int8_t>(row[k]);
            s += static_cast<int64_t>(xv - p.in_zp) * wr[k];
          }
        } else {
          s = acc[m * e.og + o];
        }
        if (border) {  // remove the padded taps' (+1 * w) contribution
          const int8_t* wr_bits = nullptr;
          (void)wr_bits;
          const PackedWeights& pw = p.packed[gi];
          int64_t k = 0;
          for (int64_t c = 0; c < e.cg; ++c)
            for (int64_t ky = 0; ky < p.kh; ++ky)
              for (int64_t kx = 0; kx < p.kw; ++kx, ++k) {
                int64_t iy, ix;
                if (!Tap(p, e, oy, ox, ky, kx, &iy, &ix)) {
                  const bool neg = (pw.bits_rows[o * pw.kwords + (k >> 6)] >> (k & 63)) & 1;
                  s -= neg ? -1 : 1;
                }
              }
        }
        const int64_t idx = is_linear ? b * e.O + oc : (b * e.O + oc) * sp + s_;
        Emit(s, p, oc, y, wide, idx, overflow);
      }
    }
  }
  return Status::Ok();
}

}  // namespace conv

Status RunConvOp(RunCtx& c, const GraphOp& op) {
  // (a 1x1 conv whose output rows the depthwise conv after it computes: conv_dw_nhwc.cc)
  if (const ConvParams& p = ParamsOf<ConvParams>(op);
      p.band_consumer >= 0 && conv::RowBandFused(c.g, c.g->ops[p.band_consumer], c.path))
    return Status::Ok();
  return conv::RunConv(c.g, op, c.batch, c.path, &c.g->overflow[c.index]);
}

}  // namespace qdsl
