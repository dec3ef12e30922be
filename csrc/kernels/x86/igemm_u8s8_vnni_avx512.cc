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

}  // namespace

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
