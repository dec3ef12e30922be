// Placement of pool threads on cores: placement.h says why.
#include "threads/placement.h"

#include <chrono>
#include <cstdlib>
#include <mutex>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#endif

namespace qdsl {

bool PlaceOn() {
  static const bool on = [] {
    const char* v = std::getenv("QDSL_POOL_PLACE");
    return v == nullptr || !(v[0] == '0' && v[1] == '\0');
  }();
  return on;
}

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

#if defined(__linux__)
namespace {
// One move at a time in the process.  Each move reads the thread's mask and writes it back;
// two interleaved moves of one thread (two workers pulling the caller, or a pull of a
// worker that is pushing itself away) would read each other's one-core mask and leave it
// in place.  A thread that finds another move under way skips its own.
std::mutex move_mu;
}  // namespace

ThreadId Me() {
  static thread_local const ThreadId me = [] {
    ThreadId t;
    clockid_t clock{};
    t.tid = static_cast<int>(syscall(SYS_gettid));
    t.ok = pthread_getcpuclockid(pthread_self(), &clock) == 0;
    t.clock = static_cast<int>(clock);
    return t;
  }();
  return me;
}

int64_t CpuNs(int clock) {
  timespec ts;
  return clock_gettime(static_cast<clockid_t>(clock), &ts) == 0 ? int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec : -1;
}

bool PullHere(int tid) {
  std::unique_lock<std::mutex> lock(move_mu, std::try_to_lock);
  if (!lock.owns_lock()) return false;
  const int cpu = sched_getcpu();
  cpu_set_t mask, one;
  if (tid <= 0 || cpu < 0 || cpu >= CPU_SETSIZE || sched_getaffinity(tid, sizeof mask, &mask) != 0 ||
      !CPU_ISSET(cpu, &mask))
    return false;
  CPU_ZERO(&one);
  CPU_SET(cpu, &one);
  if (sched_setaffinity(tid, sizeof one, &one) != 0) return false;
  sched_setaffinity(tid, sizeof mask, &mask);  // it stays where it is: that core is in its mask
  return true;
}

bool PushAway() {
  std::unique_lock<std::mutex> lock(move_mu, std::try_to_lock);
  if (!lock.owns_lock()) return false;
  const int cpu = sched_getcpu();
  cpu_set_t mask, others;
  if (cpu < 0 || cpu >= CPU_SETSIZE || sched_getaffinity(0, sizeof mask, &mask) != 0) return false;
  others = mask;
  CPU_CLR(cpu, &others);
  if (CPU_COUNT(&others) == 0 || sched_setaffinity(0, sizeof others, &others) != 0) return false;
  sched_setaffinity(0, sizeof mask, &mask);
  return true;
}

int CurrentCpu() { return sched_getcpu(); }
#else
ThreadId Me() { return ThreadId(); }
int64_t CpuNs(int) { return -1; }
bool PullHere(int) { return false; }
bool PushAway() { return false; }
int CurrentCpu() { return -1; }
#endif

}  // namespace qdsl
