// CONV1D/CONV2D/LINEAR and BCONV1D/BCONV2D/BLINEAR: params and the pieces shared by
// their files (docs/qgraph.md §4.3-4.4):
//   conv_prepare.cc   validation, weight packing, the exactness bounds (Prepare)
//   conv_exec.cc      RunConv: path choice and the generic im2col + GEMM / exact int64 path
//   conv_fast.cc      IntConvFast: the gathered-panel AVX2 / VNNI / AMX-explicit conv
//   conv_amx.cc       AmxConvImplicit: the AMX implicit-GEMM conv (with a fused residual ADD)
//   conv_igemm.cc     IgemmConv: the AVX2 implicit-GEMM conv on NHWC rows (with a fused residual ADD)
//   conv_dw.cc        DepthwiseConv: depthwise convs (groups == C) on zero-padded int16 planes
//   conv_dw_nhwc.cc   DepthwiseConvNhwc: depthwise convs with O == C, channels-last
//   conv_im2col.cc    im2col forms and padded (phase-split) images
//   conv_transpose.cc byte / int32 transposes and NCHW -> padded NHWC rows
#ifndef QDSL_RUNTIME_OPS_CONV_H_
#define QDSL_RUNTIME_OPS_CONV_H_

#include <algorithm>
#include <cstring>
#include <vector>

#include "dispatch.h"
#include "qdsl/aligned.h"
#include "requant/stage_add_f32.h"
#include "requant/stage_f32.h"
#include "runtime/ops/op.h"

namespace qdsl {

inline bool IsConvLike(int opcode) {
  return opcode == kConv1d || opcode == kConv2d || opcode == kLinear || opcode == kBconv1d || opcode == kBconv2d ||
         opcode == kBlinear;
}

// Checked, precomputed parameters of a conv-like op (CONV1D/2D, LINEAR and the binary forms).
struct ConvParams : OpParams {
  // Conv-like ops (linear: spatial rank 0, treated as a 1x1 conv on a 1x1 image).
  int spatial = 0;
  int64_t groups = 1, cin = 0, cout = 0, kh = 1, kw = 1, sh = 1, sw = 1, ph = 0, pw = 0, dh = 1, dw = 1;
  int32_t in_zp = 0;
  std::vector<PackedWeights> packed;        // per group (int: W - w_zp; binary: sign bits)
  std::vector<std::vector<int32_t>> w_int;  // per group [og][K] (W - w_zp), for the exact int64 path
  std::vector<int32_t> bias;                // empty = none
  std::vector<std::vector<int16_t>> w16;    // convs: per group [og][kp] (W - w_zp), K padded to 4
  // convs, when W - w_zp fits int8: VNNI/AMX rows [og rounded up to 16][kp64], zero padded
  std::vector<AlignedVector<int8_t>> w8;
  std::vector<int32_t> rowsum;              // [cout] sum_k (W - w_zp), the VNNI zero-point offset
  int32_t in_max_code = 255;                // largest u8 code of the input (int8: + 128), padding included
  int maddubs_steps = 0;                    // MaddubsStepsFor(w8, in_max_code) (AVX2 vpmaddubsw convs when >= 1)
  // AMX implicit-GEMM conv (groups 1, int8 weights, >= 16 input channels): the input is
  // copied to a zero-point padded NHWC image [Hp][Wp][C] and the tiles read it in place.
  // K is cut into segments of a position's window (one per kernel row when dw == 1: kw * C
  // contiguous bytes; else one per tap: C bytes), each padded to 64-byte blocks; koff[kb]
  // is block kb's byte offset from the window's first tap, and amx_w holds one VNNI panel
  // of 16 output channels per amx_kblocks KiB (bytes past a segment's end are zero).
  bool amx_conv = false;
  // Residual ADD fused into this conv (AMX implicit and IntConvFast paths): when the conv's I32 output
  // feeds exactly one op, an ADD whose other input is ready before the conv runs, the conv's
  // epilogue computes the ADD's output directly (no I32 tensor written and read back) and
  // the executor skips the ADD.  fused_add: that ADD's op index (-1: none); fused_slot:
  // which ADD input the conv is.
  int32_t fused_add = -1;
  int fused_slot = 0;
  // Twin convs: later ops with the same input, weights, bias and geometry but their own
  // output stage (the exporter emits one per consumer kind, e.g. a requantized U8 output
  // and an I32 one for a residual ADD).  The im2col conv path applies every twin's stage to
  // this op's accumulators and marks the twin done; other paths leave it to run itself.
  std::vector<int32_t> twins;
  int64_t amx_kblocks = 0, amx_panels = 0, amx_hp = 0, amx_wp = 0;
  std::vector<int64_t> amx_koff;
  AlignedVector<uint8_t> amx_w;
  // AVX2 implicit-GEMM conv (IgemmConv, conv_igemm.cc; groups 1, U8/I8 input, no overflow
  // possible).  M = output positions, N = output channels, K = taps x ig_cp (C rounded up to 4,
  // zero weights past C).  Two kernel kinds on the same row pointers: int8 weights whose pairs
  // allow the vpmaddubsw kernel (MaddubsStepsFor >= 1, e.g. behind a 7-bit clamp; any int8
  // weights where it runs as EVEX vpdpbusd, EvexVnniUsable: exact for any codes), with ig_w
  // per panel of 16 output channels [tap][k-quad][16 channels][4 bytes] s8 weights; else
  // (ig_int16: full-range 8-bit activations, |W - w_zp| <= 511) the int16 kernel, with ig_w per
  // panel [tap][k-quad][4 vectors of 8 channels x 2 int16] (igemm_i16_6x16_avx2.cc's order).
  // ig_cinit[n] = bias[n] - zu * sum_k (W - w_zp)[n][k] (0 past O), the accumulators' start value.
  // ig_rows: the taps are kernel rows instead (few input channels, C % 4 != 0, dw == 1, e.g. an
  // RGB stem): tap ky reads the kw * C contiguous bytes of one kernel row of a zero-point padded
  // NHWC copy of the input ([H + 2 ph][W + 2 pw][C] per image, so no tap falls in the padding),
  // ig_cp = kw * C rounded up to 4 (zero weights past kw * C) and ig_taps = kh: K = kh x ig_cp
  // instead of kh x kw x (C rounded up to 4), e.g. 7 x 24 = 168 for a 7 x 7 x 3 stem, not 196,
  // and a row pointer per kernel row rather than per tap.
  bool igemm = false, ig_int16 = false, ig_rows = false;
  int64_t ig_cp = 0, ig_taps = 0, ig_panels = 0;
  AlignedVector<uint8_t> ig_w;
  std::vector<int32_t> ig_cinit;
  // ig_stage: the output stage prepared for the kernel's epilogue (IgemmStageKernel: staged
  // from registers, no int32 tile) when it is FIXED_SINGLE with shifts in [0, 31] and the
  // output I8/U8; channels padded to ig_panels * 16.
  StageF32 ig_stage;
  // ig_stage32: an I32 output's stage prepared the same way (IgemmStageTwinKernel: an
  // AVX-512 epilogue that writes a conv's I8/U8 output and its I32 twin from one set of
  // sums, e.g. a MobileNetV2 projection and the copy its next block's residual ADD reads)
  StageI32Reg ig_stage32;
  // ig_add: this conv's int32 stage and the fused ADD's (fused_add) prepared as one estimate
  // (StageAddRowsKernel), when the ADD's other input and output are 8-bit codes and the
  // conditions of requant/stage_add_f32.h hold (prepare.cc FuseResidualAdds)
  StageAddF32 ig_add;
  // Depthwise (groups == C, so each output channel reads one input plane; a depth
  // multiplier m = O / C >= 1) with int32-exact sums: DepthwiseConv runs it (conv_dw.cc).
  // dw_taps: [O][kh * kw] (W - w_zp); dw_pairs: [O][kh][(kw + 1) / 2] taps 2j (low half)
  // and 2j + 1 (high half, 0 past kw) as int16, the vpmaddwd operand.
  bool depthwise = false;
  std::vector<int32_t> dw_taps, dw_pairs;
  // NHWC depthwise (conv_dw_nhwc.cc, the DwNhwcKernel operands of qdsl/gemm.h), when O == C
  // and the fast stage applies (fast_stage: no overflow possible, I8/U8 output): dwn_taps
  // [kh * kw][DwNhwcCols(C)], dwn_pairs, and dwn_init [DwNhwcCols(C)] = bias - in_zp * (sum of
  // the channel's taps) mod 2^32 (the sums wrap; the total fits int32).  dwn_zrow: in_zp's
  // code repeated, what padded taps point at.  PrepareGraph clears dw_nhwc on twin convs
  // (prepare.cc KeepNhwcDepthwise); PlanNhwc and the executor read it.
  bool dw_nhwc = false;
  // dwn_stage: the output stage prepared for the kernel's registers (DwNhwcStageKernel), when
  // it is FIXED_SINGLE with right shifts in [0, 31]; channels padded to DwNhwcCols(C).
  StageF32 dwn_stage;
  std::vector<int32_t> dwn_taps, dwn_init;
  AlignedVector<int32_t> dwn_pairs;
  std::vector<uint8_t> dwn_zrow;
  // dwq: the dw_nhwc conv also runs on the vpmaddubsw kernel (DwNhwcQuadKernel) with the
  // register stage: U8 input, every W - w_zp in int8, and no weight pair sum times
  // in_max_code beyond int16 (MaddubsStepsFor >= 1: 7-bit activations with any int8 weights).
  // dwq_w / dwq_init: the DwNhwcQuadSteps layout of qdsl/gemm.h, channels padded to 32.
  bool dwq = false;
  AlignedVector<uint8_t> dwq_w;
  AlignedVector<int32_t> dwq_init;
  // Row-band fusion (conv_dw_nhwc.cc): on an NHWC depthwise conv, band_producer is the op just
  // before it, a 1x1 stride-1 implicit-GEMM conv whose output only this conv reads (found at
  // prepare time on every path: FindRowBands in prepare.cc); band_consumer on that conv points
  // back.  Where conv::RowBandFused holds, the depthwise conv computes the rows of that output
  // its bands read into a ring of rows and the 1x1 conv's own run does nothing.  -1: none.
  int32_t band_producer = -1, band_consumer = -1;
  int64_t kp = 0;
  int64_t kp64 = 0;                         // kp rounded up to 64: w8's row stride (aligned tile rows)
  bool int32_exact = true;                  // every GEMM sum provably fits int32
  bool fast_acc = false;                    // |sum + bias| < min(2^(acc_bits-1), 2^31): no overflow possible
  bool fast_stage = false;                  // fast_acc and an I8/U8 output
  int acc_bits = 32, overflow_mode = 0;
  bool bin_out = false;
  StageData out;
};

// The conv params of op, or nullptr when it is no conv-like op.
inline const ConvParams* AsConv(const GraphOp& op) {
  return IsConvLike(op.opcode) && op.prepared ? &ParamsOf<ConvParams>(op) : nullptr;
}
inline ConvParams* AsConv(GraphOp& op) {
  return IsConvLike(op.opcode) && op.prepared ? static_cast<ConvParams*>(op.prepared.get()) : nullptr;
}

namespace conv {

// A GEMM's activations: `rows` dense rows of `cols` I8/U8 codes (graph dtype `dtype`) with
// the op's input zero point and largest u8 code (ConvParams / ConvTransposeParams fields).
inline ActView Int8Rows(const void* data, int dtype, int64_t rows, int64_t cols, int32_t zero_point,
                        int32_t max_code) {
  ActView av;
  av.data = data;
  av.dtype = dtype == kU8 ? DType::kUInt8 : DType::kInt8;
  av.rows = rows;
  av.cols = cols;
  av.ld = cols;
  av.zero_point = zero_point;
  av.max_code = max_code;
  return av;
}

struct Geometry {
  int64_t n, C, H, W, O, OH, OW, cg, og, kdim;
};

// The run's geometry of op (batch `batch`).
Geometry Geo(const Graph* g, const GraphOp& op, int64_t batch);

// Whether RunConv runs this op (off the reference path) as one GEMM with the bias and the
// output stage fused (conv_exec.cc); the graph plan reports it.
bool LinearFusedGemm(const Graph* g, const GraphOp& op);

// Input position of tap (ky, kx) for output (oy, ox); false when it lies in the padding.
inline bool Tap(const ConvParams& p, const Geometry& e, int64_t oy, int64_t ox, int64_t ky, int64_t kx, int64_t* iy,
                int64_t* ix) {
  *iy = oy * p.sh - p.ph + ky * p.dh;
  *ix = ox * p.sw - p.pw + kx * p.dw;
  return *iy >= 0 && *iy < e.H && *ix >= 0 && *ix < e.W;
}

inline int64_t FinishAcc(int64_t s, const ConvParams& p, int64_t* overflow) {
  if (p.acc_bits >= 64) return s;  // the exact sum is an int64 (like the reference's)
  const int64_t half = int64_t{1} << (p.acc_bits - 1);
  if (s < -half || s >= half) {
    ++*overflow;
    if (p.overflow_mode == 1) return s < 0 ? -half : half - 1;
    const uint64_t mask = (uint64_t{1} << p.acc_bits) - 1;
    return static_cast<int64_t>((static_cast<uint64_t>(s) + static_cast<uint64_t>(half)) & mask) - half;
  }
  return s;
}

inline void Emit(int64_t s, const ConvParams& p, int64_t oc, uint8_t* y, bool wide, int64_t idx, int64_t* overflow) {
  if (!p.bias.empty()) s += p.bias[oc];
  s = FinishAcc(s, p, overflow);
  if (wide) {  // I32 output: the stage clamps to the int32 range
    const int32_t v = ApplyStage(s, p.out.stage, oc, p.acc_bits > 32);
    std::memcpy(y + 4 * idx, &v, 4);
  } else {
    y[idx] = static_cast<uint8_t>(p.bin_out ? (s < 0 ? -1 : 1) : ApplyStage(s, p.out.stage, oc, p.acc_bits > 32));
  }
}

// Valid output columns [lo, hi) for kernel column kx: 0 <= ox*sw - pw + kx*dw < W.
inline void ValidRange(const ConvParams& p, const Geometry& e, int64_t kx, int64_t* off, int64_t* lo, int64_t* hi) {
  *off = kx * p.dw - p.pw;
  int64_t l = *off >= 0 ? 0 : (-*off + p.sw - 1) / p.sw;
  int64_t h = (e.W - 1 - *off) < 0 ? 0 : (e.W - 1 - *off) / p.sw + 1;
  l = std::min(l, e.OW);
  *lo = l;
  *hi = std::min(std::max(h, l), e.OW);
}

// A task's images as padded (phase-split when strided) u8 code planes, and the offsets
// that address them: tap row k of output position t is base[tap[k] + pos(t)], with
// pos(t) = image * img + oy * Wq + ox.
struct PaddedImages {
  const uint8_t* base = nullptr;
  int64_t Wq = 0, img = 0;
  std::vector<int64_t> tap;  // [kp]: rows past kdim point at offset 0 (their weights are 0)
  // pos[t] for output positions t < nb * OH * OW, then 0 up to Pp (padding positions read
  // image 0's first taps: their products are dropped)
  std::vector<int64_t> pos;

  void FillPositions(int64_t nb, int64_t OH, int64_t OW, int64_t Pp) {
    pos.assign(static_cast<size_t>(Pp), 0);
    for (int64_t t = 0, bi = 0; bi < nb; ++bi)
      for (int64_t oy = 0; oy < OH; ++oy)
        for (int64_t ox = 0; ox < OW; ++ox, ++t) pos[t] = bi * img + oy * Wq + ox;
  }
};

// Rows of the weight strip starting at row o0 of `og`: the strips of at most kMaxRows are
// balanced (32 rows: 6, 6, 5, 5, 5, 5, not 6 x 5 + 2: the 2-row kernel reloads the panel
// for few multiplies and cost 6% of a ResNet's time for 6% of its MACs at 1.7x the cost).
inline int64_t StripRows(int64_t og, int64_t o0) {
  const int64_t strips = (og + kMaxRows - 1) / kMaxRows, base = og / strips, extra = og % strips;
  // the first `extra` strips have base + 1 rows
  return o0 < extra * (base + 1) ? base + 1 : base;
}

// rows [n*OH*OW][kdim] of group gi; out-of-bounds taps take `pad` (conv_im2col.cc).
void Im2col(const uint8_t* x, const ConvParams& p, const Geometry& e, int64_t gi, uint8_t pad, uint8_t* rows);
// Transposed u8 im2col of images [b0, b0 + nb), group gi, in the form that suits the shape.
void Im2colU8(const uint8_t* x, const ConvParams& p, const Geometry& e, int64_t b0, int64_t nb, int64_t gi,
              int xdtype, uint8_t pad, int64_t P, int64_t Pp, uint8_t* cols);
// The planes live in *storage, or (nullptr) in a thread-local buffer that the thread's
// next call reuses.
PaddedImages PadImagesU8(const uint8_t* x, const ConvParams& p, const Geometry& e, int64_t b0, int64_t nb, int64_t gi,
                         uint8_t flip, uint8_t pad, int64_t kp, std::vector<uint8_t>* storage = nullptr);
// conv_transpose.cc
void TransposeBytes(const uint8_t* in, int64_t ldi, int64_t R, int64_t S, uint8_t* out, int64_t ldo);
void TransposeI32(const int32_t* in, int64_t ldi, int64_t R, int64_t S, int32_t* out, int64_t ldo);
void ToPaddedNhwcRows(const uint8_t* x, bool x_nhwc, int64_t C, int64_t H, int64_t W, int64_t ph, int64_t pw,
                      int64_t Wp, int64_t r0, int64_t r1, uint8_t flip, uint8_t pad, uint8_t* xp);
// conv_amx.cc, conv_fast.cc, conv_dw.cc, conv_exec.cc
Status AmxConvImplicit(Graph* g, const GraphOp& op, int64_t batch, uint32_t path, AmxGatherKernel amx);
Status IgemmConv(Graph* g, const GraphOp& op, int64_t batch, uint32_t path, IgemmKernel kernel);
// False when QDSL_IGEMM=0 (read once): the gathered-panel conv runs instead (timing the two
// in one build; conv_igemm.cc).
bool IgemmEnabled();
// False when QDSL_REGISTER_STAGE=0 (read once): IgemmConv and DepthwiseConvNhwc store int32
// sums and stage them afterwards instead of staging from the kernels' registers (timing the
// two in one build).
bool RegisterStageEnabled();
// Whether the conv's chosen implementation on `path` reads and writes Graph::nhwc layouts
// (the AMX and AVX2 implicit-GEMM convs); RunConv picks by the same rules.
inline bool RunsNhwc(const ConvParams& p, uint32_t path) {
  if (p.spatial == 0) return false;
  if (p.amx_conv && p.fast_acc && SelectAmxGatherKernel(path) != nullptr) return true;
  return p.igemm && SelectIgemmKernel(path, p.ig_int16) != nullptr && IgemmEnabled();
}
// Whether IntConvFast (the gathered-panel conv) can write this conv's I8/U8 output NHWC
// (Graph::nhwc): the fast stage into a per-tile code block, transposed into NHWC positions.
// PlanNhwc asks for it only when every reader is a max pool that writes NHWC (a ResNet's RGB
// stem and its pool, which then runs on NHWC pixels without transposes), and never for a
// twin (the conv it twins writes its output).  Not on the AMX forms.
inline bool GatheredWritesNhwc(const ConvParams& p, uint32_t path) {
  return p.spatial == 2 && p.groups == 1 && p.fast_stage && !p.bin_out && !p.w16.empty() && !p.depthwise &&
         path != kPathRef && p.twins.empty() && p.fused_add < 0 && !RunsNhwc(p, path) &&
         !(p.amx_conv && SelectAmxGatherKernel(path) != nullptr) && (p.w8.empty() || SelectAmxKernel(path) == nullptr);
}
Status IntConvFast(Graph* g, const GraphOp& op, int64_t batch, uint32_t path, int64_t* overflow);
Status DepthwiseConv(Graph* g, const GraphOp& op, int64_t batch, uint32_t path, int64_t* overflow);
Status DepthwiseConvNhwc(Graph* g, const GraphOp& op, int64_t batch, uint32_t path);
// Whether the depthwise conv `dw` (ConvParams::band_producer >= 0) computes its producer's
// output rows itself on `path` with the current layouts (Graph::nhwc): the producer runs as
// IgemmConv would with its register stage, the depthwise conv as DepthwiseConvNhwc, and
// QDSL_ROW_BAND=0 is not set (read once).  The producer's RunConv is then a no-op.
bool RowBandFused(const Graph* g, const GraphOp& dw, uint32_t path);
Status RunConv(Graph* g, const GraphOp& op, int64_t batch, uint32_t path, int64_t* overflow);

}  // namespace conv

// The CONV1D/2D, LINEAR, BCONV1D/2D, BLINEAR table entries' functions (the entries are defined in conv_prepare.cc).
Status PrepareConv(Graph* g, GraphOp& op, int index, std::vector<int64_t>* shape);  // conv_prepare.cc
Status RunConvOp(RunCtx& c, const GraphOp& op);                                     // conv_exec.cc

}  // namespace qdsl

#endif  // QDSL_RUNTIME_OPS_CONV_H_
