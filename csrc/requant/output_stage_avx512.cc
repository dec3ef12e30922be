// AVX-512 output stage: the formulas of qdsl/requant.h on 16 lanes, the same algorithm as
// output_stage_avx2.cc (see its notes on SRDHM) with what AVX-512 adds: 64-bit arithmetic
// shifts and min/max (FIXED_SINGLE rounds its 64-bit products natively instead of through
// a biased logical shift), compare masks instead of blends, and masked loads/stores for
// the last columns instead of a scalar tail.  Every loop is specialized by kind, rounding
// and whether any lane shifts left; the final clamp is applied before the zero point is
// added (clamp(r, qmin - zp, qmax - zp) + zp), which replaces the AVX2 +-2^24 clamp.
// Stages the AVX2 version refuses (POT shifts outside [-31, 31]) take the scalar
// reference here too.
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")
// gcc 12 flags its own AVX-512 intrinsics (_mm512_undefined_* inside them) as uninitialized
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "kernels/x86/x86_kernels.h"
#include "ref/ref.h"

namespace qdsl {
namespace x86 {
namespace {

inline __m512i Srdhm(__m512i a, __m512i b) {
  const __m512i nudge = _mm512_set1_epi64(int64_t{1} << 30);
  const __m512i even = _mm512_add_epi64(_mm512_mul_epi32(a, b), nudge);
  const __m512i odd = _mm512_add_epi64(_mm512_mul_epi32(_mm512_srli_epi64(a, 32), _mm512_srli_epi64(b, 32)), nudge);
  const __m512i res = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 31), _mm512_slli_epi64(odd, 1));
  const __m512i minv = _mm512_set1_epi32(INT32_MIN);
  const __mmask16 both = _mm512_cmpeq_epi32_mask(a, minv) & _mm512_cmpeq_epi32_mask(b, minv);
  return _mm512_mask_mov_epi32(res, both, _mm512_set1_epi32(INT32_MAX));
}

inline __m512i Rdbp(__m512i x, __m512i e) {
  const __m512i one = _mm512_set1_epi32(1);
  const __m512i mask = _mm512_sub_epi32(_mm512_sllv_epi32(one, e), one);
  const __m512i rem = _mm512_and_si512(x, mask);
  const __mmask16 neg = _mm512_cmplt_epi32_mask(x, _mm512_setzero_si512());
  const __m512i threshold = _mm512_mask_add_epi32(_mm512_srli_epi32(mask, 1), neg, _mm512_srli_epi32(mask, 1), one);
  const __m512i f = _mm512_srav_epi32(x, e);
  return _mm512_mask_add_epi32(f, _mm512_cmpgt_epi32_mask(rem, threshold), f, one);
}

inline __m512i SatShiftLeft(__m512i x, __m512i l) {
  const __m512i y = _mm512_sllv_epi32(x, l);
  const __mmask16 ok = _mm512_cmpeq_epi32_mask(_mm512_srav_epi32(y, l), x);
  const __mmask16 neg = _mm512_cmplt_epi32_mask(x, _mm512_setzero_si512());
  const __m512i sat = _mm512_mask_mov_epi32(_mm512_set1_epi32(INT32_MAX), neg, _mm512_set1_epi32(INT32_MIN));
  return _mm512_mask_mov_epi32(sat, ok, y);
}

// Rounding increment of RoundShift: rem = v mod 2^s, h = 2^(s-1), f = v >> s.
template <typename Odd>
inline __mmask16 UpMask(Rounding rounding, __mmask16 gt, __mmask16 eq, __mmask16 nonneg, Odd odd) {
  switch (rounding) {
    case Rounding::kHalfAway: return gt | (eq & nonneg);
    case Rounding::kHalfEven: return gt | (eq & odd());
    case Rounding::kHalfUp: return gt | eq;
    default: return 0;
  }
}

// POT right shift by s in [0, 31] (s = 0 passes through) with the stage's rounding.
inline __m512i PotShift(__m512i x, __m512i s, Rounding rounding) {
  const __m512i one = _mm512_set1_epi32(1), zero = _mm512_setzero_si512();
  const __m512i f = _mm512_srav_epi32(x, s);
  const __m512i pow = _mm512_sllv_epi32(one, s);
  const __m512i rem = _mm512_and_si512(x, _mm512_sub_epi32(pow, one));
  const __m512i h = _mm512_srli_epi32(pow, 1);  // 2^(s-1); 0 when s = 0
  const __mmask16 gt = _mm512_cmpgt_epi32_mask(rem, h), eq = _mm512_cmpeq_epi32_mask(rem, h);
  const __mmask16 nonneg = _mm512_cmpge_epi32_mask(x, zero);
  __mmask16 up = UpMask(rounding, gt, eq, nonneg,
                              [&] { return _mm512_test_epi32_mask(f, one); });
  up &= _mm512_cmpneq_epi32_mask(s, zero);  // s = 0: exact, never round
  return _mm512_mask_add_epi32(f, up, f, one);
}

// The stage of one 16-column block with everything that does not depend on the row
// hoisted: y = clamp(Rescale(x), lo, hi) + zp with lo = qmin - zp, hi = qmax - zp, which
// equals clamp(Rescale(x) + zp, qmin, qmax) (no int32 overflow: |zp| <= 2^16).  kLeft =
// false when no lane shifts left (shift >= 0 everywhere, the usual case): no saturating
// left shift.  FIXED_SINGLE clamps its int64 results to [lo, hi] directly (sat32 first
// would not change that, [lo, hi] lies in int32) and interleaves the even and odd lanes
// with one permute.
template <RescaleKind kKind, Rounding kRounding, bool kLeft>
struct BlockStage {
  __m512i mult, left, right, lo, hi;
  __m512i m_odd, s_even, s_odd, h_even, h_odd, lo64, hi64;  // FIXED_SINGLE only

  BlockStage(__m512i m, __m512i shift, int32_t lo32, int32_t hi32) : mult(m) {
    const __m512i zero = _mm512_setzero_si512();
    left = _mm512_max_epi32(_mm512_sub_epi32(zero, shift), zero);
    right = _mm512_max_epi32(shift, zero);
    lo = _mm512_set1_epi32(lo32);
    hi = _mm512_set1_epi32(hi32);
    if (kKind == RescaleKind::kFixedSingle) {
      const __m512i low32 = _mm512_set1_epi64(0xFFFFFFFFll), c31 = _mm512_set1_epi64(31), one = _mm512_set1_epi64(1);
      m_odd = _mm512_srli_epi64(m, 32);
      s_even = _mm512_add_epi64(_mm512_and_si512(right, low32), c31);
      s_odd = _mm512_add_epi64(_mm512_srli_epi64(right, 32), c31);
      // bias added before the floor shift: 2^(s-1) (HALF_EVEN: 2^(s-1) - 1, plus f & 1)
      h_even = _mm512_srli_epi64(_mm512_sllv_epi64(one, s_even), 1);
      h_odd = _mm512_srli_epi64(_mm512_sllv_epi64(one, s_odd), 1);
      if (kRounding == Rounding::kHalfEven) {
        h_even = _mm512_sub_epi64(h_even, one);
        h_odd = _mm512_sub_epi64(h_odd, one);
      }
      lo64 = _mm512_set1_epi64(lo32);
      hi64 = _mm512_set1_epi64(hi32);
    }
  }

  // clamp(RoundShift(p, s), lo, hi) on eight int64 lanes (|p| < 2^62, s in [31, 62]: the
  // bias cannot overflow); every mode is one biased arithmetic shift:
  //   HALF_AWAY (p + h - [p < 0]) >> s    HALF_UP (p + h) >> s    FLOOR p >> s
  //   HALF_EVEN (p + h - 1 + ((p >> s) & 1)) >> s
  static inline __m512i Round64(__m512i p, __m512i s, __m512i h, __m512i lo64, __m512i hi64) {
    __m512i b;
    switch (kRounding) {
      case Rounding::kHalfAway: b = _mm512_add_epi64(p, _mm512_add_epi64(h, _mm512_srai_epi64(p, 63))); break;
      case Rounding::kHalfEven:
        b = _mm512_add_epi64(_mm512_add_epi64(p, h), _mm512_and_si512(_mm512_srav_epi64(p, s), _mm512_set1_epi64(1)));
        break;
      case Rounding::kHalfUp: b = _mm512_add_epi64(p, h); break;
      default: b = p; break;
    }
    return _mm512_max_epi64(_mm512_min_epi64(_mm512_srav_epi64(b, s), hi64), lo64);
  }

  inline __m512i operator()(__m512i x) const {
    const __m512i t = kLeft ? SatShiftLeft(x, left) : x;
    if (kKind == RescaleKind::kFixedSingle) {
      const __m512i even = Round64(_mm512_mul_epi32(t, mult), s_even, h_even, lo64, hi64);
      const __m512i odd = Round64(_mm512_mul_epi32(_mm512_srli_epi64(t, 32), m_odd), s_odd, h_odd, lo64, hi64);
      const __m512i idx = _mm512_set_epi32(30, 14, 28, 12, 26, 10, 24, 8, 22, 6, 20, 4, 18, 2, 16, 0);
      return _mm512_permutex2var_epi32(even, idx, odd);  // low dword of each int64 result
    }
    const __m512i r = kKind == RescaleKind::kFixed ? Rdbp(Srdhm(t, mult), right) : PotShift(t, right, kRounding);
    return _mm512_min_epi32(_mm512_max_epi32(r, lo), hi);
  }
};

// Stage of acc[rows][cols] (column c is channel c0 + c) into int8/uint8 (kBytes, the
// low byte of the clamped value is the result for either dtype) or int32.
template <RescaleKind kKind, Rounding kRounding, bool kLeft, bool kBytes>
void StageBlock(const int32_t* acc, int64_t rows, int64_t cols, int64_t lda, const OutputStage& stage, int64_t c0,
                void* out, int64_t ldo) {
  const Rescale& rs = stage.rescale;
  const bool per_tensor = rs.channels == 1;
  const __m512i zp = _mm512_set1_epi32(stage.zero_point);
  const int32_t lo = stage.qmin - stage.zero_point, hi = stage.qmax - stage.zero_point;
  using F = BlockStage<kKind, kRounding, kLeft>;
  const auto block = [&](const F& f, int64_t c, __mmask16 m) {
    if (m == 0xFFFF) {
      for (int64_t r = 0; r < rows; ++r) {
        const __m512i y = f(_mm512_loadu_si512(acc + r * lda + c));
        if (kBytes) {
          _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint8_t*>(out) + r * ldo + c),
                           _mm512_cvtepi32_epi8(_mm512_add_epi32(y, zp)));
        } else {
          _mm512_storeu_si512(static_cast<int32_t*>(out) + r * ldo + c, y);
        }
      }
    } else {
      for (int64_t r = 0; r < rows; ++r) {
        const __m512i y = f(_mm512_maskz_loadu_epi32(m, acc + r * lda + c));
        if (kBytes) {
          _mm_mask_storeu_epi8(static_cast<uint8_t*>(out) + r * ldo + c, m, _mm512_cvtepi32_epi8(_mm512_add_epi32(y, zp)));
        } else {
          _mm512_mask_storeu_epi32(static_cast<int32_t*>(out) + r * ldo + c, m, y);
        }
      }
    }
  };
  const auto tail = [&](int64_t c) {
    return cols - c >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (cols - c)) - 1);
  };
  if (per_tensor) {  // parameters set up once (the runtime calls this per row of 1 x P)
    const F f(_mm512_set1_epi32(rs.multiplier[0]), _mm512_set1_epi32(rs.shift[0]), lo, hi);
    for (int64_t c = 0; c < cols; c += 16) block(f, c, tail(c));
    return;
  }
  for (int64_t c = 0; c < cols; c += 16) {
    const __mmask16 m = tail(c);
    const F f(_mm512_maskz_loadu_epi32(m, rs.multiplier + c0 + c), _mm512_maskz_loadu_epi32(m, rs.shift + c0 + c), lo, hi);
    block(f, c, m);
  }
}

using StageFn = void (*)(const int32_t*, int64_t, int64_t, int64_t, const OutputStage&, int64_t, void*, int64_t);

template <bool kBytes, RescaleKind kKind, Rounding kRounding>
StageFn PickLeft(bool left) {
  return left ? StageBlock<kKind, kRounding, true, kBytes> : StageBlock<kKind, kRounding, false, kBytes>;
}

template <bool kBytes, RescaleKind kKind>
StageFn PickRounding(Rounding rounding, bool left) {
  switch (rounding) {
    case Rounding::kHalfAway: return PickLeft<kBytes, kKind, Rounding::kHalfAway>(left);
    case Rounding::kHalfEven: return PickLeft<kBytes, kKind, Rounding::kHalfEven>(left);
    case Rounding::kFloor: return PickLeft<kBytes, kKind, Rounding::kFloor>(left);
    default: return PickLeft<kBytes, kKind, Rounding::kHalfUp>(left);
  }
}

// The kernel for a stage whose parameters RequantAvx2Supports accepts (columns c0 ..
// c0 + cols - 1).
template <bool kBytes>
StageFn Pick(const OutputStage& stage, int64_t c0, int64_t cols) {
  const Rescale& rs = stage.rescale;
  bool left = false;
  if (rs.channels == 1) {
    left = rs.shift[0] < 0;
  } else {
    for (int64_t c = 0; c < cols && !left; ++c) left = rs.shift[c0 + c] < 0;
  }
  switch (rs.kind) {
    case RescaleKind::kFixed: return PickLeft<kBytes, RescaleKind::kFixed, Rounding::kHalfAway>(left);  // rounding unused
    case RescaleKind::kFixedSingle: return PickRounding<kBytes, RescaleKind::kFixedSingle>(rs.rounding, left);
    default: return PickRounding<kBytes, RescaleKind::kPot>(rs.rounding, left);
  }
}

}  // namespace

void RequantAvx512(const int32_t* acc, int64_t rows, int64_t cols, int64_t lda, const OutputStage& stage, int64_t c0,
                   void* out, int64_t ldo, bool out_signed) {
  if (!RequantAvx2Supports(stage)) {
    ref::Requant(acc, rows, cols, lda, stage, c0, out, ldo, out_signed);
    return;
  }
  Pick<true>(stage, c0, cols)(acc, rows, cols, lda, stage, c0, out, ldo);
}

void StageI32RowsAvx512(const int32_t* acc, int64_t rows, int64_t cols, int64_t lda, const OutputStage& stage,
                        int64_t c0, int32_t* out, int64_t ldo) {
  // per-column (channel c0 + c) stage into int32: y = clamp(rescale(acc), qmin, qmax), zero point 0
  if (!RequantAvx2Supports(stage) || stage.zero_point != 0) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) out[r * ldo + c] = ApplyStage(acc[r * lda + c], stage, c0 + c);
    return;
  }
  Pick<false>(stage, c0, cols)(acc, rows, cols, lda, stage, c0, out, ldo);
}

// ADD (docs/qgraph.md §4.4), the AVX2 kernel's algorithm and preconditions on 16 lanes with
// masked tails; dtype codes are the file's: 2 I8, 3 U8, 4 I32.
namespace {

inline __m512i LoadAdd(const void* x, int dtype, int64_t i, __mmask16 m) {
  if (dtype == 4) return _mm512_maskz_loadu_epi32(m, static_cast<const int32_t*>(x) + i);
  const __m128i b = _mm_maskz_loadu_epi8(m, static_cast<const uint8_t*>(x) + i);
  return dtype == 2 ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
}

bool AddInputOk(int dtype, const OutputStage& in, int pre) {
  const Rescale& r = in.rescale;
  if (r.channels != 1 || r.shift[0] < -31 || r.shift[0] > 31) return false;
  if (dtype == 4) return in.zero_point == 0 && pre == 0;
  return pre <= 23;
}

}  // namespace

bool AddAvx512(const void* x0, int dtype0, const void* x1, int dtype1, int64_t n, const OutputStage* in, int pre_shift,
               const OutputStage& out_stage, uint8_t* out, bool out_signed) {
  if (!AddInputOk(dtype0, in[0], pre_shift) || !AddInputOk(dtype1, in[1], pre_shift)) return false;
  if (out_stage.rescale.channels != 1 || !RequantAvx2Supports(out_stage)) return false;
  // Chunks of kChunk elements (in L1) in passes, each a loop specialized by Pick:
  //   d_k = (x_k - zp_k) << pre;  t_k = sat32(rescale_k(d_k)) (skipped for POT by 2^0,
  //   the identity, and read in place for int32 inputs without zero point or pre-shift);
  //   total = sat32(t_0 + t_1);  out = the output stage of total.
  constexpr int64_t kChunk = 512;
  alignas(64) int32_t buf[2][kChunk];
  const void* xs[2] = {x0, x1};
  const int dts[2] = {dtype0, dtype1};
  OutputStage wide[2];  // the input rescales as int32 stages: zero point 0, no clamp
  StageFn fn[2];
  for (int k = 0; k < 2; ++k) {
    wide[k].rescale = in[k].rescale;
    wide[k].zero_point = 0;
    wide[k].qmin = INT32_MIN;
    wide[k].qmax = INT32_MAX;
    const bool ident = in[k].rescale.kind == RescaleKind::kPot && in[k].rescale.shift[0] == 0;
    fn[k] = ident ? nullptr : Pick<false>(wide[k], 0, 1);
  }
  const StageFn ofn = Pick<true>(out_stage, 0, 1);
  const __m512i imax = _mm512_set1_epi32(INT32_MAX);
  const __m128i pre = _mm_cvtsi32_si128(pre_shift);
  for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
    const int64_t len = std::min(kChunk, n - i0);
    const int32_t* t[2];
    for (int k = 0; k < 2; ++k) {
      const int32_t* src;
      if (dts[k] == 4 && in[k].zero_point == 0 && pre_shift == 0) {
        src = static_cast<const int32_t*>(xs[k]) + i0;
      } else {
        const __m512i zp = _mm512_set1_epi32(in[k].zero_point);
        for (int64_t i = 0; i < len; i += 16) {
          const __mmask16 m = len - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (len - i)) - 1);
          const __m512i d = _mm512_sll_epi32(_mm512_sub_epi32(LoadAdd(xs[k], dts[k], i0 + i, m), zp), pre);
          _mm512_store_si512(buf[k] + i, d);
        }
        src = buf[k];
      }
      if (fn[k]) {
        fn[k](src, 1, len, len, wide[k], 0, buf[k], len);
        src = buf[k];
      }
      t[k] = src;
    }
    // saturating int32 add: overflow iff both signs agree and the sum's sign differs
    for (int64_t i = 0; i < len; i += 16) {
      const __mmask16 m = len - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (len - i)) - 1);
      const __m512i a = _mm512_maskz_loadu_epi32(m, t[0] + i), b = _mm512_maskz_loadu_epi32(m, t[1] + i);
      const __m512i sum = _mm512_add_epi32(a, b);
      const __m512i ovf = _mm512_andnot_si512(_mm512_xor_si512(a, b), _mm512_xor_si512(a, sum));
      const __m512i sat = _mm512_xor_si512(_mm512_srai_epi32(a, 31), imax);
      _mm512_store_si512(buf[0] + i, _mm512_mask_mov_epi32(sum, _mm512_movepi32_mask(ovf), sat));
    }
    ofn(buf[0], 1, len, len, out_stage, 0, out + i0, len);
  }
  (void)out_signed;  // the clamped value's low byte is the result for either dtype
  return true;
}

void RequantI32Avx512(const int32_t* acc, int64_t n, const OutputStage& one, int32_t* out) {
  // one channel, zero point 0 (an I32 output stage): y = clamp(rescale(acc), qmin, qmax)
  if (!RequantAvx2Supports(one) || one.zero_point != 0) {
    for (int64_t i = 0; i < n; ++i) out[i] = ref::StageOne(acc[i], one);
    return;
  }
  Pick<false>(one, 0, 1)(acc, 1, n, n, one, 0, out, n);  // one row of n columns, per-tensor parameters
}

}  // namespace x86
}  // namespace qdsl
