// AVX512-VNNI form of the implicit-GEMM conv micro-kernels (dispatch.h IgemmKernel and
// IgemmStageKernel): the same contract, panels, row pointers and register stage as
// igemm_u8s8_6x16_avx2.cc, with each k-quad's vpmaddubsw + vpmaddwd(ones) + vpaddd replaced
// by one vpdpbusd on 256-bit registers (EVEX: AVX512_VNNI + AVX512VL, e.g. Zen 4, which has
// no VEX AVX-VNNI, so kPathAvxVnni / kPathAvx512 stay off there and the AVX2 path runs).
//
// vpdpbusd adds the four u8 x s8 products of a channel's quad to its int32 lane with no
// intermediate saturation (the non-"s" form wraps only the int32 sum), so its sums are the
// exact sums mod 2^32; the AVX2 sequence gives the same where it is exact (one int16 pair
// sum: MaddubsStepsFor >= 1, which the driver requires before choosing either kernel).  The
// results are therefore bit-identical, and the multiply uops per quad and row halve (2
// instead of 4 for 16 channels).  Selected by SelectIgemmKernel / SelectIgemmStageKernel
// on the AVX2 path when the CPU has AVX512_VNNI and AVX512VL (QDSL_IGEMM_VNNI=0: off).
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")
// gcc 12 flags its own AVX-512 intrinsics (_mm512_undefined_* inside them) as uninitialized, and
// notes the ABI of the (internal) AVX-512 helpers that return a zmm
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wpsabi"
#include <immintrin.h>

#include <cstdint>

#include "kernels/x86/x86_kernels.h"
#include "requant/stage_add_f32.h"
#include "requant/stage_f32_avx512.h"

namespace qdsl {
namespace x86 {
namespace {

// The sums of MR rows (registers once inlined): acc[r][0] channels 0..7, acc[r][1] 8..15.
template <int MR>
__attribute__((always_inline)) inline void Accumulate(const uint8_t* const* rows, int64_t taps, int64_t cquads,
                                                      const uint8_t* panel, const int32_t* c, int64_t ldc,
                                                      const int32_t* init, __m256i (&acc)[MR][2]) {
  for (int r = 0; r < MR; ++r) {
    const int32_t* from = init != nullptr ? init : c + r * ldc;
    acc[r][0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from));
    acc[r][1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + 8));
  }
  for (int64_t t = 0; t < taps; ++t) {
    const uint8_t* p[MR];
    for (int r = 0; r < MR; ++r) p[r] = rows[r * taps + t];
    const uint8_t* pt = panel + t * cquads * 64;
    for (int64_t j = 0; j < cquads; ++j) {
      const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pt + j * 64));
      const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pt + j * 64 + 32));
#pragma GCC unroll 6
      for (int r = 0; r < MR; ++r) {
        int32_t q;
        __builtin_memcpy(&q, p[r] + 4 * j, 4);
        const __m256i a = _mm256_set1_epi32(q);
        acc[r][0] = _mm256_dpbusd_epi32(acc[r][0], a, b0);
        acc[r][1] = _mm256_dpbusd_epi32(acc[r][1], a, b1);
      }
    }
  }
}

// The register stage on AVX-512 (stage_f32_avx512.h): each row's two halves as one zmm, the
// rounding in the fma, the clamp on the bit patterns, vpmovdb to 16 bytes and one store
// (masked for a partial panel), instead of the AVX2 stage's per-8-lane round, convert and
// zero point add, the packs and shuffles, and a byte loop for partial panels.  `bits`
// (optional) gets each row's sums as one zmm for a second stage (the twin kernel below).
template <int MR, Rounding R>
__attribute__((always_inline)) inline void StageRows512(const __m256i (&acc)[MR][2], const StageF32& st, int64_t c0,
                                                        int cols, uint8_t* out, int64_t ldo, __m512i (&x)[MR]) {
  const StageF32Vec512 v(st);
  const __m512 mf = _mm512_loadu_ps(st.mf.data() + c0);
  __m512i codes[MR];
  __m512i all = v.sign;  // (integer ands: vandps on zmm is AVX512DQ)
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    x[r] = _mm512_inserti64x4(_mm512_castsi256_si512(acc[r][0]), acc[r][1], 1);
    __m512 e;
    codes[r] = StageF32Codes16<R>(x[r], mf, v, &e);
    all = _mm512_and_si512(all, _mm512_castps_si512(e));
  }
  if (__builtin_expect(_mm512_testn_epi32_mask(all, v.sign) != 0, 0)) {
    for (int r = 0; r < MR; ++r) codes[r] = StageF32Exact16<R>(x[r], st, c0);
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1);
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    const __m128i b = _mm512_cvtepi32_epi8(codes[r]);
    if (cols == 16) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + r * ldo), b);
    } else {
      _mm_mask_storeu_epi8(out + r * ldo, keep, b);
    }
  }
}

template <int MR, Rounding R>
__attribute__((always_inline)) inline void StoreStage512(const __m256i (&acc)[MR][2], const StageF32& st, int64_t c0,
                                                         int cols, uint8_t* out, int64_t ldo, bool /*out_signed*/) {
  __m512i x[MR];
  StageRows512<MR, R>(acc, st, c0, cols, out, ldo, x);
}

}  // namespace
}  // namespace x86
}  // namespace qdsl

// Kernel, KernelStage and the entry points around Accumulate: igemm_u8s8_6x16_drive.h.
#define QDSL_IGEMM_U8S8 IgemmU8S8Avx512Vnni
#define QDSL_IGEMM_U8S8_STAGE IgemmU8S8StageAvx512Vnni
#define QDSL_IGEMM_STAGE_STORE StoreStage512
#include "kernels/x86/igemm_u8s8_6x16_drive.h"

namespace qdsl {
namespace x86 {
namespace {

// The stage kernel with the I32 twin: the codes as KernelStage writes them, then the int32
// stage s32 (StageI32Reg, exact: StageI32Twin16) of the same sums in registers, row r's
// first `cols` values to out32 + r * ld32.  A call with a lane whose x * 2^left leaves int32
// (RescaleOne saturates it) takes the reference rule for every row (StageI32Slow16).
template <int MR, Rounding R, Rounding R32>
void KernelStageTwin(const uint8_t* const* rows, int64_t taps, int64_t cquads, const uint8_t* panel,
                     const int32_t* init, const StageF32& st, int64_t c0, int cols, uint8_t* out, int64_t ldo,
                     const StageI32Reg& s32, int32_t* out32, int64_t ld32) {
  __m256i acc[MR][2];
  Accumulate<MR>(rows, taps, cquads, panel, nullptr, 0, init, acc);
  __m512i x[MR];
  StageRows512<MR, R>(acc, st, c0, cols, out, ldo, x);
  const StageI32Vec512 v(s32, c0);
  __m512i y[MR];
  __mmask16 bad = 0;
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) y[r] = StageI32Twin16<R32>(x[r], v, &bad);
  if (__builtin_expect(bad != 0, 0)) {
    for (int r = 0; r < MR; ++r) y[r] = StageI32Slow16<R32>(x[r], s32, c0);
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1);
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) _mm512_mask_storeu_epi32(out32 + r * ld32, keep, y[r]);
}

template <Rounding R, Rounding R32>
void TwinRows(int rows, const uint8_t* const* ind, int64_t taps, int64_t cquads, const uint8_t* panel,
              const int32_t* init, const StageF32& st, int64_t c0, int cols, uint8_t* out, int64_t ldo,
              const StageI32Reg& s32, int32_t* out32, int64_t ld32) {
  switch (rows) {
    case 1: return KernelStageTwin<1, R, R32>(ind, taps, cquads, panel, init, st, c0, cols, out, ldo, s32, out32, ld32);
    case 2: return KernelStageTwin<2, R, R32>(ind, taps, cquads, panel, init, st, c0, cols, out, ldo, s32, out32, ld32);
    case 3: return KernelStageTwin<3, R, R32>(ind, taps, cquads, panel, init, st, c0, cols, out, ldo, s32, out32, ld32);
    case 4: return KernelStageTwin<4, R, R32>(ind, taps, cquads, panel, init, st, c0, cols, out, ldo, s32, out32, ld32);
    case 5: return KernelStageTwin<5, R, R32>(ind, taps, cquads, panel, init, st, c0, cols, out, ldo, s32, out32, ld32);
    default: return KernelStageTwin<6, R, R32>(ind, taps, cquads, panel, init, st, c0, cols, out, ldo, s32, out32, ld32);
  }
}

template <Rounding R>
void TwinRounding32(int rows, const uint8_t* const* ind, int64_t taps, int64_t cquads, const uint8_t* panel,
                    const int32_t* init, const StageF32& st, int64_t c0, int cols, uint8_t* out, int64_t ldo,
                    const StageI32Reg& s32, int32_t* out32, int64_t ld32) {
  using Ro = Rounding;
  switch (s32.rounding) {
    case Ro::kHalfEven: return TwinRows<R, Ro::kHalfEven>(rows, ind, taps, cquads, panel, init, st, c0, cols, out, ldo, s32, out32, ld32);
    case Ro::kFloor: return TwinRows<R, Ro::kFloor>(rows, ind, taps, cquads, panel, init, st, c0, cols, out, ldo, s32, out32, ld32);
    case Ro::kHalfUp: return TwinRows<R, Ro::kHalfUp>(rows, ind, taps, cquads, panel, init, st, c0, cols, out, ldo, s32, out32, ld32);
    default: return TwinRows<R, Ro::kHalfAway>(rows, ind, taps, cquads, panel, init, st, c0, cols, out, ldo, s32, out32, ld32);
  }
}

// The fused residual ADD from registers (StageAddF32, requant/stage_add_f32.h): stage_add_avx2.cc's
// estimate lane for lane on 16 lanes (the same float operations in the same order, so the
// same codes and flags), the other input read at the same positions, codes narrowed by
// vpmovdb and stored (masked for a partial panel); flagged lanes take the exact chain.
enum AddOther { kOtherU8 = 0, kOtherS8 = 1, kOtherI32 = 2 };

struct AddConsts512 {
  __m512 b, k, smax, eps, lof, hif, thr, half;
  __m512i zp, abs;
  explicit AddConsts512(const StageAddF32& s)
      : b(_mm512_set1_ps(s.b)), k(_mm512_set1_ps(s.k)), smax(_mm512_set1_ps(s.smax)), eps(_mm512_set1_ps(s.eps)),
        lof(_mm512_set1_ps(s.lof)), hif(_mm512_set1_ps(s.hif)), thr(_mm512_set1_ps(s.thr)), half(_mm512_set1_ps(0.5f)),
        zp(_mm512_set1_epi32(s.zp)), abs(_mm512_set1_epi32(0x7FFFFFFF)) {}
};

template <int kOther>
__attribute__((always_inline)) inline __m512i OtherValues16(const uint8_t* x, __mmask16 keep) {
  if (kOther == kOtherI32) return _mm512_maskz_loadu_epi32(keep, x);
  const __m128i b = _mm_maskz_loadu_epi8(keep, x);
  return kOther == kOtherS8 ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
}

template <int MR, int kOther, bool kFloor>
void KernelStageAdd(const uint8_t* const* rows, int64_t taps, int64_t cquads, const uint8_t* panel,
                    const int32_t* init, const StageAddF32& s, int64_t c0, int cols, const uint8_t* other,
                    int64_t ldo, uint8_t* y, int64_t ldy) {
  __m256i acc[MR][2];
  Accumulate<MR>(rows, taps, cquads, panel, nullptr, 0, init, acc);
  const AddConsts512 v(s);
  const __m512 a = _mm512_loadu_ps(s.a.data() + c0);
  const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1);
  const int64_t esize = kOther == kOtherI32 ? 4 : 1;
  auto absf = [&](__m512 t) { return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(t), v.abs)); };
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    const __m512i x = _mm512_inserti64x4(_mm512_castsi256_si512(acc[r][0]), acc[r][1], 1);
    const uint8_t* xo = other + r * ldo * esize;
    const __m512 p0 = _mm512_mul_ps(_mm512_cvtepi32_ps(x), a);
    const __m512 q = _mm512_fmadd_ps(_mm512_cvtepi32_ps(OtherValues16<kOther>(xo, keep)), v.b, v.k);
    __m512 z = _mm512_add_ps(p0, q);
    if (kFloor) z = _mm512_sub_ps(z, v.half);
    z = _mm512_min_ps(_mm512_max_ps(z, v.lof), v.hif);
    const __m512 rz = _mm512_roundscale_ps(z, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 mag = _mm512_add_ps(absf(p0), absf(q));
    const __m512 dist = _mm512_fmadd_ps(mag, v.eps, absf(_mm512_sub_ps(z, rz)));
    const __mmask16 flag =
        (_mm512_cmp_ps_mask(dist, v.thr, _CMP_GT_OQ) | _mm512_cmp_ps_mask(mag, v.smax, _CMP_GT_OQ)) & keep;
    const __m128i codes = _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(rz), v.zp));
    uint8_t* yr = y + r * ldy;
    if (cols == 16) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(yr), codes);
    } else {
      _mm_mask_storeu_epi8(yr, keep, codes);
    }
    if (__builtin_expect(flag != 0, 0)) {
      alignas(64) int32_t xs[16];
      _mm512_store_si512(xs, x);
      for (unsigned bits = flag; bits != 0; bits &= bits - 1) {
        const int i = __builtin_ctz(bits);
        const int32_t xv = kOther == kOtherI32 ? reinterpret_cast<const int32_t*>(xo)[i]
                                               : (kOther == kOtherS8 ? static_cast<int8_t>(xo[i]) : xo[i]);
        yr[i] = static_cast<uint8_t>(StageAddOne(s, xs[i], c0 + i, xv));
      }
    }
  }
}

template <int kOther, bool kFloor>
void AddRows(int rows, const uint8_t* const* ind, int64_t taps, int64_t cquads, const uint8_t* panel,
             const int32_t* init, const StageAddF32& s, int64_t c0, int cols, const uint8_t* other, int64_t ldo,
             uint8_t* y, int64_t ldy) {
  switch (rows) {
    case 1: return KernelStageAdd<1, kOther, kFloor>(ind, taps, cquads, panel, init, s, c0, cols, other, ldo, y, ldy);
    case 2: return KernelStageAdd<2, kOther, kFloor>(ind, taps, cquads, panel, init, s, c0, cols, other, ldo, y, ldy);
    case 3: return KernelStageAdd<3, kOther, kFloor>(ind, taps, cquads, panel, init, s, c0, cols, other, ldo, y, ldy);
    case 4: return KernelStageAdd<4, kOther, kFloor>(ind, taps, cquads, panel, init, s, c0, cols, other, ldo, y, ldy);
    case 5: return KernelStageAdd<5, kOther, kFloor>(ind, taps, cquads, panel, init, s, c0, cols, other, ldo, y, ldy);
    default: return KernelStageAdd<6, kOther, kFloor>(ind, taps, cquads, panel, init, s, c0, cols, other, ldo, y, ldy);
  }
}

template <int kOther>
void AddRowsFor(int rows, const uint8_t* const* ind, int64_t taps, int64_t cquads, const uint8_t* panel,
                const int32_t* init, const StageAddF32& s, int64_t c0, int cols, const uint8_t* other, int64_t ldo,
                uint8_t* y, int64_t ldy) {
  if (s.rounding == Rounding::kFloor) return AddRows<kOther, true>(rows, ind, taps, cquads, panel, init, s, c0, cols, other, ldo, y, ldy);
  AddRows<kOther, false>(rows, ind, taps, cquads, panel, init, s, c0, cols, other, ldo, y, ldy);
}

}  // namespace

void IgemmU8S8StageAddAvx512Vnni(int rows, const uint8_t* const* ind, int64_t taps, int64_t cquads,
                                 const uint8_t* panel, const int32_t* init, const StageAddF32& s, int64_t c0, int cols,
                                 const uint8_t* other, int64_t ldo, uint8_t* y, int64_t ldy) {
  if (s.other_i32) return AddRowsFor<kOtherI32>(rows, ind, taps, cquads, panel, init, s, c0, cols, other, ldo, y, ldy);
  if (s.other_signed) return AddRowsFor<kOtherS8>(rows, ind, taps, cquads, panel, init, s, c0, cols, other, ldo, y, ldy);
  AddRowsFor<kOtherU8>(rows, ind, taps, cquads, panel, init, s, c0, cols, other, ldo, y, ldy);
}

void IgemmU8S8StageTwinAvx512Vnni(int rows, const uint8_t* const* ind, int64_t taps, int64_t cquads,
                                  const uint8_t* panel, const int32_t* init, const StageF32& st, int64_t c0, int cols,
                                  uint8_t* out, int64_t ldo, bool /*out_signed*/, const StageI32Reg& s32,
                                  int32_t* out32, int64_t ld32) {
  using Ro = Rounding;
  switch (st.rounding) {
    case Ro::kHalfEven: return TwinRounding32<Ro::kHalfEven>(rows, ind, taps, cquads, panel, init, st, c0, cols, out, ldo, s32, out32, ld32);
    case Ro::kFloor: return TwinRounding32<Ro::kFloor>(rows, ind, taps, cquads, panel, init, st, c0, cols, out, ldo, s32, out32, ld32);
    case Ro::kHalfUp: return TwinRounding32<Ro::kHalfUp>(rows, ind, taps, cquads, panel, init, st, c0, cols, out, ldo, s32, out32, ld32);
    default: return TwinRounding32<Ro::kHalfAway>(rows, ind, taps, cquads, panel, init, st, c0, cols, out, ldo, s32, out32, ld32);
  }
}

}  // namespace x86
}  // namespace qdsl
