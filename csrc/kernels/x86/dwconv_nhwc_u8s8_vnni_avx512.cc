// AVX512-VNNI form of the NHWC depthwise vpmaddubsw kernel (dwconv_nhwc_u8s8_avx2.cc: the
// same DwNhwcQuadKernel contract, weights, quads and register stage): each quad's
// vpmaddubsw + vpmaddwd(ones) + vpaddd is one vpdpbusd on 256-bit registers (EVEX: AVX512_VNNI
// + AVX512VL, e.g. Zen 4).  vpdpbusd adds the four u8 x s8 products to the int32 lane with no
// intermediate saturation, so it gives the exact sums (mod 2^32) that the AVX2 sequence gives
// where it applies (ConvParams::dwq: every pair sum within int16): bit-identical.  The lone
// last tap, the shuffles and the stage are the AVX2 kernel's (dwconv_nhwc_u8s8_drive.h).
// Selected by SelectDwNhwcQuadKernel where the CPU has the instructions (QDSL_IGEMM_VNNI=0:
// off, with the implicit-GEMM ones).
#pragma GCC target("avx2,fma,popcnt,avx512f,avx512bw,avx512vl,avx512vnni")
#include <immintrin.h>

#include <cstdint>

namespace qdsl {
namespace x86 {
namespace {

// s plus the quad sums by one vpdpbusd
__attribute__((always_inline)) inline __m256i QuadStep(__m256i s, __m256i q, __m256i w) {
  return _mm256_dpbusd_epi32(s, q, w);
}

}  // namespace
}  // namespace x86
}  // namespace qdsl

// Load32, Sums32, DwQuad and the entry point around QuadStep: dwconv_nhwc_u8s8_drive.h.
#define QDSL_DW_NHWC_QUAD DwConvNhwcQuadAvx512Vnni
#include "kernels/x86/dwconv_nhwc_u8s8_drive.h"
