// Graph executor: one pass over the ops of a prepared Graph, with the semantics of
// qdsl/graph/reference.py (docs/qgraph.md §4).  Activations are stored in their
// container type (int8 for I8 and BIN as +-1, uint8 for U8, float for F32) in buffers
// planned once per batch size; each op runs through its table entry (runtime/ops/).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>

#include "dispatch.h"
#include "runtime/ops/op.h"
#include "threads/thread_pool.h"

namespace qdsl {

Status RunGraph(Graph* g, int64_t batch, const void* const* inputs, void* const* outputs, uint32_t path) {
  QDSL_CHECK_ARG(g != nullptr && batch >= 1 && batch <= (int64_t{1} << 24), "bad batch size %lld", (long long)batch);
  uint32_t chosen = 0;
  QDSL_RETURN_IF_ERROR(ResolvePath(path, &chosen));
  if (g->planned_batch != batch) {
    g->buffers.assign(g->tensors.size(), {});
    std::vector<char> is_input(g->tensors.size(), 0);
    for (uint32_t t : g->inputs) is_input[t] = 1;
    for (size_t t = 0; t < g->tensors.size(); ++t) {
      const GraphTensor& ts = g->tensors[t];
      if (ts.is_constant) continue;
      // a graph input declared with a static first dim (an attention mask (L, S)) is not batched
      QDSL_CHECK_ARG(ts.dims[0] == -1 || ts.dims[0] == batch || is_input[t], "batch %lld does not match tensor '%s' (batch %lld)",
                     (long long)batch, ts.name.c_str(), (long long)ts.dims[0]);
      const int64_t n = Numel(ShapeFor(ts, batch));
      QDSL_CHECK(n <= (int64_t{1} << 34), StatusCode::kInvalidArgument, "tensor '%s' too large for batch %lld",
                 ts.name.c_str(), (long long)batch);
      g->buffers[t].assign(static_cast<size_t>(n * ((ts.dtype == kF32 || ts.dtype == kI32) ? 4 : 1)), 0);
    }
    g->planned_batch = batch;
  }
  for (size_t i = 0; i < g->inputs.size(); ++i) {
    QDSL_CHECK_ARG(inputs[i] != nullptr, "null input %zu", i);
    std::memcpy(g->buffers[g->inputs[i]].data(), inputs[i], g->buffers[g->inputs[i]].size());
  }
  if (g->nhwc_path != chosen) PlanNhwc(g, chosen);  // which convs run NHWC depends on the path
  std::fill(g->overflow.begin(), g->overflow.end(), 0);
  g->fused_done.assign(g->ops.size(), 0);
  // QDSL_PROFILE=1 prints each op's wall time to stderr (for finding slow ops), with the
  // process CPU time (every thread, spinning included) and how the op used the pool:
  // parallel jobs / serial ones, tasks, the share the calling thread ran, and the time it
  // waited for tasks other threads held (threads/thread_pool.h PoolStats).
  static const bool profile = [] {  // set and not "0" / empty
    const char* v = std::getenv("QDSL_PROFILE");
    const bool on = v != nullptr && v[0] != '\0' && !(v[0] == '0' && v[1] == '\0');
    if (on) EnablePoolStats(true);
    return on;
  }();
  auto t0 = std::chrono::steady_clock::now();
  std::clock_t c0 = std::clock();
  PoolStats s0 = profile ? GetPoolStats() : PoolStats{};
  for (size_t oi = 0; oi <= g->ops.size(); ++oi) {
    if (profile && oi > 0) {
      const auto t1 = std::chrono::steady_clock::now();
      const std::clock_t c1 = std::clock();
      const PoolStats s1 = GetPoolStats();
      std::fprintf(stderr, "qdsl op %3zu %-24s wall %9.3f ms  cpu %9.3f ms  jobs %lld/%lld tasks %lld caller %lld tail %.3f ms\n",
                   oi - 1, g->ops[oi - 1].name.c_str(), std::chrono::duration<double, std::milli>(t1 - t0).count(),
                   1e3 * double(c1 - c0) / CLOCKS_PER_SEC, (long long)(s1.parallel_jobs - s0.parallel_jobs),
                   (long long)(s1.serial_jobs - s0.serial_jobs), (long long)(s1.tasks - s0.tasks),
                   (long long)(s1.caller_claims - s0.caller_claims), 1e-6 * double(s1.tail_wait_ns - s0.tail_wait_ns));
      t0 = std::chrono::steady_clock::now();  // after the print: its cost is no op's
      c0 = std::clock();
      s0 = GetPoolStats();
    }
    if (oi == g->ops.size()) break;
    // ops already computed by the conv they were fused into, or a twin conv's run
    // (ConvParams::fused_add, ConvParams::twins)
    if (g->fused_done[oi]) continue;
    const GraphOp& op = g->ops[oi];
    RunCtx c{g, batch, chosen, oi};
    QDSL_RETURN_IF_ERROR(OpDefFor(op.opcode).run(c, op));
  }
  for (size_t i = 0; i < g->outputs.size(); ++i) {
    QDSL_CHECK_ARG(outputs[i] != nullptr, "null output %zu", i);
    std::memcpy(outputs[i], g->buffers[g->outputs[i]].data(), g->buffers[g->outputs[i]].size());
  }
  return Status::Ok();
}

}  // namespace qdsl
