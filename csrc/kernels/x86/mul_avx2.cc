// AVX2 MUL row (docs/qgraph.md §4.4): y[i] = stage((x0[i*s0] - zp0) * (x1[i*s1] - zp1)) for
// steps s0, s1 in {0, 1} (0: that operand is one broadcast value for the whole row, as a
// squeeze-excitation gate is).  Both differences are in [-255, 255], so the product is
// exact in int32 lanes (vpmulld) and RescaleVec applies the per-tensor stage exactly as
// RescaleOne does.  POT shifts outside [-31, 31] (legal, never exported) and zero points
// outside +-2^16 (never for I8/U8 outputs; StoreCodes8's precondition) are left to the
// scalar rule.  dtype codes are the file's: 2 I8, 3 U8.
#pragma GCC target("avx2,fma,popcnt")
#include <immintrin.h>

#include <cstdint>

#include "kernels/x86/x86_kernels.h"
#include "ref/ref.h"
#include "requant/rescale_avx2.h"

namespace qdsl {
namespace x86 {
namespace {

inline __m256i Load8(const uint8_t* x, int dtype, int64_t i) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(x + i));
  return dtype == 2 ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
}

inline int32_t LoadOne(const uint8_t* x, int dtype, int64_t i) {
  return dtype == 2 ? static_cast<int8_t>(x[i]) : static_cast<int32_t>(x[i]);
}

// The loop with the rescale kind and rounding fixed (their branches kept out of the loop).
template <RescaleKind K, Rounding R>
void Loop(const uint8_t* x0, int d0, int64_t s0, const uint8_t* x1, int d1, int64_t s1, int64_t n, __m256i zp0,
          __m256i zp1, __m256i mult, __m256i shift, __m256i ozp, __m256i qmin, __m256i qmax, bool out_signed,
          uint8_t* out) {
  // a broadcast operand's difference is one value for every lane
  const __m256i c0 = _mm256_set1_epi32(s0 == 0 ? LoadOne(x0, d0, 0) - _mm256_extract_epi32(zp0, 0) : 0);
  const __m256i c1 = _mm256_set1_epi32(s1 == 0 ? LoadOne(x1, d1, 0) - _mm256_extract_epi32(zp1, 0) : 0);
  for (int64_t i = 0; i + 8 <= n; i += 8) {
    const __m256i a = s0 == 0 ? c0 : _mm256_sub_epi32(Load8(x0, d0, i), zp0);
    const __m256i b = s1 == 0 ? c1 : _mm256_sub_epi32(Load8(x1, d1, i), zp1);
    StoreCodes8(RescaleVec(_mm256_mullo_epi32(a, b), K, mult, shift, R), ozp, qmin, qmax, out_signed, out + i);
  }
}

using LoopFn = decltype(&Loop<RescaleKind::kPot, Rounding::kHalfAway>);

template <RescaleKind K>
LoopFn PickRounding(Rounding r) {
  switch (r) {
    case Rounding::kHalfEven: return Loop<K, Rounding::kHalfEven>;
    case Rounding::kFloor: return Loop<K, Rounding::kFloor>;
    case Rounding::kHalfUp: return Loop<K, Rounding::kHalfUp>;
    default: return Loop<K, Rounding::kHalfAway>;
  }
}

LoopFn Pick(RescaleKind k, Rounding r) {
  if (k == RescaleKind::kPot) return PickRounding<RescaleKind::kPot>(r);
  if (k == RescaleKind::kFixedSingle) return PickRounding<RescaleKind::kFixedSingle>(r);
  return Loop<RescaleKind::kFixed, Rounding::kHalfAway>;  // FIXED always rounds half away
}

}  // namespace

bool MulAvx2(const uint8_t* x0, int dtype0, int64_t step0, const uint8_t* x1, int dtype1, int64_t step1, int64_t n,
             int32_t zp0, int32_t zp1, const OutputStage& st, uint8_t* out, bool out_signed) {
  const Rescale& r = st.rescale;
  if (r.channels != 1 || (r.kind == RescaleKind::kPot && (r.shift[0] < -31 || r.shift[0] > 31))) return false;
  if (st.zero_point < -(1 << 16) || st.zero_point > (1 << 16)) return false;
  if ((step0 != 0 && step0 != 1) || (step1 != 0 && step1 != 1)) return false;
  Pick(r.kind, r.rounding)(x0, dtype0, step0, x1, dtype1, step1, n, _mm256_set1_epi32(zp0), _mm256_set1_epi32(zp1),
                           _mm256_set1_epi32(r.multiplier[0]), _mm256_set1_epi32(r.shift[0]),
                           _mm256_set1_epi32(st.zero_point), _mm256_set1_epi32(st.qmin), _mm256_set1_epi32(st.qmax),
                           out_signed, out);
  for (int64_t i = n / 8 * 8; i < n; ++i) {  // the tail through the out-of-line scalar rule
    const int64_t p = static_cast<int64_t>(LoadOne(x0, dtype0, i * step0) - zp0) * (LoadOne(x1, dtype1, i * step1) - zp1);
    out[i] = static_cast<uint8_t>(ref::StageOne(p, st));
  }
  return true;
}

}  // namespace x86
}  // namespace qdsl
