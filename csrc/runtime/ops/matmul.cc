// MATMUL: y = clamp(rescale(Σ_k (a[.., m, k] - zp_a)(b[.., k, n] - zp_b)) + out_zp, out_min, out_max)
// on the operands viewed through a_perm / b_perm, the result permuted by out_perm
// (docs/qgraph.md §4.4).  Differences are in [-255, 255] and K <= 33025, so the int32 sum is
// exact.  The permutations are strides: each operand's row-major strides (batch filled in at
// run time) read through its permutation, a broadcast leading dimension stride 0.  Each
// (batch, leading..., m) row of a is gathered once as int32 differences, each (batch,
// leading...) matrix of b once, transposed (N rows of K), so the inner loop is a dot product
// of two contiguous int32 rows.
#include <algorithm>

#include "runtime/ops/op.h"
#include "threads/thread_pool.h"

namespace qdsl {
namespace {

struct MatmulParams : OpParams {
  int32_t zp[2] = {0, 0};
  std::vector<int64_t> perm[3];  // a_perm, b_perm, out_perm
  StageData out;
};

std::vector<int64_t> RowMajorStrides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> s(shape.size(), 1);
  for (size_t d = shape.size(); d-- > 1;) s[d - 1] = s[d] * shape[d];
  return s;
}

bool IsBatchFirstPerm(const std::vector<int64_t>& p, size_t rank) {
  if (p.size() != rank || p.empty() || p[0] != 0) return false;
  std::vector<int64_t> q(p);
  std::sort(q.begin(), q.end());
  for (size_t i = 0; i < q.size(); ++i)
    if (q[i] != static_cast<int64_t>(i)) return false;
  return true;
}

}  // namespace

Status PrepareMatmul(Graph* g, GraphOp& op, int index, std::vector<int64_t>* shape) {
  const GraphTensor& x0 = g->tensors[op.inputs[0]];
  const GraphTensor& x1 = g->tensors[op.inputs[1]];
  const GraphTensor& out = g->tensors[op.outputs[0]];
  OP_CHECK(!x0.is_constant && !x1.is_constant && IsInt8(x0.dtype) && IsInt8(x1.dtype),
           "MATMUL inputs must be I8/U8 activations");
  OP_CHECK(IsInt8(out.dtype), "MATMUL output must be I8/U8");
  auto p = std::make_shared<MatmulParams>();
  const std::vector<int64_t>& zp = op.attrs.at("in_zp").ints;
  OP_CHECK(zp.size() == 2, "attribute 'in_zp' needs 2 entries, got %zu", zp.size());
  for (int k = 0; k < 2; ++k) {
    int64_t lo, hi;
    DTypeRange(k == 0 ? x0.dtype : x1.dtype, &lo, &hi);
    OP_CHECK(zp[k] >= lo && zp[k] <= hi, "in_zp %lld outside the dtype of input %d", (long long)zp[k], k);
    p->zp[k] = static_cast<int32_t>(zp[k]);
  }
  const char* names[3] = {"a_perm", "b_perm", "out_perm"};
  for (int k = 0; k < 3; ++k) p->perm[k] = op.attrs.at(names[k]).ints;
  const std::vector<int64_t>& a = x0.dims;
  const std::vector<int64_t>& b = x1.dims;
  OP_CHECK(a.size() == b.size() && a.size() >= 3, "MATMUL operands need the same rank >= 3");
  const size_t rank = a.size();
  for (int k = 0; k < 3; ++k)
    OP_CHECK(IsBatchFirstPerm(p->perm[k], rank), "attribute '%s' must permute the %zu dims, batch first", names[k],
             rank);
  std::vector<int64_t> pa(rank), pb(rank), r(rank);
  for (size_t d = 0; d < rank; ++d) {
    pa[d] = a[p->perm[0][d]];
    pb[d] = b[p->perm[1][d]];
  }
  OP_CHECK(pa[rank - 1] == pb[rank - 2], "MATMUL inner dims differ (%lld, %lld)", (long long)pa[rank - 1],
           (long long)pb[rank - 2]);
  OP_CHECK(pa[rank - 1] <= (int64_t{INT32_MAX}) / (255 * 255), "MATMUL reduction length exceeds the int32 bound");
  r[0] = a[0];
  for (size_t d = 1; d + 2 < rank; ++d) {
    OP_CHECK(pa[d] == pb[d] || pa[d] == 1 || pb[d] == 1, "MATMUL leading dim %zu does not broadcast", d);
    r[d] = std::max(pa[d], pb[d]);
  }
  r[rank - 2] = pa[rank - 2];
  r[rank - 1] = pb[rank - 1];
  shape->resize(rank);
  for (size_t d = 0; d < rank; ++d) (*shape)[d] = r[p->perm[2][d]];
  QDSL_RETURN_IF_ERROR(ReadStage(op, index, 1, out.dtype, &p->out));
  OP_CHECK(p->out.multiplier.size() == 1, "MATMUL rescales are per tensor");
  op.prepared = std::move(p);
  return Status::Ok();
}

Status RunMatmul(RunCtx& c, const GraphOp& op) {
  const MatmulParams& p = ParamsOf<MatmulParams>(op);
  const std::vector<int64_t> sa = c.Shape(op.inputs[0]), sb = c.Shape(op.inputs[1]), sy = c.Shape(op.outputs[0]);
  const size_t rank = sa.size();
  const std::vector<int64_t> ta = RowMajorStrides(sa), tb = RowMajorStrides(sb), ty = RowMajorStrides(sy);
  // view shapes and strides: a (B, ..., M, K), b (B, ..., K, N), result (B, ..., M, N)
  std::vector<int64_t> va(rank), vb(rank), sta(rank), stb(rank), str(rank), rs(rank);
  for (size_t d = 0; d < rank; ++d) {
    va[d] = sa[p.perm[0][d]];
    sta[d] = ta[p.perm[0][d]];
    vb[d] = sb[p.perm[1][d]];
    stb[d] = tb[p.perm[1][d]];
    str[p.perm[2][d]] = ty[d];  // result dim perm[2][d] is output dim d
  }
  for (size_t d = 0; d + 2 < rank; ++d) {
    rs[d] = std::max(va[d], vb[d]);
    if (va[d] == 1 && rs[d] != 1) sta[d] = 0;
    if (vb[d] == 1 && rs[d] != 1) stb[d] = 0;
  }
  const int64_t M = va[rank - 2], K = va[rank - 1], N = vb[rank - 1];
  int64_t outer = 1;
  for (size_t d = 0; d + 2 < rank; ++d) outer *= rs[d];
  const uint8_t* xa = c.Buf(op.inputs[0]);
  const uint8_t* xb = c.Buf(op.inputs[1]);
  const int da = c.DType(op.inputs[0]), db = c.DType(op.inputs[1]);
  uint8_t* y = c.Buf(op.outputs[0]);
  const OutputStage& st = p.out.stage;
  ParallelFor(static_cast<int>(outer), [&](int o) {
    // offsets of this (batch, leading...) index in a, b and y
    int64_t rest = o, oa = 0, ob = 0, oy = 0;
    for (size_t d = rank - 2; d-- > 0;) {
      const int64_t i = rest % rs[d];
      rest /= rs[d];
      oa += i * sta[d];
      ob += i * stb[d];
      oy += i * str[d];
    }
    std::vector<int32_t> bt(static_cast<size_t>(N * K)), row(static_cast<size_t>(K));
    for (int64_t k = 0; k < K; ++k)
      for (int64_t n = 0; n < N; ++n)
        bt[n * K + k] = LoadValue(xb, db, ob + k * stb[rank - 2] + n * stb[rank - 1]) - p.zp[1];
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t k = 0; k < K; ++k)
        row[k] = LoadValue(xa, da, oa + m * sta[rank - 2] + k * sta[rank - 1]) - p.zp[0];
      for (int64_t n = 0; n < N; ++n) {
        const int32_t* col = bt.data() + n * K;
        int32_t acc = 0;
        for (int64_t k = 0; k < K; ++k) acc += row[k] * col[k];
        y[oy + m * str[rank - 2] + n * str[rank - 1]] = static_cast<uint8_t>(ApplyStage(acc, st, 0));
      }
    }
  }, /*work=*/outer * M * N * K);
  return Status::Ok();
}

// The op table's entry (op_schema.h names it by opcode).
const OpDef kMatmulDef = {PrepareMatmul, RunMatmul, ValueRange::kStage};

}  // namespace qdsl
