// Integer GEMM front door: activations (u8/s8 with a zero point) x packed weights
// (int8, int4, int2 or binary), int32 accumulation, optional requant output stage.
//
//   acc[m][n] = bias[n] + sum_k (A[m][k] - a_zp) * W'[n][k]     (W' = W - w_zp; int32, wrapping)
//   binary:  acc[m][n] = bias[n] + K - 2 * popcount(Abits[m] XOR Wbits[n])  (bit 1 = -1)
//
// Weights are packed once (PackWeights / PackBinaryWeights) and reused; every call
// validates its arguments here, so the kernels behind it can trust them.
#ifndef QDSL_GEMM_H_
#define QDSL_GEMM_H_

#include <cstdint>
#include <vector>

#include "qdsl/aligned.h"
#include "qdsl/requant.h"
#include "qdsl/status.h"
#include "qdsl/tensor_view.h"

namespace qdsl {

// Kernel paths, as bit flags (ruy style).  kRef is always compiled and enabled.
enum Path : uint32_t {
  kPathRef = 1u << 0,       // csrc/ref: scalar, obviously correct
  kPathPortable = 1u << 1,  // csrc/kernels/portable: blocked plain C++
  kPathAvx2 = 1u << 2,      // csrc/kernels/x86: AVX2 + FMA + POPCNT
  kPathAvxVnni = 1u << 3,   // csrc/kernels/x86: AVX-VNNI vpdpbusd (u8 x s8, exact); AVX2 for other ops
  kPathAvx512 = 1u << 4,    // csrc/kernels/x86: AVX-512 VPOPCNTDQ binary GEMM; otherwise as kPathAvxVnni
  kPathAmx = 1u << 5,       // csrc/kernels/x86: AMX-INT8 tile GEMM (int8 linear/conv); otherwise as kPathAvx512
};

// How an AMX C block starts (csrc/kernels/x86/gemm_s8_2x2_amx.cc): zero, its old
// value, a per-column row broadcast, or per-row tiles.
enum class AmxInit : int32_t { kZero = 0, kAccumulate = 1, kCols = 2, kRows = 3 };

// How the optimized paths store a 16-column weight panel (see csrc/pack/pack_weights.cc).
enum class PanelFormat : int32_t { kI16 = 0, kI4 = 1, kI2 = 2 };

// Depthwise conv of one channel plane (csrc/runtime/ops/conv_dw.cc, DwConvKernel):
//   acc[oy*lda + ox] = init + sum_{ky < kh, kx < kw} taps[ky*kw + kx] * plane[(oy*sh + ky*dh)*ldp + ox*sw + kx*dw]
// for oy < oh, ox < ow, in int32 (the caller proves no partial sum can overflow).  plane is
// the input minus its zero point as int16, padding as zeros; its rows must be readable and
// zero past the padded image up to column DwConvPlaneCols.  Kernels may compute whole blocks
// of 16 outputs, writing garbage up to column DwConvAccCols of a row (so lda >= ow will do:
// rows are written in order, and a row's spill is overwritten by the next row; the buffer
// holds (oh - 1) * lda + DwConvAccCols values).  pairs: [kh][(kw + 1) / 2] int32 words of
// int16 taps 2j (low) and 2j + 1 (high, 0 past kw), the vpmaddwd operand.
struct DwConvShape {
  int64_t oh, ow, kh, kw, sh, sw, dh, dw;
};
inline int64_t DwConvAccCols(const DwConvShape& s) { return (s.ow + 15) / 16 * 16; }
inline int64_t DwConvPlaneCols(const DwConvShape& s) { return s.sw * DwConvAccCols(s) + s.kw * s.dw + 16; }

// Depthwise conv in NHWC (groups == C == O; csrc/runtime/ops/conv_dw_nhwc.cc, DwNhwcKernel):
// for output positions i < n and channels c < C, with t < ntaps the flattened kernel taps,
//   acc[i*ldc + c] = init[c] + sum_t w[t][c] * x_i,t[c]   (int32, wrapping)
// where x_i,t = ptrs[i*ntaps + t] points at the C codes of tap t's input pixel (I8 when
// x_signed, else U8), or at a row of zero-point codes for a padded tap.  The caller folds
// the zero point into init (init = bias - zp * sum_t w[t][c]), so padded taps add
// w * zp - w * zp = 0; modular int32 sums then equal the exact sum whenever it fits int32
// (ConvParams::fast_acc).  Every pointer must be readable for DwNhwcCols(C) bytes, and
// columns [C, DwNhwcCols(C)) of acc are written too (init 0 and weights 0 there: 0).
// Weights: taps [ntaps][DwNhwcCols(C)] int32 (portable), pairs in the vpmaddwd form below
// (AVX2).
inline int64_t DwNhwcCols(int64_t C) { return (C + 15) / 16 * 16; }
// pairs[(cb * ((ntaps + 1) / 2) + j) * 16 + k]: channel cb*16 + kDwNhwcLane[k]'s taps 2j
// (low int16) and 2j + 1 (high; 0 past ntaps), in the lane order of vpunpck{l,h}wd on 16
// int16 channels (lows: channels 0-3 and 8-11, highs: 4-7 and 12-15).  The order swaps
// 4-7 with 8-11, so it is its own inverse: channel c sits at slot kDwNhwcLane[c % 16].
constexpr int kDwNhwcLane[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};
// The vpmaddubsw form (U8 codes, int8 weights; DwNhwcQuadKernel, dwconv_nhwc_u8s8_avx2.cc):
// per block of 32 channels cb, DwNhwcQuadSteps(ntaps) steps of 128 bytes: step j covers taps
// 4j..4j+3 as four 32-byte vectors r, where dword L*4 + i of vector r is channel
// cb*32 + 16L + 4r + i and byte k of it the channel's tap 4j + k (0 past ntaps), except a
// last step with a lone tap (ntaps % 4 == 1): its dwords hold that tap as an int16 (high
// half 0).  init: 32 int32 per block, slot r*8 + L*4 + i = channel cb*32 + 16L + 4r + i.
inline int64_t DwNhwcQuadSteps(int64_t ntaps) { return (ntaps + 3) / 4; }
inline int64_t DwNhwcQuadSlot(int64_t c) { return c / 32 * 32 + (c % 16) / 4 * 8 + (c % 32) / 16 * 4 + c % 4; }

constexpr int kPanelCols = 16;  // NR of every int micro-kernel
constexpr int kMaxRows = 6;     // MR of every int micro-kernel

struct PackedWeights {
  int64_t n = 0, k = 0;
  int bits = 8;                    // 16 (any int weights) or 1 (binary)
  std::vector<int16_t> raw;        // [n][k] values W - w_zp, for the reference path
  // Optimized layout (int): panels of 16 columns, K padded to a multiple of 4; the
  // format is the narrowest that holds every value (int4, int2, else int16).
  PanelFormat format = PanelFormat::kI16;
  int64_t kp = 0, panels = 0, panel_bytes = 0;
  std::vector<uint8_t> packed;
  // AVX-VNNI layout (only when every W - w_zp fits int8): per 16-column panel and k-quad,
  // 16 columns x 4 int8; colsum[n] = sum_k (W - w_zp)[n][k] for the zero-point offset.
  AlignedVector<uint8_t> vnni;
  std::vector<int32_t> colsum;  // [panels * 16]
  // How many vpmaddubsw pair sums of these weights (x any u8 activations) can be added in
  // int16 exactly: 0 = one pair can saturate (MaddubsStepsFor(maddubs_pair, 255)).  Set with colsum, as is the
  // weights' pair bound (MaddubsPairBound), from which Gemm derives the steps for
  // activations bounded below 255 (ActView::max_code).
  int maddubs_steps = 0;
  int maddubs_pair = 0;
  // Binary: bit rows [n][kwords], bit = 1 means -1.
  int64_t kwords = 0;
  std::vector<uint64_t> bits_rows;
  // The same bits transposed, [kwords][ncols_pad] with ncols_pad = n rounded up to 8
  // (AVX-512 column kernel: one load = one word of 8 weight rows).
  int64_t ncols_pad = 0;
  std::vector<uint64_t> bits_cols;
  // The bit rows nibble-split for the AVX2 kernel, when kwords % 4 == 0: per 256-bit group,
  // 4 words of low nibbles (bits & 0x0F per byte) then 4 of high nibbles (SplitNibbles).
  std::vector<uint64_t> bits_split;
};

// Weights given as zero-point-subtracted values W - w_zp [n][k] (row stride ldw), each in
// [-512, 511] so every product with an activation difference fits the int16 kernels.
Status PackWeights(const int16_t* w, int64_t n, int64_t k, int64_t ldw, PackedWeights* out);
// For int8-range weight rows [rows][k] (stride ld, k-pairs (2i, 2i+1) as the quad layouts
// pair them): max over pairs of max(w0+ + w1+, -(w0- + w1-)), the largest int16 pair sum
// of vpmaddubsw per unit of activation code.
int MaddubsPairBound(const int16_t* w, int64_t rows, int64_t k, int64_t ld);
int MaddubsPairBound(const int8_t* w, int64_t rows, int64_t k, int64_t ld);
// S for activation codes in [0, max_code] (255: any u8): the largest S <= 8 such that S
// vpmaddubsw pair sums add up exactly in int16, S * max_code * pair_bound <= 32767; 0 when
// a single pair can saturate, 8 when either bound is 0.
int MaddubsStepsFor(int pair_bound, int max_code);
// Binary weights given as +1/-1 int8 values [n][k].
Status PackBinaryWeights(const int8_t* w, int64_t n, int64_t k, int64_t ldw, PackedWeights* out);
// words (a multiple of 4) bit-packed words -> 2 * words: per group of 4, the 4 words
// & 0x0F0F.. then the 4 words >> 4 & 0x0F0F..; popcounts and XORs commute with it.
void SplitNibbles(const uint64_t* src, int64_t words, uint64_t* dst);
// Bit-packs +1/-1 int8 activations [m][k] into [m][kwords] words (bit = 1 means -1),
// padding bits are 0 in both operands so they never change the popcount.
Status BitpackSigns(const int8_t* a, int64_t m, int64_t k, int64_t lda, uint64_t* out, int64_t kwords);

// Result of a GEMM: int32 accumulators (stage == nullptr), requantized int8/uint8, or
// int32 through the stage (its rescale, zero point and clamp, like ref::StageOne).
struct GemmOutput {
  void* data = nullptr;
  DType dtype = DType::kInt32;
  int64_t ld = 0;
  const OutputStage* stage = nullptr;
};

Status Gemm(const ActView& a, const PackedWeights& w, const int32_t* bias, const GemmOutput& out,
            uint32_t path);
// a: bit-packed activations [m][kwords] (row stride lda words).
Status BinaryGemm(const uint64_t* a, int64_t m, int64_t lda, const PackedWeights& w, const int32_t* bias,
                  const GemmOutput& out, uint32_t path);
// Checks a rescale's arrays and ranges (docs/qgraph.md §4.1) for `channels` channels.
Status ValidateRescale(const Rescale& r, int64_t channels);
// Standalone output stage over a [rows][channels] int32 matrix (channels = last dim).
Status Requantize(const int32_t* acc, int64_t rows, int64_t channels, const OutputStage& stage, void* out,
                  DType out_dtype, uint32_t path);

}  // namespace qdsl

#endif  // QDSL_GEMM_H_
