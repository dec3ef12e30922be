// AVX2 ADD (docs/qgraph.md §4.4): t_i = rescale_i((x_i - zp_i) * 2^pre), y = stage(sat32(t_0 + t_1)).
//
// Runs when every intermediate provably fits int32 lanes: I8/U8 inputs with pre_shift
// <= 23 (|x - zp| <= 255), or I32 inputs with zero point 0 and pre_shift 0; per-tensor
// rescales of any kind with shifts in [-31, 31]; an output zero point within +-2^16.  Otherwise the
// caller's scalar loop runs.  dtype codes are the file's: 2 I8, 3 U8, 4 I32.
#pragma GCC target("avx2,fma,popcnt")
#include <immintrin.h>

#include <cstdint>

#include "kernels/x86/x86_kernels.h"
#include "ref/ref.h"
#include "requant/rescale_avx2.h"

namespace qdsl {
namespace x86 {
namespace {

inline __m256i Load(const void* x, int dtype, int64_t i) {
  if (dtype == 4) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const int32_t*>(x) + i));
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(x) + i));
  return dtype == 2 ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
}

inline int32_t LoadOne(const void* x, int dtype, int64_t i) {
  if (dtype == 4) return static_cast<const int32_t*>(x)[i];
  const uint8_t v = static_cast<const uint8_t*>(x)[i];
  return dtype == 2 ? static_cast<int8_t>(v) : v;
}

bool InputOk(int dtype, const OutputStage& in, int pre) {
  const Rescale& r = in.rescale;
  if (r.channels != 1 || r.shift[0] < -31 || r.shift[0] > 31) return false;
  if (dtype == 4) return in.zero_point == 0 && pre == 0;
  return pre <= 23;
}

}  // namespace

bool AddAvx2(const void* x0, int dtype0, const void* x1, int dtype1, int64_t n, const OutputStage* in, int pre_shift,
             const OutputStage& out_stage, uint8_t* out, bool out_signed) {
  if (!InputOk(dtype0, in[0], pre_shift) || !InputOk(dtype1, in[1], pre_shift)) return false;
  if (out_stage.rescale.channels != 1 || !RequantAvx2Supports(out_stage)) return false;
  const void* xs[2] = {x0, x1};
  const int dts[2] = {dtype0, dtype1};
  __m256i zp[2], mult[2], shift[2];
  for (int k = 0; k < 2; ++k) {
    zp[k] = _mm256_set1_epi32(in[k].zero_point);
    mult[k] = _mm256_set1_epi32(in[k].rescale.multiplier[0]);
    shift[k] = _mm256_set1_epi32(in[k].rescale.shift[0]);
  }
  const Rescale& ro = out_stage.rescale;
  const __m256i omult = _mm256_set1_epi32(ro.multiplier[0]), oshift = _mm256_set1_epi32(ro.shift[0]);
  const __m256i ozp = _mm256_set1_epi32(out_stage.zero_point);
  const __m256i qmin = _mm256_set1_epi32(out_stage.qmin), qmax = _mm256_set1_epi32(out_stage.qmax);
  const __m256i lim = _mm256_set1_epi32(1 << 24), nlim = _mm256_set1_epi32(-(1 << 24));
  const __m128i pre = _mm_cvtsi32_si128(pre_shift);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256i t[2];
    for (int k = 0; k < 2; ++k) {
      const __m256i d = _mm256_sll_epi32(_mm256_sub_epi32(Load(xs[k], dts[k], i), zp[k]), pre);
      t[k] = RescaleVec(d, in[k].rescale.kind, mult[k], shift[k], in[k].rescale.rounding);
    }
    // saturating int32 add: overflow iff both signs agree and the sum's sign differs
    const __m256i sum = _mm256_add_epi32(t[0], t[1]);
    const __m256i ovf = _mm256_andnot_si256(_mm256_xor_si256(t[0], t[1]), _mm256_xor_si256(t[0], sum));
    const __m256i sat = _mm256_xor_si256(_mm256_srai_epi32(t[0], 31), _mm256_set1_epi32(INT32_MAX));
    const __m256i total = _mm256_blendv_epi8(sum, sat, _mm256_srai_epi32(ovf, 31));
    __m256i y = RescaleVec(total, ro.kind, omult, oshift, ro.rounding);
    y = _mm256_min_epi32(_mm256_max_epi32(y, nlim), lim);
    y = _mm256_min_epi32(_mm256_max_epi32(_mm256_add_epi32(y, ozp), qmin), qmax);
    const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(y), _mm256_extracti128_si256(y, 1));
    const __m128i b = out_signed ? _mm_packs_epi16(w16, w16) : _mm_packus_epi16(w16, w16);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + i), b);
  }
  for (; i < n; ++i) {  // tail: same formula through the out-of-line scalar helpers
    int64_t total = 0;
    for (int k = 0; k < 2; ++k) {
      const int64_t d = static_cast<int64_t>(LoadOne(xs[k], dts[k], i)) - in[k].zero_point;
      total += ref::RescaleOneOutOfLine(d * (int64_t{1} << pre_shift), in[k].rescale);
    }
    out[i] = static_cast<uint8_t>(ref::StageOne(total < INT32_MIN ? INT32_MIN : (total > INT32_MAX ? INT32_MAX : total),
                                                out_stage));
  }
  return true;
}

}  // namespace x86
}  // namespace qdsl
