// LAYERNORM over the last axis of an I8/U8 input, integer only (docs/qgraph.md §4.4): per
// row of N codes,
//   D_i = N·x_i - Σ x,  W = Σ D_i² + eps,  G = (62 - bitlen(W)) / 2,  R = isqrt(W · 4^G),
//   Z_i = round_half_away(D_i · 2^(G+16) / R) (0 when R = 0),  acc_i = Z_i·gamma_i + beta_i,
//   y_i = clamp(rescale(acc_i) + out_zp, out_min, out_max).
// W < 2^62 (checked at prepare from N and eps); R < 2^31 and |D_i|·2^G <= R + 1, so the
// quotient's numerator stays below 2^49 and |Z_i| <= 2^16 + 1: acc fits int32.
#include <algorithm>
#include <cmath>

#include "runtime/ops/op.h"
#include "threads/thread_pool.h"

namespace qdsl {
namespace {

struct LayernormParams : OpParams {
  std::vector<int64_t> gamma, beta;
  int64_t eps = 0;
  StageData out;
};

int BitLength(uint64_t v) {
  int b = 0;
  while (v != 0) {
    ++b;
    v >>= 1;
  }
  return b;
}

// Exact floor(sqrt(v)) for 0 <= v <= 2^62: the double estimate, stepped to r² <= v < (r+1)².
int64_t ISqrt(int64_t v) {
  int64_t r = static_cast<int64_t>(std::sqrt(static_cast<double>(v)));
  while (r > 0 && r * r > v) --r;
  while ((r + 1) * (r + 1) <= v) ++r;
  return r;
}

}  // namespace

Status PrepareLayernorm(Graph* g, GraphOp& op, int index, std::vector<int64_t>* shape) {
  const GraphTensor& x = g->tensors[op.inputs[0]];
  const GraphTensor& out = g->tensors[op.outputs[0]];
  OP_CHECK(IsInt8(x.dtype) && IsInt8(out.dtype), "LAYERNORM input and output must be I8/U8");
  OP_CHECK(shape->size() >= 2 && shape->back() >= 1, "LAYERNORM needs a normalized axis");
  const int64_t n = shape->back();
  auto p = std::make_shared<LayernormParams>();
  p->gamma = op.attrs.at("gamma").ints;
  p->beta = op.attrs.at("beta").ints;
  p->eps = op.attrs.at("eps").i;
  OP_CHECK(static_cast<int64_t>(p->gamma.size()) == n && static_cast<int64_t>(p->beta.size()) == n,
           "gamma/beta need %lld entries", (long long)n);
  for (int64_t i = 0; i < n; ++i) {
    OP_CHECK(std::abs(p->gamma[i]) <= (1 << 14) - 1, "gamma entry %lld outside 14 bits", (long long)i);
    OP_CHECK(std::abs(p->beta[i]) <= (int64_t{1} << 30), "beta entry %lld outside [-2^30, 2^30]", (long long)i);
  }
  OP_CHECK(p->eps >= 0 && n <= 40000 && n * n * n * 65025 + p->eps < (int64_t{1} << 62) && n * n * n * 65025 > 0,
           "row length %lld with eps %lld overflows the int64 variance sum", (long long)n, (long long)p->eps);
  QDSL_RETURN_IF_ERROR(ReadStage(op, index, 1, out.dtype, &p->out));
  OP_CHECK(p->out.multiplier.size() == 1, "LAYERNORM rescales are per tensor");
  op.prepared = std::move(p);
  return Status::Ok();
}

Status RunLayernorm(RunCtx& c, const GraphOp& op) {
  const LayernormParams& p = ParamsOf<LayernormParams>(op);
  const std::vector<int64_t> xs = c.Shape(op.inputs[0]);
  const int64_t n = xs.back(), rows = Numel(xs) / std::max<int64_t>(n, 1);
  const uint8_t* x = c.Buf(op.inputs[0]);
  const int dt = c.DType(op.inputs[0]);
  uint8_t* y = c.Buf(op.outputs[0]);
  const OutputStage& st = p.out.stage;
  ParallelRanges(rows, /*chunk=*/16, /*work=*/rows * n * 16, [&](int64_t r0, int64_t r1) {
    std::vector<int64_t> d(static_cast<size_t>(n));
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t o = r * n;
      int64_t sum = 0;
      for (int64_t i = 0; i < n; ++i) sum += LoadValue(x, dt, o + i);
      int64_t w = p.eps;
      for (int64_t i = 0; i < n; ++i) {
        d[i] = n * LoadValue(x, dt, o + i) - sum;
        w += d[i] * d[i];
      }
      const int gs = (62 - BitLength(static_cast<uint64_t>(w))) / 2;
      const int64_t root = ISqrt(w << (2 * gs));
      for (int64_t i = 0; i < n; ++i) {
        int64_t z = 0;
        if (root != 0) {
          const int64_t num = (d[i] < 0 ? -d[i] : d[i]) << (gs + 16);
          z = (2 * num + root) / (2 * root);
          if (d[i] < 0) z = -z;
        }
        y[o + i] = static_cast<uint8_t>(ApplyStage(z * p.gamma[i] + p.beta[i], st, 0));
      }
    }
  });
  return Status::Ok();
}

// The op table's entry (op_schema.h names it by opcode).
const OpDef kLayernormDef = {PrepareLayernorm, RunLayernorm, ValueRange::kStage};

}  // namespace qdsl
