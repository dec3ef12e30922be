// The AMX implicit-GEMM conv (ConvParams::amx_conv), with the residual ADD it may compute
// in its epilogue (ConvParams::fused_add).
#include <algorithm>

#include "runtime/ops/add.h"
#include "runtime/ops/conv.h"
#include "threads/thread_pool.h"

namespace qdsl {
namespace conv {

// AMX implicit-GEMM conv (ConvParams::amx_conv; needs fast_acc: no overflow possible, an
// I8/U8/I32 output).  A task takes a block of output rows of one image (the whole image
// when the batch feeds the threads), copies the padded input rows it needs to a
// thread-local NHWC buffer (so its tiles read data in its own core's cache: sharing one
// buffer between cores cost more in cache-line transfers than it saved), and runs row
// tiles of 16 positions along an output row over it in place (A rows sw * C bytes apart).
// C starts at bias - z_u * rowsum per output channel; the requantized [positions]
// [channels] block is transposed into the NCHW output.
Status AmxConvImplicit(Graph* g, const GraphOp& op, int64_t batch, uint32_t path, AmxGatherKernel amx) {
  const ConvParams& p = ParamsOf<ConvParams>(op);
  const Geometry e = Geo(g, op, batch);
  const GraphTensor& xt = g->tensors[op.inputs[0]];
  const bool out_signed = g->tensors[op.outputs[0]].dtype == kI8;
  const bool out_i32 = g->tensors[op.outputs[0]].dtype == kI32;
  const StageI32RowsKernel stage_rows = SelectStageI32RowsKernel(path);
  // fused residual ADD (ConvParams::fused_add): computed here, skipped by the executor
  const GraphOp* add = (p.fused_add >= 0 && out_i32) ? &g->ops[p.fused_add] : nullptr;
  const uint8_t* add_other = nullptr;
  uint8_t* add_y = nullptr;
  int add_other_dtype = 0;
  int64_t add_other_size = 1;
  bool add_signed = false;
  if (add != nullptr) {
    const uint32_t other = add->inputs[1 - p.fused_slot];
    add_other = g->buffers[other].data();
    add_other_dtype = g->tensors[other].dtype;
    add_other_size = add_other_dtype == kI32 ? 4 : 1;
    add_y = g->buffers[add->outputs[0]].data();
    add_signed = g->tensors[add->outputs[0]].dtype == kI8;
    g->fused_done[p.fused_add] = 1;
  }
  const uint8_t* x = g->buffers[op.inputs[0]].data();
  uint8_t* y = g->buffers[op.outputs[0]].data();
  const bool in_nhwc = g->nhwc[op.inputs[0]] != 0, out_nhwc = g->nhwc[op.outputs[0]] != 0;
  const int64_t C = e.C, Wp = p.amx_wp;
  const int32_t zu = p.in_zp + (xt.dtype == kI8 ? 128 : 0);
  const uint8_t flip = xt.dtype == kI8 ? 0x80 : 0;
  thread_local AlignedVector<int32_t> cinit;
  const int64_t ncols = p.amx_panels * 16;
  cinit.resize(static_cast<size_t>(ncols));
  for (int64_t oc = 0; oc < ncols; ++oc) {
    uint32_t v = 0;
    if (oc < e.O)
      v = (p.bias.empty() ? 0u : static_cast<uint32_t>(p.bias[oc])) -
          static_cast<uint32_t>(zu) * static_cast<uint32_t>(p.rowsum[oc]);
    cinit[oc] = static_cast<int32_t>(v);
  }
  const int32_t* ci = cinit.data();
  const int64_t tr = (e.OW + 15) / 16;  // row tiles per output row
  const int threads = ThreadsFor(e.n * e.OH * e.OW * p.cout * (p.kp + 64));
  const int64_t per_image = e.n >= 2 * threads ? 1 : std::min<int64_t>(e.OH, (2 * threads + e.n - 1) / e.n);
  const int64_t block_rows = (e.OH + per_image - 1) / per_image;
  const int64_t blocks = (e.OH + block_rows - 1) / block_rows;
  const int64_t sub_rows = std::max<int64_t>(1, std::min<int64_t>(block_rows, 16 / tr));  // <= 16 row tiles at once
  const RequantKernel requant = SelectRequantKernel(path);
  const int64_t P = e.OH * e.OW;
  ParallelFor(static_cast<int>(e.n * blocks), [&](int t) {
    const int64_t b = t / blocks, by0 = (t % blocks) * block_rows, by1 = std::min(e.OH, by0 + block_rows);
    // padded input rows this block reads
    const int64_t pr0 = by0 * p.sh, pr1 = (by1 - 1) * p.sh + (p.kh - 1) * p.dh + 1;
    thread_local AlignedVector<uint8_t> xp;
    // tiles read up to 15 positions past a row's end and 63 bytes past a segment's end
    xp.resize(static_cast<size_t>((pr1 - pr0) * Wp * C + (16 * p.sw + Wp) * C + 1024));
    ToPaddedNhwcRows(x + b * C * e.H * e.W, in_nhwc, C, e.H, e.W, p.ph, p.pw, Wp, pr0, pr1, flip,
                     static_cast<uint8_t>(zu), xp.data());
    for (int64_t oy0 = by0; oy0 < by1; oy0 += sub_rows) {
      const int64_t oy1 = std::min(by1, oy0 + sub_rows);
      const int64_t mtiles = (oy1 - oy0) * tr;
      thread_local std::vector<int64_t> aoff;
      thread_local AlignedVector<int32_t> acc;
      thread_local std::vector<uint8_t> out8;
      aoff.resize(static_cast<size_t>(mtiles));
      for (int64_t i = 0; i < mtiles; ++i) {
        const int64_t oy = oy0 + i / tr, ox0 = (i % tr) * 16;
        aoff[i] = ((oy * p.sh - pr0) * Wp + ox0 * p.sw) * C;
      }
      acc.resize(static_cast<size_t>(mtiles * 16 * ncols));
      amx(xp.data(), p.sw * C, aoff.data(), p.amx_koff.data(), mtiles, p.amx_w.data(), p.amx_kblocks * 1024,
          p.amx_panels, p.amx_kblocks, acc.data(), ncols, AmxInit::kCols, ci);
      const int64_t rows = mtiles * 16;
      // Stage [positions][channels] into NCHW plane order (the valid rows of each tile,
      // back to back: output positions oy0 * OW ...), then one transpose straight into the
      // output planes.  With whole-row tiles that is a single call over all rows.
      const int64_t npos = (oy1 - oy0) * e.OW;
      const bool whole = e.OW == tr * 16;
      const int64_t first = b * P + oy0 * e.OW;  // NHWC: the block's first position
      if (out_i32) {
        thread_local AlignedVector<int32_t> staged, planes32;
        // NHWC without a fused ADD: staged straight into the output
        int32_t* dst = (out_nhwc && add == nullptr) ? reinterpret_cast<int32_t*>(y) + first * e.O
                                                    : (staged.resize(static_cast<size_t>(npos * e.O)), staged.data());
        if (whole) {
          stage_rows(acc.data(), rows, e.O, ncols, p.out.stage, 0, dst, e.O);
        } else {
          for (int64_t i = 0; i < mtiles; ++i) {
            const int64_t ox0 = (i % tr) * 16, pos = (i / tr) * e.OW + ox0;
            stage_rows(acc.data() + i * 16 * ncols, std::min<int64_t>(16, e.OW - ox0), e.O, ncols, p.out.stage, 0,
                       dst + pos * e.O, e.O);
          }
        }
        if (add == nullptr) {
          if (!out_nhwc)
            TransposeI32(staged.data(), e.O, npos, e.O, reinterpret_cast<int32_t*>(y) + b * e.O * P + oy0 * e.OW, P);
          continue;
        }
        const uint8_t* mine = reinterpret_cast<const uint8_t*>(dst);
        if (out_nhwc) {  // the ADD's tensors are NHWC too (PlanNhwc): one elementwise run
          const uint8_t* theirs = add_other + first * e.O * add_other_size;
          if (p.fused_slot == 0) {
            AddRange(ParamsOf<AddParams>(*add), mine, kI32, theirs, add_other_dtype, npos * e.O, add_y + first * e.O, add_signed, path);
          } else {
            AddRange(ParamsOf<AddParams>(*add), theirs, add_other_dtype, mine, kI32, npos * e.O, add_y + first * e.O, add_signed, path);
          }
          continue;
        }
        // fused residual ADD: this block's I32 planes against the other input, straight to
        // the ADD's output (same NCHW offsets: the ADD is elementwise on equal shapes)
        planes32.resize(static_cast<size_t>(e.O * npos));
        TransposeI32(staged.data(), e.O, npos, e.O, planes32.data(), npos);
        for (int64_t oc = 0; oc < e.O; ++oc) {
          const int64_t off = (b * e.O + oc) * P + oy0 * e.OW;
          const uint8_t* plane = reinterpret_cast<const uint8_t*>(planes32.data() + oc * npos);
          const uint8_t* theirs = add_other + off * add_other_size;
          if (p.fused_slot == 0) {
            AddRange(ParamsOf<AddParams>(*add), plane, kI32, theirs, add_other_dtype, npos, add_y + off, add_signed, path);
          } else {
            AddRange(ParamsOf<AddParams>(*add), theirs, add_other_dtype, plane, kI32, npos, add_y + off, add_signed, path);
          }
        }
        continue;
      }
      uint8_t* dst8 = out_nhwc ? y + first * e.O : (out8.resize(static_cast<size_t>(npos * e.O)), out8.data());
      if (whole) {
        requant(acc.data(), rows, e.O, ncols, p.out.stage, 0, dst8, e.O, out_signed);
      } else {
        for (int64_t i = 0; i < mtiles; ++i) {
          const int64_t ox0 = (i % tr) * 16, pos = (i / tr) * e.OW + ox0;
          requant(acc.data() + i * 16 * ncols, std::min<int64_t>(16, e.OW - ox0), e.O, ncols, p.out.stage, 0,
                  dst8 + pos * e.O, e.O, out_signed);
        }
      }
      if (!out_nhwc) TransposeBytes(out8.data(), e.O, npos, e.O, y + b * e.O * P + oy0 * e.OW, P);
    }
  }, /*work=*/e.n * P * p.cout * (p.kp + 64));  // + the output stage and transposes per output
  return Status::Ok();
}

}  // namespace conv
}  // namespace qdsl
