// Graph executor: one pass over the ops of a prepared Graph, with the semantics of
// qdsl/graph/reference.py (docs/qgraph.md §4).  Activations are stored in their
// container type (int8 for I8 and BIN as +-1, uint8 for U8, float for F32) in buffers
// planned once per batch size; each op runs through its table entry (runtime/ops/).
// Segments of the graph (Graph::segments, segment.cc) run a slice of the batch at a time.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <memory>

#include "dispatch.h"
#include "runtime/ops/op.h"
#include "threads/thread_pool.h"

namespace qdsl {
namespace {

// QDSL_PROFILE=1 prints each op's wall time to stderr after the run (for finding slow ops),
// with the process CPU time (every thread, spinning included) and how the op used the pool:
// parallel jobs / serial ones, tasks, the share the calling thread ran, and the time it
// waited for tasks other threads held (threads/thread_pool.h PoolStats).  An op in a segment
// (segment.cc) is summed over its passes, and the line says how many images each took.
bool ProfileOn() {
  static const bool on = [] {  // set and not "0" / empty
    const char* v = std::getenv("QDSL_PROFILE");
    const bool set = v != nullptr && v[0] != '\0' && !(v[0] == '0' && v[1] == '\0');
    if (set) EnablePoolStats(true);
    return set;
  }();
  return on;
}

struct OpTimes {
  double wall_ms = 0, cpu_ms = 0;
  PoolStats pool{};
};

class Profiler {
 public:
  explicit Profiler(size_t n_ops) : times_(n_ops) {}
  void Start() {
    t0_ = std::chrono::steady_clock::now();
    c0_ = std::clock();
    s0_ = GetPoolStats();
  }
  void Stop(size_t oi) {
    const auto t1 = std::chrono::steady_clock::now();
    const std::clock_t c1 = std::clock();
    const PoolStats s1 = GetPoolStats();
    OpTimes& o = times_[oi];
    o.wall_ms += std::chrono::duration<double, std::milli>(t1 - t0_).count();
    o.cpu_ms += 1e3 * double(c1 - c0_) / CLOCKS_PER_SEC;
    o.pool.parallel_jobs += s1.parallel_jobs - s0_.parallel_jobs;
    o.pool.serial_jobs += s1.serial_jobs - s0_.serial_jobs;
    o.pool.tasks += s1.tasks - s0_.tasks;
    o.pool.caller_claims += s1.caller_claims - s0_.caller_claims;
    o.pool.tail_wait_ns += s1.tail_wait_ns - s0_.tail_wait_ns;
  }
  void Print(const Graph& g) const {
    for (size_t oi = 0; oi < times_.size(); ++oi) {
      const OpTimes& o = times_[oi];
      char step[48] = "";
      if (g.op_step[oi] > 0) std::snprintf(step, sizeof step, "  images/pass %lld", (long long)g.op_step[oi]);
      std::fprintf(stderr, "qdsl op %3zu %-24s wall %9.3f ms  cpu %9.3f ms  jobs %lld/%lld tasks %lld caller %lld tail %.3f ms%s\n",
                   oi, g.ops[oi].name.c_str(), o.wall_ms, o.cpu_ms, (long long)o.pool.parallel_jobs,
                   (long long)o.pool.serial_jobs, (long long)o.pool.tasks, (long long)o.pool.caller_claims,
                   1e-6 * double(o.pool.tail_wait_ns), step);
    }
  }

 private:
  std::vector<OpTimes> times_;
  std::chrono::steady_clock::time_point t0_;
  std::clock_t c0_ = 0;
  PoolStats s0_{};
};

// Ops [first, end) on `batch` images (the tensors' current views).
Status RunOps(Graph* g, size_t first, size_t end, int64_t batch, uint32_t path, Profiler* prof) {
  for (size_t oi = first; oi < end; ++oi) {
    // ops already computed by the conv they were fused into, or a twin conv's run
    // (ConvParams::fused_add, ConvParams::twins)
    if (g->fused_done[oi]) continue;
    const GraphOp& op = g->ops[oi];
    RunCtx c{g, batch, path, oi};
    if (prof) prof->Start();
    const Status st = OpDefFor(op.opcode).run(c, op);
    if (prof) prof->Stop(oi);
    QDSL_RETURN_IF_ERROR(st);
  }
  return Status::Ok();
}

// Segment s, `s.step` images per pass: its sliced tensors viewed at the pass's images, its
// internal ones at the first images' room (GraphSegment); every view whole again after.
Status RunSegment(Graph* g, const GraphSegment& s, int64_t batch, uint32_t path, Profiler* prof) {
  struct Restore {
    Graph* g;
    const GraphSegment& s;
    ~Restore() {
      for (uint32_t t : s.sliced) g->buffers[t].ViewAll();
      for (uint32_t t : s.internal) g->buffers[t].ViewAll();
    }
  } restore{g, s};
  for (size_t oi = s.first; oi < s.end; ++oi) g->op_step[oi] = s.step;
  for (int64_t i0 = 0; i0 < batch; i0 += s.step) {
    const int64_t n = std::min(s.step, batch - i0);
    for (uint32_t t : s.sliced) {
      TensorBuffer& b = g->buffers[t];
      const size_t image = b.capacity() / static_cast<size_t>(batch);
      b.SetView(static_cast<ptrdiff_t>(i0 * image), static_cast<size_t>(n) * image);
    }
    for (uint32_t t : s.internal) {
      TensorBuffer& b = g->buffers[t];
      b.SetView(0, static_cast<size_t>(n) * (b.capacity() / static_cast<size_t>(batch)));
    }
    // (ops a conv computes are in its segment: marks from the last pass are this pass's to redo)
    std::fill(g->fused_done.begin() + s.first, g->fused_done.begin() + s.end, 0);
    QDSL_RETURN_IF_ERROR(RunOps(g, s.first, s.end, n, path, prof));
  }
  return Status::Ok();
}

}  // namespace

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
      g->buffers[t].Allocate(static_cast<size_t>(n * ((ts.dtype == kF32 || ts.dtype == kI32) ? 4 : 1)));
    }
    g->planned_batch = batch;
    g->segment_budget = -1;
  }
  // segments for this batch size and the environment's budget (planned again when either changes)
  if (const int64_t budget = SegmentBudgetFromEnv(); budget != g->segment_budget) PlanSegments(g, batch, budget);
  for (size_t i = 0; i < g->inputs.size(); ++i) {
    QDSL_CHECK_ARG(inputs[i] != nullptr, "null input %zu", i);
    std::memcpy(g->buffers[g->inputs[i]].data(), inputs[i], g->buffers[g->inputs[i]].size());
  }
  if (g->nhwc_path != chosen) PlanNhwc(g, chosen);  // which convs run NHWC depends on the path
  std::fill(g->overflow.begin(), g->overflow.end(), 0);
  g->fused_done.assign(g->ops.size(), 0);
  g->op_step.assign(g->ops.size(), 0);
  std::unique_ptr<Profiler> prof(ProfileOn() ? new Profiler(g->ops.size()) : nullptr);
  size_t next = 0;  // the first op not run yet
  for (const GraphSegment& s : g->segments) {
    QDSL_RETURN_IF_ERROR(RunOps(g, next, s.first, batch, chosen, prof.get()));
    QDSL_RETURN_IF_ERROR(RunSegment(g, s, batch, chosen, prof.get()));
    next = s.end;
  }
  QDSL_RETURN_IF_ERROR(RunOps(g, next, g->ops.size(), batch, chosen, prof.get()));
  if (prof) prof->Print(*g);
  for (size_t i = 0; i < g->outputs.size(); ++i) {
    QDSL_CHECK_ARG(outputs[i] != nullptr, "null output %zu", i);
    std::memcpy(outputs[i], g->buffers[g->outputs[i]].data(), g->buffers[g->outputs[i]].size());
  }
  return Status::Ok();
}

}  // namespace qdsl
