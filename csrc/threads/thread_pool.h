// A tiny fork-join pool: ParallelFor(n, f) runs f(0..n-1) on the pool threads plus the
// caller and returns when all are done.  Nested calls run serially in the caller, and so
// do calls made while another thread's job holds the pool.  Tasks are claimed one at a
// time by whichever thread is running, so cut the work into several tasks per thread: on
// a machine where another process takes a core, the thread it preempts then holds up the
// op only for the task it is in (thread_pool.cc).
//
// `work` estimates the call's cost in multiply-accumulates (or equivalent).  Below
// kMinParallelWork the tasks run serially in the caller: even with a spinning worker a
// fork-join costs a few microseconds, as much as a 4M-MAC GEMM takes on the AMX path
// (measured: 2 threads ran (64,576,64) at 0.97x of one).
//
// It lives in threads/, below both gemm.cc and runtime/ (it includes neither), so the GEMM
// front doors do not reach up into the graph runtime for their threads.
#ifndef QDSL_THREADS_THREAD_POOL_H_
#define QDSL_THREADS_THREAD_POOL_H_

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>

namespace qdsl {

// ~4M MAC-equivalents: a few microseconds of AMX work, tens of AVX2.
constexpr int64_t kMinParallelWork = int64_t{1} << 22;

// Threads a ParallelFor with this `work` will use (1 below kMinParallelWork), for callers
// that size their tasks by it.
int ThreadsFor(int64_t work);

void ParallelFor(int n, const std::function<void(int)>& fn,
                 int64_t work = std::numeric_limits<int64_t>::max());

// Claims per thread that ops aim for when they cut their work (issue 18).  With one or two
// claims per thread, a thread that another process preempts or slows holds its share of
// the op for the others to wait on; with ~8 the others take most of it.  A claim costs a
// compare-exchange and whatever the task re-reads (a weight strip, a row block's pack),
// small beside pieces of >= kMinParallelWork / 8.
constexpr int kClaimsPerThread = 8;

// The range length for ParallelRanges over n elements: `chunk` (the op's cache-sized piece)
// at one thread, else short enough for kClaimsPerThread ranges per thread, but >= min_chunk
// (what a range must hold to cost more than its claim).
inline int64_t FineChunk(int64_t n, int64_t chunk, int64_t min_chunk, int64_t work) {
  const int64_t threads = ThreadsFor(work);
  if (threads <= 1) return chunk;
  const int64_t want = kClaimsPerThread * threads;
  return std::max<int64_t>(std::max<int64_t>(1, min_chunk), std::min(chunk, (n + want - 1) / want));
}

// When the pool stops paying (issue 18: "degrade toward, not below, the 1-thread speed").
// On an oversubscribed machine a worker that another process preempts in the middle of a
// task holds the op's end until it is scheduled again, milliseconds later; with several
// processes per core that made 2 threads slower than one.  The caller measures each job:
// its wall time, and what the job would have cost it alone (n tasks at the caller's own
// time per task).  Over a window of jobs, if the jobs took longer than that estimate, the
// next jobs run in the caller alone, for a stretch that doubles while probes keep losing
// (kSoloJobs .. kMaxSoloJobs jobs: ResNet-18 issues ~22 per run) and resets once a window
// wins.  Results never depend on it (every op gives the same bytes at any thread count).
// QDSL_POOL_ADAPT=0 turns it off.
class SoloPolicy {
 public:
  static constexpr int kWindow = 24;
  static constexpr int kSoloJobs = 32;
  static constexpr int kMaxSoloJobs = 2048;

  // A parallel job: n tasks, `mine` of them run by the caller in caller_ns, the job's wall
  // time wall_ns (from posting to its end).
  void Record(int n, int64_t mine, int64_t caller_ns, int64_t wall_ns) {
    if (mine <= 0 || caller_ns <= 0) return;  // the caller ran nothing: no estimate
    wall_ns_ += wall_ns;
    alone_ns_ += caller_ns * n / mine;
    if (++jobs_ < kWindow) return;
    if (wall_ns_ > alone_ns_) {
      solo_left_ = backoff_;
      backoff_ = backoff_ * 2 > kMaxSoloJobs ? kMaxSoloJobs : backoff_ * 2;
    } else {
      backoff_ = kSoloJobs;
    }
    jobs_ = 0;
    wall_ns_ = alone_ns_ = 0;
  }
  // True (and counted) when the next job should run in the caller alone.
  bool Solo() {
    if (solo_left_ <= 0) return false;
    --solo_left_;
    return true;
  }

 private:
  int jobs_ = 0, solo_left_ = 0, backoff_ = kSoloJobs;
  int64_t wall_ns_ = 0, alone_ns_ = 0;
};

// Counters for QDSL_PROFILE (the executor prints their change per op): how ops were cut,
// which thread claimed the tasks, and how long callers waited for tasks that another
// thread had claimed and not finished (on a machine where another process takes a core,
// the time a preempted thread holds up the op).  Counted only while enabled.
struct PoolStats {
  int64_t parallel_jobs = 0;  // ParallelFor calls that went to the pool
  int64_t serial_jobs = 0;    // calls run in the caller (below kMinParallelWork, n == 1, nested, SoloPolicy)
  int64_t tasks = 0;          // claims offered by the pool's jobs
  int64_t caller_claims = 0;  // of them, run by the thread that posted the job
  int64_t tail_wait_ns = 0;   // caller time between running out of tasks and the job's end
};
void EnablePoolStats(bool on);
PoolStats GetPoolStats();

// ParallelFor over [0, n) cut into ranges of `chunk` elements: fn(i0, i1) per range (the
// elementwise ops stream their tensors once, in cache-sized pieces).
template <class F>
void ParallelRanges(int64_t n, int64_t chunk, int64_t work, F&& fn) {
  ParallelFor(static_cast<int>((n + chunk - 1) / chunk), [&](int ci) {
    const int64_t i0 = ci * chunk;
    fn(i0, n - i0 < chunk ? n : i0 + chunk);
  }, work);
}

}  // namespace qdsl

#endif  // QDSL_THREADS_THREAD_POOL_H_
