// SOFTMAX_MASKED (docs/qgraph.md §4.4): SOFTMAX of an I8/U8 input along its last axis over
// the positions one or two masks keep.  Per row, K the kept positions:
//   m = max_{i in K} x_i,  E_i = table[x_i - m + 255] (i in K) else 0,  S = Σ E_i (int64),
//   Q_i = floor(E_i · 2^30 / S) (0 for every i when K is empty),
//   y_i = clamp(rescale(Q_i) + out_zp, out_min, out_max).
// A mask (I32/I8/U8/F32; an activation, graph input or constant) is placed on x by
// mask_dims: per x axis the mask dim indexing it, or -1 (broadcast); consecutive axes may
// share one dim (row-major), and a dim of size 1 broadcasts.  mask_attend 1: nonzero
// attends; 0: zero attends.  An F32 mask is additive: 0 attends, -inf masks, any other
// value is an error of the run (kInvalidArgument naming the op, as qdsl/graph/ops/softmax_masked.py).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "dispatch.h"
#include "runtime/ops/last_axis.h"
#include "runtime/ops/op.h"
#include "runtime/ops/softmax_row.h"
#include "threads/thread_pool.h"

namespace qdsl {
namespace {

struct MaskInfo {
  uint32_t tensor = 0;
  int dtype = 0;
  bool attend_nonzero = false;
  std::vector<int> dims;           // per x axis: the mask dim, or -1
  std::vector<uint8_t> constant;  // a constant mask's nonzero flags (empty for an activation)
};

struct SoftmaxMaskedParams : OpParams {
  int64_t table[256] = {};
  // the same entries (<= 2^24) for the optimized rows, then zeros: a masked position above the
  // kept maximum m indexes table32[x - m + 255] past 255 (its E is then masked to 0)
  int32_t table32[512] = {};
  StageData out;
  std::vector<MaskInfo> masks;
};

bool NonZero(const uint8_t* b, int dtype, int64_t i) {
  if (dtype == kF32) {
    float v;
    std::memcpy(&v, b + 4 * i, 4);
    return v != 0.0f;
  }
  return LoadValue(b, dtype, i) != 0;
}

// Per x axis, the element stride of the mask (0 where it broadcasts), for the actual
// shapes xs and ms; an error when a mask dim fits neither the axes it indexes nor 1.
Status MaskStrides(const GraphOp& op, const std::string& mask_name, const std::vector<int64_t>& xs,
                   const std::vector<int64_t>& ms, const std::vector<int>& dims, std::vector<int64_t>* strides) {
  const int rank = static_cast<int>(xs.size());
  strides->assign(rank, 0);
  int64_t mstride = 1;
  for (int k = static_cast<int>(ms.size()) - 1; k >= 0; --k) {
    int64_t want = 1;
    for (int a = 0; a < rank; ++a)
      if (dims[a] == k) want *= xs[a];
    QDSL_CHECK_ARG(ms[k] == want || ms[k] == 1,
                   "SOFTMAX_MASKED '%s': mask '%s' dim %d has size %lld, expected %lld or 1", op.name.c_str(),
                   mask_name.c_str(), k, static_cast<long long>(ms[k]), static_cast<long long>(want));
    if (ms[k] != 1) {
      int64_t inner = mstride;
      for (int a = rank - 1; a >= 0; --a) {
        if (dims[a] != k) continue;
        (*strides)[a] = inner;
        inner *= xs[a];
      }
    }
    mstride *= ms[k];
  }
  return Status::Ok();
}

}  // namespace

Status PrepareSoftmaxMasked(Graph* g, GraphOp& op, int index, std::vector<int64_t>* shape) {
  const GraphTensor& x = g->tensors[op.inputs[0]];
  const GraphTensor& out = g->tensors[op.outputs[0]];
  OP_CHECK(IsInt8(x.dtype) && IsInt8(out.dtype), "SOFTMAX_MASKED input and output must be I8/U8");
  const int rank = static_cast<int>(shape->size());
  OP_CHECK(rank >= 2, "SOFTMAX_MASKED needs an axis besides the batch");
  const std::vector<int64_t>& t = op.attrs.at("table").ints;
  OP_CHECK(t.size() == 256, "attribute 'table' must have 256 entries, got %zu", t.size());
  auto p = std::make_shared<SoftmaxMaskedParams>();
  for (int i = 0; i < 256; ++i) {
    OP_CHECK(t[i] >= 0 && t[i] <= (int64_t{1} << 24), "table entry %d = %lld outside [0, 2^24]", i, (long long)t[i]);
    p->table[i] = t[i];
    p->table32[i] = static_cast<int32_t>(t[i]);
  }
  OP_CHECK(t[255] >= 1, "table[255] (exp(0)) must be >= 1");
  const int n_masks = static_cast<int>(op.inputs.size()) - 1;
  const std::vector<int64_t>& dims = op.attrs.at("mask_dims").ints;
  const std::vector<int64_t>& attend = op.attrs.at("mask_attend").ints;
  OP_CHECK(static_cast<int>(dims.size()) == rank * n_masks, "attribute 'mask_dims' must have %d entries, got %zu",
           rank * n_masks, dims.size());
  OP_CHECK(static_cast<int>(attend.size()) == n_masks, "attribute 'mask_attend' must have %d entries, got %zu",
           n_masks, attend.size());
  for (int j = 0; j < n_masks; ++j) {
    const GraphTensor& m = g->tensors[op.inputs[j + 1]];
    OP_CHECK(m.dtype == kI32 || m.dtype == kF32 || IsInt8(m.dtype), "mask '%s' must be I32/I8/U8/F32", m.name.c_str());
    OP_CHECK(attend[j] == 0 || attend[j] == 1, "mask_attend %lld must be 0 or 1", (long long)attend[j]);
    OP_CHECK(m.dtype != kF32 || attend[j] == 0, "mask '%s' is F32 (additive), so its mask_attend must be 0",
             m.name.c_str());
    MaskInfo info;
    info.tensor = op.inputs[j + 1];
    info.dtype = m.dtype;
    info.attend_nonzero = attend[j] == 1;
    const int mrank = static_cast<int>(m.dims.size());
    int last = -1;
    std::vector<int> seen(mrank, 0);
    for (int a = 0; a < rank; ++a) {
      const int64_t d = dims[j * rank + a];
      OP_CHECK(d >= -1 && d < mrank, "mask_dims entry %lld outside [-1, %d) for mask '%s'", (long long)d, mrank,
               m.name.c_str());
      if (d >= 0) {
        // in order, and the axes one dim indexes are consecutive
        OP_CHECK(d >= last && (d == last || !seen[d]) && (d != last || dims[j * rank + a - 1] == d),
                 "mask_dims of mask '%s' must place its dims in order on consecutive axes", m.name.c_str());
        seen[d] = 1;
        last = static_cast<int>(d);
      }
      info.dims.push_back(static_cast<int>(d));
    }
    for (int k = 0; k < mrank; ++k) OP_CHECK(seen[k], "mask dim %d of mask '%s' indexes no axis", k, m.name.c_str());
    if (m.is_constant) {
      info.constant.resize(m.values.size());
      for (size_t i = 0; i < m.values.size(); ++i) info.constant[i] = m.values[i] != 0;
    }
    p->masks.push_back(std::move(info));
  }
  QDSL_RETURN_IF_ERROR(ReadStage(op, index, 1, out.dtype, &p->out));
  OP_CHECK(p->out.multiplier.size() == 1, "SOFTMAX_MASKED rescales are per tensor");
  op.prepared = std::move(p);
  return Status::Ok();
}

Status RunSoftmaxMasked(RunCtx& c, const GraphOp& op) {
  const SoftmaxMaskedParams& p = ParamsOf<SoftmaxMaskedParams>(op);
  const std::vector<int64_t> xs = c.Shape(op.inputs[0]);
  const int rank = static_cast<int>(xs.size());
  const int64_t n = xs.back(), rows = Numel(xs) / std::max<int64_t>(n, 1);
  const size_t n_masks = p.masks.size();
  std::vector<std::vector<int64_t>> strides(n_masks);
  std::vector<const uint8_t*> bufs(n_masks);
  std::vector<int> dtypes(n_masks);
  for (size_t j = 0; j < n_masks; ++j) {
    const MaskInfo& mi = p.masks[j];
    const GraphTensor& mt = c.g->tensors[mi.tensor];
    const std::vector<int64_t> ms = mt.is_constant ? mt.dims : c.Shape(mi.tensor);
    QDSL_RETURN_IF_ERROR(MaskStrides(op, mt.name, xs, ms, mi.dims, &strides[j]));
    bufs[j] = mt.is_constant ? mi.constant.data() : c.Buf(mi.tensor);
    dtypes[j] = mt.is_constant ? kU8 : mi.dtype;
    if (dtypes[j] == kF32) {  // additive: 0 or -inf only (checked before any row is written)
      const int64_t count = Numel(ms);
      for (int64_t i = 0; i < count; ++i) {
        float v;
        std::memcpy(&v, bufs[j] + 4 * i, 4);
        QDSL_CHECK_ARG(v == 0.0f || v == -std::numeric_limits<float>::infinity(),
                       "SOFTMAX_MASKED '%s': mask '%s' holds %g at flat index %lld: an additive float mask must be "
                       "0 (attend) or -inf (masked)",
                       op.name.c_str(), mt.name.c_str(), static_cast<double>(v), static_cast<long long>(i));
      }
    }
  }
  const uint8_t* x = c.Buf(op.inputs[0]);
  const int dt = c.DType(op.inputs[0]);
  uint8_t* y = c.Buf(op.outputs[0]);
  const OutputStage& st = p.out.stage;
  // the row's mask offsets: its index along each axis but the last, times the strides; then
  // keep[i] = 1 where every mask attends position i
  auto offsets = [&](int64_t r, int64_t* off) {
    std::fill(off, off + n_masks, 0);
    int64_t rest = r;
    for (int a = rank - 2; a >= 0; --a) {
      const int64_t idx = rest % xs[a];
      rest /= xs[a];
      for (size_t j = 0; j < n_masks; ++j) off[j] += idx * strides[j][a];
    }
  };
  auto flags = [&](const int64_t* off, uint8_t* keep) {
    std::fill(keep, keep + n, 1);
    for (size_t j = 0; j < n_masks; ++j) {
      const int64_t sl = strides[j][rank - 1];
      const bool attend_nonzero = p.masks[j].attend_nonzero;
      for (int64_t i = 0; i < n; ++i)
        if (NonZero(bufs[j], dtypes[j], off[j] + i * sl) != attend_nonzero) keep[i] = 0;
    }
  };
  // every position kept (no padding in the row): the unmasked row's loops
  auto all_kept = [&](const uint8_t* keep) {
    uint8_t all = 1;
    for (int64_t i = 0; i < n; ++i) all &= keep[i];
    return all != 0;
  };
  if (c.path == kPathRef) {
    const int64_t work = rows * n * 4 * kSoftmaxCost;  // the scalar reference rows
    ParallelRanges(rows, RowChunk(rows, work), work, [&](int64_t r0, int64_t r1) {
      std::vector<int64_t> e(static_cast<size_t>(n));
      std::vector<uint8_t> keep(static_cast<size_t>(n));
      std::vector<int64_t> off(n_masks);
      for (int64_t r = r0; r < r1; ++r) {
        offsets(r, off.data());
        flags(off.data(), keep.data());
        const int64_t o = r * n;
        int32_t mx = std::numeric_limits<int32_t>::min();
        bool any = false;
        for (int64_t i = 0; i < n; ++i)
          if (keep[i]) {
            mx = std::max(mx, LoadValue(x, dt, o + i));
            any = true;
          }
        int64_t s = 0;
        for (int64_t i = 0; i < n; ++i) s += e[i] = keep[i] ? p.table[LoadValue(x, dt, o + i) - mx + 255] : 0;
        // a fully masked row: every E_i = 0, so every Q_i = 0 (probability 0, code clamp(out_zp))
        for (int64_t i = 0; i < n; ++i)
          y[o + i] = static_cast<uint8_t>(ApplyStage(any ? (e[i] << 30) / s : 0, st, 0));
      }
    });
    return Status::Ok();
  }
  // Optimized paths: SOFTMAX's row (softmax_row.h) over the kept flags, the same integers,
  // then the vectorized output stage over Q (Q = 0 gives the reference's clamp(out_zp)).
  const RequantKernel requant = SelectRequantKernel(c.path);
  const FloorDivScaledKernel div = SelectFloorDivScaledKernel(c.path);
  const bool out_signed = c.DType(op.outputs[0]) == kI8;
  const int64_t work = rows * n * kSoftmaxCost;
  ParallelRanges(rows, RowChunk(rows, work), work, [&](int64_t r0, int64_t r1) {
    thread_local std::vector<int32_t> q;        // Q, then E
    thread_local std::vector<uint8_t> keep;     // the row's kept flags
    thread_local std::vector<int64_t> off, prev;
    q.resize(static_cast<size_t>(2 * n));
    keep.resize(static_cast<size_t>(n));
    off.resize(n_masks);
    prev.resize(n_masks);
    int32_t* e = q.data() + n;
    const uint8_t* kept = nullptr;  // the row's flags, or nullptr when every position is kept
    for (int64_t r = r0; r < r1; ++r) {
      offsets(r, off.data());
      // rows at the same mask offsets (a key mask over heads and queries) share their flags
      if (r == r0 || off != prev) {
        flags(off.data(), keep.data());
        kept = all_kept(keep.data()) ? nullptr : keep.data();
      }
      prev.swap(off);
      off.resize(n_masks);
      const uint8_t* xr = x + r * n;
      if (dt == kU8) {
        SoftmaxRowFast(p.table32, xr, kept, n, div, e, q.data());
      } else {
        SoftmaxRowFast(p.table32, reinterpret_cast<const int8_t*>(xr), kept, n, div, e, q.data());
      }
      requant(q.data(), 1, n, n, st, 0, y + r * n, n, out_signed);
    }
  });
  return Status::Ok();
}

// The op table's entry (op_schema.h names it by opcode).
const OpDef kSoftmaxMaskedDef = {PrepareSoftmaxMasked, RunSoftmaxMasked, ValueRange::kStage};

}  // namespace qdsl
