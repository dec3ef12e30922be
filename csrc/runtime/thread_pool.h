// A tiny fork-join pool: ParallelFor(n, f) runs f(0..n-1) on the pool threads plus the
// caller and returns when all are done.  Nested calls run serially in the caller.
#ifndef QDSL_RUNTIME_THREAD_POOL_H_
#define QDSL_RUNTIME_THREAD_POOL_H_

#include <functional>

namespace qdsl {

void ParallelFor(int n, const std::function<void(int)>& fn);

}  // namespace qdsl

#endif  // QDSL_RUNTIME_THREAD_POOL_H_
