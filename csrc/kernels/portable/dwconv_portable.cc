// Portable depthwise convs: of one channel plane (DwConvShape in qdsl/gemm.h), any stride
// and dilation; and in NHWC over tap pointers (DwNhwcKernel).  Tap-major loops (one tap over a whole output row at a time), so for stride 1
// the inner loop is a contiguous multiply-add the compiler vectorizes.
#include <cstdint>

#include "kernels/portable/portable_kernels.h"

namespace qdsl {
namespace portable {

void DwConv(const int16_t* plane, int64_t ldp, const DwConvShape& s, const int32_t* taps, const int32_t* pairs,
            int32_t init, int32_t* acc, int64_t lda) {
  (void)pairs;
  for (int64_t oy = 0; oy < s.oh; ++oy) {
    int32_t* out = acc + oy * lda;
    for (int64_t ox = 0; ox < s.ow; ++ox) out[ox] = init;
    for (int64_t ky = 0; ky < s.kh; ++ky) {
      const int16_t* row = plane + (oy * s.sh + ky * s.dh) * ldp;
      for (int64_t kx = 0; kx < s.kw; ++kx) {
        const int32_t w = taps[ky * s.kw + kx];
        const int16_t* in = row + kx * s.dw;
        if (s.sw == 1) {
          for (int64_t ox = 0; ox < s.ow; ++ox) out[ox] += w * in[ox];
        } else {
          for (int64_t ox = 0; ox < s.ow; ++ox) out[ox] += w * in[ox * s.sw];
        }
      }
    }
  }
}

namespace {

// The sums in uint32: wrapping adds are defined there, and equal the exact int32 sum when
// it fits (the zero point is folded into init, so partial sums may leave the int32 range).
template <typename T>
void DwNhwc(const uint8_t* const* ptrs, int64_t n, int64_t ntaps, int64_t C, const int32_t* taps,
            const int32_t* init, int32_t* acc, int64_t ldc) {
  const int64_t cols = DwNhwcCols(C);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t* out = reinterpret_cast<uint32_t*>(acc + i * ldc);
    for (int64_t c = 0; c < cols; ++c) out[c] = static_cast<uint32_t>(init[c]);
    for (int64_t t = 0; t < ntaps; ++t) {
      const T* x = reinterpret_cast<const T*>(ptrs[i * ntaps + t]);
      const int32_t* w = taps + t * cols;
      for (int64_t c = 0; c < C; ++c) out[c] += static_cast<uint32_t>(w[c] * static_cast<int32_t>(x[c]));
    }
  }
}

}  // namespace

void DwConvNhwc(const uint8_t* const* ptrs, int64_t n, int64_t ntaps, int64_t C, bool x_signed, const int32_t* taps,
                const int32_t* pairs, const int32_t* init, int32_t* acc, int64_t ldc) {
  (void)pairs;
  if (x_signed) {
    DwNhwc<int8_t>(ptrs, n, ntaps, C, taps, init, acc, ldc);
  } else {
    DwNhwc<uint8_t>(ptrs, n, ntaps, C, taps, init, acc, ldc);
  }
}

}  // namespace portable
}  // namespace qdsl
