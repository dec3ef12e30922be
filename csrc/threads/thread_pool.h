// A tiny fork-join pool: ParallelFor(n, f) runs f(0..n-1) on the pool threads plus the
// caller and returns when all are done.  Nested calls run serially in the caller, and so
// do calls made while another thread's job holds the pool.  Tasks are claimed one at a
// time by whichever thread is running, so cut the work into several tasks per thread: on
// a machine where another process takes a core, the thread it preempts then holds up the
// op only for the task it is in (thread_pool.cc), and on Linux the thread waiting for it
// moves it onto its own core when it finds it queued rather than running (placement,
// thread_pool.cc).  A task that throws ends the job; ParallelFor rethrows in the caller.
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
// processes per core that made 2 threads slower than one.  So the pool times both ways of
// running a job, under the conditions of the moment, and runs each job the way that is
// faster: in parallel, or in the caller alone ("solo").
//
// Jobs are told apart by their shape (task count, work estimate): an op issues the same
// shape on every run, so the two wall times of one shape compare like with like (a
// window of mixed jobs would compare a conv's parallel time with a pooling's solo time).
// Per shape it keeps a running mean of each mode's wall time, updated each time the job
// runs that way; the faster mean wins.  The mode that is not winning is re-measured now
// and then (a probe, every kFirstProbe visits, the interval doubling up to kMaxProbe while
// probes confirm the winner and reset when one changes it), so an estimate taken under
// other conditions (the machine got busy, or quiet again) does not stick.  A probe's time
// replaces the old estimate outright: it is the only fresh figure for that mode.
//
// The earlier policy compared the parallel wall time with the caller's time per task times
// the task count; under contention the caller's own tasks ran slowly too, so that estimate
// made solo look as bad as the parallel job and 2 threads never fell back (stop 29).
// Results never depend on the policy: ops cut their tasks by ThreadsFor, not by the mode,
// and every op gives the same bytes at any thread count.  QDSL_POOL_ADAPT=0 turns it off.
class SoloPolicy {
 public:
  // Shapes tracked at once: kSets sets of kWays, least recently used out (ResNet-18 issues
  // ~25 shapes per run, MobileNetV2 ~60; a shape that is forgotten is measured again).
  static constexpr int kSets = 64;
  static constexpr int kWays = 4;
  static constexpr int kFirstProbe = 8;
  static constexpr int kMaxProbe = 128;

  static uint64_t Key(int n, int64_t work) {
    return (static_cast<uint64_t>(work) * 0x9E3779B97F4A7C15ull) ^ static_cast<uint64_t>(n);
  }
  static int SetOf(uint64_t key) { return static_cast<int>((key * 0xD6E8FEB86659FD93ull) >> 58); }

  // True when the next job of this shape should run in the caller alone.
  bool Solo(uint64_t key) {
    Slot& s = SlotFor(key);
    if (s.par_ns < 0) return false;  // measure each mode once first
    if (s.solo_ns < 0) return true;
    if (--s.countdown <= 0) {
      s.countdown = s.interval;
      return !s.solo;  // probe the mode that is not winning
    }
    return s.solo;
  }

  // A job of this shape ran solo or in parallel and took wall_ns.
  void Record(uint64_t key, bool solo, int64_t wall_ns) {
    Slot& s = SlotFor(key);
    int64_t& est = solo ? s.solo_ns : s.par_ns;
    const bool probe = s.par_ns >= 0 && s.solo_ns >= 0 && solo != s.solo;
    est = est < 0 || probe ? wall_ns : est + (wall_ns - est) / 4;
    if (s.par_ns < 0 || s.solo_ns < 0) return;
    const bool winner = s.solo_ns < s.par_ns;
    if (winner != s.solo) {
      s.solo = winner;
      s.interval = kFirstProbe;
      s.countdown = kFirstProbe;
    } else if (probe) {
      s.interval = std::min(2 * s.interval, kMaxProbe);
      s.countdown = s.interval;
    }
  }

 private:
  struct Slot {
    uint64_t key = 0;
    uint64_t used = 0;  // when last looked up (0: empty)
    bool solo = false;  // the winning mode
    int interval = kFirstProbe, countdown = kFirstProbe;
    int64_t solo_ns = -1, par_ns = -1;  // running means; -1: not measured yet
  };
  Slot& SlotFor(uint64_t key) {
    const int set = SetOf(key);
    Slot* ways = slots_ + set * kWays;
    Slot* out = ways;
    for (int w = 0; w < kWays; ++w) {
      if (ways[w].used != 0 && ways[w].key == key) {
        ways[w].used = ++clock_;
        return ways[w];
      }
      if (ways[w].used < out->used) out = ways + w;  // empty or least recently used
    }
    *out = Slot();
    out->used = ++clock_;
    out->key = key;
    // spread the shapes' probes over runs: probing every op on the same run would make
    // that whole run solo
    out->countdown = kFirstProbe + static_cast<int>(key >> 61);
    return *out;
  }
  Slot slots_[kSets * kWays];
  uint64_t clock_ = 0;
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
  // placement (thread_pool.cc): awaited threads found queued and moved onto the waiter's
  // core, and workers that moved off the caller's core; counted always, cheap and rare
  int64_t pulls = 0;
  int64_t pushes = 0;
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
