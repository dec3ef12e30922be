// MATMUL: y = clamp(rescale(Σ_k (a[.., m, k] - zp_a)(b[.., k, n] - zp_b)) + out_zp, out_min, out_max)
// on the operands viewed through a_perm / b_perm, the result permuted by out_perm
// (docs/qgraph.md §4.4).  Differences are in [-255, 255] and K <= 33025, so the int32 sum is
// exact.  The permutations are strides: each operand's row-major strides (batch filled in at
// run time) read through its permutation, a broadcast leading dimension stride 0.
//
// Reference path (RunMatmulRef): each (batch, leading..., m) row of a is gathered once as
// int32 differences, each (batch, leading...) matrix of b once, transposed (N rows of K), so
// the inner loop is a dot product of two contiguous int32 rows.
// Optimized paths (RunMatmulFast): per (batch, leading...) matrix, b - zp_b is packed into
// the int16 16-column panels of the GEMM micro-kernels (PanelFormat::kI16, the layout of
// csrc/pack/pack_weights.cc; straight from b when its rows or columns are contiguous, as in
// attention) and a - zp_a into int16 rows, both K padded with zeros to a
// multiple of 4; the vpmaddwd kernel multiplies int16 pairs into int32 exactly (|diff| <= 255),
// so the sums equal the reference's.  The output stage then runs vectorized over each block
// of rows (RequantKernel), straight into y when the result's columns are contiguous there.
#include <algorithm>

#include "dispatch.h"
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

namespace {

// The run's views: a (B, ..., M, K), b (B, ..., K, N), result (B, ..., M, N), as strides of
// the three buffers (broadcast leading dims stride 0).
struct MatmulView {
  size_t rank = 0;
  std::vector<int64_t> rs, sta, stb, str;
  int64_t M = 0, K = 0, N = 0, outer = 1;
  // offsets of the (batch, leading...) matrix o in a, b and y
  void Offsets(int64_t o, int64_t* oa, int64_t* ob, int64_t* oy) const {
    *oa = *ob = *oy = 0;
    for (size_t d = rank - 2; d-- > 0;) {
      const int64_t i = o % rs[d];
      o /= rs[d];
      *oa += i * sta[d];
      *ob += i * stb[d];
      *oy += i * str[d];
    }
  }
};

MatmulView ViewOf(const RunCtx& c, const GraphOp& op, const MatmulParams& p) {
  const std::vector<int64_t> sa = c.Shape(op.inputs[0]), sb = c.Shape(op.inputs[1]), sy = c.Shape(op.outputs[0]);
  MatmulView v;
  const size_t rank = v.rank = sa.size();
  const std::vector<int64_t> ta = RowMajorStrides(sa), tb = RowMajorStrides(sb), ty = RowMajorStrides(sy);
  std::vector<int64_t> va(rank), vb(rank);
  v.sta.resize(rank);
  v.stb.resize(rank);
  v.str.resize(rank);
  v.rs.resize(rank);
  for (size_t d = 0; d < rank; ++d) {
    va[d] = sa[p.perm[0][d]];
    v.sta[d] = ta[p.perm[0][d]];
    vb[d] = sb[p.perm[1][d]];
    v.stb[d] = tb[p.perm[1][d]];
    v.str[p.perm[2][d]] = ty[d];  // result dim perm[2][d] is output dim d
  }
  for (size_t d = 0; d + 2 < rank; ++d) {
    v.rs[d] = std::max(va[d], vb[d]);
    if (va[d] == 1 && v.rs[d] != 1) v.sta[d] = 0;
    if (vb[d] == 1 && v.rs[d] != 1) v.stb[d] = 0;
    v.outer *= v.rs[d];
  }
  v.M = va[rank - 2];
  v.K = va[rank - 1];
  v.N = vb[rank - 1];
  return v;
}

Status RunMatmulRef(RunCtx& c, const GraphOp& op, const MatmulParams& p, const MatmulView& v) {
  const size_t rank = v.rank;
  const int64_t M = v.M, K = v.K, N = v.N;
  const uint8_t* xa = c.Buf(op.inputs[0]);
  const uint8_t* xb = c.Buf(op.inputs[1]);
  const int da = c.DType(op.inputs[0]), db = c.DType(op.inputs[1]);
  uint8_t* y = c.Buf(op.outputs[0]);
  const OutputStage& st = p.out.stage;
  ParallelFor(static_cast<int>(v.outer), [&](int o) {
    int64_t oa, ob, oy;
    v.Offsets(o, &oa, &ob, &oy);
    std::vector<int32_t> bt(static_cast<size_t>(N * K)), row(static_cast<size_t>(K));
    for (int64_t k = 0; k < K; ++k)
      for (int64_t n = 0; n < N; ++n)
        bt[n * K + k] = LoadValue(xb, db, ob + k * v.stb[rank - 2] + n * v.stb[rank - 1]) - p.zp[1];
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t k = 0; k < K; ++k)
        row[k] = LoadValue(xa, da, oa + m * v.sta[rank - 2] + k * v.sta[rank - 1]) - p.zp[0];
      for (int64_t n = 0; n < N; ++n) {
        const int32_t* col = bt.data() + n * K;
        int32_t acc = 0;
        for (int64_t k = 0; k < K; ++k) acc += row[k] * col[k];
        y[oy + m * v.str[rank - 2] + n * v.str[rank - 1]] = static_cast<uint8_t>(ApplyStage(acc, st, 0));
      }
    }
  }, /*work=*/v.outer * M * N * K);
  return Status::Ok();
}

// Element (r, i) of a strided 8-bit matrix minus zp, as int16 into dst[r][i] (row stride ld),
// for r < rows, i < cols; the unit-stride u8/s8 rows take a loop the compiler vectorizes.
void GatherI16(const uint8_t* x, int dtype, int64_t off, int64_t s_row, int64_t s_col, int64_t rows, int64_t cols,
               int32_t zp, int16_t* dst, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    int16_t* d = dst + r * ld;
    const uint8_t* src = x + off + r * s_row;
    if (s_col == 1 && dtype == kU8) {
      for (int64_t i = 0; i < cols; ++i) d[i] = static_cast<int16_t>(src[i] - zp);
    } else if (s_col == 1) {
      const int8_t* s8 = reinterpret_cast<const int8_t*>(src);
      for (int64_t i = 0; i < cols; ++i) d[i] = static_cast<int16_t>(s8[i] - zp);
    } else {
      for (int64_t i = 0; i < cols; ++i) d[i] = static_cast<int16_t>(LoadValue(src, dtype, i * s_col) - zp);
    }
  }
}

// b - zp_b straight into the int16 panels (layout in RunMatmulFast: k-pair j of panel q holds
// b(k = 2j + t, n = 16q + c) at slot 2c + t, zeros past K and N) when one of b's axes is
// contiguous: its rows (fixed k, n at unit stride: attention's v) are interleaved in pairs,
// or its columns (fixed n, k at unit stride: attention's k^T) give each slot pair two
// adjacent codes.
template <typename T>
void PackPanelsFromRows(const T* b, int64_t sbk, int64_t K, int64_t N, int64_t kpairs, int64_t panels, int32_t zp,
                        int16_t* out) {
  for (int64_t q = 0; q < panels; ++q) {
    const int64_t n0 = 16 * q, nc = std::min<int64_t>(16, N - n0);
    for (int64_t j = 0; j < kpairs; ++j) {
      int16_t* __restrict dst = out + (q * kpairs + j) * 32;
      for (int t = 0; t < 2; ++t) {
        const int64_t k = 2 * j + t;
        if (k < K && nc == 16) {
          const T* __restrict row = b + k * sbk + n0;
          for (int c = 0; c < 16; ++c) dst[2 * c + t] = static_cast<int16_t>(row[c] - zp);
        } else {
          for (int c = 0; c < 16; ++c) dst[2 * c + t] = k < K && c < nc ? static_cast<int16_t>(b[k * sbk + n0 + c] - zp) : 0;
        }
      }
    }
  }
}

template <typename T>
void PackPanelsFromCols(const T* b, int64_t sbn, int64_t K, int64_t N, int64_t kpairs, int64_t panels, int32_t zp,
                        int16_t* out) {
  for (int64_t q = 0; q < panels; ++q)
    for (int c = 0; c < 16; ++c) {
      const int64_t n = 16 * q + c;
      int16_t* dst = out + q * kpairs * 32 + 2 * c;
      if (n >= N) {
        for (int64_t j = 0; j < kpairs; ++j) dst[j * 32] = dst[j * 32 + 1] = 0;
        continue;
      }
      const T* col = b + n * sbn;
      for (int64_t j = 0; j < kpairs; ++j) {
        const int64_t k = 2 * j;
        dst[j * 32] = k < K ? static_cast<int16_t>(col[k] - zp) : 0;
        dst[j * 32 + 1] = k + 1 < K ? static_cast<int16_t>(col[k + 1] - zp) : 0;
      }
    }
}

template <typename T>
bool PackPanelsDirect(const T* b, int64_t sbk, int64_t sbn, int64_t K, int64_t N, int64_t kpairs, int64_t panels,
                      int32_t zp, int16_t* out) {
  if (sbn == 1) {
    PackPanelsFromRows(b, sbk, K, N, kpairs, panels, zp, out);
  } else if (sbk == 1) {
    PackPanelsFromCols(b, sbn, K, N, kpairs, panels, zp, out);
  } else {
    return false;
  }
  return true;
}

Status RunMatmulFast(RunCtx& c, const GraphOp& op, const MatmulParams& p, const MatmulView& v) {
  const size_t rank = v.rank;
  const int64_t M = v.M, K = v.K, N = v.N;
  const int64_t kp = (K + 3) / 4 * 4, kpairs = kp / 2, panels = (N + kPanelCols - 1) / kPanelCols;
  const int64_t ldacc = panels * kPanelCols;
  const uint8_t* xa = c.Buf(op.inputs[0]);
  const uint8_t* xb = c.Buf(op.inputs[1]);
  const int da = c.DType(op.inputs[0]), db = c.DType(op.inputs[1]);
  uint8_t* y = c.Buf(op.outputs[0]);
  const bool out_signed = c.DType(op.outputs[0]) == kI8;
  const IntMicroKernel kernel = SelectIntMicroKernel(PanelFormat::kI16, c.path);
  const RequantKernel requant = SelectRequantKernel(c.path);
  const int64_t sam = v.sta[rank - 2], sak = v.sta[rank - 1], sbk = v.stb[rank - 2], sbn = v.stb[rank - 1];
  const int64_t sym = v.str[rank - 2], syn = v.str[rank - 1];
  // Row blocks of <= 96 rows keep a block's int16 rows and int32 sums in L1/L2 (as gemm.cc).
  constexpr int64_t kRowBlock = 16 * kMaxRows;
  const int64_t mblocks = (M + kRowBlock - 1) / kRowBlock;
  ParallelFor(static_cast<int>(v.outer), [&](int o) {
    int64_t oa, ob, oy;
    v.Offsets(o, &oa, &ob, &oy);
    thread_local std::vector<int16_t> bpack, a16, bt;
    thread_local std::vector<int32_t> acc;
    thread_local std::vector<uint8_t> tmp;
    // b - zp_b into panels: k-pair j of panel q holds slot i < 16: column 16q + i/2,
    // k = 2j + i%2, then slot 16 + i: column 16q + 8 + i/2 (slot 2c + t: column 16q + c,
    // k = 2j + t); straight from b when one of its axes is contiguous, else through N rows
    // of K (bt)
    bpack.resize(static_cast<size_t>(panels * kpairs * 32));
    const bool direct = db == kU8 ? PackPanelsDirect(xb + ob, sbk, sbn, K, N, kpairs, panels, p.zp[1], bpack.data())
                                  : PackPanelsDirect(reinterpret_cast<const int8_t*>(xb + ob), sbk, sbn, K, N, kpairs,
                                                     panels, p.zp[1], bpack.data());
    if (!direct) bt.assign(static_cast<size_t>(ldacc * kp), 0);
    if (!direct) GatherI16(xb, db, ob, sbn, sbk, N, K, p.zp[1], bt.data(), kp);
    for (int64_t q = 0; !direct && q < panels; ++q) {
      int16_t* panel = bpack.data() + q * kpairs * 32;
      for (int64_t j = 0; j < kpairs; ++j)
        for (int i = 0; i < 16; ++i) {
          panel[j * 32 + i] = bt[(16 * q + i / 2) * kp + 2 * j + i % 2];
          panel[j * 32 + 16 + i] = bt[(16 * q + 8 + i / 2) * kp + 2 * j + i % 2];
        }
    }
    for (int64_t mb = 0; mb < mblocks; ++mb) {
      const int64_t m0 = mb * kRowBlock, rows_total = std::min(kRowBlock, M - m0);
      a16.assign(static_cast<size_t>(rows_total * kp), 0);
      GatherI16(xa, da, oa + m0 * sam, sam, sak, rows_total, K, p.zp[0], a16.data(), kp);
      acc.resize(static_cast<size_t>(rows_total * ldacc));
      for (int64_t q = 0; q < panels; ++q) {
        const uint8_t* panel = reinterpret_cast<const uint8_t*>(bpack.data() + q * kpairs * 32);
        for (int64_t r = 0, rows = 0; r < rows_total; r += rows) {
          rows = std::min<int64_t>(kMaxRows, rows_total - r);
          kernel(static_cast<int>(rows), a16.data() + r * kp, kp, panel, kpairs, acc.data() + r * ldacc + q * 16,
                 ldacc, false);
        }
      }
      if (syn == 1) {  // the result's rows are contiguous in y: stage straight into it
        requant(acc.data(), rows_total, N, ldacc, p.out.stage, 0, y + oy + m0 * sym, sym, out_signed);
      } else {
        tmp.resize(static_cast<size_t>(rows_total * N));
        requant(acc.data(), rows_total, N, ldacc, p.out.stage, 0, tmp.data(), N, out_signed);
        for (int64_t r = 0; r < rows_total; ++r)
          for (int64_t n = 0; n < N; ++n) y[oy + (m0 + r) * sym + n * syn] = tmp[r * N + n];
      }
    }
  }, /*work=*/v.outer * M * N * K);
  return Status::Ok();
}

}  // namespace

Status RunMatmul(RunCtx& c, const GraphOp& op) {
  const MatmulParams& p = ParamsOf<MatmulParams>(op);
  const MatmulView v = ViewOf(c, op, p);
  if (v.M == 0 || v.N == 0 || v.outer == 0) return Status::Ok();
  return c.path == kPathRef ? RunMatmulRef(c, op, p, v) : RunMatmulFast(c, op, p, v);
}

// The op table's entry (op_schema.h names it by opcode).
const OpDef kMatmulDef = {PrepareMatmul, RunMatmul, ValueRange::kStage};

}  // namespace qdsl
