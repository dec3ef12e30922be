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
// bounded time, then sleeps on a condition variable, waking every kWatchNs to check that
// the thread it waits for is running: one found queued behind another process is moved
// onto the waiter's core (placement.h).  When jobs stop paying (workers preempted by
// other processes), SoloPolicy (thread_pool.h) runs them in the caller.
//
// A task that throws does not take the process down (a throw out of a worker's thread
// function is std::terminate) nor leave the job half-live behind a caller that unwound
// (workers would still call the caller's dead std::function): the first exception is kept,
// the job's other tasks are claimed and skipped, and the caller rethrows it once every
// claimed task has ended.  ParallelFor then leaves the pool as it found it.
//
// QDSL_POOL_TEST_DELAY_US=n (tests only): the first worker sleeps n microseconds after
// each claim, before running the task, as a worker that another process preempts in the
// middle of a task does.  Results must not change; the other threads take the job's other
// tasks meanwhile (tests/runtime/test_pool_claims.py).
#include "threads/thread_pool.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "dispatch.h"
#include "threads/placement.h"

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

std::atomic<int64_t> stat_pulls{0}, stat_pushes{0};

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
    slots_.reset(workers > 0 ? new WorkerSlot[workers] : nullptr);
    for (int i = 0; i < workers; ++i) threads_.emplace_back([this, i] { Work(i, i == 0 ? test_delay_us_ : 0); });
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
    const ThreadId me = Me();
    const bool place = place_ && me.ok;
    if (place) {  // before the ticket: a worker that sees the job sees its caller
      caller_tid_.store(me.tid, std::memory_order_relaxed);
      caller_clock_.store(static_cast<int>(me.clock), std::memory_order_relaxed);
      caller_cpu_.store(CurrentCpu(), std::memory_order_relaxed);
      caller_live_.store(true, std::memory_order_relaxed);
    }
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
    const int64_t mine = Drain(0, -1, place);
    if (stats) {
      stat_parallel.Add(1);
      stat_tasks.Add(n);
      stat_caller.Add(mine);
    }
    const auto drained = std::chrono::steady_clock::now();
    auto all_done = [&] { return done_.load(std::memory_order_acquire) == n; };
    if (!all_done()) {
      // the workers holding tasks now, and their CPU clocks (placement)
      const int nw = place ? std::min(workers(), kWatched) : 0;
      int64_t c0[kWatched];
      for (int w = 0; w < nw; ++w)
        c0[w] = slots_[w].in_task.load(std::memory_order_relaxed) ? CpuNs(slots_[w].clock.load()) : -1;
      if (!SpinUntil(all_done)) {
        // sleep, looking every kWatchNs at the workers that hold tasks: one whose clock
        // stood still is queued, not running, and is pulled onto this core
        bool watch = nw > 0;
        std::unique_lock<std::mutex> lock(mu_);
        while (!all_done()) {
          if (watch) {
            lock.unlock();
            for (int w = 0; w < nw; ++w) {
              const int64_t c1 = slots_[w].in_task.load() ? CpuNs(slots_[w].clock.load()) : -1;
              if (c0[w] >= 0 && c1 >= 0 && c1 - c0[w] < kRanNs && PullHere(slots_[w].tid.load())) {
                stat_pulls.fetch_add(1, std::memory_order_relaxed);
                watch = false;  // one: two pulled onto this core would take turns on it
                break;
              }
              c0[w] = c1;
            }
            lock.lock();
            if (all_done()) break;
          }
          caller_live_.store(false);  // asleep: no worker need leave this core for it
          if (watch) {
            done_cv_.wait_for(lock, std::chrono::nanoseconds(kWatchNs));
          } else {
            done_cv_.wait(lock, all_done);
          }
          if (place) caller_live_.store(true);
        }
      }
    }
    if (place) {
      caller_live_.store(false, std::memory_order_relaxed);
      caller_left_ns_.store(NowNs(), std::memory_order_relaxed);
    }
    const auto end = std::chrono::steady_clock::now();
    if (stats) stat_tail_ns.Add(ns(end - drained));
    if (failed_.load(std::memory_order_acquire)) {
      // every claimed task has ended (done_ == n), so no thread reads fn_ or error_ now
      std::exception_ptr e = std::move(error_);
      error_ = nullptr;
      failed_.store(false, std::memory_order_relaxed);
      std::rethrow_exception(e);  // the job's time says nothing of its shape: not recorded
    }
    if (adapt_) policy_.Record(key, /*solo=*/false, ns(end - posted));
    return true;
  }

 private:
  // Claims and runs tasks until the current job has none left; returns how many it ran.
  // `delay_us` > 0: sleep that long after each claim (QDSL_POOL_TEST_DELAY_US).  `worker`:
  // the worker's index, -1 for the caller; `place`: keep the placement records.
  int64_t Drain(int64_t delay_us, int worker, bool place) {
    int64_t ran = 0;
    uint64_t t = ticket_.load(std::memory_order_acquire);
    while (HasTask(t)) {
      if (!ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
      if (place) {
        const int cpu = CurrentCpu();
        if (worker < 0) {
          caller_cpu_.store(cpu, std::memory_order_relaxed);
        } else {
          slots_[worker].in_task.store(true, std::memory_order_relaxed);
          // running on the caller's core while the caller is awake: it is queued behind us
          if (cpu >= 0 && caller_live_.load(std::memory_order_relaxed) &&
              caller_cpu_.load(std::memory_order_relaxed) == cpu && PushAway())
            stat_pushes.fetch_add(1, std::memory_order_relaxed);
        }
      }
      if (delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
      if (!failed_.load(std::memory_order_acquire)) {  // after a failure the rest are skipped
        try {
          (*fn_.load(std::memory_order_acquire))(Next(t));
        } catch (...) {
          std::lock_guard<std::mutex> lock(mu_);
          if (!failed_.load(std::memory_order_relaxed)) {
            error_ = std::current_exception();
            failed_.store(true, std::memory_order_release);
          }
        }
      }
      ++ran;
      if (place && worker >= 0) slots_[worker].in_task.store(false, std::memory_order_relaxed);
      const int n = Count(t);
      if (done_.fetch_add(1, std::memory_order_acq_rel) + 1 == n) {
        { std::lock_guard<std::mutex> lock(mu_); }  // the caller may be between its check and its wait
        done_cv_.notify_one();
      }
      t = ticket_.load(std::memory_order_acquire);
    }
    return ran;
  }

  void Work(int index, int64_t delay_us) {
    const ThreadId me = Me();
    const bool place = place_ && me.ok;
    slots_[index].tid.store(me.tid);
    slots_[index].clock.store(static_cast<int>(me.clock));
    for (;;) {
      // seq_cst: against Run's ticket store and sleepers_ load (a job posted while this
      // worker goes to sleep is either seen here or followed by a notify)
      auto ready = [&] { return stop_.load() || HasTask(ticket_.load()); };
      if (!ready()) {
        // the caller, if it is in a job or between two (placement): its CPU clock now
        int caller = 0, clock = 0;
        int64_t c0 = -1;
        if (place && (caller_live_.load() || NowNs() - caller_left_ns_.load() < kBetweenJobsNs)) {
          caller = caller_tid_.load();
          clock = caller_clock_.load();
          c0 = CpuNs(clock);
        }
        if (!SpinUntil(ready)) {
          // sleep, looking every kWatchNs at the caller while it is in a job (or between
          // two): if its clock stood still it is queued, and is pulled onto this core
          std::unique_lock<std::mutex> lock(mu_);
          sleepers_.fetch_add(1);
          while (!ready()) {
            if (c0 >= 0) {
              lock.unlock();
              const bool live = caller_tid_.load() == caller &&
                                (caller_live_.load() || NowNs() - caller_left_ns_.load() < kBetweenJobsNs);
              const int64_t c1 = live ? CpuNs(clock) : -1;
              if (c1 >= 0 && c1 - c0 < kRanNs && PullHere(caller)) {
                stat_pulls.fetch_add(1, std::memory_order_relaxed);
                c0 = -1;  // it runs here now: sleep until the next job
              } else {
                c0 = c1;
              }
              lock.lock();
              if (ready()) break;
            }
            if (c0 >= 0) {
              cv_.wait_for(lock, std::chrono::nanoseconds(kWatchNs));
            } else {
              cv_.wait(lock, ready);
            }
          }
          sleepers_.fetch_sub(1);
        }
      }
      if (stop_.load()) return;
      Drain(delay_us, index, place);
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
  std::atomic<bool> failed_{false};  // a task of the current job threw
  // placement: the current job's caller (thread id, CPU clock, the core it last claimed
  // on; live: in the job and awake; left: when it last left a job), and per worker its
  // ids and whether it holds a task
  static constexpr int kWatched = 8;  // workers the caller looks at before sleeping
  static constexpr int64_t kBetweenJobsNs = 1000000;
  static constexpr int64_t kWatchNs = 200000;  // between looks at the awaited thread
  struct alignas(64) WorkerSlot {
    std::atomic<int> tid{0}, clock{0};
    std::atomic<bool> in_task{false};
  };
  std::unique_ptr<WorkerSlot[]> slots_;
  std::atomic<int> caller_tid_{0}, caller_clock_{0}, caller_cpu_{-1};
  std::atomic<bool> caller_live_{false};
  std::atomic<int64_t> caller_left_ns_{0};
  const bool place_ = PlaceOn();
  std::exception_ptr error_;         // its exception (set under mu_, taken by the caller)
  uint32_t seq_ = 0;  // under run_mu_
  SoloPolicy policy_;  // under run_mu_
  const bool adapt_ = [] {
    const char* v = std::getenv("QDSL_POOL_ADAPT");
    return v == nullptr || !(v[0] == '0' && v[1] == '\0');
  }();
  const int64_t test_delay_us_ = [] {
    const char* v = std::getenv("QDSL_POOL_TEST_DELAY_US");
    const long us = v != nullptr ? std::atol(v) : 0;
    return static_cast<int64_t>(us > 0 ? us : 0);
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
  // in_parallel is set for the whole call and restored however it ends (a task may throw):
  // left set, every later ParallelFor from this thread would run serially
  struct InParallel {
    bool outer = in_parallel;
    InParallel() { in_parallel = true; }
    ~InParallel() { in_parallel = outer; }
  } mark;
  const bool ran = pool.Run(claims, SoloPolicy::Key(n, work), [&](int c) {
    InParallel task;  // on a worker: nested calls inside the task run serially
    for (int i = c * per, e = std::min(n, i + per); i < e; ++i) fn(i);
  });
  if (!ran) {
    if (stats_on.load(std::memory_order_relaxed)) stat_serial.Add(1);
    for (int i = 0; i < n; ++i) fn(i);
  }
}

void EnablePoolStats(bool on) { stats_on.store(on); }

PoolStats GetPoolStats() {
  PoolStats s;
  s.parallel_jobs = stat_parallel.v.load();
  s.serial_jobs = stat_serial.v.load();
  s.tasks = stat_tasks.v.load();
  s.caller_claims = stat_caller.v.load();
  s.tail_wait_ns = stat_tail_ns.v.load();
  s.pulls = stat_pulls.load();
  s.pushes = stat_pushes.load();
  return s;
}

}  // namespace qdsl
