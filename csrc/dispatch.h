// Kernel selection: one Select* function per op, each with an explicit portable
// fallback (larq select_kernel.h).  A path runs only if it is compiled, the CPU has
// it, and it is enabled: QDSL_KERNELS=reference|portable|avx2 (read once), or
// SetEnabledPaths from tests.  A per-call path mask (the `path` argument of the
// front doors, 0 = "whatever is enabled") lets tests force one path.
#ifndef QDSL_DISPATCH_H_
#define QDSL_DISPATCH_H_

#include <cstdint>

#include "qdsl/gemm.h"
#include "qdsl/status.h"

namespace qdsl {

struct StageF32;     // requant/stage_f32.h
struct StageI32Reg;  // requant/stage_f32.h
struct StageAddF32;  // requant/stage_add_f32.h

uint32_t CompiledPaths();
uint32_t CpuPaths();
uint32_t EnabledPaths();
void SetEnabledPaths(uint32_t mask);  // 0 restores the QDSL_KERNELS default
// The single best path for a call: highest bit of (requested or enabled) that is
// compiled and supported.  Error if a forced path cannot run here.
Status ResolvePath(uint32_t requested, uint32_t* chosen);

// C[rows x 16] (+)= A16[rows][2*kpairs] * panel block.  `a` is int16 (A - a_zp),
// row stride lda; `panel` points at the first k-pair of the block.
using IntMicroKernel = void (*)(int rows, const int16_t* a, int64_t lda, const uint8_t* panel,
                                int64_t kpairs, int32_t* c, int64_t ldc, bool accumulate);
// pc[m][n] = popcount(a[m] XOR w[n]) over kwords words, for an m x n block.
using BinaryMicroKernel = void (*)(const uint64_t* a, int64_t m, int64_t lda, const uint64_t* w, int64_t n,
                                   int64_t ldw, int64_t kwords, int32_t* pc, int64_t ldc);
// out[r][c] = RequantizeOne(acc[r][c], stage channel c0 + c) as int8 or uint8.
using RequantKernel = void (*)(const int32_t* acc, int64_t rows, int64_t cols, int64_t lda,
                               const OutputStage& stage, int64_t c0, void* out, int64_t ldo, bool out_signed);
// The same for one channel (stage.rescale.channels == 1) on acc[r][c] + addend, where the
// caller guarantees every acc + addend fits int32 (a conv's bias when no overflow is possible):
// the bias add fused into the stage's single pass over the accumulators.
using RequantAddKernel = void (*)(const int32_t* acc, int64_t rows, int64_t cols, int64_t lda, int32_t addend,
                                  const OutputStage& one, void* out, int64_t ldo, bool out_signed);

// u8/s8 x s8/u8 -> int32 over k-quads (AVX-VNNI); nullptr when `path` has no such kernel.
// broadcast_unsigned: rows are u8 activations against s8 weight panels (else s8 weight
// rows against u8 activation panels).
using VnniMicroKernel = void (*)(int rows, const uint8_t* a, int64_t lda, const uint8_t* panel, int64_t kquads,
                                 int32_t* c, int64_t ldc, bool accumulate);

// ADD over n elements (false: parameters outside what the kernel handles, use scalar).
using AddKernel = bool (*)(const void* x0, int dtype0, const void* x1, int dtype1, int64_t n, const OutputStage* in,
                           int pre_shift, const OutputStage& out_stage, uint8_t* out, bool out_signed);
// MUL over one row of n outputs (docs/qgraph.md §4.4): input k at x_k[i * step_k], step_k 0
// (broadcast) or 1; false: parameters outside what the kernel handles, nothing written.
using MulKernel = bool (*)(const uint8_t* x0, int dtype0, int64_t step0, const uint8_t* x1, int dtype1,
                           int64_t step1, int64_t n, int32_t zp0, int32_t zp1, const OutputStage& out_stage,
                           uint8_t* out, bool out_signed);
// One-channel stage into int32 (I32 outputs).
using StageI32Kernel = void (*)(const int32_t* acc, int64_t n, const OutputStage& one, int32_t* out);

IntMicroKernel SelectIntMicroKernel(PanelFormat format, uint32_t path);
// Binary popcounts on nibble-split rows (PackedWeights::bits_split; strides and kwords as
// for the plain kernel, rows 2 * kwords words long); nullptr where the path has none.
BinaryMicroKernel SelectBinarySplitKernel(uint32_t path);
AddKernel SelectAddKernel(uint32_t path);  // nullptr: no vector kernel on this path
MulKernel SelectMulKernel(uint32_t path);  // nullptr: no vector kernel on this path
// QUANTIZE of n floats: y = clamp(round(x * inv) + zp, qmin, qmax) as int8/uint8, rounding
// codes as the file's, NaN -> clamp(zp) (x86::QuantizeF32Avx2's contract).
using QuantizeF32Kernel = void (*)(const float* x, int64_t n, float inv, int32_t zp, int32_t qmin, int32_t qmax,
                                   int rounding, uint8_t* out, bool out_signed);
QuantizeF32Kernel SelectQuantizeF32Kernel(uint32_t path);  // nullptr: the scalar loop
// q[i] = floor((v[i] * scale + add) / b) for i < n (SOFTMAX's and LAYERNORM's quotients), exact
// when every v[i] * scale + add is an integer a double holds exactly (scale a power of two),
// b is an integer in [1, 2^52) and every quotient is in [0, 2^31).
using FloorDivScaledKernel = void (*)(const int32_t* v, int64_t n, double scale, double add, double b, int32_t* q);
FloorDivScaledKernel SelectFloorDivScaledKernel(uint32_t path);  // nullptr: the scalar loop
// LAYERNORM's optimized row passes (csrc/runtime/ops/layernorm.cc derives the bounds), n >= 1:
//   sum:       v[i] = sat32(t0[i] + t1[i]); *sum = Σ v[i], *lo = min v[i], *hi = max v[i]; with
//              t1 nullptr the statistics of t0 itself (v unused);
//   center:    d[i] = round_half_away((n·v[i] - sum) / 2^k), returns Σ d[i]²; needs |d[i]| <= 2^24,
//              |n·v[i] - sum| < 2^52 and n <= 40000;
//   normalize: acc[i] = sign(d[i]) · floor((|d[i]|·2^s + r) / 2r) · gamma[i] + beta[i] for
//              1 <= r < 2^31, each quotient <= 2^16 + 1, |d[i]|·2^s + r < 2^51, and acc in int32.
struct LayernormKernels {
  void (*sum)(const int32_t* t0, const int32_t* t1, int64_t n, int32_t* v, int64_t* sum, int32_t* lo, int32_t* hi);
  int64_t (*center)(const int32_t* v, int64_t n, int64_t sum, int k, int32_t* d);
  void (*normalize)(const int32_t* d, int64_t n, int s, int64_t r, const int32_t* gamma, const int32_t* beta,
                    int32_t* acc);
};
LayernormKernels SelectLayernormKernels(uint32_t path);  // portable loops below AVX2
// y[i] = table[x[i]] for i < n over a 256-byte table (LUT, LUT_CHANNEL).
using LutKernel = void (*)(const uint8_t* table, const uint8_t* x, int64_t n, uint8_t* y);
LutKernel SelectLutKernel(uint32_t path);  // nullptr: the scalar loop
StageI32Kernel SelectStageI32Kernel(uint32_t path);
// One-channel stage into int32 over rows x cols with row strides (the conv's images of one
// channel); nullptr where the path has none (call the StageI32Kernel per row).
using StageI32StridedKernel = void (*)(const int32_t* acc, int64_t rows, int64_t cols, int64_t lda,
                                       const OutputStage& one, int32_t* out, int64_t ldo);
StageI32StridedKernel SelectStageI32StridedKernel(uint32_t path);
// Per-column (channel c0 + c) stage into int32 over a [rows][cols] block.
using StageI32RowsKernel = void (*)(const int32_t* acc, int64_t rows, int64_t cols, int64_t lda,
                                    const OutputStage& stage, int64_t c0, int32_t* out, int64_t ldo);
StageI32RowsKernel SelectStageI32RowsKernel(uint32_t path);
// int4/int2 panel block -> VNNI int8 layout (only called when a VNNI kernel was selected).
void UnpackPanelToVnni(int bits, const uint8_t* src, int64_t quads, uint8_t* dst, uint32_t path);
// u8 rows [4 * kquads][ld] -> VNNI activation panels of 16 columns (VNNI paths only).
void PackU8QuadPanels(const uint8_t* rows, int64_t ld, int64_t kquads, int64_t npanels, int64_t panel_quads,
                      uint8_t* panels);
// int16 pair panels (code - zu) of 16 columns, the activation operand of the int16 conv
// kernels, gathered from padded images: byte i of tap row k for panel q is
// base[tap[k] + pos[16q + i]] (every path that has the int16 kernels; portable fallback).
void PackI16PanelsGather(const uint8_t* base, const int64_t* tap, int64_t kpairs, const int64_t* pos,
                         int64_t npanels, uint8_t zu, int16_t* panels, uint32_t path);
// VNNI activation panels gathered from padded images: byte i of tap row k for panel q is
// base[tap[k] + pos[16q + i]] (x86 paths; portable fallback).
void PackU8QuadPanelsGather(const uint8_t* base, const int64_t* tap, int64_t kquads, const int64_t* pos,
                            int64_t npanels, uint8_t* panels);
VnniMicroKernel SelectVnniMicroKernel(bool broadcast_unsigned, uint32_t path);
// The one predicate for EVEX VNNI on the AVX2 path: the CPU has AVX512_VNNI + AVX512VL/BW/F
// (e.g. AMD Zen 4, which lacks VEX AVX-VNNI) and QDSL_EVEX_VNNI is not 0 (read once).  Then
// the AVX2 path's u8*s8 kernels (int GEMM quad kernel, implicit-GEMM conv, NHWC depthwise quad
// kernel) run as vpdpbusd, exact mod 2^32 for any u8 codes, and are chosen with no
// activation-code bound (full-range 8-bit activations included).  See dispatch.cc.
bool EvexVnniUsable();
// The exact kernel for VNNI-layout panels whose weights allow `maddubs_steps` int16 pair
// sums (MaddubsStepsFor): the VNNI one where the CPU has it (on the AVX2 path: EVEX vpdpbusd
// where EvexVnniUsable; any maddubs_steps), else on AVX2 the vpmaddubsw one
// (maddubs_steps >= 1); nullptr when neither applies (the int16 kernels run).
VnniMicroKernel SelectQuadMicroKernel(bool broadcast_unsigned, int maddubs_steps, uint32_t path);
// The u8 x s8 vpdpbusd kernel of VnniMicroKernel's contract (broadcast_unsigned) whose rows
// start from init[0..16) instead of zero when not accumulating; nullptr where `path` has no
// vpdpbusd (then SelectQuadMicroKernel's kernel and a correction pass).
using VnniInitKernel = void (*)(int rows, const uint8_t* a, int64_t lda, const uint8_t* panel, int64_t kquads,
                                int32_t* c, int64_t ldc, bool accumulate, const int32_t* init);
VnniInitKernel SelectQuadInitKernel(uint32_t path);
// Implicit-GEMM conv micro-kernel (x86::IgemmU8S8Avx2, csrc/kernels/x86/igemm_u8s8_6x16_avx2.cc):
// c[r][0..16) = start + sum over taps t and k-quads j of the u8 bytes ind[r * taps + t][4j..4j+3]
// times the s8 panel quad (t * cquads + j) (16 channels x 4 bytes), for rows <= 6 positions;
// start is init[0..16) for every row, or c[r]'s own values when init is nullptr.
// Exact when the weights allow one int16 pair sum (MaddubsStepsFor >= 1).
// The int16 kind (x86::IgemmU8I16Avx2, igemm_i16_6x16_avx2.cc) has the same contract on int16
// panels (128 bytes per quad: ConvParams::ig_int16) and is exact for any u8 codes and
// |W| <= 511 (full-range 8-bit activations).
using IgemmKernel = void (*)(int rows, const uint8_t* const* ind, int64_t taps, int64_t cquads, const uint8_t* panel,
                             int32_t* c, int64_t ldc, const int32_t* init);
// nullptr unless `path` is AVX2 (the VNNI/AMX paths run their own convs); `int16`: the int16 kind.
IgemmKernel SelectIgemmKernel(uint32_t path, bool int16);
// Whether the vpmaddubsw kind's kernels on `path` are the vpdpbusd ones (the AVX2 path where
// EvexVnniUsable(); igemm_u8s8_vnni_avx512.cc).
bool IgemmRunsVnni(uint32_t path);
// The same sums from init, then the prepared FIXED_SINGLE stage st (requant/stage_f32.h) of
// channels c0.. applied in registers: row r's first `cols` (<= 16) codes go to out + r * ldo.
// Bit-identical to the reference stage of those sums.  The vpmaddubsw kind only.
using IgemmStageKernel = void (*)(int rows, const uint8_t* const* ind, int64_t taps, int64_t cquads,
                                  const uint8_t* panel, const int32_t* init, const StageF32& st, int64_t c0, int cols,
                                  uint8_t* out, int64_t ldo, bool out_signed);
IgemmStageKernel SelectIgemmStageKernel(uint32_t path);
// The same with a second output: the prepared int32 stage s32 (requant/stage_f32.h
// StageI32Reg, zero point 0) of the same sums, row r's first `cols` values to out32 + r * ld32
// (a conv's I32 twin).  Bit-identical to the reference stages.  nullptr unless `path` is AVX2
// and EvexVnniUsable() (an AVX-512 epilogue: igemm_u8s8_vnni_avx512.cc).
using IgemmStageTwinKernel = void (*)(int rows, const uint8_t* const* ind, int64_t taps, int64_t cquads,
                                      const uint8_t* panel, const int32_t* init, const StageF32& st, int64_t c0,
                                      int cols, uint8_t* out, int64_t ldo, bool out_signed, const StageI32Reg& s32,
                                      int32_t* out32, int64_t ld32);
IgemmStageTwinKernel SelectIgemmStageTwinKernel(uint32_t path);
// The same sums' int32 stage and the residual ADD it feeds (requant/stage_add_f32.h StageAddF32)
// from registers: row r's first `cols` ADD output codes to y + r * ldy, the ADD's other input
// read at other + r * ldo elements (8-bit codes or int32).  The StageAddRowsKernel's estimate
// and exact recompute, so the same codes.  nullptr unless `path` is AVX2 and EvexVnniUsable().
using IgemmStageAddKernel = void (*)(int rows, const uint8_t* const* ind, int64_t taps, int64_t cquads,
                                     const uint8_t* panel, const int32_t* init, const StageAddF32& s, int64_t c0,
                                     int cols, const uint8_t* other, int64_t ldo, uint8_t* y, int64_t ldy);
IgemmStageAddKernel SelectIgemmStageAddKernel(uint32_t path);
// AMX-INT8 tile GEMM (x86::GemmAmx contract, csrc/kernels/x86/gemm_s8_2x2_amx.cc); nullptr
// unless `path` is kPathAmx.
using AmxKernel = void (*)(bool a_signed, const uint8_t* a, int64_t lda, int64_t mtiles, const uint8_t* b,
                           int64_t ldb, int64_t npanels, int64_t kblocks, int32_t* c, int64_t ldc, AmxInit init,
                           const int32_t* cinit);
AmxKernel SelectAmxKernel(uint32_t path);
// Implicit-GEMM form (x86::GemmAmxGather): u8 A tiles at a + aoff[i] + koff[kb].
using AmxGatherKernel = void (*)(const uint8_t* a, int64_t lda, const int64_t* aoff, const int64_t* koff,
                                 int64_t mtiles, const uint8_t* b, int64_t ldb, int64_t npanels, int64_t kblocks,
                                 int32_t* c, int64_t ldc, AmxInit init, const int32_t* cinit);
AmxGatherKernel SelectAmxGatherKernel(uint32_t path);
constexpr int64_t kAmxKBlock = 64;  // bytes of K per tile step; B panels hold 1 KiB per k-block
BinaryMicroKernel SelectBinaryMicroKernel(uint32_t path);
// Column-form binary kernel over transposed weights (PackedWeights::bits_cols); nullptr
// when the path has none.  Same result as the row form.
BinaryMicroKernel SelectBinaryColsKernel(uint32_t path);
RequantKernel SelectRequantKernel(uint32_t path);
// nullptr when the path has none (callers add the addend themselves, then requantize).
RequantAddKernel SelectRequantAddKernel(uint32_t path);

// Depthwise conv of one channel plane (DwConvShape in qdsl/gemm.h states the contract).
using DwConvKernel = void (*)(const int16_t* plane, int64_t ldp, const DwConvShape& s, const int32_t* taps,
                              const int32_t* pairs, int32_t init, int32_t* acc, int64_t lda);
// AVX2 for sw <= 2 and dw == 1 on every path from AVX2 up, else the portable loops.
DwConvKernel SelectDwConvKernel(const DwConvShape& s, uint32_t path);
// Depthwise conv in NHWC over tap pointers (DwConvNhwc contract in qdsl/gemm.h): AVX2 on
// every path from AVX2 up, else the portable loops (never nullptr).
using DwNhwcKernel = void (*)(const uint8_t* const* ptrs, int64_t n, int64_t ntaps, int64_t C, bool x_signed,
                              const int32_t* taps, const int32_t* pairs, const int32_t* init, int32_t* acc,
                              int64_t ldc);
DwNhwcKernel SelectDwNhwcKernel(uint32_t path);
// The same sums, then the prepared FIXED_SINGLE stage st (requant/stage_f32.h) applied in
// registers: position i's C codes go to out + i * ldo.  nullptr below AVX2.
using DwNhwcStageKernel = void (*)(const uint8_t* const* ptrs, int64_t n, int64_t ntaps, int64_t C, bool x_signed,
                                   const int32_t* pairs, const int32_t* init, const StageF32& st, uint8_t* out,
                                   int64_t ldo, bool out_signed);
DwNhwcStageKernel SelectDwNhwcStageKernel(uint32_t path);
// The same sums and stage on U8 codes and int8 weights by vpmaddubsw (the DwNhwcQuadSteps
// layout of qdsl/gemm.h), exact when no weight pair sum times the largest code leaves int16
// (ConvParams::dwq).  nullptr below AVX2.
using DwNhwcQuadKernel = void (*)(const uint8_t* const* ptrs, int64_t n, int64_t ntaps, int64_t C, const uint8_t* w,
                                  const int32_t* init, const StageF32& st, uint8_t* out, int64_t ldo, bool out_signed);
DwNhwcQuadKernel SelectDwNhwcQuadKernel(uint32_t path);
// A conv's int32 stage and the residual ADD it feeds, prepared as s (requant/stage_add_f32.h):
// acc [rows][cols] (stride lda) of channels c0.., the ADD's other input at other (8-bit
// codes or int32 values as s says; stride ldo elements), its output codes to y (stride ldy).
// nullptr below AVX2.
using StageAddRowsKernel = void (*)(const int32_t* acc, int64_t rows, int64_t cols, int64_t lda,
                                    const StageAddF32& s, int64_t c0, const uint8_t* other, int64_t ldo, uint8_t* y,
                                    int64_t ldy);
StageAddRowsKernel SelectStageAddRowsKernel(uint32_t path);
// The interior of a depthwise conv's zero-padded int16 plane: rows [ph, min(rows, ph + H))
// hold input row r - ph minus zp at columns [pw, pw + W) (I8 codes when x_signed, else U8);
// may also zero up to 16 columns past pw + W (ldp >= pw + W + 16).  nullptr: no vector kernel.
using DwFillKernel = void (*)(const uint8_t* x, bool x_signed, int64_t H, int64_t W, int64_t ph, int64_t pw,
                              int64_t rows, int64_t ldp, int32_t zp, int16_t* xp);
DwFillKernel SelectDwFillKernel(uint32_t path);

// Threads (a small std::thread pool; no OpenMP, which would clash with torch's libgomp).
void SetNumThreads(int n);  // <= 0 restores QDSL_NUM_THREADS or hardware_concurrency
int NumThreads();

}  // namespace qdsl

#endif  // QDSL_DISPATCH_H_
