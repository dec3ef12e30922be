// Fork-join pool behind ParallelFor.  Workers sleep on a condition variable between
// jobs; tasks are handed out with an atomic counter so uneven tasks balance.
#include "threads/thread_pool.h"

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

// Waiting for work: spin (with a pause) for a short while, then sleep on the condition
// variable.  Graph runs issue one parallel op after another with microseconds of serial
// code between them, and a futex wake-up of a sleeping worker costs tens of microseconds
// on these VMs, as long as a small op; a spinning worker picks the next op up at once.
// QDSL_SPIN_US (default 200) bounds the spin; 0 always sleeps.
int64_t SpinNanos() {
  static const int64_t ns = [] {
    const char* env = std::getenv("QDSL_SPIN_US");
    const long us = env != nullptr ? std::atol(env) : 200;
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
    CpuRelax();
    if ((i & 63) == 0 &&
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count() > budget)
      return done();
  }
}

class Pool {
 public:
  ~Pool() { Resize(0); }

  void Resize(int workers) {
    std::unique_lock<std::mutex> run_lock(run_mu_);  // never while a job runs
    {
      std::unique_lock<std::mutex> lock(mu_);
      stop_.store(true);
      generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
    threads_.clear();
    stop_.store(false);
    // Each worker starts from the current generation, so a job posted before the
    // thread first runs is still seen as new.
    const uint64_t g = generation_.load();
    for (int i = 0; i < workers; ++i) threads_.emplace_back([this, g] { Work(g); });
  }
  int workers() const { return static_cast<int>(threads_.size()); }

  void Run(int n, const std::function<void(int)>& fn) {
    std::unique_lock<std::mutex> run_lock(run_mu_);  // one job at a time
    {
      std::unique_lock<std::mutex> lock(mu_);
      fn_ = &fn;
      n_ = n;
      next_.store(0);
      pending_.store(static_cast<int>(threads_.size()));
      generation_.fetch_add(1, std::memory_order_release);  // publishes fn_, n_ to spinning workers
    }
    cv_.notify_all();
    Drain();
    if (!SpinUntil([this] { return pending_.load(std::memory_order_acquire) == 0; })) {
      std::unique_lock<std::mutex> lock(mu_);
      done_cv_.wait(lock, [this] { return pending_.load() == 0; });
    }
    fn_ = nullptr;
  }

 private:
  void Drain() {
    for (int i = next_.fetch_add(1); i < n_; i = next_.fetch_add(1)) (*fn_)(i);
  }
  void Work(uint64_t seen) {
    for (;;) {
      if (!SpinUntil([&] { return generation_.load(std::memory_order_acquire) != seen; })) {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return generation_.load() != seen; });
      }
      seen = generation_.load(std::memory_order_acquire);
      if (stop_.load()) return;
      Drain();
      std::lock_guard<std::mutex> lock(mu_);  // the waiter may be asleep on done_cv_
      if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) done_cv_.notify_one();
    }
  }

  std::mutex run_mu_, mu_;
  std::condition_variable cv_, done_cv_;
  std::vector<std::thread> threads_;
  const std::function<void(int)>* fn_ = nullptr;
  int n_ = 0;
  std::atomic<int> pending_{0};
  std::atomic<int> next_{0};
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> stop_{false};
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
  const int threads = NumThreads();
  if (n <= 1 || threads <= 1 || in_parallel || work < kMinParallelWork) {
    for (int i = 0; i < n; ++i) fn(i);
    return;
  }
  Pool& pool = GetPool();
  static std::mutex resize_mu;
  {
    std::lock_guard<std::mutex> lock(resize_mu);
    if (pool.workers() != threads - 1) pool.Resize(threads - 1);
  }
  in_parallel = true;
  pool.Run(n, [&](int i) {
    const bool outer = in_parallel;
    in_parallel = true;
    fn(i);
    in_parallel = outer;
  });
  in_parallel = false;
}

}  // namespace qdsl
