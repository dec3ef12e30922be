// CONV_TRANSPOSE1D / CONV_TRANSPOSE2D: integer transposed convolution (docs/qgraph.md §4.4).
// (conv_transpose.cc is unrelated: byte transposes for the conv kernels.)
//
// Semantics (qdsl/graph/ops/conv_transpose.py; a BIN input is its ±1 values): input position i and tap k add
// (x[ic][i] - in_zp) * (w[ic][o][k] - w_zp[oc]) to output position o = i*s - p + k*d, for
// the input channels ic of output channel oc's group (oc = g*og + o).  Then bias, the
// acc_bits wrap/saturate with overflow counting and the CONV output stage or, for a BIN
// output, the sign (conv::Emit, the same code as CONV*).
//
// Two kernels, equal to the reference exactly:
// * reference (kPathRef, and any layer whose GEMM sums are not provably int32):
//   scatter-accumulate.  One task is (image, group, block of output channels); it keeps the
//   block's accumulators as [OH*OW][ob] and, for every input value and tap that lands inside
//   the output, adds x * (the tap's ob weights, contiguous in wt[ic][ky][kx][o]).  Sums in
//   int64, or int32 when Prepare proved no partial sum can leave int32 (taps per output *
//   max|x - zp| * max|w - w_zp| <= INT32_MAX).
// * GEMM + col2im (other paths, when cg * max|x - zp| * max|w - w_zp| <= INT32_MAX and
//   |w - w_zp| <= 511): per image and group, the input as rows [H*W][cg] (a byte
//   transpose) times the packed weights [kk*og][cg] gives every input position's
//   contribution to every tap and output channel (the packed int GEMM, exact in int32);
//   col2im adds them into the output positions (int32 or int64 as above).  When no sum
//   with its bias can leave the accumulator (so wrap/saturate is moot), groups == 1 and the
//   output is I8/U8, the output stage runs vectorized (Requantize) on [OH*OW][O] and a
//   byte transpose writes NCHW; otherwise conv::Emit per element.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "runtime/ops/conv.h"
#include "threads/thread_pool.h"

namespace qdsl {
namespace {

struct ConvTransposeParams : OpParams {
  int64_t groups = 1, cin = 0, cout = 0, cg = 0, og = 0;
  int64_t kh = 1, kw = 1, sh = 1, sw = 1, ph = 0, pw = 0, dh = 1, dw = 1;
  int32_t in_zp = 0;
  std::vector<int32_t> wt;  // [cin][kh][kw][og]: w - w_zp[oc], output channel innermost
  bool acc32 = false;       // every partial sum provably fits int32
  bool fast_stage = false;  // acc32, no sum + bias can overflow acc_bits, groups 1, I8/U8 out
  int32_t in_max_code = 255;                 // ActView::max_code
  std::vector<PackedWeights> packed;        // per group [kk*og][cg] (empty: no GEMM path)
  ConvParams stage;         // bias, acc_bits, overflow mode and output stage, for conv::Emit
};

constexpr int64_t kBlock = 64;  // output channels per task

Status PrepareConvTranspose(Graph* g, GraphOp& op, int index, std::vector<int64_t>* shape) {
  auto params = std::make_shared<ConvTransposeParams>();
  op.prepared = params;
  ConvTransposeParams& p = *params;
  const int rank = op.opcode == kConvTranspose1d ? 1 : 2;
  const GraphTensor& x = g->tensors[op.inputs[0]];
  const GraphTensor& w = g->tensors[op.inputs[1]];
  const GraphTensor& out = g->tensors[op.outputs[0]];
  const auto& A = op.attrs;
  // BIN: a binary transposed conv (±1 codes held one int8 each, as BINARIZE writes them, at
  // zero point 0; with ±1 I8 weights the sums are exact XNOR sums)
  OP_CHECK(IsInt8(x.dtype) || x.dtype == kBin, "input must be I8/U8/BIN");
  OP_CHECK(w.is_constant && w.dtype != kF32 && w.dtype != kI32 && w.dtype != kBin,
           "weights must be a constant of an integer weight dtype (not BIN)");
  OP_CHECK(out.dtype == kI8 || out.dtype == kU8 || out.dtype == kI32 || out.dtype == kBin,
           "output must be I8/U8/I32/BIN");
  OP_CHECK(static_cast<int>(x.dims.size()) == 2 + rank && static_cast<int>(w.dims.size()) == 2 + rank,
           "input/weight ranks must be %d", 2 + rank);
  p.cin = x.dims[1];
  p.groups = A.at("groups").i;
  OP_CHECK(p.groups >= 1 && p.groups <= (1 << 20) && p.cin % p.groups == 0 && w.dims[0] == p.cin,
           "groups=%lld must divide C=%lld, and weight dim 0 (%lld) must be C", (long long)p.groups,
           (long long)p.cin, (long long)w.dims[0]);
  p.cg = p.cin / p.groups;
  p.og = w.dims[1];
  p.cout = p.og * p.groups;
  const auto& st = A.at("stride").ints;
  const auto& pd = A.at("padding").ints;
  const auto& op_ = A.at("output_padding").ints;
  const auto& dl = A.at("dilation").ints;
  OP_CHECK(static_cast<int>(st.size()) == rank && static_cast<int>(pd.size()) == rank &&
               static_cast<int>(op_.size()) == rank && static_cast<int>(dl.size()) == rank,
           "stride/padding/output_padding/dilation need %d entries", rank);
  int64_t* ks[2] = {&p.kh, &p.kw};
  int64_t* ss[2] = {&p.sh, &p.sw};
  int64_t* ps[2] = {&p.ph, &p.pw};
  int64_t* ds[2] = {&p.dh, &p.dw};
  const int off = 2 - rank;  // 1-D uses the W slot
  for (int i = 0; i < rank; ++i) {
    OP_CHECK(st[i] >= 1 && st[i] <= (1 << 20) && pd[i] >= 0 && pd[i] <= (1 << 20) && dl[i] >= 1 &&
                 dl[i] <= (1 << 20) && op_[i] >= 0 && op_[i] < std::max(st[i], dl[i]),
             "bad stride/padding/output_padding/dilation in spatial dim %d", i);
    *ks[off + i] = w.dims[2 + i];
    *ss[off + i] = st[i];
    *ps[off + i] = pd[i];
    *ds[off + i] = dl[i];
    const int64_t len = (x.dims[2 + i] - 1) * st[i] - 2 * pd[i] + dl[i] * (w.dims[2 + i] - 1) + op_[i] + 1;
    OP_CHECK(len >= 1, "padding leaves no output in spatial dim %d", i);
    (*shape)[2 + i] = len;
  }
  (*shape)[1] = p.cout;
  ConvParams& s = p.stage;
  if (op.inputs.size() == 3) {
    const GraphTensor& b = g->tensors[op.inputs[2]];
    OP_CHECK(b.is_constant && b.dtype == kI32 && b.dims.size() == 1 && b.dims[0] == p.cout, "bias must be I32 [O]");
    s.bias = b.values;
  }
  OP_CHECK(A.at("acc_bits").i >= 2 && A.at("acc_bits").i <= 64, "acc_bits outside [2, 64]");
  s.acc_bits = static_cast<int>(A.at("acc_bits").i);
  OP_CHECK(s.acc_bits <= 32 || kHasWideRescale, "acc_bits %d > 32 needs a compiler with 128-bit integers", s.acc_bits);
  s.overflow_mode = static_cast<int>(A.at("overflow").i);
  OP_CHECK(s.overflow_mode == 0 || s.overflow_mode == 1, "overflow must be 0 (wrap) or 1 (saturate)");
  s.bin_out = out.dtype == kBin;  // the accumulator's sign (conv::Emit), no stage
  if (!s.bin_out) QDSL_RETURN_IF_ERROR(ReadStage(op, index, p.cout, out.dtype, &s.out));
  int64_t xlo, xhi;
  DTypeRange(x.dtype, &xlo, &xhi);
  OP_CHECK(A.at("in_zp").i >= xlo && A.at("in_zp").i <= xhi && (x.dtype != kBin || A.at("in_zp").i == 0),
           "in_zp outside the input dtype (BIN: 0)");
  p.in_zp = static_cast<int32_t>(A.at("in_zp").i);
  const auto& wzp = A.at("w_zp").ints;
  OP_CHECK(wzp.size() == 1 || static_cast<int64_t>(wzp.size()) == p.cout, "w_zp needs 1 or O entries");
  for (int64_t v : wzp) OP_CHECK(std::llabs(v) <= 255, "w_zp %lld out of range", (long long)v);
  const int64_t kk = p.kh * p.kw;
  p.wt.assign(static_cast<size_t>(p.cin * kk * p.og), 0);
  int64_t wmax = 0;
  for (int64_t ic = 0; ic < p.cin; ++ic)
    for (int64_t o = 0; o < p.og; ++o) {
      const int64_t oc = (ic / p.cg) * p.og + o;
      const int64_t zp = wzp.size() == 1 ? wzp[0] : wzp[oc];
      for (int64_t k = 0; k < kk; ++k) {
        const int64_t v = w.values[(ic * p.og + o) * kk + k] - zp;  // weight [cin][og][kh][kw]
        p.wt[(ic * kk + k) * p.og + o] = static_cast<int32_t>(v);
        wmax = std::max<int64_t>(wmax, std::llabs(v));
      }
    }
  // the input's proven range (GraphTensor::value_min/max); at most cg * kh * kw taps reach an output
  xlo = std::max(xlo, x.value_min);
  xhi = std::min(xhi, x.value_max);
  const int64_t xmax = std::max(std::llabs(xlo - p.in_zp), std::llabs(xhi - p.in_zp));
  p.acc32 = p.cg * kk * xmax * wmax <= INT32_MAX;
  int64_t bmax = 0;
  for (int32_t b : s.bias) bmax = std::max<int64_t>(bmax, std::llabs(static_cast<int64_t>(b)));
  const int64_t acc_max = s.acc_bits >= 32 ? INT32_MAX : (int64_t{1} << (s.acc_bits - 1)) - 1;
  p.fast_stage = p.acc32 && p.groups == 1 && IsInt8(out.dtype) && p.cg * kk * xmax * wmax + bmax <= acc_max;
  // (the GEMM reads a BIN input as the int8 it is held in: conv::Int8Rows)
  p.in_max_code = static_cast<int32_t>(std::max<int64_t>(xhi, p.in_zp) + (x.dtype != kU8 ? 128 : 0));
  if (wmax <= 511 && p.cg * xmax * wmax <= INT32_MAX) {
    for (int64_t gi = 0; gi < p.groups; ++gi) {
      std::vector<int16_t> rows(static_cast<size_t>(kk * p.og * p.cg));
      for (int64_t k = 0; k < kk; ++k)
        for (int64_t o = 0; o < p.og; ++o)
          for (int64_t c = 0; c < p.cg; ++c)
            rows[(k * p.og + o) * p.cg + c] = static_cast<int16_t>(p.wt[((gi * p.cg + c) * kk + k) * p.og + o]);
      p.packed.emplace_back();
      QDSL_RETURN_IF_ERROR(PackWeights(rows.data(), kk * p.og, p.cg, p.cg, &p.packed.back()));
    }
  }
  return Status::Ok();
}

// One task: image b, group gi, output channels [o0, o0 + ob) of the group.
template <class Acc>
void RunBlock(const ConvTransposeParams& p, const uint8_t* x, int xdtype, int64_t H, int64_t W, int64_t OH,
              int64_t OW, int64_t b, int64_t gi, int64_t o0, int64_t ob, uint8_t* y, bool wide, int64_t* overflow) {
  std::vector<Acc> acc(static_cast<size_t>(OH * OW * ob), 0);
  const int64_t kk = p.kh * p.kw;
  for (int64_t c = 0; c < p.cg; ++c) {
    const int64_t ic = gi * p.cg + c;
    const int64_t xbase = (b * p.cin + ic) * H * W;
    for (int64_t iy = 0; iy < H; ++iy)
      for (int64_t ix = 0; ix < W; ++ix) {
        const Acc xv = static_cast<Acc>(LoadValue(x, xdtype, xbase + iy * W + ix) - p.in_zp);
        if (xv == 0) continue;
        for (int64_t ky = 0; ky < p.kh; ++ky) {
          const int64_t oy = iy * p.sh - p.ph + ky * p.dh;
          if (oy < 0 || oy >= OH) continue;
          for (int64_t kx = 0; kx < p.kw; ++kx) {
            const int64_t ox = ix * p.sw - p.pw + kx * p.dw;
            if (ox < 0 || ox >= OW) continue;
            Acc* row = acc.data() + (oy * OW + ox) * ob;
            const int32_t* wr = p.wt.data() + (ic * kk + ky * p.kw + kx) * p.og + o0;
            for (int64_t o = 0; o < ob; ++o) row[o] += xv * static_cast<Acc>(wr[o]);
          }
        }
      }
  }
  const int64_t sp = OH * OW;
  for (int64_t o = 0; o < ob; ++o) {
    const int64_t oc = gi * p.og + o0 + o;
    for (int64_t s = 0; s < sp; ++s)
      conv::Emit(static_cast<int64_t>(acc[s * ob + o]), p.stage, oc, y, wide, (b * p.cout + oc) * sp + s, overflow);
  }
}

// col2im of one image and group: cols [H*W][kk*og] (tap-major) into acc [OH*OW][og].
template <class Acc>
void Col2im(const ConvTransposeParams& p, const int32_t* cols, int64_t H, int64_t W, int64_t OH, int64_t OW,
            Acc* acc) {
  const int64_t N = p.kh * p.kw * p.og;
  std::fill(acc, acc + OH * OW * p.og, Acc{0});
  for (int64_t iy = 0; iy < H; ++iy)
    for (int64_t ix = 0; ix < W; ++ix) {
      const int32_t* row = cols + (iy * W + ix) * N;
      for (int64_t ky = 0; ky < p.kh; ++ky) {
        const int64_t oy = iy * p.sh - p.ph + ky * p.dh;
        if (oy < 0 || oy >= OH) continue;
        for (int64_t kx = 0; kx < p.kw; ++kx) {
          const int64_t ox = ix * p.sw - p.pw + kx * p.dw;
          if (ox < 0 || ox >= OW) continue;
          Acc* dst = acc + (oy * OW + ox) * p.og;
          const int32_t* src = row + (ky * p.kw + kx) * p.og;
          for (int64_t o = 0; o < p.og; ++o) dst[o] += static_cast<Acc>(src[o]);
        }
      }
    }
}

// The GEMM + col2im path (see the file comment).
template <class Acc>
Status RunGemm(RunCtx& c, const GraphOp& op, const ConvTransposeParams& p, int64_t n, int64_t H, int64_t W,
               int64_t OH, int64_t OW, int64_t* overflow) {
  const uint8_t* x = c.Buf(op.inputs[0]);
  uint8_t* y = c.Buf(op.outputs[0]);
  const int xdtype = c.DType(op.inputs[0]);
  const bool wide = c.DType(op.outputs[0]) == kI32;
  const int64_t P = H * W, OP = OH * OW, N = p.kh * p.kw * p.og;
  std::vector<uint8_t> xt(static_cast<size_t>(P * p.cg));
  std::vector<int32_t> cols(static_cast<size_t>(P * N));
  std::vector<Acc> acc(static_cast<size_t>(OP * p.og));
  std::vector<uint8_t> staged(p.fast_stage ? static_cast<size_t>(OP * p.cout) : 0);
  for (int64_t b = 0; b < n; ++b)
    for (int64_t gi = 0; gi < p.groups; ++gi) {
      conv::TransposeBytes(x + (b * p.cin + gi * p.cg) * P, P, p.cg, P, xt.data(), p.cg);
      const ActView av = conv::Int8Rows(xt.data(), xdtype, P, p.cg, p.in_zp, p.in_max_code);
      GemmOutput o;
      o.data = cols.data();
      o.ld = N;
      QDSL_RETURN_IF_ERROR(Gemm(av, p.packed[gi], nullptr, o, c.path));
      Col2im(p, cols.data(), H, W, OH, OW, acc.data());
      if constexpr (sizeof(Acc) == sizeof(int32_t)) {
        if (p.fast_stage) {  // groups == 1: acc is [OH*OW][O]
          if (!p.stage.bias.empty())
            for (int64_t s = 0; s < OP; ++s)
              for (int64_t oc = 0; oc < p.cout; ++oc) acc[s * p.cout + oc] += p.stage.bias[oc];
          const DType od = c.DType(op.outputs[0]) == kI8 ? DType::kInt8 : DType::kUInt8;
          QDSL_RETURN_IF_ERROR(Requantize(acc.data(), OP, p.cout, p.stage.out.stage, staged.data(), od, c.path));
          conv::TransposeBytes(staged.data(), p.cout, OP, p.cout, y + b * p.cout * OP, OP);
          continue;
        }
      }
      for (int64_t o = 0; o < p.og; ++o) {
        const int64_t oc = gi * p.og + o;
        for (int64_t s = 0; s < OP; ++s)
          conv::Emit(static_cast<int64_t>(acc[s * p.og + o]), p.stage, oc, y, wide, (b * p.cout + oc) * OP + s, overflow);
      }
    }
  return Status::Ok();
}

Status RunConvTranspose(RunCtx& c, const GraphOp& op) {
  const ConvTransposeParams& p = ParamsOf<ConvTransposeParams>(op);
  const std::vector<int64_t> xs = c.Shape(op.inputs[0]), ys = c.Shape(op.outputs[0]);
  const bool one_d = xs.size() == 3;
  const int64_t n = xs[0], H = one_d ? 1 : xs[2], W = xs.back(), OH = one_d ? 1 : ys[2], OW = ys.back();
  if (!p.packed.empty() && c.path != kPathRef) {
    int64_t* overflow = &c.g->overflow[c.index];
    return p.acc32 ? RunGemm<int32_t>(c, op, p, n, H, W, OH, OW, overflow)
                   : RunGemm<int64_t>(c, op, p, n, H, W, OH, OW, overflow);
  }
  const int64_t blocks = (p.og + kBlock - 1) / kBlock;
  const int64_t tasks = n * p.groups * blocks;
  const bool wide = c.DType(op.outputs[0]) == kI32;
  const uint8_t* x = c.Buf(op.inputs[0]);
  uint8_t* y = c.Buf(op.outputs[0]);
  const int xdtype = c.DType(op.inputs[0]);
  std::vector<int64_t> overflow(static_cast<size_t>(tasks), 0);
  const int64_t work = n * p.cin * H * W * p.kh * p.kw * p.og;
  ParallelFor(static_cast<int>(tasks), [&](int t) {
    const int64_t bk = t % blocks, gi = (t / blocks) % p.groups, b = t / (blocks * p.groups);
    const int64_t o0 = bk * kBlock, ob = std::min(kBlock, p.og - o0);
    if (p.acc32)
      RunBlock<int32_t>(p, x, xdtype, H, W, OH, OW, b, gi, o0, ob, y, wide, &overflow[t]);
    else
      RunBlock<int64_t>(p, x, xdtype, H, W, OH, OW, b, gi, o0, ob, y, wide, &overflow[t]);
  }, work);
  for (int64_t v : overflow) c.g->overflow[c.index] += v;
  return Status::Ok();
}

}  // namespace

// The op table's entries (op_schema.h names them by opcode).
const OpDef kConvTranspose1dDef = {PrepareConvTranspose, RunConvTranspose, ValueRange::kStage};
const OpDef kConvTranspose2dDef = {PrepareConvTranspose, RunConvTranspose, ValueRange::kStage};

}  // namespace qdsl
