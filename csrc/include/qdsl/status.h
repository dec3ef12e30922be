// Status: how every qdsl C++ error travels (never an abort, never an exception
// across the C ABI).  Functions that can fail return a Status; the C ABI turns it
// into an int code plus a message copied into a caller-owned buffer.
#ifndef QDSL_STATUS_H_
#define QDSL_STATUS_H_

#include <cstdarg>
#include <cstdio>
#include <string>

namespace qdsl {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,  // caller passed inconsistent shapes, dtypes, pointers
  kFormatError = 2,      // a .qgraph byte string is corrupt or truncated
  kUnsupported = 3,      // a valid request this build cannot run (op, dtype)
  kInternal = 4,         // out of memory or a broken invariant (a qdsl bug)
};

class Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status Ok() { return Status(); }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// printf-style constructor; messages are short, so a fixed buffer is enough.
inline Status MakeStatus(StatusCode code, const char* fmt, ...) {
  char buf[512];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, args);
  va_end(args);
  return Status(code, buf);
}

}  // namespace qdsl

// Front-door validation: return an error Status when `cond` is false.
#define QDSL_CHECK(cond, code, ...)                              \
  do {                                                           \
    if (!(cond)) return ::qdsl::MakeStatus((code), __VA_ARGS__); \
  } while (0)
#define QDSL_CHECK_ARG(cond, ...) QDSL_CHECK(cond, ::qdsl::StatusCode::kInvalidArgument, __VA_ARGS__)
#define QDSL_RETURN_IF_ERROR(expr)         \
  do {                                     \
    ::qdsl::Status _st = (expr);           \
    if (!_st.ok()) return _st;             \
  } while (0)

#endif  // QDSL_STATUS_H_
