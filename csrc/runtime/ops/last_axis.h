// Shared by the ops that normalize along the last axis (SOFTMAX, LAYERNORM): the row loop
// over a tensor's last axis, and the exact floor division their optimized rows use.
#ifndef QDSL_RUNTIME_OPS_LAST_AXIS_H_
#define QDSL_RUNTIME_OPS_LAST_AXIS_H_

#include <algorithm>
#include <cstdint>

#include "runtime/ops/op.h"
#include "threads/thread_pool.h"

namespace qdsl {

// Bytes per element of a runtime buffer of graph dtype `dtype` (I32/F32: 4, else 1).
inline int64_t ElementBytes(int dtype) { return dtype == kI32 || dtype == kF32 ? 4 : 1; }

// Rows per claim for the row ops: 16, fewer when that gives a thread under kClaimsPerThread
// claims (MiniLM at batch 1: 128 rows).  A row is hundreds of elements: a claim per row
// still costs little beside it.
inline int64_t RowChunk(int64_t rows, int64_t work) { return FineChunk(rows, 16, 1, work); }

// Calls fn(scratch, x_row, y_row, n) for every row of the op's input 0 along its last axis (n
// elements; x_row in input 0's buffer, y_row in output 0's, both at the row's first element),
// rows split into ranges of <= 16 across the threads (RowChunk).  `cost` is the work per
// element (in MAC equivalents, for ParallelFor's threshold).  Scratch is one default-constructed S per
// thread, kept across calls, so rows reuse their buffers (sized by fn) without allocating.
template <class S, class F>
void ForEachLastAxisRow(const RunCtx& c, const GraphOp& op, int64_t cost, F&& fn) {
  const std::vector<int64_t> xs = c.Shape(op.inputs[0]);
  const int64_t n = xs.back(), rows = Numel(xs) / std::max<int64_t>(n, 1);
  const int64_t xb = ElementBytes(c.DType(op.inputs[0])) * n, yb = ElementBytes(c.DType(op.outputs[0])) * n;
  const uint8_t* x = c.Buf(op.inputs[0]);
  uint8_t* y = c.Buf(op.outputs[0]);
  ParallelRanges(rows, RowChunk(rows, rows * n * cost), /*work=*/rows * n * cost, [&](int64_t r0, int64_t r1) {
    thread_local S scratch;
    for (int64_t r = r0; r < r1; ++r) fn(scratch, x + r * xb, y + r * yb, n);
  });
}

// Work per element of the optimized rows, in MAC equivalents (ParallelFor's threshold is
// in the AVX2 GEMM's): measured at batch 1 on MiniLM shapes, a SOFTMAX element costs about
// as much time as ~80 GEMM MACs (1.7 ns), a LAYERNORM element per input ~200 (the figures
// of 4-16 these ops gave before kept 0.3-0.45 ms rows serial at 2 threads).
constexpr int64_t kSoftmaxCost = 64;
constexpr int64_t kLayernormCost = 128;

// floor(a / b) for a >= 0, b > 0 both exact as doubles (below 2^53, or like E·2^30 with at
// most 53 significant bits), a / b < 2^50 and a + b < 2^62, given inv = 1.0 / b: the double
// estimate floor(a * inv) (relative error a few ulp, so within 1 of the quotient), stepped
// once with the exact int64 remainder a - q*b, which must then lie in [0, b).  An int64
// division costs tens of cycles; this costs a multiply, a convert and a multiply-compare.
inline int64_t FloorDivByReciprocal(int64_t a, int64_t b, double inv) {
  int64_t q = static_cast<int64_t>(static_cast<double>(a) * inv);  // a, inv >= 0: truncation is floor
  const int64_t r = a - q * b;
  q += (r >= b) - (r < 0);
  return q;
}

}  // namespace qdsl

#endif  // QDSL_RUNTIME_OPS_LAST_AXIS_H_
