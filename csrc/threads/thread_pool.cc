// Fork-join pool behind ParallelFor.
//
// A job is n tasks claimed one at a time from a shared ticket, by the caller and by every
// worker that is awake, so whoever runs takes the tasks of whoever does not.  The caller
// returns when all n tasks are done, not when every worker has checked in: on an
// oversubscribed machine a worker may be descheduled for a whole time slice (milliseconds)
// before it even sees the job, and waiting for it made every op cost a time slice (issue
// 18: a busy core slowed graph runs 8-13x).  A worker that wakes late finds no task left
// and goes back to waiting.  The only wait left is for tasks already running.
//
// The ticket is one 64-bit word (job sequence, task count, next task), so a claim is one
// compare-exchange that also proves the job it claims from is still live: a worker that
// read a finished job's ticket fails the exchange instead of running a stale task.  The
// job's function pointer is read only after a successful claim: the job cannot finish
// (and its caller cannot return and post the next job) while a claimed task is unrun.
//
// Waiting (workers for a job, the caller for the last running tasks) spins for a short
// bounded time, then sleeps on a condition variable.  When jobs stop paying (workers
// preempted by other processes), SoloPolicy (thread_pool.h) runs them in the caller.
#include "threads/thread_pool.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#include "dispatch.h"

namespace qdsl {
namespace {

// Spin budget before sleeping.  Graph runs issue one parallel op after another with
// microseconds of serial code between them, and a futex wake-up of a sleeping worker
// costs tens of microseconds on these VMs, as long as a small op; a spinning worker picks
// the next op up at once.  On an oversubscribed machine the spin is CPU time taken from
// whoever holds the work, so it is kept short, and past the first stretch of pauses the
// spinner yields its core to any other runnable thread.  QDSL_SPIN_US (default 50)
// bounds it; 0 always sleeps.
int64_t SpinNanos() {
  static const int64_t ns = [] {
    const char* env = std::getenv("QDSL_SPIN_US");
    const long us = env != nullptr ? std::atol(env) : 50;
    return static_cast<int64_t>(us < 0 ? 0 : us) * 1000;
  }();
  return ns;
}

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

// True as soon as done() holds, false if it still does not after SpinNanos().
template <typename F>
bool SpinUntil(F done) {
  const int64_t budget = SpinNanos();
  if (budget <= 0) return done();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 1;; ++i) {
    if (done()) return true;
    if (i < 2048) {
      CpuRelax();
    } else {
      sched_yield();  // a no-op when this core has nothing else to run
    }
    if ((i & 63) == 0 &&
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count() > budget)
      return done();
  }
}

// Ticket fields: sequence (24 bits) | task count (20 bits) | next task (20 bits).
constexpr int kTaskBits = 20;
constexpr uint64_t kTaskMask = (uint64_t{1} << kTaskBits) - 1;
inline int Next(uint64_t t) { return static_cast<int>(t & kTaskMask); }
inline int Count(uint64_t t) { return static_cast<int>((t >> kTaskBits) & kTaskMask); }
inline bool HasTask(uint64_t t) { return Next(t) < Count(t); }

// PoolStats counters, each on its own cache line (workers bump theirs per claim)
struct alignas(64) Counter {
  std::atomic<int64_t> v{0};
  void Add(int64_t d) { v.fetch_add(d, std::memory_order_relaxed); }
};
std::atomic<bool> stats_on{false};
Counter stat_parallel, stat_serial, stat_tasks, stat_caller, stat_tail_ns;

class Pool {
 public:
  static constexpr int kMaxTasks = static_cast<int>(kTaskMask);

  ~Pool() { Resize(0); }

  void Resize(int workers) {
    std::unique_lock<std::mutex> run_lock(run_mu_);  // never while a job runs
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_.store(true);
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
    threads_.clear();
    stop_.store(false);
    for (int i = 0; i < workers; ++i) threads_.emplace_back([this] { Work(); });
    policy_ = SoloPolicy();  // parallel times taken with another thread count no longer apply
  }
  int workers() const { return static_cast<int>(threads_.size()); }

  // Runs fn(0..n-1), 1 <= n <= kMaxTasks, on the pool or (SoloPolicy) in the caller alone;
  // `key` names the job's shape for the policy.  False (nothing run) when another thread's
  // job holds the pool: the caller then runs its tasks itself rather than queue behind it.
  bool Run(int n, uint64_t key, const std::function<void(int)>& fn) {
    std::unique_lock<std::mutex> run_lock(run_mu_, std::try_to_lock);
    if (!run_lock.owns_lock()) return false;
    auto ns = [](std::chrono::steady_clock::duration d) {
      return std::chrono::duration_cast<std::chrono::nanoseconds>(d).count();
    };
    if (adapt_ && policy_.Solo(key)) {
      const auto start = std::chrono::steady_clock::now();
      for (int i = 0; i < n; ++i) fn(i);
      policy_.Record(key, /*solo=*/true, ns(std::chrono::steady_clock::now() - start));
      if (stats_on.load(std::memory_order_relaxed)) stat_serial.Add(1);
      return true;
    }
    const auto posted = std::chrono::steady_clock::now();
    fn_.store(&fn, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    seq_ = (seq_ + 1) & 0xffffff;
    // publishes fn_ and done_ with the job (release); seq_cst against sleepers_ below
    ticket_.store((static_cast<uint64_t>(seq_) << (2 * kTaskBits)) | (static_cast<uint64_t>(n) << kTaskBits));
    if (sleepers_.load() > 0) {
      { std::lock_guard<std::mutex> lock(mu_); }  // a worker between its check and its wait
      cv_.notify_all();
    }
    const bool stats = stats_on.load(std::memory_order_relaxed);
    const int64_t mine = Drain();
    if (stats) {
      stat_parallel.Add(1);
      stat_tasks.Add(n);
      stat_caller.Add(mine);
    }
    const auto drained = std::chrono::steady_clock::now();
    if (!SpinUntil([&] { return done_.load(std::memory_order_acquire) == n; })) {
      std::unique_lock<std::mutex> lock(mu_);
      done_cv_.wait(lock, [&] { return done_.load(std::memory_order_acquire) == n; });
    }
    const auto end = std::chrono::steady_clock::now();
    if (stats) stat_tail_ns.Add(ns(end - drained));
    if (adapt_) policy_.Record(key, /*solo=*/false, ns(end - posted));
    return true;
  }

 private:
  // Claims and runs tasks until the current job has none left; returns how many it ran.
  int64_t Drain() {
    int64_t ran = 0;
    uint64_t t = ticket_.load(std::memory_order_acquire);
    while (HasTask(t)) {
      if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
      (*fn_.load(std::memory_order_acquire))(Next(t));
      ++ran;
      const int n = Count(t);
      if (done_.fetch_add(1, std::memory_order_acq_rel) + 1 == n) {
        { std::lock_guard<std::mutex> lock(mu_); }  // the caller may be between its check and its wait
        done_cv_.notify_one();
      }
      t = ticket_.load(std::memory_order_acquire);
    }
    return ran;
  }

  void Work() {
    for (;;) {
      // seq_cst: against Run's ticket store and sleepers_ load (a job posted while this
      // worker goes to sleep is either seen here or followed by a notify)
      auto ready = [&] { return stop_.load() || HasTask(ticket_.load()); };
      if (!SpinUntil(ready)) {
        std::unique_lock<std::mutex> lock(mu_);
        sleepers_.fetch_add(1);
        cv_.wait(lock, ready);
        sleepers_.fetch_sub(1);
      }
      if (stop_.load()) return;
      Drain();
    }
  }

  std::mutex run_mu_, mu_;
  std::condition_variable cv_, done_cv_;
  std::vector<std::thread> threads_;
  std::atomic<const std::function<void(int)>*> fn_{nullptr};
  std::atomic<uint64_t> ticket_{0};
  std::atomic<int> done_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  uint32_t seq_ = 0;  // under run_mu_
  SoloPolicy policy_;  // under run_mu_
  const bool adapt_ = [] {
    const char* v = std::getenv("QDSL_POOL_ADAPT");
    return v == nullptr || !(v[0] == '0' && v[1] == '\0');
  }();
};

Pool& GetPool() {
  static Pool* pool = new Pool();  // leaked on purpose: no join at static destruction
  return *pool;
}

thread_local bool in_parallel = false;
std::mutex config_mu;
int num_threads = 0;

int DefaultThreads() {
  if (const char* env = std::getenv("QDSL_NUM_THREADS")) {
    const int n = std::atoi(env);
    if (n > 0) return n;
  }
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}

}  // namespace

void SetNumThreads(int n) {
  std::lock_guard<std::mutex> lock(config_mu);
  num_threads = n > 0 ? (n > 64 ? 64 : n) : DefaultThreads();
}

int NumThreads() {
  std::lock_guard<std::mutex> lock(config_mu);
  if (num_threads == 0) num_threads = DefaultThreads();
  return num_threads;
}

int ThreadsFor(int64_t work) { return work < kMinParallelWork ? 1 : NumThreads(); }

void ParallelFor(int n, const std::function<void(int)>& fn, int64_t work) {
  const int threads = n > 1 && !in_parallel && work >= kMinParallelWork ? NumThreads() : 1;
  if (threads <= 1) {
    if (stats_on.load(std::memory_order_relaxed)) stat_serial.Add(1);
    for (int i = 0; i < n; ++i) fn(i);
    return;
  }
  Pool& pool = GetPool();
  static std::mutex resize_mu;
  {
    std::lock_guard<std::mutex> lock(resize_mu);
    if (pool.workers() != threads - 1) pool.Resize(threads - 1);
  }
  // more tasks than a ticket counts: each claim runs a contiguous run of them
  const int per = (n + Pool::kMaxTasks - 1) / Pool::kMaxTasks, claims = (n + per - 1) / per;
  in_parallel = true;
  const bool ran = pool.Run(claims, SoloPolicy::Key(n, work), [&](int c) {
    const bool outer = in_parallel;
    in_parallel = true;
    for (int i = c * per, e = std::min(n, i + per); i < e; ++i) fn(i);
    in_parallel = outer;
  });
  if (!ran) {
    if (stats_on.load(std::memory_order_relaxed)) stat_serial.Add(1);
    for (int i = 0; i < n; ++i) fn(i);
  }
  in_parallel = false;
}

void EnablePoolStats(bool on) { stats_on.store(on); }

PoolStats GetPoolStats() {
  PoolStats s;
  s.parallel_jobs = stat_parallel.v.load();
  s.serial_jobs = stat_serial.v.load();
  s.tasks = stat_tasks.v.load();
  s.caller_claims = stat_caller.v.load();
  s.tail_wait_ns = stat_tail_ns.v.load();
  return s;
}

}  // namespace qdsl
