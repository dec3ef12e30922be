// The C ABI's error boundary, shared by every exported function: a Status becomes a return
// code plus a NUL-terminated message in the caller's buffer, and no C++ exception ever
// crosses into C (bad_alloc and std::exception become kInternal).
#ifndef QDSL_BINDINGS_GUARD_H_
#define QDSL_BINDINGS_GUARD_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <new>

#include "qdsl/status.h"

namespace qdsl {
namespace bindings {

inline int Report(const Status& st, char* err, int64_t errlen) {
  if (st.ok()) return 0;
  if (err != nullptr && errlen > 0) {
    const size_t n = std::min<size_t>(st.message().size(), static_cast<size_t>(errlen - 1));
    std::memcpy(err, st.message().data(), n);
    err[n] = 0;
  }
  return static_cast<int>(st.code());
}

template <typename F>
int Guard(char* err, int64_t errlen, F&& f) {
  try {
    return Report(f(), err, errlen);
  } catch (const std::bad_alloc&) {
    return Report(Status(StatusCode::kInternal, "out of memory"), err, errlen);
  } catch (const std::exception& e) {
    return Report(Status(StatusCode::kInternal, e.what()), err, errlen);
  }
}

}  // namespace bindings
}  // namespace qdsl

#endif  // QDSL_BINDINGS_GUARD_H_
