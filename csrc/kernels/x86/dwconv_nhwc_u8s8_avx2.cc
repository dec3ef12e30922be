// AVX2 depthwise conv in NHWC on u8 activations and s8 weights by vpmaddubsw
// (DwNhwcQuadKernel in dispatch.h), with the prepared output stage applied from registers:
// 32 channels per step, four kernel taps per step, through the tap pointers of the NHWC
// depthwise conv (conv_dw_nhwc.cc; padded taps point at a zero-point row).
//
// The int16 kernel (dwconv_nhwc_avx2.cc) widens every code to int16 and interleaves two taps:
// four shuffles per 16 channels and tap pair, which bound it.  Here the bytes of four taps
// t..t+3 of 32 channels (four 32-byte loads) are interleaved into per-channel quads
// (vpunpck{l,h}bw then vpunpck{l,h}wd: eight shuffles per 32 channels and four taps):
//   q_r, 128-bit lane L, dword i = (x_t, x_t+1, x_t+2, x_t+3) of channel 16L + 4r + i.
// vpmaddubsw with the quad's weight bytes (ConvParams::dwq_w, in that order) gives
// w_t*x_t + w_t+1*x_t+1 and w_t+2*x_t+2 + w_t+3*x_t+3 as int16, exact when no pair sum
// leaves the int16 range: |pair sum| <= max_code * pair_bound <= 32767 (MaddubsStepsFor >= 1,
// checked when the weights are prepared: u8 codes at most 127 with int8 weights always
// qualify, 2 * 127 * 128 = 32512).  vpmaddwd with ones adds the two halves of a channel into
// int32, where the sums wrap (exact for a total that fits: the zero point is folded into
// init).  A lone last tap (9 = 4 + 4 + 1, 25 = 6 * 4 + 1) is widened to int32 lanes in the
// same channel order (vpunpck with zero) and multiplied by vpmaddwd with (w, 0) int16 pairs;
// two or three last taps take a quad whose missing taps read the last tap with weight 0.
// Four vperm2i128 put the sums in channel order for StageF32Codes32 (requant/stage_f32_avx2.h).
#pragma GCC target("avx2,fma,popcnt")
#include <immintrin.h>

#include <cstdint>

namespace qdsl {
namespace x86 {
namespace {

// s plus the quad sums by vpmaddubsw (int16 pair sums) and vpmaddwd with ones
__attribute__((always_inline)) inline __m256i QuadStep(__m256i s, __m256i q, __m256i w) {
  return _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(q, w), _mm256_set1_epi16(1)));
}

}  // namespace
}  // namespace x86
}  // namespace qdsl

// Load32, Sums32, DwQuad and the entry point around QuadStep: dwconv_nhwc_u8s8_drive.h.
#define QDSL_DW_NHWC_QUAD DwConvNhwcQuadAvx2
#include "kernels/x86/dwconv_nhwc_u8s8_drive.h"
