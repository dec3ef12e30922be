// C ABI implementation: converts arguments to views, calls the front doors, and turns
// a Status (or a C++ exception such as std::bad_alloc) into a code + message.
#include "bindings/c_api.h"
#include "bindings/guard.h"

#include <cstring>
#include <memory>
#include <vector>
#include <exception>
#include <new>

#include "dispatch.h"
#include "qdsl/gemm.h"

namespace {

using qdsl::bindings::Guard;
using qdsl::bindings::Report;

qdsl::GemmOutput MakeOutput(void* out, int out_dtype, int64_t ldo, const int32_t* mult, const int32_t* shift,
                            int64_t channels, int kind, int rounding, int32_t zp, int32_t qmin, int32_t qmax, qdsl::OutputStage* stage) {
  qdsl::GemmOutput o;
  o.data = out;
  o.dtype = static_cast<qdsl::DType>(out_dtype);
  o.ld = ldo;
  if (mult != nullptr) {
    stage->rescale.multiplier = mult;
    stage->rescale.shift = shift;
    stage->rescale.channels = channels;
    stage->rescale.kind = static_cast<qdsl::RescaleKind>(kind);
    stage->rescale.rounding = static_cast<qdsl::Rounding>(rounding);
    stage->zero_point = zp;
    stage->qmin = qmin;
    stage->qmax = qmax;
    o.stage = stage;
  }
  return o;
}

}  // namespace

extern "C" {

int qdsl_abi_version(void) { return 1; }

uint32_t qdsl_paths(int which) {
  switch (which) {
    case 0: return qdsl::CompiledPaths();
    case 1: return qdsl::CpuPaths();
    case 3: return qdsl::EvexVnniUsable() ? 1u : 0u;  // the AVX2 path runs EVEX vpdpbusd kernels
    default: return qdsl::EnabledPaths();
  }
}

void qdsl_set_enabled_paths(uint32_t mask) { qdsl::SetEnabledPaths(mask); }
void qdsl_set_num_threads(int n) { qdsl::SetNumThreads(n); }
int qdsl_get_num_threads(void) { return qdsl::NumThreads(); }

int qdsl_pack_weights(const int8_t* w, int64_t n, int64_t k, int bits, const int32_t* zero_point, void** handle,
                      char* err, int64_t errlen) {
  return Guard(err, errlen, [&]() -> qdsl::Status {
    QDSL_CHECK_ARG(handle != nullptr, "null handle pointer");
    *handle = nullptr;
    QDSL_CHECK_ARG(w != nullptr && n > 0 && k > 0, "bad weight arguments");
    QDSL_CHECK_ARG(bits == 1 || bits == 2 || bits == 4 || bits == 8, "weight bits must be 1, 2, 4 or 8");
    auto packed = std::make_unique<qdsl::PackedWeights>();
    qdsl::Status st;
    if (bits == 1) {
      st = qdsl::PackBinaryWeights(w, n, k, k, packed.get());
    } else {
      const int lo = -(1 << (bits - 1)), hi = (1 << (bits - 1)) - 1;
      std::vector<int16_t> values(static_cast<size_t>(n * k));
      for (int64_t r = 0; r < n; ++r) {
        const int32_t zp = zero_point ? zero_point[r] : 0;
        QDSL_CHECK_ARG(zp >= -255 && zp <= 255, "weight zero point %d outside [-255, 255]", zp);
        for (int64_t c = 0; c < k; ++c) {
          const int v = w[r * k + c];
          QDSL_CHECK_ARG(v >= lo && v <= hi, "weight [%lld][%lld] = %d outside int%d range", (long long)r,
                         (long long)c, v, bits);
          values[r * k + c] = static_cast<int16_t>(v - zp);
        }
      }
      st = qdsl::PackWeights(values.data(), n, k, k, packed.get());
    }
    if (st.ok()) *handle = packed.release();
    return st;
  });
}

void qdsl_free_weights(void* handle) { delete static_cast<qdsl::PackedWeights*>(handle); }

int64_t qdsl_weights_bytes(const void* handle) {
  const auto* w = static_cast<const qdsl::PackedWeights*>(handle);
  return w->bits == 1 ? w->n * w->kwords * 8 : w->panels * w->panel_bytes;
}

int qdsl_bitpack(const int8_t* a, int64_t m, int64_t k, uint64_t* out, int64_t kwords, char* err, int64_t errlen) {
  return Guard(err, errlen, [&] { return qdsl::BitpackSigns(a, m, k, k, out, kwords); });
}

int qdsl_gemm(const void* a, int a_dtype, int64_t m, int64_t k, int64_t lda, int32_t a_zp, int32_t a_max,
              const void* weights,
              const int32_t* bias, void* out, int out_dtype, int64_t ldo, const int32_t* mult, const int32_t* shift,
              int64_t channels, int kind, int rounding, int32_t out_zp, int32_t qmin, int32_t qmax, uint32_t path, char* err,
              int64_t errlen) {
  return Guard(err, errlen, [&]() -> qdsl::Status {
    QDSL_CHECK_ARG(weights != nullptr, "null weights handle");
    QDSL_CHECK_ARG(a_dtype == 0 || a_dtype == 1, "activation dtype code %d is not int8/uint8", a_dtype);
    QDSL_CHECK_ARG(out_dtype >= 0 && out_dtype <= 2, "bad output dtype code %d", out_dtype);
    qdsl::ActView av;
    av.data = a;
    av.dtype = static_cast<qdsl::DType>(a_dtype);
    av.rows = m;
    av.cols = k;
    av.ld = lda;
    av.zero_point = a_zp;
    av.max_code = a_max;
    qdsl::OutputStage stage;
    const qdsl::GemmOutput o = MakeOutput(out, out_dtype, ldo, mult, shift, channels, kind, rounding, out_zp, qmin, qmax, &stage);
    return qdsl::Gemm(av, *static_cast<const qdsl::PackedWeights*>(weights), bias, o, path);
  });
}

int qdsl_gemm_i32(const void* a, int a_dtype, int64_t m, int64_t k, int32_t a_zp, const void* weights, void* out,
                  uint32_t path) {
  if (weights == nullptr) return static_cast<int>(qdsl::StatusCode::kInvalidArgument);
  const int64_t n = static_cast<const qdsl::PackedWeights*>(weights)->n;
  return qdsl_gemm(a, a_dtype, m, k, k, a_zp, 255, weights, nullptr, out, 2, n, nullptr, nullptr, 0, 0, 0, 0, 0, 0, path,
                   nullptr, 0);
}

int qdsl_binary_gemm(const uint64_t* a, int64_t m, int64_t lda, const void* weights, const int32_t* bias, void* out,
                     int out_dtype, int64_t ldo, const int32_t* mult, const int32_t* shift, int64_t channels,
                     int kind, int rounding, int32_t out_zp, int32_t qmin, int32_t qmax, uint32_t path, char* err, int64_t errlen) {
  return Guard(err, errlen, [&]() -> qdsl::Status {
    QDSL_CHECK_ARG(weights != nullptr, "null weights handle");
    QDSL_CHECK_ARG(out_dtype >= 0 && out_dtype <= 2, "bad output dtype code %d", out_dtype);
    qdsl::OutputStage stage;
    const qdsl::GemmOutput o = MakeOutput(out, out_dtype, ldo, mult, shift, channels, kind, rounding, out_zp, qmin, qmax, &stage);
    return qdsl::BinaryGemm(a, m, lda, *static_cast<const qdsl::PackedWeights*>(weights), bias, o, path);
  });
}

int qdsl_requantize(const int32_t* acc, int64_t rows, int64_t channels, const int32_t* mult, const int32_t* shift,
                    int64_t stage_channels, int kind, int rounding, int32_t out_zp, int32_t qmin, int32_t qmax, void* out, int out_dtype,
                    uint32_t path, char* err, int64_t errlen) {
  return Guard(err, errlen, [&]() -> qdsl::Status {
    QDSL_CHECK_ARG(out_dtype == 0 || out_dtype == 1, "requantize output must be int8 or uint8");
    qdsl::OutputStage stage;
    stage.rescale.multiplier = mult;
    stage.rescale.shift = shift;
    stage.rescale.channels = stage_channels;
    stage.rescale.kind = static_cast<qdsl::RescaleKind>(kind);
    stage.rescale.rounding = static_cast<qdsl::Rounding>(rounding);
    stage.zero_point = out_zp;
    stage.qmin = qmin;
    stage.qmax = qmax;
    return qdsl::Requantize(acc, rows, channels, stage, out, static_cast<qdsl::DType>(out_dtype), path);
  });
}

}  // extern "C"
