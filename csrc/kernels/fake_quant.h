// One-pass fake quantization of float32 tensors for qdsl's evaluation path before freeze
// (qdsl/quantizers/native_fq.py).  Not a graph op: the Python quantizer calls it through
// the C ABI (bindings/c_api_fq.cc) instead of its four or five torch passes.
//
// The formula is the quantizer's torch passes (qdsl/quantizers/proxy.py, _affine_passes),
// one element at a time, every step rounding as torch's float32 kernel does:
//
//   v = x * inv                       binary32 multiply (inv = 1/s, computed by the caller)
//   r = round_half_even(v)            torch.round: roundps / nearbyint
//   r = lo if r < lo; hi if r > hi    torch.clamp with scalar bounds: r itself when equal or
//                                     NaN (so -0.0 stays -0.0, NaN stays NaN)
//   r = +0.0 if r is NaN              nan_to_num(0.0) (the zero point's code)
//   y = r * s                         binary32 multiply
//
// Layout: x and y are [outer][channels][inner] in memory; channel c uses s[c], inv[c] and
// bounds lo[c]/hi[c] (or lo0/hi0 when the arrays are null).  A per-tensor call is
// channels == 1.  Any dense tensor whose channel axis has stride `inner` maps onto this
// (contiguous, channels_last, any axis).
#ifndef QDSL_KERNELS_FAKE_QUANT_H_
#define QDSL_KERNELS_FAKE_QUANT_H_

#include <cstdint>

namespace qdsl {

struct FakeQuantParams {
  const float* s;    // [channels]
  const float* inv;  // [channels]
  const float* lo;   // [channels] or null: lo0
  const float* hi;   // [channels] or null: hi0
  float lo0, hi0;
};

using FakeQuantF32Kernel = void (*)(const float* x, float* y, int64_t outer, int64_t channels, int64_t inner,
                                    const FakeQuantParams& p);
// A minifloat grid with one scale (qdsl/quantizers/formats/minifloat.py, MinifloatOps.fake's
// float8 cast path), per element:
//
//   y = x / s                         binary32 division, as torch's x / s
//   y = -top if y < -top; top if y > top   (torch.clamp: NaN passes)
//   q = y rounded half-even to the grid: step 2^(max(e, emin) - mantissa), e = floor(log2|y|)
//                                     (torch's float8 cast; exact power-of-two scalings)
//   out = q * s                       the decode table's entry (q itself) times s
//   a NaN y gives nan_bits | its sign bit (what the table holds for a NaN code) times s,
//   which keeps that NaN.
struct MinifloatParams {
  float s;
  float top;       // the largest finite value (on the grid)
  int32_t emin;    // exponent of the smallest normal
  int32_t mantissa;
  uint32_t nan_bits;  // the decoded NaN, sign bit clear
};
using FakeQuantMinifloatKernel = void (*)(const float* x, float* y, int64_t n, const MinifloatParams& p);

// *lo = min x[i], *hi = max x[i] over n >= 1 values; both NaN when any x[i] is NaN.
using MinMaxF32Kernel = void (*)(const float* x, int64_t n, float* lo, float* hi);

namespace portable {
void FakeQuantF32(const float* x, float* y, int64_t outer, int64_t channels, int64_t inner, const FakeQuantParams& p);
void MinMaxF32(const float* x, int64_t n, float* lo, float* hi);
void FakeQuantMinifloat(const float* x, float* y, int64_t n, const MinifloatParams& p);
}  // namespace portable

namespace x86 {
void FakeQuantF32Avx2(const float* x, float* y, int64_t outer, int64_t channels, int64_t inner,
                      const FakeQuantParams& p);
void MinMaxF32Avx2(const float* x, int64_t n, float* lo, float* hi);
void FakeQuantMinifloatAvx2(const float* x, float* y, int64_t n, const MinifloatParams& p);
}  // namespace x86

// The kernels for a resolved path (dispatch.h ResolvePath): AVX2 from kPathAvx2 up, else portable.
FakeQuantF32Kernel SelectFakeQuantF32Kernel(uint32_t path);
MinMaxF32Kernel SelectMinMaxF32Kernel(uint32_t path);
FakeQuantMinifloatKernel SelectFakeQuantMinifloatKernel(uint32_t path);

}  // namespace qdsl

#endif  // QDSL_KERNELS_FAKE_QUANT_H_
