// The fake-quant front doors (c_api_fq.h): argument checks, path resolution, the kernel.
// No Guard/message buffer: the only failures are the caller's shapes or a forced path, and
// qdsl/quantizers/native_fq.py falls back to the torch passes on any nonzero return.
#include "bindings/c_api_fq.h"

#include "dispatch.h"
#include "kernels/fake_quant.h"

namespace {

int Resolve(uint32_t path, uint32_t* chosen) {
  const qdsl::Status st = qdsl::ResolvePath(path, chosen);
  return st.ok() ? 0 : static_cast<int>(st.code());
}

constexpr int kBadArgument = static_cast<int>(qdsl::StatusCode::kInvalidArgument);

}  // namespace

extern "C" {

int qdsl_fake_quant_f32(const float* x, float* y, int64_t n, float s, float inv, float lo, float hi, uint32_t path) {
  if (n < 0 || (n > 0 && (x == nullptr || y == nullptr))) return kBadArgument;
  uint32_t chosen = 0;
  if (const int rc = Resolve(path, &chosen)) return rc;
  if (n == 0) return 0;
  const qdsl::FakeQuantParams p{&s, &inv, nullptr, nullptr, lo, hi};
  qdsl::SelectFakeQuantF32Kernel(chosen)(x, y, 1, 1, n, p);
  return 0;
}

int qdsl_fake_quant_f32_channels(const float* x, float* y, int64_t outer, int64_t channels, int64_t inner,
                                 const float* s, const float* inv, const float* lo, const float* hi, float lo0,
                                 float hi0, uint32_t path) {
  if (outer < 0 || channels < 1 || inner < 0 || s == nullptr || inv == nullptr) return kBadArgument;
  if (outer > 0 && inner > 0 && (x == nullptr || y == nullptr)) return kBadArgument;
  uint32_t chosen = 0;
  if (const int rc = Resolve(path, &chosen)) return rc;
  if (outer == 0 || inner == 0) return 0;
  const qdsl::FakeQuantParams p{s, inv, lo, hi, lo0, hi0};
  qdsl::SelectFakeQuantF32Kernel(chosen)(x, y, outer, channels, inner, p);
  return 0;
}

int qdsl_fake_quant_minifloat_f32(const float* x, float* y, int64_t n, float s, float top, int32_t emin,
                                  int32_t mantissa, uint32_t nan_bits, uint32_t path) {
  if (n < 0 || (n > 0 && (x == nullptr || y == nullptr))) return kBadArgument;
  // the step exponents stay normal binary32 powers of two (emin - mantissa >= -126, top's binade <= 127)
  if (mantissa < 0 || mantissa > 22 || emin - mantissa < -126 || emin > 127 || !(top > 0.0f) || !(top < 1e37f) ||
      !(s > 0.0f))
    return kBadArgument;
  uint32_t chosen = 0;
  if (const int rc = Resolve(path, &chosen)) return rc;
  if (n == 0) return 0;
  const qdsl::MinifloatParams p{s, top, emin, mantissa, nan_bits & 0x7fffffffu};
  qdsl::SelectFakeQuantMinifloatKernel(chosen)(x, y, n, p);
  return 0;
}

int qdsl_minmax_f32(const float* x, int64_t n, float* out, uint32_t path) {
  if (n < 1 || x == nullptr || out == nullptr) return kBadArgument;
  uint32_t chosen = 0;
  if (const int rc = Resolve(path, &chosen)) return rc;
  qdsl::SelectMinMaxF32Kernel(chosen)(x, n, out, out + 1);
  return 0;
}

}  // extern "C"
