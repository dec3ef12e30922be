// Internals shared by the graph validator (prepare.cc) and executor (executor.cc).
#ifndef QDSL_RUNTIME_OPS_H_
#define QDSL_RUNTIME_OPS_H_

#include <cstdint>
#include <vector>

#include "qdsl/gemm.h"
#include "qdsl/graph.h"

namespace qdsl {

enum OpCode : int {
  kQuantize = 1, kDequantize, kRequantize, kConv1d, kConv2d, kLinear, kBconv1d, kBconv2d, kBlinear,
  kAdd, kConcat, kClamp, kMaxpool1d, kMaxpool2d, kAvgpool1d, kAvgpool2d, kGlobalAvgpool, kReshape, kBinarize,
};

// A stage's arrays copied out of the attribute map (OutputStage points into them).
struct StageData {
  std::vector<int32_t> multiplier, shift;
  OutputStage stage;
  bool present = false;
};

// Checked, precomputed parameters of one op.
struct PreparedOp {
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
  // Residual ADD fused into this conv (AMX implicit path only): when the conv's I32 output
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
  int64_t kp = 0;
  int64_t kp64 = 0;                         // kp rounded up to 64: w8's row stride (aligned tile rows)
  bool int32_exact = true;                  // every GEMM sum provably fits int32
  bool fast_acc = false;                    // |sum + bias| < min(2^(acc_bits-1), 2^31): no overflow possible
  bool fast_stage = false;                  // fast_acc and an I8/U8 output
  int acc_bits = 32, overflow_mode = 0;
  bool bin_out = false;
  StageData out;
  // ADD / CONCAT per-input rescales (per tensor).
  std::vector<StageData> in;
};

// ADD (docs/qgraph.md §4.4) over elements [0, n) of flat inputs x0 (dtype d0), x1 (d1) into
// y: the path's vector kernel where it handles the parameters, else the exact scalar rule.
void AddRange(const GraphOp& add, const uint8_t* x0, int d0, const uint8_t* x1, int d1, int64_t n, uint8_t* y,
              bool y_signed, uint32_t path);

inline int64_t Numel(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

}  // namespace qdsl

#endif  // QDSL_RUNTIME_OPS_H_
