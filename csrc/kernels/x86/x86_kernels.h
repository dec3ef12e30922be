// AVX2 kernels (csrc/kernels/x86).  Only call them after dispatch checked the CPU.
#ifndef QDSL_KERNELS_X86_X86_KERNELS_H_
#define QDSL_KERNELS_X86_X86_KERNELS_H_

#include <cstdint>

#include "qdsl/gemm.h"
#include "qdsl/requant.h"

namespace qdsl {
struct StageF32;     // requant/stage_f32.h
struct StageI32Reg;  // requant/stage_f32.h
struct StageAddF32;  // requant/stage_add_f32.h
namespace x86 {

void GemmI16Avx2(int rows, const int16_t* a, int64_t lda, const uint8_t* panel, int64_t kpairs, int32_t* c,
                 int64_t ldc, bool accumulate);
void GemmI4Avx2(int rows, const int16_t* a, int64_t lda, const uint8_t* panel, int64_t kpairs, int32_t* c,
                int64_t ldc, bool accumulate);
void GemmI2Avx2(int rows, const int16_t* a, int64_t lda, const uint8_t* panel, int64_t kpairs, int32_t* c,
                int64_t ldc, bool accumulate);
// AVX-VNNI (csrc/kernels/x86/gemm_u8s8_6x16_avxvnni.cc): u8 rows x s8 panels, and
// s8 rows x u8 panels; C[rows x 16] (+)= over kquads k-quads.
void GemmU8S8AvxVnni(int rows, const uint8_t* a, int64_t lda, const uint8_t* panel, int64_t kquads, int32_t* c,
                     int64_t ldc, bool accumulate);
void GemmS8U8AvxVnni(int rows, const uint8_t* w, int64_t ldw, const uint8_t* panel, int64_t kquads, int32_t* c,
                     int64_t ldc, bool accumulate);
void GemmU8S8InitAvxVnni(int rows, const uint8_t* a, int64_t lda, const uint8_t* panel, int64_t kquads, int32_t* c,
                         int64_t ldc, bool accumulate, const int32_t* init);
// The same kernels EVEX-encoded (AVX512-VNNI + AVX512VL; gemm_u8s8_6x16_vnni_avx512.cc).
void GemmU8S8Avx512Vnni(int rows, const uint8_t* a, int64_t lda, const uint8_t* panel, int64_t kquads, int32_t* c,
                        int64_t ldc, bool accumulate);
void GemmS8U8Avx512Vnni(int rows, const uint8_t* w, int64_t ldw, const uint8_t* panel, int64_t kquads, int32_t* c,
                        int64_t ldc, bool accumulate);
// GemmU8S8Avx512Vnni whose rows start from init[0..16) when not accumulating (the int GEMM's
// bias and zero-point correction, folded into the first K block: dispatch.h VnniInitKernel).
void GemmU8S8InitAvx512Vnni(int rows, const uint8_t* a, int64_t lda, const uint8_t* panel, int64_t kquads,
                            int32_t* c, int64_t ldc, bool accumulate, const int32_t* init);
// AVX2 vpmaddubsw on the same panels (csrc/kernels/x86/gemm_u8s8_6x16_avx2.cc), exact for
// weights whose MaddubsStepsFor() >= S: S pair sums are added in int16 before widening.
#define QDSL_DECLARE_MADDUBS(S)                                                                                  \
  void GemmU8S8Avx2S##S(int rows, const uint8_t* a, int64_t lda, const uint8_t* panel, int64_t kquads, int32_t* c, \
                        int64_t ldc, bool accumulate);                                                           \
  void GemmS8U8Avx2S##S(int rows, const uint8_t* w, int64_t ldw, const uint8_t* panel, int64_t kquads, int32_t* c, \
                        int64_t ldc, bool accumulate);
// Implicit-GEMM conv kernel (dispatch.h IgemmKernel's contract), the S == 1 sequence above.
void IgemmU8S8Avx2(int rows, const uint8_t* const* ind, int64_t taps, int64_t cquads, const uint8_t* panel,
                   int32_t* c, int64_t ldc, const int32_t* init);
// The same sums with the prepared stage applied from registers (dispatch.h IgemmStageKernel).
void IgemmU8S8StageAvx2(int rows, const uint8_t* const* ind, int64_t taps, int64_t cquads, const uint8_t* panel,
                        const int32_t* init, const StageF32& st, int64_t c0, int cols, uint8_t* out, int64_t ldo,
                        bool out_signed);
// The same two contracts on vpdpbusd (igemm_u8s8_vnni_avx512.cc; AVX512_VNNI + AVX512VL).
void IgemmU8S8Avx512Vnni(int rows, const uint8_t* const* ind, int64_t taps, int64_t cquads, const uint8_t* panel,
                         int32_t* c, int64_t ldc, const int32_t* init);
void IgemmU8S8StageAvx512Vnni(int rows, const uint8_t* const* ind, int64_t taps, int64_t cquads, const uint8_t* panel,
                              const int32_t* init, const StageF32& st, int64_t c0, int cols, uint8_t* out,
                              int64_t ldo, bool out_signed);
// The stage kernel with an I32 twin written from the same registers (IgemmStageTwinKernel).
void IgemmU8S8StageTwinAvx512Vnni(int rows, const uint8_t* const* ind, int64_t taps, int64_t cquads,
                                  const uint8_t* panel, const int32_t* init, const StageF32& st, int64_t c0, int cols,
                                  uint8_t* out, int64_t ldo, bool out_signed, const StageI32Reg& s32, int32_t* out32,
                                  int64_t ld32);
// The sums' int32 stage and the fused residual ADD from registers (IgemmStageAddKernel).
void IgemmU8S8StageAddAvx512Vnni(int rows, const uint8_t* const* ind, int64_t taps, int64_t cquads,
                                 const uint8_t* panel, const int32_t* init, const StageAddF32& s, int64_t c0, int cols,
                                 const uint8_t* other, int64_t ldo, uint8_t* y, int64_t ldy);
// Its int16 kind on int16 panels (igemm_i16_6x16_avx2.cc): exact on full-range u8 codes.
void IgemmU8I16Avx2(int rows, const uint8_t* const* ind, int64_t taps, int64_t cquads, const uint8_t* panel,
                    int32_t* c, int64_t ldc, const int32_t* init);
// Per-column (channel c0 + c) stage into int32 over a [rows][cols] block (StageI32RowsKernel).
void StageI32RowsAvx2(const int32_t* acc, int64_t rows, int64_t cols, int64_t lda, const OutputStage& stage,
                      int64_t c0, int32_t* out, int64_t ldo);
// A conv's int32 stage and the residual ADD it feeds, into the ADD's codes (StageAddRowsKernel).
void StageAddRowsAvx2(const int32_t* acc, int64_t rows, int64_t cols, int64_t lda, const StageAddF32& s, int64_t c0,
                      const uint8_t* other, int64_t ldo, uint8_t* y, int64_t ldy);
QDSL_DECLARE_MADDUBS(1)
QDSL_DECLARE_MADDUBS(2)
QDSL_DECLARE_MADDUBS(4)
QDSL_DECLARE_MADDUBS(8)
#undef QDSL_DECLARE_MADDUBS
// AMX-INT8 (csrc/kernels/x86/gemm_s8_2x2_amx.cc): C[16*mtiles][16*npanels] (+)= A x B over
// kblocks blocks of 64 bytes of K; a_signed: s8 A rows x u8 B panels, else u8 x s8.
// init/cinit: see the file comment (AmxInit in qdsl/requant.h's namespace, below).
void GemmAmx(bool a_signed, const uint8_t* a, int64_t lda, int64_t mtiles, const uint8_t* b, int64_t ldb,
             int64_t npanels, int64_t kblocks, int32_t* c, int64_t ldc, AmxInit init, const int32_t* cinit);
void GemmAmxGather(const uint8_t* a, int64_t lda, const int64_t* aoff, const int64_t* koff, int64_t mtiles,
                   const uint8_t* b, int64_t ldb, int64_t npanels, int64_t kblocks, int32_t* c, int64_t ldc,
                   AmxInit init, const int32_t* cinit);
// int4/int2 panel (kI4/kI2 layout) -> VNNI int8 quad layout, `quads` k-quads.
void UnpackPanelToVnni(int bits, const uint8_t* src, int64_t quads, uint8_t* dst);
// The same with AVX-512BW, four quads per step (csrc/kernels/x86/unpack_vnni_avx512.cc).
void UnpackPanelToVnniAvx512(int bits, const uint8_t* src, int64_t quads, uint8_t* dst);
// int16 (code - zu) pair panels of 16 columns gathered from padded images: byte i of tap
// row k for panel q is base[tap[k] + pos[16q + i]] (csrc/runtime/ops/conv_fast.cc).
void PackI16PanelsGather(const uint8_t* base, const int64_t* tap, int64_t kpairs, const int64_t* pos,
                         int64_t npanels, uint8_t zu, int16_t* panels);
// The same panels gathered from padded images: byte i of tap row k for panel q is
// base[tap[k] + pos[16q + i]].
void PackU8QuadPanelsGather(const uint8_t* base, const int64_t* tap, int64_t kquads, const int64_t* pos,
                            int64_t npanels, uint8_t* panels);
// u8 rows [4 * kquads][ld] -> VNNI activation panels of 16 columns (positions).
void PackU8QuadPanels(const uint8_t* rows, int64_t ld, int64_t kquads, int64_t npanels, int64_t panel_quads,
                      uint8_t* panels);
// AVX-512 VPOPCNTDQ (csrc/kernels/x86/bgemm_2x4_avx512.cc), same contract as the AVX2 one.
void BinaryPopcountAvx512(const uint64_t* a, int64_t m, int64_t lda, const uint64_t* w, int64_t n, int64_t ldw,
                          int64_t kwords, int32_t* pc, int64_t ldc);
// Column form: wt[j][n] transposed weight words (row stride ldwt >= n, columns padded to 8).
void BinaryPopcountColsAvx512(const uint64_t* a, int64_t m, int64_t lda, const uint64_t* wt, int64_t n,
                              int64_t ldwt, int64_t kwords, int32_t* pc, int64_t ldc);
// The same on nibble-split rows (SplitNibbles; 2 * kwords words each, kwords % 4 == 0).
void BinaryPopcountSplitAvx2(const uint64_t* a, int64_t m, int64_t lda, const uint64_t* w, int64_t n, int64_t ldw,
                             int64_t kwords, int32_t* pc, int64_t ldc);
void BinaryPopcountAvx2(const uint64_t* a, int64_t m, int64_t lda, const uint64_t* w, int64_t n, int64_t ldw,
                        int64_t kwords, int32_t* pc, int64_t ldc);
bool RequantAvx2Supports(const OutputStage& stage);
// q[i] = floor((v[i] * scale + add) / b) (csrc/kernels/x86/floordiv_f64_avx2.cc; contract:
// FloorDivScaledKernel in csrc/dispatch.h).
void FloorDivScaledAvx2(const int32_t* v, int64_t n, double scale, double add, double b, int32_t* q);
// LAYERNORM's row passes (LayernormKernels in csrc/dispatch.h): csrc/kernels/x86/layernorm_i32_avx2.cc,
// and the normalize pass beside FloorDivScaledAvx2.
void LayernormSumAvx2(const int32_t* t0, const int32_t* t1, int64_t n, int32_t* v, int64_t* sum, int32_t* lo,
                      int32_t* hi);
int64_t LayernormCenterAvx2(const int32_t* v, int64_t n, int64_t sum, int k, int32_t* d);
void LayernormNormalizeAvx2(const int32_t* d, int64_t n, int s, int64_t r, const int32_t* gamma, const int32_t* beta,
                            int32_t* acc);
// y[i] = table[x[i]] over a 256-byte table (csrc/kernels/x86/lut_u8_avx2.cc).
void LutU8Avx2(const uint8_t* table, const uint8_t* x, int64_t n, uint8_t* y);
// One-channel stage to int32 (I32 outputs): out[i] = clamp(rescale(acc[i]) + zp, qmin, qmax).
void RequantI32Avx2(const int32_t* acc, int64_t n, const OutputStage& one, int32_t* out);
// The same over rows x cols (acc and out row strides lda, ldo), one channel.
void RequantI32RowsAvx2(const int32_t* acc, int64_t rows, int64_t cols, int64_t lda, const OutputStage& one,
                        int32_t* out, int64_t ldo);
// ADD (docs/qgraph.md §4.4) over n elements; false = unsupported parameters, nothing written.
bool AddAvx2(const void* x0, int dtype0, const void* x1, int dtype1, int64_t n, const OutputStage* in, int pre_shift,
             const OutputStage& out_stage, uint8_t* out, bool out_signed);
void RequantAvx2(const int32_t* acc, int64_t rows, int64_t cols, int64_t lda, const OutputStage& stage, int64_t c0,
                 void* out, int64_t ldo, bool out_signed);
// MUL over one row (mul_avx2.cc; dispatch.h MulKernel's contract).
bool MulAvx2(const uint8_t* x0, int dtype0, int64_t step0, const uint8_t* x1, int dtype1, int64_t step1, int64_t n,
             int32_t zp0, int32_t zp1, const OutputStage& out_stage, uint8_t* out, bool out_signed);
// One channel on acc + addend (RequantAddKernel in dispatch.h; acc + addend within int32).
void RequantAddAvx2(const int32_t* acc, int64_t rows, int64_t cols, int64_t lda, int32_t addend,
                    const OutputStage& one, void* out, int64_t ldo, bool out_signed);
// AVX-512 output stage (csrc/requant/output_stage_avx512.cc), same contracts as the AVX2 ones.
void RequantAvx512(const int32_t* acc, int64_t rows, int64_t cols, int64_t lda, const OutputStage& stage, int64_t c0,
                   void* out, int64_t ldo, bool out_signed);
void RequantI32Avx512(const int32_t* acc, int64_t n, const OutputStage& one, int32_t* out);
// ADD on 16 lanes, same contract and preconditions as AddAvx2.
bool AddAvx512(const void* x0, int dtype0, const void* x1, int dtype1, int64_t n, const OutputStage* in, int pre_shift,
               const OutputStage& out_stage, uint8_t* out, bool out_signed);
// Per-column stage into int32 over a [rows][cols] block (column c is channel c0 + c).
void StageI32RowsAvx512(const int32_t* acc, int64_t rows, int64_t cols, int64_t lda, const OutputStage& stage,
                        int64_t c0, int32_t* out, int64_t ldo);

// QUANTIZE of float input (quantize_f32_avx2.cc): out[i] = clamp(round(x[i] * inv) + zp,
// qmin, qmax) as int8/uint8, rounding codes as the file's (0 half away, 1 half even, 2 floor,
// 3 half up), NaN -> clamp(zp); qmin, qmax within [-128, 255].
void QuantizeF32Avx2(const float* x, int64_t n, float inv, int32_t zp, int32_t qmin, int32_t qmax, int rounding,
                     uint8_t* out, bool out_signed);

// Depthwise conv of one plane (DwConvKernel in dispatch.h; dwconv_i16_avx2.cc): sw 1 or 2,
// dw 1, blocks of 16 outputs per row.
void DwConvAvx2(const int16_t* plane, int64_t ldp, const DwConvShape& s, const int32_t* taps, const int32_t* pairs,
                int32_t init, int32_t* acc, int64_t lda);
// Depthwise conv in NHWC (DwNhwcKernel in dispatch.h; dwconv_nhwc_avx2.cc): 16 channels per step.
void DwConvNhwcAvx2(const uint8_t* const* ptrs, int64_t n, int64_t ntaps, int64_t C, bool x_signed,
                    const int32_t* taps, const int32_t* pairs, const int32_t* init, int32_t* acc, int64_t ldc);
// The same sums with the prepared stage applied from registers (DwNhwcStageKernel).
void DwConvNhwcStageAvx2(const uint8_t* const* ptrs, int64_t n, int64_t ntaps, int64_t C, bool x_signed,
                         const int32_t* pairs, const int32_t* init, const StageF32& st, uint8_t* out, int64_t ldo,
                         bool out_signed);
// The same on U8 codes and int8 weights by vpmaddubsw (DwNhwcQuadKernel; dwconv_nhwc_u8s8_avx2.cc).
void DwConvNhwcQuadAvx2(const uint8_t* const* ptrs, int64_t n, int64_t ntaps, int64_t C, const uint8_t* w,
                        const int32_t* init, const StageF32& st, uint8_t* out, int64_t ldo, bool out_signed);
// The same on vpdpbusd (dwconv_nhwc_u8s8_vnni_avx512.cc; AVX512_VNNI + AVX512VL).
void DwConvNhwcQuadAvx512Vnni(const uint8_t* const* ptrs, int64_t n, int64_t ntaps, int64_t C, const uint8_t* w,
                              const int32_t* init, const StageF32& st, uint8_t* out, int64_t ldo, bool out_signed);
// Padded int16 plane interior of a depthwise conv (DwFillKernel in dispatch.h).
void DwFillPlaneAvx2(const uint8_t* x, bool x_signed, int64_t H, int64_t W, int64_t ph, int64_t pw, int64_t rows,
                     int64_t ldp, int32_t zp, int16_t* xp);

}  // namespace x86
}  // namespace qdsl

#endif  // QDSL_KERNELS_X86_X86_KERNELS_H_
