// A tiny fork-join pool: ParallelFor(n, f) runs f(0..n-1) on the pool threads plus the
// caller and returns when all are done.  Nested calls run serially in the caller.
//
// `work` estimates the call's cost in multiply-accumulates (or equivalent).  Below
// kMinParallelWork the tasks run serially in the caller: waking a sleeping worker and
// joining it costs tens of microseconds, more than a small GEMM takes (measured: 2
// threads ran (64,576,64) at 0.7x and a 768x768 GEMV at 0.3x of one thread).
#ifndef QDSL_RUNTIME_THREAD_POOL_H_
#define QDSL_RUNTIME_THREAD_POOL_H_

#include <cstdint>
#include <functional>
#include <limits>

namespace qdsl {

// ~8M MACs: about 25 us of single-core int8 work, several times the fork-join cost.
constexpr int64_t kMinParallelWork = int64_t{1} << 21;

void ParallelFor(int n, const std::function<void(int)>& fn,
                 int64_t work = std::numeric_limits<int64_t>::max());

}  // namespace qdsl

#endif  // QDSL_RUNTIME_THREAD_POOL_H_
