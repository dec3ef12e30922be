// The implicit-GEMM conv micro-kernels' driver body (dispatch.h IgemmKernel and
// IgemmStageKernel) around the sums, compiled once per target: AVX2 (vpmaddubsw,
// igemm_u8s8_6x16_avx2.cc) and AVX512-VNNI (EVEX vpdpbusd on ymm, igemm_u8s8_vnni_avx512.cc).
// Only the inner loop differs, so the including file, after its target pragma, defines in
// qdsl::x86's anonymous namespace
//
//   template <int MR> void Accumulate(const uint8_t* const* rows, int64_t taps, int64_t cquads,
//                                     const uint8_t* panel, const int32_t* c, int64_t ldc,
//                                     const int32_t* init, __m256i (&acc)[MR][2]);
//
// (always_inline: the sums of MR <= 6 position rows into acc[r][0] channels 0..7 and
// acc[r][1] 8..15, starting from the row init when it is not null, else from c's rows r * ldc),
// and QDSL_IGEMM_U8S8 / QDSL_IGEMM_U8S8_STAGE (the entry points' names, declared in
// x86_kernels.h); then includes this file once.  Everything here lives in the anonymous
// namespace of that translation unit, so each target has its own copy.
#include <immintrin.h>

#include <cstdint>

#include "kernels/x86/igemm_6x16_avx2.h"
#include "kernels/x86/x86_kernels.h"
#include "requant/stage_f32_avx2.h"

namespace qdsl {
namespace x86 {
namespace {

template <int MR>
void Kernel(const uint8_t* const* rows, int64_t taps, int64_t cquads, const uint8_t* panel, int32_t* c, int64_t ldc,
            const int32_t* init) {
  __m256i acc[MR][2];
  Accumulate<MR>(rows, taps, cquads, panel, c, ldc, init, acc);
  StoreIgemmRows<MR>(acc, c, ldc);
}

// The prepared output stage (stage_f32_avx2.h) applied to MR rows of sums in registers:
// each row's 16 channels become 16 codes stored at out + r * ldo (the first `cols` of them
// when the panel runs past the last channel), no int32 stored or re-read.  Rows go two at a
// time through StageF32Codes32 (an odd last row as both halves); the row loop is unrolled so
// acc keeps constant indices and stays in registers (a rolled loop indexed it at run time,
// which kept all 12 sums on the stack and stored the start values there first).  An
// including file may define QDSL_IGEMM_STAGE_STORE as its own function of this signature
// (the AVX-512 one, igemm_u8s8_vnni_avx512.cc).
template <int MR, Rounding R>
__attribute__((always_inline)) inline void StoreStageAvx2(const __m256i (&acc)[MR][2], const StageF32& st,
                                                          int64_t c0, int cols, uint8_t* out, int64_t ldo,
                                                          bool out_signed) {
  const StageF32Vec v(st);
#pragma GCC unroll 3
  for (int r = 0; r < MR; r += 2) {
    const int r1 = r + 1 < MR ? r + 1 : r;
    const __m256i codes = StageF32Codes32<R>(acc[r][0], acc[r][1], acc[r1][0], acc[r1][1], st, c0, c0, v, out_signed);
    if (cols == 16) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + r * ldo), _mm256_castsi256_si128(codes));
      if (r1 != r) _mm_storeu_si128(reinterpret_cast<__m128i*>(out + r1 * ldo), _mm256_extracti128_si256(codes, 1));
    } else {
      alignas(32) uint8_t buf[32];
      _mm256_store_si256(reinterpret_cast<__m256i*>(buf), codes);
      for (int i = 0; i < cols; ++i) out[r * ldo + i] = buf[i];
      if (r1 != r)
        for (int i = 0; i < cols; ++i) out[r1 * ldo + i] = buf[16 + i];
    }
  }
}
#ifndef QDSL_IGEMM_STAGE_STORE
#define QDSL_IGEMM_STAGE_STORE StoreStageAvx2
#endif

// The same sums, then the prepared output stage from the registers (QDSL_IGEMM_STAGE_STORE).
template <int MR, Rounding R>
void KernelStage(const uint8_t* const* rows, int64_t taps, int64_t cquads, const uint8_t* panel, const int32_t* init,
                 const StageF32& st, int64_t c0, int cols, uint8_t* out, int64_t ldo, bool out_signed) {
  __m256i acc[MR][2];
  Accumulate<MR>(rows, taps, cquads, panel, nullptr, 0, init, acc);
  QDSL_IGEMM_STAGE_STORE<MR, R>(acc, st, c0, cols, out, ldo, out_signed);
}

template <Rounding R>
void StageRows(int rows, const uint8_t* const* ind, int64_t taps, int64_t cquads, const uint8_t* panel,
               const int32_t* init, const StageF32& st, int64_t c0, int cols, uint8_t* out, int64_t ldo,
               bool out_signed) {
  switch (rows) {
    case 1: return KernelStage<1, R>(ind, taps, cquads, panel, init, st, c0, cols, out, ldo, out_signed);
    case 2: return KernelStage<2, R>(ind, taps, cquads, panel, init, st, c0, cols, out, ldo, out_signed);
    case 3: return KernelStage<3, R>(ind, taps, cquads, panel, init, st, c0, cols, out, ldo, out_signed);
    case 4: return KernelStage<4, R>(ind, taps, cquads, panel, init, st, c0, cols, out, ldo, out_signed);
    case 5: return KernelStage<5, R>(ind, taps, cquads, panel, init, st, c0, cols, out, ldo, out_signed);
    default: return KernelStage<6, R>(ind, taps, cquads, panel, init, st, c0, cols, out, ldo, out_signed);
  }
}

}  // namespace

void QDSL_IGEMM_U8S8_STAGE(int rows, const uint8_t* const* ind, int64_t taps, int64_t cquads, const uint8_t* panel,
                           const int32_t* init, const StageF32& st, int64_t c0, int cols, uint8_t* out, int64_t ldo,
                           bool out_signed) {
  switch (st.rounding) {
    case Rounding::kHalfEven: return StageRows<Rounding::kHalfEven>(rows, ind, taps, cquads, panel, init, st, c0, cols, out, ldo, out_signed);
    case Rounding::kFloor: return StageRows<Rounding::kFloor>(rows, ind, taps, cquads, panel, init, st, c0, cols, out, ldo, out_signed);
    case Rounding::kHalfUp: return StageRows<Rounding::kHalfUp>(rows, ind, taps, cquads, panel, init, st, c0, cols, out, ldo, out_signed);
    default: return StageRows<Rounding::kHalfAway>(rows, ind, taps, cquads, panel, init, st, c0, cols, out, ldo, out_signed);
  }
}

void QDSL_IGEMM_U8S8(int rows, const uint8_t* const* ind, int64_t taps, int64_t cquads, const uint8_t* panel,
                     int32_t* c, int64_t ldc, const int32_t* init) {
  static constexpr IgemmRowsFn kRows[6] = {Kernel<1>, Kernel<2>, Kernel<3>, Kernel<4>, Kernel<5>, Kernel<6>};
  kRows[(rows < 6 ? rows : 6) - 1](ind, taps, cquads, panel, c, ldc, init);
}

}  // namespace x86
}  // namespace qdsl

#undef QDSL_IGEMM_U8S8
#undef QDSL_IGEMM_U8S8_STAGE
#undef QDSL_IGEMM_STAGE_STORE
