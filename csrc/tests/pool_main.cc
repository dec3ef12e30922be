// The thread pool alone (threads/thread_pool.cc), built with this file by
// tests/runtime/test_pool_claims.py and run once per case:
//
//   pool_main JOBS TASKS THREADS SPIN_US THROW_AT
//
// runs JOBS ParallelFor calls of TASKS tasks at THREADS threads.  Each task spins SPIN_US
// microseconds and writes its own slot once; task THROW_AT (-1: none) of the first job
// throws.  Checks that every slot was written exactly once by one task, that the throw
// reaches the caller and the next jobs still run on the pool, then shrinks and regrows the
// pool and exits through the normal path.  On Linux it also checks that every thread of the
// process ends with the CPU mask it started with (placement moves threads between cores
// but leaves no mask changed).  Prints one line of counters for the test:
//
//   ok tasks=T caller=C parallel=P serial=S thrown=0|1 pulls=N pushes=M
//
// or "FAIL <what>" and exit code 1.
#include <atomic>
#include <chrono>
#if defined(__linux__)
#include <dirent.h>
#include <sched.h>
#endif
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <thread>
#include <vector>

#include "dispatch.h"
#include "threads/thread_pool.h"

namespace {

void Spin(int64_t us) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::microseconds(us);
  while (std::chrono::steady_clock::now() < end) {
  }
}

int Fail(const char* what) {
  std::printf("FAIL %s\n", what);
  return 1;
}

// True when every thread of this process may run on exactly the CPUs in `mask`.
bool AllThreadMasksAre(const std::vector<int>& mask) {
#if defined(__linux__)
  DIR* d = opendir("/proc/self/task");
  if (d == nullptr) return true;
  bool same = true;
  while (dirent* e = readdir(d)) {
    const int tid = std::atoi(e->d_name);
    cpu_set_t set;
    if (tid <= 0 || sched_getaffinity(tid, sizeof set, &set) != 0) continue;
    for (int c = 0; c < CPU_SETSIZE; ++c) same = same && (CPU_ISSET(c, &set) != 0) == (mask[c] != 0);
  }
  closedir(d);
  return same;
#else
  (void)mask;
  return true;
#endif
}

std::vector<int> MyMask() {
  std::vector<int> out(1024, 0);
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0)
    for (int c = 0; c < CPU_SETSIZE; ++c) out[c] = CPU_ISSET(c, &set) != 0;
#endif
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6) return Fail("usage: pool_main JOBS TASKS THREADS SPIN_US THROW_AT");
  const int jobs = std::atoi(argv[1]), tasks = std::atoi(argv[2]), threads = std::atoi(argv[3]);
  const int64_t spin_us = std::atol(argv[4]);
  const int throw_at = std::atoi(argv[5]);
  const std::vector<int> mask = MyMask();
  qdsl::SetNumThreads(threads);
  qdsl::EnablePoolStats(true);
  int thrown = 0;
  std::vector<std::atomic<int>> hits(static_cast<size_t>(tasks));
  for (int j = 0; j < jobs; ++j) {
    for (auto& h : hits) h.store(0);
    const bool throwing = j == 0 && throw_at >= 0 && throw_at < tasks;
    try {
      qdsl::ParallelFor(tasks, [&](int i) {
        Spin(spin_us);
        hits[static_cast<size_t>(i)].fetch_add(1);
        if (throwing && i == throw_at) throw std::runtime_error("task failed");
      });
    } catch (const std::runtime_error&) {
      ++thrown;
    }
    if (throwing) {
      // the job ended with the throw: tasks after it may have been skipped, none ran twice
      for (auto& h : hits)
        if (h.load() > 1) return Fail("a task ran twice in the throwing job");
      if (hits[static_cast<size_t>(throw_at)].load() != 1) return Fail("the throwing task did not run");
      continue;
    }
    for (auto& h : hits)
      if (h.load() != 1) return Fail("a task ran other than once");
  }
  if (throw_at >= 0 && throw_at < tasks && jobs > 0 && thrown != 1) return Fail("the throw did not reach the caller");
  const qdsl::PoolStats s = qdsl::GetPoolStats();
  // workers watch the caller for a millisecond after a job (placement): let that pass, so a
  // move in flight (its mask is one core for microseconds) is not taken for one left behind
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  if (!AllThreadMasksAre(mask)) return Fail("a thread's CPU mask changed");
  // shrink, regrow and shut down: Resize joins the workers it drops
  for (int t : {1, threads + 1, 2, threads}) {
    qdsl::SetNumThreads(t);
    std::atomic<int> n{0};
    qdsl::ParallelFor(2 * t + 1, [&](int) { n.fetch_add(1); });
    if (n.load() != 2 * t + 1) return Fail("a job after resizing lost tasks");
  }
  std::printf("ok tasks=%lld caller=%lld parallel=%lld serial=%lld thrown=%d pulls=%lld pushes=%lld\n",
              (long long)s.tasks, (long long)s.caller_claims, (long long)s.parallel_jobs, (long long)s.serial_jobs,
              thrown, (long long)s.pulls, (long long)s.pushes);
  return 0;
}
