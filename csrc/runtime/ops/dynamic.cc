// QUANTIZE_DYNAMIC (F32 -> I8/U8 codes + F32 qparams [rows, 2]) and LINEAR_DYNAMIC
// (codes x int8 weights -> F32), docs/qgraph.md §4.4; the reference is
// qdsl/graph/ops/dynamic.py and this file equals it bit for bit.
//
// Float order: every float step is one binary32 operation in the order the reference
// writes it (no fused multiply-add: this file is compiled without -mfma, and the library's
// flags in setup.py enable none, so the compiler cannot contract a*b+c; the pragma below
// says so for GCC/Clang builds that add -march flags).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "dispatch.h"
#include "runtime/ops/dynamic_quant.h"
#include "runtime/ops/op.h"
#include "threads/thread_pool.h"

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace qdsl {
namespace {

using dynq::BitsF32;
using dynq::FiniteRange;
constexpr int64_t kMaxK = 65536;  // |q - zp| <= 255, |w| <= 128: K products fit int32

struct QuantizeDynamicParams : OpParams, dynq::Rule {
  bool per_row = false;
};

struct LinearDynamicParams : OpParams {
  int64_t cout = 0, k = 0;
  std::vector<float> w_scale, bias;
  std::vector<int32_t> colsum;  // sum_k w[o][k], for the per-row zero point
  bool relu = false;
  int32_t max_code = 255;  // the largest code the u8 kernels see (ActView::max_code): qmax, +128 for I8
  PackedWeights packed;
  mutable std::vector<int32_t> acc;  // scratch, reused (a graph runs one call at a time)
};

}  // namespace

Status PrepareQuantizeDynamic(Graph* g, GraphOp& op, int index, std::vector<int64_t>* /*shape*/) {
  const GraphTensor& x = g->tensors[op.inputs[0]];
  const GraphTensor& out = g->tensors[op.outputs[0]];
  const GraphTensor& qp = g->tensors[op.outputs[1]];
  const auto& A = op.attrs;
  OP_CHECK(x.dtype == kF32 && IsInt8(out.dtype), "QUANTIZE_DYNAMIC maps F32 to I8/U8");
  OP_CHECK(x.dims.size() >= 2, "input must have rank >= 2");
  int64_t lo, hi;
  DTypeRange(out.dtype, &lo, &hi);
  const int64_t qmin = A.at("qmin").i, qmax = A.at("qmax").i;
  OP_CHECK(qmin >= lo && qmax <= hi && qmin < qmax && qmax > 0, "qmin/qmax outside the output dtype or empty");
  OP_CHECK(A.at("symmetric").i == 0 || A.at("symmetric").i == 1, "symmetric must be 0 or 1");
  OP_CHECK(A.at("per_row").i == 0 || A.at("per_row").i == 1, "per_row must be 0 or 1");
  OP_CHECK(A.at("rounding").i >= 0 && A.at("rounding").i <= 3, "unknown rounding");
  std::vector<int64_t> want(x.dims.begin(), x.dims.end() - 1);
  want.push_back(2);
  OP_CHECK(qp.dtype == kF32 && qp.dims == want, "qparams output '%s' must be F32 of shape [rows.., 2]",
           qp.name.c_str());
  auto p = std::make_shared<QuantizeDynamicParams>();
  p->qmin = static_cast<int32_t>(qmin);
  p->qmax = static_cast<int32_t>(qmax);
  p->symmetric = A.at("symmetric").i == 1;
  p->per_row = A.at("per_row").i == 1;
  p->rounding = static_cast<int>(A.at("rounding").i);
  op.prepared = std::move(p);
  return Status::Ok();
}

Status RunQuantizeDynamic(RunCtx& c, const GraphOp& op) {
  const QuantizeDynamicParams& p = ParamsOf<QuantizeDynamicParams>(op);
  const std::vector<int64_t> xs = c.Shape(op.inputs[0]);
  const int64_t k = xs.back(), rows = Numel(xs) / k;
  const float* x = reinterpret_cast<const float*>(c.Buf(op.inputs[0]));
  uint8_t* y = c.Buf(op.outputs[0]);
  float* qp = reinterpret_cast<float*>(c.Buf(op.outputs[1]));
  float ts = 0.f, tz = 0.f;
  if (!p.per_row) {
    float lo = 0.f, hi = 0.f;
    bool any = false;
    FiniteRange(x, rows * k, &lo, &hi, &any);
    dynq::QParams(lo, hi, any, p, &ts, &tz);
  }
  // QUANTIZE's vector kernel equals QuantizeRow bit for bit (same rule, NaN -> zp)
  const QuantizeF32Kernel vec = SelectQuantizeF32Kernel(c.path);
  const bool out_signed = c.DType(op.outputs[0]) == kI8;
  ParallelRanges(rows, /*chunk=*/std::max<int64_t>(1, 16384 / k), /*work=*/rows * k * 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float s = ts, z = tz;
      if (p.per_row) {
        float lo = 0.f, hi = 0.f;
        bool any = false;
        FiniteRange(x + r * k, k, &lo, &hi, &any);
        dynq::QParams(lo, hi, any, p, &s, &z);
      }
      if (vec != nullptr) {
        vec(x + r * k, k, 1.0f / s, static_cast<int32_t>(z), p.qmin, p.qmax, p.rounding, y + r * k, out_signed);
      } else {
        dynq::QuantizeRow(x + r * k, k, s, z, p, y + r * k);
      }
      qp[2 * r] = s;
      qp[2 * r + 1] = z;
    }
  });
  return Status::Ok();
}

Status PrepareLinearDynamic(Graph* g, GraphOp& op, int index, std::vector<int64_t>* shape) {
  const GraphTensor& x = g->tensors[op.inputs[0]];
  const GraphTensor& qp = g->tensors[op.inputs[1]];
  const GraphTensor& w = g->tensors[op.inputs[2]];
  const GraphTensor& out = g->tensors[op.outputs[0]];
  const auto& A = op.attrs;
  OP_CHECK(IsInt8(x.dtype) && x.dims.size() >= 2, "input must be I8/U8 of rank >= 2");
  std::vector<int64_t> want(x.dims.begin(), x.dims.end() - 1);
  want.push_back(2);
  OP_CHECK(!qp.is_constant && qp.dtype == kF32 && qp.dims == want, "qparams '%s' must be an F32 activation [rows.., 2]",
           qp.name.c_str());
  OP_CHECK(w.is_constant && (w.dtype == kI8 || w.dtype == kI4 || w.dtype == kI2) && w.dims.size() == 2,
           "weight must be a constant I8/I4/I2 matrix");
  const int64_t cout = w.dims[0], k = w.dims[1];
  OP_CHECK(k == x.dims.back(), "weight expects %lld input features, input has %lld", (long long)k,
           (long long)x.dims.back());
  OP_CHECK(k <= kMaxK, "%lld input features exceed %lld", (long long)k, (long long)kMaxK);
  OP_CHECK(out.dtype == kF32, "output must be F32");
  const auto& ws = A.at("w_scale").ints;
  const auto& bs = A.at("bias").ints;
  OP_CHECK(static_cast<int64_t>(ws.size()) == cout, "w_scale must have %lld values", (long long)cout);
  OP_CHECK(bs.empty() || static_cast<int64_t>(bs.size()) == cout, "bias must have 0 or %lld values", (long long)cout);
  OP_CHECK(A.at("relu").i == 0 || A.at("relu").i == 1, "relu must be 0 or 1");
  auto p = std::make_shared<LinearDynamicParams>();
  p->cout = cout;
  p->k = k;
  p->relu = A.at("relu").i == 1;
  for (int64_t b : ws) {
    OP_CHECK(b >= std::numeric_limits<int32_t>::min() && b <= std::numeric_limits<int32_t>::max(), "w_scale bits out of range");
    const float f = BitsF32(b);
    OP_CHECK(std::isfinite(f) && f > 0.f, "w_scale must hold finite positive binary32 values");
    p->w_scale.push_back(f);
  }
  for (int64_t b : bs) {
    OP_CHECK(b >= std::numeric_limits<int32_t>::min() && b <= std::numeric_limits<int32_t>::max(), "bias bits out of range");
    const float f = BitsF32(b);
    OP_CHECK(std::isfinite(f), "bias must hold finite binary32 values");
    p->bias.push_back(f);
  }
  // the codes' proven range (QUANTIZE_DYNAMIC's qmax): below 255 the AVX2 path can use the
  // exact vpmaddubsw kernel (e.g. 7-bit codes, torch.ao's reduce_range)
  p->max_code = static_cast<int32_t>(x.value_max + (x.dtype == kI8 ? 128 : 0));
  std::vector<int16_t> w16(w.values.begin(), w.values.end());
  p->colsum.assign(static_cast<size_t>(cout), 0);
  for (int64_t o = 0; o < cout; ++o)
    for (int64_t i = 0; i < k; ++i) p->colsum[o] += w16[o * k + i];
  QDSL_RETURN_IF_ERROR(PackWeights(w16.data(), cout, k, k, &p->packed));
  *shape = std::vector<int64_t>(x.dims.begin(), x.dims.end() - 1);
  shape->push_back(cout);
  op.prepared = std::move(p);
  return Status::Ok();
}

Status RunLinearDynamic(RunCtx& c, const GraphOp& op) {
  const LinearDynamicParams& p = ParamsOf<LinearDynamicParams>(op);
  const uint32_t xi = op.inputs[0];
  const int64_t rows = Numel(c.Shape(xi)) / p.k;
  // the codes times the weights with no zero point (a per-row zero point is one scalar per
  // row: its product with the weight's column sum is subtracted below, in int64)
  ActView av;
  av.data = c.Buf(xi);
  av.dtype = c.DType(xi) == kI8 ? DType::kInt8 : DType::kUInt8;
  av.rows = rows;
  av.cols = av.ld = p.k;
  av.zero_point = 0;
  av.max_code = p.max_code;
  std::vector<int32_t>& acc = p.acc;
  acc.resize(static_cast<size_t>(rows * p.cout));
  GemmOutput o;
  o.data = acc.data();
  o.dtype = DType::kInt32;
  o.ld = p.cout;
  QDSL_RETURN_IF_ERROR(Gemm(av, p.packed, nullptr, o, c.path));
  const float* qp = reinterpret_cast<const float*>(c.Buf(op.inputs[1]));
  float* y = reinterpret_cast<float*>(c.Buf(op.outputs[0]));
  const bool has_bias = !p.bias.empty();
  ParallelRanges(rows, /*chunk=*/std::max<int64_t>(1, 16384 / p.cout), /*work=*/rows * p.cout * 4,
                 [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float sx = qp[2 * r];
      // acc - zp * colsum in wrapping 32-bit arithmetic: the true sum fits int32 (K <= 65536),
      // so the result modulo 2^32 is it; straight loops, so the compiler vectorizes them
      const uint32_t zp = static_cast<uint32_t>(static_cast<int32_t>(qp[2 * r + 1]));
      const int32_t* a = acc.data() + r * p.cout;
      const int32_t* cs = p.colsum.data();
      const float* ws = p.w_scale.data();
      float* yr = y + r * p.cout;
      for (int64_t ch = 0; ch < p.cout; ++ch) {
        const int32_t exact = static_cast<int32_t>(static_cast<uint32_t>(a[ch]) - zp * static_cast<uint32_t>(cs[ch]));
        const float m = sx * ws[ch];
        yr[ch] = static_cast<float>(exact) * m;
      }
      if (has_bias) {
        const float* b = p.bias.data();
        for (int64_t ch = 0; ch < p.cout; ++ch) yr[ch] = yr[ch] + b[ch];
      }
      if (p.relu)  // np.maximum(v, 0): NaN kept, -0 -> +0
        for (int64_t ch = 0; ch < p.cout; ++ch) yr[ch] = yr[ch] <= 0.f ? 0.f : yr[ch];
    }
  });
  return Status::Ok();
}

// The op table's entries (op_schema.h names them by opcode).
const OpDef kQuantizeDynamicDef = {PrepareQuantizeDynamic, RunQuantizeDynamic, ValueRange::kQuantize};
const OpDef kLinearDynamicDef = {PrepareLinearDynamic, RunLinearDynamic, ValueRange::kStage};  // F32 output

}  // namespace qdsl
