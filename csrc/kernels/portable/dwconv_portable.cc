// Portable depthwise conv of one channel plane (DwConvShape in qdsl/gemm.h): any stride and
// dilation.  Tap-major loops (one tap over a whole output row at a time), so for stride 1
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

}  // namespace portable
}  // namespace qdsl
