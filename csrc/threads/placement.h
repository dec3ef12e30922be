// Placement of pool threads on cores (Linux; elsewhere every call is a no-op that reports
// failure).  Used by thread_pool.cc only.
//
// With one core taken by another process, three runnable threads share two cores, and the
// scheduler leaves one of ours queued behind the other process for a time slice
// (milliseconds) even when our other thread's core falls idle: it does not migrate a thread
// that ran a moment ago (cache hot) to an idle core.  A pool thread then waits for the
// queued one for the whole slice with its own core idle: a worker for the caller, which
// holds a task or the next job, or the caller for a worker holding a task.  So the waiter,
// once its spin is over, looks at the CPU clock of the thread it waits for; a clock that
// stood still means that thread is not running, and the waiter moves it onto its own core
// (PullHere) before sleeping there, so it runs at once.  The reverse: a worker that finds
// itself on the core of the caller while the caller is awake (so one of them is queued
// behind the other, while the other process may have a core to itself) moves itself off
// (PushAway).  Both moves are a pair of sched_setaffinity calls, the one core (or the other
// cores) and then the thread's own mask back, so no mask is left changed: the kernel only
// migrates the thread, as its balancer would.  For the microseconds between the two calls
// the moved thread's mask is the one core (visible to sched_getaffinity); moves are
// serialized, so two of them never read each other's mask.  On a quiet machine neither
// happens: the awaited thread is running, and a woken worker finds an idle core.
#ifndef QDSL_THREADS_PLACEMENT_H_
#define QDSL_THREADS_PLACEMENT_H_

#include <cstdint>

namespace qdsl {

// QDSL_POOL_PLACE=0 turns placement off (read once).
bool PlaceOn();

// A thread's CPU clock that moved less than this while its waiter spun: not running.
constexpr int64_t kRanNs = 5000;

// The calling thread as placement sees it: kernel thread id and CPU-time clock id.
struct ThreadId {
  int tid = 0;
  int clock = 0;
  bool ok = false;  // false: no placement for this thread (or platform)
};
ThreadId Me();

// CPU time of the thread with this clock id (ns), -1 if it cannot be read.
int64_t CpuNs(int clock);

// Moves thread `tid` onto the core the calling thread runs on, leaving its mask as it was.
bool PullHere(int tid);

// Moves the calling thread to another core it may use, leaving its mask as it was.
bool PushAway();

// The core the calling thread runs on, -1 if unknown.
int CurrentCpu();

// steady_clock now, in ns.
int64_t NowNs();

}  // namespace qdsl

#endif  // QDSL_THREADS_PLACEMENT_H_
