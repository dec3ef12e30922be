// IgemmConv: the AVX2 implicit-GEMM conv (ConvParams::igemm) on NHWC activation rows, with
// the output stage and a fused residual ADD (ConvParams::fused_add) in its epilogue.
//
// M = output positions, N = output channels, K = taps x C.  The kernel reads each output
// position's tap rows in place through a table of row pointers (a zero-point row for taps
// in the padding), so no activation panel is gathered: the rows are the NHWC image itself
// when the input tensor is stored NHWC (Graph::nhwc) with C a multiple of 4 and U8 codes,
// else a copy in that form (transposed from NCHW, padded to 4 channels, I8 flipped to u8
// codes).  The accumulators start at bias - z_u * rowsum (ConvParams::ig_cinit), so the
// epilogue is the output stage alone, per [positions][channels] tile while it is in L1/L2,
// written as NHWC rows, or transposed into NCHW planes when the output tensor is NCHW.
// Two kernel kinds run under this one driver (`kernel`), which differ only in their panels'
// and rows' element size: the vpmaddubsw kind on u8 rows (7-bit codes or small weights) and
// the int16 kind for full-range 8-bit codes (ConvParams::ig_int16, igemm_i16_6x16_avx2.cc) on
// the same rows widened to int16 once per conv.
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "runtime/ops/add.h"
#include "runtime/ops/conv.h"
#include "threads/thread_pool.h"

namespace qdsl {
namespace conv {
namespace {

// Part `part` of `parts` near-equal parts of [0, total).
void Part(int64_t total, int64_t parts, int64_t part, int64_t* b, int64_t* e) {
  *b = total * part / parts;
  *e = total * (part + 1) / parts;
}

// Positions per M block: about 60 (10 six-row strips; a 3x3 x 256-channel block's rows are
// ~140 KB, read once per 16-channel weight panel from L2), balanced over the image so the
// last strip of a 7 x 7 image is not a lone row.
int64_t BlockPositions(int64_t P) {
  const int64_t blocks = std::max<int64_t>(1, (P + 59) / 60);
  const int64_t per = (P + blocks - 1) / blocks;
  return (per + 5) / 6 * 6;
}

}  // namespace

bool RegisterStageEnabled() {
  static const bool on = [] {
    const char* v = std::getenv("QDSL_REGISTER_STAGE");
    return v == nullptr || !(v[0] == '0' && v[1] == '\0');
  }();
  return on;
}

bool IgemmEnabled() {
  static const bool on = [] {
    const char* v = std::getenv("QDSL_IGEMM");
    return v == nullptr || !(v[0] == '0' && v[1] == '\0');
  }();
  return on;
}

Status IgemmConv(Graph* g, const GraphOp& op, int64_t batch, uint32_t path, IgemmKernel kernel) {
  const ConvParams& p = ParamsOf<ConvParams>(op);
  const Geometry e = Geo(g, op, batch);
  const GraphTensor& xt = g->tensors[op.inputs[0]];
  const int out_dtype = g->tensors[op.outputs[0]].dtype;
  const bool in_nhwc = g->nhwc[op.inputs[0]] != 0, out_nhwc = g->nhwc[op.outputs[0]] != 0;
  const uint8_t* x = g->buffers[op.inputs[0]].data();
  uint8_t* y = g->buffers[op.outputs[0]].data();
  const int64_t P = e.OH * e.OW, HW = e.H * e.W, C = e.C, O = e.O, cp = p.ig_cp, taps = p.ig_taps;
  // a panel's k-quad: 16 channels x 4 s8 weights, or x 4 int16 for the int16 kernel kind
  const int64_t cquads = cp / 4, panel_bytes = taps * cquads * (p.ig_int16 ? 128 : 64);
  const uint8_t zu = static_cast<uint8_t>(p.in_zp + (xt.dtype == kI8 ? 128 : 0));
  const uint8_t flip = xt.dtype == kI8 ? 0x80 : 0;
  // Kernel rows as taps (ConvParams::ig_rows): the rows are a zero-point padded NHWC copy, C
  // bytes per pixel, and the image the row pointers address is the padded one (IH x IW, no
  // padding left); else pixels of cp bytes in the input's own H x W.
  const bool by_rows = p.ig_rows;
  const int64_t IH = by_rows ? e.H + 2 * p.ph : e.H, IW = by_rows ? e.W + 2 * p.pw : e.W;
  const int64_t ph = by_rows ? 0 : p.ph, pw = by_rows ? 0 : p.pw, px = by_rows ? C : cp, IHW = IH * IW;
  // (a kernel row's last quad reads up to 3 bytes past its kw * C: slack past the last image)
  const int64_t slack = by_rows ? 64 : 0;
  // the rows the kernel reads: the input itself, or an NHWC u8 copy with rows of cp bytes
  const uint8_t* rows = x;
  thread_local AlignedVector<uint8_t> copy;
  if (by_rows) {
    copy.resize(static_cast<size_t>(e.n * IHW * C + slack));
    uint8_t* const copied = copy.data();
    ParallelFor(static_cast<int>(e.n), [&](int b) {
      ToPaddedNhwcRows(x + b * C * HW, in_nhwc, C, e.H, e.W, p.ph, p.pw, IW, 0, IH, flip, zu, copied + b * IHW * C);
    }, /*work=*/e.n * IHW * C * 8);
    std::memset(copied + e.n * IHW * C, zu, static_cast<size_t>(slack));
    rows = copied;
  } else if (!in_nhwc || cp != C || flip != 0) {
    copy.resize(static_cast<size_t>(e.n * HW * cp));
    uint8_t* const copied = copy.data();  // (a thread_local named in the lambda would be each worker's own)
    ParallelFor(static_cast<int>(e.n), [&](int b) {
      uint8_t* dst = copied + b * HW * cp;
      if (in_nhwc) {
        for (int64_t i = 0; i < HW; ++i) std::memcpy(dst + i * cp, x + (b * HW + i) * C, static_cast<size_t>(C));
      } else {
        TransposeBytes(x + b * C * HW, HW, C, HW, dst, cp);
      }
      if (cp != C)
        for (int64_t i = 0; i < HW; ++i) std::memset(dst + i * cp + C, zu, static_cast<size_t>(cp - C));
      if (flip != 0)
        for (int64_t i = 0; i < HW * cp; ++i) dst[i] ^= flip;
    }, /*work=*/e.n * HW * cp * 8);
    rows = copied;
  }
  // the int16 kind reads int16 rows: the u8 rows widened once per conv here (widening in the
  // kernel's loads repeats it for every 16-channel panel; igemm_i16_6x16_avx2.cc)
  const int64_t esize = p.ig_int16 ? 2 : 1, row_bytes = px * esize, img_elems = IHW * px;
  std::vector<uint8_t> zero_row(static_cast<size_t>(cp * esize), zu);  // taps in the padding
  if (p.ig_int16) {
    thread_local AlignedVector<int16_t> wide;
    wide.resize(static_cast<size_t>(e.n * img_elems + slack));
    int16_t* const widened = wide.data();
    const uint8_t* const narrow = rows;
    ParallelFor(static_cast<int>(e.n), [&](int b) {
      for (int64_t i = b * img_elems; i < (b + 1) * img_elems; ++i) widened[i] = narrow[i];
    }, /*work=*/e.n * img_elems * 4);
    for (int64_t i = e.n * img_elems; i < e.n * img_elems + slack; ++i) widened[i] = zu;
    rows = reinterpret_cast<const uint8_t*>(widened);
    const int16_t z16 = zu;
    for (int64_t c = 0; c < cp; ++c) std::memcpy(zero_row.data() + 2 * c, &z16, 2);
  }
  const uint8_t* zrow = zero_row.data();

  // fused residual ADD (ConvParams::fused_add; I32 output): computed here, skipped by the
  // executor.  The ADD's tensors share the conv output's layout (PlanNhwc keeps an ADD's
  // tensors in one layout), so it runs on the same element offsets.
  const GraphOp* add = (p.fused_add >= 0 && out_dtype == kI32) ? &g->ops[p.fused_add] : nullptr;
  const AddParams* add_p = add != nullptr ? &ParamsOf<AddParams>(*add) : nullptr;
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
  // conv value v (I32, at vb) + the ADD's other input at element `at`, n elements
  auto add_run = [&](const int32_t* v, int64_t at, int64_t n) {
    const uint8_t* vb = reinterpret_cast<const uint8_t*>(v);
    const uint8_t* ob = add_other + at * add_other_size;
    AddRange(*add_p, p.fused_slot == 0 ? vb : ob, p.fused_slot == 0 ? kI32 : add_other_dtype,
             p.fused_slot == 0 ? ob : vb, p.fused_slot == 0 ? add_other_dtype : kI32, n, add_y + at, add_signed, path);
  };

  // this op's output, then each twin conv's (ConvParams::twins: the same inputs, weights and
  // bias, another output stage) from the same accumulators; the executor skips the twins.
  // A twin that takes a residual ADD runs itself (the ADD's other input may come later).
  struct Out {
    const StageData* sd;
    int dtype;
    bool nhwc;
    uint8_t* y;
    const ConvParams* cp;  // the conv whose output it is (this op or a twin)
  };
  std::vector<Out> outs{{&p.out, out_dtype, out_nhwc, y, &p}};
  for (int32_t j : p.twins) {
    const GraphOp& tw = g->ops[j];
    const ConvParams& tp = ParamsOf<ConvParams>(tw);
    if (!tp.igemm || tp.fused_add >= 0) continue;
    outs.push_back({&tp.out, g->tensors[tw.outputs[0]].dtype, g->nhwc[tw.outputs[0]] != 0,
                    g->buffers[tw.outputs[0]].data(), &tp});
    g->fused_done[j] = 1;
  }
  // the stage from registers (IgemmStageKernel): one output, stored NHWC as codes, with a
  // stage prepared for it (ConvParams::ig_stage); else int32 tiles and the stage after them
  const IgemmStageKernel stage_kernel = RegisterStageEnabled() ? SelectIgemmStageKernel(path) : nullptr;
  const bool from_regs = stage_kernel != nullptr && !p.ig_int16 && p.ig_stage.ok && outs.size() == 1 && out_nhwc &&
                         (out_dtype == kU8 || out_dtype == kI8);
  // two outputs from registers (IgemmStageTwinKernel, AVX-512): one I8/U8 with ig_stage and
  // one I32 with ig_stage32 (not this op's own I32 output when it takes the fused ADD), both
  // NHWC: a projection's codes and the I32 twin the next residual ADD reads
  const IgemmStageTwinKernel twin_kernel =
      RegisterStageEnabled() && outs.size() == 2 && !p.ig_int16 ? SelectIgemmStageTwinKernel(path) : nullptr;
  const Out* twin_codes = nullptr;
  const Out* twin_wide = nullptr;
  if (twin_kernel != nullptr && outs[0].nhwc && outs[1].nhwc) {
    for (const Out& o : outs) {
      if ((o.dtype == kU8 || o.dtype == kI8) && o.cp->ig_stage.ok) twin_codes = &o;
      if (o.dtype == kI32 && o.cp->ig_stage32.ok && !(o.sd == &p.out && add != nullptr)) twin_wide = &o;
    }
  }
  const bool twin_regs = twin_codes != nullptr && twin_wide != nullptr;
  // this op's I32 output into the fused ADD's codes from registers (IgemmStageAddKernel,
  // AVX-512; ig_add prepared, the ADD's tensors NHWC, no other output)
  const IgemmStageAddKernel add_kernel =
      add != nullptr && out_nhwc && p.ig_add.ok && outs.size() == 1 && !p.ig_int16 && RegisterStageEnabled() &&
              p.ig_taps * p.ig_cp <= 512
          ? SelectIgemmStageAddKernel(path)
          : nullptr;
  const RequantKernel requant = SelectRequantKernel(path);
  const StageI32RowsKernel stage_rows = SelectStageI32RowsKernel(path);
  // the fused ADD's codes straight from the int32 tile (ig_add: the conv's stage and the ADD
  // as one estimate) when the ADD's tensors are NHWC like the tile's rows
  const StageAddRowsKernel stage_add =
      add != nullptr && out_nhwc && p.ig_add.ok && RegisterStageEnabled() ? SelectStageAddRowsKernel(path) : nullptr;
  const int64_t bsz = BlockPositions(P), blocks = (P + bsz - 1) / bsz;
  const int64_t work = e.n * P * O * (taps * cp + 64 * static_cast<int64_t>(outs.size()));
  const int threads = ThreadsFor(work);
  // Tasks: (image, M block) x N parts.  N is split only when the M blocks alone do not give
  // each thread kClaimsPerThread tasks (14 x 14 and 7 x 7 images at batch 1); each N part
  // re-reads its block's rows.
  int64_t nparts = 1;
  const int64_t want = int64_t{kClaimsPerThread} * threads;
  if (threads > 1 && e.n * blocks < want)
    nparts = std::min<int64_t>(p.ig_panels, (want + e.n * blocks - 1) / (e.n * blocks));
  const int64_t tasks = e.n * blocks * nparts;
  // each tap's row offset from the first tap's row, and the taps' reach past the first
  // (for the row pointer tables below)
  // (kernel rows: one tap per ky, starting at the row's first column)
  const int64_t tkw = by_rows ? 1 : p.kw;
  std::vector<int64_t> tap_off(static_cast<size_t>(taps));
  for (int64_t ky = 0; ky < p.kh; ++ky)
    for (int64_t kx = 0; kx < tkw; ++kx) tap_off[ky * tkw + kx] = (ky * p.dh * IW + kx * p.dw) * row_bytes;
  const int64_t span_y = (p.kh - 1) * p.dh, span_x = (tkw - 1) * p.dw;
  ParallelFor(static_cast<int>(tasks), [&](int t) {
    const int64_t part = t % nparts, bb = t / nparts, b = bb / blocks, blk = bb % blocks;
    const int64_t p0 = blk * bsz, p1 = std::min(P, p0 + bsz), m = p1 - p0;
    int64_t n0 = 0, n1 = 0;
    Part(p.ig_panels, nparts, part, &n0, &n1);
    if (n1 <= n0) return;
    // row pointers [position][tap], built per block here rather than once at prepare time:
    // the rows live in this run's buffers.  A position whose taps all fall inside the image
    // (all but the border ones) takes its first tap's row plus the fixed tap offsets; only
    // border positions test each tap.  (Per tap bounds tests and a division per position
    // were 2 % of ResNet-18's run: ~30 cycles per position against the ~1100 of its 3x3 x
    // 64-channel kernel steps per 16-channel panel.)
    thread_local std::vector<const uint8_t*> ind;
    ind.resize(static_cast<size_t>(m * taps));
    const uint8_t* img = rows + b * IHW * row_bytes;
    int64_t oy = p0 / e.OW, ox = p0 % e.OW;
    for (int64_t i = 0; i < m; ++i) {
      const uint8_t** r = ind.data() + i * taps;
      const int64_t iy0 = oy * p.sh - ph, ix0 = ox * p.sw - pw;
      if (iy0 >= 0 && iy0 + span_y < IH && ix0 >= 0 && ix0 + span_x < IW) {  // (always, for kernel rows)
        const uint8_t* first_row = img + (iy0 * IW + ix0) * row_bytes;
        for (int64_t t = 0; t < taps; ++t) r[t] = first_row + tap_off[t];
      } else {
        for (int64_t ky = 0; ky < p.kh; ++ky) {
          const int64_t iy = iy0 + ky * p.dh;
          for (int64_t kx = 0; kx < p.kw; ++kx) {
            const int64_t ix = ix0 + kx * p.dw;
            r[ky * p.kw + kx] = (iy >= 0 && iy < IH && ix >= 0 && ix < IW) ? img + (iy * IW + ix) * row_bytes : zrow;
          }
        }
      }
      if (++ox == e.OW) ox = 0, ++oy;
    }
    const int64_t first = b * P + p0;  // NHWC: the block's first position
    if (twin_regs) {
      const StageF32& st = twin_codes->cp->ig_stage;
      const StageI32Reg& s32 = twin_wide->cp->ig_stage32;
      const bool out_signed = twin_codes->dtype == kI8;
      int32_t* y32 = reinterpret_cast<int32_t*>(twin_wide->y);
      for (int64_t np = n0; np < n1; ++np) {
        const uint8_t* w = p.ig_w.data() + np * panel_bytes;
        const int64_t c0 = np * 16;
        const int cols = static_cast<int>(std::min<int64_t>(16, O - c0));
        for (int64_t s = 0; s < m; s += 6)
          twin_kernel(static_cast<int>(std::min<int64_t>(6, m - s)), ind.data() + s * taps, taps, cquads, w,
                      p.ig_cinit.data() + c0, st, c0, cols, twin_codes->y + (first + s) * O + c0, O, out_signed, s32,
                      y32 + (first + s) * O + c0, O);
      }
      return;
    }
    if (add_kernel != nullptr) {
      for (int64_t np = n0; np < n1; ++np) {
        const uint8_t* w = p.ig_w.data() + np * panel_bytes;
        const int64_t c0 = np * 16;
        const int cols = static_cast<int>(std::min<int64_t>(16, O - c0));
        for (int64_t s = 0; s < m; s += 6)
          add_kernel(static_cast<int>(std::min<int64_t>(6, m - s)), ind.data() + s * taps, taps, cquads, w,
                     p.ig_cinit.data() + c0, p.ig_add, c0, cols, add_other + ((first + s) * O + c0) * add_other_size,
                     O, add_y + (first + s) * O + c0, O);
      }
      return;
    }
    if (from_regs) {
      for (int64_t np = n0; np < n1; ++np) {
        const uint8_t* w = p.ig_w.data() + np * panel_bytes;
        const int64_t c0 = np * 16;
        const int cols = static_cast<int>(std::min<int64_t>(16, O - c0));
        for (int64_t s = 0; s < m; s += 6)
          stage_kernel(static_cast<int>(std::min<int64_t>(6, m - s)), ind.data() + s * taps, taps, cquads, w,
                       p.ig_cinit.data() + c0, p.ig_stage, c0, cols, y + (first + s) * O + c0, O, out_dtype == kI8);
      }
      return;
    }
    const int64_t ld = (n1 - n0) * 16, c0 = n0 * 16, cols = std::min(O, n1 * 16) - c0;
    thread_local AlignedVector<int32_t> acc;
    if (acc.size() < static_cast<size_t>(m * ld)) acc.resize(static_cast<size_t>(m * ld));
    // weight panel outer: it stays in L1/L2 while the block's strips run over it; each call
    // covers all of K, so its sums start at the panel's start values (no copy into acc)
    for (int64_t np = n0; np < n1; ++np) {
      const uint8_t* w = p.ig_w.data() + np * panel_bytes;
      const int32_t* init = p.ig_cinit.data() + np * 16;
      for (int64_t s = 0; s < m; s += 6)
        kernel(static_cast<int>(std::min<int64_t>(6, m - s)), ind.data() + s * taps, taps, cquads, w,
               acc.data() + s * ld + (np - n0) * 16, ld, init);
    }
    for (const Out& o : outs) {
      if (o.dtype != kI32) {
        const bool out_signed = o.dtype == kI8;
        if (o.nhwc) {
          requant(acc.data(), m, cols, ld, o.sd->stage, c0, o.y + first * O + c0, O, out_signed);
        } else {
          thread_local std::vector<uint8_t> tile;
          tile.resize(static_cast<size_t>(m * cols));
          requant(acc.data(), m, cols, ld, o.sd->stage, c0, tile.data(), cols, out_signed);
          TransposeBytes(tile.data(), cols, m, cols, o.y + (b * O + c0) * P + p0, P);
        }
        continue;
      }
      const bool fused = o.sd == &p.out && add != nullptr;  // (only this op's own output)
      int32_t* y32 = reinterpret_cast<int32_t*>(o.y);
      if (!fused && o.nhwc) {
        stage_rows(acc.data(), m, cols, ld, o.sd->stage, c0, y32 + first * O + c0, O);
        continue;
      }
      if (fused && stage_add != nullptr) {  // (o.nhwc: stage_add needs out_nhwc)
        stage_add(acc.data(), m, cols, ld, p.ig_add, c0, add_other + (first * O + c0) * add_other_size, O,
                  add_y + first * O + c0, O);
        continue;
      }
      thread_local AlignedVector<int32_t> tile32, planes;
      tile32.resize(static_cast<size_t>(m * cols));
      stage_rows(acc.data(), m, cols, ld, o.sd->stage, c0, tile32.data(), cols);
      if (!fused) {
        TransposeI32(tile32.data(), cols, m, cols, y32 + (b * O + c0) * P + p0, P);
      } else if (o.nhwc) {  // the conv's I32 values go straight into the ADD (never stored)
        if (cols == O) {
          add_run(tile32.data(), first * O, m * O);
        } else {
          for (int64_t i = 0; i < m; ++i) add_run(tile32.data() + i * cols, (first + i) * O + c0, cols);
        }
      } else {
        planes.resize(static_cast<size_t>(m * cols));
        TransposeI32(tile32.data(), cols, m, cols, planes.data(), m);
        for (int64_t c = 0; c < cols; ++c) add_run(planes.data() + c * m, (b * O + c0 + c) * P + p0, m);
      }
    }
  }, /*work=*/work);
  return Status::Ok();
}

}  // namespace conv
}  // namespace qdsl
