// LSTM_DYNAMIC (37) and GRU_DYNAMIC (40): one LSTM/GRU layer and direction with dynamic int8 input and hidden state
// and float gates (docs/qgraph.md §4.4); the reference is qdsl/graph/ops/recurrent_dynamic.py
// and this file equals it bit for bit.
//
// Float order: every float step is one binary32 operation in the order the reference
// writes it; no fused multiply-add (the pragma below, as dynamic.cc).  The dynamic
// quantization of the input and of each step's hidden state is QUANTIZE_DYNAMIC's per-tensor
// rule (dynamic.cc); exp is ExpF32, the reference's exp_f32 step for step.  The hidden
// state's scale is one per step over the whole batch, so the samples are not independent:
// the op runs on one thread.  The optimized paths compute the same integer sums with the
// GEMM front door (all steps' input products at once, then the batch's hidden products per
// step); the reference path keeps the scalar rows.
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "dispatch.h"
#include "qdsl/gemm.h"
#include "runtime/ops/dynamic_quant.h"
#include "runtime/ops/op.h"

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace qdsl {
namespace {

using DynQ = dynq::Rule;
using dynq::BitsF32;

struct LstmDynamicParams : OpParams {
  bool reverse = false;
  int64_t f = 0, h = 0, rows = 0;
  DynQ in, hq;
  std::vector<int32_t> w_ih, w_hh;
  std::vector<float> ws_ih, ws_hh, b_ih, b_hh;
  bool has_x2 = false, gru = false;  // GRU_DYNAMIC (40): gates r, z, n, no cell
  int n_states = 0;
  PackedWeights packed_ih, packed_hh;  // the optimized paths' GEMM operands
};

// QUANTIZE_DYNAMIC per tensor (dynamic_quant.h: the op's own rule) into int32 codes.
void QuantizeDyn(const float* x, int64_t n, const DynQ& p, int32_t* q, float* scale, float* zpf) {
  float lo = 0.f, hi = 0.f;
  bool any = false;
  dynq::FiniteRange(x, n, &lo, &hi, &any);
  dynq::QParams(lo, hi, any, p, scale, zpf);
  dynq::QuantizeRow(x, n, *scale, *zpf, p, q);
}

// exp_f32 of the reference: clamp, k = rint(x/ln2), r = (x - k·hi) - k·lo, Horner, ·2^k.
float ExpF32(float x) {
  // decimal -> binary64 -> binary32, as the reference's np.float32(<Python float>)
  constexpr float kLimit = 87.0f, kInvLn2 = static_cast<float>(1.44269504), kLn2Hi = 0.693359375f,
                  kLn2Lo = static_cast<float>(-2.12194440e-4);
  static const float kPoly[7] = {static_cast<float>(1.0 / 720), static_cast<float>(1.0 / 120),
                                 static_cast<float>(1.0 / 24), static_cast<float>(1.0 / 6), 0.5f, 1.0f, 1.0f};
  x = x < -kLimit ? -kLimit : (x > kLimit ? kLimit : x);
  const float k = std::nearbyint(x * kInvLn2);
  const float r = (x - k * kLn2Hi) - k * kLn2Lo;
  float p = kPoly[0];
  for (int i = 1; i < 7; ++i) p = p * r + kPoly[i];
  return std::ldexp(p, static_cast<int>(k));
}
inline float Sigmoid(float v) { return 1.0f / (1.0f + ExpF32(-v)); }
inline float TanhF(float v) { return 2.0f * Sigmoid(2.0f * v) - 1.0f; }

Status ReadDynQ(const GraphOp& op, int index, const char* prefix, DynQ* q) {
  const std::string p(prefix);
  const int64_t mn = op.attrs.at(p + "_qmin").i, mx = op.attrs.at(p + "_qmax").i;
  const int64_t sym = op.attrs.at(p + "_symmetric").i, rnd = op.attrs.at(p + "_rounding").i;
  OP_CHECK(mn >= -128 && mx <= 255 && mn < mx && mx > 0 && (mn >= 0 || mx <= 127), "%s_qmin/%s_qmax not an 8-bit range",
           prefix, prefix);
  OP_CHECK((sym == 0 || sym == 1) && rnd >= 0 && rnd <= 3, "%s_symmetric/%s_rounding out of range", prefix, prefix);
  q->qmin = static_cast<int32_t>(mn);
  q->qmax = static_cast<int32_t>(mx);
  q->symmetric = sym == 1;
  q->rounding = static_cast<int>(rnd);
  return Status::Ok();
}

Status ReadFloats(const GraphOp& op, int index, const char* name, int64_t n, bool positive, bool optional,
                  std::vector<float>* out) {
  const auto& v = op.attrs.at(name).ints;
  OP_CHECK(static_cast<int64_t>(v.size()) == n || (optional && v.empty()), "'%s' must have %lld values", name,
           (long long)n);
  for (int64_t b : v) {
    OP_CHECK(b >= std::numeric_limits<int32_t>::min() && b <= std::numeric_limits<int32_t>::max(), "'%s' bits out of range",
             name);
    const float f = BitsF32(b);
    OP_CHECK(std::isfinite(f) && (!positive || f > 0.f), "'%s' must hold finite%s binary32 values", name,
             positive ? " positive" : "");
    out->push_back(f);
  }
  return Status::Ok();
}

Status PrepareRecurrentDynamic(Graph* g, GraphOp& op, int index, std::vector<int64_t>* shape, bool gru) {
  const int gates = gru ? 3 : 4;
  const GraphTensor& x = g->tensors[op.inputs[0]];
  const GraphTensor& w_ih = g->tensors[op.inputs[1]];
  const GraphTensor& w_hh = g->tensors[op.inputs[2]];
  OP_CHECK(x.dtype == kF32 && x.dims.size() == 3, "input must be F32 [N, T, F]");
  int64_t feats = x.dims[2];
  // after the weights: x2 (rank 3, optional), then h0 and c0 (rank 2, optional)
  size_t next = 3;
  if (op.inputs.size() > 3 && g->tensors[op.inputs[3]].dims.size() == 3) {
    const GraphTensor& x2 = g->tensors[op.inputs[3]];
    next = 4;
    OP_CHECK(!x2.is_constant && x2.dtype == kF32 && x2.dims.size() == 3 && x2.dims[0] == x.dims[0] &&
                 x2.dims[1] == x.dims[1],
             "second input part must be an F32 activation [N, T, F2]");
    feats += x2.dims[2];
  }
  OP_CHECK(w_ih.is_constant && w_hh.is_constant && w_ih.dtype == kI8 && w_hh.dtype == kI8 && w_ih.dims.size() == 2 &&
               w_hh.dims.size() == 2,
           "weights must be constant I8 matrices");
  auto p = std::make_shared<LstmDynamicParams>();
  p->gru = gru;
  p->h = w_hh.dims[1];
  p->rows = w_hh.dims[0];
  p->f = feats;
  OP_CHECK(p->rows == gates * p->h && w_ih.dims[0] == p->rows && w_ih.dims[1] == feats,
           "weights must be [%dH, F], [%dH, H]", gates, gates);
  OP_CHECK(feats <= 65536 && p->h <= 65536, "F and H must be <= 65536");
  OP_CHECK(op.attrs.at("reverse").i == 0 || op.attrs.at("reverse").i == 1, "reverse must be 0 or 1");
  p->reverse = op.attrs.at("reverse").i == 1;
  QDSL_RETURN_IF_ERROR(ReadDynQ(op, index, "in", &p->in));
  QDSL_RETURN_IF_ERROR(ReadDynQ(op, index, "h", &p->hq));
  QDSL_RETURN_IF_ERROR(ReadFloats(op, index, "w_ih_scale", p->rows, true, false, &p->ws_ih));
  QDSL_RETURN_IF_ERROR(ReadFloats(op, index, "w_hh_scale", p->rows, true, false, &p->ws_hh));
  QDSL_RETURN_IF_ERROR(ReadFloats(op, index, "b_ih", p->rows, false, true, &p->b_ih));
  QDSL_RETURN_IF_ERROR(ReadFloats(op, index, "b_hh", p->rows, false, true, &p->b_hh));
  const std::vector<int64_t> state = {x.dims[0], p->h};
  for (int k = 0; k < (gru ? 2 : 3); ++k) {
    const GraphTensor& o = g->tensors[op.outputs[k]];
    OP_CHECK(o.dtype == kF32, "outputs must be F32");
    if (k > 0) OP_CHECK(o.dims == state, "h_n and c_n must be [N, H]");
  }
  p->has_x2 = next == 4;
  p->n_states = static_cast<int>(op.inputs.size() - next);
  OP_CHECK(p->n_states <= (gru ? 1 : 2), "too many initial states (LSTM: h0, c0; GRU: h0)");
  for (size_t k = next; k < op.inputs.size(); ++k) {
    const GraphTensor& s = g->tensors[op.inputs[k]];
    // N static when sliced from a module's (layers·directions, N, H) state input (SELECT)
    OP_CHECK(!s.is_constant && s.dtype == kF32 && s.dims.size() == 2 && s.dims[1] == p->h &&
                 (s.dims[0] == x.dims[0] || s.dims[0] == -1 || x.dims[0] == -1),
             "initial state '%s' must be an F32 activation [N, H]", s.name.c_str());
  }
  p->w_ih.assign(w_ih.values.begin(), w_ih.values.end());
  p->w_hh.assign(w_hh.values.begin(), w_hh.values.end());
  {
    const std::vector<int16_t> wi(w_ih.values.begin(), w_ih.values.end()), wh(w_hh.values.begin(), w_hh.values.end());
    QDSL_RETURN_IF_ERROR(PackWeights(wi.data(), p->rows, p->f, p->f, &p->packed_ih));
    QDSL_RETURN_IF_ERROR(PackWeights(wh.data(), p->rows, p->h, p->h, &p->packed_hh));
  }
  shape->back() = p->h;
  op.prepared = std::move(p);
  return Status::Ok();
}

// y[r] = f32(Σ (q - zp)·w[r]) · f32(s · ws[r]) (+ b[r]) for r < rows
void LinearRow(const int32_t* q, int64_t k, float s, float zpf, const std::vector<int32_t>& w,
               const std::vector<float>& ws, const std::vector<float>& b, int64_t rows, float* y) {
  const int64_t zp = static_cast<int64_t>(zpf);
  for (int64_t r = 0; r < rows; ++r) {
    int64_t acc = 0;
    const int32_t* wr = w.data() + r * k;
    for (int64_t i = 0; i < k; ++i) acc += (q[i] - zp) * wr[i];
    const float m = s * ws[r];
    float v = static_cast<float>(acc) * m;
    if (!b.empty()) v = v + b[r];
    y[r] = v;
  }
}

// LinearRow over m rows of codes q [m][k] at once, through the GEMM front door (the
// optimized paths): the same exact integer sums (|Σ| < 2^31 for k <= 65536), then the same
// binary32 steps.  Codes go to the kernels as their 8-bit container (int8 when qmin < 0).
Status LinearRows(uint32_t path, const int32_t* q, int64_t m, int64_t k, float s, float zpf, const DynQ& dq,
                  const PackedWeights& pw, const std::vector<float>& ws, const std::vector<float>& b, int64_t rows,
                  std::vector<uint8_t>* codes, std::vector<int32_t>* acc, float* y) {
  codes->resize(static_cast<size_t>(m * k));
  for (int64_t i = 0; i < m * k; ++i) (*codes)[i] = static_cast<uint8_t>(static_cast<int8_t>(q[i]));
  acc->resize(static_cast<size_t>(m * rows));
  ActView av;
  av.data = codes->data();
  av.dtype = dq.qmin < 0 ? DType::kInt8 : DType::kUInt8;
  av.rows = m;
  av.cols = av.ld = k;
  av.zero_point = static_cast<int32_t>(zpf);
  GemmOutput o;
  o.data = acc->data();
  o.dtype = DType::kInt32;
  o.ld = rows;
  QDSL_RETURN_IF_ERROR(Gemm(av, pw, nullptr, o, path));
  for (int64_t i = 0; i < m; ++i) {
    const int32_t* a = acc->data() + i * rows;
    float* yr = y + i * rows;
    for (int64_t r = 0; r < rows; ++r) {
      const float mult = s * ws[r];
      float v = static_cast<float>(a[r]) * mult;
      if (!b.empty()) v = v + b[r];
      yr[r] = v;
    }
  }
  return Status::Ok();
}

Status RunLstmDynamic(RunCtx& c, const GraphOp& op) {
  const LstmDynamicParams& p = ParamsOf<LstmDynamicParams>(op);
  const std::vector<int64_t> xs = c.Shape(op.inputs[0]);
  const int64_t n = xs[0], steps = xs[1], f1 = xs[2], F = p.f, H = p.h, R = p.rows;
  const float* x1 = reinterpret_cast<const float*>(c.Buf(op.inputs[0]));
  const float* x2 = p.has_x2 ? reinterpret_cast<const float*>(c.Buf(op.inputs[3])) : nullptr;
  const size_t first_state = p.has_x2 ? 4 : 3;
  // x‖x2, quantized per tensor
  std::vector<float> x(static_cast<size_t>(n * steps * F));
  for (int64_t i = 0; i < n * steps; ++i) {
    std::memcpy(x.data() + i * F, x1 + i * f1, static_cast<size_t>(f1) * 4);
    if (x2 != nullptr) std::memcpy(x.data() + i * F + f1, x2 + i * (F - f1), static_cast<size_t>(F - f1) * 4);
  }
  std::vector<int32_t> qx(x.size());
  float sx, zx;
  QuantizeDyn(x.data(), static_cast<int64_t>(x.size()), p.in, qx.data(), &sx, &zx);
  std::vector<float> aih(static_cast<size_t>(n * steps * R));
  const bool fast = c.path != kPathRef;
  std::vector<uint8_t> codes;
  std::vector<int32_t> acc;
  if (fast) {
    QDSL_RETURN_IF_ERROR(LinearRows(c.path, qx.data(), n * steps, F, sx, zx, p.in, p.packed_ih, p.ws_ih, p.b_ih, R,
                                    &codes, &acc, aih.data()));
  } else {
    for (int64_t i = 0; i < n * steps; ++i)
      LinearRow(qx.data() + i * F, F, sx, zx, p.w_ih, p.ws_ih, p.b_ih, R, aih.data() + i * R);
  }
  std::vector<float> ahh(fast ? static_cast<size_t>(n * R) : 0);
  std::vector<float> h(static_cast<size_t>(n * H), 0.f), cs(static_cast<size_t>(n * H), 0.f), hf(h.size());
  QDSL_CHECK_ARG(p.n_states == 0 || c.Shape(op.inputs[first_state])[0] == n, "initial state batch differs from the input's");
  if (p.n_states > 0) std::memcpy(h.data(), c.Buf(op.inputs[first_state]), h.size() * 4);
  if (p.n_states > 1) std::memcpy(cs.data(), c.Buf(op.inputs[first_state + 1]), cs.size() * 4);
  std::vector<int32_t> qh(h.size());
  std::vector<float> pre(static_cast<size_t>(R));
  float sh, zh;
  QuantizeDyn(h.data(), n * H, p.hq, qh.data(), &sh, &zh);
  float* y = reinterpret_cast<float*>(c.Buf(op.outputs[0]));
  if (p.gru) {  // h: the dequantized codes of Q(h0) (the reference's start)
    const int64_t z = static_cast<int64_t>(zh);
    for (int64_t i = 0; i < n * H; ++i) h[i] = static_cast<float>(qh[i] - z) * sh;
  }
  for (int64_t k = 0; k < steps; ++k) {
    const int64_t t = p.reverse ? steps - 1 - k : k;
    if (fast)
      QDSL_RETURN_IF_ERROR(LinearRows(c.path, qh.data(), n, H, sh, zh, p.hq, p.packed_hh, p.ws_hh, p.b_hh, R, &codes,
                                      &acc, ahh.data()));
    for (int64_t s = 0; s < n; ++s) {
      if (fast) {
        std::memcpy(pre.data(), ahh.data() + s * R, static_cast<size_t>(R) * 4);
      } else {
        LinearRow(qh.data() + s * H, H, sh, zh, p.w_hh, p.ws_hh, p.b_hh, R, pre.data());
      }
      const float* a = aih.data() + (s * steps + t) * R;
      if (p.gru) {  // r, z, n: n = tanh(a_n + σ(r)·hh_n), h' = (1 - σ(z))·n + σ(z)·h
        for (int64_t j = 0; j < H; ++j) {
          const float r = Sigmoid(a[j] + pre[j]);
          const float z = Sigmoid(a[H + j] + pre[H + j]);
          const float nn = TanhF(a[2 * H + j] + r * pre[2 * H + j]);
          hf[s * H + j] = (1.0f - z) * nn + z * h[s * H + j];
        }
        continue;
      }
      for (int64_t r = 0; r < R; ++r) pre[r] = a[r] + pre[r];
      for (int64_t j = 0; j < H; ++j) {
        float& cj = cs[s * H + j];
        cj = Sigmoid(pre[H + j]) * cj + Sigmoid(pre[j]) * TanhF(pre[2 * H + j]);
        hf[s * H + j] = Sigmoid(pre[3 * H + j]) * TanhF(cj);
      }
    }
    QuantizeDyn(hf.data(), n * H, p.hq, qh.data(), &sh, &zh);
    const int64_t z = static_cast<int64_t>(zh);
    for (int64_t s = 0; s < n; ++s)
      for (int64_t j = 0; j < H; ++j) {
        h[s * H + j] = static_cast<float>(qh[s * H + j] - z) * sh;
        y[(s * steps + t) * H + j] = h[s * H + j];
      }
  }
  std::memcpy(c.Buf(op.outputs[1]), h.data(), h.size() * 4);
  if (!p.gru) std::memcpy(c.Buf(op.outputs[2]), cs.data(), cs.size() * 4);
  return Status::Ok();
}

Status PrepareLstmDynamic(Graph* g, GraphOp& op, int index, std::vector<int64_t>* shape) {
  return PrepareRecurrentDynamic(g, op, index, shape, false);
}
Status PrepareGruDynamic(Graph* g, GraphOp& op, int index, std::vector<int64_t>* shape) {
  return PrepareRecurrentDynamic(g, op, index, shape, true);
}

}  // namespace

const OpDef kLstmDynamicDef = {PrepareLstmDynamic, RunLstmDynamic, ValueRange::kStage};  // F32 outputs
const OpDef kGruDynamicDef = {PrepareGruDynamic, RunLstmDynamic, ValueRange::kStage};

}  // namespace qdsl
